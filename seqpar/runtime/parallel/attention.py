"""The public entry point ``attention(q, k, v, mode, group=...)``, the protocol every mode follows, and what they share.

Every mode lives in its own module, the ``runtime`` its registered description names (seqpar.plan.modes; the built-in
ones are ``seqpar/runtime/parallel/<mode>.py``), layered like ring-flash-attention's zigzag_ring_flash_attn.py:
- ``forward(q, k, v, *, group, causal, scale, backend, docs=None, **mode_kw) -> (out, lse)`` and
  ``backward(dout, q, k, v, out, lse, *, group, causal, scale, backend, docs=None, **mode_kw) -> (dq, dk, dv)``: plain
  functions, no autograd, on inputs ``prepare`` has checked; out in q's dtype, lse float32 (float64 for float64),
  gradients in their inputs' dtypes. A hybrid mode's (usp_attn's) mode_kw is ``ulysses_degree``. ``docs``
  (seqpar.runtime.parallel.documents.Documents) are packed documents: each query sees the earlier tokens of its own
  document only (seqpar.runtime.parallel.blocks); None is the plain causal path, unchanged.
- ``<mode>_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None, cu_seqlens=None)``: the
  user-facing call, ``attention`` with the mode filled in (``get_attention_fn`` maps a mode name to it).
This module holds what the modes share: ``prepare`` (every check, once: each rank holds the same shapes, so every rank raises
the same error before any transfer), ``Functions`` (a mode's forward and backward with its arguments bound) and the one
autograd Function around any mode (``differentiable``; seqpar.runtime.memory.selective reuses it with its keep hooks).
Head-splitting modes (Ulysses, USP) take ``attend``, how to run their inner mode: ``plain`` or ``differentiable``. The
autograd path passes ``differentiable``, so their all-to-alls stay differentiable outside the Function and backward moves
dout and dq, dk, dv only; their plain ``backward`` sends q, k, v, out again (what selective checkpointing pays instead
of recomputing). Modules are imported on first use, so a mode's import cost touches only its users.
Layout: q (B, S_local, Hq, D); k, v (B, S_local, Hkv, D) in the mode's shard layout; out like q; lse (B, Hq, S_local).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import check_heads, check_split, degrees, describe
from seqpar.runtime.parallel import documents, kernels
from seqpar.runtime.parallel.comm import group_size


class Functions(NamedTuple):
    """A mode's attention without autograd, its arguments bound: forward(q, k, v) -> (out, lse);
    backward(dout, q, k, v, out, lse) -> (dq, dk, dv)."""

    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def mode_module(mode: str) -> ModuleType:
    """The runtime module a mode's description names (SeqparError naming the valid modes for an unknown one)."""
    return importlib.import_module(describe(mode).runtime)


def functions(mode: str, **kwargs) -> Functions:
    """The mode's plain forward and backward with ``kwargs`` (group, causal, scale, backend, ...) bound."""
    m = mode_module(mode)
    return Functions(functools.partial(m.forward, **kwargs), functools.partial(m.backward, **kwargs))


def get_attention_fn(mode: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The user-facing attention call of a mode, ``<its runtime module>.<mode>_attention``."""
    return getattr(mode_module(mode), f"{mode}_attention")


def prepare(
    mode: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group,
    causal: bool,
    softmax_scale: float | None,
    ulysses_degree: int | None,
    backend: str | None,
    cu_seqlens: Tensor | None = None,
) -> dict:
    """Every check of a mode's inputs, then its keyword arguments for forward/backward (scale and backend resolved).

    All checks but one are local and see the same shapes on every rank (shard makes them so), so every rank raises the
    same error before any transfer. The one collective: with cu_seqlens on a sequence-parallel group, the ranks compare
    their boundaries (seqpar.runtime.parallel.documents.plan, once per cu_seqlens tensor, not per layer)."""
    if not q.dtype == k.dtype == v.dtype:
        raise SeqparError(
            f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first "
            "(under autocast: to torch.get_autocast_dtype)"
        )
    P = group_size(group)
    degrees(mode, P, ulysses_degree)  # ulysses_degree is usp_attn's: it must divide the group size
    whole = describe(mode).layout == "whole"  # data_parallel: any Sq, Sk when not causal, as one kernel call takes them
    kernels.check_shapes(q, k, v, causal=causal and whole)
    if not whole and q.shape[1] != k.shape[1]:
        raise SeqparError(
            f"{mode} needs q and k,v chunks of the same local length, got {q.shape[1]} and {k.shape[1]}; shard q, k, v alike"
        )
    check_heads(mode, q.shape[2], k.shape[2], P, ulysses_degree)
    if causal:  # zigzag layouts need whole halves of every chunk; the other layouts split any local length
        check_split(mode, q.shape[1] * P, P, ulysses_degree)
    kwargs = dict(
        group=group,
        causal=causal,
        scale=kernels.default_scale(q, softmax_scale),
        backend=kernels.select_backend(q.device, q.dtype, backend),
    )
    if describe(mode).takes_ulysses_degree:
        kwargs["ulysses_degree"] = ulysses_degree
    if cu_seqlens is not None:
        if not causal:
            raise SeqparError(
                "cu_seqlens (packed documents) needs causal=True: a query sees the earlier tokens of its own document"
            )
        S = q.shape[1] if whole else q.shape[1] * P  # the full, unsharded length the global boundaries cover
        docs = documents.plan(cu_seqlens, S, q.shape[0], group, across_ranks=not whole)  # whole: ranks hold their own rows
        if docs is not None:  # None: one document per row, the plain causal path
            kwargs["docs"] = docs
    return kwargs


class _Attention(torch.autograd.Function):
    """Any mode's forward and backward as one differentiable op (lse carries no gradient).

    ``keep`` (seqpar.runtime.memory.selective) may hand over a kept (out, lse) instead of running forward: ``take(q)`` returns
    it or None, ``record(q, out, lse)`` keeps a forward's result (an entry the node holds), ``release(entry)`` ends it."""

    @staticmethod
    def forward(ctx, q, k, v, fns: Functions, keep):
        kept = keep.take(q) if keep is not None else None
        out, lse = fns.forward(q, k, v) if kept is None else kept
        ctx.entry = keep.record(q, out, lse) if keep is not None and kept is None else None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.fns, ctx.keep = fns, keep
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.entry is not None:
            ctx.keep.release(ctx.entry)
        ctx.entry = None
        dq, dk, dv = ctx.fns.backward(dout.contiguous(), q, k, v, out, lse)
        return dq, dk, dv, None, None


def differentiable(fns: Functions, keep=None) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(q, k, v) -> (out, lse) through the autograd Function: out differentiable in q, k, v."""
    return lambda q, k, v: _Attention.apply(q, k, v, fns, keep)


def plain(fns: Functions) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(q, k, v) -> (out, lse) without autograd: the mode's forward."""
    return fns.forward


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mode: str,
    group=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    ulysses_degree: int | None = None,
    backend: str | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded across the group in ``mode``'s layout (see ``seqpar.runtime.shard``).

    ``ulysses_degree`` is for usp_attn only (Ulysses ranks per ring rank, consecutive ranks); ``backend`` overrides the
    kernel choice (exact | cudnn | flash | flash_attn). ``cu_seqlens``: packed documents, the GLOBAL cumulative document
    lengths ``[0, l1, l1+l2, ..., S]`` over the unsharded sequence (int tensor, the same on every rank; (B, n+1) for
    boundaries per batch row, padded with S): a query attends to the earlier tokens of its own document only, and its
    lse is over that document. Returns (out, lse); out is differentiable in q, k, v.
    """
    kwargs = prepare(
        mode,
        q,
        k,
        v,
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        ulysses_degree=ulysses_degree,
        backend=backend,
        cu_seqlens=cu_seqlens,
    )
    if describe(mode).splits_heads:  # differentiable all-to-alls around the Function on the inner mode (see the docstring)
        return mode_module(mode).forward(q, k, v, attend=differentiable, **kwargs)
    return differentiable(functions(mode, **kwargs))(q, k, v)
