"""bench/multi_gpu.sh, the multi-GPU bench, and its helpers: the pure parts exactly, then its CPU dry run end to end.

- collectives.py: nccl-tests' bus-bandwidth factors (NVIDIA/nccl-tests doc/PERFORMANCE.md, "Summary"; src/sendrecv.cu:
  factor 1), the message sizes, bad options refused in one line.
- multi_gpu_cases.py: the verify cases and run lengths the advisor gives on 2 and 4 gloo ranks (usp_attn needs 4).
- multi_gpu.sh: bad options refused (exit 2, one line) before anything runs.
- multi_gpu_report.py: a run out of memory (torch's OutOfMemoryError in a rank's failure record) becomes a row marked
  oom that seqpar calibrate's reader takes; any other crash is no row and fails the bench.
- The dry run (slow: about 3-7 minutes on 2 cores): `bash bench/multi_gpu.sh --cpu 2` on 2 gloo ranks with the tiny
  model; every mode's verify passed, every bandwidth row positive and consistent, every mode run at three lengths,
  `seqpar calibrate` ingested the rows, and the report names each mode and why usp_attn is not run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import collectives  # noqa: E402
import multi_gpu_cases  # noqa: E402

from seqpar.advisor.cost.measurements import load_measurements  # noqa: E402

SPLIT_ON_2 = ["zigzag_ring_attn", "dist_flash_attn", "ulysses_attn"]
MODES_ON_2 = ["data_parallel", *SPLIT_ON_2]


def _env() -> dict:
    """This interpreter's `seqpar` and `python` first on PATH, as an activated environment has them."""
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHON": sys.executable,
    }


@pytest.mark.parametrize(
    "op, n, factor",
    [
        ("all_reduce", 2, 1.0),  # 2(n-1)/n
        ("all_reduce", 8, 1.75),
        ("all_gather", 2, 0.5),  # (n-1)/n
        ("all_gather", 8, 0.875),
        ("all_to_all", 4, 0.75),  # (n-1)/n
        ("send_recv", 8, 1.0),  # sendrecv.cu: busbw = algbw
    ],
)
def test_bus_factor_is_nccl_tests(op, n, factor):
    assert collectives.bus_factor(op, n) == pytest.approx(factor)
    r = collectives.row(op, 2**20, 1e-3, n, "nccl", "gpu", 20)
    assert r["algbw_gb_s"] == pytest.approx(2**20 / 1e-3 / 1e9)
    assert r["busbw_gb_s"] == pytest.approx(r["algbw_gb_s"] * factor)


def test_sizes_split_evenly_over_the_ranks():
    assert collectives.sizes(1024, 2**20, 4, 2) == [1024, 4096, 16384, 65536, 262144, 1048576]
    # 1000 bytes over 3 ranks of float32: down to 996 = 3 x 83 x 4; the smallest is one element per rank
    assert collectives.sizes(1000, 4000, 4, 3) == [996, 3996]
    assert collectives.sizes(1, 8, 2, 8) == [32]
    assert collectives.parse_bytes("256K") == 262144 and collectives.parse_bytes("1G") == 2**30


def test_collectives_refuses_bad_options_in_one_line(capsys):
    assert collectives.main(["--out", "x.jsonl", "--ops", "all_reduce,broadcast"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "operations are all_to_all, all_gather, send_recv, all_reduce" in err[0]


def _cases(tmp_path, *argv) -> dict:
    out = tmp_path / "cases.json"
    assert multi_gpu_cases.main([*argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_verify_cases_on_2_and_4_ranks(tmp_path):
    two = _cases(tmp_path, "degrees", "--model", "tiny", "--cluster", "cpu:2", "--seq-len", "64")
    assert [(c["mode"], c["sp_degree"], c["ulysses_degree"]) for c in two["verify"]] == [
        ("data_parallel", 1, 1),
        ("zigzag_ring_attn", 2, 1),
        ("dist_flash_attn", 2, 1),
        ("ulysses_attn", 2, 1),
    ]
    assert list(two["skipped"]) == ["usp_attn"] and "at least 4 ranks" in two["skipped"]["usp_attn"]
    four = _cases(tmp_path, "degrees", "--model", "tiny", "--cluster", "cpu:4", "--seq-len", "64")
    got = {(c["mode"], c["sp_degree"], c["ulysses_degree"]) for c in four["verify"]}
    assert ("usp_attn", 4, 2) in got and ("zigzag_ring_attn", 4, 1) in got and ("zigzag_ring_attn", 2, 1) in got
    assert four["skipped"] == {} and four["cluster"]["accelerator"] == "cpu"


def test_three_lengths_per_mode_within_the_fit_and_the_budget(tmp_path):
    from seqpar.advisor.search import advise_by_cost

    res = _cases(tmp_path, "lengths", "--model", "tiny", "--cluster", "cpu:2", "--unit", "128", "--step-budget-s", "0.05")
    by_mode: dict[str, list[dict]] = {}
    for r in res["runs"]:
        by_mode.setdefault(r["mode"], []).append(r)
    assert list(by_mode) == MODES_ON_2 and list(res["skipped"]) == ["usp_attn"]
    for mode, runs in by_mode.items():
        lens = [r["seq_len"] for r in runs]
        assert lens == [lens[0], 2 * lens[0], 4 * lens[0]] and lens[0] % 128 == 0, (mode, lens)
        assert all(r["sp_degree"] == (1 if mode == "data_parallel" else 2) for r in runs)
        assert lens[-1] <= runs[-1]["max_seq_len"]
        args = argparse.Namespace(model="tiny", gpu=None, gpus=None, cluster="cpu:2", host_ram_gib=None)
        step = advise_by_cost(multi_gpu_cases._request(args, mode, lens[-1], sp_degree=runs[0]["sp_degree"]))
        assert step.prediction.step_time_s <= 0.05 or lens[0] == 128  # halved no lower than 4 units


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--cpu", "1"], "--cpu 1: give 2 or more ranks"),
        (["--cpu", "2", "--stages", "verify,fast"], "fast is not a stage"),
        (["--cpu", "2", "--steps", "1"], "--steps 1: give 2 or more"),
        (["--cpu", "2", "--bogus", "1"], "unknown option --bogus"),
        (["--cpu"], "--cpu needs a value"),
    ],
)
def test_script_refuses_bad_options_before_running(tmp_path, argv, says):
    r = subprocess.run(
        ["bash", str(ROOT / "bench/multi_gpu.sh"), "--out", str(tmp_path / "o"), *argv],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=30,
    )  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cpu_dry_run_end_to_end(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run(
        ["bash", str(ROOT / "bench/multi_gpu.sh"), "--cpu", "2", "--out", str(out)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=1400,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr

    # verify: every mode 2 ranks allow passed, against data_parallel, within fp32's tolerance
    for mode in MODES_ON_2:
        res = json.loads(
            (out / "verify" / f"{mode}-sp{1 if mode == 'data_parallel' else 2}" / "verify" / "verify.json").read_text()
        )
        assert res["ok"] and res["mode"] == mode and res["world_size"] == 2, res
        assert res["grads"]["max_rel_diff"] <= res["tolerance"] == pytest.approx(2e-5)

    # bandwidth: every operation at every size, positive, busbw = algbw x nccl-tests' factor
    rows = [json.loads(x) for x in (out / "bandwidth.jsonl").read_text().splitlines()]
    sizes = collectives.sizes(1024, 256 * 1024, 4, 2)
    assert sorted((x["op"], x["bytes"]) for x in rows) == sorted((op, s) for op in collectives.OPS for s in sizes)
    for x in rows:
        assert x["time_us"] > 0 and x["algbw_gb_s"] > 0 and x["backend"] == "gloo" and x["ranks"] == 2
        assert x["algbw_gb_s"] == pytest.approx(x["bytes"] / (x["time_us"] * 1e-6) / 1e9)
        assert x["busbw_gb_s"] == pytest.approx(x["algbw_gb_s"] * collectives.bus_factor(x["op"], 2))

    # runs: three lengths per mode, each a run report; seqpar calibrate's reader takes every row
    measured = load_measurements([out / "rows.json"])
    got = sorted((m.strategy.mode, m.workload.seq_len) for m in measured)
    lengths = json.loads((out / "lengths.json").read_text())["runs"]
    assert got == sorted((x["mode"], x["seq_len"]) for x in lengths)
    assert sorted({mode for mode, _ in got}) == sorted(MODES_ON_2) and len(got) == 3 * len(MODES_ON_2)
    assert all(m.tokens_per_s > 0 and m.cluster.accelerator == "cpu" and not m.oom for m in measured)
    calib = json.loads((out / "calibrate.json").read_text())  # what the script's `seqpar calibrate --json` printed
    assert [row["label"] for row in calib["rows"][-len(measured) :]] == [m.label for m in measured]
    assert (out / "coefficients.json").is_file()

    report = (out / "report.md").read_text()
    for mode in MODES_ON_2:
        assert report.count(f"| {mode} |") == 1 + 3, mode  # its verify row and its three runs
    assert "usp_attn: not verified on 2 ranks" in report and "at least 4 ranks" in report
    assert "Everything that ran passed." in report and "Ingested the 12 rows of this bench" in report


def test_a_run_out_of_memory_is_a_row_and_a_crash_is_a_failure(tmp_path):
    """The report stage's reading of a run that ended: torch's OutOfMemoryError in a rank's failure record makes the plan
    a row marked oom (which seqpar calibrate's reader takes); any other failure is no row and fails the bench."""
    import multi_gpu_report

    from seqpar_testing.cli import run

    out = tmp_path / "bench"
    (out / "plans").mkdir(parents=True)
    cases = []
    for n, message in ((256, "OutOfMemoryError: CUDA out of memory. Tried to allocate 5.27 GiB"), (512, "RuntimeError: boom")):
        name = f"zigzag_ring_attn-{n}"
        r = run(
            "advise",
            "-s",
            n,
            "-m",
            "tiny",
            "--cluster",
            "cpu:2",
            "--mode",
            "zigzag_ring_attn",
            "-o",
            out / "plans" / f"run-{name}.json",
        )
        assert r.exit_code == 0, r.stderr
        (out / "runs" / name).mkdir(parents=True)
        (out / "runs" / name / "failed-rank1.json").write_text(json.dumps({"rank": 1, "kind": "error", "message": message}))
        cases.append({"mode": "zigzag_ring_attn", "sp_degree": 2, "seq_len": n, "max_seq_len": 4096})
    (out / "lengths.json").write_text(
        json.dumps({"ranks": 2, "model": "tiny", "step_budget_s": 0.05, "runs": cases, "skipped": {}})
    )
    (out / "status.tsv").write_text("run\tzigzag_ring_attn-256\t0\t1\nrun\tzigzag_ring_attn-512\t0\t1\n")

    assert [c["outcome"] for c in multi_gpu_report.run_cases(out)] == ["oom", "failed"]
    assert multi_gpu_report.main(["rows", str(out)]) == 0
    (row,) = load_measurements([out / "rows.json"])
    assert row.oom and row.tokens_per_s is None and row.workload.seq_len == 256
    assert multi_gpu_report.main(["report", str(out)]) == 1  # the crash fails the bench; the report is still written
    report = (out / "report.md").read_text()
    assert "1 step(s) failed: zigzag_ring_attn-512" in report and "oom: OutOfMemoryError" in report
