"""DeepSpeed ALST's one-GPU recipe for Llama-3.1-8B on one H200: the longest trainable sequence and tokens/s at given lengths.

The recipe, as ArcticTraining publishes it for one H200 (snowflakedb/ArcticTraining, commit b28638e6, file
projects/sequence-parallelism/run-h200-sp1-llama-8b-liger-offload-tiled-mlp.yml: "max_length: 1_200_000 # ok 136.15 GB";
the README beside it: `export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`), and as its trainer applies it
(arctic_training/trainer/trainer.py, sft_trainer.py, model/liger_factory.py, optimizer/adam_factory.py,
config/trainer.py): DeepSpeed ZeRO-3 with the optimizer and the parameters offloaded to CPU, DeepSpeedCPUAdam (lr 1e-5,
betas 0.9/0.999, weight decay 0.1 except norms), bf16, gradient clipping 1.0, micro batch 1, sequence_parallel_size 1,
Liger-Kernel (RoPE, RMSNorm, fused linear cross-entropy; its SwiGLU off because the MLP is tiled), DeepSpeed's TiledMLP
(ceil(seq / hidden) tiles), activation checkpointing with the checkpointed layer inputs offloaded to CPU, FlashAttention 3.
The recipe's settings, DeepSpeed config and host-memory arithmetic are bench/alst_recipe.py.

Built here from DeepSpeed's ALST components under a DeepSpeed engine, not by running ArcticTraining: arctic-training 0.8.0
pins transformers<5 (the GPU machine has 5.17) and needs wandb, openai, datasets, peft, loguru, devtools, a tokenizer and
a dataset from the Hub. The pieces are the ones ArcticTraining calls: deepspeed.runtime.sequence_parallel.ulysses_sp's
TiledMLP (and TiledFusedLogitsLoss for --loss tiled: the trainer's loss without Liger at sp > 1), DeepSpeed's
CheckpointHiddenStatesOffload for the checkpoint offload (ArcticTraining's own patch replaces the reentrant
CheckpointFunction, which transformers 5's default use_reentrant=False never calls), DeepSpeedCPUAdam, ZeRO-3.

Adaptations to this machine, each recorded in every row's "settings" (none is silent):
- attention: sdpa (the machine has no FlashAttention 3 wheel); --attn auto takes FA3 or FA2 where importable.
- --recipe published keeps fp32 master weights, fp32 gradients and fp32 Adam states on the host: 20 bytes per parameter
  (149.6 GiB for 8.03B parameters) > the 125 GiB usable here, so it cannot start (a preflight says so; --no-preflight
  runs it anyway). --recipe alst-bf16 (the default) changes only the precision, with DeepSpeed's own options
  (bf16_master_weights_and_grads, bf16_optimizer_states, DeepSpeedCPUAdam fp32_optimizer_states=False): 12 bytes per
  parameter (89.7 GiB), the same bf16 AdamW precision as the stock baseline's.

Measured on this host (one H200, 2026-12-04; BENCHMARKS.md, "Llama-3.1-8B against DeepSpeed ALST"; raw rows
bench/results/h200_s6_alst_*.json):
- --recipe published: not run; the preflight refuses it (its host need at any length: 149.6 GiB of states + the 6 GiB
  overhead estimate = 155.6 GiB).
- --recipe alst-bf16 (parameters offloaded, as published): a host OOM at 64K, 112K and 128K, each killed by the kernel
  110-190 s after launch (start-up included). At 64K host_need_gib counts 111 GiB; the machine's used memory (sampled
  every second, bench/results/h200_s6_alst_host_used.log) held at ~102 GiB, then reached 117 GiB the second before the
  kill. With offload_param, host_need_gib is a lower bound.
- --recipe alst-bf16 --no-offload-param (bf16 parameters on the GPU: 2 bytes/param less on the host, 15 GiB more on a GPU
  that has room): 128K trains (first step 71.5 s, 59.0 GiB of the GPU, the machine's used memory 112.1 GiB against 111.8
  predicted); 176K: a host OOM. Its longest on this host lies between 128K and 176K (144K and 160K not run).
The GPU is not the limit: the recipe's own comment has 1.2M tokens in 136 GB of an H200 (its host memory not stated).

Each length runs in its own subprocess (an OOM, GPU or host, leaves the next clean); a run starts only if its estimate
fits in what is left of --budget-s (with --seq, one that does not fit is a printed not-run row, with its estimate; with
--max-seq the search ends there, "budget ended"), and is stopped at what is left. Rows
carry bench/single_gpu.py's fields, plus host memory (peak RSS, machine's used), the first step's time, the
checkpoint-offload counters and the predicted host need. The results file is rewritten after every run.

On the H200 (device tool, carry=[".whl"]; bench/alst_h200.sh installs DeepSpeed from .whl and builds CPU Adam first,
~80 s), e.g. (~3 minutes each):

    bash bench/alst_h200.sh --seq 128k --no-offload-param --steps 1 --warmup 0 --budget-s 300 --out $OUT/alst_128k.json
    bash bench/alst_h200.sh --max-seq --no-offload-param --start 144k --step 16k --steps 1 --warmup 0 --budget-s 560 \
        --out $OUT/alst_max.json

Others: --seq 64k --recipe published --no-preflight (the published precision: host OOM at start-up), --no-ckpt-offload,
--loss tiled (DeepSpeed's TiledFusedLogitsLoss instead of Liger's), --attn auto.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alst_recipe import ALLOC_CONF, RECIPES, ds_config, host_need_gib, outcome, settings  # noqa: E402
from single_gpu import parse_len, shape_spec  # noqa: E402

HOST_RAM_GIB = 125.0  # usable memory of the nvidia-h200 machine (128 GiB installed): the figure the comparison is held to
EST_FLOPS = 400e12  # model FLOP/s to estimate a first run: ~40% MFU, as this repo's long 7B runs (BENCHMARKS.md)
CPU_STEP_S = 15.0  # the CPU Adam step over 8B parameters on 16 cores plus the offload copies: an estimate for the budget
START_S = 150.0  # subprocess start, 8B random init, ZeRO-3 partition + offload, optimizer states: estimate for the budget


def est_run_s(seq_len: int, steps: int, done: list[dict], flops) -> float:
    """Seconds one run should take: start-up plus its steps, scaled from the last finished row by model FLOPs (the CPU
    Adam step and the offload copies are in that row's step time too); START_S, EST_FLOPS and CPU_STEP_S without one."""
    ok = [r for r in done if r.get("ok")]
    if not ok:
        return START_S + steps * (flops(seq_len) / EST_FLOPS + CPU_STEP_S)
    last = ok[-1]
    start = max(30.0, last["wall_s"] - sum(last["all_step_times_s"]))
    return start + steps * last["step_time_s"] * flops(seq_len) / flops(last["seq_len"])


def max_seq_search(run, start: int, step: int, limit: int) -> tuple[list[dict], dict]:
    """Lengths start, start+step, ... up to limit until one fails; ``run(seq_len)`` returns a row, or None when the budget
    has no room for it. The result row says whether the best length is the limit (a failure above it) or a lower bound."""
    rows, best, s, why = [], 0, start, "limit reached"
    while s <= limit:
        r = run(s)
        if r is None:
            why = "budget ended"
            break
        rows.append({**r, "search": "max_seq"})
        if not r.get("ok"):
            why = "host out of memory" if r.get("oom_kind") == "host" else "out of memory" if r.get("oom") else "failed"
            break
        best, s = s, s + step
    return rows, {"search": "result", "max_seq_len": best, "step": step, "stopped_by": why, "exact": why != "budget ended"}


def summary(r: dict) -> dict:
    keys = ("seq_len", "ok", "oom_kind", "tokens_per_s", "first_step_s", "peak_memory_gib", "reserved_memory_gib",
            "host_peak_rss_gib", "host_used_peak_gib", "wall_s")  # fmt: skip
    return {k: r.get(k) for k in keys}


# ------------------------------------------------------------------------------------------------ driver


def one(seq_len: int, args, timeout: float) -> dict:
    """One length in its own process, with the recipe's allocator setting; the row it prints, or why there is none."""
    cmd = [sys.executable, __file__, "--worker", "--seq-len", str(seq_len), *args.passthrough]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # its partial output comes back as bytes on Linux
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else b or ""
        out, rc = text(e.stdout) + text(e.stderr), None
    row = next((json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT ")), None)
    if row is None:
        row = {"seq_len": seq_len, **(outcome(rc, out) if rc is not None else {"ok": False, "oom": False, "timeout_s": timeout,
               "error": f"stopped at the {timeout:.0f} s left of --budget-s/--timeout; " + out[-1000:]})}  # fmt: skip
    row["wall_s"] = round(time.monotonic() - t0, 1)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--spec-json", default="", help=argparse.SUPPRESS)  # tests: a tiny ModelSpec instead of --shape
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--recipe", default="alst-bf16", choices=sorted(RECIPES))
    p.add_argument("--offload-param", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--ckpt-offload", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--tiled-mlp", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--loss", choices=["liger", "tiled", "hf"], default=None, help="liger FLCE (recipe), DeepSpeed's tiled, HF's")
    p.add_argument("--attn", default="sdpa", help="sdpa (default here), flash_attention_3/2, or auto")
    p.add_argument("--loss-shards", type=int, default=0, help="--loss tiled: tiles (0: ~1 GiB of fp32 logits each)")
    p.add_argument("--seq", default="64k,128k")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-seq", action="store_true", help="search the longest trainable length in --step increments")
    p.add_argument("--start", default="96k")
    p.add_argument("--step", default="16k")
    p.add_argument("--limit", default="2m")
    p.add_argument("--budget-s", type=float, default=450.0, help="all runs end inside this; a run starts only if it fits")
    p.add_argument("--timeout", type=float, default=540.0, help="one run's limit")
    p.add_argument("--host-ram-gib", type=float, default=HOST_RAM_GIB)
    p.add_argument("--preflight", action=argparse.BooleanOptionalAction, default=True,
                   help="skip a recipe whose host states alone exceed --host-ram-gib")  # fmt: skip
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.worker:
        from alst_worker import worker

        return worker(args)
    spec = json.loads(args.spec_json) if args.spec_json else shape_spec(args.shape)
    overrides = {"offload_param": args.offload_param, "ckpt_offload": args.ckpt_offload, "tiled_mlp": args.tiled_mlp,
                 "loss": args.loss}  # fmt: skip
    s = settings(args.recipe, overrides)
    args.passthrough = _passthrough(argv if argv is not None else sys.argv[1:])
    from seqpar.plan.flops import model_flops_per_sequence
    from seqpar.plan.specs import ModelSpec

    model = ModelSpec.model_validate(spec)
    flops = lambda n: model_flops_per_sequence(model, n)
    result = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["alst_h200.py", *sys.argv[1:]]), "model": model.name,
              "settings": s, "ds_config": ds_config(s), "host_ram_gib": args.host_ram_gib, "rows": []}  # fmt: skip
    need0 = host_need_gib(model.num_params, spec, s, 0)
    t_start, done = time.monotonic(), result["rows"]

    def run(seq_len: int, steps: int) -> dict | None:
        left = args.budget_s - (time.monotonic() - t_start)
        need = host_need_gib(model.num_params, spec, s, seq_len)
        if args.preflight and need0["total_gib"] > args.host_ram_gib:
            return {"seq_len": seq_len, "ok": False, "oom": True, "oom_kind": "host", "preflight": True, "predicted_host": need,
                    "error": f"not run: the recipe's host states need {need0['total_gib']:.1f} GiB > {args.host_ram_gib} GiB "
                    "at any length (--no-preflight runs it)"}  # fmt: skip
        if est_run_s(seq_len, steps, done, flops) > left:
            return None
        row = {**one(seq_len, args, min(args.timeout, left)), "predicted_host": need}
        print(json.dumps(summary(row)), flush=True)
        return row

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    if args.max_seq:

        def probe(n: int) -> dict | None:
            r = run(n, args.steps + args.warmup)
            if r is not None:  # kept (and saved) as it comes: a command stopped mid-search keeps the rows before it
                done.append(r)
                save()
            return r

        rows, res = max_seq_search(probe, parse_len(args.start), parse_len(args.step), parse_len(args.limit))
        result["rows"] = [*rows, {**res, "model": model.name}]
        print(json.dumps(res), flush=True)
    else:
        for n in (parse_len(x) for x in args.seq.split(",")):
            r = run(n, args.steps + args.warmup)
            if r is None:
                r = {"seq_len": n, "ok": False, "oom": False, "not_run": f"its estimate ({est_run_s(n, args.steps + args.warmup, done, flops):.0f} s) "
                     "does not fit in what is left of --budget-s"}  # fmt: skip
                print(json.dumps(r), flush=True)
            done.append(r)
            save()
    result["runs_s"] = round(time.monotonic() - t_start, 1)
    save()


def _passthrough(argv: list[str]) -> list[str]:
    """The worker gets the recipe and step flags; the driver's own (lengths, search, budget, output) stay here."""
    drop_with_value = {"--seq", "--start", "--step", "--limit", "--budget-s", "--timeout", "--out", "--host-ram-gib"}
    drop = {"--max-seq", "--preflight", "--no-preflight"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop_with_value:
            skip = True
        elif a.split("=", 1)[0] not in drop | drop_with_value:
            out.append(a)
    return out


if __name__ == "__main__":
    main()
