"""Forward-only evaluation in a plan's layout: what ``seqpar eval`` starts on every rank with torchrun
(``python -m seqpar.runtime.eval --plan plan.json ...``; seqpar.plan.jobspec.eval_job builds the command).

The model runs forward under ``torch.no_grad`` in the plan's mode and degrees: no optimizer, no gradients, no
checkpointing; weights whole on every rank in the model dtype (the plan's on CUDA, fp32 on CPU ranks, kept exact). Each
forward stops at the final hidden state and seqpar.runtime.eval.forward.token_scores derives every token's cross-entropy and
argmax a chunk of tokens at a time, so the (tokens, vocab) fp32 logits never exist. The plan's sharding, checkpointing,
loss_impl, fused_ops and tiled_mlp are training choices: eval applies none of them.

Exactness. A window of seq_len + 1 held-out tokens (seqpar.runtime.data.windows's windows: inputs window[:-1], targets
window[1:], as in training) is split by seqpar.runtime.parallel.inputs.prepare_inputs; each rank scores its shard's tokens at
their global positions, and every rank's float64 sums are all-reduced once at the end. The loss is therefore
sum / count over every token of every window whatever the degrees, never a mean of per-rank means. Data-parallel groups
read different windows (window k goes to group k mod dp_degree); the sequence-parallel ranks of a group share one.

Rank 0 writes ``eval.json`` (perplexity) or ``needle.json`` (seqpar.runtime.eval.needle) atomically, with each length's
measured peak memory and tokens/s beside the advisor's prediction that ``seqpar eval`` hands in (``--prediction``).
Errors in the input are one line and exit code 2 on every rank.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from seqpar.plan.errors import SeqparError
from seqpar.plan.flags import OptionsParser
from seqpar.plan.job_options import EvalJobOptions
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.modes import ulysses_arg
from seqpar.plan.safe import printable
from seqpar.runtime.eval.forward import Evaluator, check_head, perplexity, score
from seqpar.runtime.train.run_files import read_file, write_file

REPORTS = {"perplexity": "eval.json", "needle": "needle.json"}


def parser() -> OptionsParser:
    """The eval job's argv parser, built from EvalJobOptions (seqpar.plan.job_options); ``parse_args`` returns one."""
    return OptionsParser(EvalJobOptions, prog="python -m seqpar.runtime.eval", description=__doc__.split("\n\n")[0])


def preflight(
    task: str,
    lengths: list[int],
    data: str | None,
    tokenizer_path: str | None,
    vocab: int,
    depths: list[float],
    samples: int,
    *,
    trust_remote_code: bool = False,
) -> None:
    """The input checks that need no process group, run before any rank starts (every rank repeats them): the held-out
    data holds a window of every length (perplexity), the needle prompt fits every length. SeqparError otherwise.
    ``trust_remote_code``: a tokenizer folder may run the code it ships (--trust-remote-code)."""
    from seqpar.runtime.data.windows import TokenData, open_data

    if data and data != "synthetic" and Path(data).is_file() and Path(data).stat().st_size == 0:
        raise SeqparError(
            f"held-out data file {printable(data)!r} is empty (0 bytes); pass a file with at least seq_len + 1 tokens"
        )
    if task == "needle":
        from seqpar.runtime.eval.needle import build_prompts

        build_prompts(lengths, depths, samples, tokenizer_path, data, vocab, trust_remote_code=trust_remote_code)
        return
    first = open_data(
        data or "synthetic",
        seq_len=min(lengths),
        vocab_size=vocab,
        tokenizer_path=tokenizer_path,
        trust_remote_code=trust_remote_code,
    )
    for L in sorted(lengths):
        TokenData(first.name, L, vocab, first.tokens)  # refuses a length with no whole window (one line)


def eval_dtype(plan: LaunchPlan, device: torch.device) -> tuple[torch.dtype, str]:
    """Weights in the model dtype on CUDA (nothing is updated, so no fp32 master); fp32 on CPU, where runs are checks."""
    want = plan.workload.dtype
    if device.type != "cuda":
        return torch.float32, f"fp32 on CPU (plan asks {want}; CPU runs are for checks, kept exact)"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[want], f"{want} weights, no autocast"


def measured(ev: Evaluator, tokens: int, fn: Callable[[], Any]) -> tuple[Any, dict]:
    """Run fn (collective) and measure it: peak memory (max over ranks: the CUDA allocator's peaks since fn started; on
    CPU the process's peak RSS, which cannot be reset) and tokens/s of the whole world (tokens over the slowest rank)."""
    from seqpar.runtime.train.report import memory_now

    cuda = ev.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(ev.device)
        torch.cuda.reset_peak_memory_stats(ev.device)
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize(ev.device)
    dt = time.perf_counter() - t0
    mem = memory_now(ev.device)
    v = torch.tensor([mem["peak_allocated_gib"], mem["peak_reserved_gib"], dt], dtype=torch.float64, device=ev.device)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    peak, reserved, slowest = v.tolist()
    return out, {
        "peak_memory_gib": peak,
        "reserved_memory_gib": reserved,
        "tokens_per_s": tokens / slowest if slowest > 0 else 0.0,
        "time_s": slowest,
        "memory": "CUDA allocator peak" if cuda else "peak RSS of the process (CPU)",
    }


def setup(args: EvalJobOptions, dtype: torch.dtype | None = None) -> tuple[LaunchPlan, Evaluator, dict]:
    """Plan, process groups and the model in the plan's mode; ``dtype`` overrides eval_dtype (the tests' float64).
    Collective over the job."""
    from transformers.utils import logging as hf_logging

    from seqpar.runtime.hf.apply import apply
    from seqpar.runtime.hf.model import build_model
    from seqpar.runtime.train import engine

    hf_logging.disable_progress_bar()
    plan = LaunchPlan.load(args.plan)
    s, w = plan.strategy, plan.workload
    topo = engine.init_distributed(plan)
    dtype, reason = (dtype, f"{dtype} (set by the caller)") if dtype is not None else eval_dtype(plan, topo.device)
    # A model folder keeps its own RoPE base (an export records its stage's); random weights take the plan's.
    theta = None if args.model_path else plan.training.rope_theta
    model = build_model(
        w.model,
        model_path=args.model_path,
        seed=plan.training.seed,
        rope_theta=theta,
        device=topo.device,
        dtype=dtype,
        trust_remote_code=args.trust_remote_code,  # the folder's own shape: seqpar eval predicts with it
    )
    check_head(model)
    u = ulysses_arg(s.mode, s.ulysses_degree)
    apply(model, s.mode, group=topo.sp_group, ulysses_degree=u, checkpointing="none")
    model.eval().requires_grad_(False)
    model.to(device=topo.device, dtype=dtype)
    ev = Evaluator(model, s.mode, s.sp_degree, topo.sp_rank, s.dp_degree, topo.dp_rank, u, topo.device)
    from seqpar.runtime.parallel.kernels import select_backend

    notes = {"dtype": reason, "device": topo.device.type, "backend": select_backend(topo.device, dtype), "rank": topo.rank}
    return plan, ev, notes


def warm_up(ev: Evaluator) -> None:
    """One short forward before timing on CUDA (kernel selection, cuBLAS/cuDNN handles, allocator growth)."""
    if ev.device.type != "cuda":
        return
    from seqpar.plan.modes import split_multiple

    n = split_multiple(ev.mode, ev.sp_degree, ev.ulysses_degree) * 64
    ids = torch.zeros(1, n, dtype=torch.long)
    score(ev, ids, ids)


def run(args: EvalJobOptions, dtype: torch.dtype | None = None) -> dict | None:
    """Evaluate; rank 0 writes the report after every length ("complete": false until the last, so a length that fails,
    e.g. out of memory, leaves the ones before it) and returns it; other ranks return None. Collective over the job."""
    from seqpar.runtime.data.windows import TokenData, open_data

    plan, ev, notes = setup(args, dtype)
    lengths = list(args.seq_len) or [plan.workload.seq_len]
    predicted = _prediction(args.prediction)
    vocab = ev.model.config.vocab_size
    warm_up(ev)
    rows: list[dict] = []
    if args.task == "needle":
        from seqpar.runtime.eval.needle import build_prompts, sweep

        depths = list(args.depths)
        prompts, tok = build_prompts(
            lengths,
            depths,
            args.samples,
            args.tokenizer or args.model_path,
            args.data,
            vocab,
            trust_remote_code=args.trust_remote_code,
        )
        extra = {"prompts": "text (a tokenizer)" if tok is not None else "token ids (no tokenizer)"}
    else:
        stream = open_data(
            args.data or "synthetic",
            seq_len=min(lengths),
            vocab_size=vocab,
            seed=plan.training.seed,
            tokenizer_path=args.tokenizer or args.model_path,
            trust_remote_code=args.trust_remote_code,
        )
        extra = {}
    for L in lengths:
        if args.task == "needle":
            mine = [p for p in prompts if p.seq_len == L]
            cells, meas = measured(ev, L * len(mine), lambda mine=mine: sweep(ev, mine, tok))
            row = {"seq_len": L, "cells": cells}
        else:  # one token stream, cut into windows of each length
            data = TokenData(stream.name, L, vocab, stream.tokens, stream.seed)
            data.corpus = getattr(stream, "corpus", None)  # its scored mask: a chat's assistant tokens
            tokens = min(args.windows, data.num_windows) * L
            row, meas = measured(ev, tokens, lambda data=data: perplexity(ev, data, args.windows, args.buckets, args.score))
            row["windows_requested"] = args.windows
        rows.append({**row, "measured": meas, "predicted": predicted.get("lengths", {}).get(str(L))})
        if notes["rank"] == 0:
            out = write_report(args, plan, notes, rows, predicted, extra, complete=len(rows) == len(lengths))
    return out if notes["rank"] == 0 else None


def write_report(args, plan: LaunchPlan, notes: dict, rows: list[dict], predicted: dict, extra: dict, complete: bool) -> dict:
    import transformers

    import seqpar

    s = plan.strategy
    report = {
        "task": args.task,
        "complete": complete,
        "plan": str(args.plan),
        "strategy": {"mode": s.mode, "sp_degree": s.sp_degree, "dp_degree": s.dp_degree, "ulysses_degree": s.ulysses_degree},
        "model": args.model_path or f"{plan.workload.model.name} (random weights, seed {plan.training.seed})",
        "data": args.data or ("synthetic" if args.task == "perplexity" else "built-in filler / synthetic tokens"),
        **{k: notes[k] for k in ("dtype", "device", "backend")},
        **extra,
        "lengths": rows,
        "max_eval_seq_len": predicted.get("max_eval_seq_len"),
        "versions": {"seqpar": seqpar.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }
    if args.task == "needle":
        from seqpar.runtime.eval.needle import grid

        report.update(grid(rows))
    write_file(Path(args.output) / REPORTS[args.task], json.dumps(report, indent=2) + "\n", "eval report")
    return report


def _prediction(path: str | None) -> dict:
    """seqpar eval's prediction file (it wrote it into the output folder just before), read without following a link."""
    if not path:
        return {}
    raw = read_file(path, "prediction file", limit=1 << 24)
    try:
        data = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("lengths", {}), dict):
        raise SeqparError(f"prediction file {printable(path)!r} is not the JSON object seqpar eval writes; run seqpar eval again")
    return data


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        run(args)
        from seqpar.runtime.train.engine import shutdown

        shutdown()
    except SeqparError as e:
        print(f"seqpar: error: {printable(e, 4000)}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
