"""Tiled MLP (DeepSpeed ALST's TiledMLP, Bekman et al. 2025, arXiv:2506.13996, sec. 3.2): each decoder MLP runs one sequence
tile at a time, so its intermediates (SwiGLU's gate, up, act(gate) and their product: 4 x intermediate_size per token,
2.7x the hidden state for Llama-2-7B) exist for one tile instead of the whole local sequence.

``_TiledMLP`` is one autograd Function around the module: forward runs the tiles under no_grad into one output and saves
only the MLP's input (and its parameters); backward recomputes each tile with grad, backpropagates that tile's slice of
the output gradient, writes the input gradient slice and sums the parameter gradients over tiles in fp32. The parameters
are inputs of the Function and their gradients come out of its backward, so DDP / FSDP2 see ordinary gradients (no
accumulation behind their hooks). The MLP is token-wise, so every output row is the untiled one; the weight gradients
are the same sums in another order (fp32, then cast to the parameter dtype).

Cost: one more MLP forward per step (the tile recomputation in backward; under gradient checkpointing the layer's own
recomputation runs the no-grad forward once more as well). Autocast is captured in forward and restored in backward.

``tile_norms`` runs the model's own RMSNorms (transformers' unfused ones: an fp32 upcast, pow, mean, rsqrt, two
products) the same way. Untiled, such a norm saves an fp32 copy of its input and holds five fp32 tensors of the hidden
state's shape at once in its backward (20 bytes per element): with a tiled MLP the largest moment of a layer's backward.
Tiled, it saves its input alone and its backward holds those temporaries for one tile; the norm is token-wise, so every
output row and input gradient is the untiled one (the weight's gradient: the same sum in another order, in fp32).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from seqpar.plan.errors import SeqparError


def tile_tokens(local_tokens: int, hidden_size: int) -> int:
    """ALST's rule: ceil(t / h) tiles, so a tile holds about h tokens (its intermediates ~ an (h, I) block)."""
    tiles = max(1, math.ceil(local_tokens / max(hidden_size, 1)))
    return math.ceil(local_tokens / tiles)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, module: nn.Module, names: tuple[str, ...], tile: int, *params: Tensor) -> Tensor:
        dev = x.device.type
        ctx.autocast = (
            (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) if dev in ("cuda", "cpu") else (False, None)
        )
        ctx.module, ctx.names, ctx.tile = module, names, tile
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return _tiles_no_grad(module, names, params, x, tile)

    @staticmethod
    def backward(ctx, dout: Tensor):
        x, *params = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[4 + i]]
        acc = [torch.zeros_like(params[i], dtype=torch.promote_types(params[i].dtype, torch.float32)) for i in want]
        for start in range(0, x.shape[1], ctx.tile):
            xt = x[:, start : start + ctx.tile].detach().requires_grad_(dx is not None)
            # a frozen parameter goes in as it is: detaching it would drop what a subclass carries beside its data
            # (bitsandbytes' Params4bit its quant_state, without which a 4-bit layer cannot run); only the ones whose
            # gradient is wanted become fresh leaves
            leaves = [p.detach().requires_grad_() if i in want else p for i, p in enumerate(params)]
            with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
                y = _call(ctx.module, ctx.names, leaves, xt)
            inputs = ([xt] if dx is not None else []) + [leaves[i] for i in want]
            grads = torch.autograd.grad(y, inputs, dout[:, start : start + ctx.tile], allow_unused=True)
            if dx is not None:
                dx[:, start : start + ctx.tile] = grads[0]
                grads = grads[1:]
            for a, g in zip(acc, grads):
                if g is not None:
                    a.add_(g)
        pgrads = [None] * len(params)
        for i, a in zip(want, acc):
            pgrads[i] = a.to(params[i].dtype)
        return (dx, None, None, None, *pgrads)


def _call(module: nn.Module, names: tuple[str, ...], params, x: Tensor) -> Tensor:
    """The module's own (untiled) forward on one tile with ``params`` in place of its parameters."""
    module._seqpar_inside = True  # the tiled forward then runs the untiled one
    try:
        return torch.func.functional_call(module, dict(zip(names, params)), (x,), strict=False)
    finally:
        module._seqpar_inside = False


class _Tiled:
    """Mixin put in front of an MLP's class (``Tiled<Class>``): forward runs in tiles. A class, not a closure on the
    instance, so a tiled model has no reference cycle (its memory goes when it is deleted), deep-copies into an
    independent model and pickles (the classes are registered in this module). An instance-level forward some other
    patch bound (Liger's SwiGLU) is kept, unbound, in ``_seqpar_inner_forward`` and is what runs inside the tiles."""

    def _seqpar_untiled(self, *args, **kwargs):
        inner = self.__dict__.get("_seqpar_inner_forward")
        return inner(self, *args, **kwargs) if inner is not None else super().forward(*args, **kwargs)

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        if self._seqpar_inside or x.dim() != 3:  # inside a tile, or not a (B, S, h) call
            return self._seqpar_untiled(x, *args, **kwargs)
        if args or kwargs:
            if not self._seqpar_warned:
                self._seqpar_warned = True
                warnings.warn(f"tiled_mlp: {type(self).__name__} called with extra arguments runs untiled", stacklevel=2)
            return self._seqpar_untiled(x, *args, **kwargs)
        t = self._seqpar_tile or tile_tokens(x.shape[1], self._seqpar_hidden)
        named = list(self.named_parameters())
        if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for _, p in named)):
            # no graph to keep (reentrant checkpointing's forward, evaluation): still one tile at a time
            with torch.no_grad():
                return _tiles_no_grad(self, tuple(n for n, _ in named), tuple(p for _, p in named), x, t)
        return _TiledMLP.apply(x, self, tuple(n for n, _ in named), t, *(p for _, p in named))


def _tiles_no_grad(module, names, params, x: Tensor, tile: int) -> Tensor:
    out = None
    for start in range(0, x.shape[1], tile):
        y = _call(module, names, params, x[:, start : start + tile])
        if out is None:
            out = y.new_empty((x.shape[0], x.shape[1], *y.shape[2:]))
        out[:, start : start + tile] = y
    return out


def _tiled_class(cls: type) -> type:
    name = f"Tiled{cls.__name__}"
    existing = globals().get(name)
    if isinstance(existing, type) and existing.__mro__[2] is cls:
        return existing
    new = type(name, (_Tiled, cls), {"__module__": __name__, "__qualname__": name})
    globals()[name] = new  # importable by name, so torch.save / pickle of a tiled model works
    return new


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' MLPs: a child named ``mlp`` of each layer (Llama, Mistral, Qwen2/3 and most HF decoders)."""
    found = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"]
    return found


def tile_mlp(model: nn.Module, tile: int | None = None) -> int:
    """Switch every decoder MLP of a transformers model to tiled execution (in place); returns how many were switched.

    tile: tokens per tile (default: ALST's ceil(t / ceil(t / hidden_size)) for the local length t of each call).
    Mixture-of-experts blocks (router logits, auxiliary losses) are refused: their routing statistics are not token-wise."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    name = f"{type(model).__name__} ({getattr(config, 'model_type', '?')})"
    mlps = mlp_modules(model)
    if not mlps or hidden is None:
        raise SeqparError(f"{name}: tiled_mlp found no decoder MLP (a submodule named 'mlp'); set tiled_mlp false")
    for m in mlps:
        if any(hasattr(m, a) for a in ("gate", "router", "experts")) or getattr(config, "num_experts", None):
            raise SeqparError(
                f"{name}: tiled_mlp cannot tile a mixture-of-experts block ({type(m).__name__}); set tiled_mlp false"
            )
        drop = [d.p for d in m.modules() if isinstance(d, nn.Dropout) and d.p > 0]
        if drop and model.training:
            raise SeqparError(
                f"{name}: tiled_mlp recomputes each tile in backward and would draw new dropout masks "
                f"(dropout p={drop[0]} inside {type(m).__name__}); set the MLP's dropout to 0 or tiled_mlp false"
            )
    _check_tile(tile, "tiled_mlp")
    for m in mlps:
        if isinstance(m, _Tiled):
            m._seqpar_tile = tile
            continue
        bound = m.__dict__.pop("forward", None)  # an instance-level patch (Liger's SwiGLU): keep it, unbound
        if bound is not None:
            func = getattr(bound, "__func__", None)
            if func is None or getattr(bound, "__self__", None) is not m:
                m.forward = bound
                raise SeqparError(
                    f"{name}: tiled_mlp cannot wrap {type(m).__name__}'s replaced forward ({bound!r}); set tiled_mlp false"
                )
            m._seqpar_inner_forward = func
        _switch(m, tile, hidden)
    return len(mlps)


def _check_tile(tile: int | None, what: str) -> None:
    if tile is not None and tile < 1:
        raise SeqparError(f"{what} tile {tile} must be >= 1 token")


def _switch(m: nn.Module, tile: int | None, hidden: int) -> None:
    """Run ``m`` in tiles of ``tile`` tokens (None: ALST's rule for ``hidden``); an already tiled module takes the tile."""
    if not isinstance(m, _Tiled):
        m.__class__ = _tiled_class(type(m))
        m._seqpar_hidden, m._seqpar_inside, m._seqpar_warned = hidden, False, False
    m._seqpar_tile = tile


def norm_modules(model: nn.Module) -> list[nn.Module]:
    """The model's own RMSNorms over the hidden state (the decoder layers' and the final one): modules whose class name
    ends in RMSNorm with a weight of hidden_size. Liger's replacements and per-head norms (Qwen3's q_norm: head_dim wide)
    are not among them."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    out = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if type(m).__name__.endswith("RMSNorm") and not type(m).__name__.startswith("Liger") and w is not None:
            if tuple(w.shape) == (hidden,) and "forward" not in m.__dict__:
                out.append(m)
    return out


def tile_norms(model: nn.Module, tile: int | None = None) -> int:
    """Switch the model's own RMSNorms (norm_modules) to tiled execution (in place), as tile_mlp does the MLPs; returns
    how many were switched (0 where the model has none of its own, e.g. under Liger's fused norms)."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    _check_tile(tile, "tiled norms:")
    norms = norm_modules(model) if hidden is not None else []
    for m in norms:
        _switch(m, tile, hidden)
    return len(norms)
