"""Selective checkpointing (LightSeq's idea, Li et al., arXiv:2310.03294, sec. 3.3): keep each layer's attention output
and log-sum-exp, so that backward's recomputation of a checkpointed layer does not run attention's forward again.

Under non-reentrant gradient checkpointing (torch.utils.checkpoint, use_reentrant=False) a layer's forward runs twice:
once in the forward pass with its saved tensors dropped, once inside backward to rebuild them. ``kept_attention`` runs
every mode through seqpar.runtime.parallel.attention's one autograd Function (the mode's plain forward and backward, which save
(q, k, v, out, lse) in this rank's layout), with this module's keep hooks (``_Keep``):
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
Layout: q (B, S_local, Hq, D); k, v (B, S_local, Hkv, D); out like q; lse (B, Hq, S_local) (seqpar.runtime.parallel.attention).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from seqpar.runtime.parallel.attention import differentiable, functions, prepare

_PENDING: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()  # module -> [weakref to _Entry]


class _Entry:
    """One forward's kept (out, lse) and a fingerprint of its q; the forward's graph node holds it, _PENDING only refers to it."""

    __slots__ = ("out", "lse", "probe", "__weakref__")  # out is None once a recomputation took it

    def __init__(self, out: Tensor, lse: Tensor, probe: Tensor):
        self.out, self.lse, self.probe = out, lse, probe


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


class _Keep:
    """The keep hooks of one attention call (seqpar.runtime.parallel.attention._Attention calls them); the module is held weakly."""

    __slots__ = ("module", "group", "active")

    def __init__(self, module: nn.Module, group, active: bool):
        self.module, self.group, self.active = weakref.ref(module), group, active  # active: this call has a backward

    def take(self, q: Tensor) -> tuple[Tensor, Tensor] | None:
        module = self.module()
        return _take(module, q, self.group) if self.active and module is not None and _in_backward() else None

    def record(self, q: Tensor, out: Tensor, lse: Tensor) -> _Entry | None:
        module = self.module()
        if not self.active or module is None:
            return None
        entry = _Entry(out.detach(), lse.detach(), _probe(q))  # detached: no cycle through the node holding it
        _PENDING.setdefault(module, []).append(weakref.ref(entry))
        return entry

    def release(self, entry: _Entry) -> None:
        module = self.module()
        if module is not None:
            _release(module, entry)


def kept_attention(
    module: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mode: str,
    *,
    group=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    ulysses_degree: int | None = None,
    backend: str | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``seqpar.runtime.parallel.attention.attention`` whose (out, lse) is kept for the recomputation of ``module``'s layer.

    Same inputs, checks and results as the mode's function (packed documents too); differentiable in q, k, v; lse
    carries no gradient."""
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
    active = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return differentiable(functions(mode, **kwargs), _Keep(module, group, active))(q, k, v)


def pending(module: nn.Module | None = None) -> int:
    """Entries whose forward still awaits its backward (of one module, or of all): 0 between steps (tests check it)."""
    mods = [module] if module is not None else list(_PENDING.keys())
    return sum(len(_entries(m)) for m in mods)
