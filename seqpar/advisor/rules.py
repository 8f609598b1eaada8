"""The guide's decision tree ("EasyContext best practices: choosing a sequence-parallel mode"), as data plus one function.

The tree as that article states it, evaluated top to bottom, first match wins:
  S < 64K -> data_parallel;  several nodes -> ulysses_attn;  64K <= S <= 256K -> dist_flash_attn;  S > 256K -> zigzag_ring_attn.
Data parallel comes first because the guide says to start with it and switch to sequence parallelism at the first OOM (64K is
where it places that switch), whatever the node count. The guide's by-hardware and by-phase tables are kept as data too; they
are reported beside the choice, not used to override it (the by-length rule is the one it states with numbers).

When the tree's mode cannot run (heads not divisible for Ulysses, an odd GPU count for dist flash, seq_len not divisible for
the layout), ``choose_mode`` says why and falls to the next valid mode in ``NEXT_CHOICE``. ``advise_by_rules`` wraps it into a
LaunchPlan (no prediction: the rules do not model memory or speed; ``--policy cost`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Optional

from seqpar import __version__
from seqpar.advisor.request import AdviseRequest
from seqpar.plan.errors import SeqparError
from seqpar.plan.jobspec import launch_spec
from seqpar.plan.launch_plan import LaunchPlan, Rationale
from seqpar.plan.modes import hybrid_names, splits_sequence, takes_ulysses_degree
from seqpar.plan.rules import layout_problems, plan_problems
from seqpar.plan.specs import ClusterSpec, ModelSpec, Strategy
from seqpar.plan.units import format_tokens

K64, K256 = 64 * 1024, 256 * 1024


@dataclass(frozen=True)
class Rule:
    condition: str  # the guide's words
    mode: str
    applies: Callable[[int, ClusterSpec], bool]


TREE: tuple[Rule, ...] = (
    Rule("seq_len < 64K", "data_parallel", lambda s, c: s < K64),
    Rule("several nodes", "ulysses_attn", lambda s, c: c.nodes > 1),
    Rule("64K <= seq_len <= 256K", "dist_flash_attn", lambda s, c: s <= K256),
    Rule("seq_len > 256K", "zigzag_ring_attn", lambda s, c: s > K256),
)

# The guide's other two tables, kept for the record and reported beside the choice.
BY_HARDWARE = {"one 8-GPU node": "zigzag_ring_attn", "multi-node cluster": "ulysses_attn", "scarce resources": "dist_flash_attn"}
BY_PHASE = {"experiments": "dist_flash_attn", "production": "zigzag_ring_attn", "large scale": "ulysses_attn"}

# When the tree's mode is invalid, try these in order. Ulysses -> the Ulysses x ring hybrid keeps all-to-all inside groups
# whose size divides the heads (USP's advice); otherwise the guide's other choices, production (zigzag) before experiments.
NEXT_CHOICE: dict[str, tuple[str, ...]] = {
    "data_parallel": ("dist_flash_attn", "zigzag_ring_attn", "ulysses_attn", "usp_attn"),
    "ulysses_attn": ("usp_attn", "zigzag_ring_attn", "dist_flash_attn"),
    "dist_flash_attn": ("zigzag_ring_attn", "ulysses_attn", "usp_attn"),
    "zigzag_ring_attn": ("dist_flash_attn", "ulysses_attn", "usp_attn"),
    "usp_attn": ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn"),
}


@dataclass(frozen=True)
class Choice:
    mode: str  # the mode chosen (valid)
    tree_mode: str  # the mode the tree picked
    sp_degree: int
    ulysses_degree: int
    rule_path: list[str]
    rejected: list[tuple[str, str]]  # (mode, why) for each invalid mode tried before the choice


def tree_mode(seq_len: int, cluster: ClusterSpec) -> tuple[str, list[str]]:
    """The tree's mode and the path: each rule tested, in order, up to the first that applies."""
    path = []
    for rule in TREE:
        if rule.applies(seq_len, cluster):
            path.append(f"{rule.condition}: yes -> {rule.mode}")
            return rule.mode, path
        path.append(f"{rule.condition}: no")
    raise AssertionError("the tree's last rule always applies")  # S > 256K is the complement of the rules above


def _usp_ulysses_degree(model: ModelSpec, sp: int, gpus_per_node: int) -> int:
    """Largest Ulysses degree that divides sp, fits in a node and splits (or replicates) the heads; 1 if none."""
    a, kv = model.num_attention_heads, model.num_key_value_heads
    ok = [u for u in range(2, min(sp, gpus_per_node) + 1) if sp % u == 0 and a % u == 0 and (kv % u == 0 or u % kv == 0)]
    return max(ok, default=1)


def check_mode(
    mode: str, seq_len: int, model: ModelSpec, cluster: ClusterSpec, sp_pin: Optional[int] = None, u_pin: Optional[int] = None
) -> tuple[Optional[tuple[int, int]], str]:
    """((sp_degree, ulysses_degree), '') when the mode can run here, else (None, why)."""
    world = cluster.world_size
    if not splits_sequence(mode):
        if sp_pin not in (None, 1):
            return None, f"{mode} keeps whole sequences, but sp_degree {sp_pin} is pinned"
        if u_pin not in (None, 1):
            return None, f"ulysses_degree {u_pin} is pinned, which only {hybrid_names()} takes"
        return (1, 1), ""
    sp = sp_pin or world
    if sp < 2:
        return None, f"{mode} needs at least 2 ranks to split a sequence over, the cluster has {world}"
    if not takes_ulysses_degree(mode) and u_pin not in (None, 1):
        return None, f"ulysses_degree {u_pin} is pinned, which only {hybrid_names()} takes"
    u = 1
    if takes_ulysses_degree(mode):
        u = u_pin or _usp_ulysses_degree(model, sp, cluster.gpus_per_node)
        if u < 2 or sp % u:
            return (
                None,
                f"{mode} found no Ulysses degree >= 2 dividing sp_degree {sp} and {model.name}'s {model.num_attention_heads} heads",
            )
        if sp // u < 2:  # a ring of one rank is ulysses_attn: the search never plans it as usp_attn either
            ranks = "CPU ranks" if cluster.accelerator == "cpu" else "GPUs"
            return (
                None,
                f"{mode} needs a Ulysses degree and a ring degree of at least 2 each (sp_degree = ulysses x ring), so at "
                f"least 4 {ranks}; sp_degree {sp} with Ulysses degree {u} leaves a ring of {sp // u}: use ulysses_attn",
            )
    problems = layout_problems(Strategy.over(mode, sp, world, u), seq_len, model, cluster)  # ranks, split, heads
    return (None, problems[0]) if problems else ((sp, u), "")


def choose_mode(
    seq_len: int,
    model: ModelSpec,
    cluster: ClusterSpec,
    mode: Optional[str] = None,
    sp_degree: Optional[int] = None,
    ulysses_degree: Optional[int] = None,
) -> Choice:
    """The tree's choice (or the pinned mode), checked; the next valid mode when it cannot run; SeqparError when none can."""
    picked, path = tree_mode(seq_len, cluster)
    if mode is not None:
        degrees, why = check_mode(mode, seq_len, model, cluster, sp_degree, ulysses_degree)
        if degrees is None:
            raise SeqparError(f"pinned --mode {mode}: {why}")
        return Choice(mode, picked, degrees[0], degrees[1], path + [f"--mode {mode} pinned"], [])
    candidates = (picked,) + NEXT_CHOICE[picked]
    if cluster.world_size == 1 and sp_degree in (None, 1):
        candidates += ("data_parallel",)  # one device: nothing to split the sequence over
    rejected = []
    for cand in dict.fromkeys(candidates):
        degrees, why = check_mode(cand, seq_len, model, cluster, sp_degree, ulysses_degree)
        if degrees is not None:
            if rejected:
                path = path + [f"{m} invalid: {w}" for m, w in rejected] + [f"next valid choice -> {cand}"]
            return Choice(cand, picked, degrees[0], degrees[1], path, rejected)
        rejected.append((cand, why))
    raise SeqparError(
        f"seq_len {seq_len} cannot be split over {cluster.world_size} ranks by any mode: "
        + "; ".join(f"{m}: {w}" for m, w in rejected[:2])
    )


def advise_by_rules(req: AdviseRequest, cluster_note: str = "") -> LaunchPlan:
    """A launch plan from the guide's tree. Pins in the request are honoured; no prediction (prediction=None)."""
    c, s = req.cluster, req.seq_len
    ch = choose_mode(s, req.model, c, req.mode, req.sp_degree, req.ulysses_degree)
    dp = c.world_size // ch.sp_degree
    reasons = [
        f"seq_len {s} ({format_tokens(s)}) on {c.nodes} node(s) x {c.gpus_per_node} {c.gpu.name}: the guide's tree picks {ch.tree_mode}"
    ]
    reasons += [f"{m} rejected: {w}" for m, w in ch.rejected]
    if not splits_sequence(ch.mode):
        reasons.append(
            "the guide: start with data parallel and switch to sequence parallelism at the first OOM; "
            "the rules do not model memory, so check the fit with --policy cost or `seqpar check`"
        )
    else:
        reasons.append(
            f"{ch.mode} over sp_degree {ch.sp_degree}"
            + (
                f" (ulysses {ch.ulysses_degree} x ring {ch.sp_degree // ch.ulysses_degree})"
                if takes_ulysses_degree(ch.mode)
                else ""
            )
            + f", dp_degree {dp}: {s // ch.sp_degree} tokens per rank"
        )
        hw = "multi-node cluster" if c.nodes > 1 else "one 8-GPU node" if c.gpus_per_node == 8 else None
        if hw and BY_HARDWARE[hw] != ch.mode:
            reasons.append(f"the guide's by-hardware table says {BY_HARDWARE[hw]} for a {hw}; its by-length rule decides here")
    # EasyContext's recipe: gradient checkpointing, DeepSpeed ZeRO-3 with CPU offload, its own loss on full logits, micro-batch 1.
    ckpt, loss = req.checkpointing or "full", req.loss_impl or "hf"
    gas = req.accumulation_steps(dp)
    strategy = Strategy.over(
        ch.mode,
        ch.sp_degree,
        c.world_size,
        ch.ulysses_degree,
        checkpointing=ckpt,
        loss_impl=loss,
        gradient_accumulation_steps=gas,
        **req.option_pins(),
    )
    # Sharding: the pin, else EasyContext's engine on CUDA (FSDP2 where the plan rules refuse ZeRO-3: another optimizer than
    # AdamW, tiled_mlp) and plain DDP on gloo CPU ranks (DeepSpeed is a GPU engine).
    w = req.workload()
    shardings = [req.sharding] if req.sharding else ["zero3_offload", "fsdp"] if c.accelerator == "cuda" else ["ddp"]
    if w.lora is not None and not req.sharding and c.accelerator == "cuda":
        # EasyContext offloads to fit a full fine-tuning's optimizer states; LoRA's are the adapters': small
        shardings = ["ddp", "zero3", "fsdp"]
    tried = [(sh, plan_problems(w, c, strategy.model_copy(update={"sharding": sh}))) for sh in shardings]
    sharding = next((sh for sh, problems in tried if not problems), None)
    if sharding is None:
        raise SeqparError(tried[0][1][0])
    strategy = strategy.model_copy(update={"sharding": sharding})
    sharding_why = (
        "LoRA trains the adapters only: their gradients and optimizer states are small, so every rank keeps the frozen "
        "base and reduces the adapters' gradients (pin --sharding zero3 to shard the base)"
        if w.lora is not None and sharding == "ddp" and sharding == shardings[0] and c.accelerator == "cuda"
        else "EasyContext's engine: DeepSpeed ZeRO-3 with CPU offload; pin --sharding fsdp to run without DeepSpeed"
        if sharding == "zero3_offload"
        else f"not EasyContext's zero3_offload: {tried[0][1][0]}"
        if sharding != shardings[0]
        else "gloo CPU ranks: plain data-parallel gradients (DeepSpeed is a GPU engine)"
    )
    for what, pinned, val, why in (
        (
            "checkpointing",
            req.checkpointing,
            ckpt,
            "EasyContext trains with gradient checkpointing (dist_flash_attn requires it)",
        ),
        ("sharding", req.sharding, sharding, sharding_why),
        ("loss_impl", req.loss_impl, loss, "EasyContext computes the loss on full logits (transformers' way)"),
    ):
        reasons.append(f"{what} {val}: " + ("pinned" if pinned else why))
    for what, pinned in req.option_pins().items():
        reasons.append(f"{what} {pinned}: pinned")
    if req.tokens_per_step:
        per_micro = req.micro_batch_size * s * dp
        reasons.append(
            f"gradient_accumulation_steps {gas}: {req.tokens_per_step} tokens per step / ({req.micro_batch_size} x {s} x dp {dp}) "
            f"= {req.tokens_per_step / per_micro:.2f}, rounded"
        )
    everything_pinned = bool(
        req.mode
        and (not splits_sequence(req.mode) or req.sp_degree)
        and req.checkpointing
        and req.sharding
        and req.loss_impl
        and (not takes_ulysses_degree(req.mode) or req.ulysses_degree)
    )
    rationale = Rationale(
        policy="pinned" if everything_pinned else "rules",
        rule_path=ch.rule_path,
        rules_choice=ch.tree_mode,
        reasons=reasons,
        cluster_note=cluster_note,
    )
    return written_plan("rules", workload=w, cluster=c, strategy=strategy, prediction=None, rationale=rationale)


def written_plan(policy: str, **fields) -> LaunchPlan:
    """A plan as the advisor writes it: by whom (seqpar's version, the policy) and when, with the command ``seqpar launch
    plan.json`` will run (seqpar.plan.jobspec; `seqpar advise -o PATH` records it for PATH)."""
    created_at = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    plan = LaunchPlan(created_by=f"seqpar {__version__} (advise, {policy})", created_at=created_at, **fields)
    return plan.model_copy(update={"launch": launch_spec(plan)})


__all__ = [
    "TREE",
    "NEXT_CHOICE",
    "BY_HARDWARE",
    "BY_PHASE",
    "Choice",
    "tree_mode",
    "check_mode",
    "choose_mode",
    "advise_by_rules",
    "written_plan",
]
