"""What a run measured, beside what its plan predicted: the run report (JSON) and the per-step metrics (JSONL).

``run_report.json`` sits next to ``checkpoints/`` in the output folder; ``seqpar calibrate`` reads it. The trainer
writes it before the final checkpoint (a failed final write leaves the measurements) and then adds the checkpoints'
predicted and written sizes (``checkpoints``). Measured figures
use the plan's field names (``tokens_per_s``, ``peak_memory_gib``, ``reserved_memory_gib``, ``step_time_s``, ``mfu``) so a
measured/predicted pair lines up by key.

MFU = model FLOPs per step (seqpar.plan.flops, the count the advisor's predicted MFU uses: 6 * matmul parameters per token plus
causal attention, no recompute) / step time / the datasheet bf16 peak of every GPU.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from seqpar.plan.errors import SeqparError
from seqpar.plan.flops import model_flops_per_sequence
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.safe import append_text, printable
from seqpar.plan.units import GIB
from seqpar.runtime.train.run_files import read_file, write_file

METRICS, REPORT = "metrics file", "run report"  # how a refusal names them


def peak_rss_bytes() -> int:
    """This process's own peak resident set size. On Linux the kernel's high-water mark of its address space (VmHWM in
    /proc/self/status), not getrusage's ru_maxrss: exec records the old address space's peak in ru_maxrss, and a rank's
    old address space is the fork of its launcher (torchrun's agent, which tokenized the data), so ru_maxrss reports the
    launcher's peak when that is higher than the rank's own. Elsewhere ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def memory_now(device: torch.device) -> dict:
    """Peak memory of this process: CUDA allocator peaks on GPU; the resident set size on CPU (its own: peak_rss_bytes)."""
    out = {"peak_rss_gib": peak_rss_bytes() / GIB}
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        # allocations that found no free block, emptied the cache (a synchronization of every stream) and retried: a
        # run at the edge of its GPU memory pays them in time
        out["alloc_retries"] = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
    else:
        out["peak_allocated_gib"] = out["peak_reserved_gib"] = out["peak_rss_gib"]
    return out


class Metrics:
    """Per-step metrics: rank 0 appends one JSON line per step to metrics.jsonl, and logs the same record to the trackers
    of ``--report-to`` (seqpar.runtime.train.trackers: accelerate's TensorBoard / W&B trackers, a run id kept across
    ``--resume``, the plan and its predictions as the run's config)."""

    def __init__(
        self,
        out: Path,
        rank: int,
        report_to: list[str],
        resume_step: int,
        log,
        *,
        plan: LaunchPlan | None = None,
        resumed: bool = False,
        project: str | None = None,
        run_name: str | None = None,
    ):
        self.path, self.rank, self.trackers = out / "metrics.jsonl", rank, []
        if rank != 0:
            return
        held = read_file(self.path, METRICS)
        if held is not None:  # keep what the checkpoint covers; the steps after it are run again
            keep = [ln for ln, rec in _records(self.path, log, held) if rec["step"] <= resume_step]
            write_file(self.path, "".join(ln + "\n" for ln in keep), METRICS)
        else:
            append_text(self.path, "", what=METRICS)  # a link planted there is refused now, not after the first step
        if report_to:
            from seqpar.runtime.train import trackers

            ident = trackers.run_identity(out, resumed=resumed, project=project, run_name=run_name)
            config = trackers.plan_config(plan, {"run_id": ident["run_id"]}) if plan is not None else {}
            self.trackers = trackers.open_trackers(report_to, out, ident, resume_step=resume_step, config=config)
            log.info(
                "logging to %s: project %s, run %s (id %s)",
                ", ".join(report_to),
                ident["project"],
                ident["run_name"],
                ident["run_id"],
            )

    def log(self, rec: dict) -> None:
        if self.rank != 0:
            return
        # strict JSON: a skipped step's non-finite loss or norm is null
        line = json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()})
        append_text(self.path, line + "\n", what=METRICS)
        values = {k: v for k, v in rec.items() if k != "step"}
        for tracker in self.trackers:
            tracker.log(values, step=rec["step"])

    def close(self) -> None:
        """Finish the trackers (W&B uploads or closes its offline run; TensorBoard closes its event file)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


def _records(path: Path, log, held: bytes | None = None) -> list[tuple[str, dict]]:
    """(line, record) of a metrics file (its bytes ``held``, else read without following a link); a torn last line (a
    crash or a full disk mid-append) is dropped with a warning, a bad line before it is an error naming the file and
    line."""
    if held is None:
        held = read_file(path, METRICS) or b""
    lines = held.decode("utf-8", errors="replace").splitlines()
    out = []
    for n, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("no integer 'step'")
        except (ValueError, RecursionError) as e:  # bad JSON, a 5000-digit number, nesting past the parser's depth
            if n == len(lines):
                log.warning("%s: dropped a torn last line (%d characters); its step runs again", path, len(ln))
                break
            raise SeqparError(
                f"metrics file {printable(str(path))!r} line {n} is not a step record ({printable(e)}); restore the file "
                f"or delete it to start its records afresh"
            ) from None
        out.append((ln, rec))
    return out


def update_report(out: Path, **fields) -> None:
    """Rank 0: add ``fields`` to run_report.json (atomically)."""
    path = out / "run_report.json"
    report = json.loads(read_file(path, REPORT) or b"{}")  # this run wrote it moments ago (write_report)
    report.update(fields)
    write_file(path, json.dumps(report, indent=2) + "\n", REPORT)


def write_report(
    out: Path,
    plan: LaunchPlan,
    *,
    step_times: list[float],
    tokens_per_step: int,
    sequences_per_step: int,
    device: torch.device,
    backend: str,
    dtype_reason: str,
    engine: str,
    steps_done: int,
    rank: int,
    profiled: set[int] = frozenset(),
    norms_tiled: bool = False,
) -> dict | None:
    """Collective: gathers every rank's memory peaks; rank 0 writes run_report.json and returns it. ``profiled``: the
    indices into ``step_times`` of steps run under the profiler (--profile-step), left out of the warm figures;
    ``norms_tiled``: whether the runtime ran the model's own RMSNorms in tiles (tiled_mlp.tile_norms switched some)."""
    mem = memory_now(device)
    per_rank = [None] * dist.get_world_size() if dist.is_initialized() else [mem]
    if dist.is_initialized():
        dist.all_gather_object(per_rank, mem)
    if rank != 0:
        return None
    # The first step pays for warm-up (allocator growth, lazy init, kernel selection): leave it out when there are more.
    warm = [t for i, t in enumerate(step_times) if i > 0 and i not in profiled]
    timed = warm or [t for i, t in enumerate(step_times) if i not in profiled] or step_times
    step_s = statistics.median(timed) if timed else 0.0
    total = sum(timed)
    tps = tokens_per_step * len(timed) / total if total > 0 else 0.0
    peak_flops = plan.cluster.gpu.bf16_tflops * 1e12 * plan.cluster.world_size
    flops = sequences_per_step * model_flops_per_sequence(plan.workload.model, plan.workload.seq_len, plan.workload.doc_lens)
    mfu = flops / step_s / peak_flops if step_s > 0 else 0.0
    per_node = plan.cluster.gpus_per_node  # ranks are numbered node by node
    nodes = [per_rank[i : i + per_node] for i in range(0, len(per_rank), per_node)]
    measured = {
        "tokens_per_s": tps,
        "peak_memory_gib": max(r["peak_allocated_gib"] for r in per_rank),
        "reserved_memory_gib": max(r["peak_reserved_gib"] for r in per_rank),
        # the plan's host_memory_gib is per node: the peak RSS of the node's ranks, summed (an upper bound: the peaks
        # need not coincide), on the busiest node; offloaded states and pinned buffers live there
        "host_memory_gib": max(sum(r["peak_rss_gib"] for r in node) for node in nodes),
        "step_time_s": step_s,
        "mfu": mfu,
        # the first step apart (kernel plans, allocator growth, pinned host blocks, JIT builds): the figures above are
        # warm steps only when there is one (warm_steps > 0); `seqpar calibrate` fits time only from such runs
        "first_step_s": step_times[0] if step_times else 0.0,
        "warm_steps": len(warm),
    }
    p = plan.prediction
    predicted = {k: getattr(p, k, None) for k in measured if k != "warm_steps"} if p is not None else None
    report = {
        "measured": measured,
        "predicted": predicted,
        "per_rank": [dict(rank=i, **r) for i, r in enumerate(per_rank)],
        "step_times_s": step_times,
        "profiled_steps": sorted(i + 1 + steps_done - len(step_times) for i in profiled),
        "steps": steps_done,
        "tokens_per_step": tokens_per_step,
        "device": str(device.type),
        "backend": backend,
        # cuDNN's backward is cut over KV heads at long lengths (seqpar.plan.attention_calls); reports without this key
        # come from runs before the cut, and the memory model prices them as one call
        "attention_backward_cut": True,
        # under a tiled MLP the model's own RMSNorms run in tiles too (seqpar.runtime.memory.tiled_mlp.tile_norms);
        # reports without this key come from runs before, priced with the untiled norms' backward
        "norms_tiled": bool(norms_tiled),
        "dtype": dtype_reason,
        "engine": engine,
        "versions": _versions(),
        "plan": json.loads(plan.model_dump_json()),
    }
    write_file(out / "run_report.json", json.dumps(report, indent=2) + "\n", REPORT)
    return report


def _versions() -> dict:
    import transformers

    import seqpar

    return {"seqpar": seqpar.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
