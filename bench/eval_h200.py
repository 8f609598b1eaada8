"""One H200: `seqpar eval`'s forward-only peak memory and tokens/s against the advisor's prediction, Llama-2-7B shape
with random weights, synthetic held-out data, one window per length (64K, 128K, 256K, 512K by default).

    source bench/h200_env.sh && python3 bench/eval_h200.py --out $OUT/eval_h200.json

It advises a one-GPU data_parallel plan (`seqpar advise`), then runs `seqpar eval plan.json --seq-len ... --windows 1`
once, so the model is built once and every length runs in the same ranks (a short warm-up forward first). The report
(eval.json) holds each length's measured peak (torch.cuda.max_memory_allocated since the length started), reserved
memory and tokens/s beside the prediction; this script adds the ratios and the advisor's longest evaluable length.

Budget. The forward time of a 7B model grows with S^2 (causal attention, 2 S^2 a d FLOPs per layer: 7.2e16 at 512K, about
2.3 minutes at the H200's ~570 TFLOP/s cuDNN rate; the linear part, 2 * 6.7e9 FLOPs per token, adds ~9 s). Before
running, the advisor's predicted forward time of each length is summed from the shortest up and the lengths past
--budget-s (default 300 s) are dropped, so the call stays within ~6 minutes with start-up and the model build.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_len(text: str) -> int:
    from seqpar.plan.units import parse_seq_len

    return parse_seq_len(text)


def choose(lengths: list[int], model: str, budget_s: float) -> tuple[list[int], list[dict], list[int]]:
    """(lengths to run, their predictions, lengths dropped for the budget), from the advisor's forward-only model."""
    from seqpar.advisor.cluster import cluster_from_flags
    from seqpar.advisor.cost.evaluate import predict_eval
    from seqpar.plan.specs import Strategy
    from seqpar.profiles import get_model

    m, cl = get_model(model), cluster_from_flags("h200", 1)
    keep, preds, dropped, total = [], [], [], 0.0
    for n in sorted(lengths):
        p = predict_eval(m, n, cl, Strategy(mode="data_parallel"), "bf16").to_dict()
        if total + p["forward_time_s"] > budget_s or not p["fits"]:
            dropped.append(n)
            continue
        total += p["forward_time_s"]
        keep.append(n)
        preds.append(p)
    return keep, preds, dropped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--lengths", default="64k,128k,256k,512k")
    p.add_argument("--budget-s", type=float, default=300.0, help="sum of predicted forward times to stay under")
    p.add_argument("--timeout", type=int, default=540, help="seconds for the seqpar eval call")
    p.add_argument("--out", default="eval_h200.json")
    args = p.parse_args()
    lengths, preds, dropped = choose([parse_len(x) for x in args.lengths.split(",")], args.model, args.budget_s)
    print(
        json.dumps({"run": lengths, "dropped_for_budget": dropped, "predicted_s": [round(x["forward_time_s"], 1) for x in preds]})
    )
    result: dict = {"model": args.model, "gpu": "h200 x1", "lengths": lengths, "dropped_for_budget": dropped}
    with tempfile.TemporaryDirectory() as tmp:
        plan, out = Path(tmp) / "plan.json", Path(tmp) / "eval"
        adv = [sys.executable, "-m", "seqpar.cli", "advise", "--model", args.model, "--gpu", "h200", "--gpus", "1"]
        adv += ["--seq-len", str(min(lengths)), "--mode", "data_parallel", "--optimizer", "none", "-o", str(plan)]
        subprocess.run(adv, check=True, stdout=subprocess.DEVNULL)
        cmd = [sys.executable, "-m", "seqpar.cli", "eval", str(plan), "--seq-len", ",".join(map(str, lengths))]
        cmd += ["--windows", "1", "--buckets", "8", "--data", "synthetic", "--output", str(out), "--json", "--force"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = "timeout", "", (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        result["wall_s"] = time.perf_counter() - t0
        result["stderr_tail"] = stderr[-4000:]
        if rc != 0:
            result.update(ok=False, exit=rc, oom="out of memory" in stderr.lower() or "OutOfMemory" in stderr)
        partial = out / "eval.json"  # the ranks rewrite it after every length: what finished before a failure
        report = json.loads(stdout) if rc == 0 else json.loads(partial.read_text()) if partial.is_file() else None
        if report is not None:
            rows = []
            for r in report["lengths"]:
                m, pr = r["measured"], r["predicted"] or {}
                rows.append(
                    {
                        "seq_len": r["seq_len"],
                        "loss": r["loss"],
                        "measured": m,
                        "predicted": pr,
                        "peak_ratio": m["peak_memory_gib"] / pr["peak_memory_gib"] if pr else None,
                        "reserved_ratio": m["reserved_memory_gib"] / pr["reserved_memory_gib"] if pr else None,
                        "tokens_per_s_ratio": m["tokens_per_s"] / pr["tokens_per_s"] if pr else None,
                    }
                )
                print(json.dumps({k: rows[-1][k] for k in ("seq_len", "peak_ratio", "tokens_per_s_ratio")}), flush=True)
            result.update(rows=rows, max_eval_seq_len=report["max_eval_seq_len"], report=report)
            result.setdefault("ok", True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}: ok={result['ok']}")


if __name__ == "__main__":
    main()
