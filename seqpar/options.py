"""Names of plan options that the schema and the runtime both read, stated once and dependency-free.

The schema builds its ``Literal`` types from these tuples; the runtime maps each name to what applies it
(``seqpar.runtime.activation_checkpoint.POLICIES`` for checkpointing). Modes have their own table (seqpar.modes).
"""

from __future__ import annotations

CHECKPOINTING: tuple[str, ...] = ("none", "full", "offload", "selective")

# Training checkpoints kept by default (--keep-last): the newest and the one before it, so a damaged newest still
# leaves one to resume from. The CLI's help and the trainer read it.
KEEP_LAST = 2

__all__ = ["CHECKPOINTING", "KEEP_LAST"]
