"""The output folder stays taken until every process of a job has exited, and a burst of stop signals tells the truth.

- The locks (seqpar.runtime.launch.lock), without torch: a process holding the ranks' lock keeps the folder taken after
  its launcher is gone (the next launch waits, then refuses naming it); a symbolic link as either lock file is refused
  with one line and its target is left as it was.
- Real 2-rank gloo launches (the ``launches`` fixture of test_stopping): ``kill -9`` of the launcher alone, then a
  ``--resume`` started at once. The new launch waits for the old ranks (which stop after their step, checkpointed) and
  resumes from their checkpoint: no old rank is alive once the new ranks run, metrics.jsonl reads 1, 2, 3, ... and the
  resumed job starts from the old job's last checkpoint. Then three SIGTERMs 20-50 ms apart to the new launcher: exit
  143, one line naming the checkpoint the ranks wrote, and no rank left. The slow set repeats the burst 8 times (SIGTERM
  and SIGINT).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_stopping import Launch, _gone, launches  # noqa: F401  (launches: the fixture, used by name)
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.plan.errors import SeqparError
from seqpar.runtime.launch import lock

from seqpar_testing.cli import one_error_line
from seqpar_testing.train import make_plan, read_metrics

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="parent-death signals and /proc/locks are Linux's")


# --------------------------------------------------------------------------------------------- the locks alone


def _rank_holding(out: Path) -> subprocess.Popen:
    """A process that holds ``out``'s ranks lock as a rank does (lock.hold), until killed."""
    code = "from seqpar.runtime.launch import lock; lock.hold(); print('held', flush=True); import time; time.sleep(600)"
    env = {**os.environ, lock.RANKS_ENV: str(out / lock.RANKS_NAME)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_rank_keeps_the_folder_taken_after_its_launcher_is_gone(tmp_path):
    held = lock.lock_output(tmp_path)
    rank = _rank_holding(tmp_path)
    try:
        assert lock.lock_holder(tmp_path) == os.getpid()
        t0 = time.monotonic()
        with pytest.raises(SeqparError, match=f"is in use by another seqpar launch \\(pid {os.getpid()}\\)"):
            lock.check_free(tmp_path, 60)  # a live launcher: refused at once, not waited for
        assert time.monotonic() - t0 < 5
        held.close()  # the launcher is gone (kill -9 frees its lock the same way); its rank is not
        assert lock.lock_holder(tmp_path) is None
        assert lock.rank_pids(tmp_path) == [rank.pid]
        said = []
        t0 = time.monotonic()
        with pytest.raises(SeqparError, match="still in use by ranks of an earlier launch") as e:
            lock.check_free(tmp_path, 0.5, said.append)
        assert time.monotonic() - t0 >= 0.5
        assert f"stop them (kill {rank.pid})" in str(e.value) and f"launcher pid {os.getpid()}" in str(e.value)
        assert len(said) == 1 and f"still exiting (pid {rank.pid}); waiting up to 0 s" in said[0], said
    finally:
        rank.kill()
        rank.wait()
    lock.check_free(tmp_path, 5)  # the rank is gone: free, no wait
    assert lock.rank_pids(tmp_path) is None


@pytest.mark.parametrize("name", [lock.LOCK_NAME, lock.RANKS_NAME])
def test_a_lock_file_link_is_refused_and_its_target_untouched(tmp_path, name):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    plan, out = tmp_path / "plan.json", tmp_path / "out"
    make_plan(2, "zigzag_ring_attn", 2).write(plan)
    out.mkdir()
    (out / name).symlink_to(target)
    r = CliRunner().invoke(app, ["launch", str(plan), "--output", str(out), "--steps", "2"])
    assert r.exit_code == 2, r.output
    assert "is a symbolic link; seqpar never follows links in a run folder" in one_error_line(r)
    assert target.read_text() == "keep me\n"
    with pytest.raises(SeqparError, match="symbolic link"):
        lock.lock_output(out)
    assert target.read_text() == "keep me\n" and (out / name).is_symlink()


# --------------------------------------------------------------------------------------------- real launches


class Resume(Launch):
    """`seqpar launch --resume` into ``first``'s folder, in a session of its own."""

    def __init__(self, first: Launch):
        self.plan, self.out, self.err = first.plan, first.out, first.out.parent / "stderr-resume.txt"
        cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(self.plan), "--output", str(self.out), "--resume"]
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return status != "Z"


def _burst(job: Launch, sig: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(3):
        job.proc.send_signal(sig)
        if i < 2:
            time.sleep(rng.uniform(0.02, 0.05))


def _check_stopped(job: Launch, sig: int, seen: int, ranks: dict[int, int], rc: int) -> None:
    """Exit 128 + sig, no rank alive, and one line that names the checkpoint the ranks left (or truly says there is
    none: a signal before a rank could stop at a step boundary)."""
    assert rc == 128 + sig, job.stderr()[-3000:]
    assert not [p for p in ranks.values() if _alive(p)], "ranks alive after the launcher exited"
    progress = ("[seqpar rank 0] ", "[seqpar rank 1] ")  # the ranks' own log lines
    after = [ln for ln in job.stderr()[seen:].splitlines() if ln.strip() and not ln.startswith(progress)]
    name = signal.Signals(sig).name
    if (job.out / "checkpoints" / "latest").is_file():
        step = job.latest_step()
        ckpt = job.out / "checkpoints" / f"step-{step:06d}"
        assert after == [f"seqpar launch: stopped by {name}; last checkpoint {ckpt} (continue with --resume)"], after
        assert step == job.steps_done()  # the step in flight finished and was checkpointed; nothing after it
    else:
        assert after == [f"seqpar launch: stopped by {name}; no checkpoint was written"], after
        assert not list((job.out / "checkpoints").glob("step-*"))


def test_kill_9_of_the_launcher_then_resume_at_once_then_a_burst_of_sigterm(tmp_path, launches):  # noqa: F811
    """Rank 1 of the first job is held (SIGSTOP) while its launcher is killed, so its ranks cannot stop before the resume
    starts (on a loaded machine they took 14 s): the resume must wait for them, and start only from what they left."""
    first = launches(tmp_path)
    first.wait_for(lambda: first.steps_done() >= 2, 300, "two steps")
    old = first.ranks()
    assert sorted(old) == [0, 1]
    os.kill(old[1], signal.SIGSTOP)
    os.kill(first.proc.pid, signal.SIGKILL)  # the launcher alone: its ranks get the parent-death signal (rank 1 when resumed)
    first.proc.wait(timeout=10)
    job = Resume(first)  # at once
    try:
        job.wait_for(lambda: "are still exiting" in job.stderr(), 60, "the resume waiting for the old ranks")
        time.sleep(2)
        assert not job.ranks() and all(_alive(p) for p in old.values()), "the resume started beside the old ranks"
    finally:
        os.kill(old[1], signal.SIGCONT)
    line = next(ln for ln in job.stderr().splitlines() if "are still exiting" in ln)
    assert f"(launcher pid {first.proc.pid}, which has ended) are still exiting (pid {old[0]}, {old[1]})" in line, line
    job.wait_for(lambda: job.ranks(), 120, "the resumed job's ranks")
    assert not [p for p in old.values() if _alive(p)], "the resumed job started while ranks of the killed launcher ran"
    old_last = first.latest_step()  # written by the old ranks as they stopped, before the new job read the folder
    assert old_last >= 2
    job.wait_for(lambda: job.steps_done() >= old_last + 2, 300, "two resumed steps")
    log = (job.out / "train.log").read_text()
    assert f"resuming from {job.out / 'checkpoints' / f'step-{old_last:06d}'} (step {old_last})" in log, log[-3000:]
    seen, ranks = len(job.stderr()), job.ranks()
    _burst(job, signal.SIGTERM, 0)
    _check_stopped(job, signal.SIGTERM, seen, ranks, job.proc.wait(timeout=90))
    steps = [m["step"] for m in read_metrics(job.out)]
    assert steps == list(range(1, len(steps) + 1)), steps  # one job at a time wrote it: 1, 2, 3, ...
    assert (job.out / lock.LOCK_NAME).read_text() == f"{job.proc.pid}\n"


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(8))
def test_a_burst_of_stop_signals_tells_the_truth(tmp_path, launches, trial):  # noqa: F811
    """SIGTERM and SIGINT alternately, sent as soon as the ranks run (trial 0, 1: before or in the first step) or after
    a few steps."""
    sig = signal.SIGTERM if trial % 2 == 0 else signal.SIGINT
    job = launches(tmp_path)
    job.wait_for(lambda: len(job.ranks()) == 2 and job.steps_done() >= trial // 2, 300, "the ranks")
    seen, ranks = len(job.stderr()), job.ranks()
    _burst(job, sig, trial)
    _check_stopped(job, sig, seen, ranks, job.proc.wait(timeout=90))
