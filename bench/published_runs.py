"""Published multi-GPU runs against the cost model: per-row errors, OOM verdicts, longest lengths and rankings.

    python bench/published_runs.py                 # markdown on stdout (the BENCHMARKS.md section's tables)
    python bench/published_runs.py --json OUT.json # also every row's prediction and errors as JSON

Rows and citations: seqpar/profiles/published_runs.json (schema: seqpar/advisor/cost/published.py); each is priced with
its configuration pinned (seqpar/advisor/cost/published_predict.py). Errors are predicted / published - 1. A row the
targets apply to (multi-GPU, not fitted on, fully stated, representable) must land memory within 10% and tokens/s within
15%; every published OOM must be flagged. CPU only: no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from seqpar.advisor.cost.published import load_published_runs
from seqpar.advisor.cost.published_predict import RowResult, compare_all, longest_fitting, rank
from seqpar.plan.files import write_atomic


def _pct(x) -> str:
    return "" if x is None else f"{x:+.1f}%"


def _num(x, fmt: str = ",.0f") -> str:
    return "" if x is None else format(x, fmt)


def _oom(v) -> str:
    return {True: "OOM", False: "ran", None: ""}[v]


def _config(r: RowResult) -> str:
    c, s = r.row.config, r.row
    deg = f" sp{c.sp_degree}" if c.sp_degree > 1 else ""
    extra = "".join(f" {x}" for x, on in (("liger", c.fused_ops == "liger"), ("tiled", c.tiled_mlp)) if on)
    return f"{s.gpus}x {s.hardware.gpu}, {c.mode}{deg}, {c.sharding}, ckpt {c.checkpointing}, loss {c.loss_impl}{extra}"


def _status(r: RowResult) -> str:
    if r.fitted_on:
        return "fitted on"
    if r.row.gpus == 1:
        return "1 GPU (shown)"
    if not r.row.representable:
        return "not representable"
    if not r.row.fully_stated:
        return "not fully stated"
    return "**miss**: " + "; ".join(r.failures) if r.failures else "meets targets"


def table(results: list[RowResult]) -> list[str]:
    out = [
        "| row | configuration (pinned) | S | memory published / predicted GiB | error | tokens/s published / predicted | error | OOM published / predicted | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r.row.measured
        mem = (
            f"{_num(m.peak_memory_gib, '.1f')} ({m.memory_kind}) / {_num(r.memory_pred_gib, '.1f')}" if m.peak_memory_gib else ""
        )
        tok = f"{_num(m.tokens_per_s)} / {_num(r.prediction.tokens_per_s)}" if m.tokens_per_s else ""
        oom = f"{_oom(m.oom)} / {'OOM' if r.oom_predicted else 'fits'}"
        out.append(
            f"| {r.row.id} | {_config(r)} | {r.row.config.seq_len:,} | {mem} | {_pct(r.memory_error_pct)} | {tok} | "
            f"{_pct(r.tokens_error_pct)} | {oom} | {_status(r)} |"
        )
    return out


def longest(results: list[RowResult]) -> list[str]:
    out = ["| row | published longest that trained | predicted longest that fits | predicted / published |", "|---|---|---|---|"]
    for r in results:
        if r.row.measured.longest and r.row.gpus > 1:
            pred = longest_fitting(r.row)
            out.append(f"| {r.row.id} | {r.row.config.seq_len:,} | {pred:,} | {pred / r.row.config.seq_len:.2f} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write every row's prediction and errors here")
    args = ap.parse_args(argv)
    runs = load_published_runs()
    results = compare_all(runs)
    truth, targeted = runs.ground_truth(), runs.targeted()
    groups = sorted({runs.source_of(r).group for r in truth})
    print(
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d}; machine: {platform.machine()} {platform.system()} (CPU only), Python "
        f"{platform.python_version()}; command: `python bench/published_runs.py`\n"
    )
    print(
        f"{len(runs.rows)} rows from {len(runs.sources)} sources; ground truth (multi-GPU, not fitted on): {len(truth)} rows "
        f"from {len(groups)} independent groups ({', '.join(groups)}); targets apply to {len(targeted)}.\n"
    )
    print("\n".join(table(results)) + "\n")
    print("Longest sequence per configuration (rows whose length is the longest the source trained):\n")
    print("\n".join(longest(results)) + "\n")
    print("Rankings a source makes:\n")
    print("| ranking | published | predicted | same order |\n|---|---|---|---|")
    for k in rank(runs):
        fmt = lambda d: ", ".join(f"{i} {v:,.0f}" for i, v in d.items())  # noqa: E731
        print(f"| {k.ranking_id} | {fmt(k.published)} | {fmt(k.predicted)} | {'yes' if k.same_order else '**no**'} |")
    if args.json:
        rows = [
            {
                "id": r.row.id,
                "source": r.row.source,
                "targeted": r.targeted,
                "prediction": r.prediction.model_dump(),
                "memory_error_pct": r.memory_error_pct,
                "tokens_error_pct": r.tokens_error_pct,
                "oom_published": r.oom_published,
                "oom_predicted": r.oom_predicted,
                "failures": list(r.failures),
                "refused_by_seqpar": r.refused,
            }
            for r in results
        ]
        write_atomic(args.json, json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
