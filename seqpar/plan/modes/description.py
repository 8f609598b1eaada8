"""What a mode is to the rest of seqpar: one frozen description, each field a choice from a small vocabulary that the
layer reading it knows how to act on.

| field   | read by                                                  | vocabulary                                            |
|---------|----------------------------------------------------------|-------------------------------------------------------|
| layout  | runtime.parallel.layout (shard, unshard), split multiple | whole, zigzag, contiguous, zigzag+contiguous          |
| degrees | the plan's degrees, the head split, the advisor's search | none, sequence, heads, hybrid                         |
| comm    | advisor.cost memory / throughput / evaluate terms        | ring_kv, heads_all_to_all, peer_blocks, all_gather_kv |
| balance | runtime.parallel.balance (rank_work), dense imbalance    | even, zigzag, contiguous, lightseq                    |

degrees: ``none`` keeps whole sequences (sp_degree 1, degrees (1, 1)); ``sequence`` splits the sequence over all W
ranks (W, 1); ``heads`` trades the sequence split for a head split over all W ranks (1, W); ``hybrid`` does both, a
head split over U consecutive ranks inside W (W/U, U), and takes the plan's ulysses_degree.
comm (the cost model's shape of the mode's communication, per layer and pass): ``ring_kv`` K,V blocks passed round a
ring of the sequence-split ranks, overlapping compute; ``heads_all_to_all`` q, k, v and out through all-to-alls of the
head split; ``peer_blocks`` LightSeq's helper steps (Q,K,V out to a peer, O,lse back); ``all_gather_kv`` every rank
gathers every other rank's K,V (and reduce-scatters their gradients), the whole sequence's K,V held while attention runs.
balance (who does how much causal work): ``even`` every rank the same (whole sequences, or the whole sequence on 1/W of
the heads); ``zigzag`` chunks r and 2R-1-r; ``contiguous`` chunk r's queries against every earlier key (the last rank
does most: (2W-1)/W of the mean); ``lightseq`` LightSeq's balanced schedule over contiguous chunks.
Dependency-free (no pydantic, no torch), like the rest of seqpar.plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from seqpar.plan.errors import SeqparError

LAYOUTS = ("whole", "zigzag", "contiguous", "zigzag+contiguous")
DEGREES = ("none", "sequence", "heads", "hybrid")
COMM = ("ring_kv", "heads_all_to_all", "peer_blocks", "all_gather_kv")
BALANCES = ("even", "zigzag", "contiguous", "lightseq")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class ModeDescription:
    """Everything seqpar asks of one mode; ``seqpar.plan.modes.register`` makes it a mode every layer accepts."""

    name: str  # the plan's strategy.mode
    implementation: str  # transformers attn_implementation name (never "flash": transformers 5 reads that as a hub kernel)
    runtime: (
        str  # dotted module the runtime imports on first use: forward, backward, <name>_attention (runtime.parallel.attention)
    )
    layout: str  # LAYOUTS: which part of the sequence each rank holds
    degrees: str  # DEGREES: how the sp_degree ranks split the sequence and the heads
    comm: tuple[str, ...]  # COMM: the communication the cost model prices (empty: none)
    balance: str  # BALANCES: each rank's share of the causal work
    summary: str  # one line for people
    packed_imbalance: str | None = None  # the measured packed-window imbalance it follows (advisor.cost.packed); None: even
    needs_checkpointing: bool = False  # its schedule is only run under gradient checkpointing (the search keeps it there)
    # per export target (seqpar.emit's tools), the modes the tool runs for this one, nearest first: (name,) where the tool
    # runs it itself; a tool missing here does not run it, and `seqpar advise --emit` says so
    exports: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        def bad(what: str, value, allowed) -> SeqparError:
            return SeqparError(f"mode {self.name!r}: {what} {value!r} is not one of {', '.join(allowed)}")

        if not _NAME.match(self.name):
            raise SeqparError(f"mode name {self.name!r} must be lower-case letters, digits and _ (a plan field's value)")
        if "flash" in self.implementation or not _NAME.match(self.implementation):
            raise SeqparError(
                f"mode {self.name!r}: implementation {self.implementation!r} must be a plain name without 'flash' "
                "(transformers 5 reads 'flash' as a hub kernel)"
            )
        for what, value, allowed in (("layout", self.layout, LAYOUTS), ("degrees", self.degrees, DEGREES)):
            if value not in allowed:
                raise bad(what, value, allowed)
        if self.balance not in BALANCES:
            raise bad("balance", self.balance, BALANCES)
        for c in self.comm:
            if c not in COMM:
                raise bad("comm", c, COMM)
        if (self.degrees == "none") != (self.layout == "whole"):
            raise SeqparError(
                f"mode {self.name!r}: degrees 'none' and layout 'whole' go together (whole sequences on every rank)"
            )
        if (self.degrees == "hybrid") != (self.layout == "zigzag+contiguous"):
            raise SeqparError(f"mode {self.name!r}: degrees 'hybrid' and layout 'zigzag+contiguous' go together")
        if self.splits_heads != ("heads_all_to_all" in self.comm):
            raise SeqparError(
                f"mode {self.name!r}: a head split (degrees {self.degrees}) moves heads by all-to-all and only then"
            )
        object.__setattr__(self, "comm", tuple(self.comm))
        object.__setattr__(self, "exports", {tool: tuple(runs) for tool, runs in dict(self.exports).items()})

    @property
    def splits_sequence(self) -> bool:
        """Whether sp_degree ranks share one sequence (False: every rank holds whole sequences, sp_degree 1)."""
        return self.degrees != "none"

    @property
    def splits_heads(self) -> bool:
        """An all-to-all head split over the group (heads) or over its Ulysses part (hybrid)."""
        return self.degrees in ("heads", "hybrid")

    @property
    def takes_ulysses_degree(self) -> bool:
        """The plan's ulysses_degree (and ring_degree) apply: a head split over part of the group."""
        return self.degrees == "hybrid"

    @property
    def rotates_kv(self) -> bool:
        """K,V blocks travel between ranks while attention runs (ring, LightSeq's peers)."""
        return bool({"ring_kv", "peer_blocks"} & set(self.comm))


__all__ = ["BALANCES", "COMM", "DEGREES", "LAYOUTS", "ModeDescription"]
