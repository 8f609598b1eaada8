"""DeepSpeed ZeRO-2, ZeRO-3 and ZeRO-3 + CPU offload on one H200 through `seqpar launch`, beside the advisor's prediction.

Each row: `seqpar advise` a pinned plan for one H200 (data_parallel, the row's sharding, full recompute, chunked loss,
one sequence per step: tokens_per_step = seq_len, host RAM 128 GiB as the machine has), then `seqpar launch` it for 3
steps of synthetic data on random weights (accelerate + DeepSpeed, bf16, one rank), and read its run_report.json:
peak GPU memory (allocated and reserved), host memory (peak RSS of the rank: offloaded states and pinned buffers live
there), tokens/s (steps 2-3; the first pays for warm-up) and step time, each beside the plan's prediction, with
measured / predicted. The whole report rides along in the row (plan included) for `seqpar calibrate`.

Rows run in the order of ROWS (the most informative first) while the budget lasts: a row starts only when its estimate
(start-up + 3 predicted steps) fits in what is left of --budget-s, so the script ends inside its limit; rows left out are
recorded as such. The results file is rewritten after every row (a run killed mid-way keeps the rows before it).
Lengths chosen for ~7 minutes of runs: Llama-3.2-1B at 16K, 64K and 128K (all three shardings fit to 128K), Llama-2-7B
at 16K and 32K (ZeRO-2/3 on one GPU hold the 16 bytes per parameter of AdamW's states, ~100 GiB of the 141 GiB; the
offload row needs ~128 GiB of host RAM by the prediction, so it runs last).

    bash bench/deepspeed_h200.sh            # on the H200: installs DeepSpeed from the carried archive, then this
    python3 bench/deepspeed_h200.py --out $OUT/deepspeed_h200.json [--budget-s 420] [--only 1b-zero3-64k,...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

STEPS = 3
HOST_RAM_GIB = 128  # the nvidia-h200 machine's memory (device KINDS.md)
START_S = {"llama-3.2-1b": 30.0, "llama-2-7b": 50.0}  # process start, random init, DeepSpeed init: estimates for the budget
SHORT = {"llama-3.2-1b": "1b", "llama-2-7b": "7b"}

# (model, sharding, seq_len), most informative first: one length of every sharding per model, then the length slope.
ROWS = [
    ("llama-3.2-1b", "zero3", 65536),
    ("llama-3.2-1b", "zero2", 65536),
    ("llama-3.2-1b", "zero3_offload", 65536),
    ("llama-2-7b", "zero3", 32768),
    ("llama-2-7b", "zero2", 32768),
    ("llama-3.2-1b", "zero3", 131072),
    ("llama-3.2-1b", "zero3_offload", 131072),
    ("llama-3.2-1b", "zero2", 16384),
    ("llama-2-7b", "zero3", 16384),
    ("llama-2-7b", "zero3_offload", 16384),
]


def label(model: str, sharding: str, seq_len: int) -> str:
    return f"{SHORT[model]}-{sharding}-{seq_len // 1024}k"


def seqpar(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "seqpar.cli", *args], capture_output=True, text=True, **kw)


def advise(model: str, sharding: str, seq_len: int, plan: Path) -> dict:
    pins = ["--mode", "data_parallel", "--sharding", sharding, "--checkpointing", "full", "--loss-impl", "chunked"]
    cluster = ["--gpu", "h200", "--gpus", "1", "--host-ram-gib", str(HOST_RAM_GIB)]
    r = seqpar(
        "advise", "--model", model, "--seq-len", str(seq_len), "--tokens-per-step", str(seq_len), *pins, *cluster, "-o", str(plan)
    )
    if r.returncode != 0:
        raise RuntimeError(f"advise exit {r.returncode}: {r.stderr.strip()[-500:]}")
    return json.loads(plan.read_text())


def run_row(plan_file: Path, final_flag: bool) -> dict:
    """`seqpar launch` the plan for STEPS steps; the row's figures from its run report (or why there is none)."""
    plan = json.loads(plan_file.read_text())
    out = plan_file.parent / "run"
    cmd = ["launch", str(plan_file), "--steps", str(STEPS), "--data", "synthetic", "--output", str(out), "--force"]
    cmd += ["--no-final-checkpoint"] if final_flag else []
    t0 = time.monotonic()
    r = seqpar(*cmd, timeout=540)
    row = {"wall_s": round(time.monotonic() - t0, 1), "exit_status": r.returncode, "predicted": plan["prediction"]}
    report = out / "run_report.json"
    if not report.is_file():
        tail = (r.stdout + r.stderr)[-4000:]
        oom = "out of memory" in tail.lower()
        return {**row, "status": "CUDA out of memory" if oom else "failed (killed: host memory?)" if r.returncode < 0 else "failed",
                "output_tail": tail}  # fmt: skip
    rep = json.loads(report.read_text())
    m, p = rep["measured"], rep["predicted"] or {}
    keys = ("peak_memory_gib", "reserved_memory_gib", "host_memory_gib", "tokens_per_s", "step_time_s")
    row.update(
        status="ok" if r.returncode == 0 else f"report written, then exit {r.returncode}",
        measured={k: m.get(k) for k in keys},
        predicted={k: p.get(k) for k in keys},
        measured_over_predicted={k: round(m[k] / p[k], 3) for k in keys if m.get(k) and p.get(k)},
        step_times_s=rep["step_times_s"],
        engine=rep["engine"],
        dtype=rep["dtype"],
        backend=rep["backend"],
        versions=rep["versions"],
        report=rep,
    )
    if r.returncode != 0:
        row["output_tail"] = (r.stdout + r.stderr)[-2000:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON (rewritten after every row)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="seconds of runs; a row starts only if its estimate fits")
    ap.add_argument("--only", default="", help="comma list of row labels (e.g. 1b-zero3-64k) to run")
    ap.add_argument("--work", default="/tmp/seqpar-deepspeed-bench", help="plans and run folders (deleted per row)")
    args = ap.parse_args()
    only = {x for x in args.only.split(",") if x}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    final_flag = True  # no final checkpoint: 7B AdamW state (~100 GiB) does not fit the machine's disk, and is not measured
    import deepspeed  # noqa: F401  (installed? the rows would all fail the same way otherwise)

    results = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "gpu": _gpu(),
        "deepspeed": deepspeed.__version__,
        "steps": STEPS,
        "final_checkpoint_skipped": final_flag,
        "rows": [],
    }
    t_start = time.monotonic()
    for model, sharding, seq_len in ROWS:
        name = label(model, sharding, seq_len)
        if only and name not in only:
            continue
        row = {"label": name, "model": model, "sharding": sharding, "seq_len": seq_len}
        left = args.budget_s - (time.monotonic() - t_start)
        try:
            (work / name).mkdir(parents=True, exist_ok=True)
            plan = advise(model, sharding, seq_len, work / name / "plan.json")
            estimate = START_S[model] + STEPS * plan["prediction"]["step_time_s"]
            if not final_flag:  # this tree writes the final checkpoint (16 bytes per parameter): it must fit the disk
                need = 16 * {"llama-3.2-1b": 1.24e9, "llama-2-7b": 6.74e9}[model] / 2**30
                if need > shutil.disk_usage(work).free / 2**30 - 8:
                    raise RuntimeError(
                        f"the final checkpoint (~{need:.0f} GiB) would not fit the disk; needs --no-final-checkpoint"
                    )
            if estimate > left:
                row.update(status="not run", reason=f"estimate {estimate:.0f} s > {left:.0f} s left of --budget-s")
            else:
                print(f"[{time.monotonic() - t_start:5.0f} s] {name} (estimate {estimate:.0f} s)", flush=True)
                row.update(run_row(work / name / "plan.json", final_flag))
        except Exception as e:  # one row's failure is a result, not the end of the script
            row.update(status="error", reason=f"{type(e).__name__}: {str(e)[-1500:]}")
        shutil.rmtree(work / name, ignore_errors=True)
        results["rows"].append(row)
        print(f"    {row['status']}: {_line(row)}", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    results["runs_s"] = round(time.monotonic() - t_start, 1)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def _line(row: dict) -> str:
    m, p = row.get("measured"), row.get("predicted") or {}
    if not m:
        return row.get("reason", row.get("output_tail", "")[-300:])
    return (
        f"peak {m['peak_memory_gib']:.1f} GiB (pred {p.get('peak_memory_gib', 0):.1f}), "
        f"host {m['host_memory_gib']:.1f} GiB (pred {p.get('host_memory_gib', 0):.1f}), "
        f"{m['tokens_per_s']:.0f} tok/s (pred {p.get('tokens_per_s', 0):.0f}), {row['wall_s']} s"
    )


def _gpu() -> str:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        return r.stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
