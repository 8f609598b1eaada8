"""--profile-step: the step summary against hand-made device timelines, and a profiled step of a real CPU run (its trace,
its summary, and the run report leaving the profiled step out of the warm figures)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.runtime.train.profiling import copy_direction, memory_peak, summarize

from seqpar_testing import run_ranks
from seqpar_testing.train import make_plan, read_metrics

runner = CliRunner()


def test_copy_direction_reads_cuptis_names():
    assert copy_direction("Memcpy DtoH (Device -> Pinned)") == "DtoH"
    assert copy_direction("Memcpy HtoD (Pinned -> Device)") == "HtoD"
    assert copy_direction("Memset (Device)") is None
    assert copy_direction("void cutlass::Kernel<...>") is None


def test_summary_of_a_timeline_with_a_copy_half_under_kernels():
    # kernels on stream 7: [0, 100] and [150, 300] us, one more on stream 9 inside the first; a copy out [80, 200]
    # (50 us of it under no kernel: the gap 100-150), a copy back [310, 330] (all of it exposed), a memset [330, 340]
    device = [
        ("k0", 7, 0.0, 100.0),
        ("k_side", 9, 20.0, 60.0),
        ("k1", 7, 150.0, 300.0),
        ("Memcpy DtoH (Device -> Pinned)", 20, 80.0, 200.0),
        ("Memcpy HtoD (Pinned -> Device)", 20, 310.0, 330.0),
        ("Memset (Device)", 7, 330.0, 340.0),
    ]
    host = [("cudaStreamSynchronize", 40.0), ("cudaLaunchKernel", 3.0), ("cudaLaunchKernel", 2.0)]
    s = summarize(device, host)
    assert s["device_window_s"] == pytest.approx(340e-6)
    assert s["kernel_busy_s"] == pytest.approx(250e-6)
    assert s["copy_s"] == pytest.approx({"DtoH": 120e-6, "HtoD": 20e-6})
    assert s["exposed_copy_s"] == pytest.approx({"DtoH": 50e-6, "HtoD": 20e-6})
    assert s["idle_s"] == pytest.approx(10e-6)  # 300-310: nothing at all runs
    assert s["streams"] == [7, 9, 20]
    gap = s["gaps"][0]  # the longest kernel-free stretch: 100-150, while the copy out runs
    assert gap["seconds"] == pytest.approx(50e-6) and gap["at_s"] == pytest.approx(100e-6)
    assert (gap["after"], gap["before"], gap["copies_running"]) == ("k0", "k1", ["DtoH"])
    assert s["runtime_calls"][0] == {"name": "cudaStreamSynchronize", "seconds": pytest.approx(40e-6), "calls": 1}
    assert s["runtime_calls"][1] == {"name": "cudaLaunchKernel", "seconds": pytest.approx(5e-6), "calls": 2}


def _frame(file: str, line: int, func: str) -> dict:
    return {"filename": file, "line": line, "name": func}


def test_memory_peak_of_a_hand_made_allocator_history():
    # 10 bytes live before the step; the step frees 4 of them (last step's gradient), makes a 6-byte activation in
    # transformers and a 20-byte logits chunk in seqpar (the peak: 10 - 4 + 6 + 20 = 32), frees both, then a 5-byte
    # one; a block stops counting at its free's request (its completion comes later when another stream used it)
    mlp = [
        _frame("/x/torch/nn/functional.py", 1, "linear"),
        _frame("/x/transformers/models/llama/modeling_llama.py", 9, "forward"),
    ]
    loss = [_frame("/x/seqpar/runtime/parallel/loss.py", 42, "chunked_ce")]
    events = [
        {"action": "alloc", "addr": 100, "size": 6, "frames": mlp},
        {"action": "free_requested", "addr": 7, "size": 4},
        {"action": "free_completed", "addr": 7, "size": 4},  # a block from before the step
        {"action": "alloc", "addr": 200, "size": 20, "frames": loss},
        {"action": "segment_alloc", "addr": 0, "size": 1 << 20},  # the cache growing is not allocated memory
        {"action": "free_requested", "addr": 200, "size": 20},
        {"action": "free_completed", "addr": 200, "size": 20},
        {"action": "free_completed", "addr": 100, "size": 6},
        {"action": "alloc", "addr": 300, "size": 5, "frames": []},
    ]
    peak = memory_peak(events, before_bytes=10, roots=("/x/transformers/", "/x/seqpar/"))
    gib = 2**30
    assert peak["peak_allocated_gib"] == round(32 / gib, 4)
    assert peak["before_step_gib"] == round(6 / gib, 4)
    assert peak["reached_by"]["where"] == "loss.py:42 in chunked_ce"
    assert [g["where"] for g in peak["live"]] == ["loss.py:42 in chunked_ce", "modeling_llama.py:9 in forward"]
    assert [g["allocations"] for g in peak["live"]] == [1, 1] and not peak["truncated"]
    # a block used on another stream: requested free before the next allocation, completed after it
    late = [
        {"action": "alloc", "addr": 1, "size": 8, "frames": loss},
        {"action": "free_requested", "addr": 1, "size": 8},
        {"action": "alloc", "addr": 2, "size": 5, "frames": loss},
        {"action": "free_completed", "addr": 1, "size": 8},
    ]
    assert memory_peak(late, before_bytes=0, roots=("/x/seqpar/",))["peak_allocated_gib"] == round(8 / gib, 4)
    # a script under a folder named like a package is not that package's code: the install folders decide
    assert memory_peak(events, before_bytes=10, roots=())["live"][0]["where"] == "torch internals"


def test_memory_peak_agrees_with_the_allocator_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the allocator's history is recorded there only")
    from seqpar.runtime.train.profiling import _peak_of_step, _record_history

    dev = torch.device("cuda", torch.cuda.current_device())
    kept = torch.ones(1 << 20, device=dev)  # 4 MiB live before the step
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    _record_history(dev, True)
    try:
        a = torch.ones(1 << 22, device=dev)  # 16 MiB
        b = a * 2  # 16 MiB more: the peak
        del a, b
        c = torch.ones(1 << 20, device=dev)
        torch.cuda.synchronize(dev)
        peak = _peak_of_step(dev, before)
    finally:
        _record_history(dev, False)
    assert peak["peak_allocated_gib"] == pytest.approx(torch.cuda.max_memory_allocated(dev) / 2**30, abs=1e-4)
    assert peak["before_step_gib"] == pytest.approx(kept.numel() * 4 / 2**30, abs=1e-4)
    # a test's own lines are no package's code: its two 16 MiB tensors make one group
    assert peak["live"][0] == {"where": "torch internals", "gib": round(32 / 1024, 4), "allocations": 2}
    del c


def test_a_summary_without_device_activity_lists_only_host_calls():
    s = summarize([], [("aten::mm", 7.0)])
    assert s == {"runtime_calls": [{"name": "aten::mm", "seconds": pytest.approx(7e-6), "calls": 1}]}


def _profiled_run(rank, world, tmp):
    from seqpar.runtime.train.loop import parser, run

    plan = Path(tmp) / "plan.json"
    make_plan(1, steps=3).write(plan)
    run(parser().parse_args(["--plan", str(plan), "--output", str(Path(tmp) / "o"), "--profile-step", "2"]))


def test_a_profiled_step_writes_its_trace_and_summary_and_stays_out_of_the_warm_figures(tmp_path):
    run_ranks(_profiled_run, 1, str(tmp_path), timeout=120)
    out = tmp_path / "o"
    summary = json.loads((out / "profile" / "rank0_step2.json").read_text())
    assert summary["step"] == 2 and summary["trace"] == "rank0_step2.json.gz"
    assert summary["runtime_calls"] and all(c["seconds"] >= 0 for c in summary["runtime_calls"])
    assert "kernel_busy_s" not in summary  # a CPU run has no device activity
    with gzip.open(out / "profile" / "rank0_step2.json.gz", "rt") as f:
        assert json.load(f)["traceEvents"]
    metrics = read_metrics(out)
    assert [m.get("profiled", False) for m in metrics] == [False, True, False]
    report = json.loads((out / "run_report.json").read_text())
    assert report["profiled_steps"] == [2]
    assert report["measured"]["warm_steps"] == 1
    assert report["measured"]["step_time_s"] == pytest.approx(report["step_times_s"][2])
    assert report["measured"]["first_step_s"] == pytest.approx(report["step_times_s"][0])


def test_launch_passes_the_profiled_step_to_the_trainer(tmp_path):
    plan = tmp_path / "plan.json"
    make_plan(2).write(plan)
    r = runner.invoke(app, ["launch", str(plan), "--dry-run", "--output", str(tmp_path / "o"), "--profile-step", "3"])
    assert r.exit_code == 0, r.output
    cmd = [ln for ln in r.stdout.splitlines() if "torch.distributed.run" in ln]
    assert len(cmd) == 1 and "--profile-step 3" in cmd[0]
    bad = runner.invoke(app, ["launch", str(plan), "--dry-run", "--profile-step", "0"])
    assert bad.exit_code == 2
