"""One training step under torch.profiler (``--profile-step N``): a Chrome trace and a summary of where the step went.

The trace (``profile/rank<r>_step<N>.json.gz``, for chrome://tracing or Perfetto) is torch.profiler's own. The summary
(``profile/rank<r>_step<N>.json``, and one log line) answers the questions a long-context step raises, from the
trace's device activity (kernels and memory copies, each with its stream) and the CUDA runtime calls on the host:

- ``kernel_busy_s``: time at least one kernel runs (the union over streams); ``idle_s``: the device window (first
  device activity to last) minus that and the copies;
- ``copy_s`` per direction (``DtoH``, ``HtoD``, ``DtoD``...) and ``exposed_copy_s``: the same directions' copy time
  under no kernel, what the host copies of offloaded checkpoints and host-kept matmul outputs cost the step beyond their overlap;
- ``gaps``: the longest stretches with no kernel, with the kernels either side and the copies running meanwhile;
- ``runtime_calls``: the CUDA runtime / driver calls that took the most host time (synchronizations, allocations,
  host registrations show up here);
- ``memory_peak`` (CUDA): what was live at the step's allocated peak, from the caching allocator's own history of the
  step: the bytes live before the step began (weights, gradients, optimizer states, kept buffers), and the step's live
  allocations grouped by the line of seqpar / transformers / kernel code that made them, largest first, with the
  allocation that reached the peak. This is what names a transient the cost model misses;
- ``allocator``: the step's change in the caching allocator's counters (``num_alloc_retries``: allocations that freed
  the cache and retried, each one a synchronization of every stream; ``num_device_alloc`` / ``num_device_free``:
  cudaMalloc / cudaFree calls), from torch.cuda.memory_stats.

On CPU the device fields are absent (no device activity) and the runtime calls are the step's slowest host ops.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import torch

from seqpar.plan.safe import printable
from seqpar.runtime.train.run_files import check_file, check_folder, write_file

ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
GAPS = 5  # the longest kernel-free stretches listed
CALLS = 8  # the runtime calls listed
PEAK_GROUPS = 12  # the largest groups of live allocations listed at the memory peak
HISTORY_ENTRIES = 1_000_000  # allocator events kept for one step (a 32-layer step makes a few hundred thousand)
# Frames from these packages name an allocation; torch's own frames (autograd, nn.Module plumbing) do not. Matched by
# the packages' install folders (found without importing them), so a script that happens to sit under a folder named
# like one of them is not taken for its code.
_OWN_PACKAGES = ("seqpar", "transformers", "liger_kernel", "deepspeed", "peft", "flash_attn")


@functools.cache
def _own_roots() -> tuple[str, ...]:
    roots = []
    for name in _OWN_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            roots.append(str(Path(loc).resolve()) + os.sep)
    return tuple(roots)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge (start, end) intervals into disjoint sorted ones."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` outside the disjoint sorted ``cover``."""
    total = 0.0
    for a, b in _union(intervals):
        inside = sum(max(0.0, min(b, d) - max(a, c)) for c, d in cover if c < b and d > a)
        total += (b - a) - inside
    return total


def copy_direction(name: str) -> str | None:
    """'Memcpy DtoH (Device -> Pinned)' -> 'DtoH'; None for anything that is not a memory copy."""
    if not name.startswith("Memcpy"):
        return None
    parts = name.split()
    return parts[1] if len(parts) > 1 else "other"


def summarize(device_events: list[tuple[str, int, float, float]], host_calls: list[tuple[str, float]]) -> dict:
    """The step's summary from its device activity ``(name, stream, start_us, end_us)`` (kernels, memory copies and
    sets) and its host runtime calls ``(name, duration_us)``; times in seconds (module docstring)."""
    s = 1e-6
    kernels = [(a, b, n) for n, _, a, b in device_events if copy_direction(n) is None and not n.startswith("Memset")]
    copies = [(a, b, n, copy_direction(n)) for n, _, a, b in device_events if copy_direction(n) is not None]
    calls: dict[str, list[float]] = {}
    for name, us in host_calls:
        calls.setdefault(name, [0.0, 0])
        calls[name][0] += us
        calls[name][1] += 1
    top = sorted(calls.items(), key=lambda kv: -kv[1][0])[:CALLS]
    out: dict = {"runtime_calls": [{"name": n, "seconds": t * s, "calls": c} for n, (t, c) in top]}
    if not device_events:
        return out
    busy = _union([(a, b) for a, b, _ in kernels])
    everything = _union([(a, b) for _, _, a, b in device_events])
    start, end = everything[0][0], everything[-1][1]
    per_dir: dict[str, list[tuple[float, float]]] = {}
    for a, b, _, d in copies:
        per_dir.setdefault(d, []).append((a, b))
    by_end = sorted(kernels, key=lambda k: k[1])
    ends = [k[1] for k in by_end]
    by_start = sorted(kernels)
    starts = [k[0] for k in by_start]
    gaps = []
    for _, b0, a1 in sorted(((a1 - b0, b0, a1) for (_, b0), (a1, _) in zip(busy, busy[1:])), reverse=True)[:GAPS]:
        i, j = bisect.bisect_right(ends, b0) - 1, bisect.bisect_left(starts, a1)
        gaps.append(
            {
                "seconds": (a1 - b0) * s,
                "at_s": (b0 - start) * s,
                "after": by_end[i][2] if i >= 0 else None,
                "before": by_start[j][2] if j < len(by_start) else None,
                "copies_running": sorted({d for a, b, _, d in copies if a < a1 and b > b0}),
            }
        )
    out.update(
        {
            "device_window_s": (end - start) * s,
            "kernel_busy_s": _length(busy) * s,
            "idle_s": (end - start - _length(everything)) * s,
            "copy_s": {d: _length(_union(iv)) * s for d, iv in sorted(per_dir.items())},
            "exposed_copy_s": {d: _minus(iv, busy) * s for d, iv in sorted(per_dir.items())},
            "streams": sorted({st for _, st, _, _ in device_events}),
            "gaps": gaps,
        }
    )
    return out


def _is_runtime_call(name: str) -> bool:
    """CUDA runtime (cudaX) and driver (cuX) API calls, as CUPTI names them."""
    return (name.startswith("cuda") and name[4:5].isupper()) or (name.startswith("cu") and name[2:3].isupper())


def _events(prof, cuda: bool) -> tuple[list[tuple[str, int, float, float]], list[tuple[str, float]]]:
    from torch.autograd import DeviceType

    device, host = [], []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            device.append((e.name, int(e.device_resource_id or 0), e.time_range.start, e.time_range.end))
        elif _is_runtime_call(e.name) or not cuda:  # a CPU run: its slowest host ops
            host.append((e.name, e.time_range.elapsed_us()))
    return device, host


def _where(frames: list[dict], roots: tuple[str, ...] | None = None) -> str:
    """The innermost frame of seqpar / transformers / kernel code that made an allocation, as 'file.py:line in func'."""
    roots = _own_roots() if roots is None else roots
    for f in frames or []:
        name = str(f.get("filename", ""))
        if name.startswith(roots):
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line', '?')} in {f.get('name', '?')}"
    return "torch internals"


def memory_peak(events: list[dict], before_bytes: int, top: int = PEAK_GROUPS, roots: tuple[str, ...] | None = None) -> dict:
    """Replay one step's allocator history (torch.cuda.memory._snapshot()'s device trace: ``alloc``, ``free_requested``
    and ``free_completed`` events with addr, size and frames) from ``before_bytes`` live at its start, and say what was
    live at the highest point: the total, how much of it was allocated before the step, the allocation that reached
    it, and the step's live allocations grouped by where they were made, largest first. A block stops counting when
    its free is requested, as torch.cuda.max_memory_allocated counts it (a block used on another stream is handed back
    to the cache later, ``free_completed``, but is no longer allocated). ``truncated``: the history held as many events
    as it keeps (HISTORY_ENTRIES), so its oldest were dropped and the replay may start from the wrong base."""
    live: dict[int, tuple[int, str]] = {}
    freed: set[int] = set()
    older = now = best = before_bytes  # older: bytes from before the step still live
    at_peak: dict[int, tuple[int, str]] = {}
    older_at_peak, reached = older, ("", 0)
    for ev in events:
        action, size, addr = ev.get("action"), int(ev.get("size") or 0), ev.get("addr")
        if action == "alloc":
            where = _where(ev.get("frames") or [], roots)
            live[addr] = (size, where)
            freed.discard(addr)
            now += size
            if now > best:
                best, at_peak, older_at_peak, reached = now, dict(live), older, (where, size)
        elif action == "free_requested" or (action == "free_completed" and addr not in freed):
            # (a completion without its request: the request came before the history began)
            freed.add(addr)
            now -= size
            if live.pop(addr, None) is None:
                older -= size  # a tensor of an earlier step (last step's gradients, a kept buffer) let go
    groups: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        g = groups.setdefault(where, [0, 0])
        g[0] += size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    gib = 2**30
    return {
        "peak_allocated_gib": round(best / gib, 4),
        "before_step_gib": round(older_at_peak / gib, 4),
        "reached_by": {"where": reached[0], "gib": round(reached[1] / gib, 4)},
        "live": [{"where": w, "gib": round(b / gib, 4), "allocations": n} for w, (b, n) in ranked],
        "truncated": len(events) >= HISTORY_ENTRIES,
    }


def _record_history(device: torch.device, on: bool) -> None:
    if device.type != "cuda":
        return
    if on:
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python", device=device)
    else:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


def _peak_of_step(device: torch.device, before_bytes: int) -> dict:
    snap = torch.cuda.memory._snapshot(device)
    traces = snap.get("device_traces") or []
    events = traces[device.index or 0] if len(traces) > (device.index or 0) else []
    return memory_peak(events, before_bytes)


def _counters(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats[k]) for k in ALLOCATOR_COUNTERS if k in stats}


@contextlib.contextmanager
def profiled_step(out: Path, rank: int, step: int, device: torch.device, log):
    """Profile what runs inside (one training step) and write its trace and summary under ``out/profile``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    before = _counters(device)
    before_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    _record_history(device, True)
    try:
        with profile(activities=activities) as prof:
            yield
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        peak = _peak_of_step(device, before_bytes) if device.type == "cuda" else None
    finally:
        _record_history(device, False)
    after = _counters(device)
    folder = out / "profile"
    check_folder(folder, "profile folder")  # a link there (or in it) would aim the trace anywhere
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / f"rank{rank}_step{step}.json.gz"
    check_file(trace, "profiler trace")
    # torch writes the trace with a plain open: to a fresh name of our own, then renamed over the trace's
    fd, tmp = tempfile.mkstemp(prefix=f".{trace.name}.", suffix=".tmp.json.gz", dir=folder)
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        os.replace(tmp, trace)
    finally:
        Path(tmp).unlink(missing_ok=True)
    summary = {"step": step, "rank": rank, "trace": trace.name, **summarize(*_events(prof, device.type == "cuda"))}
    if after:
        summary["allocator"] = {k: after[k] - before.get(k, 0) for k in after}
    if peak:
        summary["memory_peak"] = peak
    write_file(folder / f"rank{rank}_step{step}.json", json.dumps(summary, indent=2) + "\n", "profiler summary")
    if "kernel_busy_s" in summary:
        log.info(
            "step %d profiled: kernels busy %.3f s of a %.3f s device window, idle %.3f s, copies %s, %.3f s of them "
            "under no kernel; allocator %s; %s",
            step,
            summary["kernel_busy_s"],
            summary["device_window_s"],
            summary["idle_s"],
            ", ".join(f"{d} {t:.3f} s" for d, t in summary["copy_s"].items()) or "none",
            sum(summary["exposed_copy_s"].values()),
            summary.get("allocator", {}),
            folder / f"rank{rank}_step{step}.json",
        )
    else:
        log.info("step %d profiled: %s", step, folder / f"rank{rank}_step{step}.json")
    if peak:
        log.info(
            "step %d memory peak %.2f GiB allocated (%.2f before the step), reached by %.2f GiB at %s; largest live: %s",
            step,
            peak["peak_allocated_gib"],
            peak["before_step_gib"],
            peak["reached_by"]["gib"],
            printable(peak["reached_by"]["where"]),
            "; ".join(f"{g['gib']:.2f} GiB {printable(g['where'])}" for g in peak["live"][:4]),
        )
