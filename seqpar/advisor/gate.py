"""The pre-launch OOM gate (``seqpar check``): does a plan (or a request) fit, its biggest memory terms, and the cheapest fix.

``check(plan_or_request)`` predicts the plan on its own cluster (or on another of the same size), and when it does not
fit tries single changes (``variants``: the chunked loss, each checkpointing, each zero* sharding, tiled_mlp, another
mode or sp degree, each with the layer split memory allows: search.layer_split_variant) and names the fastest that fits. Every variant is a strategy the plan rules accept
(schema.plan_problems), so the fix it names can always be written as a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

from seqpar.advisor.cost.coefficients import Coefficients, load_coefficients
from seqpar.advisor.cost.memory import estimate_memory
from seqpar.advisor.cost.predict import predict
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.search import advise_by_cost, describe, enumerate_strategies, evaluate, layer_split_variant
from seqpar.plan.display import option_names
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan, Prediction
from seqpar.plan.rules import NO_SPLIT, checkpointing_text, plan_problems
from seqpar.plan.specs import ClusterSpec, Strategy
from seqpar.plan.units import format_tokens


@dataclass
class CheckResult:
    fits: bool
    prediction: Prediction
    biggest_terms: list[tuple[str, float]]  # (term, GiB) at the peak phase, largest first
    fix: str  # the cheapest change that fits (empty when it fits)
    fix_strategy: Optional[Strategy] = None
    reason: str = ""
    exit_code: int = 0  # 0 fits, 1 risks OOM
    plan: Optional[LaunchPlan] = field(default=None, repr=False)


def variants(s: Strategy, req: AdviseRequest) -> Iterator[tuple[str, Strategy]]:
    """(what changed, the strategy) for each single change of ``s`` the plan rules accept for req's workload and cluster."""
    w = req.workload()
    changes = [("loss_impl chunked (logits a chunk at a time)", {"loss_impl": "chunked"})]
    whole = NO_SPLIT  # a new policy over every layer; its split is searched in check
    if s.checkpoint_layers is not None or s.offload_layers is not None:
        changes.append(("every layer checkpointed" + (" and offloaded" if s.checkpointing == "offload" else ""), whole))
    elif s.offload_stride > 1:
        changes.append(("every offloaded layer's input in host memory (offload_stride 1)", whole))
    changes += [(f"checkpointing {ck}", {"checkpointing": ck, **whole}) for ck in ("full", "selective", "offload")]
    changes += [(f"sharding {sh}", {"sharding": sh}) for sh in ("zero2", "zero3", "zero3_offload")]
    if not s.tiled_mlp:
        changes.append(("tiled_mlp (the MLP one sequence tile at a time)", {"tiled_mlp": True}))
    for what, update in changes:
        v = s.model_copy(update=update)
        if not plan_problems(w, req.cluster, v):
            yield what, v
    valid, _ = enumerate_strategies(
        req.model_copy(
            update={
                "mode": None,
                "sp_degree": None,
                "ulysses_degree": None,
                "checkpointing": s.checkpointing,
                "sharding": s.sharding,
                "loss_impl": s.loss_impl,
                **{k: getattr(s, k) for k in option_names(s)},
            }
        ),
        req.workload(),
    )
    for v in valid:
        if (v.mode, v.sp_degree) != (s.mode, s.sp_degree):
            yield f"{v.mode} with sp_degree {v.sp_degree}", v


def check(
    target: Union[LaunchPlan, AdviseRequest], cluster: Optional[ClusterSpec] = None, coeffs: Optional[Coefficients] = None
) -> CheckResult:
    """Does it fit? The predicted peak, the biggest terms and, when it does not fit, the cheapest fix (fastest single change that fits)."""
    c = coeffs or load_coefficients()
    plan = target if isinstance(target, LaunchPlan) else advise_by_cost(target, c)
    cl = cluster or plan.cluster
    if cluster is not None and cluster.world_size != plan.strategy.world_size:
        raise SeqparError(
            f"the plan needs {plan.strategy.world_size} GPUs but the cluster to check has {cluster.world_size}; "
            f"check on the plan's own cluster or re-advise with `seqpar advise`"
        )
    w, s = plan.workload, plan.strategy
    problems = plan_problems(w, cl, s)  # the plan's own cluster accepted it; another may not (e.g. liger without CUDA)
    if problems:
        raise SeqparError(problems[0])
    pred = predict(w, cl, s, c)
    mem = estimate_memory(w, cl, s, c)
    terms = sorted(pred.memory_breakdown_gib.items(), key=lambda kv: -kv[1])[:4]
    if mem.fits:
        return CheckResult(True, pred, terms, "", None, "", 0, plan)
    req = AdviseRequest(
        model=w.model,
        seq_len=w.seq_len,
        cluster=cl,
        micro_batch_size=w.micro_batch_size,
        dtype=w.dtype,
        optimizer=w.optimizer,
        tokens_per_step=w.tokens_per_step,
        doc_lens=w.doc_lens,
        fused_ops=s.fused_ops if s.fused_ops != "none" else None,
    )  # keep the plan's kernels for the fallback advice
    best: Optional[tuple[float, str, Strategy]] = None
    for what, v in variants(s, req):
        split = layer_split_variant(w, cl, v, c)  # the layer split memory allows under that change, where there is one
        tries = [(what, v)] + ([(f"{what}: {checkpointing_text(split, w.model.num_layers)}", split)] if split is not None else [])
        for label, x in tries:
            cand = evaluate(w, cl, x, c)
            if cand.fits and (best is None or cand.tokens_per_s > best[0]):
                best = (cand.tokens_per_s, label, x)
    if best:
        fix = f"{best[1]} -> fits, {best[0]:,.0f} tokens/s ({describe(best[2])})"
    else:
        try:
            alt = advise_by_cost(req, c)
            fix = (
                f"no single change fits; `seqpar advise` proposes {describe(alt.strategy)}"
                if alt.prediction and not alt.prediction.oom_risk
                else f"nothing fits {format_tokens(w.seq_len)} tokens on this cluster: more GPUs, or a shorter sequence"
            )
        except SeqparError as e:
            fix = str(e)
    return CheckResult(False, pred, terms, fix, best[2] if best else None, mem.reason, 1, plan)
