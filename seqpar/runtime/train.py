"""The trainer that ``seqpar launch`` starts on every rank: ``python -m seqpar.runtime.train --plan plan.json ...``.

One optimizer step = ``gradient_accumulation_steps`` micro-batches of ``micro_batch_size`` windows per data-parallel
group; each sequence-parallel rank trains on its shard of the group's windows (seqpar.prepare_inputs' layout). The loop
reads its settings from the plan (mode, degrees, sharding, checkpointing, loss_impl, training section); the flags only say
what to train on, for how long and where to write. Errors in the input are one line and exit code 2 on every rank.

Test hooks (environment): SEQPAR_FAULT_RANK + SEQPAR_FAULT_STEP (+ SEQPAR_FAULT_PHASE=step|checkpoint) raise on one rank.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seqpar.errors import SeqparError
from seqpar.schema import LaunchPlan

ENGINES = {
    "ddp": "ddp",
    "fsdp": "fsdp2",
    "zero2": "deepspeed-zero2",
    "zero3": "deepspeed-zero3",
    "zero3_offload": "deepspeed-zero3-offload",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m seqpar.runtime.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True, help="launch plan JSON (seqpar advise -o)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the plan's training.steps)")
    p.add_argument("--data", default="synthetic", help="synthetic | file.jsonl | tokens.bin | tokens.npy | datasets folder")
    p.add_argument("--model-path", default=None, help="local Hugging Face model folder (default: plan's model, random weights)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder for text data (default: --model-path)")
    p.add_argument("--output", default="runs/seqpar", help="folder for checkpoints, run report, metrics and log")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    p.add_argument("--init-from", default=None, help="save_pretrained folder to start the weights from (recipe stages)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="override training.checkpoint_every (0 = only at the end)")
    p.add_argument("--fsdp-cpu-offload", action="store_true", help="FSDP2: keep parameters and optimizer state in host RAM")
    p.add_argument("--report-to", default="", help="comma list: tensorboard, wandb (used only when installed)")
    p.add_argument("--log-every", type=int, default=10, help="log a line every N steps when there is no progress bar")
    return p


def check_output(out: Path, resume: bool) -> None:
    """Refuse to train over another run's checkpoints unless resuming (before anything is written)."""
    ck = out / "checkpoints"
    if not resume and ck.is_dir() and any(p.name.startswith("step-") for p in ck.iterdir()):
        raise SeqparError(f"output {str(out)!r} already holds checkpoints; pass --resume to continue it or pick another --output")


@dataclass
class Run:
    """What a training run holds between steps; ``setup`` builds it on every rank."""

    plan: LaunchPlan
    steps: int  # the optimizer step to reach
    start: int  # the step to continue from: 0, or the resumed checkpoint's
    every: int  # checkpoint interval in steps (0: only at the end)
    out: Path
    topo: Any  # seqpar.runtime.engine.Topology
    log: logging.Logger
    data: Any  # seqpar.runtime.data's windows
    model: Any  # the transformers model (what checkpoints save_pretrained)
    wrapped: Any  # the engine around engine.LossModule(model)
    optimizer: Any
    scheduler: Any
    backward: Any  # DeepSpeed's backward (it scales and steps itself), else None
    autocast_dtype: Any  # torch dtype or None
    topo_state: dict  # what a checkpoint must match to be resumed
    notes: dict  # engine, attention backend and dtype reason: for the log line and the run report

    @property
    def root(self) -> Path:
        return self.out / "checkpoints"


def _ulysses_degree(plan: LaunchPlan) -> int | None:
    """The runtime's ulysses_degree argument: the plan's for usp_attn, None for the other modes."""
    return plan.strategy.ulysses_degree if plan.strategy.mode == "usp_attn" else None


def setup(args: argparse.Namespace) -> Run:
    """Plan, data, process groups, model (attention mode, checkpointing, fused ops, tiled MLP), engine, optimizer, and
    the state of a resumed run. Collective over the job."""
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from seqpar.jobspec import require_deepspeed, uses_deepspeed
    from seqpar.runtime import checkpoint as ckpt
    from seqpar.runtime import engine
    from seqpar.runtime.data import open_data
    from seqpar.runtime.fused import apply_fused_ops
    from seqpar.runtime.hf import apply
    from seqpar.runtime.model import build_model
    from seqpar.runtime.progress import setup_logging
    from seqpar.runtime.tiled_mlp import tile_mlp

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with ours
    plan = LaunchPlan.load(args.plan)
    s, w, t = plan.strategy, plan.workload, plan.training
    steps = args.steps or t.steps
    every = t.checkpoint_every if args.checkpoint_every is None else args.checkpoint_every
    data = open_data(
        args.data, seq_len=w.seq_len, vocab_size=w.model.vocab_size, seed=t.seed, tokenizer_path=args.tokenizer or args.model_path
    )
    out = Path(args.output)
    check_output(out, args.resume)
    deepspeed = uses_deepspeed(plan)
    require_deepspeed(plan)

    topo = engine.init_distributed(plan)
    if topo.rank == 0:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    log = setup_logging(out, topo.rank)
    topo_state = {
        "world_size": topo.world_size,
        "sp_degree": s.sp_degree,
        "dp_degree": s.dp_degree,
        "mode": s.mode,
        "seq_len": w.seq_len,
        "micro_batch_size": w.micro_batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "data": args.data,
    }
    resume_from, start = ckpt.resume_point(out / "checkpoints", args.resume, topo_state, log)

    # ----- model, engine, optimizer
    init = ckpt.init_weights(args.init_from)
    param_dtype, autocast_dtype, dtype_reason = engine.compute_dtype(plan, topo.device)
    model = build_model(
        w.model,
        model_path=args.model_path,
        seed=t.seed,
        rope_theta=t.rope_theta,
        init_from=str(resume_from / "model") if resume_from else init,
        device=topo.device,
        dtype=param_dtype,
    )
    apply(model, s.mode, group=topo.sp_group, ulysses_degree=_ulysses_degree(plan), checkpointing=s.checkpointing)
    # fused kernels first: tiled_mlp wraps whatever forward the MLP then has (Liger's SwiGLU or the model's own)
    fused_line = apply_fused_ops(model, s.fused_ops, topo.device.type)
    tiled_line = f"tiled MLP: {tile_mlp(model)} MLPs, ~hidden_size tokens per tile" if s.tiled_mlp else "tiled MLP: off"
    model.train()
    model.to(device=topo.device, dtype=param_dtype)
    module = engine.LossModule(model, s.loss_impl, topo.sp_group)
    if deepspeed:
        from seqpar.runtime.deepspeed import prepare

        wrapped, optimizer, scheduler, backward = prepare(module, plan, steps)
    else:
        wrapped = engine.wrap(module, plan, topo, cpu_offload=args.fsdp_cpu_offload)
        optimizer = engine.make_optimizer(wrapped, plan)
        scheduler = engine.make_scheduler(optimizer, plan, steps)
        backward = None
    if resume_from is not None:
        ckpt.load_training_state(resume_from, wrapped=wrapped, optimizer=optimizer, scheduler=scheduler, rank=topo.rank)

    engine_name = ENGINES[s.sharding]
    backend = _backend(topo.device, param_dtype if autocast_dtype is None else autocast_dtype)
    log.info(
        "plan %s: %s sp=%d dp=%d engine=%s checkpointing=%s loss=%s; %s; %s; %s; attention backend %s; %d steps from %d%s",
        args.plan,
        s.mode,
        s.sp_degree,
        s.dp_degree,
        engine_name,
        s.checkpointing,
        s.loss_impl,
        fused_line,
        tiled_line,
        dtype_reason,
        backend,
        steps,
        start,
        f"; weights from {init}" if init and resume_from is None else "",
    )
    return Run(
        plan,
        steps,
        start,
        every,
        out,
        topo,
        log,
        data,
        model,
        wrapped,
        optimizer,
        scheduler,
        backward,
        autocast_dtype,
        topo_state,
        {"engine": engine_name, "backend": backend, "dtype_reason": dtype_reason},
    )


def train_step(r: Run, step: int) -> dict:
    """One optimizer step: gradient_accumulation_steps micro-batches, then the update. Returns the step's metrics
    record (loss = the world mean). Collective over the job."""
    import torch
    import torch.distributed as dist

    from seqpar.runtime import engine
    from seqpar.runtime.inputs import prepare_inputs
    from seqpar.runtime.layout import shard
    from seqpar.runtime.report import memory_now

    s, w, topo = r.plan.strategy, r.plan.workload, r.topo
    ga, mbs, ulysses = s.gradient_accumulation_steps, w.micro_batch_size, _ulysses_degree(r.plan)
    autocast = (
        torch.autocast(topo.device.type, dtype=r.autocast_dtype) if r.autocast_dtype is not None else contextlib.nullcontext()
    )
    t0 = time.perf_counter()
    total = torch.zeros((), dtype=torch.float64, device=topo.device)
    for micro in range(ga):
        ids = r.data.batch(step, micro, topo.dp_rank, grad_accum=ga, dp_degree=s.dp_degree, micro_batch=mbs)  # (B, S+1)
        batch = prepare_inputs(ids[:, :-1], mode=s.mode, rank=topo.sp_rank, world_size=s.sp_degree, ulysses_degree=ulysses)
        # Targets are the window shifted by one (all seq_len of them predicted), split like the inputs.
        batch["labels"] = shard(ids[:, 1:], s.mode, topo.sp_rank, s.sp_degree, dim=1, ulysses_degree=ulysses)
        batch = {k: v.to(topo.device) for k, v in batch.items()}  # each (B, S_local)
        sync = micro == ga - 1
        accumulating = r.backward.accumulate(r.wrapped) if r.backward is not None else engine.no_sync(r.wrapped, sync)
        with accumulating, autocast:
            loss = r.wrapped(batch["input_ids"], batch["position_ids"], batch["labels"])
        if r.backward is not None:  # DeepSpeed: the engine scales by 1/GA and steps at the boundary itself
            r.backward(loss * s.sp_degree)
        else:
            (loss * (s.sp_degree / ga)).backward()  # see engine.py: sum over sp, mean over dp and micro-batches
        total += loss.detach().double()
    grad_norm = None
    if r.backward is not None:  # DeepSpeed stepped (and clipped) at the boundary; the LR schedule is ours, as below
        grad_norm = r.backward.grad_norm() if r.plan.training.grad_clip > 0 else None
        r.scheduler.step()
    elif r.optimizer is not None:
        if r.plan.training.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(r.wrapped.parameters(), r.plan.training.grad_clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # DTensor under FSDP2
        r.optimizer.step()
        r.scheduler.step()
        r.optimizer.zero_grad(set_to_none=True)
    else:
        r.wrapped.zero_grad(set_to_none=True)
    # Every rank of a group holds the same global loss: the world mean is the mean over data-parallel groups.
    dist.all_reduce(total)
    step_loss = float(total) / (topo.world_size * ga)
    if topo.device.type == "cuda":
        torch.cuda.synchronize(topo.device)
    dt = time.perf_counter() - t0
    lr = r.scheduler.get_last_lr()[0] if r.scheduler is not None else 0.0
    rec = {
        "step": step + 1,
        "loss": step_loss,
        "lr": lr,
        "tokens_per_s": _tokens_per_step(r) / dt,
        "step_time_s": dt,
        "peak_memory_gib": memory_now(topo.device)["peak_allocated_gib"],
    }
    if grad_norm is not None:
        rec["grad_norm"] = grad_norm
    return rec


def _tokens_per_step(r: Run) -> int:
    s, w = r.plan.strategy, r.plan.workload
    return w.seq_len * w.micro_batch_size * s.gradient_accumulation_steps * s.dp_degree


def run(args: argparse.Namespace) -> dict:
    """Train; returns {"losses": [...], "report": dict | None (rank 0), "output": str}. Collective over the job."""
    from seqpar.runtime import checkpoint as ckpt
    from seqpar.runtime.progress import ProgressBar
    from seqpar.runtime.report import Metrics, write_report

    r = setup(args)
    s, rank = r.plan.strategy, r.topo.rank
    sequences_per_step = r.plan.workload.micro_batch_size * s.gradient_accumulation_steps * s.dp_degree
    metrics = Metrics(r.out, rank, [x for x in args.report_to.split(",") if x], r.start, r.log)
    bar = ProgressBar(rank, r.steps, r.start, r.log, args.log_every)
    losses, step_times = [], []
    try:
        for step in range(r.start, r.steps):
            ckpt._fault("step", step + 1, rank)
            rec = train_step(r, step)
            step_times.append(rec["step_time_s"])
            losses.append(rec["loss"])
            metrics.log(rec)
            bar.update(rec)
            if (r.every and (step + 1) % r.every == 0) or step + 1 == r.steps:
                ckpt.save(
                    r.root,
                    step + 1,
                    wrapped=r.wrapped,
                    hf_model=r.model,
                    optimizer=r.optimizer,
                    scheduler=r.scheduler,
                    state={"step": step + 1, "windows_read": (step + 1) * sequences_per_step, **r.topo_state},
                    rank=rank,
                )
    finally:
        bar.close()
    report = write_report(
        r.out,
        r.plan,
        step_times=step_times,
        tokens_per_step=_tokens_per_step(r),
        sequences_per_step=sequences_per_step,
        device=r.topo.device,
        backend=r.notes["backend"],
        dtype_reason=r.notes["dtype_reason"],
        engine=r.notes["engine"],
        steps_done=r.steps,
        rank=rank,
    )
    if rank == 0:
        r.log.info("done: %d steps; run report %s", r.steps, r.out / "run_report.json")
    return {"losses": losses, "report": report, "output": str(r.out)}


def _backend(device, dtype) -> str:
    try:
        from seqpar.runtime.kernels import select_backend

        return select_backend(device, dtype)
    except Exception as e:  # the report still gets written; say why the name is missing
        return f"unknown ({e})"


def _fail(rank: str, msg: str, out: str | None) -> None:
    """One line on stderr naming the rank, and a file the launcher reads to name it again after torchrun's summary."""
    line = f"seqpar: rank {rank} failed: {msg}"
    print(line, file=sys.stderr, flush=True)
    if out:
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / f"failed-rank{rank}.txt").write_text(f"{time.time():.6f} {line}\n")
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        run(args)
        from seqpar.runtime.engine import shutdown

        shutdown()
    except SeqparError as e:
        print(f"seqpar: error: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException as e:
        import traceback

        traceback.print_exc()
        _fail(
            rank,
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            args.output if Path(args.output, "checkpoints").is_dir() else None,
        )
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
