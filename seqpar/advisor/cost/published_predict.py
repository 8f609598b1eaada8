"""The cost model's prediction of each published run (published.py), its configuration pinned, and the comparison.

A row becomes a Workload, a ClusterSpec (cluster_from_flags: the GPU profile and its usual links, host RAM as stated,
board figures the row overrides) and a Strategy (Strategy.over with every option of the row's ``config``), priced by
``seqpar.advisor.cost.predict.predict``: the function the search and ``seqpar check`` price with, so that a row whose
options seqpar's plan rules accept gets exactly what ``advise_by_cost`` with every pin returns. The plan rules are
reported, not applied: a published run may use a combination seqpar does not launch (DeepSpeed's own TiledMLP under
ZeRO-3), and its cost is still the cost model's business. An ``attention_kernel`` the row names picks the kernel rate
(Coefficients.attention_backend), as the GPU's compute capability does otherwise.

Errors are (predicted - published) / published. Memory is compared with the prediction's counterpart of what was
measured: peak allocated for ``allocated`` and ``unstated``, reserved (which also counts the CUDA context and NCCL
buffers) for ``torch_reserved`` and ``device_used``. Pure Python: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.coefficients import Coefficients, load_coefficients
from seqpar.advisor.cost.predict import predict
from seqpar.advisor.cost.published import PublishedRun, PublishedRuns, model_of
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import Prediction
from seqpar.plan.modes import split_multiple, takes_ulysses_degree
from seqpar.plan.rules import layout_problems, plan_problems
from seqpar.plan.specs import ClusterSpec, Strategy, Workload
from seqpar.plan.units import longest

MEMORY_TARGET_PCT = 10.0  # issue targets, where the configuration is fully stated
TOKENS_TARGET_PCT = 15.0


def inputs(row: PublishedRun) -> tuple[Workload, ClusterSpec, Strategy]:
    """The row's workload, cluster and strategy; SeqparError when its config cannot be laid out at all (a data bug)."""
    hw, cfg = row.hardware, row.config
    cluster = cluster_from_flags(hw.gpu, hw.gpus_per_node, hw.nodes, host_ram_gib=hw.host_ram_gib)
    if hw.gpu_override is not None:
        o = hw.gpu_override
        figures = {k: v for k, v in o.model_dump(exclude={"source"}).items() if v is not None}
        gpu = cluster.gpu.model_copy(update={**figures, "source": f"{cluster.gpu.source}; this board: {o.source}"})
        cluster = cluster.model_copy(update={"gpu": gpu})
    model = model_of(row)
    workload = Workload(
        model=model,
        seq_len=cfg.seq_len,
        micro_batch_size=cfg.micro_batch_size,
        dtype=cfg.dtype,
        optimizer=cfg.optimizer,
    )
    u = cfg.ulysses_degree if takes_ulysses_degree(cfg.mode) else None
    strategy = Strategy.over(
        cfg.mode,
        cfg.sp_degree,
        cluster.world_size,
        u,
        checkpointing=cfg.checkpointing,
        sharding=cfg.sharding,
        loss_impl=cfg.loss_impl,
        fused_ops=cfg.fused_ops,
        tiled_mlp=cfg.tiled_mlp,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
    )
    problems = layout_problems(strategy, cfg.seq_len, model, cluster)
    if problems:
        raise SeqparError(f"published run {row.id}: {problems[0]}")
    return workload, cluster, strategy


def coefficients_for(row: PublishedRun, coeffs: Optional[Coefficients] = None) -> Coefficients:
    """The coefficients with the row's attention kernel: flash prices FlashAttention-2 even where the GPU's capability
    would pick cuDNN (Coefficients.attention_backend), cudnn the reverse; unstated keeps the default."""
    c = coeffs or load_coefficients()
    kernel = row.config.attention_kernel
    if kernel == "flash":
        return replace(c, min_cudnn_capability=math.inf)
    if kernel == "cudnn":
        return replace(c, min_cudnn_capability=0.0)
    return c


def predict_row(row: PublishedRun, coeffs: Optional[Coefficients] = None) -> Prediction:
    w, cl, s = inputs(row)
    return predict(w, cl, s, coefficients_for(row, coeffs), norms_tiled=False)  # the source's runtime: its norms whole


def longest_fitting(row: PublishedRun, coeffs: Optional[Coefficients] = None, limit: int = 2**26) -> int:
    """The longest seq_len (a multiple of 1024 and of the mode's split) the cost model fits with the row's configuration:
    memory grows with seq_len, so a doubling, then a bisection, over predict's OOM verdict."""
    w, cl, s = inputs(row)
    c = coefficients_for(row, coeffs)
    unit = math.lcm(1024, split_multiple(s.mode, s.sp_degree, s.ulysses_degree))

    return longest(unit, limit, lambda n: not predict(w.model_copy(update={"seq_len": n}), cl, s, c, norms_tiled=False).oom_risk)


def _pct(pred: float, pub: float) -> float:
    return 100.0 * (pred - pub) / pub


@dataclass(frozen=True)
class RowResult:
    """One row against its prediction."""

    row: PublishedRun
    prediction: Prediction
    fitted_on: bool
    refused: str  # the first of seqpar's plan rules the configuration breaks ("" when seqpar would launch it)
    memory_pred_gib: Optional[float] = None
    memory_error_pct: Optional[float] = None
    tokens_error_pct: Optional[float] = None
    oom_published: Optional[bool] = None
    oom_predicted: bool = False
    targeted: bool = False  # PublishedRuns.is_target: the targets apply
    failures: tuple[str, ...] = ()  # targets missed: any on targeted rows, and a published OOM not flagged on every row


def compare(runs: PublishedRuns, row: PublishedRun, coeffs: Optional[Coefficients] = None) -> RowResult:
    p = predict_row(row, coeffs)
    w, cl, s = inputs(row)
    problems = plan_problems(w, cl, s)
    m = row.measured
    mem_pred = mem_err = tok_err = None
    if m.peak_memory_gib is not None:
        mem_pred = p.reserved_memory_gib if m.memory_kind in ("torch_reserved", "device_used") else p.peak_memory_gib
        mem_err = _pct(mem_pred, m.peak_memory_gib)
    if m.tokens_per_s is not None:
        tok_err = _pct(p.tokens_per_s, m.tokens_per_s)
    failures = []
    targeted = runs.is_target(row)
    if targeted:
        if mem_err is not None and abs(mem_err) > MEMORY_TARGET_PCT:
            failures.append(f"memory {mem_err:+.1f}%")
        if tok_err is not None and abs(tok_err) > TOKENS_TARGET_PCT:
            failures.append(f"tokens/s {tok_err:+.1f}%")
        if m.oom is False and p.oom_risk:
            failures.append("flagged OOM, but it trained")
    if m.oom is True and not p.oom_risk:  # a published OOM is checked on every row: the gate's promise
        failures.append("published OOM not flagged")
    return RowResult(
        row=row,
        prediction=p,
        fitted_on=runs.source_of(row).fitted_on,
        refused=problems[0] if problems else "",
        memory_pred_gib=mem_pred,
        memory_error_pct=mem_err,
        tokens_error_pct=tok_err,
        oom_published=m.oom,
        oom_predicted=p.oom_risk,
        targeted=targeted,
        failures=tuple(failures),
    )


def compare_all(runs: PublishedRuns, coeffs: Optional[Coefficients] = None) -> list[RowResult]:
    return [compare(runs, r, coeffs) for r in runs.rows]


@dataclass(frozen=True)
class RankingResult:
    ranking_id: str
    published: dict[str, float]  # row id -> the published quantity
    predicted: dict[str, float]  # row id -> the cost model's
    same_order: bool


def rank(runs: PublishedRuns, coeffs: Optional[Coefficients] = None) -> list[RankingResult]:
    """Each ranking: the published and predicted quantity per row, and whether they order the rows alike (ties in the
    published figures may go either way)."""
    out = []
    for k in runs.rankings:
        rows = [runs.row(i) for i in k.rows]
        if k.quantity == "max_seq_len":
            pub = {r.id: float(r.config.seq_len) for r in rows}
            pred = {r.id: float(longest_fitting(r, coeffs)) for r in rows}
        else:
            pub = {r.id: r.measured.tokens_per_s for r in rows}
            pred = {r.id: predict_row(r, coeffs).tokens_per_s for r in rows}
        ids = list(pub)
        same = all(pub[a] == pub[b] or (pub[a] > pub[b]) == (pred[a] > pred[b]) for i, a in enumerate(ids) for b in ids[i + 1 :])
        out.append(RankingResult(k.id, pub, pred, same))
    return out


__all__ = [
    "MEMORY_TARGET_PCT",
    "TOKENS_TARGET_PCT",
    "RankingResult",
    "RowResult",
    "coefficients_for",
    "compare",
    "compare_all",
    "inputs",
    "longest_fitting",
    "predict_row",
    "rank",
]
