"""Communication for the parallel modes, kept apart from the algorithms (as picotron's cp_communications and
ring-flash-attention's RingComm do).

Works on gloo with CPU tensors, NCCL with CUDA tensors, and gloo with CUDA tensors by staging through host memory
(so several gloo ranks can share one GPU in tests). Peers are always *group* ranks; translation to global ranks is here.

- ``P2P``: a batch of sends and receives to arbitrary group peers via ``dist.batch_isend_irecv``; ``wait()`` returns the
  received tensors on the caller's device.
- ``exchange(sends, recvs, group)``: the same as a function.
- ``RingComm``: the ring special case: send to the next rank, receive from the previous one
  (``send_recv(t)`` for one tensor, ``send_recv_many([k, v])`` for several in one batch).
- ``all_to_all(x, scatter_dim, gather_dim, group)``: ``dist.all_to_all_single`` underneath, differentiable (its
  backward is the inverse all-to-all), usable inside autograd Functions too.
- ``all_gather(t, group)``: every rank's t (same shape everywhere), in rank order; small tensors (position ids).
- ``raise_everywhere(msg, group)``: all ranks raise the same error when any one of them has a problem, so none hangs.

Every wait is bounded by the group's timeout (``init_process_group``/``new_group``'s, which seqpar's trainer sets from
SEQPAR_PG_TIMEOUT_S): gloo's point-to-point waits have no timeout of their own, so a stopped peer (SIGSTOP, a hung host)
would block its ring neighbour forever. A wait that runs out raises ``PeerTimeoutError`` naming the rank(s) it waited on.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.plan.errors import SeqparError


class PeerTimeoutError(RuntimeError):
    """A peer did not answer within the group's timeout: ``peers`` are the global ranks this rank waited on."""

    def __init__(self, rank: int, peers: list[int], timeout: timedelta | None, what: str, detail: str = ""):
        self.rank, self.peers = rank, peers
        who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {', '.join(map(str, peers))}"
        secs = f"{timeout.total_seconds():g} s" if timeout else "the process-group timeout"
        super().__init__(
            f"{who} did not answer rank {rank} within {secs} ({what}; stopped, hung or dead? SEQPAR_PG_TIMEOUT_S sets the "
            f"wait){': ' + detail if detail else ''}"
        )


def group_timeout(group=None) -> timedelta | None:
    """The timeout to pass to a gloo wait: the one the group was created with. None for NCCL, whose watchdog enforces the
    same timeout on its own (TORCH_NCCL_ASYNC_ERROR_HANDLING), as a timeout given to its wait() would block the CPU until
    the transfer ends and lose the compute/communication overlap; None too when it cannot be read."""
    if not dist.is_initialized() or dist.get_backend(group) != dist.Backend.GLOO:
        return None
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def _timed_out(e: RuntimeError) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _staged(t: Tensor, group) -> bool:
    """True when this group's backend cannot move t directly (gloo with a CUDA tensor): go through host memory."""
    return t.is_cuda and dist.get_backend(group) == dist.Backend.GLOO


def group_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def global_rank(group, peer: int) -> int:
    return peer if group is None else dist.get_global_rank(group, peer)


class P2P:
    """One batch of point-to-point transfers. sends: [(tensor, peer)], recvs: [(buffer, peer)]; peers are group ranks.

    The batch is posted at construction (non-blocking); ``wait()`` blocks and returns the received tensors, copied back
    to the device of their buffers when staged through host memory.
    """

    def __init__(self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], group=None):
        me = group_rank(group)
        # transfers to oneself (a ring of one, a schedule that keeps a block home) are copies, matched in order
        self._all_recv = [buf for buf, _ in recvs]  # returned by wait(), in the caller's order
        for t, buf in zip([t for t, p in sends if p == me], [b for b, p in recvs if p == me]):
            buf.copy_(t)
        sends = [(t, p) for t, p in sends if p != me]
        recvs = [(b, p) for b, p in recvs if p != me]
        self._recv_out = [buf for buf, _ in recvs]
        self._host_recv: list[Tensor | None] = []
        ops = []
        for t, peer in sends:
            t = t.contiguous()
            if _staged(t, group):
                t = t.cpu()
            ops.append(dist.P2POp(dist.isend, t, global_rank(group, peer), group))
        for buf, peer in recvs:
            host = torch.empty(buf.shape, dtype=buf.dtype) if _staged(buf, group) else None
            self._host_recv.append(host)
            ops.append(dist.P2POp(dist.irecv, buf if host is None else host, global_rank(group, peer), group))
        self._sent = [op.tensor for op in ops]  # keep staged send buffers alive until the transfers finish
        self._peers = sorted({global_rank(group, p) for _, p in sends + recvs})
        self._group = group
        self._reqs = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[Tensor]:
        timeout = group_timeout(self._group) if self._reqs else None
        for r in self._reqs:
            try:
                r.wait(timeout) if timeout is not None else r.wait()
            except RuntimeError as e:
                if not _timed_out(e):
                    raise
                me = dist.get_rank()
                raise PeerTimeoutError(me, self._peers, timeout, "point-to-point transfer") from None
        self._reqs, self._sent = [], []
        for buf, host in zip(self._recv_out, self._host_recv):
            if host is not None:
                buf.copy_(host)
        return self._all_recv


def exchange(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], group=None) -> P2P:
    """Post a batch of sends [(tensor, peer)] and receives [(buffer, peer)] (group ranks); ``.wait()`` fills the buffers."""
    return P2P(sends, recvs, group)


class _Single:
    """Handle of one ring transfer: ``wait()`` returns the one received tensor."""

    def __init__(self, p2p: P2P):
        self._p2p = p2p

    def wait(self) -> Tensor:
        return self._p2p.wait()[0]


class RingComm:
    """Send to the next rank of the group and receive from the previous one; the next block can be in flight while
    the current one computes: ``h = comm.send_recv(t)`` ... compute ... ``received = h.wait()`` (or ``comm.wait()``)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = group_rank(group)
        self.world_size = group_size(group)
        self.next = (self.rank + 1) % self.world_size
        self.prev = (self.rank - 1) % self.world_size
        self._pending: _Single | None = None

    def send_recv(self, t: Tensor, recv_buffer: Tensor | None = None) -> _Single:
        """Post: send t to next, receive a tensor like t from prev. Returns the handle (also kept for ``wait()``)."""
        buf = torch.empty_like(t, memory_format=torch.contiguous_format) if recv_buffer is None else recv_buffer
        self._pending = _Single(P2P([(t, self.next)], [(buf, self.prev)], self.group))
        return self._pending

    def send_recv_many(self, tensors: list[Tensor]) -> P2P:
        """Several tensors in one batch (e.g. K and V): the handle's ``wait()`` returns the received list."""
        # contiguous receive buffers whatever the senders' strides: gloo and NCCL refuse strided ones
        recvs = [(torch.empty_like(t, memory_format=torch.contiguous_format), self.prev) for t in tensors]
        return P2P([(t.contiguous(), self.next) for t in tensors], recvs, self.group)

    def wait(self) -> Tensor:
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("RingComm.wait() without a send_recv() in flight")
        return pending.wait()


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group) -> Tensor:
    P = group_size(group)
    if P == 1:
        return x
    scatter_dim %= x.dim()
    gather_dim %= x.dim()
    if x.shape[scatter_dim] % P:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} does not split over {P} ranks")
    # chunk i of scatter_dim goes to rank i: put scatter_dim first so each chunk is one contiguous slab
    send = x.movedim(scatter_dim, 0).contiguous()  # (P*c, ...)
    staged = _staged(send, group)
    src = send.cpu() if staged else send
    recv = torch.empty_like(src)
    timeout = group_timeout(group)
    work = dist.all_to_all_single(recv, src, group=group, async_op=True)
    try:
        work.wait(timeout) if timeout is not None else work.wait()
    except RuntimeError as e:
        if not _timed_out(e):
            raise
        me = dist.get_rank()
        peers = [global_rank(group, p) for p in range(P) if global_rank(group, p) != me]
        raise PeerTimeoutError(me, peers, timeout, "all-to-all") from None
    if staged:
        recv = recv.to(x.device)
    parts = recv.chunk(P, dim=0)  # from rank j: its chunk for us, (c, ...) with scatter_dim first
    return torch.cat([p.movedim(0, scatter_dim) for p in parts], dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group=None) -> Tensor:
    """Split x into P chunks along scatter_dim, send chunk i to group rank i, concatenate what arrives along gather_dim
    (in rank order). E.g. (B, S/P, H, D) with scatter_dim=2, gather_dim=1 -> (B, S, H/P, D). Differentiable."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _AllToAll.apply(x, scatter_dim, gather_dim, group)
    return _all_to_all(x, scatter_dim, gather_dim, group)


def all_gather(t: Tensor, group=None) -> list[Tensor]:
    """[t of group rank 0, ..., rank P-1] on t's device; t has the same shape on every rank."""
    if group_size(group) == 1 or not dist.is_initialized():
        return [t]
    staged = _staged(t, group)
    src = t.contiguous().cpu() if staged else t.contiguous()
    parts = [torch.empty_like(src) for _ in range(group_size(group))]
    dist.all_gather(parts, src, group=group)
    return [p.to(t.device) for p in parts] if staged else parts


def raise_everywhere(msg: str | None, group=None, error=None) -> None:
    """Collective check: every rank calls it; if any rank passes a message, all ranks raise (the first message seen,
    by rank order) as ``error`` (default SeqparError). Costs one tiny all-reduce-like gather; use at setup, not per step."""
    if group_size(group) == 1 or not dist.is_initialized():
        msgs = [msg]
    else:
        msgs = [None] * group_size(group)
        dist.all_gather_object(msgs, msg, group=group)
    first = next((m for m in msgs if m), None)
    if first:
        raise (error or SeqparError)(first)
