"""Run one job's ranks under torchrun's elastic agent in this process, and say how each rank ended.

The job's command is ``python -m torch.distributed.run ARGS`` (seqpar.plan.jobspec builds it, the plan records it).
``seqpar launch`` runs torchrun's own ``run(parse_args(ARGS))`` here instead of in a child process, which gives it what a
child would hide:

- every failed rank's exit status (``ChildFailedError.failures``): a rank killed by a signal (the OOM killer, ``kill -9``)
  writes nothing, so only its status names it, where its survivors can only say "connection reset by peer". The agent
  lists the ranks it stopped itself there too (SIGTERM, then SIGKILL 30 s later), with later timestamps;
- the stop: the first SIGTERM or SIGINT reaches the agent, which sends SIGTERM to every rank and gives them
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (30 by default) before SIGKILL; the ranks write a final checkpoint and exit
  (seqpar.runtime.launch.stopping), and the agent's SignalException ends here, so the launcher prints one line, not
  tracebacks. The handler is seqpar's, not torch's (torchrun's ``signals_to_handle`` leaves these two to it): torch's
  raises on every signal, so a burst (a scheduler's repeats, Ctrl-C pressed twice) broke the agent's wait for the
  ranks, and the launcher said "no checkpoint was written" while they went on to write one. Later signals of a stop
  are noted and change nothing; the ranks' own grace bounds the wait;
- the ranks are children of this process and die with it (stopping.die_with_parent), so no rank outlives a ``kill -9``
  of the launcher.

torchrun's own log lines (its warnings while it stops workers, its failure table) are kept out of the way unless
SEQPAR_DEBUG is set: the launcher's one line replaces them.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

TORCHRUN = ("-m", "torch.distributed.run")


@dataclass
class RankEnd:
    """How one rank ended, as torchrun's agent saw it: exit code (negative: killed by that signal)."""

    rank: int
    exitcode: int
    pid: int
    message: str = ""
    timestamp: float = 0.0  # when the agent saw it end (whole seconds)

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


@dataclass
class Outcome:
    rc: int  # 0 done; 1 a rank failed; 128 + n: stopped by signal n
    failures: dict[int, RankEnd] = field(default_factory=dict)  # global rank -> how it ended (failed ranks only)
    signum: int | None = None  # the signal that stopped the launcher
    oom_kills: int = 0  # kernel OOM kills in this cgroup while the job ran


class StopHandler:
    """SIGTERM/SIGINT handler of a running job: the first signal raises torch's SignalException (the agent then stops
    the ranks and waits for them), later ones are only noted. Stays installed after a stop: the launcher exits 128 + the
    signal next, and a late signal of the burst must not kill it first (exit -15 instead of 143) or cut its line short."""

    def __init__(self):
        self.got: list[int] = []

    def __call__(self, signum, frame):
        self.got.append(signum)
        if len(self.got) == 1:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            # The ranks get SIGTERM for either: they stop the same way, and one still importing (before its handler)
            # ends quietly instead of printing a KeyboardInterrupt traceback. The launcher exits 128 + this signal.
            raise SignalException(f"got {signal.Signals(signum).name}", sigval=signal.SIGTERM)


def _quiet_torchrun() -> dict[str, int]:
    """Raise every torch.distributed logger to CRITICAL; returns their old levels."""
    old = {}
    for name, lg in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(lg, logging.Logger):
            old[name] = lg.level
            lg.setLevel(logging.CRITICAL)
    return old


def oom_kills() -> int | None:
    """The kernel's OOM kills so far in this process's cgroup (cgroup v2 memory.events), or None when unreadable."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].split(":", 2)[2]
        for line in Path("/sys/fs/cgroup", rel.lstrip("/"), "memory.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        return None
    return None


def run_torchrun(argv: list[str], env: dict[str, str]) -> Outcome:
    """Run the torchrun command ``argv`` (``python -m torch.distributed.run ...``) with ``env`` over this environment."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if tuple(argv[1:3]) != TORCHRUN:
        raise ValueError(f"not a torchrun command: {argv[:3]}")
    saved_env = dict(os.environ)
    os.environ.update(env)  # the agent starts the ranks with its own environment
    levels = {} if os.environ.get("SEQPAR_DEBUG") else _quiet_torchrun()
    stop = StopHandler()
    handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    before = oom_kills()
    try:
        args = parse_args(argv[3:])
        args.signals_to_handle = "SIGHUP,SIGQUIT"  # SIGTERM and SIGINT stay with StopHandler
        run(args)
        out = Outcome(0)
    except ChildFailedError as e:
        ends = {r: RankEnd(r, f.exitcode, f.pid, f.message, float(f.timestamp)) for r, f in e.failures.items()}
        out = Outcome(1, ends)
    except SignalException as e:
        signum = stop.got[0] if stop.got else int(e.sigval)
        out = Outcome(128 + signum, signum=signum)
    finally:
        if not stop.got:
            for s, h in handlers.items():
                signal.signal(s, h)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        os.environ.clear()
        os.environ.update(saved_env)
    after = oom_kills()
    out.oom_kills = (after - before) if after is not None and before is not None else 0
    return out


__all__ = ["Outcome", "RankEnd", "StopHandler", "oom_kills", "run_torchrun"]
