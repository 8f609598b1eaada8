"""Stopping and hanging, on real 2-rank gloo launches of the tiny model (zigzag_ring_attn) driven by real signals.

- SIGTERM to the launcher alone (`kill PID`, what a scheduler sends) and Ctrl-C (SIGINT to the launcher's process group,
  as a terminal sends it): the ranks finish their step, write a checkpoint and exit; the launcher ends with one line
  naming that checkpoint and exit code 143 / 130, and no rank is left. While it runs, a second launch into the same folder
  is refused (exit 2) naming the first one's pid.
- `kill -9` of the launcher's process group: its ranks (each in a session of its own) stop by themselves, checkpointed.
- A rank killed by SIGKILL (what the OOM killer sends) is named by its exit status, not its peer's "connection reset".
- A stopped rank (SIGSTOP) does not block its peer: the peer fails within SEQPAR_PG_TIMEOUT_S and the launcher names the
  stopped rank; every mode's waits (point-to-point, all-to-all) time out the same way (run_ranks, a silent peer).
The default set stops a job by a signal once (SIGTERM) and kills a rank once (SIGKILL); Ctrl-C (the same stop, delivered
to the group), `kill -9` of the launcher and the stopped rank (a launch that waits out a timeout; the silent peer below
times out in every mode) are in the slow set.

This process makes itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER) while a test runs, so ranks orphaned by a
killed launcher are reparented here and their end can be seen wherever the tests run; whatever a test leaves running is
killed after it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seqpar.cli import app

from seqpar_testing import run_ranks
from seqpar_testing.train import make_plan

PR_SET_CHILD_SUBREAPER = 36
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="parent-death signals and subreapers are Linux's")


@pytest.fixture
def launches():
    """Start Launch(...)es as this process's children (and its orphans' subreaper); kill whatever is left afterwards."""
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    started: list[Launch] = []
    yield lambda *a, **k: started.append(Launch(*a, **k)) or started[-1]
    for job in started:  # a failed test must not leave a job training: every process whose command names its folder
        marker = str(job.out).encode()
        ours = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and marker in _cmdline(int(p.name))]
        for pid in ours:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _gone(ours, timeout=10)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class Launch:
    """`seqpar launch` in a session of its own (as from a terminal), stderr to a file."""

    def __init__(self, tmp_path: Path, pg_timeout_s: int = 60, steps: int = 1000):
        plan = make_plan(2, "zigzag_ring_attn", 2, steps=steps)
        data = json.loads(plan.model_dump_json())
        data["launch"]["env"] = {"SEQPAR_PG_TIMEOUT_S": str(pg_timeout_s), "OMP_NUM_THREADS": "1"}
        self.plan, self.out, self.err = tmp_path / "plan.json", tmp_path / "out", tmp_path / "stderr.txt"
        self.plan.write_text(json.dumps(data))
        cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(self.plan), "--output", str(self.out)]
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    def steps_done(self) -> int:
        m = self.out / "metrics.jsonl"
        return len(m.read_text().splitlines()) if m.is_file() else 0

    def wait_for(self, cond, timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while not cond():
            assert self.proc.poll() is None or cond(), f"launcher ended before {what}:\n{self.stderr()[-3000:]}"
            assert time.monotonic() - t0 < timeout, f"no {what} within {timeout} s:\n{self.stderr()[-3000:]}"
            time.sleep(0.1)
        return time.monotonic() - t0

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the launcher's children (torchrun's workers)."""
        kids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        out = {}
        for pid in map(int, kids):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = pid
        return out

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def latest_step(self) -> int:
        pointer = self.out / "checkpoints" / "latest"
        return json.loads((self.out / "checkpoints" / pointer.read_text().strip() / "trainer_state.json").read_text())["step"]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _gone(pids, timeout: float) -> dict[int, int | None]:
    """Wait for the processes to end; their exit codes when they were our children (or reparented to us), else None."""
    codes, t0 = {}, time.monotonic()
    while len(codes) < len(pids) and time.monotonic() - t0 < timeout:
        for pid in pids:
            if pid in codes:
                continue
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # not ours: reaped elsewhere, or still running under another parent
                if not Path(f"/proc/{pid}").exists():
                    codes[pid] = None
        time.sleep(0.1)
    return codes


@pytest.mark.parametrize("how", ["sigterm", pytest.param("ctrl-c", marks=pytest.mark.slow)])
def test_a_stop_signal_ends_the_job_after_a_checkpoint_with_one_line(tmp_path, launches, how):
    job = launches(tmp_path)
    job.wait_for(lambda: job.steps_done() >= 2, 300, "two steps")
    ranks = job.ranks()
    assert sorted(ranks) == [0, 1]
    if how == "sigterm":  # a second launch into the same folder is refused while this one holds it
        r = CliRunner().invoke(app, ["launch", str(job.plan), "--output", str(job.out), "--resume"])
        assert r.exit_code == 2 and f"is in use by another seqpar launch (pid {job.proc.pid})" in r.stderr, r.output
    seen = len(job.stderr())
    os.killpg(job.proc.pid, signal.SIGINT) if how == "ctrl-c" else job.proc.send_signal(signal.SIGTERM)
    rc = job.proc.wait(timeout=60)
    assert rc == (130 if how == "ctrl-c" else 143), job.stderr()[-3000:]
    progress = ("[seqpar rank 0] step ", "[seqpar rank 0] checkpoint ")  # the rank's own log lines of steps and saves
    after = [ln for ln in job.stderr()[seen:].splitlines() if ln.strip() and not ln.startswith(progress)]
    step = job.latest_step()
    sig = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    ckpt = job.out / "checkpoints" / f"step-{step:06d}"
    assert after == [f"seqpar launch: stopped by {sig}; last checkpoint {ckpt} (continue with --resume)"], after
    assert step == job.steps_done() >= 2  # the step in flight finished and was checkpointed
    assert not (job.out / "run_report.json").exists()  # the run did not end: no report claims it did
    assert all(not Path(f"/proc/{pid}").exists() for pid in ranks.values())


@pytest.mark.slow
def test_kill_9_of_the_launcher_group_leaves_no_rank_running(tmp_path, launches):
    job = launches(tmp_path)
    job.wait_for(lambda: job.steps_done() >= 2, 300, "two steps")
    ranks = job.ranks()
    os.killpg(job.proc.pid, signal.SIGKILL)  # the ranks are in sessions of their own: this does not reach them
    job.proc.wait(timeout=10)
    codes = _gone(list(ranks.values()), timeout=45)  # torchrun's 30 s grace at most
    assert sorted(codes) == sorted(ranks.values()), f"ranks still running: {set(ranks.values()) - set(codes)}"
    assert set(codes.values()) <= {143, None}, codes  # SIGTERM from the parent-death signal: stopped, checkpointed
    assert job.latest_step() >= 2


def test_a_rank_killed_by_sigkill_is_named_by_its_exit_status(tmp_path, launches):
    job = launches(tmp_path)
    job.wait_for(lambda: job.steps_done() >= 2, 300, "two steps")
    os.kill(job.ranks()[1], signal.SIGKILL)  # what the kernel's OOM killer sends
    rc = job.proc.wait(timeout=90)
    last = job.stderr().strip().splitlines()[-1]
    assert rc == 1 and "first failure: rank 1 was killed by SIGKILL" in last, job.stderr()[-3000:]


@pytest.mark.slow
def test_a_stopped_rank_does_not_block_its_peer(tmp_path, launches):
    # The timeout is all this test waits out, and also the process-group start's: ranks that start far apart under load
    # meet within it (they start together, and both import the same modules before the group forms).
    job = launches(tmp_path, pg_timeout_s=10)
    job.wait_for(lambda: job.steps_done() >= 2, 300, "two steps")
    stopped = job.ranks()[1]
    os.kill(stopped, signal.SIGSTOP)
    job.wait_for(lambda: "seqpar: rank 0 failed:" in job.stderr(), 10 + 20, "rank 0 giving up on rank 1 (10 s timeout)")
    # torchrun's agent now sends the stopped rank SIGTERM and, 30 s later, SIGKILL; resuming it lets the job end sooner
    os.kill(stopped, signal.SIGCONT)
    rc = job.proc.wait(timeout=60)
    last = job.stderr().strip().splitlines()[-1]
    assert rc == 1 and "first failure: rank 1 stopped answering; rank 0 failed:" in last, job.stderr()[-3000:]


def test_a_dead_launchers_lock_is_taken_over(tmp_path):
    from seqpar.runtime.launch.run import LOCK_NAME, lock_holder, lock_output

    (tmp_path / LOCK_NAME).write_text("999999999\n")  # left by a launcher that died: no process holds the flock
    assert lock_holder(tmp_path) is None
    held = lock_output(tmp_path)
    try:
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        holder = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from seqpar.runtime.launch.run import lock_holder; print(lock_holder(__import__('pathlib').Path({str(tmp_path)!r})))",
            ],
            capture_output=True,
            text=True,
        )
        assert holder.stdout.strip() == str(os.getpid()), holder.stderr
    finally:
        held.close()
    assert lock_holder(tmp_path) is None


# --------------------------------------------------------------------------------------------- every mode's waits time out


def _silent_peer(rank, world):
    """For each mode, rank 1 says nothing on a fresh group with a 1 s timeout (it waits in the default group's barrier):
    rank 0's attention call must fail within the timeout, naming rank 1."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from seqpar.runtime.parallel.attention import get_attention_fn
    from seqpar.runtime.parallel.comm import PeerTimeoutError

    out = {}
    for mode, kw in (
        ("zigzag_ring_attn", {}),
        ("dist_flash_attn", {}),
        ("ulysses_attn", {}),
        ("usp_attn", {"ulysses_degree": 1}),
    ):
        group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
        if rank == 0:
            q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))  # (B, S_local, H, D)
            t0 = time.monotonic()
            try:
                get_attention_fn(mode)(q, k, v, group=group, **kw)
                out[mode] = "returned"
            except PeerTimeoutError as e:
                out[mode] = (e.peers, round(time.monotonic() - t0, 1), str(e))
        dist.barrier()  # the default group is unharmed: the next mode starts together
    return out


def test_every_modes_waits_time_out_naming_the_silent_rank():
    got = run_ranks(_silent_peer, 2, timeout=90)[0]
    for mode, res in got.items():
        assert res != "returned", mode
        peers, secs, msg = res
        assert peers == [1] and 0.9 <= secs < 8, (mode, res)
        assert msg.startswith("rank 1 did not answer rank 0 within 1 s"), msg
