"""seqpar's test helpers (named so they cannot shadow an installed package). This module is the rank harness: run a
function on W real gloo ranks (separate processes) and collect what each returns; tolerances by dtype; test ids naming
the mode and world size. The modules beside it hold what several test files share, one per wing they test: ``train``
(the tiny model's plans, the trainer in-process on ranks), ``hf`` (tiny transformers models, gradients summed over a
group), ``memory`` (the 4-layer Llama of the checkpointing split), ``attention`` (the attention cases on sub-groups),
``data`` (a word tokenizer and a mixed JSONL corpus), ``advisor`` (the 7B layer-split setting), ``cli`` (the CLI
runner, one-line errors, a device node).

``run_ranks(fn, world_size, *args, timeout=60)`` starts W fresh processes, each joins a gloo process group on a free
localhost port with ``torch.set_num_threads(1)``, calls ``fn(rank, world_size, *args)`` and sends back its (picklable)
result. If any rank raises, or the timeout passes (a broken collective hangs rather than fails), every process is killed
and one RuntimeError carries every rank's traceback. ``fn`` must be a module-level function of an importable module
(it is pickled by name). Spawn once per world size and loop over cases inside fn.

The processes come from multiprocessing's forkserver: one server process imports torch, transformers' Llama and the
trainer once (PRELOAD), and every rank is a fork of it, a new process with nothing of any earlier rank in it, that
skips the seconds of imports a spawned interpreter pays (most of a small case's time, and the suite runs hundreds of
ranks). The server starts at the first call, in the environment the session had when this module was imported, so
what the preloaded modules read from the environment at import is the session's; each rank then takes the caller's
current environment and working directory, as a spawned one would. Importing this module imports no torch.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import time
import traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank of the suite imports anyway (the trainer pulls in torch.distributed, transformers' Llama, numpy).
PRELOAD = ["torch", "torch.distributed", "numpy", "transformers.modeling_utils", "transformers.models.llama.modeling_llama"]
PRELOAD += [
    "seqpar.runtime.parallel.attention",
    "seqpar.runtime.train.loop",
    "seqpar.runtime.train.engine",
    "seqpar.runtime.hf.apply",
    "seqpar.runtime.hf.model",
    "seqpar.runtime.checkpoint.shards",  # torch.distributed.checkpoint
]  # not transformers.trainer: its import starts a jemalloc thread, and a fork copies no thread


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # children inherit it: keep gloo on loopback
_SESSION_ENV = dict(os.environ)  # as this module was imported (at collection), before any test changed it


def _context():
    """The forkserver context, its server started (once) in the session's environment whatever the caller's is now."""
    from multiprocessing import forkserver

    import torch.multiprocessing as mp  # here, not at the top: the advisor's tests import this package without torch

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    now = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENV)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now)
    return ctx


def _worker(rank, world_size, port, fn, args, results, timeout, env, cwd):
    try:
        import datetime

        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        out = fn(rank, world_size, *args)  # no barrier after: a failed rank must not wait for the others
        results.put((rank, "ok", out))
        dist.destroy_process_group()
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))
    # The result is all the parent waits for: hand it over (the queue's feeder thread), then skip the interpreter's
    # teardown of torch and transformers, seconds of CPU per rank on a busy machine that run_ranks would wait out.
    results.close()
    results.join_thread()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout: float = 60):
    """fn(rank, world_size, *args) on world_size gloo ranks; returns [result of rank 0, ..., rank W-1]."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, timeout, env, cwd), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    first_error_at = None
    try:
        while len(got) < world_size:
            now = time.monotonic()
            # once one rank failed, give the others a moment to report (they may fail the same way), then stop
            limit = deadline if first_error_at is None else min(deadline, first_error_at + 3.0)
            if now >= limit:
                break
            try:
                rank, status, out = results.get(timeout=min(0.5, limit - now))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and first_error_at is None:
                    first_error_at = time.monotonic()  # a rank died without reporting (segfault, OOM kill)
                continue
            got[rank] = (status, out)
            if status == "error" and first_error_at is None:
                first_error_at = time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world_size and all(s == "ok" for s, _ in got.values()) else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = [f"--- rank {r}:\n{got[r][1]}" for r in sorted(got) if got[r][0] == "error"]
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        why = (
            f"ranks {missing} gave no result within {timeout:.0f} s (hang or crash; exit codes "
            f"{[procs[r].exitcode for r in missing]})\n"
            if missing
            else ""
        )
        raise RuntimeError(f"run_ranks({getattr(fn, '__name__', fn)}, W={world_size}) failed:\n{why}" + "\n".join(errors))
    return [got[r][1] for r in range(world_size)]


def tolerances(dtype) -> dict:
    """assert_close tolerances named by dtype: float32 relative error <= 1e-5, float64 <= 1e-10."""
    import torch

    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}[dtype]


def case_id(mode: str | None = None, world_size: int | None = None, ulysses_degree: int | None = None) -> str:
    """A test id naming the mode and the world size: "W2", "zigzag_ring_attn-W4", "usp_attn-W4-U2"."""
    parts = [mode] if mode else []
    parts += [f"W{world_size}"] if world_size is not None else []
    parts += [f"U{ulysses_degree}"] if ulysses_degree is not None else []
    return "-".join(parts)


def world_ids(sizes) -> list[str]:
    """ids for a world-size parameter: [2, 4] -> ["W2", "W4"]."""
    return [case_id(world_size=w) for w in sizes]


def error_messages(calls):
    """str() of the SeqparError each call raises ('no error' when it returns)."""
    from seqpar.plan.errors import SeqparError

    msgs = []
    for fn in calls:
        try:
            fn()
            msgs.append("no error")
        except SeqparError as e:
            msgs.append(str(e))
    return msgs
