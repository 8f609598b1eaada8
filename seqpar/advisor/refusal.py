"""Why the advisor's search has nothing to try: one line that names the rule, the numbers and a fix.

The search (search.py) enumerates modes x degrees x options and drops what the plan rules refuse; when nothing is left,
``no_valid_strategy`` says why in the user's terms: the cluster's ranks as they are ("2 CPU ranks", "8 GPUs"), the
degrees a mode needs and the cluster cannot give (usp_attn: a Ulysses group and a ring of at least 2 ranks each), a pinned
degree that forms no split, or a length that no strategy splits evenly, with the nearest lengths below and above that
one does (checked against the plan rules, not only the multiple).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Optional

from seqpar.advisor.request import AdviseRequest
from seqpar.plan.modes import names, nearest_multiples, split_multiple, splits_sequence, takes_ulysses_degree
from seqpar.plan.rules import plan_problems
from seqpar.plan.specs import ClusterSpec, Strategy, Workload
from seqpar.plan.units import divisors


def _ranks(cl: ClusterSpec) -> str:
    """What the cluster's ranks are, counted: "8 GPUs", "2 CPU ranks"."""
    n = cl.world_size
    return f"{n} CPU rank{'s' if n != 1 else ''}" if cl.accelerator == "cpu" else f"{n} GPU{'s' if n != 1 else ''}"


def no_valid_strategy(req: AdviseRequest, w: Workload, invalid: list[tuple[Strategy | None, str]]) -> str:
    """Why no strategy of the search space can run, in one line with a fix: the length that splits under none of them
    (with the nearest lengths that do), the degrees no mode can take here, or the reason that rules out most."""
    head = f"no valid strategy for seq_len {req.seq_len} on {_ranks(req.cluster)}: "
    if not invalid:
        modes = [req.mode] if req.mode else list(names())
        return head + "; ".join(dict.fromkeys(_no_degrees(m, req) for m in modes))
    if all(v is None for v, _ in invalid):  # a pinned Ulysses degree that forms no hybrid split (_degrees)
        world, u = req.cluster.world_size, req.ulysses_degree
        sps = [req.sp_degree] if req.sp_degree else [d for d in divisors(world) if d >= 2]
        fits = sorted({x for sp in sps for x in range(2, sp) if sp % x == 0})
        return head + (
            f"--ulysses-degree {u} forms no split of sp_degree {_either(sps)} into Ulysses groups and a ring of at "
            f"least 2 ranks each (the Ulysses degree must divide sp_degree and be below it): "
            + (f"pick --ulysses-degree {_either(fits)}" if fits else f"use at least 4 ranks, not {_ranks(req.cluster)}")
        )
    return head + (_length_refusal(req, w, invalid) or Counter(r for _, r in invalid).most_common(1)[0][0])


def _either(xs: list[int]) -> str:
    """[2, 4, 8] -> "2, 4 or 8"."""
    words = [str(x) for x in xs]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _no_degrees(mode: str, req: AdviseRequest) -> str:
    """Why ``mode`` has no degrees to try on the request's cluster with its pins (``_degrees`` yields none)."""
    cl, m = req.cluster, req.model
    world, hybrids = cl.world_size, ", ".join(n for n in names() if takes_ulysses_degree(n))
    more = "--cluster cpu:{n}" if cl.accelerator == "cpu" else "--gpus {n}" + (" (per node)" if cl.nodes > 1 else "")
    if req.ulysses_degree not in (None, 1) and not takes_ulysses_degree(mode):
        return (
            f"--ulysses-degree {req.ulysses_degree} sizes the Ulysses groups of {hybrids}, and {mode} has none: drop "
            f"--ulysses-degree, or pin --mode {hybrids.split(', ')[0]}"
        )
    if not splits_sequence(mode):
        return (
            f"{mode} keeps whole sequences on each rank, so it takes no --sp-degree {req.sp_degree}: drop --sp-degree, "
            f"or pin a mode that splits sequences"
        )
    if takes_ulysses_degree(mode):
        splits = [d for d in divisors(world) if d >= 4 and len(divisors(d)) > 2]  # d = ulysses x ring, each >= 2
        if req.sp_degree:
            where = f"--sp-degree {req.sp_degree} has no such split"
            fix = f"pin an sp_degree in {splits}" if splits else f"use {more.format(n=4)}"
        else:
            where, fix = f"the cluster has {_ranks(cl)}", f"use {more.format(n=4)}"
        return (
            f"{mode} needs a Ulysses degree and a ring degree of at least 2 each (sp_degree = ulysses x ring), so at "
            f"least 4 ranks, with {m.name}'s {m.num_attention_heads} query and {m.num_key_value_heads} KV heads divisible "
            f"by the Ulysses degree; {where}: {fix}, or a mode that splits over {max(world, 2)} ranks "
            f"(--mode zigzag_ring_attn or ulysses_attn)"
        )
    return (
        f"{mode} splits each sequence over at least 2 ranks and the cluster has {_ranks(cl)}: use {more.format(n=2)}, "
        f"or --mode data_parallel"
    )


def _length_refusal(req: AdviseRequest, w: Workload, invalid: list[tuple[Strategy | None, str]]) -> Optional[str]:
    """When the length rules out every strategy tried (seq_len divides by none of their split multiples) and a length
    near it would do: which multiple each mode needs over its degrees and the nearest lengths below and above that some
    strategy takes (None when none near it would: then the length is not the reason to give)."""
    S, cl = req.seq_len, req.cluster
    groups: dict[tuple[str, int, int], list[Strategy]] = {}
    for v, _ in invalid:
        if v is None or S % split_multiple(v.mode, v.sp_degree, v.ulysses_degree) == 0:
            return None  # something else than the length refused it
        groups.setdefault((v.mode, v.sp_degree, v.ulysses_degree), []).append(v)
    below, above = 0, math.inf
    needs: dict[str, dict[int, int]] = {}
    for (mode, sp, u), strategies in groups.items():
        mult = split_multiple(mode, sp, u)
        needs.setdefault(mode, {})[sp] = mult
        for n in set(nearest_multiples(S, mult)) - {S}:
            if any(not plan_problems(w.model_copy(update={"seq_len": n}), cl, v) for v in strategies):
                below, above = (max(below, n), above) if n < S else (below, min(above, n))
    if below == 0 and above == math.inf:
        return None  # no length near it would do: something else than the length refuses them too
    per_mode = "; ".join(
        f"{mode} needs a multiple of " + ", ".join(f"{mult} over sp {sp}" for sp, mult in sorted(sps.items()))
        for mode, sps in needs.items()
    )
    found = [str(n) for n in (below, above) if 0 < n < math.inf]
    return f"seq_len {S} does not split evenly over the ranks: {per_mode}; nearest valid: {' or '.join(found)}"


__all__ = ["no_valid_strategy"]
