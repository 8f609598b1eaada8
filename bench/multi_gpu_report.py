"""bench/multi_gpu.sh's last stage: the rows `seqpar calibrate` reads, and a one-page report of predicted against measured.

``rows OUT``: every run of the bench that ended (``OUT/runs/<case>/run_report.json``, as `seqpar launch` wrote it) and
every run that ran out of memory (its plan with ``"oom": true``), as one JSON list in ``OUT/rows.json``: the run-report
format seqpar.advisor.cost.measurements reads (``seqpar calibrate OUT/rows.json``).

``report OUT``: ``OUT/report.md`` from what the stages left in OUT (modes.json and verify/, bandwidth.jsonl,
lengths.json and runs/, calibrate.json; status.tsv holds each step's exit codes). A stage not run is said to be missing.
Exit 1 when a verify failed or a step broke (a run out of memory is a measurement, not a failure), else 0.

The prediction error of a run is predicted / measured - 1 (seqpar calibrate's residual). Out of memory is recognised
from the ranks' failure records (``failed-rank<R>.json``: torch's OutOfMemoryError).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from multi_gpu_tables import bandwidth_section, calibrate_section, runs_section, verify_section


def status(out: Path) -> dict[tuple[str, str], tuple[int | None, int | None]]:
    """(stage, case) -> (advise exit code, job exit code; None where it did not run), the last line of each winning."""
    got = {}
    f = out / "status.tsv"
    for line in f.read_text().splitlines() if f.is_file() else []:
        parts = line.split("\t")
        if len(parts) == 4:
            got[(parts[0], parts[1])] = tuple(None if p == "-" else int(p) for p in parts[2:])
    return got


def failure(folder: Path) -> str:
    """The first rank failure recorded in a job's output folder ('' when none)."""
    for f in sorted(folder.glob("failed-rank*.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("kind") in ("error", "invalid"):
            return str(rec.get("message", ""))
    return ""


def is_oom(message: str) -> bool:
    return "OutOfMemoryError" in message or "out of memory" in message.lower()


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def run_cases(out: Path) -> list[dict]:
    """Each run of lengths.json with its outcome, report and plan: ok | oom | no fit | failed | not run."""
    codes = status(out)
    cases = []
    for c in (read_json(out / "lengths.json") or {}).get("runs", []):
        name = f"{c['mode']}-{c['seq_len']}"
        advise, job = codes.get(("run", name), (None, None))
        folder = out / "runs" / name
        report = read_json(folder / "run_report.json") if job == 0 else None
        why = failure(folder) if job not in (None, 0) else ""
        if advise is None:
            outcome = "not run"
        elif advise == 1:
            outcome = "no fit"  # the advisor's plan at this length is predicted not to fit: not launched
        elif advise != 0:
            outcome, why = "failed", f"seqpar advise exit {advise}"
        elif report is not None:
            outcome = "ok"
        elif is_oom(why):
            outcome = "oom"
        else:
            outcome, why = "failed", why or f"seqpar launch exit {job}, no run report"
        plan = read_json(out / "plans" / f"run-{name}.json")
        cases.append({**c, "case": name, "outcome": outcome, "why": why, "report": report, "plan": plan})
    return cases


def verify_cases(out: Path) -> list[dict]:
    """Each verify case of modes.json with its outcome (passed | mismatch | failed | not run) and verify.json."""
    codes = status(out)
    cases = []
    for c in (read_json(out / "modes.json") or {}).get("verify", []):
        name = f"{c['mode']}-sp{c['sp_degree']}" + (f"-u{c['ulysses_degree']}" if c["ulysses_degree"] != 1 else "")
        advise, job = codes.get(("verify", name), (None, None))
        result = read_json(out / "verify" / name / "verify" / "verify.json")
        if advise is None:
            outcome = "not run"
        elif advise != 0 or job is None:
            outcome = f"failed (seqpar advise exit {advise})"
        elif result is not None and result.get("ok") and job == 0:
            outcome = "passed"
        elif result is not None and not result.get("ok"):
            outcome = "mismatch"
        else:
            outcome = f"failed (seqpar verify exit {job})"
        cases.append({**c, "case": name, "outcome": outcome, "result": result})
    return cases


def rows(out: Path) -> list[dict]:
    """What `seqpar calibrate` fits: run reports as written, and the plans of runs out of memory marked oom."""
    got = []
    for c in run_cases(out):
        if c["outcome"] == "ok":
            got.append(c["report"])
        elif c["outcome"] == "oom" and c["plan"] is not None:
            got.append({"plan": c["plan"], "oom": True})
    return got


def report(out: Path, command: str) -> tuple[str, bool]:
    """(the report's markdown, whether everything that ran passed)."""
    from seqpar.advisor.cost.coefficients import load_coefficients

    modes, lengths = read_json(out / "modes.json") or {}, read_json(out / "lengths.json") or {}
    cluster = modes.get("cluster") or lengths.get("cluster") or {}
    cpu = cluster.get("accelerator") == "cpu"
    verify, runs = verify_cases(out), run_cases(out)
    f = out / "bandwidth.jsonl"
    bandwidth = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []
    n = modes.get("ranks") or lengths.get("ranks") or "?"
    broken = [c for c in verify if c["outcome"] != "passed"] + [c for c in runs if c["outcome"] == "failed"]
    codes = status(out)
    broken += [
        {"case": stage} for stage, case in (("bandwidth", "all"), ("calibrate", "rows")) if codes.get((stage, case), (None, 0))[1]
    ]
    lines = [
        f"# Multi-GPU bench: predicted against measured ({n} x {cluster.get('gpu', '?')})",
        "",
        f"`{command}`: {n} {'gloo CPU ranks' if cpu else 'GPUs'}, {cluster.get('link', '?')} inside the node "
        f"({cluster.get('link_gb_s', '?')} GB/s per direction, datasheet). "
        + (
            "Everything that ran passed."
            if not broken
            else f"{len(broken)} step(s) failed: " + ", ".join(c["case"] for c in broken) + "."
        )
        + " The rows for `seqpar calibrate` are `rows.json`; each step's output is under `logs/`.",
        "",
    ]
    lines += verify_section(verify, modes)
    lines += bandwidth_section(bandwidth, cluster, load_coefficients().comm_bandwidth_efficiency)
    calib, ours = read_json(out / "calibrate.json"), len(read_json(out / "rows.json") or [])
    fitted = [c["case"] for c in runs if c["outcome"] in ("ok", "oom")]  # rows.json's order, which calibrate keeps
    refit = dict(zip(fitted, calib["rows"][-ours:])) if calib and ours == len(fitted) else {}
    lines += runs_section(runs, lengths, cpu, refit)
    lines += calibrate_section(calib, ours, cpu)
    return "\n".join(lines) + "\n", not broken


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("rows", "report"))
    ap.add_argument("out", type=Path, help="The bench's output folder.")
    ap.add_argument("--command", default="bash bench/multi_gpu.sh", help="report: the command line named in the report.")
    args = ap.parse_args(argv)
    from seqpar.plan.files import write_atomic

    if args.what == "rows":
        got = rows(args.out)
        write_atomic(args.out / "rows.json", json.dumps(got, indent=1) + "\n")
        print(len(got))
        return 0
    text, ok = report(args.out, args.command)
    write_atomic(args.out / "report.md", text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
