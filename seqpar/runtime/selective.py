"""Selective checkpointing (LightSeq's idea, Li et al., arXiv:2310.03294, sec. 3.3): keep each layer's attention output
and log-sum-exp, so that backward's recomputation of a checkpointed layer does not run attention's forward again.

Under non-reentrant gradient checkpointing (torch.utils.checkpoint, use_reentrant=False) a layer's forward runs twice:
once in the forward pass with its saved tensors dropped, once inside backward to rebuild them. ``kept_attention`` is the
attention of every mode as one autograd Function that saves (q, k, v, out, lse) in this rank's layout:
- first forward: run the mode's forward (kernels and communication), keep a detached (out, lse) on the Function's
  context (ctx attributes escape checkpointing's saved-tensor hooks) and announce it under the attention module;
- recomputation (inside backward: torch._C._current_graph_task_id() != -1, and an announced entry of this module):
  hand the kept (out, lse) over as if computed, so the saved tensors match the first forward's (checkpointing checks
  their shapes) and no kernel or transfer runs;
- backward (of the first forward's node, which is the one autograd runs): the mode's exact backward on those tensors.
The entry lives as long as the forward's graph node; the recomputation takes its tensors over and backward frees them,
so nothing outlives a micro-batch (gradient accumulation, or a model without checkpointing, leave nothing behind).
When several forwards of one module await backward at once, a per-token fingerprint of q picks the right one (the
recomputation reproduces q bitwise); with none matching, the forward simply runs again (exact, just not cheaper).
Memory: one (B, S_local, Hq, D) output in the model dtype + (B, Hq, S_local) fp32 lse per layer on top of its input.
Layout: q (B, S_local, Hq, D); k, v (B, S_local, Hkv, D); out like q; lse (B, Hq, S_local) (seqpar.runtime.attention).
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch
from torch import Tensor, nn

from seqpar.errors import SeqparError
from seqpar.runtime import dist_flash_attn as df
from seqpar.runtime import kernels
from seqpar.runtime import zigzag_ring_attn as zz
from seqpar.runtime.comm import all_to_all, group_size
from seqpar.modes import check_heads, check_split, degrees
from seqpar.runtime.ulysses_attn import heads_to_seq, lse_to_seq_split, replicate_kv, seq_to_heads

_PENDING: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()  # module -> [weakref to _Entry]


class _Entry:
    """One forward's kept (out, lse) and a fingerprint of its q; the forward's graph node holds it, _PENDING only refers to it."""

    __slots__ = ("out", "lse", "probe", "__weakref__")  # out is None once a recomputation took it

    def __init__(self, out: Tensor, lse: Tensor, probe: Tensor):
        self.out, self.lse, self.probe = out, lse, probe


class Functions(NamedTuple):
    """A mode's attention without autograd: forward(q, k, v) -> (out, lse); backward(dout, q, k, v, out, lse) -> (dq, dk, dv)."""

    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def _probe(q: Tensor) -> Tensor:
    """A fingerprint of q, one float per token (B, S): the recomputation reproduces q bitwise, so it reproduces this."""
    return q.detach().sum(dim=(2, 3), dtype=torch.float32)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1  # -1 outside the autograd engine (torch >= 2.1)


def _entries(module: nn.Module) -> list[_Entry]:
    """The module's entries whose forward node is still alive (kept or already taken), oldest first; prunes the rest."""
    live = [e for r in _PENDING.get(module, ()) if (e := r()) is not None]
    _PENDING[module] = [weakref.ref(e) for e in live]
    return live


def _all_agree(hit: bool, group, device: torch.device) -> bool:
    """True when every rank of the group hit. A rank that recomputes attention communicates, so the ranks must take
    the same path or their messages pair up wrongly (a hang on NCCL): one tiny all-reduce decides for all."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return hit
    flag = torch.tensor([int(hit)], device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _take(module: nn.Module, q: Tensor, group=None) -> tuple[Tensor, Tensor] | None:
    """The kept (out, lse) of this module's forward being recomputed, moved out of its entry; None if there is none.

    One kept entry (every forward followed by its backward, the normal case) is found by structure alone, the same on
    every rank. Several (forwards awaiting one backward) are told apart by q's fingerprint, which is data: a NaN or a
    non-bitwise recomputation on one rank would make it miss alone, so the group agrees before anyone uses a hit."""
    kept = [e for e in _entries(module) if e.out is not None and e.out.shape[:3] == q.shape[:3]]
    if len(kept) > 1:
        probe = _probe(q)
        kept = [e for e in kept if torch.equal(e.probe, probe)]
        if not _all_agree(bool(kept), group, q.device):
            return None
    if not kept:
        return None
    entry = kept[-1]  # equal fingerprints: the newest, the order autograd runs a summed backward in
    out, lse = entry.out, entry.lse
    entry.out = entry.lse = None  # the recomputation's saved tensors own them now; backward frees them
    return out, lse


def _release(module: nn.Module, entry: _Entry) -> None:
    """At the end of a node's backward. An entry never taken while an equal one was (two forwards of the same q awaiting
    one backward, recomputed in the other order) hands its tensors to the taken one, whose recomputation is still due."""
    if entry.out is None:
        return
    for other in _entries(module):
        if other is not entry and other.out is None and torch.equal(other.probe, entry.probe):
            other.out, other.lse = entry.out, entry.lse
            break
    entry.out = entry.lse = None


class _KeptAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, module, fns, record, group):
        kept = _take(module, q, group) if record and _in_backward() else None
        ctx.entry = None
        if kept is None:
            out, lse = fns.forward(q, k, v)
            if record:
                ctx.entry = _Entry(out.detach(), lse.detach(), _probe(q))  # detached: no cycle through this node
                _PENDING.setdefault(module, []).append(weakref.ref(ctx.entry))
        else:
            out, lse = kept
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.fns, ctx.module = fns, weakref.ref(module)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.entry is not None and (module := ctx.module()) is not None:
            _release(module, ctx.entry)
        ctx.entry = None
        dq, dk, dv = ctx.fns.backward(dout.contiguous(), q, k, v, out, lse)
        return dq, dk, dv, None, None, None, None


# --------------------------------------------------------------------------------------------- each mode, no autograd


def _local(causal: bool, scale: float, backend: str) -> Functions:
    kw = dict(causal=causal, softmax_scale=scale, backend=backend)
    return Functions(lambda q, k, v: kernels.attn_forward(q, k, v, **kw),
                     lambda do, q, k, v, o, l: kernels.attn_backward(do, q, k, v, o, l, **kw))


def _zigzag(group, causal: bool, scale: float, backend: str) -> Functions:
    def forward(q, k, v):
        out, lse = zz._forward(q, k, v, group, causal, scale, backend)
        return out.to(q.dtype), lse

    def backward(do, q, k, v, o, l):
        dq, dk, dv = zz._backward(do, q, k, v, o, l, group, causal, scale, backend)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    return Functions(forward, backward)


def _fold_replicas(dx: Tensor, hkv: int) -> Tensor:
    """Gradient of replicate_kv: (B, s, P, D) with P/hkv replicas of each KV head -> (B, s, hkv, D) summed over them."""
    B, s, P, D = dx.shape
    return dx if P == hkv else dx.view(B, s, hkv, P // hkv, D).sum(3)


def _head_split(inner: Functions, group) -> Functions:
    """Ulysses around an inner attention: all-to-all to (B, S_inner, H/P, D), inner attention, all-to-all back.
    Backward sends q, k, v, dout and out across again (what the autograd path saved after its all-to-alls)."""
    P = group_size(group)

    def forward(q, k, v):
        qh, kh, vh = (heads_to_seq(x, group) for x in (q, replicate_kv(k, P), replicate_kv(v, P)))
        out, lse = inner.forward(qh, kh, vh)  # (B, S_inner, Hq/P, D), (B, Hq/P, S_inner)
        return seq_to_heads(out, group), lse_to_seq_split(lse, group)

    def backward(do, q, k, v, o, l):
        qh, kh, vh, doh, oh = (heads_to_seq(x, group) for x in (q, replicate_kv(k, P), replicate_kv(v, P), do, o))
        lh = all_to_all(l, scatter_dim=1, gather_dim=2, group=group)  # (B, Hq, s) -> (B, Hq/P, S_inner)
        dq, dk, dv = inner.backward(doh, qh, kh, vh, oh, lh)
        dk, dv = (_fold_replicas(seq_to_heads(x, group), k.shape[2]) for x in (dk, dv))
        return seq_to_heads(dq, group), dk, dv

    return Functions(forward, backward)


def functions(mode: str, q: Tensor, k: Tensor, v: Tensor, *, group, causal: bool, scale: float, backend: str,
              ulysses_degree: int | None) -> Functions:
    """The mode's forward and backward on this rank's shard, after the same checks the mode's own function makes."""
    kernels._check(q, k, v, causal=causal and mode == "data_parallel")
    if mode != "data_parallel" and q.shape[1] != k.shape[1]:
        raise SeqparError(f"{mode} needs q and k,v chunks of the same length, got {q.shape[1]} and {k.shape[1]}")
    P = group_size(group)
    if mode == "data_parallel" or P == 1 and mode != "usp_attn":
        return _local(causal, scale, backend)
    if mode == "zigzag_ring_attn":
        zz._validate(q, k, v, causal, P)
        return _zigzag(group, causal, scale, backend)
    if mode == "dist_flash_attn":
        return Functions(lambda q, k, v: df._forward(q.contiguous(), k.contiguous(), v.contiguous(), group, causal, scale, backend),
                         lambda do, q, k, v, o, l: df._backward(do, q, k, v, o, l, group, causal, scale, backend))
    if mode == "ulysses_attn":
        check_heads("ulysses_attn", q.shape[2], k.shape[2], P)
        return _head_split(_local(causal, scale, backend), group)
    if mode == "usp_attn":
        from seqpar.runtime.usp_attn import subgroups

        R, U = degrees("usp_attn", P, ulysses_degree)
        check_heads("usp_attn", q.shape[2], k.shape[2], P, U)
        if causal:
            check_split("usp_attn", q.shape[1] * P, P, U)
        if U == 1:
            return _zigzag(group, causal, scale, backend)
        if R == 1:
            return _head_split(_local(causal, scale, backend), group)
        uly_group, ring_group = subgroups(group, U)
        return _head_split(_zigzag(ring_group, causal, scale, backend), uly_group)
    raise SeqparError(f"mode {mode!r} is unknown")


def kept_attention(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, mode: str, *, group=None, causal: bool = True,
                   softmax_scale: float | None = None, ulysses_degree: int | None = None,
                   backend: str | None = None) -> tuple[Tensor, Tensor]:
    """``seqpar.runtime.attention.attention`` whose (out, lse) is kept for the recomputation of ``module``'s layer.

    Same inputs and results as the mode's function; differentiable in q, k, v; lse carries no gradient."""
    scale = kernels.default_scale(q, softmax_scale)
    backend = kernels.select_backend(q.device, q.dtype, backend)
    fns = functions(mode, q, k, v, group=group, causal=causal, scale=scale, backend=backend, ulysses_degree=ulysses_degree)
    record = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _KeptAttention.apply(q, k, v, module, fns, record, group)


def pending(module: nn.Module | None = None) -> int:
    """Entries whose forward still awaits its backward (of one module, or of all): 0 between steps (tests check it)."""
    mods = [module] if module is not None else list(_PENDING.keys())
    return sum(len(_entries(m)) for m in mods)
