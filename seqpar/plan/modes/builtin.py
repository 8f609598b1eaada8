"""The five built-in modes (EasyContext's names), registered like any other mode.

| mode               | layout of rank r of W                                   | split multiple | degrees (ring, ulysses) | heads split |
|--------------------|----------------------------------------------------------|----------------|-------------------------|-------------|
| data_parallel      | the whole sequence                                       | 1              | (1, 1)                  | no          |
| zigzag_ring_attn   | chunks r and 2W-1-r of 2W (balanced causal work)         | 2W             | (W, 1)                  | no          |
| dist_flash_attn    | contiguous chunk r of W (LightSeq's balanced schedule)   | W              | (W, 1)                  | no          |
| ulysses_attn       | contiguous chunk r of W, all-to-all to a head split      | W              | (1, W)                  | over W      |
| usp_attn           | zigzag over R ring ranks, then contiguous over U Ulysses | 2RU            | (R, U), W = R x U       | over U      |

Export targets (seqpar.emit's capability table): accelerate and TRL run Ulysses (DeepSpeed's ALST) and ring attention
(torch context parallelism), not both at once; DeepSpeed and ArcticTraining run Ulysses only; Axolotl runs ring attention
only; none runs LightSeq's dist_flash_attn schedule. Each mode lists what each tool runs for it, nearest first.
"""

from __future__ import annotations

from seqpar.plan.modes.description import ModeDescription
from seqpar.plan.modes.registry import register

_DP, _RING, _ULYSSES = ("data_parallel",), ("zigzag_ring_attn",), ("ulysses_attn",)
_RUNTIME = "seqpar.runtime.parallel."

BUILTIN: tuple[ModeDescription, ...] = (
    ModeDescription(
        name="data_parallel",
        implementation="seqpar_local",
        runtime=_RUNTIME + "data_parallel",
        layout="whole",
        degrees="none",
        comm=(),
        balance="even",
        summary="no split: every rank holds whole sequences",
        exports={"accelerate": _DP, "trl": _DP, "axolotl": _DP, "arctic": _DP, "deepspeed": _DP},
    ),
    ModeDescription(
        name="zigzag_ring_attn",
        implementation="seqpar_zigzag_ring",
        runtime=_RUNTIME + "zigzag_ring_attn",
        layout="zigzag",
        degrees="sequence",
        comm=("ring_kv",),
        balance="zigzag",
        packed_imbalance="zigzag_ring_attn",
        summary="ring attention over a zigzag split (ring-flash-attention, PyTorch CP's head-tail balancer)",
        exports={"accelerate": _RING, "trl": _RING, "axolotl": _RING, "arctic": _ULYSSES, "deepspeed": _ULYSSES},
    ),
    ModeDescription(
        name="dist_flash_attn",
        implementation="seqpar_lightseq",
        runtime=_RUNTIME + "dist_flash_attn",
        layout="contiguous",
        degrees="sequence",
        comm=("peer_blocks",),
        balance="lightseq",
        packed_imbalance="dist_flash_attn",
        needs_checkpointing=True,  # EasyContext runs its schedule under gradient checkpointing only
        summary="LightSeq / DistFlashAttn's balanced causal schedule over contiguous chunks",
        exports={"accelerate": _RING, "trl": _RING, "axolotl": _RING, "arctic": _ULYSSES, "deepspeed": _ULYSSES},
    ),
    ModeDescription(
        name="ulysses_attn",
        implementation="seqpar_ulysses",
        runtime=_RUNTIME + "ulysses_attn",
        layout="contiguous",
        degrees="heads",
        comm=("heads_all_to_all",),
        balance="even",
        summary="DeepSpeed-Ulysses: all-to-all from a sequence split to a head split around local attention",
        exports={"accelerate": _ULYSSES, "trl": _ULYSSES, "axolotl": _RING, "arctic": _ULYSSES, "deepspeed": _ULYSSES},
    ),
    ModeDescription(
        name="usp_attn",
        implementation="seqpar_usp",
        runtime=_RUNTIME + "usp_attn",
        layout="zigzag+contiguous",
        degrees="hybrid",
        comm=("heads_all_to_all", "ring_kv"),
        balance="zigzag",
        packed_imbalance="usp_attn",
        summary="USP: Ulysses inside groups of consecutive ranks, zigzag ring across the groups",
        exports={
            "accelerate": _ULYSSES + _RING,
            "trl": _ULYSSES + _RING,
            "axolotl": _RING,
            "arctic": _ULYSSES,
            "deepspeed": _ULYSSES,
        },
    ),
)

for _description in BUILTIN:
    register(_description)

__all__ = ["BUILTIN"]
