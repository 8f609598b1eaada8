"""A plan is a file people download and share: it must not run code, restyle or hide what the terminal shows, or make
seqpar overwrite what is not a file. Each test fails on a seqpar that merged launch.env into the job unchecked, printed
plan text as rich markup with raw escapes, or replaced a FIFO or device with a regular file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.plan.env import plan_env_allowed
from seqpar.plan.errors import SeqparError
from seqpar.plan.files import write_atomic
from seqpar.plan.jobspec import LaunchOptions, build_job, launch_spec
from seqpar.plan.launch_plan import LaunchPlan

from seqpar_testing.train import make_plan

runner = CliRunner()
ESC = "\x1b"


def _plan_file(tmp_path: Path, env: dict | None = None, name: str = "tiny", reason: str | None = None) -> Path:
    data = json.loads(make_plan(2, "zigzag_ring_attn", 2).model_dump_json())
    data["launch"]["env"].update(env or {})
    data["workload"]["model"]["name"] = name
    if reason is not None:
        data["rationale"]["reasons"] = [reason]
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(data))
    return f


def test_a_plan_cannot_make_the_job_run_code(tmp_path):
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "ran"
    (evil / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('code from the plan ran')\n")
    plan = _plan_file(tmp_path, {"PYTHONPATH": str(evil)})
    out = tmp_path / "out"
    for cmd in (["launch", str(plan), "--output", str(out), "--steps", "1"], ["explain", str(plan)]):
        r = runner.invoke(app, cmd)
        assert r.exit_code == 2, r.output
        msg = r.stderr.strip()
        assert "\n" not in msg and "sets launch.env PYTHONPATH, which a plan may not set" in msg
        assert f"`seqpar launch {plan} --allow-env PYTHONPATH`" in msg
    assert not marker.exists() and not out.exists()
    # trusted on the command line: the job gets it, and the ranks are told it was allowed
    r = runner.invoke(app, ["launch", str(plan), "--output", str(out), "--allow-env", "PYTHONPATH", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert f"export PYTHONPATH={evil}" in r.stdout and "--allow-env PYTHONPATH --plan" in r.stdout
    assert not marker.exists() and not out.exists()
    with pytest.raises(SeqparError, match="PYTHONPATH"):  # the builder of the job refuses it too, without the flag
        build_job(LaunchPlan.load(plan, allow_env=["PYTHONPATH"]), plan, LaunchOptions(), output=out)


@pytest.mark.parametrize(
    "name, allowed",
    [
        ("NCCL_DEBUG", True),
        ("NCCL_IB_HCA", True),
        ("TORCH_NCCL_BLOCKING_WAIT", True),
        ("PYTORCH_CUDA_ALLOC_CONF", True),
        ("CUDA_VISIBLE_DEVICES", True),
        ("OMP_NUM_THREADS", True),
        ("SEQPAR_PG_TIMEOUT_S", True),
        ("SEQPAR_PINNED_BUDGET_GIB", True),
        ("SEQPAR_FAULT_STEP", False),  # seqpar's internals: a test hook, its own files
        ("SEQPAR_DATA_CACHE", False),
        ("SEQPAR_COEFFICIENTS", False),
        ("SEQPAR_ARCTIC_PYTHON", False),
        ("PYTHONPATH", False),
        ("LD_PRELOAD", False),
        ("LD_LIBRARY_PATH", False),
        ("PATH", False),
        ("HOME", False),
        ("NCCL_NET_PLUGIN", False),  # loads a shared library
        ("NCCL_DEBUG_FILE", False),  # writes where it says
        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", False),
        ("CUDA_CACHE_PATH", False),
    ],
)
def test_env_allow_list(name, allowed):
    assert plan_env_allowed(name) is allowed


@pytest.mark.parametrize("accelerator", ["cpu", "cuda"])
def test_what_seqpar_sets_is_allowed(accelerator):
    plan = make_plan(2, "zigzag_ring_attn", 2)
    if accelerator == "cuda":
        data = json.loads(plan.model_dump_json())
        data["cluster"]["accelerator"] = "cuda"
        plan = LaunchPlan.model_validate(data)
    env = launch_spec(plan).env
    assert env and all(plan_env_allowed(k) for k in env), env


def test_plan_text_is_printed_literally(tmp_path):
    name = "[/bold] tiny" + ESC + "[2K"  # unbalanced markup crashed rich; ESC[2K erased the line on a terminal
    plan = _plan_file(tmp_path, {"NCCL_DEBUG": "INFO" + ESC + "[1A"}, name=name, reason="[red]alarm[/red]\u202e")
    r = runner.invoke(app, ["explain", str(plan)], terminal_width=400)
    assert r.exit_code == 0, r.output
    assert ESC not in r.output and "\u202e" not in r.output
    assert "[/bold] tiny\\x1b[2K" in r.stdout and "[red]alarm[/red]\\u202e" in r.stdout
    r = runner.invoke(app, ["launch", str(plan), "--dry-run", "--output", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert ESC not in r.output and "export NCCL_DEBUG='INFO\\x1b[1A'" in r.stdout
    r = runner.invoke(app, ["check", str(plan)])
    assert r.exit_code == 0 and ESC not in r.output


@pytest.mark.skipif(sys.platform != "linux", reason="FIFOs and device nodes as on Linux")
def test_write_atomic_writes_only_files(tmp_path):
    from seqpar_testing.cli import device_node  # our own node: a broken write_atomic must never replace the real /dev/null

    fifo, folder, link = tmp_path / "fifo", tmp_path / "folder", tmp_path / "link"
    os.mkfifo(fifo)
    folder.mkdir()
    null = device_node(tmp_path / "null")
    link.symlink_to(null)
    for target, kind in ((fifo, "a FIFO"), (folder, "a folder"), (link, "a device or socket"), (null, "a device or socket")):
        with pytest.raises(SeqparError, match=f"is {kind}, not a file"):
            write_atomic(target, "x")
    assert fifo.is_fifo() and folder.is_dir() and link.is_symlink() and null.is_char_device()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder", "link", "null"]  # no temporary file left
    write_atomic(tmp_path / "new" / "file.json", "{}")  # a new path, and over a regular file
    write_atomic(tmp_path / "new" / "file.json", "[]")
    assert (tmp_path / "new" / "file.json").read_text() == "[]"
