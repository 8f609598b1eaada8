"""Fit the cost model's side_copy_overlap (the share of the host-kept matmul outputs' copies hidden under compute) from
bench/h100_side_copies.sh's rows.

    python bench/fit_side_copy.py bench/results/h100_kept_matmuls_32k_paced.json

Each seqpar row's plan (the one it ran, from its run report) is predicted again for side_copy_overlap 0 to 1 with the
shipped coefficients otherwise. Rows are compared as ratios to the row that keeps no output in host memory (tag
"same0"): the GPU's absolute speed factor cancels, what is left is the copies' cost (and, for the advisor's own split,
what keeping instead of recomputing saves). The fit is the overlap minimising the squared error of those ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.search import evaluate
from seqpar.plan.launch_plan import LaunchPlan


def predict(plan: LaunchPlan, overlap: float, base) -> float:
    c = dataclasses.replace(base, side_copy_overlap=overlap)
    return evaluate(plan.workload, plan.cluster, plan.strategy, c).tokens_per_s


GRID = [i / 100 for i in range(101)]


def fit(rows: list[dict], reference: str = "same0") -> tuple[float, dict]:
    """(the overlap fitted to every host row, {tag: (kept_host_layers, measured ratio, predicted ratio at 0.8, the row's own
    best overlap, predicted ratio there)}) for rows of bench/single_gpu.py tagged by bench/h100_side_copies.sh."""
    rows = [r for r in rows if r.get("ok") and r.get("report")]
    base = load_coefficients()
    plans = {r["tag"]: LaunchPlan.model_validate(r["report"]["plan"]) for r in rows}
    measured = {r["tag"]: r["tokens_per_s"] for r in rows}
    if reference not in plans:
        raise KeyError(reference)
    pred = {t: [predict(p, ov, base) for ov in GRID] for t, p in plans.items()}
    others = [t for t in plans if t != reference and plans[t].strategy.kept_host_layers]

    def err(i: int, tags) -> float:
        return sum((pred[t][i] / pred[reference][i] - measured[t] / measured[reference]) ** 2 for t in tags)

    best = min(range(len(GRID)), key=lambda i: err(i, others))
    table = {}
    for t in others:
        own = min(range(len(GRID)), key=lambda i: err(i, [t]))
        table[t] = (
            plans[t].strategy.kept_host_layers,
            measured[t] / measured[reference],
            pred[t][80] / pred[reference][80],
            GRID[own],
            pred[t][own] / pred[reference][own],
        )
    return GRID[best], table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "rows",
        help="JSON rows of bench/single_gpu.py with a 'tag' each (bench/results/h100_kept_matmuls_32k_paced.json; the unpaced runtime's: h100_kept_matmuls_32k.json)",
    )
    ap.add_argument("--reference", default="same0", help="the tag of the row that keeps nothing in host memory")
    args = ap.parse_args(argv)
    try:
        best, table = fit(json.load(open(args.rows)), args.reference)
    except KeyError:
        print(f"error: no row tagged {args.reference!r} in {args.rows}; pass --reference TAG", file=sys.stderr)
        return 2
    print("| row | kept_host_layers | measured / reference | predicted at 0.8 | row's own best overlap | predicted there |")
    print("|---|---|---|---|---|---|")
    for t, (k, m, p8, own, p_own) in table.items():
        print(f"| {t} | {k} | {m:.4f} | {p8:.4f} | {own:.2f} | {p_own:.4f} |")
    print(f"fitted side_copy_overlap (all rows): {best:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
