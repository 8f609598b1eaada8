"""The one error type of seqpar: invalid input, said in one line that names the value, the rule and a fix.

Needs nothing (no pydantic, no torch), so every layer raises it directly: the schema, the advisor, the runtime on a GPU
image without pydantic, and the trainer on every rank. The CLI maps it to exit code 2.

TrainingStopped is the other known outcome: a run that stopped for a named reason (a non-finite loss, a full disk),
said in one line without a traceback; the trainer exits 1 with it, as for any failure it can explain.
"""

from __future__ import annotations


class SeqparError(ValueError):
    """Invalid input: one line that names the value, the rule and a fix (the CLI maps it to exit code 2)."""


class TrainingStopped(RuntimeError):
    """A run stopped for a reason it can name (non-finite loss or gradient norm, full disk): one line, exit code 1."""


__all__ = ["SeqparError", "TrainingStopped"]
