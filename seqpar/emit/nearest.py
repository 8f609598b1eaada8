"""What a tool's row of the capability table (capabilities.py) says about one strategy: whether the tool runs it as it
is (``expressible``: the filter of ``--emit``'s search, space.py, and of the fixes ``seqpar check`` proposes), and the
line that says why the tool lacks a plan's choice (``lacks_note``; ``split_notes`` and ``stride_notes``: the per-layer
checkpointing split and the recomputed offloaded inputs, which no tool's own keys say). A choice the row has nothing for is ``capabilities.Unsupported``.
"""

from __future__ import annotations

from seqpar.emit.capabilities import OPTIONS, Caps, Unsupported
from seqpar.plan.rules import checkpointed_layers, offloaded_layers
from seqpar.plan.specs import ClusterSpec, Strategy


def lacks_note(caps: Caps, name: str, old, new) -> str:
    """'<why the tool lacks it>; emitted <name> <new> instead': the most specific reason the tool's table gives."""
    keys = (f"{name} {old}->{new}", f"{name} ->{new}", f"{name} {old}")
    why = next((caps.why[k] for k in keys if k in caps.why), f"{caps.tool} has no {name} {old}")
    return f"{why}; emitted {name} {new} instead"


def split_notes(caps: Caps, s: Strategy, cand: Strategy, n: int) -> list[str]:
    """A line per layer split of ``s`` that ``cand`` (the policy on every layer) drops."""
    ck, off, out = checkpointed_layers(s, n), offloaded_layers(s, n), []
    if s.checkpointing != "none" and ck < n and cand.checkpointing != "none":
        out.append(
            f"{caps.tool} checkpoints every decoder layer or none (no checkpoint_layers); emitted checkpointing "
            f"{cand.checkpointing} on all {n} layers instead of the first {ck} (more recomputation, less memory)"
        )
    if s.kept_saves != "all" and ck < n and cand.checkpointing != "none":
        out.append(
            f"{caps.tool} has no kept_saves {s.kept_saves} (the last {n - ck} layers keeping only their matmul outputs); "
            "emitted those layers checkpointed like the rest"
        )
    if s.checkpointing == "offload" and off < ck and cand.checkpointing == "offload":
        out.append(
            f"{caps.tool} offloads every checkpointed layer's input or none (no offload_layers); emitted all of them in "
            f"host memory instead of {off} of {ck} (more host RAM, less GPU memory)"
        )
    return out


def stride_notes(caps: Caps, s: Strategy, cand: Strategy) -> list[str]:
    """A line when ``s`` recomputes offloaded inputs (offload_stride), which only seqpar's runtime does, and ``cand``
    (what the tool runs) does not."""
    if s.offload_stride > 1 and cand.offload_stride == 1:
        instead = "every offloaded layer's input" if cand.checkpointing == "offload" else f"checkpointing {cand.checkpointing}"
        return [
            f"{caps.tool} has no offload_stride (only seqpar's runtime recomputes offloaded layer inputs); emitted "
            f"{instead} instead of 1 in {s.offload_stride} of them in host memory"
        ]
    return []


def expressible(caps: Caps, s: Strategy) -> bool:
    """Does the tool run ``s`` as it is (every choice maps onto itself)? False for a choice its row lacks."""
    if caps.adjust is not None and caps.adjust(s)[0] != s:
        return False
    if not caps.layer_split and (s.checkpoint_layers is not None or s.offload_layers is not None or s.kept_saves != "all"):
        return False
    if s.offload_stride > 1:  # seqpar's runtime alone recomputes offloaded inputs (seqpar.apply takes it; no tool's key)
        return False
    try:
        return (
            s.mode in caps.modes_for(s.mode)
            and caps.sharding(s.mode, s.sharding) == s.sharding
            and all(caps.option(name, getattr(s, name)) == getattr(s, name) for name in OPTIONS)
        )
    except Unsupported:
        return False


def attn_implementation(cluster: ClusterSpec) -> str:
    """FlashAttention-2 on GPUs (what the tools' sequence parallelism is built on), SDPA on CPU ranks."""
    return "flash_attention_2" if cluster.accelerator == "cuda" else "sdpa"


__all__ = ["attn_implementation", "expressible", "lacks_note", "split_notes", "stride_notes"]
