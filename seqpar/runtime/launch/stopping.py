"""How a rank stops: on a signal, at a step boundary, with a final checkpoint; and never outliving its launcher.

``seqpar launch`` runs torchrun's elastic agent, which sends SIGTERM to every rank when the launcher gets SIGTERM or
SIGINT (and SIGKILL after its grace period, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default). A rank that gets
SIGTERM, or SIGINT from elsewhere:

- notes it (``install``): the training loop asks ``requested()`` after every step, a collective over the whole job, so all
  ranks stop after the same step; the loop then writes a checkpoint and raises ``Stopped``, and the rank exits 128 + the
  signal number (130 for SIGINT, 143 for SIGTERM) without a traceback;
- exits ``grace_s`` after the first signal whatever it is doing (a watchdog thread), so a rank whose peers are gone
  cannot hang on in a collective; more signals change nothing (the kernel sends the parent-death signal once per thread);
- dies with its parent (``die_with_parent``: Linux's PR_SET_PDEATHSIG): when the launcher is killed, even with ``kill
  -9`` of its process group (torchrun starts each rank in a session of its own, out of reach of the group), its ranks get
  SIGTERM and stop as above instead of training on as orphans.

And how any process of a job ends cleanly (``settle``): torch.distributed's gloo worker thread frees a finished
collective's tensors itself, a moment after the caller's wait returned. A tensor Python no longer holds then needs the
interpreter's lock (the GIL) to be freed; if the interpreter is already tearing down, taking it ends the thread inside
C++ ("terminate called without an active exception", SIGABRT after a finished run). ``settle`` hands the lock over while
the interpreter is whole. A rank of ``seqpar launch`` skips the teardown (it exits with ``os._exit``); ``with_seqpar``
and the engine's shutdown settle.

Torch is imported only inside ``requested`` and ``settle``; the rest is the standard library.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SETTLE_S = 0.1  # what a worker thread descheduled on a busy machine may need to run again
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_received: list[int] = []  # the signal numbers this rank received (the first one counts)


class Stopped(Exception):
    """The run stopped on a signal after ``step`` with its final checkpoint written (``checkpoint``, or None)."""

    def __init__(self, step: int, signum: int, checkpoint: str | None):
        self.step, self.signum, self.checkpoint = step, signum, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def grace_s() -> float:
    """Seconds a rank may take to stop after the first signal: the grace torchrun's agent gives before its SIGKILL."""
    try:
        return max(1.0, float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")))
    except ValueError:
        return 30.0


def _on_signal(signum, frame) -> None:
    _received.append(signum)
    if len(_received) > 1:  # the parent-death signal comes once per thread of this process: one stop is enough
        return
    timer = threading.Timer(grace_s(), os._exit, (128 + signum,))  # a rank stuck in a collective still ends
    timer.daemon = True
    timer.start()


def install() -> None:
    """SIGTERM and SIGINT ask for a stop at the next step boundary (main thread only, as Python's signals are)."""
    _received.clear()
    for s in STOP_SIGNALS:
        signal.signal(s, _on_signal)


def received() -> int | None:
    """The signal this rank received, or None."""
    return _received[0] if _received else None


def requested() -> int | None:
    """Collective over the job (every rank calls it after every step): the signal any rank received (the largest
    number), or None. One tiny all-reduce, so all ranks stop after the same step."""
    import torch
    import torch.distributed as dist

    mine = received() or 0
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine or None
    flag = torch.tensor([mine], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) or None


def settle(seconds: float = SETTLE_S) -> None:
    """Let torch.distributed's worker threads free what they still hold of finished collectives, while the interpreter
    is whole: collect the garbage (a cycle may hold a collective's tensors or a process group), then sleep, which
    releases the GIL to any thread waiting for it. Local to this process: no collective, so it is safe at exit whatever
    the other ranks do."""
    import gc
    import time

    gc.collect()
    time.sleep(seconds)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux; elsewhere nothing happens)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() == 1:  # the parent died before the request took effect: reparented to init
        os.kill(os.getpid(), signum)


__all__ = ["STOP_SIGNALS", "Stopped", "die_with_parent", "grace_s", "install", "received", "requested", "settle"]
