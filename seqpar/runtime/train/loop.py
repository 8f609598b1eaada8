"""The trainer that ``seqpar launch`` starts on every rank: ``python -m seqpar.runtime.train --plan plan.json ...``.

One optimizer step = ``gradient_accumulation_steps`` micro-batches of ``micro_batch_size`` windows per data-parallel
group; each sequence-parallel rank trains on its shard of the group's windows (seqpar.prepare_inputs' layout). The loop
reads its settings from the plan (mode, degrees, sharding, checkpointing, loss_impl, training section); the flags only say
what to train on, for how long and where to write. Errors in the input are one line and exit code 2 on every rank.

Checkpoints (seqpar.runtime.checkpoint.saver): every ``--checkpoint-every`` steps (the plan's interval; by default about hourly),
the newest ``--keep-last`` kept, and a final one with the save_pretrained export after the run report is written
(``--no-final-checkpoint`` skips it). A non-finite loss or gradient norm stops the run before its update is applied
(exit 1, one line naming the step; no checkpoint of it is written, ``latest`` stays the last good one), or with
``--skip-nonfinite`` the step's update is skipped and the run goes on.

SIGTERM or SIGINT (what torchrun's agent forwards when ``seqpar launch`` is stopped) ends the run after the current step
with a checkpoint and exit code 128 + the signal; the rank also dies with its launcher (seqpar.runtime.launch.stopping).

Test hooks (environment): SEQPAR_FAULT_RANK + SEQPAR_FAULT_STEP + SEQPAR_FAULT_PHASE (seqpar.runtime.checkpoint.shards.fault).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from seqpar.plan.errors import SeqparError, TrainingStopped
from seqpar.plan.flags import OptionsParser
from seqpar.plan.job_options import TrainOptions
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.modes import ulysses_arg
from seqpar.plan.options import kept
from seqpar.plan.rules import checkpointing_text
from seqpar.plan.safe import printable
from seqpar.runtime.checkpoint import resume

ERROR_LIMIT = 4000  # characters of a rank's error line (escaped: values from files are in it)
ENGINES = {
    "ddp": "ddp",
    "fsdp": "fsdp2",
    "zero2": "deepspeed-zero2",
    "zero3": "deepspeed-zero3",
    "zero3_offload": "deepspeed-zero3-offload",
}


def parser() -> OptionsParser:
    """The trainer's argv parser, built from TrainOptions (seqpar.plan.job_options); ``parse_args`` returns a TrainOptions."""
    return OptionsParser(TrainOptions, prog="python -m seqpar.runtime.train", description=__doc__.split("\n\n")[0])


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
    every: int | None  # checkpoint interval in steps (0: only the final one; None: from the first measured steps)
    out: Path
    topo: Any  # seqpar.runtime.train.engine.Topology
    log: logging.Logger
    data: Any  # seqpar.runtime.data.windows's windows
    model: Any  # the transformers model (what the final checkpoint exports)
    wrapped: Any  # the engine around engine.LossModule(model)
    optimizer: Any
    scheduler: Any
    backward: Any  # DeepSpeed's backward (it scales and steps itself), else None
    autocast_dtype: Any  # torch dtype or None
    facts: dict  # seqpar.runtime.checkpoint.resume's run / layout / training facts: what a checkpoint records
    notes: dict  # engine, attention backend and dtype reason: for the log line and the run report
    skip_nonfinite: bool = False
    tokenizer: dict = field(default_factory=dict)  # the export's tokenizer: shards.export's tokenizer, trust_remote_code
    adapter: Any = None  # workload.lora: peft's PeftModel around ``model`` (what writes the adapter), else None
    merge_lora: bool = False  # --merge-lora: the final export holds the merged model too

    @property
    def root(self) -> Path:
        return self.out / "checkpoints"

    def state(self, step: int) -> dict:
        """What trainer_state.json records for a checkpoint after ``step`` steps."""
        return {"step": step, "windows_read": step * self.facts["run"][resume.WINDOWS_PER_STEP], **self.facts}


def _ulysses_degree(plan: LaunchPlan) -> int | None:
    """The runtime's ulysses_degree argument: the plan's where its mode takes one (usp_attn), None for the other modes."""
    return ulysses_arg(plan.strategy.mode, plan.strategy.ulysses_degree)


def setup(args: TrainOptions) -> Run:
    """Plan, data, process groups, model (attention mode, checkpointing, fused ops, tiled MLP), engine, optimizer, and
    the state of a resumed run. Collective over the job."""
    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from seqpar.plan.jobspec import require_deepspeed, uses_deepspeed
    from seqpar.plan.rules import tiles_norms
    from seqpar.runtime.checkpoint import shards as ckpt
    from seqpar.runtime.checkpoint.storage import interval
    from seqpar.runtime.data import windows as datasrc
    from seqpar.runtime.hf import model as models
    from seqpar.runtime.hf.apply import apply
    from seqpar.runtime.memory.fused import apply_fused_ops
    from seqpar.runtime.memory.tiled_mlp import tile_mlp, tile_norms
    from seqpar.runtime.train import engine, trackers
    from seqpar.runtime.train.progress import setup_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with ours
    plan = LaunchPlan.load(args.plan, allow_env=args.allow_env)
    s, w, t = plan.strategy, plan.workload, plan.training
    steps = args.steps or t.steps
    every, every_why = interval(plan, args.checkpoint_every, steps)
    # Before the process group: a missing cache entry is built by one rank while the others wait on its lock (the
    # launcher built it already, so normally every rank just reads it).
    data_opts = args.data_options
    data = datasrc.open_training_data(
        args.data,
        data_opts,
        seq_len=w.seq_len,
        vocab_size=w.model.vocab_size,
        seed=t.seed,
        tokenizer_path=data_opts.tokenizer or args.model_path,
    )
    out = Path(args.output)
    check_output(out, args.resume)
    trackers.parse(args.report_to)  # an unknown or missing tracker: one line on every rank, before any transfer
    deepspeed = uses_deepspeed(plan)
    require_deepspeed(plan)

    topo = engine.init_distributed(plan)
    if topo.rank == 0:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    log = setup_logging(out, topo.rank)
    # Every rank reads and checks the checkpoint, so a bad one is the same one line everywhere, before any transfer.
    resume_from = resume.latest(out / "checkpoints") if args.resume else None
    saved = resume.read_state(resume_from, foreign=args.accept_foreign_run) if resume_from is not None else None
    start = saved["step"] if saved else 0
    if args.resume and resume_from is None:
        log.info("--resume: no checkpoint in %s yet, starting at step 0", out / "checkpoints")
    log.info("%s", data.note)

    # ----- model: rank 0 builds it with its weights, the others on the meta device (seqpar.runtime.hf.model)
    init = ckpt.init_weights(args.init_from, foreign=args.accept_foreign_run)
    param_dtype, autocast_dtype, dtype_reason = engine.compute_dtype(plan, topo.device)
    # DeepSpeed builds and partitions its own way; a 4-bit base is quantized by every rank from the same weights
    nf4 = w.lora is not None and w.lora.base_dtype == "nf4"
    meta = topo.rank != 0 and not deepspeed and not nf4
    model = models.build_model(
        w.model,
        model_path=args.model_path,
        seed=t.seed,
        rope_theta=t.rope_theta,
        # a resumed checkpoint holds every trained weight; under LoRA that is the adapters only, the base comes from here
        init_from=init if resume_from is None or w.lora is not None else None,
        device=topo.device,
        dtype=param_dtype,
        meta=meta,
        trust_remote_code=data_opts.trust_remote_code,
        match_plan=True,  # the plan's figures and layout are for its model's shape
        quantize_4bit=nf4,  # a 4-bit base is quantized layer by layer as it is built: never whole in 16 bits
        compute_dtype=autocast_dtype or param_dtype,
    )
    adapter = None
    if w.lora is not None:  # before anything wraps the model: every later feature sees the adapters (seqpar.runtime.hf.lora)
        from seqpar.runtime.hf.lora import apply_lora

        # no fp32 states and no autocast (adamw-bf16, none): the adapters in the parameters' dtype, as the plan prices them
        low = w.optimizer in ("adamw-bf16", "none") and autocast_dtype is None and param_dtype != torch.float32
        adapter = apply_lora(
            model,
            w.lora,
            seed=t.seed,
            device=topo.device,
            compute_dtype=autocast_dtype or param_dtype,
            adapter_dtype=param_dtype if low else None,
        )
        dtype_reason += f"; {lora_text(model, w.lora)}"
    facts = resume.facts(
        plan,
        steps,
        data=args.data,
        data_windows=data.num_windows,
        packing=datasrc.packing_fact(args.data, data_opts),
        data_sha256=datasrc.digest_fact(data),
        model=model,
        deepspeed=deepspeed,
        base=init or args.model_path,
    )
    changes = resume.compare(saved, facts, resume_from) if saved else []
    apply(
        model,
        s.mode,
        group=topo.sp_group,
        ulysses_degree=_ulysses_degree(plan),
        checkpointing=s.checkpointing,
        checkpoint_layers=s.checkpoint_layers,
        offload_layers=s.offload_layers,
        kept_saves=s.kept_saves,
        kept_host_layers=s.kept_host_layers,
        pinned_budget_gib=plan.cluster.stated_pinned_gib_per_rank,
        offload_stride=s.offload_stride,
    )
    # fused kernels first: tiled_mlp wraps whatever forward the MLP then has (Liger's SwiGLU or the model's own)
    fused_line = apply_fused_ops(model, s.fused_ops, topo.device.type)
    tiled_line = f"tiled MLP: {tile_mlp(model)} MLPs, ~hidden_size tokens per tile" if s.tiled_mlp else "tiled MLP: off"
    norms_tiled = 0
    if tiles_norms(s):  # the model's own RMSNorms too (Liger's are fused already)
        norms_tiled = tile_norms(model)
        tiled_line += f"; {norms_tiled} RMSNorms tiled alike"
    model.train()
    if not meta:  # under LoRA the dtypes are set (a 16-bit or 4-bit base, fp32 adapters): only the device moves
        model.to(device=topo.device) if adapter is not None else model.to(device=topo.device, dtype=param_dtype)
    module = engine.LossModule(model, s.loss_impl, topo.sp_group)
    if deepspeed:
        from seqpar.runtime.train.deepspeed import prepare

        wrapped, optimizer, scheduler, backward = prepare(module, plan, steps)
    else:
        if nf4:  # every rank built and quantized the same base and drew the same adapters: nothing to share
            wrapped = engine.wrap(module, plan, topo)
        else:
            sharded = s.sharding != "ddp"  # FSDP2 (engine.wrap) shards the meta parameters
            wrapped = models.wrap_from_rank0(
                module,
                lambda m: engine.wrap(m, plan, topo, cpu_offload=args.fsdp_cpu_offload),
                rank=topo.rank,
                device=topo.device,
                sharded=sharded,
                offload=sharded and args.fsdp_cpu_offload and topo.device.type == "cuda",  # shards kept in host memory
            )
        optimizer = engine.make_optimizer(wrapped, plan)
        scheduler = engine.make_scheduler(optimizer, plan, steps)
        backward = None
    if resume_from is not None:
        notes = ckpt.load(
            resume_from,
            saved,
            wrapped=wrapped,
            optimizer=optimizer,
            scheduler=scheduler,
            rank=topo.rank,
            world_size=topo.world_size,
        )
        log.info(
            "resuming from %s (step %d)%s",
            resume_from,
            start,
            "; changed: " + ", ".join(changes + notes) if changes or notes else "",
        )

    engine_name = ENGINES[s.sharding]
    backend = _backend(topo.device, param_dtype if autocast_dtype is None else autocast_dtype)
    log.info(
        "plan %s: %s sp=%d dp=%d engine=%s checkpointing=%s loss=%s; %s; %s; %s; attention backend %s; %d steps from %d%s; "
        "checkpoints %s",
        args.plan,
        s.mode,
        s.sp_degree,
        s.dp_degree,
        engine_name,
        checkpointing_text(s, plan.workload.model.num_layers),
        s.loss_impl,
        fused_line,
        tiled_line,
        dtype_reason,
        backend,
        steps,
        start,
        f"; weights from {init}" if init and resume_from is None else "",
        every_why,
    )
    return Run(
        plan=plan,
        steps=steps,
        start=start,
        every=every,
        out=out,
        topo=topo,
        log=log,
        data=data,
        model=model,
        wrapped=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        backward=backward,
        autocast_dtype=autocast_dtype,
        facts=facts,
        notes={"engine": engine_name, "backend": backend, "dtype_reason": dtype_reason, "norms_tiled": norms_tiled > 0},
        skip_nonfinite=args.skip_nonfinite,
        tokenizer={"tokenizer": data_opts.tokenizer or args.model_path, "trust_remote_code": data_opts.trust_remote_code},
        adapter=adapter,
        merge_lora=args.merge_lora,
    )


def lora_text(model, spec) -> str:
    """The plan's adapters and how many parameters the model trains (peft's count, against the plan's):
    'LoRA r=8 on q_proj v_proj (bf16 base, alpha 16): 12,288 adapter parameters train, the base is frozen'."""
    from seqpar.plan.lora import lora_text as described

    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{described(spec)}: {train:,} adapter parameters train, the base is frozen"


def model_inputs(r: Run, got, guard=None) -> dict:
    """This rank's share of one micro-batch from the data (``r.data.batch``): input ids, position ids, labels and, for
    documents, their boundaries, split as the plan's mode splits the sequence. ``guard``: the group whose ranks must hold
    the same batch (checked)."""
    from seqpar.runtime.parallel.inputs import prepare_inputs
    from seqpar.runtime.parallel.layout import shard

    s, topo, ulysses = r.plan.strategy, r.topo, _ulysses_degree(r.plan)
    if r.data.packed:  # documents: (B, S) ids, labels (-100 unscored) and position ids restarting per document
        batch = prepare_inputs(
            got["input_ids"],
            mode=s.mode,
            rank=topo.sp_rank,
            world_size=s.sp_degree,
            labels=got["labels"],
            position_ids=got["position_ids"],
            ulysses_degree=ulysses,
            balance=True,  # exact (documents are independent): evens the ranks' attention work
            check_group=guard,
        )
    else:  # the stream: a (B, S + 1) window, targets = the window shifted by one (all seq_len of them predicted)
        batch = prepare_inputs(
            got[:, :-1], mode=s.mode, rank=topo.sp_rank, world_size=s.sp_degree, ulysses_degree=ulysses, check_group=guard
        )
        batch["labels"] = shard(got[:, 1:], s.mode, topo.sp_rank, s.sp_degree, dim=1, ulysses_degree=ulysses)
    return batch


def train_step(r: Run, step: int) -> dict:
    """One optimizer step: gradient_accumulation_steps micro-batches, then the update. Returns the step's metrics
    record (loss = the world mean). A non-finite loss or gradient norm skips the update (--skip-nonfinite) or stops the
    run (TrainingStopped) before it is applied; every rank sees the same all-reduced loss and global norm, so all agree.
    Collective over the job."""
    import torch
    import torch.distributed as dist

    from seqpar.runtime.train import engine, nonfinite
    from seqpar.runtime.train.report import memory_now

    s, w, topo = r.plan.strategy, r.plan.workload, r.topo
    ga, mbs = s.gradient_accumulation_steps, w.micro_batch_size
    autocast = (
        torch.autocast(topo.device.type, dtype=r.autocast_dtype) if r.autocast_dtype is not None else contextlib.nullcontext()
    )
    t0 = time.perf_counter()
    total = torch.zeros((), dtype=torch.float64, device=topo.device)
    for micro in range(ga):
        # the first micro-batch of the run checks that every rank of the sequence-parallel group loaded the same windows
        guard = topo.sp_group if step == r.start and micro == 0 and s.sp_degree > 1 else None
        got = r.data.batch(step, micro, topo.dp_rank, grad_accum=ga, dp_degree=s.dp_degree, micro_batch=mbs)
        batch = model_inputs(r, got, guard)
        batch = {k: v.to(topo.device) for k, v in batch.items()}  # each (B, S_local)
        sync = micro == ga - 1
        accumulating = r.backward.accumulate(r.wrapped) if r.backward is not None else engine.no_sync(r.wrapped, sync)
        with accumulating, autocast:
            loss = r.wrapped(batch["input_ids"], batch["position_ids"], batch["labels"], batch.get("cu_seqlens"))
        if r.backward is not None:  # DeepSpeed: the engine scales by 1/GA and steps at the boundary itself
            r.backward(loss * s.sp_degree)
        else:
            (loss * (s.sp_degree / ga)).backward()  # see engine.py: sum over sp, mean over dp and micro-batches
        total += loss.detach().double()
    # Every rank of a group holds the same global loss: the world mean is the mean over data-parallel groups.
    dist.all_reduce(total)
    step_loss = float(total) / (topo.world_size * ga)
    if r.backward is not None:  # DeepSpeed stepped (and clipped) at the boundary: its pre-clip global norm
        grad_norm = r.backward.grad_norm() if r.plan.training.grad_clip > 0 else None
    elif r.optimizer is not None:
        grad_norm = nonfinite.grad_norm(r.wrapped, r.plan.training.grad_clip)
    else:
        grad_norm = None
    bad = nonfinite.problems(step_loss, grad_norm)
    if bad and not r.skip_nonfinite:
        raise TrainingStopped(nonfinite.message(step + 1, bad, r.root, applied=r.backward is not None))
    if r.backward is None and r.optimizer is not None:
        if not bad:
            r.optimizer.step()
        with warnings.catch_warnings():  # a skipped first step: "scheduler.step() before optimizer.step()" is meant
            warnings.simplefilter("ignore", UserWarning)
            r.scheduler.step()  # the schedule stays a function of the step, skipped or not
        r.optimizer.zero_grad(set_to_none=True)
    elif r.backward is not None:
        r.scheduler.step()  # DeepSpeed's optimizer stepped; the LR schedule is ours (saved with the checkpoint)
    else:
        r.wrapped.zero_grad(set_to_none=True)
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
    if bad:
        rec["skipped"] = f"non-finite {', '.join(bad)}; update not applied (--skip-nonfinite)"
        r.log.warning("step %d: %s", step + 1, rec["skipped"])
    return rec


def _tokens_per_step(r: Run) -> int:
    s, w = r.plan.strategy, r.plan.workload
    return w.seq_len * w.micro_batch_size * s.gradient_accumulation_steps * s.dp_degree


def run(args: TrainOptions) -> dict:
    """Train; returns {"losses": [...], "report": dict | None (rank 0), "output": str}. Collective over the job."""
    from seqpar.runtime.checkpoint import shards as ckpt
    from seqpar.runtime.checkpoint.saver import Saver
    from seqpar.runtime.launch import stopping
    from seqpar.runtime.train.progress import ProgressBar
    from seqpar.runtime.train.report import Metrics, update_report, write_report
    from seqpar.runtime.train.trackers import parse as parse_trackers

    r = setup(args)
    rank = r.topo.rank
    if r.start >= r.steps:  # e.g. --resume --steps 2 after step 4: nothing to run, nothing to overwrite
        r.log.info(
            "the checkpoint is at step %d, and --steps is %d: nothing to train; outputs left as they are", r.start, r.steps
        )
        return {"losses": [], "report": None, "output": str(r.out)}
    saver = Saver(
        r,
        every=r.every,
        keep_last=kept(args.keep_last, r.plan.training.keep_last),
        final=args.final_checkpoint,
        async_mode=args.async_checkpoint,
    )
    metrics = Metrics(
        r.out,
        rank,
        parse_trackers(args.report_to),
        r.start,
        r.log,
        plan=r.plan,
        resumed=args.resume,
        project=args.project,
        run_name=args.run_name,
    )
    bar = ProgressBar(rank, r.steps, r.start, r.log, args.log_every)
    losses, step_times = [], []
    profiled: set[int] = set()  # indices into step_times of profiled steps: their profiler overhead stays out of the warm figures

    def report(steps_done: int) -> dict | None:
        return write_report(
            r.out,
            r.plan,
            step_times=step_times,
            profiled=profiled,
            tokens_per_step=_tokens_per_step(r),
            sequences_per_step=r.facts["run"][resume.WINDOWS_PER_STEP],
            device=r.topo.device,
            backend=r.notes["backend"],
            dtype_reason=r.notes["dtype_reason"],
            engine=r.notes["engine"],
            norms_tiled=r.notes["norms_tiled"],
            steps_done=steps_done,
            rank=rank,
        )

    done = r.start
    try:
        for step in range(r.start, r.steps):
            ckpt.fault("step", step + 1, rank)
            if step + 1 == args.profile_step:
                from seqpar.runtime.train.profiling import profiled_step

                with profiled_step(r.out, rank, step + 1, r.topo.device, r.log):
                    rec = train_step(r, step)
                rec["profiled"] = True
                profiled.add(len(step_times))
            else:
                rec = train_step(r, step)
            done = step + 1
            saver.wait()  # an asynchronous write of an earlier step commits now
            step_times.append(rec["step_time_s"])
            losses.append(rec["loss"])
            metrics.log(rec)
            bar.update(rec)
            saver.observe(done, r.start, rec["step_time_s"])
            # Stop hook (seqpar.runtime.launch.stopping): a SIGTERM/SIGINT on any rank ends the run after this step, checkpointed.
            stop = stopping.requested()
            if done < r.steps and (saver.due(done, r.steps) or stop):
                saver.save(done, r.state(done), final=False)
            if stop and done < r.steps:
                saver.wait()
                raise stopping.Stopped(done, stop, str(resume.step_dir(r.root, done)))
        saver.wait()
    except TrainingStopped:
        if step_times:  # what was measured survives the stop (a full disk may refuse this too)
            with contextlib.suppress(OSError):
                report(done)
        raise
    finally:
        bar.close()
        metrics.close()
    # The run report first: a final checkpoint that fails (full disk, a kill) leaves the measurements behind.
    result = report(r.steps)
    if saver.final:
        saver.save(r.steps, r.state(r.steps), final=True)
    if rank == 0:
        sizes = saver.sizes
        update_report(
            r.out,
            checkpoints={"predicted_bytes": sizes.checkpoint, "export_predicted_bytes": sizes.export, "written": saver.written},
        )
        matmuls = _kept_matmuls(r.steps - r.start)
        if matmuls:
            update_report(r.out, kept_matmuls=matmuls)
            r.log.info(
                "kept matmul outputs per step: %.2f GiB on the GPU, %.2f GiB in host memory, %.2f GiB recomputed "
                "(beyond the pinned budget, or changed in place)",
                *(matmuls[k] / 2**30 for k in ("gpu_bytes", "host_bytes", "recomputed_bytes")),
            )
        strided = _strided_offload(r.steps - r.start)
        if strided:
            update_report(r.out, strided_offload=strided)
            r.log.info(
                "offload_stride per step: %.0f layer inputs to host memory, %.0f rebuilt in backward by %.0f layer forwards",
                strided["host"],
                strided["recomputed"],
                strided["forwards"],
            )
            if strided["fallback"]:
                r.log.warning(
                    "offload_stride: %.0f layer inputs per step were not the layer before's output and went to host "
                    "memory after all (more host RAM than the plan counts); a module between the decoder layers, or "
                    "a model whose layers do not pass the hidden state on, does this",
                    strided["fallback"],
                )
        r.log.info("done: %d steps; run report %s", r.steps, r.out / "run_report.json")
    return {"losses": losses, "report": result, "output": str(r.out)}


def _per_step(module: str, owner: str, keys: tuple[str, ...], steps: int) -> dict:
    """The counts a memory feature keeps since the process started (``module``'s ``owner``.stats), per step over the
    ``steps`` it ran; empty when it counted nothing (the feature was off, or its module never loaded)."""
    import sys

    mod = sys.modules.get(module)
    stats = getattr(mod, owner).stats if mod is not None else {}
    if not steps or not any(stats.values()):
        return {}
    return {k: stats.get(k, 0) / steps for k in keys}


def _kept_matmuls(steps: int) -> dict:
    """kept_saves matmuls: the bytes of matmul outputs kept per step on the GPU, in host memory and recomputed instead
    (seqpar.runtime.memory.matmul_keep); empty when none were kept."""
    got = _per_step("seqpar.runtime.memory.matmul_keep", "MatmulKeep", ("gpu", "host", "recomputed"), steps)
    return {f"{k}_bytes": v for k, v in got.items()}


def _strided_offload(steps: int) -> dict:
    """offload_stride: per step, the layer inputs sent to host memory ("host", "fallback" of them not the layer
    before's output), rebuilt in backward ("recomputed") and the layer forwards that rebuilt them
    (seqpar.runtime.memory.strided_offload); empty when the run had no stride."""
    keys = ("host", "fallback", "recomputed", "forwards")
    return _per_step("seqpar.runtime.memory.strided_offload", "StridedOffload", keys, steps)


def _backend(device, dtype) -> str:
    try:
        from seqpar.runtime.parallel.kernels import select_backend

        return select_backend(device, dtype)
    except Exception as e:  # the report still gets written; say why the name is missing
        return f"unknown ({e})"


# What a rank's failure says when it is only the consequence of a peer's: the peer died (its sockets closed) or stopped
# answering (a timeout). The launcher names the rank that failed for itself before these.
PEER_WORDS = ("closed by peer", "reset by peer", "connection closed", "broken pipe", "timed out", "timeout")


def _record(rank: int, out: str, kind: str, message: str, peers: list[int] | None = None) -> None:
    """``<output>/failed-rank<R>.json`` for the launcher: kind error | invalid (input, exit 2) | peer (a consequence of a
    peer's failure) | stopped (a signal from outside the launcher)."""
    import json

    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        rec = {"time": time.time(), "rank": rank, "kind": kind, "message": message, "peers": peers or []}
        from seqpar.runtime.train.run_files import write_file

        write_file(Path(out) / f"failed-rank{rank}.json", json.dumps(rec) + "\n", "failure record")
    except (OSError, SeqparError):  # a link planted there is not written through; the exit code still tells
        pass


def main(argv: list[str] | None = None) -> int:
    """The rank's entry point (``python -m seqpar.runtime.train``, what torchrun starts): exit 0 done, 1 failed, 2
    invalid input, 128 + the signal when stopped. An unexpected error is written by ``train`` (torchrun's ``@record``)
    to the error file torchrun reads, then named here in one line for the launcher."""
    from seqpar.runtime.launch import lock, stopping
    from seqpar.runtime.parallel.comm import PeerTimeoutError

    stopping.install()  # SIGTERM/SIGINT: stop after the current step with a checkpoint
    stopping.die_with_parent()  # the launcher's death ends this rank the same way (torchrun put it in a session of its own)
    try:
        lock.hold()  # the output folder stays taken while this rank lives (seqpar.runtime.launch.lock)
    except SeqparError as e:
        print(f"seqpar: error: {e}", file=sys.stderr, flush=True)
        return 2
    args = parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        from seqpar.runtime.train import liveness

        liveness.start(rank, int(os.environ.get("WORLD_SIZE", "1")))  # names a silent peer if a wait times out
    except Exception as e:  # never a reason not to train
        print(f"seqpar: rank {rank}: no heartbeat ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    try:
        return train(args, rank)
    except BaseException as e:
        first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        consequence = isinstance(e, PeerTimeoutError) or any(w in first.lower() for w in PEER_WORDS)
        if not consequence:
            import traceback

            traceback.print_exc()
        # the peers whose heartbeat stopped are the ones that stopped answering; else those the wait was for
        peers = (liveness.silent_ranks() if consequence else None) or getattr(e, "peers", None)
        if Path(args.output, "checkpoints").is_dir():  # a folder this run set up, never one it refused
            _record(rank, args.output, "peer" if consequence else "error", first, peers)
        print(f"seqpar: rank {rank} failed: {printable(first, ERROR_LIMIT)}", file=sys.stderr, flush=True)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@record
def train(args: TrainOptions, rank: int) -> int:
    """Run and shut down; the known outcomes become exit codes here (one line each, no error file): invalid input 2, a
    named stop 1, a stop by signal 128 + the signal. Anything else propagates to ``main`` through torchrun's ``@record``
    (torch.distributed.elastic.multiprocessing.errors), which first writes it with its traceback to the file torchrun
    names in TORCHELASTIC_ERROR_FILE: torchrun's failure summary prints it, and seqpar launch's agent reads the rank's
    message from it. Outside torchrun (no such file) it only logs."""
    from seqpar.runtime.launch import stopping
    from seqpar.runtime.train.engine import shutdown

    try:
        run(args)
        shutdown()
    except SeqparError as e:
        print(f"seqpar: error: {printable(e, ERROR_LIMIT)}", file=sys.stderr, flush=True)
        if Path(args.output).is_dir():  # the launcher made it: it repeats this line and exits 2 too
            _record(rank, args.output, "invalid", str(e))
        return 2
    except TrainingStopped as e:  # a named stop (non-finite loss, full disk): one line, no traceback
        if Path(args.output).is_dir():
            _record(rank, args.output, "error", str(e))
        print(f"seqpar: rank {rank} failed: {printable(e, ERROR_LIMIT)}", file=sys.stderr, flush=True)
        return 1
    except stopping.Stopped as e:  # the final checkpoint is written; the launcher says so
        if stopping.received() and Path(args.output, "checkpoints").is_dir():
            _record(rank, args.output, "stopped", f"received {signal_name(e.signum)}; {e} (checkpoint {e.checkpoint})")
        shutdown()
        return e.exit_code
    return 0


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name
