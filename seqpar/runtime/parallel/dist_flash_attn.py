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
                         for even P the last step (t = P/2) has nothing left for helpers, so (unlike LightSeq, whose
                         busiest rank does half a block more than the average) its P/2 blocks are split by query rows:
                         the owner computes the first half, the idle K,V owner the second half and returns it.
So floor(P/2) + 1 steps and exactly P/2 block units per rank for every P (a diagonal or a half block counts 1/2): perfect
balance, and odd P works exactly as even P does. The backward follows the same schedule: owners receive K,V again and
send dk, dv partials back to the K,V owner; helpers receive q, dout, out, lse and send dq partials back. The inputs of
step t + 1 are in flight while step t computes, and the partials of step t are folded in after step t + 1 computes, so neither transfer stalls
the kernels. Non-causal attention uses the plain rotation (every rank computes its whole row, one block a step).
Transfers are batches of arbitrary-peer p2p (seqpar.runtime.parallel.comm.exchange); the schedule is the same pure function on every
rank, so each rank knows whom to send to and receive from without asking.
Packed documents (``docs``): the same schedule, each block cut into the pieces that attend (seqpar.runtime.parallel.blocks), and a
block whose queries share no document with its keys left idle (``packed_schedule``): no kernel and no transfer for it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from seqpar.runtime.parallel import blocks, kernels
from seqpar.runtime.parallel.attention import attention
from seqpar.runtime.parallel.comm import exchange, group_rank, group_size


def _buffer(like: Tensor) -> Tensor:
    """A contiguous receive buffer shaped like `like` (empty_like would copy strides; p2p wants contiguous)."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


class Block(NamedTuple):
    """One attention block: query chunk of rank `q` against the key/value chunk of rank `kv`; causal only on the
    diagonal; `half` None = every query row of the chunk, 0 / 1 = its first / second half of rows (see `rows`)."""

    q: int
    kv: int
    causal: bool
    half: int | None = None


def rows(half: int | None, n: int) -> slice:
    """The query rows of a block in a chunk of n rows: all, or the first n // 2 (half 0) or the rest (half 1)."""
    return slice(None) if half is None else slice(0, n // 2) if half == 0 else slice(n // 2, n)


def schedule(world_size: int, causal: bool = True, split_last: bool = True) -> list[list[Block | None]]:
    """steps[s][r] = the block rank r computes at step s (None = idle). Pure Python, the same on every rank.

    split_last (even P): the last step has P/2 blocks at distance P/2 and P/2 idle ranks, each idle rank being the K,V
    owner of one of those blocks; it takes the block's second half of query rows, so every rank does exactly P/2 block
    units (1/2 diagonal + P/2 - 1 full + 1/2 split) instead of P/2 + 1/2 for the busiest: perfect balance, as for odd P.
    """
    p = world_size
    if not causal:  # plain rotation: rank r sees every key chunk, one per step
        return [[Block(r, (r - t) % p, False) for r in range(p)] for t in range(p)]
    steps: list[list[Block | None]] = [[Block(r, r, True) for r in range(p)]]
    for t in range(1, p // 2 + 1):
        last_even = p - t == t  # distance P/2: nothing left for helpers
        step: list[Block | None] = []
        for r in range(p):
            if r >= t:  # own block at distance t (first half of rows only when the last step is split)
                step.append(Block(r, r - t, False, 0 if last_even and split_last else None))
            elif not last_even:  # helper: rank p-t+r's block at distance p-t, against own K,V
                step.append(Block(p - t + r, r, False))
            else:  # K,V owner of rank r+t's block: its second half of rows, or idle
                step.append(Block(r + t, r, False, 1) if split_last else None)
        steps.append(step)
    return steps


def block_segments(blk: Block, n: int) -> tuple[blocks.Segments, blocks.Segments]:
    """Global (query, key) ranges of a block over chunks of n rows."""
    sl = rows(blk.half, n)
    r0, r1 = sl.indices(n)[:2]
    return ((blk.q * n + r0, r1 - r0),), ((blk.kv * n, n),)


def packed_schedule(world_size: int, n: int, docs) -> list[list[Block | None]]:
    """The causal schedule with every block that attends nowhere (no shared document) made idle."""
    steps = schedule(world_size, True, split_last=n >= 2)
    return [[b if b is not None and blocks.need(*block_segments(b, n), docs) else None for b in step] for step in steps]


def _attend(bq, bk, bv, blk: Block, n: int, docs, scale: float, backend: str):
    if docs is None:
        return kernels.attn_forward(bq, bk, bv, causal=blk.causal, softmax_scale=scale, backend=backend)
    o, lse = blocks.attend(bq, bk, bv, *block_segments(blk, n), docs, scale=scale, backend=backend)
    return o.to(bq.dtype), lse  # in q's dtype, like a kernel's: helpers send it to buffers shaped like q


def _attend_backward(bdo, bq, bk, bv, bo, bl, blk: Block, n: int, docs, scale: float, backend: str):
    if docs is None:
        return kernels.attn_backward(bdo, bq, bk, bv, bo, bl, causal=blk.causal, softmax_scale=scale, backend=backend)
    g = blocks.attend_backward(bdo, bq, bk, bv, bo, bl, *block_segments(blk, n), docs, scale=scale, backend=backend)
    return tuple(x.to(like.dtype) for x, like in zip(g, (bq, bk, bv)))


def _q_side(name: str, t: Tensor, sl: slice) -> Tensor:
    """Rows sl of a query-side tensor: q, dout, out are (B, S, H, D) (rows on dim 1), lse is (B, H, S) (rows last)."""
    return t[..., sl] if name == "lse" else t[:, sl]


def _post_inputs(step: list[Block | None], me: int, group, mine: dict[str, Tensor], q_names: list[str]):
    """Post this step's input transfers: my query-side tensors (q_names) and K,V to the ranks whose block uses them,
    and receives for what my own block needs from others (buffers shaped like mine: every chunk has the same shape).

    Returns (handle, received): received["q"] / received["kv"] are filled once handle.wait() returns.
    """
    sends, recvs, received = [], [], {}
    n_rows = mine["q"].shape[1]
    for c, blk in enumerate(step):  # order per peer: q side, then kv side (the receiver posts in the same order)
        if blk is None or c == me:
            continue
        if blk.q == me:
            sends += [(_q_side(n, mine[n], rows(blk.half, n_rows)), c) for n in q_names]
        if blk.kv == me:
            sends += [(mine["k"], c), (mine["v"], c)]
    blk = step[me]
    if blk is not None:
        if blk.q != me:
            received["q"] = [_buffer(_q_side(n, mine[n], rows(blk.half, n_rows))) for n in q_names]
            recvs += [(t, blk.q) for t in received["q"]]
        if blk.kv != me:
            received["kv"] = [_buffer(mine["k"]), _buffer(mine["v"])]
            recvs += [(t, blk.kv) for t in received["kv"]]
    return exchange(sends, recvs, group), received


def _merge_rows(out, lse, b_out, b_lse, sl: slice):
    """Fold a block's partial into query rows sl of the running (out, lse); in place on rows (no autograd in here)."""
    if sl == slice(None):
        return kernels.merge(out, lse, b_out, b_lse)
    o, l = kernels.merge(out[:, sl], lse[..., sl], b_out, b_lse)  # (B, rows, Hq, D), (B, Hq, rows)
    out[:, sl], lse[..., sl] = o, l
    return out, lse


def _merge_partials(deferred, out, lse):
    if deferred is not None:
        handle, bufs = deferred
        handle.wait()
        for b_out, b_lse, sl in bufs:
            out, lse = _merge_rows(out, lse, b_out, b_lse, sl)
    return out, lse


def _steps(p: int, n: int, causal: bool, docs) -> list[list[Block | None]]:
    # n is the same on every rank, so is the schedule
    return packed_schedule(p, n, docs) if docs is not None else schedule(p, causal, split_last=n >= 2)


def forward(q, k, v, *, group, causal: bool, scale: float, backend: str, docs=None) -> tuple[Tensor, Tensor]:
    """The balanced schedule: out (B, S/P, Hq, D) in q's dtype, lse (B, Hq, S/P). One rank: one kernel call."""
    p, me, n = group_size(group), group_rank(group), q.shape[1]
    if p == 1:
        return _attend(q, k, v, Block(0, 0, causal), n, docs, scale, backend)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # p2p sends and receive buffers shaped like them
    steps = _steps(p, n, causal, docs)
    mine = {"q": q, "k": k, "v": v}
    out = lse = None  # fp32 (float64 for float64) accumulators of my rows
    deferred = None  # (handle, [(out, lse, rows) buffers]) of the previous step's partials from other ranks
    pending = _post_inputs(steps[0], me, group, mine, ["q"])
    for s, step in enumerate(steps):
        handle, received = pending
        handle.wait()
        if s + 1 < len(steps):  # next step's inputs travel while this step computes
            pending = _post_inputs(steps[s + 1], me, group, mine, ["q"])
        blk, sends = step[me], []
        if blk is not None:
            sl = rows(blk.half, n)
            bq = received["q"][0] if blk.q != me else q[:, sl]  # (B, rows, Hq, D)
            bk, bv = received["kv"] if blk.kv != me else (k, v)  # (B, S/P, Hkv, D)
            b_out, b_lse = _attend(bq, bk, bv, blk, n, docs, scale, backend)
            if blk.q == me:
                out, lse = _merge_rows(out, lse, b_out, b_lse, sl)
            else:  # a helper returns the partial (out, lse) to the query's owner
                sends = [(b_out, blk.q), (b_lse, blk.q)]
        bufs, recvs = [], []
        for c, cblk in enumerate(step):  # partials of my rows computed elsewhere (step 0 has none: lse exists after it)
            if cblk is not None and c != me and cblk.q == me:
                sl = rows(cblk.half, n)
                bufs.append((_buffer(q[:, sl]), _buffer(lse[..., sl]), sl))
                recvs += [(bufs[-1][0], c), (bufs[-1][1], c)]
        results = exchange(sends, recvs, group)
        # partials are merged one step later, so their transfer overlaps this rank's next block
        out, lse = _merge_partials(deferred, out, lse)
        deferred = (results, bufs)
    out, lse = _merge_partials(deferred, out, lse)
    return out.to(q.dtype), lse


def _add_partials(deferred, grads: dict[str, Tensor]) -> None:
    if deferred is not None:
        handle, bufs = deferred
        handle.wait()
        for name, t, sl in bufs:
            grads[name][:, sl] += t


def backward(
    dout, q, k, v, out, lse, *, group, causal: bool, scale: float, backend: str, docs=None
) -> tuple[Tensor, Tensor, Tensor]:
    """The same schedule: owners gather dk, dv partials, helpers return dq partials; gradients in the inputs' dtypes."""
    p, me, n = group_size(group), group_rank(group), q.shape[1]
    if p == 1:
        return _attend_backward(dout, q, k, v, out, lse, Block(0, 0, causal), n, docs, scale, backend)
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    steps = _steps(p, n, causal, docs)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # partial gradients add up in fp32
    grads = {
        "q": torch.zeros(q.shape, dtype=acc, device=q.device),  # (B, S/P, Hq, D)
        "k": torch.zeros(k.shape, dtype=acc, device=k.device),  # (B, S/P, Hkv, D)
        "v": torch.zeros(v.shape, dtype=acc, device=v.device),
    }
    mine = {"q": q, "dout": dout, "out": out, "lse": lse, "k": k, "v": v}
    q_names = ["q", "dout", "out", "lse"]
    every = slice(None)
    deferred = None  # (handle, [(name, buffer, rows)]) of the previous step's gradient partials from other ranks
    pending = _post_inputs(steps[0], me, group, mine, q_names)
    for s, step in enumerate(steps):
        handle, received = pending
        handle.wait()
        if s + 1 < len(steps):
            pending = _post_inputs(steps[s + 1], me, group, mine, q_names)
        blk, sends = step[me], []
        if blk is not None:
            sl = rows(blk.half, n)
            if blk.q != me:
                bq, bdo, bo, bl = received["q"]
            else:
                bq, bdo, bo, bl = (_q_side(name, mine[name], sl) for name in q_names)
            bk, bv = received["kv"] if blk.kv != me else (k, v)
            g_q, g_k, g_v = _attend_backward(bdo, bq, bk, bv, bo, bl, blk, n, docs, scale, backend)
            # (B, rows, Hq, D), (B, S/P, Hkv, D) x 2
            if blk.q == me:
                grads["q"][:, sl] += g_q
            else:
                sends.append((g_q, blk.q))
            if blk.kv == me:
                grads["k"] += g_k
                grads["v"] += g_v
            else:
                sends += [(g_k, blk.kv), (g_v, blk.kv)]
        bufs, recvs = [], []  # per peer: dq first, then dk, dv (the sender's order above)
        for c, cblk in enumerate(step):
            if cblk is None or c == me:
                continue
            if cblk.q == me:
                sl = rows(cblk.half, n)
                bufs.append(("q", _buffer(q[:, sl]), sl))
                recvs.append((bufs[-1][1], c))
            if cblk.kv == me:
                bufs += [("k", _buffer(k), every), ("v", _buffer(v), every)]
                recvs += [(bufs[-2][1], c), (bufs[-1][1], c)]
        results = exchange(sends, recvs, group)
        _add_partials(deferred, grads)  # one step late: the transfer overlaps this rank's next block
        deferred = (results, bufs)
    _add_partials(deferred, grads)
    return grads["q"].to(q.dtype), grads["k"].to(k.dtype), grads["v"].to(v.dtype)


def dist_flash_attn_attention(
    q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None, cu_seqlens=None
) -> tuple[Tensor, Tensor]:
    """Exact attention over contiguous chunks with the balanced schedule; returns (out, lse) in this rank's layout.

    q (B, S/P, Hq, D); k, v (B, S/P, Hkv, D) -> out (B, S/P, Hq, D), lse (B, Hq, S/P). Works for every group size P.
    cu_seqlens: global document boundaries (seqpar.runtime.parallel.attention).
    """
    return attention(
        q,
        k,
        v,
        "dist_flash_attn",
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        cu_seqlens=cu_seqlens,
    )


dist_flash_attention = dist_flash_attn_attention
