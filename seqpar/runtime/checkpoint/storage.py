"""What checkpoints cost and when they are written: the size of one checkpoint and of the export, the interval, the
free-space check ``seqpar launch`` runs before training, and a full disk named as such.

Torch-free (the launcher imports it before any process starts). Sizes in bytes, N = ``ModelSpec.num_params``:

* one checkpoint (``state/``, every rank writes its shards) holds the engine's parameters and the optimizer state, per
  parameter: CPU ranks compute in fp32 (engine.compute_dtype), so fp32 weights 4 + AdamW's two moments 2 x 4 = 12;
  ``adamw`` on GPUs keeps fp32 master weights 4 + moments 8 = 12 (DeepSpeed adds its 16-bit module weights, 2);
  ``adamw-bf16`` keeps weights and moments in the 16-bit dtype, 2 + 4 = 6; ``none`` the weights only, in the dtype
  the run computes in. Headers, RNG states and trainer_state.json add kilobytes.
* the export (``model/``, save_pretrained, final checkpoint only) holds the weights in the plan's dtype: 2 bytes
  (bf16/fp16) or 4 (fp32) per parameter.
* LoRA (``workload.lora``, A = LoraSpec.adapter_params): a checkpoint holds the adapters and their moments alone, all
  fp32 (peft keeps adapters in fp32), 12 bytes per adapter parameter (4 with optimizer none; DeepSpeed's 16-bit copy
  adds 2 on GPUs); the export is the adapter, 4 per adapter parameter, plus the merged model (N x 2 or 4) with
  --merge-lora.

A Llama-2-7B DDP AdamW plan: 6.74e9 x 12 = 81 GB per checkpoint and 13.5 GB for the bf16 export; the 64 GiB disk of
a GPU machine holds neither a checkpoint and the export nor two checkpoints, which is what the check says before step 1.

Interval: ``training.checkpoint_every`` None (the default) = about hourly, from the plan's predicted step time (or,
for plans without a prediction, the first measured steps); 0 = only at the end; K = every K steps.
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path

from seqpar.plan import options
from seqpar.plan.job_options import AUTO  # --checkpoint-every auto: the interval from the step time, whatever the plan says
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.options import HOURLY_S, hourly, kept
from seqpar.plan.units import GIB


@dataclass(frozen=True)
class Sizes:
    checkpoint: int  # bytes of one checkpoint (all ranks' shards together)
    export: int  # bytes of the save_pretrained export
    why: str  # the per-parameter terms, for messages


def sizes(plan: LaunchPlan, merge: bool = False) -> Sizes:
    """The bytes of one checkpoint and of the export of ``plan`` (the terms are in the module docstring); ``merge``:
    --merge-lora."""
    w = plan.workload
    n = w.model.num_params
    low = 4 if w.dtype == "fp32" else 2
    cpu = plan.cluster.accelerator == "cpu"
    if w.lora is not None:
        a = w.lora.adapter_params(w.model)
        per = 4 if w.optimizer == "none" else 12
        extra = 2 if (plan.strategy.sharding.startswith("zero") and not cpu and w.optimizer != "none") else 0
        what = f"{a / 1e6:.3g}M adapter parameters x {per + extra} B: fp32 adapters" + (" + AdamW moments" if per == 12 else "")
        return Sizes(a * (per + extra), a * 4 + (n * low if merge else 0), what)
    if w.optimizer == "none":
        weights, moments, what = (4 if cpu else low), 0, "weights only (optimizer none)"
    elif cpu or w.optimizer == "adamw":
        weights, moments, what = 4, 8, "fp32 weights 4 + AdamW moments 8 B/parameter"
    else:  # adamw-bf16 on GPUs
        weights, moments, what = low, 2 * low, f"{w.dtype} weights {low} + moments {2 * low} B/parameter"
    extra = 2 if (plan.strategy.sharding.startswith("zero") and not cpu and w.optimizer != "none") else 0
    if extra:
        what += " + DeepSpeed's 16-bit weights 2"
    return Sizes(n * (weights + moments + extra), n * low, f"{n / 1e9:.3g}B parameters x {weights + moments + extra} B: {what}")


def interval(plan: LaunchPlan, override: int | str | None, steps: int | None = None) -> tuple[int | None, str]:
    """(steps between checkpoints, why): 0 = only at the end; None = decide from the first measured steps.
    ``override`` is --checkpoint-every: an int, AUTO, or None for the plan's ``training.checkpoint_every``; ``steps``
    the run's steps (for the why)."""
    every = plan.training.checkpoint_every if override is None else override
    return options.interval(every, plan.prediction.step_time_s if plan.prediction else None, steps)


def saves(start: int, steps: int, every: int | None, final: bool) -> int:
    """How many checkpoints a run from ``start`` to ``steps`` writes (every None: unknown yet, counted as many)."""
    if steps <= start:
        return 0
    if every is None:
        n = steps - 1 - start  # an upper bound: at most one per step
    else:  # interval checkpoints before the last step; the one at the last step is the final one
        n = ((steps - 1) // every - start // every) if every else 0
    return n + (1 if final else 0)


def needed(sz: Sizes, *, writes: int, keep_last: int, existing: int, final: bool) -> int:
    """Bytes the run needs at --output at its peak: a new checkpoint is written in full before the oldest beyond
    ``keep_last`` is deleted (0 = keep all), so keep_last + 1 may exist at once; the final one adds the export."""
    if writes == 0:
        return 0
    peak = existing + writes if keep_last == 0 else min(existing + writes, keep_last + 1)
    return max(peak - existing, 1) * sz.checkpoint + (sz.export if final else 0)


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def space_problem(
    plan: LaunchPlan,
    output: Path,
    *,
    steps: int,
    start: int,
    every: int | None,
    keep_last: int,
    final: bool,
    existing: int,
    reserved: int = 0,
    merge: bool = False,
) -> tuple[str | None, int]:
    """(one line when the run's checkpoints cannot fit at ``output``: both sizes, the free space, the fixes; else None,
    the bytes this run needs). ``reserved``: bytes earlier stages of the same launch will have written there."""
    sz = sizes(plan, merge)
    free = free_bytes(output) - reserved
    writes = saves(start, steps, every, final)
    need = needed(sz, writes=writes, keep_last=keep_last, existing=existing, final=final)
    if need <= free:
        return None, need
    fixes = ["another --output with more space"]
    if keep_last != 1 and needed(sz, writes=writes, keep_last=1, existing=existing, final=final) <= free:
        fixes.append("--keep-last 1")
    if (
        every != 0
        and needed(sz, writes=saves(start, steps, 0, final), keep_last=keep_last, existing=existing, final=final) <= free
    ):
        fixes.append("--checkpoint-every 0 (only the final checkpoint)")
    if (
        final
        and needed(sz, writes=saves(start, steps, every, False), keep_last=keep_last, existing=existing, final=False) <= free
    ):
        fixes.append("--no-final-checkpoint (when the run's weights are not needed, e.g. a benchmark)")
    earlier = f" (after {reserved / GIB:.1f} GiB for earlier stages)" if reserved else ""
    return (
        f"--output {str(output)!r} has {free / GIB:.1f} GiB free{earlier}, and this run's checkpoints need {need / GIB:.1f} "
        f"GiB: one checkpoint is {sz.checkpoint / GIB:.1f} GiB ({sz.why}), the final export {sz.export / GIB:.1f} GiB "
        f"({plan.workload.dtype}); use {' or '.join(fixes)}"
    ), need


def launch_problem(plan: LaunchPlan, output: Path, opts, reserved: int = 0) -> tuple[str | None, int]:
    """space_problem for a job of ``seqpar launch`` (opts: seqpar.plan.job_options.TrainOptions), counting the checkpoints
    already in ``output`` and, on --resume, starting at the newest one's step."""
    import json

    from seqpar.plan.errors import SeqparError
    from seqpar.plan.safe import read_bytes

    done = sorted(p for p in (output / "checkpoints").glob("step-*") if (p / "trainer_state.json").is_file())
    start = 0
    if opts.resume and done:
        try:  # resume.launch_check has checked it (its signature, its types) when --resume runs
            start = int(json.loads(read_bytes(done[-1] / "trainer_state.json", limit=64 << 20))["step"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError, SeqparError):
            start = 0  # the trainer names what is wrong with it
    every, _ = interval(plan, opts.checkpoint_every)
    return space_problem(
        plan,
        output,
        steps=opts.steps or plan.training.steps,
        start=start,
        every=every,
        keep_last=kept(opts.keep_last, plan.training.keep_last),
        final=opts.final_checkpoint,
        existing=len(done),
        reserved=reserved,
        merge=opts.merge_lora,
    )


def is_disk_full(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps: a cause, a context, torch.distributed.checkpoint's per-rank failures)
    is a full disk or an exceeded quota."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, stack summary)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


def disk_full_message(output: Path, what: str, plan: LaunchPlan, last: str | None) -> str:
    sz = sizes(plan)
    kept = f"the previous checkpoint {last} is intact" if last else "no earlier checkpoint exists"
    return (
        f"disk full at --output {str(output)!r} while writing {what} ({free_bytes(output) / GIB:.1f} GiB free; one checkpoint "
        f"is {sz.checkpoint / GIB:.1f} GiB, the export {sz.export / GIB:.1f} GiB); {kept}; free space there and rerun with "
        f"--resume (--keep-last 1 keeps fewer checkpoints, --no-final-checkpoint skips the last one)"
    )


__all__ = [
    "AUTO",
    "HOURLY_S",
    "Sizes",
    "disk_full_message",
    "free_bytes",
    "hourly",
    "interval",
    "is_disk_full",
    "launch_problem",
    "needed",
    "saves",
    "sizes",
    "space_problem",
]
