"""dist_flash_attn: LightSeq / DistFlashAttn's balanced causal schedule over contiguous sequence chunks.

Layout: rank r of a group of P ranks holds contiguous chunk r of the sequence.
q (B, S/P, Hq, D); k, v (B, S/P, Hkv, D) with Hq % Hkv == 0; out like q; lse (B, Hq, S/P) float32 (float64 for float64 inputs).

Causal attention over P chunks is the lower triangle of a P x P grid of blocks (i, j), j <= i: query chunk i against key chunk j.
Rank i owns row i (i + 1 blocks); run row by row, the last rank does P blocks while rank 0 does one. The balanced schedule
(Li et al., "DistFlashAttn", arXiv:2310.03294, section 3.1, the helper/worker scheme):
  step 0:                every rank computes its diagonal block (i, i);
  step t = 1..floor(P/2): every rank i >= t computes its own block (i, i - t) with K,V received from rank i - t, and every
                         rank i < t, which has no block of its own at distance t, helps rank P - t + i: it receives that rank's
                         query and computes block (P - t + i, i) against its own K,V, then sends the partial (out, lse) back to be
                         merged with kernels.merge. Distances t and P - t together cover every off-diagonal block exactly once;
                         for even P the last step (t = P/2) has nothing left for helpers.
So floor(P/2) + 1 steps, at most floor(P/2) + 1 blocks per rank; for odd P every rank does exactly (P + 1)/2 (perfect balance),
which is why odd P works here exactly as even P does. The backward follows the same schedule: owners receive K,V again and send
dk, dv partials back to the K,V owner; helpers receive q, dout, out, lse and send dq partials back. The inputs of step t + 1 are in
flight while step t computes, and the partials of step t are folded in after step t + 1 computes, so neither transfer stalls
the kernels. Non-causal attention uses the plain rotation (every rank computes its whole row, one block a step).
Transfers are batches of arbitrary-peer p2p (seqpar.runtime.comm.exchange); the schedule is the same pure function on every
rank, so each rank knows whom to send to and receive from without asking.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from seqpar.runtime import kernels
from seqpar.runtime.comm import exchange, group_rank, group_size


def _buffer(like: Tensor) -> Tensor:
    """A contiguous receive buffer shaped like `like` (empty_like would copy strides; p2p wants contiguous)."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


class Block(NamedTuple):
    """One attention block: query chunk of rank `q`, key/value chunk of rank `kv`; causal only on the diagonal."""

    q: int
    kv: int
    causal: bool


def schedule(world_size: int, causal: bool = True) -> list[list[Block | None]]:
    """steps[s][r] = the block rank r computes at step s (None = idle). Pure Python, the same on every rank."""
    p = world_size
    if not causal:  # plain rotation: rank r sees every key chunk, one per step
        return [[Block(r, (r - t) % p, False) for r in range(p)] for t in range(p)]
    steps: list[list[Block | None]] = [[Block(r, r, True) for r in range(p)]]
    for t in range(1, p // 2 + 1):
        step: list[Block | None] = []
        for r in range(p):
            if r >= t:
                step.append(Block(r, r - t, False))  # own block at distance t
            elif p - t != t:
                step.append(Block(p - t + r, r, False))  # helper: rank p-t+r's block at distance p-t, against own K,V
            else:
                step.append(None)  # even P, last step: every distance is covered
        steps.append(step)
    return steps


def _post_inputs(step: list[Block | None], me: int, group, mine: dict[str, Tensor], q_names: list[str]):
    """Post this step's input transfers: my query-side tensors (q_names) and K,V to the ranks whose block uses them,
    and receives for what my own block needs from others (buffers shaped like mine: every chunk has the same shape).

    Returns (handle, received): received["q"] / received["kv"] are filled once handle.wait() returns.
    """
    sends, recvs, received = [], [], {}
    for c, blk in enumerate(step):  # order per peer: q side, then kv side (the receiver posts in the same order)
        if blk is None or c == me:
            continue
        if blk.q == me:
            sends += [(mine[n], c) for n in q_names]
        if blk.kv == me:
            sends += [(mine["k"], c), (mine["v"], c)]
    blk = step[me]
    if blk is not None:
        if blk.q != me:
            received["q"] = [_buffer(mine[n]) for n in q_names]
            recvs += [(t, blk.q) for t in received["q"]]
        if blk.kv != me:
            received["kv"] = [_buffer(mine["k"]), _buffer(mine["v"])]
            recvs += [(t, blk.kv) for t in received["kv"]]
    return exchange(sends, recvs, group), received


def _from_others(step: list[Block | None], me: int, side: str) -> list[int]:
    """Ranks that compute a block of mine at this step (side 'q': my query rows, 'kv': my K,V): their partials come back."""
    return [c for c, blk in enumerate(step) if blk is not None and c != me and getattr(blk, side) == me]


def _forward(q, k, v, group, causal, scale, backend):
    p, me = group_size(group), group_rank(group)
    steps = schedule(p, causal)
    mine = {"q": q, "k": k, "v": v}
    out = lse = None  # fp32 (float64 for float64) accumulators of my rows
    deferred = None  # (handle, [(out, lse) buffers]) of the previous step's partials from helpers
    pending = _post_inputs(steps[0], me, group, mine, ["q"])
    for s, step in enumerate(steps):
        handle, received = pending
        handle.wait()
        if s + 1 < len(steps):  # next step's inputs travel while this step computes
            pending = _post_inputs(steps[s + 1], me, group, mine, ["q"])
        blk, sends = step[me], []
        if blk is not None:
            bq = received["q"][0] if blk.q != me else q  # (B, S/P, Hq, D)
            bk, bv = received["kv"] if blk.kv != me else (k, v)  # (B, S/P, Hkv, D)
            b_out, b_lse = kernels.attn_forward(bq, bk, bv, causal=blk.causal, softmax_scale=scale, backend=backend)
            if blk.q == me:
                out, lse = kernels.merge(out, lse, b_out, b_lse)
            else:  # a helper returns the partial (out, lse) to the query's owner
                sends = [(b_out, blk.q), (b_lse, blk.q)]
        helpers = _from_others(step, me, "q")
        bufs = [(_buffer(q), _buffer(lse)) for _ in helpers]  # (B, S/P, Hq, D), (B, Hq, S/P)
        results = exchange(sends, [(t, c) for c, pair in zip(helpers, bufs) for t in pair], group)
        # partials are merged one step later, so their transfer overlaps this rank's next block
        out, lse = _merge_partials(deferred, out, lse)
        deferred = (results, bufs)
    out, lse = _merge_partials(deferred, out, lse)
    return out.to(q.dtype), lse


def _merge_partials(deferred, out, lse):
    if deferred is not None:
        handle, bufs = deferred
        handle.wait()
        for b_out, b_lse in bufs:
            out, lse = kernels.merge(out, lse, b_out, b_lse)
    return out, lse


def _add_partials(deferred, grads: dict[str, Tensor]) -> None:
    if deferred is not None:
        handle, bufs = deferred
        handle.wait()
        for name, t in bufs:
            grads[name].add_(t)


def _backward(dout, q, k, v, out, lse, group, causal, scale, backend):
    p, me = group_size(group), group_rank(group)
    steps = schedule(p, causal)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # partial gradients add up in fp32
    grads = {
        "q": torch.zeros(q.shape, dtype=acc, device=q.device),  # (B, S/P, Hq, D)
        "k": torch.zeros(k.shape, dtype=acc, device=k.device),  # (B, S/P, Hkv, D)
        "v": torch.zeros(v.shape, dtype=acc, device=v.device),
    }
    mine = {"q": q, "dout": dout, "out": out, "lse": lse, "k": k, "v": v}
    q_names = ["q", "dout", "out", "lse"]
    deferred = None  # (handle, [(name, buffer)]) of the previous step's gradient partials from other ranks
    pending = _post_inputs(steps[0], me, group, mine, q_names)
    for s, step in enumerate(steps):
        handle, received = pending
        handle.wait()
        if s + 1 < len(steps):
            pending = _post_inputs(steps[s + 1], me, group, mine, q_names)
        blk, sends = step[me], []
        if blk is not None:
            bq, bdo, bo, bl = received["q"] if blk.q != me else (q, dout, out, lse)
            bk, bv = received["kv"] if blk.kv != me else (k, v)
            g_q, g_k, g_v = kernels.attn_backward(bdo, bq, bk, bv, bo, bl, causal=blk.causal, softmax_scale=scale, backend=backend)
            if blk.q == me:
                grads["q"] += g_q
            else:
                sends.append((g_q, blk.q))
            if blk.kv == me:
                grads["k"] += g_k
                grads["v"] += g_v
            else:
                sends += [(g_k, blk.kv), (g_v, blk.kv)]
        bufs, peers = [], []  # per peer: dq first, then dk, dv (the sender's order above)
        for c, cblk in enumerate(step):
            if cblk is None or c == me:
                continue
            if cblk.q == me:
                bufs.append(("q", _buffer(q)))
                peers.append(c)
            if cblk.kv == me:
                bufs += [("k", _buffer(k)), ("v", _buffer(v))]
                peers += [c, c]
        results = exchange(sends, [(t, c) for (_, t), c in zip(bufs, peers)], group)
        _add_partials(deferred, grads)  # one step late: the transfer overlaps this rank's next block
        deferred = (results, bufs)
    _add_partials(deferred, grads)
    return grads["q"].to(q.dtype), grads["k"].to(k.dtype), grads["v"].to(v.dtype)


class _DistFlashAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, backend):
        out, lse = _forward(q, k, v, group, causal, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def dist_flash_attn_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None) -> tuple[Tensor, Tensor]:
    """Exact attention over contiguous chunks with the balanced schedule; returns (out, lse) in this rank's layout.

    q (B, S/P, Hq, D); k, v (B, S/P, Hkv, D) -> out (B, S/P, Hq, D), lse (B, Hq, S/P). Works for every group size P.
    """
    # Only local checks: every rank holds a chunk of the same shape (shard makes them so), so every rank raises the
    # same error before any transfer; a cross-rank shape check would cost a collective and a host sync per call.
    kernels._check(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise kernels._error(
            f"dist_flash_attn needs q and k,v chunks of the same length, got {q.shape[1]} and {k.shape[1]}; shard q, k, v alike"
        )
    scale = kernels.default_scale(q, softmax_scale)
    backend = kernels.select_backend(q.device, q.dtype, backend)
    if group_size(group) == 1:
        return kernels.local_attention(q, k, v, causal=causal, softmax_scale=scale, backend=backend)
    return _DistFlashAttn.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, causal, scale, backend)


dist_flash_attention = dist_flash_attn_attention
