"""Per-document causal attention of one diagonal block: the kernel every mode runs where a block's queries and keys are the
same tokens and several documents share them (a query sees the earlier tokens of its own document only).

``bounds`` are the block's local document boundaries, python ints ``[0, b1, ..., n]`` (seqpar.runtime.parallel.documents clips
the global ones to the block). No autograd here, like seqpar.runtime.parallel.kernels: forward returns (out, lse), backward takes
an external out and lse (the merged result of every block, which ring attention needs).

Kernels (chosen by the backend seqpar.runtime.parallel.kernels.select_backend picked; one document is the plain causal kernel):
- ``exact``: one masked call (same document and j <= i) in float32/float64, on any device.
- CUDA: the documents go together into one FA2 varlen call, ``aten._flash_attention_forward/_backward`` with cumulative
  lengths (PyTorch's FA2, no flash-attn build needed; it reads GQA K,V directly and takes an external out and lse).
  Documents of at least ``LONG_DOC`` tokens can instead get their own causal call of the selected kernel (cuDNN on
  Hopper): faster once warm, but cuDNN builds an execution plan for every new length, and training windows bring new
  lengths every step, so a window of new lengths costs far more than varlen saves (BENCHMARKS.md, "Packed documents").
  So varlen only is the default (``LONG_DOC`` unreachable); set ``LONG_DOC`` (e.g. 1024, where the warm per-document
  kernel overtakes varlen: bench/packed_kernels.py) where the same lengths repeat, as in evaluation on fixed windows.
Layout: q (B, n, Hq, D); k, v (B, n, Hkv, D); out like q; lse (B, Hq, n) float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from seqpar.runtime.parallel import kernels

LONG_DOC = 1 << 62  # tokens: a document this long runs alone on the causal kernel (never by default: see the docstring)


@functools.lru_cache(maxsize=8)  # every layer asks for the same blocks' masks
def _mask(bounds: tuple[int, ...], device) -> Tensor:
    """(n, n) bool, True where query i must not see key j: another document, or a later token."""
    lens = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], device=device)
    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)  # (n,) document of each token
    n = bounds[-1]
    return (doc[:, None] != doc[None, :]) | torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


def _split(bounds: tuple[int, ...]) -> tuple[list[tuple[int, int]], tuple[tuple[int, int], ...]]:
    """(long documents, short documents) as (start, end) pairs."""
    docs = list(zip(bounds, bounds[1:]))
    return [d for d in docs if d[1] - d[0] >= LONG_DOC], tuple(d for d in docs if d[1] - d[0] < LONG_DOC)


@functools.lru_cache(maxsize=64)  # every layer (and backward) asks for the same blocks: built once, kept on the device
def _short_tokens(short: tuple[tuple[int, int], ...], B: int, n: int, device) -> tuple[Tensor | None, Tensor, int]:
    """Rows of the flattened (B*n) tokens that belong to short documents (None: all of them, in order), the int32
    cumulative lengths of those documents over every batch row, and the longest."""
    lens = [b - a for a, b in short] * B
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    if sum(lens) == B * n:
        return None, cu, max(lens)
    rows = torch.cat([torch.arange(r * n + a, r * n + b) for r in range(B) for a, b in short]).to(device)
    return rows, cu, max(lens)


def _flat(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # (B, n, H, D) -> (B*n, H, D)


def _pick(x: Tensor, rows: Tensor | None) -> Tensor:
    return _flat(x) if rows is None else _flat(x).index_select(0, rows)


def forward(q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...], *, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """Per-document causal attention of the block: out (B, n, Hq, D) in q's dtype, lse (B, Hq, n)."""
    if len(bounds) == 2:  # one document: the plain causal kernel
        return kernels.attn_forward(q, k, v, causal=True, softmax_scale=scale, backend=backend)
    if backend == "exact":
        return kernels._exact_forward(q, k, v, False, scale, mask=_mask(bounds, q.device))
    B, n, Hq, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, n, Hq, D)
    lse_t = torch.empty(B, n, Hq, dtype=torch.float32, device=q.device)  # (B, n, Hq): token-major, like the varlen rows
    long, short = _split(bounds)
    for a, b in long:
        o, lse = kernels.attn_forward(q[:, a:b], k[:, a:b], v[:, a:b], causal=True, softmax_scale=scale, backend=backend)
        out[:, a:b] = o
        lse_t[:, a:b] = lse.transpose(1, 2)
    if short:
        rows, cu, longest = _short_tokens(short, B, n, q.device)
        o, lse, _seed, _offset, _ = torch.ops.aten._flash_attention_forward(
            _pick(q, rows), _pick(k, rows), _pick(v, rows), cu, cu, longest, longest, 0.0, True, False, scale=scale
        )  # o (T, Hq, D), lse (Hq, T): FA2's varlen layout
        if rows is None:
            out.view(B * n, Hq, -1).copy_(o)
            lse_t.view(B * n, Hq).copy_(lse.t())
        else:
            out.view(B * n, Hq, -1).index_copy_(0, rows, o)
            lse_t.view(B * n, Hq).index_copy_(0, rows, lse.t().float())
    return out, lse_t.transpose(1, 2).contiguous()


def backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    bounds: tuple[int, ...],
    *,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the block given the (possibly merged, global) out and lse of its rows: dq like q, dk and dv like k."""
    if len(bounds) == 2:
        return kernels.attn_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale, backend=backend)
    if backend == "exact":
        return kernels._exact_backward(dout, q, k, v, out, lse, False, scale, mask=_mask(bounds, q.device))
    B, n, Hq, _ = q.shape
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)  # every token is in one document: all rows written
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    long, short = _split(bounds)
    for a, b in long:
        g = kernels.attn_backward(
            dout[:, a:b],
            q[:, a:b],
            k[:, a:b],
            v[:, a:b],
            out[:, a:b],
            lse[..., a:b],
            causal=True,
            softmax_scale=scale,
            backend=backend,
        )
        dq[:, a:b], dk[:, a:b], dv[:, a:b] = g
    if short:
        rows, cu, longest = _short_tokens(short, B, n, q.device)
        lse_rows = _pick(lse.transpose(1, 2), rows).t().float().contiguous()  # (Hq, T): the layout forward returned
        seed = torch.empty((), dtype=torch.long, device=q.device)  # no dropout: the RNG state is never read
        g = torch.ops.aten._flash_attention_backward(
            _pick(dout.to(q.dtype), rows),
            _pick(q, rows),
            _pick(k, rows),
            _pick(v, rows),
            _pick(out.to(q.dtype), rows),
            lse_rows,
            cu,
            cu,
            longest,
            longest,
            0.0,
            True,
            seed,
            seed,
            scale=scale,
        )
        for full, part in zip((dq, dk, dv), g):
            if rows is None:
                full.view(B * n, *full.shape[2:]).copy_(part)
            else:
                full.view(B * n, *full.shape[2:]).index_copy_(0, rows, part)
    return dq, dk, dv
