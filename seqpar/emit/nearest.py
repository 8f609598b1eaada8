"""The strategy nearest a plan's that a tool runs, from the tool's row of the capability table (capabilities.py).

``nearest`` walks the row: the modes the tool runs for the plan's mode (nearest first, several when the first may not
split the heads), the sharding per mode (DeepSpeed's Ulysses runs on ZeRO, torch's context parallelism on FSDP2),
checkpointing, the loss, the fused kernels, TiledMLP; it yields strategies that split the sequence and the heads
(plan.rules.layout_problems), each with one line per choice the tool changed. ``expressible`` says whether a tool runs a
strategy unchanged (``seqpar check`` proposes only fixes the tool can write). A choice the row has nothing for is
``capabilities.Unsupported``.
"""

from __future__ import annotations

from typing import Iterator

from seqpar.emit.capabilities import OPTIONS, Caps, Unsupported
from seqpar.plan.modes import splits_sequence
from seqpar.plan.rules import NO_SPLIT, checkpointed_layers, layout_problems, offloaded_layers
from seqpar.plan.specs import ClusterSpec, Strategy, Workload


def _note(caps: Caps, name: str, old, new) -> str:
    """'<why the tool lacks it>; emitted <name> <new> instead': the most specific reason the tool's table gives."""
    keys = (f"{name} {old}->{new}", f"{name} ->{new}", f"{name} {old}")
    why = next((caps.why[k] for k in keys if k in caps.why), f"{caps.tool} has no {name} {old}")
    return f"{why}; emitted {name} {new} instead"


def _degrees(sp: int, world: int, mode: str) -> list[int]:
    """sp degrees to try for ``mode``: the plan's first, then the other divisors of the world, nearest first."""
    if not splits_sequence(mode):
        return [1]
    divisors = [d for d in range(2, world + 1) if world % d == 0]
    return sorted(divisors, key=lambda d: (abs(d - sp), -d))


def nearest(caps: Caps, s: Strategy, w: Workload, cluster: ClusterSpec) -> Iterator[tuple[Strategy, list[str]]]:
    """Strategies the tool runs, nearest to ``s`` first, each with a line per choice the tool changed. Only strategies
    that split the sequence and the heads on this cluster; the same tokens per step (gradient accumulation follows dp)."""
    world = cluster.world_size
    options = {name: caps.option(name, getattr(s, name)) for name in OPTIONS}
    for mode in caps.modes_for(s.mode):
        for sp in _degrees(s.sp_degree, world, mode):
            dp = world // sp
            accum = max(1, round(s.gradient_accumulation_steps * s.dp_degree / dp))
            cand = Strategy.over(
                mode,
                sp,
                world,
                checkpointing=options["checkpointing"],
                sharding=caps.sharding(mode, s.sharding),
                loss_impl=options["loss_impl"],
                gradient_accumulation_steps=accum,
                fused_ops=options["fused_ops"],
                tiled_mlp=options["tiled_mlp"],
            )
            if layout_problems(cand, w.seq_len, w.model, cluster):
                continue
            notes = []
            if mode != s.mode:
                notes.append(_note(caps, "mode", s.mode, mode))
            if sp != s.sp_degree and splits_sequence(mode):
                notes.append(
                    f"sp_degree {s.sp_degree} cannot split {w.model.name}'s heads or the sequence in {mode}; emitted {sp}"
                )
            for name in ("sharding", "checkpointing", "loss_impl", "fused_ops", "tiled_mlp"):
                old, new = getattr(s, name), getattr(cand, name)
                if old != new:
                    notes.append(_note(caps, name, old, new))
            if caps.adjust is not None:  # rules across choices, after the per-choice mapping
                cand, more = caps.adjust(cand)
                notes += more
            if mode in caps.approx:
                notes.append(caps.approx[mode])
            if caps.layer_split and cand.checkpointing == s.checkpointing:
                cand = cand.model_copy(update={k: getattr(s, k) for k in NO_SPLIT})  # the split as planned
            else:
                notes += _split_notes(caps, s, cand, w.model.num_layers)
            yield cand, notes


def _split_notes(caps: Caps, s: Strategy, cand: Strategy, n: int) -> list[str]:
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


def expressible(caps: Caps, s: Strategy) -> bool:
    """Does the tool run ``s`` as it is (every choice maps onto itself)? False for a choice its row lacks."""
    if caps.adjust is not None and caps.adjust(s)[0] != s:
        return False
    if not caps.layer_split and (s.checkpoint_layers is not None or s.offload_layers is not None or s.kept_saves != "all"):
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


__all__ = ["attn_implementation", "expressible", "nearest"]
