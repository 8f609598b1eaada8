"""Per-rank attention kernel time of packed documents vs dense causal attention on the same tokens, on one GPU.

W = 8 ranks simulated as bench/attention.py does: each rank's sequence of block calls (forward + backward), timed in
sequence; communication is not included (it overlaps in real runs, and packed ring modes skip the blocks nothing needs).
Packed windows come from the long-tail mix (bench/packed_kernels.py: log-normal, median 512, sigma 1.6) at S = 128K,
512K, 1M; 32 heads x 128, MHA, bf16. For each mode, rank r runs exactly the blocks its mode computes with these documents
(seqpar.runtime.parallel.blocks: zigzag ring steps whose block shares a document; dist_flash_attn's packed schedule; Ulysses's
one whole-sequence call on H/W heads; usp_attn's ring on H/U heads), through seqpar's own packed kernels: one cuDNN
causal call per document of >= seqpar.runtime.parallel.varlen.LONG_DOC tokens, one FA2 varlen call for the shorter ones, dense
rectangles off the diagonal. Reported per rank: seconds warm (median of --reps after a warm-up run of the same window)
and cold (the first run of a new window of the same mix: cuDNN builds a plan per new document length, which a training
step pays whenever its lengths are new), with --long-doc 0 also timed as "varlen only" (every document in the FA2 call).
Dense: bench/attention.py's per-rank calls of causal attention on the same S. Useful TFLOP/s = useful FLOPs
(3.5 x 4 x pairs x H x D, pairs from seqpar.runtime.parallel.balance.rank_work) / the busiest rank's time.
First it checks exactness on a small case: zigzag ring over W = 4 simulated ranks (seqpar.runtime.parallel.blocks with merged
out/lse, backward with the global out/lse) against float32 per-document attention, MHA and GQA; it stops if that fails.

    PYTHONPATH=. python3 bench/packed_attention.py                  # JSON to $OUT/packed_attention.json
    PYTHONPATH=. python3 bench/packed_attention.py --seq 128k --modes zigzag_ring_attn --skip-dense
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import parse_len, rank_calls, time_block  # noqa: E402
from packed_kernels import long_tail_lengths  # noqa: E402

from seqpar.runtime.parallel import blocks, kernels, varlen
from seqpar.runtime.parallel.balance import rank_work  # noqa: E402
from seqpar.runtime.parallel.documents import Documents  # noqa: E402

MODES = ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")


def _docs(lengths: list[int]) -> Documents:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return Documents(bounds[-1], ((None, tuple(bounds)),))


def packed_calls(mode: str, S: int, W: int, H: int, U: int, docs: Documents) -> list[list[tuple]]:
    """calls[r] = [(q_len, k_len, heads, q_segs, k_segs)]: the packed blocks rank r computes."""
    if mode == "ulysses_attn":
        return [[(S, S, H // W, ((0, S),), ((0, S),))] for _ in range(W)]
    if mode == "dist_flash_attn":
        from seqpar.runtime.parallel.dist_flash_attn import block_segments, packed_schedule

        n, calls = S // W, [[] for _ in range(W)]
        for step in packed_schedule(W, n, docs):
            for r, b in enumerate(step):
                if b is not None:
                    qs, ks = block_segments(b, n)
                    calls[r].append((qs[0][1], n, H, qs, ks))
        return calls
    R, heads = (W, H) if mode == "zigzag_ring_attn" else (W // U, H // U)
    segs = [blocks.zigzag_segments(i, R, S) for i in range(R)]
    need, _ = blocks.ring_need(segs, docs)
    ring = [[(S // R, S // R, heads, segs[i], segs[(i - t) % R]) for t in range(R) if need[(i - t) % R][i]] for i in range(R)]
    return [ring[r // (1 if mode == "zigzag_ring_attn" else U)] for r in range(W)]


class Tensors:
    """Random bf16 q, k, v, dout per (q_len, k_len, heads): values do not change kernel time."""

    def __init__(self, D: int):
        self.D, self.cache = D, {}

    def get(self, ql: int, kl: int, heads: int):
        key = (ql, kl, heads)
        if key not in self.cache:
            g = torch.Generator(device="cuda").manual_seed(0)
            mk = lambda n: torch.randn(1, n, heads, self.D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
            self.cache[key] = (mk(ql), mk(kl), mk(kl), mk(ql))
        return self.cache[key]


def run_rank(calls, docs: Documents, tensors: Tensors, scale: float) -> float:
    """Seconds of one rank's blocks, forward then backward of each (seqpar's packed kernels), CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for ql, kl, heads, qs, ks in calls:
        q, k, v, do = tensors.get(ql, kl, heads)
        out, lse = blocks.attend(q, k, v, qs, ks, docs, scale=scale, backend="cudnn")
        blocks.attend_backward(do, q, k, v, out.to(q.dtype), lse, qs, ks, docs, scale=scale, backend="cudnn")
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# --------------------------------------------------------------------------------------------- exactness first


def _reference(q, k, v, dout, lengths, scale):
    """float32 per-document causal attention with autograd: out, lse (B, H, S), dq, dk, dv."""
    qf, kf, vf = (x.float().detach().requires_grad_() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    outs, lses, a = [], [], 0
    for n in lengths:
        s = torch.einsum("bqhd,bkhd->bhqk", qf[:, a : a + n], kf[:, a : a + n].repeat_interleave(g, 2)) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), vf[:, a : a + n].repeat_interleave(g, 2)))
        lses.append(lse)
        a += n
    out = torch.cat(outs, 1)
    out.backward(dout.float())
    return out.detach(), torch.cat(lses, -1).detach(), qf.grad, kf.grad, vf.grad


def simulated_zigzag(q, k, v, dout, docs: Documents, W: int, scale: float):
    """The packed zigzag ring of seqpar.runtime.parallel.zigzag_ring_attn on W simulated ranks, unsharded: out, lse, dq, dk, dv."""
    from seqpar.runtime.parallel.layout import shard, unshard

    S = q.shape[1]
    segs = [blocks.zigzag_segments(r, W, S) for r in range(W)]
    need, _ = blocks.ring_need(segs, docs)
    part = lambda x, r, dim=1: shard(x, "zigzag_ring_attn", r, W, dim=dim)  # noqa: E731
    outs, lses = [], []
    for r in range(W):
        out = lse = None
        for t in range(W):
            src = (r - t) % W
            if need[src][r]:
                bo, bl = blocks.attend(
                    part(q, r), part(k, src), part(v, src), segs[r], segs[src], docs, scale=scale, backend="cudnn"
                )
                out, lse = kernels.merge(out, lse, bo, bl)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    out, lse = unshard(outs, "zigzag_ring_attn"), unshard(lses, "zigzag_ring_attn", dim=2)
    grads = [[torch.zeros(part(x, r).shape, dtype=torch.float32, device=x.device) for r in range(W)] for x in (q, k, v)]
    for r in range(W):  # rank r's queries against every block it needs, with the global out and lse of its rows
        for src in range(W):
            if need[src][r]:
                g = blocks.attend_backward(
                    part(dout, r), part(q, r), part(k, src), part(v, src), outs[r], lses[r],
                    segs[r], segs[src], docs, scale=scale, backend="cudnn",
                )  # fmt: skip
                for per_rank, piece, who in zip(grads, g, (r, src, src)):
                    per_rank[who] += piece
    return (out, lse, *(unshard(per_rank, "zigzag_ring_attn") for per_rank in grads))


def check(scale_d: int = 64) -> dict:
    lengths = long_tail_lengths(16384, seed=7, median=300.0, sigma=1.5)
    assert max(lengths) >= varlen.LONG_DOC and min(lengths) < varlen.LONG_DOC, lengths
    docs, result = _docs(lengths), {"lengths": lengths}
    for hq, hkv in ((8, 8), (8, 2)):
        g = torch.Generator(device="cuda").manual_seed(hkv)
        q, dout = (torch.randn(1, 16384, hq, scale_d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(1, 16384, hkv, scale_d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        ref = _reference(q, k, v, dout, lengths, scale_d**-0.5)
        got = simulated_zigzag(q, k, v, dout, docs, 4, scale_d**-0.5)
        errs = {n: float((a.float() - b).norm() / b.norm()) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref)}
        result[f"{hq}/{hkv}"] = errs
        print(f"exactness {hq}/{hkv} (zigzag W=4, {len(lengths)} documents): {errs}", flush=True)
        # bf16 kernels: out and gradients ~2-3e-3 (bench/results/h200_packed_kernels.json: every kernel alike), lse ~1e-7
        if not (errs["lse"] < 1e-4 and max(errs[n] for n in ("out", "dq", "dk", "dv")) < 1e-2):
            raise SystemExit(f"packed attention is not exact on this GPU: {errs}")
    return result


# --------------------------------------------------------------------------------------------- timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="128k,512k,1m")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--usp-ulysses", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-dense", action="store_true", help="only the packed timings")
    args = ap.parse_args(argv)
    W, H, D, U = args.world_size, args.heads, args.head_dim, args.usp_ulysses
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": " ".join(["python3", "bench/packed_attention.py", *(argv if argv is not None else sys.argv[1:])]),
        "long_doc": varlen.LONG_DOC,
        "check": check(),
        "rows": [],
    }
    path = Path(os.environ.get("OUT", "."), "packed_attention.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    scale, dense_cache = D**-0.5, {}
    for S in (parse_len(s) for s in args.seq.split(",")):
        lengths, cold_lengths = long_tail_lengths(S, seed=S), long_tail_lengths(S, seed=S + 1)
        for mode in [m for m in args.modes.split(",") if m]:
            uly = U if mode == "usp_attn" else None
            row = {"seq_len": S, "mode": mode, "world_size": W, "docs": len(lengths), "longest": max(lengths)}
            pairs = rank_work(lengths, mode, W, uly)  # pair-heads per rank / H
            row["rank_tflop"] = [3.5 * 4 * p * H * D / 1e12 for p in pairs]
            for label, long_doc in (("cudnn_varlen", varlen.LONG_DOC), ("varlen_only", 1 << 62)):
                saved, varlen.LONG_DOC = varlen.LONG_DOC, long_doc
                try:
                    docs, tensors = _docs(lengths), Tensors(D)
                    calls = packed_calls(mode, S, W, H, U, docs)
                    for r in range(W):  # warm-up: plans and allocations of this window
                        run_rank(calls[r], docs, tensors, scale)
                    warm = [
                        statistics.median(run_rank(calls[r], docs, tensors, scale) for _ in range(args.reps)) for r in range(W)
                    ]
                    cold_docs = _docs(cold_lengths)
                    cold_calls = packed_calls(mode, S, W, H, U, cold_docs)
                    cold = [run_rank(cold_calls[r], cold_docs, tensors, scale) for r in range(W)]
                finally:
                    varlen.LONG_DOC = saved
                    torch.cuda.empty_cache()
                busiest = max(range(W), key=warm.__getitem__)
                row[label] = {
                    "warm_rank_seconds": warm,
                    "cold_rank_seconds": cold,
                    "busiest_rank": busiest,
                    "useful_tflops": sum(row["rank_tflop"]) / W / warm[busiest],
                    "busiest_rank_tflops": row["rank_tflop"][busiest] / warm[busiest],
                    "calls_per_rank": [len(c) for c in calls],
                }
                print(
                    f"S={S:>8} {mode:<17} {label:<12} busiest {warm[busiest]:.3f} s warm, {max(cold):.3f} s cold; "
                    f"{row[label]['useful_tflops']:.0f} useful TFLOP/s",
                    flush=True,
                )
            if not args.skip_dense:
                dense = []
                for cs in rank_calls(mode, S, W, H, U):
                    t = 0.0
                    for c in cs:
                        if c not in dense_cache:
                            dense_cache[c] = time_block(*c[:3], c[3], D, kernels.select_backend("cuda", torch.bfloat16))
                        t += dense_cache[c]
                    dense.append(t)
                row["dense_rank_seconds"] = dense
                row["dense_busiest_seconds"] = max(dense)
                row["speedup_vs_dense"] = max(dense) / max(row["cudnn_varlen"]["warm_rank_seconds"])
                print(f"S={S:>8} {mode:<17} dense        busiest {max(dense):.3f} s (x{row['speedup_vs_dense']:.1f})", flush=True)
            result["rows"].append(row)
            path.write_text(json.dumps(result, indent=2) + "\n")  # after every row: a run cut short keeps its rows
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
