"""Per-rank attention kernel time of each sequence-parallel mode vs single-GPU full attention, on one GPU.

For S in {128K, 512K, 1M} over W = 8 ranks (32 heads x 128 dim, MHA, bf16, causal), each mode's rank r runs a fixed
sequence of local attention calls (forward + backward) on the blocks it computes or receives:
- zigzag_ring_attn: one (2c x 2c) diagonal, then r blocks (2c q x c kv) and W-1-r blocks (c q x 2c kv), c = S/2W;
- dist_flash_attn: LightSeq's balanced schedule (seqpar.runtime.parallel.dist_flash_attn.schedule) of (S/W x S/W) blocks;
- ulysses_attn: one full-length causal attention on 32/W heads;
- usp_attn: zigzag over R = W/U ring ranks on 32/U heads (U = --usp-ulysses, default 2).
Each distinct block shape is timed once (after a warm-up call of the same shape: cuDNN builds a plan per shape) and a
rank's time is the sum over its calls; communication is not included (it overlaps in the real runs). Efficiency =
(single-GPU time / W) / busiest rank's time, i.e. the rank's useful TFLOP/s as a share of single-GPU TFLOP/s.
FLOPs: causal attention forward = 2*S^2*H*D (4*Sq*Sk*H*D for a full block), forward + backward = 3.5x forward.

    PYTHONPATH=. python3 bench/attention.py                       # JSON to $OUT/attention_bench.json
    PYTHONPATH=. python3 bench/attention.py --seq 128k --modes zigzag_ring_attn,ulysses_attn --backend flash
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seqpar.runtime.parallel import kernels

MODES = ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")


def parse_len(text: str) -> int:
    text = text.strip().lower()
    return int(float(text.rstrip("km")) * {"k": 1024, "m": 1024**2}.get(text[-1], 1))


def block_flops(sq: int, sk: int, causal: bool, heads: int, d: int) -> float:
    """Forward + backward FLOPs of one block (3.5x the forward's 4*Sq*Sk*H*D, halved on the causal diagonal)."""
    return 3.5 * 4.0 * sq * sk * heads * d * (0.5 if causal else 1.0)


def _zigzag_calls(S: int, W: int, heads: int) -> list[list[tuple]]:
    c = S // (2 * W)
    return [
        [(2 * c, 2 * c, True, heads)] + [(2 * c, c, False, heads)] * r + [(c, 2 * c, False, heads)] * (W - 1 - r)
        for r in range(W)
    ]


def rank_calls(mode: str, S: int, W: int, H: int, usp_u: int) -> list[list[tuple]]:
    """calls[r] = [(Sq, Sk, causal, heads), ...]: the local attention calls rank r makes, forward (and again backward)."""
    if mode == "zigzag_ring_attn":
        return _zigzag_calls(S, W, H)
    if mode == "ulysses_attn":
        return [[(S, S, True, H // W)] for _ in range(W)]
    if mode == "usp_attn":
        R = W // usp_u
        per_ring = _zigzag_calls(S, R, H // usp_u)
        return [per_ring[r // usp_u] for r in range(W)]  # rank = ring_rank * U + ulysses_rank
    if mode == "dist_flash_attn":
        from seqpar.runtime.parallel.dist_flash_attn import rows, schedule

        C = S // W
        calls: list[list[tuple]] = [[] for _ in range(W)]
        for step in schedule(W, causal=True, split_last=C >= 2):
            for r, blk in enumerate(step):
                if blk is not None:  # a split last-step block covers half of the query rows
                    calls[r].append((len(range(C)[rows(blk.half, C)]), C, blk.causal, H))
        return calls
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


def time_block(sq, sk, causal, heads, d, backend, min_seconds=1.0) -> float:
    """Median seconds of forward + backward of one (sq x sk) block, after one warm-up call."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, sq, heads, d, device=dev, dtype=torch.bfloat16, generator=g)  # (B, Sq, H, D)
    k = torch.randn(1, sk, heads, d, device=dev, dtype=torch.bfloat16, generator=g)  # (B, Sk, H, D)
    v = torch.randn(1, sk, heads, d, device=dev, dtype=torch.bfloat16, generator=g)
    do = torch.randn_like(q)
    scale = d**-0.5

    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out, lse = kernels.attn_forward(q, k, v, causal=causal, softmax_scale=scale, backend=backend)
        kernels.attn_backward(do, q, k, v, out, lse, causal=causal, softmax_scale=scale, backend=backend)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    first = once()  # warm-up (plan building, allocator)
    times = [once()]
    while sum(times) < min_seconds and len(times) < 20 and first < min_seconds:
        times.append(once())
    torch.cuda.empty_cache()  # the block's tensors go with this frame
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="128k,512k,1m")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--usp-ulysses", type=int, default=2)
    ap.add_argument("--backend", default=None, help="cudnn | flash | flash_attn (default: automatic)")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/attention_bench.json, else ./attention_bench.json)")
    args = ap.parse_args(argv)
    W, H, D = args.world_size, args.heads, args.head_dim
    backend = kernels.select_backend("cuda", torch.bfloat16, args.backend)
    cache: dict[tuple, float] = {}

    def t(shape) -> float:
        if shape not in cache:
            cache[shape] = time_block(*shape[:3], shape[3], D, backend)
        return cache[shape]

    rows = []
    for S in (parse_len(s) for s in args.seq.split(",")):
        single_s = t((S, S, True, H))
        single_flops = block_flops(S, S, True, H, D)
        base = {"seq_len": S, "world_size": W, "heads": H, "head_dim": D, "backend": backend}
        rows.append({**base, "mode": "single_gpu", "seconds": single_s, "tflops": single_flops / single_s / 1e12})
        print(f"S={S:>8} single GPU          {single_s:8.3f} s  {single_flops / single_s / 1e12:6.1f} TFLOP/s", flush=True)
        for mode in [m for m in args.modes.split(",") if m]:
            try:
                calls = rank_calls(mode, S, W, H, args.usp_ulysses)
                per_rank = [sum(t(c) for c in cs) for cs in calls]
                flops = [sum(block_flops(sq, sk, ca, h, D) for sq, sk, ca, h in cs) for cs in calls]
            except Exception as e:  # one mode's failure (e.g. a kernel refusing a shape) must not hide the rest
                rows.append({**base, "mode": mode, "error": f"{type(e).__name__}: {e}"})
                print(f"S={S:>8} {mode:<18} ERROR {e}", flush=True)
                continue
            busiest = max(range(W), key=per_rank.__getitem__)
            pct = 100.0 * (single_s / W) / per_rank[busiest]
            row = {
                **base,
                "mode": mode,
                "rank_seconds": per_rank,
                "busiest_rank": busiest,
                "rank_tflops": flops[busiest] / per_rank[busiest] / 1e12,
                "useful_tflops": single_flops / W / per_rank[busiest] / 1e12,
                "pct_of_single_gpu": pct,
                "calls_per_rank": [len(c) for c in calls],
            }
            if mode == "usp_attn":
                row["ulysses_degree"] = args.usp_ulysses
            rows.append(row)
            print(
                f"S={S:>8} {mode:<18} {per_rank[busiest]:8.3f} s  {row['useful_tflops']:6.1f} TFLOP/s  {pct:5.1f}% of single GPU",
                flush=True,
            )
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": " ".join(["python3", "bench/attention.py", *(argv if argv is not None else sys.argv[1:])]),
        "block_seconds": [{"sq": k[0], "sk": k[1], "causal": k[2], "heads": k[3], "seconds": v} for k, v in cache.items()],
        "rows": rows,
    }
    path = Path(args.out or os.path.join(os.environ.get("OUT", "."), "attention_bench.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
