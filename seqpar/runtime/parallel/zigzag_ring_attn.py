"""Zigzag ring attention: K,V blocks travel around the ring, each rank folds every block into its output.

Layout (seqpar.runtime.parallel.layout, ``zigzag_ring_attn``): the sequence is cut into 2W chunks and rank r holds chunks r and
2W-1-r, so q, k, v are (B, 2c, H, D) with the first half = chunk r and the second half = chunk 2W-1-r. That makes the
causal work equal on every rank (ring-flash-attention's zigzag scheme, PyTorch CP's head-tail balancer):
- step 0: own q against own k,v, causal (the diagonal);
- step i > 0, the block of rank src = r - i (mod W):
  src < r: src's first chunk (src) precedes both of mine and its second (2W-1-src) follows both -> all of q x first half of kv;
  src > r: my first chunk (r) precedes both of src's, my second (2W-1-r) follows both -> second half of q x all of kv.
Each step sends the current K,V block to the next rank with ``batch_isend_irecv`` while the current block computes.
Backward replays the ring: K,V travel again, and the dK,dV accumulated for a block travel with it one step behind, so
after W steps every rank receives the complete gradient of its own K,V. ``causal=False`` is the plain ring (full blocks).

Packed documents (``docs``): the same ring, each step's block cut into the pieces that attend (seqpar.runtime.parallel.blocks),
and blocks that share no document skipped: block src travels only as far as the farthest rank that uses it
(``blocks.ring_need``'s reach, a pure function of the boundaries, the same on every rank), no kernel runs where nothing
attends, and in backward its dK,dV go straight home from that rank instead of finishing the circle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqpar.runtime.parallel import blocks, kernels
from seqpar.runtime.parallel.attention import attention
from seqpar.runtime.parallel.comm import RingComm, exchange, group_rank, group_size


def _plan(step: int, rank: int, causal: bool) -> str:
    """What this rank computes at this ring step: 'diag', 'full', 'kv_first_half' or 'q_second_half'."""
    if step == 0:
        return "diag" if causal else "full"
    if not causal:
        return "full"
    return "kv_first_half" if step <= rank else "q_second_half"  # step <= rank  <=>  source rank r - step < r


def _ring(group, q: Tensor, docs):
    """(rank, W, every rank's segments, need, reach) of the packed ring."""
    rank, W = group_rank(group), group_size(group)
    segs = [blocks.zigzag_segments(r, W, q.shape[1] * W) for r in range(W)]
    return (rank, W, segs, *blocks.ring_need(segs, docs))


def _post_kv(kv, like, t: int, rank: int, W: int, reach: list[int], group):
    """Send the block held at step t on (if a later rank uses it), receive the one held at step t + 1 (if used);
    every block is shaped like this rank's own (like)."""
    src, nxt = (rank - t) % W, (rank - t - 1) % W
    sends = [(x, (rank + 1) % W) for x in kv] if t < reach[src] else []
    recvs = [(torch.empty(x.shape, dtype=x.dtype, device=x.device), (rank - 1) % W) for x in like] if t + 1 <= reach[nxt] else []
    return exchange(sends, recvs, group), bool(recvs)


def _packed_forward(q, k, v, group, scale, backend, docs):
    rank, W, segs, need, reach = _ring(group, q, docs)
    out = lse = None
    kv = (k, v)
    for t in range(W):
        src = (rank - t) % W
        handle, receiving = _post_kv(kv, (k, v), t, rank, W, reach, group) if t + 1 < W else (None, False)
        if need[src][rank]:  # step 0 (the diagonal) always: every query sees itself
            bo, bl = blocks.attend(q, *kv, segs[rank], segs[src], docs, scale=scale, backend=backend)
            out, lse = kernels.merge(out, lse, bo, bl)
        if handle is not None:
            got = handle.wait()
            kv = tuple(got) if receiving else None
    return out.to(q.dtype), lse


def _packed_backward(dout, q, k, v, out, lse, group, scale, backend, docs):
    rank, W, segs, need, reach = _ring(group, q, docs)
    acc = torch.promote_types(q.dtype, torch.float32)
    zeros = lambda x: torch.zeros(x.shape, dtype=acc, device=x.device)  # noqa: E731
    dq, home = zeros(q), None
    kv, dkv = (k, v), None  # dkv: partial dK,dV of the block held now, from its earlier holders
    pending = None  # (handle, receiving the next block's partial, receiving my own block's gradient)
    for t in range(W):
        src = (rank - t) % W
        kv_handle, receiving = _post_kv(kv, (k, v), t, rank, W, reach, group) if t + 1 < W else (None, False)
        g = (
            blocks.attend_backward(dout, q, *kv, out, lse, segs[rank], segs[src], docs, scale=scale, backend=backend)
            if need[src][rank]
            else None
        )
        if pending is not None:
            handle, partial, mine = pending
            got = handle.wait()
            if partial:
                dkv = got[:2]
            if mine:
                home = got[-2:]
        if kv is not None and dkv is None:  # step 0: my own block starts its gradient here
            dkv = [zeros(k), zeros(v)]
        if g is not None:
            dq += g[0]
            dkv[0] += g[1]
            dkv[1] += g[2]
        if kv_handle is not None:
            got = kv_handle.wait()
            kv = tuple(got) if receiving else None
        sends, recvs = [], []
        if dkv is not None and t == reach[src] and t == 0:
            home = dkv  # nobody else uses my block: its gradient never left
        elif dkv is not None:  # on to the next holder, or home from the farthest one
            sends = [(x, (rank + 1) % W if t < reach[src] else src) for x in dkv]
        partial = t + 1 < W and t + 1 <= reach[(rank - t - 1) % W]
        if partial:
            recvs += [(zeros(k), (rank - 1) % W), (zeros(v), (rank - 1) % W)]
        mine = t > 0 and t == reach[rank]
        if mine:
            recvs += [(zeros(k), (rank + t) % W), (zeros(v), (rank + t) % W)]
        pending = (exchange(sends, recvs, group), partial, mine)
        dkv = None
    handle, _, mine = pending
    got = handle.wait()
    if mine:
        home = got[-2:]
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)


def forward(q, k, v, *, group, causal: bool, scale: float, backend: str, docs=None) -> tuple[Tensor, Tensor]:
    """The ring: out (B, 2c, Hq, D) in q's dtype, lse (B, Hq, 2c) in the zigzag layout."""
    if docs is not None:
        return _packed_forward(q, k, v, group, scale, backend, docs)
    rank, W = group_rank(group), group_size(group)
    c = q.shape[1] // 2
    comm = RingComm(group)
    out = lse = None
    for step in range(W):
        handle = comm.send_recv_many([k, v]) if step + 1 < W else None  # next block in flight during this compute
        plan = _plan(step, rank, causal)
        if plan in ("diag", "full"):
            bo, bl = kernels.attn_forward(q, k, v, causal=plan == "diag", softmax_scale=scale, backend=backend)
            out, lse = kernels.merge(out, lse, bo, bl)
        elif plan == "kv_first_half":
            bo, bl = kernels.attn_forward(q, k[:, :c], v[:, :c], causal=False, softmax_scale=scale, backend=backend)
            out, lse = kernels.merge(out, lse, bo, bl)
        else:  # q_second_half: only rows c: of the running result change
            bo, bl = kernels.attn_forward(q[:, c:], k, v, causal=False, softmax_scale=scale, backend=backend)
            o2, l2 = kernels.merge(out[:, c:], lse[..., c:], bo, bl)  # (B, c, H, D), (B, H, c)
            out, lse = torch.cat([out[:, :c], o2], dim=1), torch.cat([lse[..., :c], l2], dim=-1)
        if handle is not None:
            k, v = handle.wait()
    return out.to(q.dtype), lse


def backward(
    dout, q, k, v, out, lse, *, group, causal: bool, scale: float, backend: str, docs=None
) -> tuple[Tensor, Tensor, Tensor]:
    """The ring again, dK,dV travelling one step behind K,V: gradients in the inputs' dtypes."""
    if docs is not None:
        return _packed_backward(dout, q, k, v, out, lse, group, scale, backend, docs)
    rank, W = group_rank(group), group_size(group)
    c = q.shape[1] // 2
    acc = torch.promote_types(q.dtype, torch.float32)
    kv_comm, dkv_comm = RingComm(group), RingComm(group)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, 2c, Hq, D)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # (B, 2c, Hkv, D): gradient of the block held this step
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dkv_handle = None
    for step in range(W):
        kv_handle = kv_comm.send_recv_many([k, v]) if step + 1 < W else None
        plan = _plan(step, rank, causal)
        if plan in ("diag", "full"):
            bdq, bdk, bdv = kernels.attn_backward(
                dout, q, k, v, out, lse, causal=plan == "diag", softmax_scale=scale, backend=backend
            )
        elif plan == "kv_first_half":
            bdq, bdk, bdv = kernels.attn_backward(
                dout, q, k[:, :c], v[:, :c], out, lse, causal=False, softmax_scale=scale, backend=backend
            )
        else:
            bdq, bdk, bdv = kernels.attn_backward(
                dout[:, c:], q[:, c:], k, v, out[:, c:], lse[..., c:], causal=False, softmax_scale=scale, backend=backend
            )
        if plan == "q_second_half":
            dq[:, c:] += bdq
        else:
            dq += bdq
        if dkv_handle is not None:  # the partial dK,dV of this same block, from the ranks it visited before
            dk, dv = dkv_handle.wait()
        if plan == "kv_first_half":
            dk[:, :c] += bdk
            dv[:, :c] += bdv
        else:
            dk += bdk
            dv += bdv
        if kv_handle is not None:
            k, v = kv_handle.wait()
        dkv_handle = dkv_comm.send_recv_many([dk, dv]) if W > 1 else None
    if dkv_handle is not None:
        dk, dv = dkv_handle.wait()  # after W hops: the full gradient of this rank's own K,V
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def zigzag_ring_attn_attention(
    q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None, cu_seqlens=None
) -> tuple[Tensor, Tensor]:
    """Exact attention over a sequence held in zigzag layout across the group's ranks.

    q (B, S_local, Hq, D); k, v (B, S_local, Hkv, D), S_local = S / W from ``shard(x, "zigzag_ring_attn", ...)``.
    Returns out (B, S_local, Hq, D) and lse (B, Hq, S_local), both in the same zigzag layout; out differentiable.
    cu_seqlens: global document boundaries (seqpar.runtime.parallel.attention).
    """
    return attention(
        q,
        k,
        v,
        "zigzag_ring_attn",
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        cu_seqlens=cu_seqlens,
    )


zigzag_ring_attention = zigzag_ring_attn_attention  # the name ring-flash-attention users know
