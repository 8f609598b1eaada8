"""``seqpar verify``: the plan's sequence-parallel step next to an sp = 1 reference on the same batch, compared.

Silent wrong results are sequence parallelism's most reported failure (a ring mode on packed documents, an attention
override that stops applying after a library upgrade, a loss multiplied by the cp size). This runs, on the plan's ranks
with the plan's engine, model, checkpointing and loss, one forward and backward of one batch (one window per data-parallel
group) twice, both through the trainer's own ``setup``:
- the plan: its mode and degrees (sp x dp);
- the reference: ``data_parallel`` over the same W ranks, rank r reading the window of the plan's group r // sp, so the
  gradient both engines produce is the mean over the same windows (seqpar.runtime.train.engine's gradient math);
and compares the loss (world mean), the global gradient norm and every parameter's full gradient (gathered from the
engine: DDP's, FSDP2's DTensor, DeepSpeed's ``safe_get_full_grad``). A gradient's difference is
max|g - g_ref| / max|g_ref| (relative to the tensor's scale, as tests/runtime/hf/test_hf.py does: elementwise rtol fails on entries
near zero); the worst parameter is named. Both runs share the kernels, fused ops and checkpointing: the check is on what
sequence parallelism adds (the split, the positions, the exchange, the attention override, the loss reduction, the scale).

Tolerance (relative, for loss, norm and gradients): ``tol = base(dtype) x W``, W = world size, base = 1e-5 for fp32 (the
trainer tests' float32 bound, tests/seqpar_testing.py), 8e-3 for bf16 (PyTorch context parallel's test tolerance,
8e-3 x world size), 1e-3 for fp16 (bf16's bound / 8: fp16 keeps 3 more mantissa bits). The dtype is what the ranks
compute in (CPU ranks: fp32). Broken modes miss by orders of magnitude more (tests/runtime/train/test_verify.py).

Default length: the plan's seq_len / sp_degree, down to the mode's split multiple, so the reference's whole sequence holds
no more tokens per rank than the plan's own shard: if the plan fits, both runs fit. Rank 0 keeps the reference's full
gradients in host RAM (fp32, 4 bytes per parameter) until the plan's run has been compared against them.

This module's top level imports no torch (the CLI side: ``verify_plans``, ``run_verify``); the ranks run ``main``.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from seqpar.plan.errors import SeqparError
from seqpar.plan.files import write_atomic
from seqpar.plan.flags import OptionsParser
from seqpar.plan.job_options import DataOptions, LaunchOptions, TrainOptions, VerifyOptions
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.modes import check_split, split_multiple, ulysses_arg

BASE_TOLERANCE = {"fp32": 1e-5, "bf16": 8e-3, "fp16": 1e-3}
RESULT = "verify.json"


def tolerance(dtype: str, world_size: int) -> tuple[float, str]:
    """(relative tolerance, the rule in words)."""
    base = BASE_TOLERANCE[dtype]
    return base * world_size, f"{base:g} x W={world_size} ({dtype})"


def default_seq_len(plan: LaunchPlan) -> int:
    s = plan.strategy
    mult = split_multiple(s.mode, s.sp_degree, ulysses_arg(s.mode, s.ulysses_degree))
    return max(mult, plan.workload.seq_len // s.sp_degree // mult * mult)


def verify_plans(plan: LaunchPlan, seq_len: int) -> tuple[LaunchPlan, LaunchPlan]:
    """(the plan at seq_len with one window per group and one step, its data_parallel reference over the same ranks)."""
    s = plan.strategy
    check_split(s.mode, seq_len, s.sp_degree, ulysses_arg(s.mode, s.ulysses_degree))
    data = json.loads(plan.model_dump_json())
    data["workload"].update(seq_len=seq_len, micro_batch_size=1)
    data["strategy"]["gradient_accumulation_steps"] = 1
    data["training"].update(steps=1, checkpoint_every=0)
    data["prediction"], data["stages"] = None, []
    mine = LaunchPlan.model_validate(data)
    data["strategy"].update(mode="data_parallel", sp_degree=1, dp_degree=s.world_size, ulysses_degree=1, ring_degree=1)
    return mine, LaunchPlan.model_validate(data)


# --------------------------------------------------------------------------------------------- the ranks


def _step(plan: LaunchPlan, groups: int, sp_of_groups: int, folder: Path, opts: VerifyOptions):
    """One forward and backward of ``plan`` through the trainer's setup; yields (name, full fp32 gradient) for every
    parameter (collective: every rank iterates), after returning the world-mean loss and the compute dtype first."""
    import torch
    import torch.distributed as dist

    from seqpar.runtime.train.loop import model_inputs, setup

    topo_rank = dist.get_rank()
    if topo_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        plan.write(folder / "plan.json")
    dist.barrier()
    train = TrainOptions(data=opts.data, model_path=opts.model_path, checkpoint_every=0, allow_env=opts.allow_env)
    r = setup(replace(train, plan=str(folder / "plan.json"), output=str(folder)))
    s, topo = plan.strategy, r.topo
    # The window of the plan's data-parallel group this rank serves (the reference's rank r serves group r // sp).
    got = r.data.batch(0, 0, topo.rank // sp_of_groups, grad_accum=1, dp_degree=groups, micro_batch=1)
    batch = {k: v.to(topo.device) for k, v in model_inputs(r, got).items()}  # each (1, S_local), as the trainer splits it
    amp = r.autocast_dtype
    with torch.autocast(topo.device.type, dtype=amp) if amp is not None else torch.autocast(topo.device.type, enabled=False):
        loss = r.wrapped(batch["input_ids"], batch["position_ids"], batch["labels"], batch.get("cu_seqlens"))
    scaled = loss * s.sp_degree  # the trainer's scale (engine.py): sum over sp, mean over dp
    if r.backward is not None:
        r.wrapped.backward(scaled)  # DeepSpeed's backward alone: its step would consume the gradients
    else:
        scaled.backward()
    total = loss.detach().double()
    dist.all_reduce(total)
    computed = amp or next(r.model.parameters()).dtype
    yield float(total) / topo.world_size, {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[computed]
    full = _full_grad_fn(r)
    for name, p in r.model.named_parameters():
        if p.requires_grad:  # under LoRA the frozen base has no gradient to compare
            yield name, full(p)
    if hasattr(r.wrapped, "destroy"):
        r.wrapped.destroy()  # DeepSpeed's hooks and buffers, before the next engine is built


def _full_grad_fn(r):
    """The whole gradient of a parameter on every rank, fp32 on CPU (collective for sharded engines)."""
    import torch

    if r.backward is not None:
        from deepspeed.utils import safe_get_full_grad

        grad_of = safe_get_full_grad
    else:

        def grad_of(p):
            g = p.grad
            return g.full_tensor() if hasattr(g, "full_tensor") else g  # FSDP2 holds a DTensor shard

    def full(p):
        g = grad_of(p)
        if g is None:
            shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape  # ZeRO-3 keeps a placeholder tensor
            return torch.zeros(shape, dtype=torch.float32)
        return g.detach().float().cpu()

    return full


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def verify_ranks(opts: VerifyOptions) -> dict | None:
    """Collective: both runs and the comparison; rank 0 returns (and writes) the result, other ranks None."""
    import torch.distributed as dist

    from seqpar.runtime.train.engine import init_distributed

    plan = LaunchPlan.load(opts.plan, allow_env=opts.allow_env)
    s, seq_len = plan.strategy, opts.seq_len
    L = seq_len or default_seq_len(plan)
    mine, ref = verify_plans(plan, L)
    init_distributed(plan)  # joins torchrun's group (or reuses the caller's), and checks the world is the plan's
    out = Path(opts.output)
    steps = _step(ref, s.dp_degree, s.sp_degree, out / "reference", opts)
    ref_loss, dtype = next(steps)
    want = {}
    for name, g in steps:
        if dist.get_rank() == 0:
            want[name] = g
    steps = _step(mine, s.dp_degree, s.sp_degree, out / "plan", opts)
    loss, _ = next(steps)
    worst, worst_name, norm2, ref_norm2, params = 0.0, "", 0.0, 0.0, 0
    for name, g in steps:
        if dist.get_rank() != 0:
            continue
        w, params = want.pop(name), params + 1
        norm2, ref_norm2 = norm2 + float(g.double().pow(2).sum()), ref_norm2 + float(w.double().pow(2).sum())
        d = float((g - w).abs().max()) / max(float(w.abs().max()), 1e-30) if w.numel() else 0.0
        if d > worst or not worst_name:
            worst, worst_name = d, name
    if dist.get_rank() != 0:
        return None
    tol, rule = tolerance(dtype, dist.get_world_size())
    norm, ref_norm = norm2**0.5, ref_norm2**0.5
    checks = [
        (_rel(loss, ref_loss), f"loss {loss:.6g} vs reference {ref_loss:.6g}"),
        (_rel(norm, ref_norm), f"gradient norm {norm:.6g} vs reference {ref_norm:.6g}"),
        (worst, f"gradient of {worst_name}"),
    ]
    failed = [f"{what} differs by {d:.2e}" for d, what in checks if d > tol]
    if len(failed) > 2:  # the first, and the worst parameter: the most telling
        failed = [failed[0], failed[-1]]
    mismatch = f"{'; '.join(failed)} (relative; tolerance {tol:.1e} = {rule})" if failed else None
    result = {
        "ok": mismatch is None,
        "mismatch": mismatch,
        "seq_len": L,
        "seq_len_source": "--seq-len" if seq_len else f"the plan's {plan.workload.seq_len} / sp_degree {s.sp_degree}",
        "mode": s.mode,
        "sp_degree": s.sp_degree,
        "dp_degree": s.dp_degree,
        "sharding": s.sharding,
        "world_size": dist.get_world_size(),
        "dtype": dtype,
        "tolerance": tol,
        "tolerance_rule": rule,
        "loss": {"plan": loss, "reference": ref_loss, "rel_diff": checks[0][0]},
        "grad_norm": {"plan": norm, "reference": ref_norm, "rel_diff": checks[1][0]},
        "grads": {"params": params, "max_rel_diff": worst, "worst": worst_name},
    }
    write_atomic(out / RESULT, json.dumps(result, indent=2) + "\n")
    return result


def parser() -> OptionsParser:
    """The verify job's argv parser, built from VerifyOptions (seqpar.plan.job_options)."""
    return OptionsParser(VerifyOptions, prog="python -m seqpar.runtime.train.verify", description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    """Every rank: both runs; exit 0 (the verdict is in verify.json), 2 for invalid input, 1 for a crash."""
    import os

    from seqpar.runtime.train.loop import _record

    args = parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        from seqpar.runtime.launch import lock, stopping

        stopping.die_with_parent()  # no verify rank outlives its launcher, nor lets another launch in before it exits
        lock.hold()
        verify_ranks(args)
        from seqpar.runtime.train.engine import shutdown

        shutdown()
    except SeqparError as e:
        print(f"seqpar: error: {e}", file=sys.stderr, flush=True)
        _record(rank, args.output, "invalid", str(e))  # the launcher repeats the line and exits 2 too
        return 2
    except BaseException as e:
        import traceback

        traceback.print_exc()
        first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        _record(rank, args.output, "error", first)
        print(f"seqpar: rank {rank} failed: {first}", file=sys.stderr, flush=True)
        return 1
    return 0


# --------------------------------------------------------------------------------------------- the launcher side


def run_verify(plan: LaunchPlan, plan_path: Path, opts: LaunchOptions, *, ranks: VerifyOptions, echo=print) -> list[dict]:
    """Start the verify job(s) the way ``seqpar launch`` starts training (jobspec, same launcher and rendezvous, the
    checks of ``opts.train``) into ``<output>/verify``, one per stage of a staged plan, every rank reading ``ranks``
    (``ranks.seq_len`` None: each plan's default_seq_len); the results (ok, figures, first mismatch). Torch-free."""
    from seqpar.plan.jobspec import default_output, stage_plan
    from seqpar.runtime.launch.run import launch

    seq_len = ranks.seq_len
    base = Path(opts.train.output) if opts.train.output else default_output(plan_path)
    plans = [(plan, plan_path, base / "verify")] if not plan.stages else []
    for i in range(len(plan.stages)):
        plans.append((stage_plan(plan, i), base / "verify" / f"stage-{i}" / "plan.json", base / "verify" / f"stage-{i}"))
    results = []
    for p, path, out in plans:
        L = seq_len or default_seq_len(p)
        verify_plans(p, L)  # invalid lengths: exit 2 before anything starts
        shutil.rmtree(out / "plan", ignore_errors=True), shutil.rmtree(out / "reference", ignore_errors=True)
        (out / RESULT).unlink(missing_ok=True)
        if path != plan_path:
            path.parent.mkdir(parents=True, exist_ok=True)
            p.write(path)
        echo(
            f"seqpar verify: {p.strategy.mode} sp={p.strategy.sp_degree} dp={p.strategy.dp_degree} {p.strategy.sharding} "
            f"at seq_len {L} ({'--seq-len' if seq_len else f'{p.workload.seq_len} / sp_degree {p.strategy.sp_degree}'}) "
            f"against data_parallel on the same {p.strategy.world_size} ranks"
        )
        # the launch's checks for a job of the verify ranks: their data (read with the default data options, as they
        # read it) and output folder
        train = replace(opts.train, output=str(out), steps=None, resume=False, report_to="", data_options=DataOptions())
        vopts = replace(opts, train=train, verify=replace(ranks, seq_len=L))
        rc = launch(p, path, vopts, echo=echo)
        if rc != 0 or not (out / RESULT).is_file():
            raise VerifyFailed(f"the verify job failed (exit status {rc}) before comparing; see the output above")
        results.append(json.loads((out / RESULT).read_text()))
    return results


class VerifyFailed(Exception):
    """The verify job itself failed (not a mismatch): exit 1."""


def summary(r: dict) -> str:
    """One line of figures (and the mismatch) for a person."""
    head = f"{r['mode']} sp={r['sp_degree']} dp={r['dp_degree']} {r['sharding']} seq_len {r['seq_len']} {r['dtype']} W={r['world_size']}"
    figures = (
        f"loss {r['loss']['plan']:.6g} vs {r['loss']['reference']:.6g} ({r['loss']['rel_diff']:.1e}), "
        f"grad norm {r['grad_norm']['plan']:.6g} vs {r['grad_norm']['reference']:.6g} ({r['grad_norm']['rel_diff']:.1e}), "
        f"{r['grads']['params']} gradients max {r['grads']['max_rel_diff']:.1e} ({r['grads']['worst']}); "
        f"tolerance {r['tolerance']:.1e} = {r['tolerance_rule']}"
    )
    return f"{'ok' if r['ok'] else 'MISMATCH'}: {head}: " + (r["mismatch"] + "; " if r["mismatch"] else "") + figures


if __name__ == "__main__":
    sys.exit(main())
