"""Collective bandwidth by message size on this machine's ranks: all-to-all, all-gather, ring send/recv, all-reduce.

Run by torchrun, one process per GPU (NCCL) or per CPU rank (gloo, ``--cpu``)::

    torchrun --standalone --nproc-per-node 8 bench/collectives.py --out bandwidth.jsonl
    torchrun --standalone --nproc-per-node 2 bench/collectives.py --cpu --max-bytes 256K --out bandwidth.jsonl

The figures follow nccl-tests' definitions (NVIDIA/nccl-tests, doc/PERFORMANCE.md and src/{all_reduce,all_gather,
alltoall,sendrecv}.cu), so a row reads like the same line of ``all_reduce_perf`` & co:
- S, the size in bytes: all_reduce the buffer; all_gather the gathered output (n x each rank's input); all_to_all each
  rank's send buffer (n blocks, one per peer); send_recv what each rank sends to the next rank of the ring (and receives
  from the previous one), as sendrecv_perf does.
- time: ``warmup`` untimed operations, then ``iters`` back to back between two device synchronisations, divided by
  ``iters``; the mean over the ranks (nccl-tests' default ``-a 1``). Defaults 5 and 20 are nccl-tests' ``-w`` and ``-n``.
- algbw = S / time, in GB/s (1e9 bytes per second).
- busbw = algbw x the operation's factor over n ranks: all_reduce 2(n-1)/n, all_gather (n-1)/n, all_to_all (n-1)/n,
  send_recv 1. It is the figure to hold against a link's datasheet bandwidth per direction, whatever n is.

Every operation's result is checked once per size before it is timed (as nccl-tests' ``-c 1``): a wrong answer stops
the run with the operation and size named. Rank 0 writes one JSON line per (operation, size) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

OPS = ("all_to_all", "all_gather", "send_recv", "all_reduce")
ELEMENT_BYTES = 4  # float32 elements, nccl-tests' default datatype


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` over ``n`` ranks (nccl-tests doc/PERFORMANCE.md, "Summary"; sendrecv.cu: 1)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "all_to_all"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown operation {op!r}; one of {', '.join(OPS)}")


def sizes(min_bytes: int, max_bytes: int, factor: int, n: int) -> list[int]:
    """Message sizes from min_bytes to max_bytes, each ``factor`` times the last, rounded down to whole float32 elements
    that split evenly over n ranks (all_gather and all_to_all cut S into n blocks)."""
    unit = ELEMENT_BYTES * n
    out, s = [], min_bytes
    while s <= max_bytes:
        b = max(unit, s // unit * unit)
        if b not in out:
            out.append(b)
        s *= factor
    return out


def parse_bytes(text: str) -> int:
    """``4096``, ``64K``, ``16M``, ``1G`` (K = 1024)."""
    t = text.strip().upper().removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    number = t[:-1] if scale > 1 else t
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes; write e.g. 4096, 64K, 16M or 1G")
    return int(number) * scale


def _operation(op: str, nbytes: int, device, rank: int, n: int):
    """(run: a callable doing the operation once, check: a callable raising if its last result is wrong)."""
    import torch
    import torch.distributed as dist

    count = nbytes // ELEMENT_BYTES
    block = count // n

    def full(c, value):
        return torch.full((c,), float(value), dtype=torch.float32, device=device)

    if op == "all_reduce":
        buf = full(count, rank + 1)

        def run():
            buf.fill_(rank + 1)  # in place: refill so the checked result is one reduction's
            dist.all_reduce(buf)

        def want():
            return full(count, n * (n + 1) // 2)

        got = buf
    elif op == "all_gather":
        src, got = full(block, rank + 1), torch.empty(count, dtype=torch.float32, device=device)

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name, where it exists

        def run():
            gather(got, src)

        def want():
            return torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat_interleave(block)

    elif op == "all_to_all":
        # block j of rank r's input goes to rank j, landing as block r of its output
        src = (rank * n + torch.arange(n, dtype=torch.float32, device=device)).repeat_interleave(block)
        got = torch.empty(count, dtype=torch.float32, device=device)

        def run():
            dist.all_to_all_single(got, src)

        def want():
            return (torch.arange(n, dtype=torch.float32, device=device) * n + rank).repeat_interleave(block)

    elif op == "send_recv":
        src, got = full(count, rank + 1), torch.empty(count, dtype=torch.float32, device=device)
        nxt, prev = (rank + 1) % n, (rank - 1) % n

        def run():
            ops = [dist.P2POp(dist.isend, src, nxt), dist.P2POp(dist.irecv, got, prev)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        def want():
            return full(count, prev + 1)

    else:
        raise ValueError(f"unknown operation {op!r}; one of {', '.join(OPS)}")

    def check():
        if not torch.equal(got, want()):
            raise RuntimeError(f"{op} of {nbytes} bytes gave a wrong result on rank {rank}: the transport is broken")

    return run, check


def measure(op: str, nbytes: int, warmup: int, iters: int, device, rank: int, n: int) -> float:
    """Seconds per operation on this rank (nccl-tests' loop: warm-up, then ``iters`` between synchronisations)."""
    import torch
    import torch.distributed as dist

    run, check = _operation(op, nbytes, device, rank, n)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    sync()
    check()
    for _ in range(warmup):
        run()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    return (time.perf_counter() - t0) / iters


def row(op: str, nbytes: int, seconds: float, n: int, backend: str, device: str, iters: int) -> dict:
    algbw = nbytes / seconds / 1e9
    return {
        "op": op,
        "bytes": nbytes,
        "ranks": n,
        "backend": backend,
        "device": device,
        "dtype": "float32",
        "iters": iters,
        "time_us": seconds * 1e6,
        "algbw_gb_s": algbw,
        "busbw_gb_s": algbw * bus_factor(op, n),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="JSON lines, one per operation and size (rank 0 writes).")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU ranks instead of NCCL on GPUs.")
    ap.add_argument("--ops", default=",".join(OPS), help=f"Comma-separated, of {', '.join(OPS)}.")
    ap.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1K"))
    ap.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("1G"))
    ap.add_argument("--factor", type=int, default=4, help="Each size is this many times the last.")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or args.factor < 2 or args.iters < 1 or args.warmup < 0 or args.min_bytes > args.max_bytes:
        print(
            f"collectives: --ops {args.ops!r}, --factor {args.factor}, --iters {args.iters}, --warmup {args.warmup}, "
            f"--min-bytes {args.min_bytes} --max-bytes {args.max_bytes}: operations are {', '.join(OPS)}, the factor at "
            "least 2, iters at least 1, warmup at least 0, and the smallest size no larger than the largest",
            file=sys.stderr,
        )
        return 2

    import torch
    import torch.distributed as dist

    backend = "gloo" if args.cpu else "nccl"
    if not args.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    if n < 2:
        if rank == 0:
            print("collectives: one rank has no peer to talk to; start 2 or more (torchrun --nproc-per-node)", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    name = "cpu" if args.cpu else torch.cuda.get_device_name(device)
    rows = []
    for op in ops:
        for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor, n):
            seconds = _mean_over_ranks(measure(op, nbytes, args.warmup, args.iters, device, rank, n), device)
            r = row(op, nbytes, seconds, n, backend, name, args.iters)
            rows.append(r)
            if rank == 0:
                print(
                    f"{op:>10} {nbytes:>12} B {r['time_us']:>11.1f} us  algbw {r['algbw_gb_s']:9.4g}  "
                    f"busbw {r['busbw_gb_s']:9.4g} GB/s",
                    flush=True,
                )
    if rank == 0:
        from seqpar.plan.files import write_atomic

        write_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _mean_over_ranks(seconds: float, device) -> float:
    """The mean of every rank's time (nccl-tests reports the average over ranks by default, ``-a 1``)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


if __name__ == "__main__":
    sys.exit(main())
