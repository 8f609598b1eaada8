"""The cost-model search: every valid strategy predicted, the fastest that fits chosen; max context per mode; the OOM gate.

``advise_by_cost(req)`` enumerates modes x sp degrees (divisors of the GPU count; usp: ulysses x ring) x checkpointing x
sharding x loss implementation x tiled_mlp off/on (pins in the request restrict each axis; fused_ops is never searched:
Liger-Kernel is an optional dependency, so it is ``none`` unless pinned, and the rationale says when ``liger`` would be
faster), drops those the plan rules refuse (schema.plan_problems: the same judge LaunchPlan validates with) and records
why, predicts the rest (memory.py, throughput.py; ~30 us
each) and returns the fastest that fits with the margin. tiled_mlp costs one more MLP forward and saves memory, so it can only
win where its untiled twin does not fit, and only there is it predicted. The plan carries the guide tree's choice
(rules.py) and, where the cost model departs from it, why. ``max_seq_len`` binary-searches the longest sequence that fits
per mode. The OOM gate (``seqpar check``) is gate.py.

Search space, not validity: every registered mode (seqpar.plan.modes) is a candidate; a mode whose description
needs_checkpointing (dist_flash_attn: EasyContext runs its schedule under gradient checkpointing) is searched with
checkpointing only unless checkpointing is pinned; a hybrid mode's (usp_attn's) Ulysses degree ranges over
2..sp_degree/2 (a ring of one is ulysses_attn, a Ulysses group of one zigzag_ring_attn).

LoRA (the workload's ``lora``) changes no axis: the cost model prices its frozen base and small adapter states
(seqpar.advisor.cost.lora), so offload, ZeRO sharding and checkpointing win or lose on those, and the plan rules refuse
what the runtime cannot train (a 4-bit base sharded). Only the kept-matmuls note, priced for a full fine-tuning's
layer, is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Iterator, Optional

from seqpar.advisor.cost.coefficients import Coefficients, load_coefficients
from seqpar.advisor.cost.memory import estimate_memory, kept_host_matmuls
from seqpar.advisor.cost.predict import predict
from seqpar.advisor.cost.throughput import estimate_time
from seqpar.advisor.refusal import no_valid_strategy
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.rules import tree_mode, written_plan
from seqpar.plan.display import tags
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import Alternative, LaunchPlan, Rationale
from seqpar.plan.modes import describe as describe_mode
from seqpar.plan.modes import names, split_multiple, splits_sequence, takes_ulysses_degree
from seqpar.plan.rules import NO_SPLIT, plan_problems, split_tag
from seqpar.plan.specs import ClusterSpec, ModelSpec, Strategy, Workload
from seqpar.plan.units import GIB, divisors, longest

CHECKPOINTING = ("full", "selective", "none", "offload")
SHARDING = ("ddp", "zero2", "zero3", "zero3_offload")  # fsdp costs the same as zero3 in this model; searched when pinned
LOSS = ("chunked", "hf")


@dataclass
class Candidate:
    strategy: Strategy
    tokens_per_s: float = 0.0
    peak_gib: float = 0.0
    fits: bool = False
    why: str = ""  # invalid / OOM reason


def _degrees(mode: str, world: int, req: AdviseRequest) -> Iterator[tuple[int, int, str]]:
    """(sp_degree, ulysses_degree, why not) the mode can take on ``world`` ranks, honouring the pinned degrees: a pinned
    sp_degree > 1 rules out whole sequences (data_parallel), a pinned Ulysses degree (> 1) every mode but a hybrid one
    (usp_attn). ``why not`` is set for a pinned Ulysses degree that forms no hybrid strategy over that sp_degree."""
    hybrid = takes_ulysses_degree(mode)
    if req.ulysses_degree not in (None, 1) and not hybrid:
        return
    if not splits_sequence(mode):
        if req.sp_degree in (None, 1):
            yield 1, 1, ""
        return
    sps = [req.sp_degree] if req.sp_degree else [d for d in divisors(world) if d >= 2]
    for sp in sps:
        if not hybrid:
            yield sp, 1, ""
        elif req.ulysses_degree is None:
            yield from ((sp, u, "") for u in range(2, sp) if sp % u == 0)
        else:
            u = req.ulysses_degree
            ok = sp % u == 0 and 2 <= u < sp
            yield sp, u, "" if ok else f"{mode} needs ulysses_degree x ring_degree = {sp} with both >= 2, got ulysses {u}"


def enumerate_strategies(req: AdviseRequest, workload: Workload) -> tuple[list[Strategy], list[tuple[Strategy | None, str]]]:
    """(valid strategies, [(strategy, why invalid)]) over the request's search space; ``why`` is the first of the plan rules'
    problems (schema.plan_problems), so LaunchPlan refuses each invalid strategy with that very line. The strategy is None
    where a pinned Ulysses degree forms none."""
    c, world = req.cluster, req.cluster.world_size
    modes = [req.mode] if req.mode else list(names())
    if req.checkpointing:
        ckpts = [req.checkpointing]
    else:  # a stride pin above 1 spaces offloaded inputs: offload is the policy it asks for
        ckpts = ["offload"] if (req.offload_stride or 1) > 1 else list(CHECKPOINTING)
    if req.sharding:
        shards = [req.sharding]
    elif c.accelerator == "cpu":  # DeepSpeed is GPU-only; gloo ranks shard with FSDP2
        shards = ["ddp"] if world == 1 else ["ddp", "fsdp"]
    else:
        shards = ["ddp", "zero3_offload"] if world == 1 else list(SHARDING)
    losses = [req.loss_impl] if req.loss_impl else list(LOSS)
    tileds = [req.tiled_mlp] if req.tiled_mlp is not None else [False, True]
    pins = req.option_pins()  # fused_ops: none unless pinned (module docstring)
    L = workload.model.num_layers  # a pinned split that covers every layer is the plain policy: plans say so with None
    ckl = req.checkpoint_layers if req.checkpoint_layers != L else None
    valid: list[Strategy] = []
    invalid: list[tuple[Strategy | None, str]] = []
    for mode in modes:
        for sp, u, why in _degrees(mode, world, req):
            if why:
                invalid.append((None, why))
                continue
            gas = req.accumulation_steps(max(1, world // sp))
            for ck, sh, loss, tiled in product(ckpts, shards, losses, tileds):
                if ck == "none" and describe_mode(mode).needs_checkpointing and req.checkpointing is None:
                    continue
                st = Strategy.over(
                    mode,
                    sp,
                    world,
                    u,
                    checkpointing=ck,
                    checkpoint_layers=ckl if ck != "none" else None,
                    offload_layers=req.offload_layers if ck == "offload" and req.offload_layers != (ckl or L) else None,
                    offload_stride=(req.offload_stride or 1) if ck == "offload" else 1,
                    sharding=sh,
                    loss_impl=loss,
                    gradient_accumulation_steps=gas,
                    **{**pins, "tiled_mlp": tiled},
                )
                variants = [st]
                if ckl is not None and ck != "none":  # the split is pinned: each host count is a strategy of its own
                    variants = []
                    for host in host_counts(req, st):
                        v = st.model_copy(update=kept_fields(req, L - ckl, st, host))
                        if v not in variants:
                            variants.append(v)
                        if budget_full(v, host, L - ckl):
                            break  # larger counts give this strategy again
                for v in variants:
                    problems = plan_problems(workload, c, v)
                    if problems:
                        invalid.append((v, problems[0]))
                    else:
                        valid.append(v)
    return valid, invalid


def evaluate(
    workload: Workload,
    cluster: ClusterSpec,
    s: Strategy,
    c: Coefficients,
    norms_tiled: bool = True,
    loss_path: str = "seqpar",
) -> Candidate:
    """One strategy predicted; ``norms_tiled`` False: a tool's runtime, whose tiled MLP leaves the model's norms whole;
    ``loss_path`` "trl": TRL's SFTTrainer's loss (estimate_memory)."""
    mem = estimate_memory(workload, cluster, s, c, loss_path=loss_path, norms_tiled=norms_tiled)
    tim = estimate_time(workload, cluster, s, c, norms_tiled)
    return Candidate(s, tim.tokens_per_s, mem.peak_bytes / GIB, mem.fits, mem.reason)


def describe(s: Strategy) -> str:
    deg = f" sp={s.sp_degree}" if s.sp_degree > 1 else ""
    if takes_ulysses_degree(s.mode):
        deg += f" (ulysses {s.ulysses_degree} x ring {s.ring_degree})"
    extra = "".join(f" {t}" for t in tags(s, "name"))
    return f"{s.mode}{deg} dp={s.dp_degree} ckpt={s.checkpointing}{split_tag(s)} {s.sharding} loss={s.loss_impl}{extra}"


def _gpu_fits(w: Workload, cl: ClusterSpec, s: Strategy, c: Coefficients, runtime: Optional[dict] = None) -> bool:
    mem = estimate_memory(w, cl, s, c, **(runtime or {}))
    return mem.required_bytes + mem.margin_bytes <= mem.capacity_bytes


def _first(lo: int, hi: int, ok) -> Optional[int]:
    """The smallest n in [lo, hi] with ok(n), for ok monotone (False ... True); None when ok(hi) is False."""
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def kept_fields(req: AdviseRequest, kept: int, s: Strategy, host: Optional[int] = None) -> dict:
    """The request's kept_saves / kept_host_layers pins for ``s`` split so that ``kept`` layers are past
    checkpoint_layers: kept_host_layers is at most ``host`` (default: the pinned count), at most that many, and at most as
    many as the pinned budget holds (the runtime recomputes the matmuls of the rest, so more would only cost); no kept
    layers, or a tiled MLP (which recomputes its own tiles): nothing to pin."""
    if req.kept_saves != "matmuls" or kept <= 0 or s.tiled_mlp:  # the tiled MLP recomputes its own tiles
        return {}
    host = min((req.kept_host_layers or 0) if host is None else host, kept)
    if host:
        update = {"kept_saves": "matmuls", "kept_host_layers": host, "checkpoint_layers": req.model.num_layers - kept}
        host = kept_host_matmuls(req.workload(), req.cluster, s.model_copy(update=update))[2]
    return {"kept_saves": "matmuls", "kept_host_layers": host}


def host_counts(req: Optional[AdviseRequest], s: Strategy) -> list[Optional[int]]:
    """The kept_host_layers to try for ``s``: a pinned kept_host_layers N is a most, so every count from none to N (each
    moves a different share of the kept layers' matmul outputs to the host: copies against recomputation, host RAM
    against GPU memory); [None] (kept_fields' default, the request's pins) when there is nothing to choose."""
    pin = req.kept_host_layers if req is not None and req.kept_saves == "matmuls" and not s.tiled_mlp else None
    return list(range(min(pin, req.model.num_layers) + 1)) if pin else [None]


def budget_full(v: Strategy, host: Optional[int], kept: int) -> bool:
    """Whether asking ``host`` host-kept layers of ``kept`` got fewer because the pinned budget is full (kept_fields
    caps the count at what it holds): every larger count gives the same strategy."""
    return bool(host) and v.kept_host_layers < min(host, kept)


# offload_stride values the search tries, smallest first, where the host's RAM does not hold every offloaded input:
# each more recomputes more layers' inputs (one more forward of each) and holds more of them on the GPU in backward
OFFLOAD_STRIDES = (1, 2, 3, 4, 6, 8)


def _offload_split(
    w: Workload, cl: ClusterSpec, s: Strategy, c: Coefficients, req: Optional[AdviseRequest], runtime: dict
) -> Optional[Strategy]:
    """Offload's split: as few offloaded layers as the GPU allows (the rest keep their input on the GPU), at the
    smallest offload_stride whose host inputs the host's RAM holds (the request's pinned stride only, if any). None
    when that is the strategy itself (every layer offloaded, one stride) or nothing fits the GPU; where no stride fits
    the host, stride 1's split (the least GPU memory)."""
    L = w.model.num_layers
    pinned = req.offload_stride if req is not None and req.offload_stride else None
    pinned = pinned or (s.offload_stride if s.offload_stride > 1 else None)  # a pin enumerate_strategies applied
    first = None
    for k in (pinned,) if pinned else OFFLOAD_STRIDES:
        if k > L:
            break

        def at(n: int, k=k) -> Strategy:
            return s.model_copy(update={"offload_layers": None if n == L else n, "offload_stride": k})

        # a stride k offloads at least k layers (split_problems); with fewer, stride 1's split is the same strategy.
        # More offloaded layers never need more GPU memory at one stride: a bisection finds the fewest that fit
        host = _first(0 if k == 1 else k, L, lambda n: _gpu_fits(w, cl, at(n), c, runtime))
        if host is None or host == 0:
            if k == (pinned or 1):
                return None  # no offloaded layer is needed (the policy without offload), or none fits the GPU
            break  # a larger stride holds more on the GPU: no larger one fits either
        v = at(host)
        first = first or v
        if estimate_memory(w, cl, v, c, **runtime).fits:
            return None if v == s else v
    return None if first == s else first


def layer_split_variant(
    w: Workload,
    cl: ClusterSpec,
    s: Strategy,
    c: Coefficients,
    req: Optional[AdviseRequest] = None,
    runtime: Optional[dict] = None,
) -> Optional[Strategy]:
    """The strategy's layer split that memory allows, when it differs from all-or-nothing (None otherwise, and when the
    request pinned a split): offload keeps as many layer inputs on the GPU as fit, the rest go to the host (copies the
    time model prices, pageable ones beyond the pinned budget dearest); full and selective let as many of the last layers
    as fit keep all their activations, so backward does not recompute them (Megatron's recompute_num_layers, torchtitan's
    memory budget). GPU memory grows with each layer moved toward the GPU, so each count is a bisection. ``req``'s
    kept_saves / kept_host_layers pins apply to the layers past checkpoint_layers (kept_fields). ``runtime``: how the
    runtime that runs it is priced (evaluate's norms_tiled and loss_path; a tool's, by seqpar.emit.space)."""
    L = w.model.num_layers
    runtime = runtime or {}
    if s.checkpoint_layers is not None or s.offload_layers is not None or s.checkpointing == "none":
        return None
    if s.checkpointing == "offload":
        return _offload_split(w, cl, s, c, req, runtime)

    def at(n: int, host: Optional[int]) -> Strategy:
        return s.model_copy(update={"checkpoint_layers": n, **(kept_fields(req, L - n, s, host) if req is not None else {})})

    splits: list[Strategy] = []  # each host count's split (host_counts), the fastest that fits wins
    last = None  # the previous count's split: one more host-kept layer frees GPU memory, so this one's is at most that
    for host in host_counts(req, s):

        def fits(n: int, host=host) -> bool:
            return _gpu_fits(w, cl, at(n, host), c, runtime)

        if last is not None and fits(last):  # walk down from it (a step or two per count, where a bisection takes ~6)
            checkpointed = last
            while checkpointed > 0 and fits(checkpointed - 1):
                checkpointed -= 1
        else:
            checkpointed = _first(0, L, fits)
        if checkpointed is None:
            break  # not even every layer recomputed fits, and with no layer kept the host count changes nothing
        v = at(checkpointed, host)
        # a count that recomputes as many layers as the one before only adds copies and host RAM: never better; none
        # checkpointed is the policy none, unless the kept layers keep only their matmul outputs
        if checkpointed not in (L, last) and (checkpointed > 0 or v.kept_saves == "matmuls"):
            splits.append(v)
        last = checkpointed
        if checkpointed == 0 or budget_full(v, host, L - checkpointed):
            break  # nothing left to stop recomputing (more host layers only add copies), or larger counts give the
            # same strategies, so the same split
    if len(splits) < 2:
        return splits[0] if splits else None
    fitting = [x for x in (evaluate(w, cl, v, c, **runtime) for v in splits) if x.fits]
    # none fits the host's RAM: the split with the fewest host-kept layers, which needs the least of it
    return max(fitting, key=lambda x: x.tokens_per_s).strategy if fitting else splits[0]


def advise_by_cost(req: AdviseRequest, coeffs: Optional[Coefficients] = None, cluster_note: str = "") -> LaunchPlan:
    """The fastest strategy that fits, with the guide's choice, the departures from it and the alternatives."""
    c = coeffs or load_coefficients()
    w, cl = req.workload(), req.cluster
    valid, invalid = enumerate_strategies(req, w)
    if not valid:
        raise SeqparError(no_valid_strategy(req, w, invalid))
    cands = _predict_all(req, valid, w, cl, c)
    fitting = sorted((x for x in cands if x.fits), key=lambda x: (-x.tokens_per_s, x.peak_gib))
    pinned = len(cands) == 1
    reasons: list[str] = []
    if fitting:
        best = fitting[0]
    else:
        best = min(cands, key=lambda x: x.peak_gib)
        reasons.append(
            f"nothing fits: the smallest footprint is {describe(best.strategy)}: {best.why}; "
            f"see `seqpar advise --max-seq-len` for what fits on this cluster"
        )
    pred = predict(w, cl, best.strategy, c)
    rules_mode, rule_path = tree_mode(req.seq_len, req.cluster)
    reasons.insert(
        0,
        f"cost model: {describe(best.strategy)}: {pred.tokens_per_s:,.0f} tokens/s, peak {pred.peak_memory_gib:.1f} GiB "
        f"allocated ({pred.reserved_memory_gib:.1f} reserved) of {pred.capacity_gib:.1f} GiB, MFU {pred.mfu:.0%}"
        f" ({len(cands)} strategies predicted, {len(fitting)} fit, {len(invalid)} invalid)",
    )
    if rules_mode and not req.mode:
        reasons.append(_departure(rules_mode, best, fitting, cands))
    reasons += _option_notes(req, best, cands, valid, w, cl, c)
    reasons += [f"invalid: {why}" for why in list(dict.fromkeys(r for _, r in invalid))[:5]]
    alts = _alternatives(best, fitting, cands, w, cl, c)
    liger = _liger_alternative(req, best, w, cl, c)
    if liger is not None:
        alts.append(liger)
    rationale = Rationale(
        policy="pinned" if pinned else "cost",
        rule_path=rule_path,
        rules_choice=rules_mode,
        reasons=reasons,
        alternatives=alts,
        cluster_note=cluster_note,
    )
    return written_plan("cost", workload=w, cluster=cl, strategy=best.strategy, prediction=pred, rationale=rationale)


def _predict_all(req: AdviseRequest, valid: list[Strategy], w: Workload, cl: ClusterSpec, c: Coefficients) -> list[Candidate]:
    """Every valid strategy's prediction, except that an unpinned tiled_mlp is predicted only where its untiled twin does not
    fit: tiling costs one more MLP forward and is never faster, so it can only win where it is the one that fits."""
    if req.tiled_mlp is not None:
        out = [evaluate(w, cl, s, c) for s in valid]
    else:
        tiled = {s.model_copy(update={"tiled_mlp": False}): s for s in valid if s.tiled_mlp}
        out = []
        for s in valid:
            if s.tiled_mlp:
                continue
            x = evaluate(w, cl, s, c)
            out.append(x)
            if not x.fits and s in tiled:
                out.append(evaluate(w, cl, tiled[s], c))
    # each checkpointing strategy's layer split, where memory allows one between all and nothing (unless the request pins it)
    if req.checkpoint_layers is not None or req.offload_layers is not None:
        return out
    variants = (
        layer_split_variant(w, cl, x.strategy, c, req) for x in list(out) if x.fits or x.strategy.checkpointing == "offload"
    )
    return out + [evaluate(w, cl, v, c) for v in variants if v is not None]


def _departure(rules_mode: str, best: Candidate, fitting: list[Candidate], cands: list[Candidate]) -> str:
    if best.strategy.mode == rules_mode:
        return f"rules: {rules_mode}; cost model agrees"
    same = [x for x in fitting if x.strategy.mode == rules_mode]
    if same:
        gain = best.tokens_per_s / same[0].tokens_per_s - 1
        return f"rules: {rules_mode}; cost model: {best.strategy.mode} {gain:.0%} faster, both fit"
    tried = [x for x in cands if x.strategy.mode == rules_mode]
    if tried:
        low = min(tried, key=lambda x: x.peak_gib)
        return f"rules: {rules_mode}; cost model: {best.strategy.mode}, because {rules_mode} does not fit ({low.why})"
    return f"rules: {rules_mode}; cost model: {best.strategy.mode}, because {rules_mode} is invalid here"


def _option_notes(
    req: AdviseRequest,
    best: Candidate,
    cands: list[Candidate],
    valid: list[Strategy],
    w: Workload,
    cl: ClusterSpec,
    c: Coefficients,
) -> list[str]:
    """Why tiled_mlp is on (its untiled twin does not fit), and whether pinning fused_ops liger would be faster or fit."""
    out = []
    s = best.strategy
    if s.tiled_mlp and req.tiled_mlp is None and best.fits:
        whole = NO_SPLIT  # the twin under any layer split of its own
        untiled = s.model_copy(update={"tiled_mlp": False, **whole})
        twins = sorted(
            (x for x in cands if x.strategy.model_copy(update=whole) == untiled), key=lambda x: (not x.fits, -x.tokens_per_s)
        )
        twin = twins[0] if twins else None
        if twin is not None and twin.fits:  # the twin fits by a split of its own: tiling is chosen for speed
            out.append(
                f"tiled_mlp: without it, {describe(twin.strategy)}: fits at {twin.tokens_per_s:,.0f} tokens/s; the memory "
                f"the tiles free keeps more of the split on the GPU: {best.tokens_per_s:,.0f} tokens/s "
                f"({best.tokens_per_s / twin.tokens_per_s - 1:+.0%}) for one more MLP forward"
            )
        elif twin is not None:
            out.append(
                f"tiled_mlp: without it, {describe(twin.strategy)}: {twin.why or 'fits'}; tiling the MLP saves "
                f"{twin.peak_gib - best.peak_gib:.1f} GiB for one more MLP forward"
            )
    if req.kept_saves == "matmuls" and s.kept_saves != "matmuls":
        if s.tiled_mlp:
            why = "a tiled MLP recomputes its own tiles"
        elif s.checkpointing == "none":
            why = "checkpointing none keeps every activation of every layer"
        else:
            why = f"checkpointing {s.checkpointing} covers every layer (none is kept)"
        out.append(f"kept_saves matmuls was pinned, but the chosen strategy keeps no layer's matmul outputs: {why}")
    out += _kept_matmuls_note(req, best, w, cl, c)
    if req.fused_ops is not None or cl.accelerator != "cuda":
        return out
    if best.fits:
        alt = evaluate(w, cl, s.model_copy(update={"fused_ops": "liger"}), c)
        if alt.fits and alt.tokens_per_s > best.tokens_per_s:
            out.append(
                f"fused_ops liger (Liger-Kernel's fused RMSNorm, RoPE and SwiGLU; optional: pip install liger-kernel) would "
                f"run {alt.tokens_per_s:,.0f} tokens/s ({alt.tokens_per_s / best.tokens_per_s - 1:+.0%}) at a peak of "
                f"{alt.peak_gib:.1f} GiB; pin --fused-ops liger to use it"
            )
        return out
    fits = [x for x in (evaluate(w, cl, v.model_copy(update={"fused_ops": "liger"}), c) for v in valid) if x.fits]
    if fits:
        top = max(fits, key=lambda x: x.tokens_per_s)
        out.append(
            f"with --fused-ops liger (Liger-Kernel, optional: pip install liger-kernel) {describe(top.strategy)} fits: "
            f"{top.tokens_per_s:,.0f} tokens/s, peak {top.peak_gib:.1f} GiB"
        )
    return out


def _kept_matmuls_note(req: AdviseRequest, best: Candidate, w: Workload, cl: ClusterSpec, c: Coefficients) -> list[str]:
    """Whether pinning kept_saves matmuls would be faster: the chosen full / selective strategy with its layers past
    checkpoint_layers keeping only their matmul outputs, re-split for the memory that frees, and the same with as many
    of those layers' outputs in pinned host memory as the pinned budget holds (--kept-host-layers, the advisor picking the
    count) when that is faster still. Not searched unasked: it pins host memory and its speed rests on a side stream's
    copies hiding under compute (their measurements: BENCHMARKS.md)."""
    s = best.strategy
    if req.kept_saves is not None or not best.fits or s.checkpointing not in ("full", "selective") or s.tiled_mlp:
        return []
    if w.lora is not None:  # the kept matmul outputs are priced for a full fine-tuning's layer, not a LoRA one's
        return []
    if req.checkpoint_layers is not None:
        return []
    whole = s.model_copy(update=NO_SPLIT)
    alt = layer_split_variant(w, cl, whole, c, req.model_copy(update={"kept_saves": "matmuls"}))
    host_req = req.model_copy(update={"kept_saves": "matmuls", "kept_host_layers": w.model.num_layers})
    alt_host = layer_split_variant(w, cl, whole, c, host_req) if cl.accelerator == "cuda" else None
    x = evaluate(w, cl, alt, c) if alt is not None else None
    xh = evaluate(w, cl, alt_host, c) if alt_host is not None and alt_host.kept_host_layers else None
    if x is None or not x.fits or x.tokens_per_s <= best.tokens_per_s:
        x = None
    if xh is None or not xh.fits or xh.tokens_per_s <= max(best.tokens_per_s, x.tokens_per_s if x else 0.0):
        xh = None
    if x is None and xh is None:
        return []
    out = []
    if x is not None:
        out.append(
            f"kept_saves matmuls (the layers past the recomputed ones keep only their matmul outputs and attention's out + "
            f"lse) would run {x.tokens_per_s:,.0f} tokens/s ({x.tokens_per_s / best.tokens_per_s - 1:+.1%}) with "
            f"{alt.checkpoint_layers} of {w.model.num_layers} layers recomputed, at a peak of {x.peak_gib:.1f} GiB: "
            "pin --kept-saves matmuls to use it (the search uses it only when pinned)"
        )
    if xh is not None:
        _, layer_bytes, on_host = kept_host_matmuls(w, cl, alt_host)
        kept = w.model.num_layers - alt_host.checkpoint_layers
        holds = kept_host_matmuls(w, cl, alt_host.model_copy(update={"kept_host_layers": kept}))[2]  # all kept asked
        bound = (
            f"; the pinned budget, {cl.pinned_gib_per_rank:.0f} GiB per rank, holds no more: --pinned-host-gib"
            if holds == on_host < kept
            else ""
        )
        out.append(
            f"kept_saves matmuls with {on_host} kept layers' matmul outputs in pinned host memory "
            f"({on_host * layer_bytes / GIB:.1f} GiB{bound}) would run {xh.tokens_per_s:,.0f} tokens/s "
            f"({xh.tokens_per_s / best.tokens_per_s - 1:+.1%}) with {alt_host.checkpoint_layers} of {w.model.num_layers} "
            f"layers recomputed, at a peak of {xh.peak_gib:.1f} GiB: pin --kept-saves matmuls --kept-host-layers "
            f"{w.model.num_layers} to use it (the search uses it only when pinned)"
        )
    return out


def _liger_alternative(
    req: AdviseRequest, best: Candidate, w: Workload, cl: ClusterSpec, c: Coefficients
) -> Optional[Alternative]:
    """The chosen strategy with Liger's fused kernels, when they were not pinned and would be faster on this CUDA cluster."""
    if req.fused_ops is not None or cl.accelerator != "cuda" or not best.fits:
        return None
    s = best.strategy.model_copy(update={"fused_ops": "liger"})
    pred = predict(w, cl, s, c)
    if pred.oom_risk or pred.tokens_per_s <= best.tokens_per_s:
        return None
    return Alternative(
        strategy=s,
        prediction=pred,
        rejected_because=(
            f"faster, {pred.tokens_per_s:,.0f} vs {best.tokens_per_s:,.0f} tokens/s "
            f"({pred.tokens_per_s / best.tokens_per_s - 1:+.0%}), but Liger-Kernel is an optional dependency: pin --fused-ops liger"
        ),
    )


def _alternatives(best, fitting, cands, w, cl, c) -> list[Alternative]:
    """The best of each other mode (and of each other sharding / checkpointing / tiled_mlp for the chosen mode), and modes
    that never fit; each strategy once (the best of another sharding can also be the best of another tiled_mlp). The
    reason does not repeat the strategy, which the alternative carries."""
    seen, picks, taken = set(), [], {best.strategy}
    for key in ("mode", "sharding", "checkpointing", "tiled_mlp"):
        for x in fitting:
            k = (key, getattr(x.strategy, key))
            if (
                x.strategy not in taken
                and k not in seen
                and getattr(x.strategy, key) != getattr(best.strategy, key)
                and (key == "mode" or x.strategy.mode == best.strategy.mode)
            ):
                seen.add(k)
                taken.add(x.strategy)
                gain = x.tokens_per_s / best.tokens_per_s - 1
                picks.append((x, f"slower: {x.tokens_per_s:,.0f} vs {best.tokens_per_s:,.0f} tokens/s ({gain:+.0%})"))
    for mode in names():
        ms = [x for x in cands if x.strategy.mode == mode]
        if ms and not any(x.fits for x in ms) and mode != best.strategy.mode:
            low = min(ms, key=lambda x: x.peak_gib)
            picks.append((low, f"risks OOM even at its smallest footprint: {low.why}"))
    return [
        Alternative(strategy=x.strategy, prediction=predict(w, cl, x.strategy, c), rejected_because=why) for x, why in picks[:10]
    ]


# --------------------------------------------------------------------------------------------- max context


def _request_for(model: ModelSpec, cluster: ClusterSpec, seq_len: int, **pins) -> AdviseRequest:
    return AdviseRequest(model=model, seq_len=seq_len, cluster=cluster, **{k: v for k, v in pins.items() if v is not None})


def max_seq_len(
    model: ModelSpec,
    cluster: ClusterSpec,
    modes: Optional[list[str]] = None,
    coeffs: Optional[Coefficients] = None,
    limit: int = 2**27,
    **pins,
) -> dict[str, tuple[int, Optional[Strategy]]]:
    """Per mode, the longest seq_len (a multiple of 1024 and of the mode's split) that some allowed strategy fits, and that strategy.

    ``pins``: AdviseRequest fields (optimizer, micro_batch_size, dtype, sp_degree, checkpointing, sharding, loss_impl,
    fused_ops, tiled_mlp; an unpinned tiled_mlp is tried both ways).
    Memory grows with seq_len, so a doubling then a bisection finds the edge; 0 when even the shortest does not fit.
    """
    c = coeffs or load_coefficients()
    out: dict[str, tuple[int, Optional[Strategy]]] = {}
    pinned_split = pins.get("checkpoint_layers") is not None or pins.get("offload_layers") is not None
    for mode in modes or list(names()):
        req0 = _request_for(model, cluster, 1024, mode=mode, **pins)
        w0 = req0.workload()
        any_len = 2 * math.lcm(
            1024, *range(1, cluster.world_size + 1)
        )  # a length every mode splits: the options and heads decide
        strategies, _ = enumerate_strategies(
            req0.model_copy(update={"seq_len": any_len}), w0.model_copy(update={"seq_len": any_len})
        )
        if not strategies:
            out[mode] = (0, None)
            continue

        def fitting(n: int) -> Optional[Strategy]:
            w = w0.model_copy(update={"seq_len": n})
            for s in strategies:
                if n % split_multiple(s.mode, s.sp_degree, s.ulysses_degree):
                    continue
                if estimate_memory(w, cluster, s, c).fits:
                    return s
                offload = s.checkpointing == "offload" and not pinned_split
                partial = layer_split_variant(w, cluster, s, c, req0) if offload else None
                if partial is not None and estimate_memory(w, cluster, partial, c).fits:
                    return partial  # offloading only some layers' inputs fits where all of them overflow the host
            return None

        unit = math.lcm(1024, *(split_multiple(s.mode, s.sp_degree, s.ulysses_degree) for s in strategies))
        n = longest(unit, limit, lambda length: fitting(length) is not None)
        out[mode] = (n, fitting(n) if n else None)
    return out
