"""Fit the cost model's side_copy_overlap (the share of the host-kept matmul outputs' copies hidden under compute) from
bench/h100_side_copies.sh's rows.

    python bench/fit_side_copy.py bench/results/h100_kept_matmuls_32k.json

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

from seqpar.advisor.coefficients import load_coefficients
from seqpar.advisor.search import evaluate
from seqpar.schema import LaunchPlan


def predict(plan: LaunchPlan, overlap: float, base) -> float:
    c = dataclasses.replace(base, side_copy_overlap=overlap)
    return evaluate(plan.workload, plan.cluster, plan.strategy, c).tokens_per_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", help="JSON rows of bench/single_gpu.py with a 'tag' each (bench/results/h100_kept_matmuls_32k.json)")
    ap.add_argument("--reference", default="same0", help="the tag of the row that keeps nothing in host memory")
    args = ap.parse_args(argv)
    rows = [r for r in json.load(open(args.rows)) if r.get("ok") and r.get("report")]
    base = load_coefficients()
    plans = {r["tag"]: LaunchPlan.model_validate(r["report"]["plan"]) for r in rows}
    measured = {r["tag"]: r["tokens_per_s"] for r in rows}
    ref = args.reference
    if ref not in plans:
        print(f"error: no row tagged {ref!r} in {args.rows}; pass --reference TAG", file=sys.stderr)
        return 2
    grid = [i / 100 for i in range(101)]
    pred = {t: [predict(p, ov, base) for ov in grid] for t, p in plans.items()}
    others = [t for t in plans if t != ref and plans[t].strategy.kept_host_layers]

    def err(i: int, tags) -> float:
        return sum((pred[t][i] / pred[ref][i] - measured[t] / measured[ref]) ** 2 for t in tags)

    best = min(range(len(grid)), key=lambda i: err(i, others))
    print(f"reference {ref}: measured {measured[ref]:,.0f} tokens/s, predicted {pred[ref][best]:,.0f}")
    print("| row | kept_host_layers | measured / reference | predicted at 0.8 | at the row's own best | row's own best overlap |")
    print("|---|---|---|---|---|---|")
    for t in others:
        own = min(range(len(grid)), key=lambda i: err(i, [t]))
        m = measured[t] / measured[ref]
        p8 = pred[t][80] / pred[ref][80]
        print(
            f"| {t} | {plans[t].strategy.kept_host_layers} | {m:.4f} | {p8:.4f} | {pred[t][own] / pred[ref][own]:.4f} | "
            f"{grid[own]:.2f} |"
        )
    print(f"fitted side_copy_overlap (all rows): {grid[best]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
