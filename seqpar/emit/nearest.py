"""What each training tool can run, stated once, and the strategy nearest a plan's that a tool runs.

A tool's ``Caps`` maps every plan choice onto the choice the tool has: the mode (nearest first, several when the first
may not split the heads), the sharding per mode (DeepSpeed's Ulysses runs on ZeRO, torch's context parallelism on
FSDP2), checkpointing, the loss, the fused kernels, TiledMLP. ``nearest`` walks them and yields strategies that split
the sequence and the heads (schema.layout_problems), each with one line per choice the tool changed; ``expressible``
says whether a tool runs a strategy unchanged (``seqpar check`` proposes only fixes the tool can write).

Facts (read in the released wheels; accelerate 1.16.0, TRL 1.16.0, axolotl 0.19.0, arctic-training 0.8.0):
- accelerate's ParallelismConfig: ``sp_size`` is DeepSpeed's Ulysses/ALST (needs distributed_type DEEPSPEED),
  ``cp_size`` torch's context parallelism (ring attention with head-tail load balancing, FSDP2 and SDPA only); the two
  are mutually exclusive, so USP has no equivalent; nothing runs LightSeq's dist_flash_attn schedule.
- Axolotl's ``context_parallel_size`` is ring attention through ring-flash-attn (``ring_attn_func`` batch_ring or
  varlen_llama3; zigzag variants are commented out of its enum); it has no Ulysses.
- ArcticTraining's ``sequence_parallel_size`` is DeepSpeed Ulysses (ALST); it runs DeepSpeed ZeRO only, has no ring
  attention and no selective checkpointing.
- None of them splits the decoder layers between checkpointing policies (the plan's checkpoint_layers, offload_layers):
  accelerate's FSDP checkpointing wraps every layer, transformers' checkpointing (TRL, Axolotl, ArcticTraining) has
  ``every_n_layers`` (every n-th layer, not the first k) and one offload switch for all of them. The nearest is the
  policy on every layer (and every checkpointed input offloaded): less GPU memory than the plan, more recomputation.
- TRL >= 1.15 computes the SFT loss through a fused LM head, chunk by chunk ("without materializing the full logits"):
  seqpar's ``chunked``; it has no switch back to full logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from seqpar.plan.rules import NO_SPLIT, checkpointed_layers, layout_problems, offloaded_layers
from seqpar.plan.specs import ClusterSpec, Strategy, Workload

ALL_SHARDINGS = ("ddp", "zero2", "zero3", "zero3_offload", "fsdp")
DEEPSPEED_ONLY = {"ddp": "zero2", "zero2": "zero2", "zero3": "zero3", "zero3_offload": "zero3_offload", "fsdp": "zero3"}
FSDP_ONLY = dict.fromkeys(ALL_SHARDINGS, "fsdp")
SAME_SHARDING = {s: s for s in ALL_SHARDINGS}


@dataclass(frozen=True)
class Caps:
    """How one tool expresses a plan's choices: plan value -> the tool's nearest value (itself when it has it)."""

    tool: str
    modes: dict[str, tuple[str, ...]]  # plan mode -> modes the tool runs, nearest first (empty: none)
    shardings: dict[str, dict[str, str]]  # tool mode -> {plan sharding -> tool sharding}
    checkpointing: dict[str, str] = field(default_factory=lambda: {c: c for c in ("none", "full", "offload", "selective")})
    loss_impl: dict[str, str] = field(default_factory=lambda: {"hf": "hf", "chunked": "chunked"})
    fused_ops: dict[str, str] = field(default_factory=lambda: {"none": "none", "liger": "liger"})
    tiled_mlp: dict[bool, bool] = field(default_factory=lambda: {False: False, True: True})
    why: dict[str, str] = field(default_factory=dict)  # "field value" -> why the tool lacks it (a clause)
    approx: dict[str, str] = field(default_factory=dict)  # tool mode -> how the tool runs it, when not seqpar's kernel
    adjust: Callable[[Strategy], tuple[Strategy, list[str]]] | None = None  # rules across choices (e.g. FSDP's policies)
    layer_split: bool = False  # the tool runs checkpoint_layers / offload_layers (none of today's tools does)


def _note(caps: Caps, name: str, old, new) -> str:
    """'<why the tool lacks it>; emitted <name> <new> instead': the most specific reason the tool's table gives."""
    keys = (f"{name} {old}->{new}", f"{name} ->{new}", f"{name} {old}")
    why = next((caps.why[k] for k in keys if k in caps.why), f"{caps.tool} has no {name} {old}")
    return f"{why}; emitted {name} {new} instead"


def _degrees(sp: int, world: int, mode: str) -> list[int]:
    """sp degrees to try for ``mode``: the plan's first, then the other divisors of the world, nearest first."""
    if mode == "data_parallel":
        return [1]
    divisors = [d for d in range(2, world + 1) if world % d == 0]
    return sorted(divisors, key=lambda d: (abs(d - sp), -d))


def nearest(caps: Caps, s: Strategy, w: Workload, cluster: ClusterSpec) -> Iterator[tuple[Strategy, list[str]]]:
    """Strategies the tool runs, nearest to ``s`` first, each with a line per choice the tool changed. Only strategies
    that split the sequence and the heads on this cluster; the same tokens per step (gradient accumulation follows dp)."""
    world = cluster.world_size
    for mode in caps.modes.get(s.mode, ()):
        for sp in _degrees(s.sp_degree, world, mode):
            dp = world // sp
            accum = max(1, round(s.gradient_accumulation_steps * s.dp_degree / dp))
            cand = Strategy.over(
                mode,
                sp,
                world,
                checkpointing=caps.checkpointing[s.checkpointing],
                sharding=caps.shardings[mode][s.sharding],
                loss_impl=caps.loss_impl[s.loss_impl],
                gradient_accumulation_steps=accum,
                fused_ops=caps.fused_ops[s.fused_ops],
                tiled_mlp=caps.tiled_mlp[s.tiled_mlp],
            )
            if layout_problems(cand, w.seq_len, w.model, cluster):
                continue
            notes = []
            if mode != s.mode:
                notes.append(_note(caps, "mode", s.mode, mode))
            if sp != s.sp_degree and mode != "data_parallel":
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
    """Does the tool run ``s`` as it is (every choice maps onto itself)?"""
    if caps.adjust is not None and caps.adjust(s)[0] != s:
        return False
    if not caps.layer_split and (s.checkpoint_layers is not None or s.offload_layers is not None or s.kept_saves != "all"):
        return False
    return (
        s.mode in caps.modes.get(s.mode, ())
        and caps.shardings[s.mode][s.sharding] == s.sharding
        and caps.checkpointing[s.checkpointing] == s.checkpointing
        and caps.loss_impl[s.loss_impl] == s.loss_impl
        and caps.fused_ops[s.fused_ops] == s.fused_ops
        and caps.tiled_mlp[s.tiled_mlp] == s.tiled_mlp
    )


def attn_implementation(cluster: ClusterSpec) -> str:
    """FlashAttention-2 on GPUs (what the tools' sequence parallelism is built on), SDPA on CPU ranks."""
    return "flash_attention_2" if cluster.accelerator == "cuda" else "sdpa"


__all__ = [
    "ALL_SHARDINGS",
    "Caps",
    "DEEPSPEED_ONLY",
    "FSDP_ONLY",
    "SAME_SHARDING",
    "attn_implementation",
    "expressible",
    "nearest",
]
