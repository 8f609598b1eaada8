"""The public entry point: ``attention(q, k, v, mode, group=...)`` and the registry {mode name -> function}.

Every mode lives in its own module (``seqpar/runtime/<mode>.py``) and exposes ``<mode>_attention`` with one signature:
``fn(q, k, v, *, group, causal=True, softmax_scale=None, backend=None, **mode_kwargs) -> (out, lse)``.
Modules are imported on first use, so a mode's import cost (or a missing optional dependency) touches only its users.
Layout: q (B, S_local, Hq, D); k, v (B, S_local, Hkv, D) in the mode's shard layout; out like q; lse (B, Hq, S_local).
"""

from __future__ import annotations

import importlib
from typing import Callable

from torch import Tensor

from seqpar.errors import SeqparError
from seqpar.modes import facts


def get_attention_fn(mode: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The attention function of a mode (``seqpar.runtime.<module>.<mode>_attention``, the module named in
    seqpar.modes); SeqparError naming the valid modes for an unknown one."""
    module = importlib.import_module(f"seqpar.runtime.{facts(mode).module}")
    return getattr(module, f"{mode}_attention")


def attention(q: Tensor, k: Tensor, v: Tensor, mode: str, group=None, causal: bool = True,
              softmax_scale: float | None = None, ulysses_degree: int | None = None,
              backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded across the group in ``mode``'s layout (see ``seqpar.runtime.shard``).

    ``ulysses_degree`` is for usp_attn only (Ulysses ranks per ring rank, consecutive ranks); ``backend`` overrides the
    kernel choice (exact | cudnn | flash | flash_attn). Returns (out, lse); out is differentiable in q, k, v.
    """
    if not q.dtype == k.dtype == v.dtype:
        raise SeqparError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first "
                     "(under autocast: to torch.get_autocast_dtype)")
    fn = get_attention_fn(mode)
    kwargs = dict(group=group, causal=causal, softmax_scale=softmax_scale, backend=backend)
    if mode == "usp_attn":
        kwargs["ulysses_degree"] = ulysses_degree
    elif ulysses_degree not in (None, 1):
        raise SeqparError(f"ulysses_degree={ulysses_degree} is for usp_attn only; {mode} takes the group alone (pass None)")
    return fn(q, k, v, **kwargs)
