"""Which GPU kernel runs packed-document attention (each query sees the earlier tokens of its own document) fastest, and exactly.

Candidates on one GPU, bf16, for one local block of S tokens holding many documents (the diagonal block every mode runs):
- ``varlen_flash``: ``aten._flash_attention_forward/_backward`` with cumulative document lengths (PyTorch's FA2 varlen,
  what ``torch.nn.attention.varlen`` calls); backward takes an external out and lse, as ring attention needs.
- ``varlen_cudnn``: ``aten._cudnn_attention_forward/_backward`` with the same ragged offsets (cuDNN), when this build has it.
- ``flex``: compiled ``flex_attention`` with a document block mask (its backward recomputes its own lse: usable where
  no merge across blocks is needed).
- ``per_doc``: one cuDNN causal call per document.
- ``dense``: cuDNN causal over the whole block, ignoring documents: the baseline on the same total tokens (not exact).
Documents come from a seeded long-tail mix (log-normal lengths: median 512 tokens, sigma 1.6; many short, a few of tens of K). Exactness first: every
candidate's out, lse and gradients against a float32 per-document reference on a small case. Time: forward + backward,
median of CUDA-event timings after warm-up; useful FLOPs = sum over documents of 3.5 * 2 * l^2 * H * D.

    PYTHONPATH=. python3 bench/packed_kernels.py        # JSON to $OUT/packed_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import traceback

import torch


def long_tail_lengths(total: int, seed: int, median: float = 512.0, sigma: float = 1.6, shortest: int = 16) -> list[int]:
    """Document lengths summing to ``total``: log-normal (median 512 tokens, sigma 1.6: many short, a few of tens of K)."""
    g = torch.Generator().manual_seed(seed)
    out, used = [], 0
    while used < total:
        n = int(median * math.exp(sigma * float(torch.randn((), generator=g))))
        n = min(max(shortest, n), total - used)  # the last document takes what is left
        out.append(n)
        used += n
    return out


def cu_of(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)


# --------------------------------------------------------------------------------------------- candidates
# Each takes q (S, Hq, D), k, v (S, Hkv, D), lens, dout and returns a closure fwd_bwd() -> (out, lse (Hq, S), dq, dk, dv).


def _lse_hs(lse: torch.Tensor, S: int, H: int) -> torch.Tensor:
    lse = lse.reshape(-1, lse.shape[-1]) if lse.dim() > 2 else lse
    if lse.shape == (S, H):
        return lse.t()
    return lse.reshape(H, -1)[:, :S]


def varlen_flash(q, k, v, lens, dout, scale):
    cu = cu_of(lens, q.device)
    m = max(lens)

    def run():
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, True, False, scale=scale)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, o, lse, cu, cu, m, m, 0.0, True, rng, unused, scale=scale
        )
        return o, _lse_hs(lse, q.shape[0], q.shape[1]), dq, dk, dv

    return run


def varlen_cudnn(q, k, v, lens, dout, scale):
    cu = cu_of(lens, q.device).to(torch.int32)
    m = max(lens)

    def run():
        r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, m, m, True, 0.0, True, False, scale=scale)
        o, lse, seed, offset = r[0], r[1], r[6], r[7]
        g = torch.ops.aten._cudnn_attention_backward(
            dout, q, k, v, o, lse, seed, offset, None, cu, cu, m, m, 0.0, True, scale=scale
        )
        return (o, _lse_hs(lse, q.shape[0], q.shape[1])) + tuple(g[:3])

    return run


def flex(q, k, v, lens, dout, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    S = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lens), device=q.device), torch.tensor(lens, device=q.device))

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    block = create_block_mask(mask_mod, None, None, S, S, device=q.device)
    fn = torch.compile(flex_attention, dynamic=False)
    gqa = q.shape[1] != k.shape[1]
    qb, kb, vb = (x.detach().transpose(0, 1)[None].requires_grad_() for x in (q, k, v))  # (1, H, S, D)

    def run():
        for x in (qb, kb, vb):
            x.grad = None
        o, lse = fn(qb, kb, vb, block_mask=block, scale=scale, enable_gqa=gqa, return_lse=True)
        o.backward(dout.transpose(0, 1)[None])
        return o[0].transpose(0, 1), lse[0], qb.grad[0].transpose(0, 1), kb.grad[0].transpose(0, 1), vb.grad[0].transpose(0, 1)

    return run


def _cudnn_causal(q, k, v, dout, scale):
    """One causal cuDNN call on (S, H, D) tensors: (out, lse (H, S), dq, dk, dv); K,V expanded for GQA."""
    g = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(g, dim=1) if g > 1 else x for x in (k, v))
    qh, kh, vh, doh = (x.transpose(0, 1)[None] for x in (q, kk, vv, dout))  # (1, H, S, D) views
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, True, False, scale=scale)
    o, lse = r[0], r[1]
    seed = torch.empty((), dtype=torch.long, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        doh,
        qh,
        kh,
        vh,
        o,
        lse.view(1, q.shape[1], q.shape[0], 1),
        seed,
        seed,
        None,
        None,
        None,
        q.shape[0],
        q.shape[0],
        0.0,
        True,
        scale=scale,
    )
    fold = (
        (lambda x: x[0].transpose(0, 1).reshape(q.shape[0], k.shape[1], g, -1).sum(2))
        if g > 1
        else (lambda x: x[0].transpose(0, 1))
    )
    return o[0].transpose(0, 1), lse.reshape(q.shape[1], q.shape[0]), dq[0].transpose(0, 1), fold(dk), fold(dv)


def per_doc(q, k, v, lens, dout, scale):
    bounds = cu_of(lens, "cpu").tolist()

    def run():
        parts = [_cudnn_causal(q[a:b], k[a:b], v[a:b], dout[a:b], scale) for a, b in zip(bounds, bounds[1:])]
        return (
            torch.cat([p[0] for p in parts]),
            torch.cat([p[1] for p in parts], dim=1),
            *(torch.cat([p[i] for p in parts]) for i in (2, 3, 4)),
        )

    return run


def dense(q, k, v, lens, dout, scale):
    return lambda: _cudnn_causal(q, k, v, dout, scale)


CANDIDATES = {"varlen_flash": varlen_flash, "varlen_cudnn": varlen_cudnn, "flex": flex, "per_doc": per_doc, "dense": dense}


# --------------------------------------------------------------------------------------------- reference and timing


def reference(q, k, v, lens, dout, scale):
    """float32 per-document attention with autograd: out, lse (H, S), dq, dk, dv."""
    qf, kf, vf = (x.float().detach().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    a = 0
    for n in lens:
        b = a + n
        s = torch.einsum("qhd,khd->hqk", qf[a:b], kf[a:b].repeat_interleave(g, 1)) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vf[a:b].repeat_interleave(g, 1)))
        lses.append(lse)
        a = b
    out = torch.cat(outs)
    out.backward(dout.float())
    return out.detach(), torch.cat(lses, 1).detach(), qf.grad, kf.grad, vf.grad


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tensors(S, hq, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(S, h, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="16384,65536,131072")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", ".")
    names = args.candidates.split(",")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "check": {}, "time": []}
    # exactness, small case: documents of 16..~2K tokens, MHA and GQA
    for hq, hkv in ((8, 8), (8, 2)):
        S, d = 4096, 64
        lens = long_tail_lengths(S, seed=1, median=200.0, sigma=1.2)
        q, k, v, do = tensors(S, hq, hkv, d, 0)
        ref = reference(q, k, v, lens, do, 1 / math.sqrt(d))
        for name in names:
            if name == "dense":
                continue
            key = f"{name} {hq}/{hkv}"
            try:
                got = CANDIDATES[name](q, k, v, lens, do, 1 / math.sqrt(d))()
                result["check"][key] = {n: rel(a, b) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref)}
            except Exception as e:  # a candidate this build lacks is reported, not fatal
                result["check"][key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                traceback.print_exc()
            print(key, result["check"][key], flush=True)
    # speed
    for S in (int(x) for x in args.seqs.split(",")):
        lens = long_tail_lengths(S, seed=S)
        useful = sum(3.5 * 2 * n * n * 32 * 128 for n in lens)
        dense_flops = 3.5 * 2 * S * S * 32 * 128
        q, k, v, do = tensors(S, 32, 32, 128, 1)
        row = {"S": S, "docs": len(lens), "longest": max(lens), "useful_tflop": useful / 1e12, "dense_tflop": dense_flops / 1e12}
        for name in names:
            if name == "per_doc" and len(lens) > 400:
                continue
            try:
                ms = time_ms(CANDIDATES[name](q, k, v, lens, do, 1 / math.sqrt(128)), args.reps)
                flops = dense_flops if name == "dense" else useful
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9}
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(S, name, row[name], flush=True)
        result["time"].append(row)
    with open(os.path.join(out_dir, "packed_kernels.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["time"], indent=1))


if __name__ == "__main__":
    main()
