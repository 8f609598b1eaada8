"""Cost-model accuracy: predicted vs measured for every measurement row (published + ours), residuals and leave-one-out.

    python bench/accuracy.py               # markdown table on stdout (paste into BENCHMARKS.md)
    python bench/accuracy.py --update      # also refit and write seqpar/profiles/coefficients.json
    python bench/accuracy.py REPORT.json   # add run reports from `seqpar launch` to the shipped rows

Residual = predicted / measured - 1 after fitting on all rows; LOO = the same when the row is left out of the fit
(its GPU's factors and h0 refitted without it). The summary lines split published (EasyContext) rows from ours.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone

from seqpar.advisor.cost.coefficients import COEFFICIENTS_PATH, load_coefficients
from seqpar.advisor.cost.fit import coefficients_json, evaluate
from seqpar.advisor.cost.measurements import load_measurements
from seqpar.plan.files import write_atomic


def pct(x):
    return "" if x is None else f"{x:+.1%}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="*", help="extra run reports (JSON) or measurement CSVs")
    ap.add_argument("--update", action="store_true", help="write the fitted coefficients to seqpar/profiles/coefficients.json")
    args = ap.parse_args(argv)
    rows = load_measurements() + (load_measurements(args.reports) if args.reports else [])
    res = evaluate(rows, load_coefficients())
    c = res.coefficients
    print(
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d}; machine: {platform.machine()} {platform.system()}, Python {platform.python_version()}; "
        f"command: `python bench/accuracy.py{' ' + ' '.join(args.reports) if args.reports else ''}`\n"
    )
    print(
        "Fitted: global (fallback) "
        + ", ".join(f"{k} = {getattr(c, k):.4g}" for k in ("linear_time_factor", "attn_time_factor"))
        + "; "
        + "; ".join(f"{gpu}: " + ", ".join(f"{k} = {v:.4g}" for k, v in f.items()) for gpu, f in sorted(c.time_factors.items()))
        + "; "
        + ", ".join(
            f"{k} = {getattr(c, k):.4g}"
            for k in (
                "matmul_width_h0",
                "attn_head_dim_d0",
                "elementwise_efficiency",
                "attn_block_tokens",
                "cpu_adam_gparams_per_s",
            )
        )
        + "\n"
    )
    print(
        "| row | source | measured tok/s | predicted tok/s | residual | LOO | measured peak GiB | predicted peak GiB | mem residual | OOM measured / predicted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in res.rows:
        mt = f"{e['measured_tokens_per_s']:,.0f}" if e["measured_tokens_per_s"] else ""
        mm = f"{e['measured_peak_gib']:.1f}" if e["measured_peak_gib"] else ""
        print(
            f"| {e['label']} | {e['source']} | {mt} | {e['predicted_tokens_per_s']:,.0f} | {pct(e['tokens_residual'])} | {pct(e['loo_tokens_error'])} "
            f"| {mm} | {e['predicted_peak_gib']:.1f} | {pct(e['memory_residual'])} | {e['measured_oom']} / {e['predicted_oom']} |"
        )
    within = sum(1 for e in res.rows if e["tokens_residual"] is not None and abs(e["tokens_residual"]) <= 0.10)
    timed = sum(1 for e in res.rows if e["tokens_residual"] is not None)
    print(f"\nmax |residual| {res.max_abs_residual:.1%}, max |LOO| {res.max_abs_loo:.1%}; within 10%: {within} of {timed}")
    for name, pick in (
        ("published", lambda e: e["source"] == "easycontext_a100.csv"),
        ("ours", lambda e: e["source"] != "easycontext_a100.csv"),
    ):
        sel = [e for e in res.rows if pick(e) and e["tokens_residual"] is not None]
        mem = [abs(e["memory_residual"]) for e in res.rows if pick(e) and e["memory_residual"] is not None]
        if sel:
            print(
                f"{name}: max |residual| {max(abs(e['tokens_residual']) for e in sel):.1%}, max |LOO| "
                f"{max(abs(e['loo_tokens_error'] or 0) for e in sel):.1%}"
                + (f", max |memory residual| {max(mem):.1%}" if mem else "")
            )
    unsafe = [e["label"] for e in res.rows if e["measured_oom"] and not e["predicted_oom"]]
    print("configurations that ran out of memory but are predicted to fit: " + (", ".join(unsafe) if unsafe else "none"))
    if args.update:
        write_atomic(COEFFICIENTS_PATH, json.dumps(coefficients_json(c, res, (r.source for r in rows)), indent=2) + "\n")
        print(f"wrote {COEFFICIENTS_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
