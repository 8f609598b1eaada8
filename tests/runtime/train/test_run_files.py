"""The files the ranks write into a run folder (train.log, metrics.jsonl, run_report.json, tracker_run.json, the
profiler's, failed-rank<R>.json) are never written through a symbolic link, and every log line is one line.

The hostile case is the one a colleague's run folder could hold: ``train.log`` a relative link to a ``.pth`` file in a
venv's site-packages, which the next Python start executes line by line. Each writer is run as the trainer runs it
(the same function, the same arguments) with a link planted under its name, in every shape a link takes (relative,
absolute, dangling, to a folder), and must refuse with one line (SeqparError: exit 2 on the rank) and leave the target
byte for byte as it was. The slow test plants the link under a real ``seqpar launch`` and reads the exit code and the
last line.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqpar.plan.errors import SeqparError
from seqpar.runtime.train import progress, report, trackers

from seqpar_testing.train import make_plan

PTH = "import os; os.system('touch pwned')\n"  # what a .pth line runs at the next interpreter start


def _site_packages(tmp_path: Path) -> Path:
    """A stand-in for a venv's site-packages holding a .pth file (never the real one)."""
    site = tmp_path / "venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    (site / "seqpar-hook.pth").write_text(PTH)
    return site


def _plant(out: Path, name: str, target: Path, shape: str) -> Path:
    """``out/name`` made a symbolic link to ``target`` in one of the shapes a hostile folder could hold."""
    link = out / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if shape == "relative":
        link.symlink_to(os.path.relpath(target, link.parent))
    elif shape == "absolute":
        link.symlink_to(target)
    elif shape == "dangling":  # a write through it would create the target
        link.symlink_to(target.with_name("created-by-seqpar.pth"))
    else:
        raise ValueError(shape)
    return link


def _writers(out: Path):
    """(name, the writer as the trainer calls it) for every run-folder file rank 0 writes."""
    plan = make_plan(1)
    cpu = torch.device("cpu")
    log = logging.getLogger("test.run_files")

    def run_report():
        report.write_report(
            out, plan, step_times=[0.1, 0.1], tokens_per_step=64, sequences_per_step=1, device=cpu, backend="exact",
            dtype_reason="fp32", engine="ddp", steps_done=2, rank=0,
        )  # fmt: skip

    def failure_record():
        from seqpar.runtime.train.loop import _record

        _record(0, str(out), "invalid", "x")
        # _record swallows its own failure (the exit code still tells): nothing to raise, the target must be intact
        raise SeqparError("not written")

    return {
        "train.log": lambda: progress.setup_logging(out, 0).info("step 1"),
        "metrics.jsonl": lambda: report.Metrics(out, 0, [], 0, log).log({"step": 1, "loss": 1.0}),
        "run_report.json": run_report,
        "tracker_run.json": lambda: trackers.run_identity(out, resumed=True, project=None, run_name=None),
        "failed-rank0.json": failure_record,
    }


NAMES = ["train.log", "metrics.jsonl", "run_report.json", "tracker_run.json", "failed-rank0.json"]


@pytest.mark.parametrize("shape", ["relative", "absolute", "dangling"])
@pytest.mark.parametrize("name", NAMES)
def test_no_run_file_is_written_through_a_link(tmp_path, name, shape):
    site = _site_packages(tmp_path)
    target = site / "seqpar-hook.pth"
    out = tmp_path / "run"
    out.mkdir()
    link = _plant(out, name, target, shape)
    with pytest.raises(SeqparError) as e:
        _writers(out)[name]()
    message = str(e.value)
    assert "\n" not in message
    if name != "failed-rank0.json":
        assert "symbolic link" in message and name in message, message
    assert target.read_text() == PTH  # byte for byte as it was
    assert sorted(p.name for p in site.iterdir()) == ["seqpar-hook.pth"]  # nothing created beside it
    assert link.is_symlink()  # refused, not replaced either: the refusal names what was planted
    logging.getLogger("seqpar.train").handlers.clear()


def test_a_folder_the_trainer_writes_into_may_hold_no_link(tmp_path):
    """profile/ (--profile-step) and tensorboard/ (--report-to) linked elsewhere: refused before anything is written."""
    from seqpar.runtime.train.profiling import profiled_step

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    (out / "profile").symlink_to(elsewhere)
    with pytest.raises(SeqparError, match="profile folder .* symbolic link"):
        with profiled_step(out, 0, 1, torch.device("cpu"), logging.getLogger("test")):
            torch.ones(4).sum()
    (out / "profile").unlink()
    (out / "profile").mkdir()
    (out / "profile" / "rank0_step1.json.gz").symlink_to(elsewhere / "trace.json.gz")
    with pytest.raises(SeqparError, match="profile folder .* holds a symbolic link, .*rank0_step1.json.gz"):
        with profiled_step(out, 0, 1, torch.device("cpu"), logging.getLogger("test")):
            torch.ones(4).sum()
    pytest.importorskip("tensorboard")
    (out / "tensorboard").symlink_to(elsewhere)
    ident = {"project": "p", "run_name": "r", "run_id": "abc"}
    with pytest.raises(SeqparError, match="tensorboard folder .* symbolic link"):
        trackers.open_trackers(["tensorboard"], out, ident, resume_step=0, config={})
    assert list(elsewhere.iterdir()) == []


def test_links_a_tracker_makes_inside_its_folder_are_its_own(tmp_path):
    """W&B links wandb/latest-run and wandb/debug.log into its run folder: inside, so accepted; one that leads out is not."""
    from seqpar.runtime.train.run_files import check_folder

    wandb = tmp_path / "run" / "wandb"
    (wandb / "run-1" / "logs").mkdir(parents=True)
    (wandb / "latest-run").symlink_to("run-1")
    (wandb / "debug.log").symlink_to(wandb / "run-1" / "logs" / "debug.log")  # absolute, and dangling: still inside
    check_folder(wandb, "wandb folder")
    (wandb / "run-1" / "files").symlink_to(tmp_path)
    with pytest.raises(SeqparError, match=r"profile folder .*run-1/files"):
        check_folder(wandb, "profile folder")  # a folder seqpar's own code writes into: no link out of it
    (wandb / "run-1" / "logs" / "debug-core.log").symlink_to(tmp_path / "cache-log")
    check_folder(wandb, "wandb folder", library_links=True)  # W&B's own links out of its folder: W&B's business
    wandb.rename(tmp_path / "real-wandb")
    wandb.symlink_to(tmp_path / "real-wandb")
    with pytest.raises(SeqparError, match=r"wandb folder .* symbolic link"):
        check_folder(wandb, "wandb folder", library_links=True)  # but the folder itself is never a link


def test_a_profiled_step_still_writes_its_trace_and_summary(tmp_path):
    from seqpar.runtime.train.profiling import profiled_step

    with profiled_step(tmp_path, 0, 3, torch.device("cpu"), logging.getLogger("test")):
        torch.ones(64, 64) @ torch.ones(64, 64)
    files = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert files == ["rank0_step3.json", "rank0_step3.json.gz"], files  # no temporary left behind
    assert json.loads((tmp_path / "profile" / "rank0_step3.json").read_text())["trace"] == "rank0_step3.json.gz"


HOSTILE_VALUES = [
    "lr\nimport os; os.system('touch pwned')",  # a new line of Python in the log
    "cosine\r\x1b[2Kall good",  # a carriage return and a terminal's erase-line
    "a\u2028b\u2029c\x85d",  # Unicode line and paragraph separators, NEL
    "\u202etxt.exe",  # a bidirectional override
    "\ud800",  # a lone surrogate (JSON's \ud800 escape)
]


@pytest.mark.parametrize("value", HOSTILE_VALUES)
def test_every_log_message_is_one_escaped_line(tmp_path, capsys, value):
    log = progress.setup_logging(tmp_path, 0)
    log.info("resuming; changed: training.lr_schedule %s -> cosine", value)
    for h in log.handlers:
        h.flush()
    text = (tmp_path / "train.log").read_text(encoding="utf-8")
    assert text.count("\n") == 1 and text.endswith("\n"), repr(text)
    line = text.rstrip("\n")
    assert all(ch.isprintable() for ch in line), repr(line)
    assert "changed: training.lr_schedule" in line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(ch.isprintable() for ch in err.rstrip("\n")), repr(err)
    log.handlers.clear()


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"run_id": "' + "7" * 5001 + '"}', "holds no run_id"),  # a run id W&B would reject
        ('{"run_id": ' + "7" * 5001 + "}", "is not JSON"),  # a 5001-digit number
        ("[" * 10_000 + "]" * 10_000, "is not JSON"),  # nesting past the parser's depth
        ("{}" + " " * 100_000, "more than the"),  # bigger than such a file can be
        ('{"run_id": "abc", "run_name": "x\\nimport os"}', "run_name that is not a name"),
        ('{"run_id": "abc", "project": "\\ud800"}', "project that is not a name"),
        (b"\xff\xfe", "is not JSON"),
    ],
)
def test_a_hostile_tracker_run_file_is_one_line(tmp_path, content, match):
    path = tmp_path / trackers.RUN_FILE
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SeqparError, match=match) as e:
        trackers.run_identity(tmp_path, resumed=True, project=None, run_name=None)
    assert "\n" not in str(e.value) and all(ch.isprintable() for ch in str(e.value))


def test_metrics_still_keep_the_steps_a_checkpoint_covers(tmp_path):
    """The refusal did not cost the resume path: steps after the checkpoint are dropped, the rest kept."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    m = report.Metrics(tmp_path, 0, [], 2, logging.getLogger("test"))
    m.log({"step": 3, "loss": 0.5})
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_a_launch_never_writes_its_log_through_a_link(tmp_path):
    """The issue's case end to end: train.log a relative link to a .pth file; seqpar launch exits 2 with one last line
    naming the link, and the .pth file is unchanged."""
    site = _site_packages(tmp_path)
    target = site / "seqpar-hook.pth"
    plan = tmp_path / "plan.json"
    make_plan(1, steps=2).write(plan)
    out = tmp_path / "run"
    out.mkdir()
    _plant(out, "train.log", target, "relative")
    cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(plan), "--output", str(out), "--force", "--steps", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "train.log" in last and "symbolic link" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert target.read_text() == PTH
    assert not (tmp_path / "pwned").exists()
