"""Which ranks still run: a heartbeat each rank keeps in torchrun's store, read when a wait for a peer times out.

A collective that times out ("Timed out waiting 3000ms for recv operation") does not say which peer went silent, and
every rank waiting in it times out alike. So each rank's daemon thread adds 1 to ``seqpar/alive/<rank>`` in the job's
store every PERIOD_S; after a timeout, ``silent_ranks`` reads every counter twice, a few periods apart: a rank whose
counter did not move is stopped (SIGSTOP), dead or on a wedged host (its threads do not run), while a rank blocked in the
same collective keeps beating (torch releases the GIL while it waits). Only under torchrun's agent store
(TORCHELASTIC_USE_AGENT_STORE: the agent, not a rank, serves MASTER_ADDR:MASTER_PORT), which no rank can block.
``stop`` ends the beat before the process tears down (seqpar.runtime.train.engine.shutdown): a thread still inside the
store client when the interpreter finalizes is ended inside C++, which aborts the process.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

PERIOD_S = 0.5
_state: dict = {}  # store, rank, world while beating


def start(rank: int, world: int) -> None:
    """Beat for this rank in a daemon thread (a no-op outside torchrun's agent store or in a world of one)."""
    if world < 2 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or _state:
        return
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    beat = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))  # its own connection
    read = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    _state.update(store=read, rank=rank, world=world)

    done = threading.Event()

    def run():
        while not done.is_set():
            try:
                beat.add(f"seqpar/alive/{rank}", 1)
            except Exception:  # the agent is gone: the job is ending anyway
                return
            done.wait(PERIOD_S)

    thread = threading.Thread(target=run, name="seqpar-heartbeat", daemon=True)
    _state.update(done=done, thread=thread)
    thread.start()


def stop() -> None:
    """End the heartbeat (its thread returns within a period); nothing when none beats."""
    if "thread" in _state:
        _state["done"].set()
        _state["thread"].join(timeout=4 * PERIOD_S)
        _state.clear()


def silent_ranks(wait_s: float = 4 * PERIOD_S) -> list[int] | None:
    """The other ranks whose heartbeat did not move in ``wait_s`` seconds; None when there is no heartbeat to read."""
    if not _state:
        return None
    store, me, world = _state["store"], _state["rank"], _state["world"]
    keys = [f"seqpar/alive/{r}" for r in range(world)]
    try:
        before = [store.add(k, 0) for k in keys]  # add 0: read a counter, 0 for one that never beat
        time.sleep(wait_s)
        after = [store.add(k, 0) for k in keys]
    except Exception:
        return None
    return [r for r in range(world) if r != me and after[r] == before[r]]


__all__ = ["PERIOD_S", "silent_ranks", "start", "stop"]
