"""One GPU: stock transformers, stock + Liger kernels, and `seqpar launch`, on the same model shapes.

Each (variant, shape, seq_len) runs in its own subprocess so an OOM in one leaves the others' memory statistics clean.
Results are JSON rows with the fields the cost model's measurement files use (tokens_per_s, peak_memory_gib, ...).

    PYTHONPATH=. python3 bench/single_gpu.py --shape llama-2-7b --seq 32k,64k,128k --variants stock,liger,seqpar \
        --steps 2 --out $OUT/single_gpu.json
    PYTHONPATH=. python3 bench/single_gpu.py --shape llama-3.2-1b --max-seq --start 64k --step 16k --variants stock
    PYTHONPATH=. python3 bench/single_gpu.py --seq 384k --variants seqpar --seqpar-args "--checkpointing offload" \
        --strategy-set checkpoint_layers=28,offload_layers=20   # the advised plan's strategy edited before launch

Model FLOPs per step (for MFU): seqpar.plan.flops, the count seqpar's predicted and measured MFU use (6 * matmul parameters per
token plus causal attention, 3.5x its forward); recompute is not counted (MFU, not HFU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

H200_DATASHEET_TFLOPS = 989.0  # dense bf16, NVIDIA H200 SXM datasheet
H200_MATMUL_TFLOPS = (
    773.0  # measured bf16 8192^3 matmul on the project's H200 (median of 10), torch 2.11 + CUDA 13.0, December 2026
)


def parse_len(text: str) -> int:
    text = text.strip().lower()
    mult = {"k": 1024, "m": 1024**2}.get(text[-1], 1)
    return int(float(text.rstrip("km")) * mult)


def shape_spec(name: str) -> dict:
    from seqpar.profiles import get_model

    return get_model(name).model_dump()


def hf_config(spec: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"],
        vocab_size=spec["vocab_size"],
        tie_word_embeddings=spec["tie_word_embeddings"],
        rope_theta=spec["rope_theta"],
        max_position_embeddings=max(spec["max_position_embeddings"], 1 << 21),
        use_cache=False,
    )


# ------------------------------------------------------------------------------------------------ worker (one run)


def run_baseline(variant: str, spec: dict, seq_len: int, steps: int, warmup: int, optimizer: str) -> dict:
    import torch

    if variant in ("liger", "peft-liger"):  # peft-liger: the peft variant with Liger's kernels, its fused loss above all
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)  # variant "peft": transformers + peft LoRA (r=32, all linear layers), gradient checkpointing
    cfg = hf_config(spec)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant in ("peft", "peft-liger"):  # transformers + peft, as its docs show it: LoRA r=32 on every linear layer
        from peft import LoraConfig, get_peft_model

        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad when the base is frozen
        model = get_peft_model(model, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5) if optimizer in ("adamw-bf16", "adamw") else None
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {
        "loss": float(loss),
        "step_times_s": times,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "reserved_memory_gib": torch.cuda.max_memory_reserved() / 2**30,
    }


def strategy_set(text: str) -> dict:
    """ "checkpoint_layers=28,offload_layers=20" -> {"checkpoint_layers": 28, ...}; "null" = unset, digits = int."""
    pairs = [kv.split("=", 1) for kv in text.split(",") if kv.strip()]
    return {k.strip(): None if v == "null" else int(v) if v.isdigit() else v for k, v in pairs}


def run_seqpar(
    spec_name: str,
    seq_len: int,
    steps: int,
    warmup: int,
    optimizer: str,
    extra: list[str],
    overrides: dict,
    gpu: str = "h200",
    profile_step: int = 0,
    profile_dir: str = "",
) -> dict:
    """`seqpar advise` a pinned data_parallel plan for one ``gpu`` (h200 by default; its strategy's fields set from ``overrides``, the plan
    validated again), then `seqpar launch` it and read the run report. ``profile_step``: that step runs under the
    profiler (seqpar launch --profile-step), left out of the step times; its summary goes into the row, its trace and
    summary into ``profile_dir`` when given."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        out = Path(tmp) / "run"
        adv = [
            sys.executable,
            "-m",
            "seqpar.cli",
            "advise",
            "--model",
            spec_name,
            "--gpu",
            gpu,
            "--gpus",
            "1",
            "--seq-len",
            str(seq_len),
            "--mode",
            "data_parallel",
            "--sharding",
            "ddp",
            "--optimizer",
            optimizer,
            "-o",
            str(plan),
            *extra,
        ]
        subprocess.run(adv, check=True, stdout=subprocess.DEVNULL)
        if overrides:
            from seqpar.plan.launch_plan import LaunchPlan

            data = json.loads(plan.read_text())
            data["strategy"].update(overrides)
            LaunchPlan.model_validate(data).write(plan)
        cmd = [
            sys.executable,
            "-m",
            "seqpar.cli",
            "launch",
            str(plan),
            "--steps",
            str(warmup + steps),
            "--data",
            "synthetic",
            "--output",
            str(out),
            "--force",
            "--no-final-checkpoint",  # a benchmark's weights are random: writing them would only cost time and disk
            *(["--profile-step", str(profile_step)] if profile_step else []),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        reports = sorted(out.rglob("run_report.json"))
        if proc.returncode != 0 or not reports:
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError("OutOfMemoryError" if "OutOfMemory" in tail or "out of memory" in tail else tail)
        rep = json.loads(reports[-1].read_text())
        metrics = [json.loads(x) for x in (reports[-1].parent / "metrics.jsonl").read_text().splitlines() if x.strip()]
        profiles = sorted((reports[-1].parent / "profile").glob("rank*_step*.json"))
        profile = [json.loads(f.read_text()) for f in profiles]
        if profile_dir and profiles:
            shutil.copytree(profiles[0].parent, profile_dir, dirs_exist_ok=True)
    profiled = {n - 1 for n in rep.get("profiled_steps", [])}
    times = [t for i, t in enumerate(rep["step_times_s"]) if i >= warmup and i not in profiled]
    return {
        "loss": metrics[-1].get("loss") if metrics else None,
        "step_times_s": times,
        "profile": profile,
        "alloc_retries": [r.get("alloc_retries") for r in rep.get("per_rank", [])],
        "peak_memory_gib": rep["measured"]["peak_memory_gib"],
        "reserved_memory_gib": rep["measured"]["reserved_memory_gib"],
        "predicted": rep["predicted"],
        "strategy": rep["plan"]["strategy"],
        "report": rep,
    }


def worker(args) -> None:
    spec = shape_spec(args.shape)
    row = {
        "variant": args.variant,
        "model": args.shape,
        "seq_len": args.seq_len,
        "optimizer": args.optimizer,
        "options": args.seqpar_args,
        "strategy_set": args.strategy_set,
    }
    try:
        if args.variant == "seqpar":
            extra, overrides = args.seqpar_args.split(), strategy_set(args.strategy_set)
            res = run_seqpar(
                args.shape,
                args.seq_len,
                args.steps + (1 if args.profile else 0),
                args.warmup,
                args.optimizer,
                extra,
                overrides,
                args.gpu,
                args.warmup + args.steps + 1 if args.profile else 0,
                args.profile_dir,
            )
        else:
            res = run_baseline(args.variant, spec, args.seq_len, args.steps, args.warmup, args.optimizer)
        t = sorted(res["step_times_s"])[len(res["step_times_s"]) // 2]
        from seqpar.plan.flops import model_flops_per_sequence
        from seqpar.profiles import get_model

        flops = model_flops_per_sequence(get_model(args.shape), args.seq_len)
        row.update(
            res,
            ok=True,
            step_time_s=t,
            tokens_per_s=args.seq_len / t,
            mfu_datasheet=flops / t / (H200_DATASHEET_TFLOPS * 1e12),
            mfu_matmul_ceiling=flops / t / (H200_MATMUL_TFLOPS * 1e12),
        )
    except Exception as e:  # OOM is a result here, not a failure of the bench
        msg = str(e)
        row.update(ok=False, oom="out of memory" in msg.lower() or "OutOfMemory" in type(e).__name__ + msg, error=msg[-500:])
    print("RESULT " + json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------------------ driver


def one(variant: str, shape: str, seq_len: int, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--variant",
        variant,
        "--shape",
        shape,
        "--seq-len",
        str(seq_len),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--optimizer",
        args.optimizer,
        "--seqpar-args",
        args.seqpar_args,
        "--strategy-set",
        args.strategy_set,
        "--gpu",
        args.gpu,
        *(["--profile", "--profile-dir", args.profile_dir] if getattr(args, "profile", False) else []),
    ]
    # Baselines run with the default allocator settings users get; seqpar launch sets its own (expandable segments).
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    failed = {"variant": variant, "model": shape, "seq_len": seq_len, "ok": False, "oom": False}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:  # a row that says so, so the rows before it are still written
        tail = ((e.stdout or b"") + (e.stderr or b""))[-1500:]  # bytes whatever text= says
        return {**failed, "error": f"timed out after {args.timeout} s: " + tail.decode(errors="replace")}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {**failed, "error": (proc.stdout + proc.stderr)[-1500:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="stock")
    p.add_argument("--variants", default="stock,liger,seqpar")
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--seq", default="32k,64k")
    p.add_argument("--seq-len", type=int, default=0)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--optimizer", default="none", choices=["none", "adamw-bf16", "adamw"])
    p.add_argument("--seqpar-args", default="", help="extra `seqpar advise` flags for the seqpar variant")
    p.add_argument("--strategy-set", default="", help="seqpar variant: strategy fields set in the advised plan (k=v,...)")
    p.add_argument("--gpu", default="h200", help="the GPU profile seqpar's plans are advised for (seqpar advise --gpu)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="seqpar variant: one more step after the timed ones, run under the profiler (seqpar launch --profile-step)",
    )
    p.add_argument("--profile-dir", default="", help="where the profiled step's trace and summary are copied")
    p.add_argument("--max-seq", action="store_true", help="search the longest trainable length in --step increments")
    p.add_argument("--start", default="64k")
    p.add_argument("--step", default="16k")
    p.add_argument("--limit", default="2m")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for variant in args.variants.split(","):
        if args.max_seq:
            s, step, best = parse_len(args.start), parse_len(args.step), 0
            # torch's AdamW creates its moments at the first optimizer step, after the first backward: only a second
            # step's forward and backward run beside them (two bf16 moments: 30 GiB more for an 8B model), so a baseline's
            # trained length needs two steps. seqpar launch allocates them before its first step
            # (seqpar.runtime.train.engine.allocate_states): one step is the steady state's peak.
            warmup = 0 if args.optimizer == "none" or variant == "seqpar" else 1
            while s <= parse_len(args.limit):
                r = one(variant, args.shape, s, argparse.Namespace(**{**vars(args), "steps": 1, "warmup": warmup}))
                r["search"] = "max_seq"
                rows.append(r)
                print(
                    json.dumps({k: r.get(k) for k in ("variant", "seq_len", "ok", "peak_memory_gib", "step_time_s")}), flush=True
                )
                if not r["ok"]:
                    break
                best, s = s, s + step
            rows.append({"variant": variant, "model": args.shape, "max_seq_len": best, "step": step, "search": "result"})
        else:
            for s in (parse_len(x) for x in args.seq.split(",")):
                r = one(variant, args.shape, s, args)
                rows.append(r)
                print(
                    json.dumps(
                        {
                            k: r.get(k)
                            for k in (
                                "variant",
                                "seq_len",
                                "ok",
                                "tokens_per_s",
                                "peak_memory_gib",
                                "reserved_memory_gib",
                                "mfu_datasheet",
                                "error",
                            )
                        }
                    ),
                    flush=True,
                )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
