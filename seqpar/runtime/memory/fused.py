"""Fused elementwise kernels for a transformers model: ``fused_ops: liger`` in a plan.

Hugging Face's eager RMSNorm, RoPE and SwiGLU run as chains of small kernels that each read and write the whole
(tokens, hidden) tensor, and RMSNorm saves fp32 copies of its input for backward. Liger-Kernel (Hsu et al. 2024,
arXiv:2410.10989) fuses each into one Triton kernel that saves only its input and a per-row rstd. seqpar applies
Liger's own per-model patch to the instance (the entry point transformers' Trainer uses for ``use_liger_kernel``), with
its losses switched off: seqpar's loss (``loss_impl``) stays in charge, and the attention stays seqpar's.
Exactness: the fused kernels compute the same functions in fp32 inside, so loss and gradients match the eager modules
within bf16 rounding (tests/runtime/hf/test_hf_gpu.py checks it on the GPU). Needs CUDA and the ``liger-kernel`` package
(the ``liger`` extra).
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch import nn

from seqpar.plan.errors import SeqparError
from seqpar.plan.extras import install_line

KINDS = ("none", "liger")


def apply_fused_ops(model: nn.Module, kind: str, device_type: str) -> str:
    """Patch ``model`` in place with the fused kernels of ``kind``; returns a line saying what ran."""
    if kind == "none":
        return "fused ops: none (the model's own RMSNorm, RoPE and SwiGLU)"
    if kind != "liger":
        raise SeqparError(f"fused_ops {kind!r} is unknown; use one of {', '.join(KINDS)}")
    if device_type != "cuda":
        raise SeqparError(f"fused_ops liger runs Triton kernels on CUDA, but this run is on {device_type}; set fused_ops none")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:
        raise SeqparError(
            f"fused_ops liger needs the liger-kernel package ({e}); {install_line('liger')} or set fused_ops none"
        ) from None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise SeqparError(
            f"fused_ops liger has no kernels for model type {model_type!r} (Liger supports "
            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set fused_ops none"
        )
    accepted = inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]).parameters
    kinds = [k for k in ("rms_norm", "rope", "swiglu") if k in accepted]
    modeling = sys.modules.get(type(model).__module__)
    before = dict(vars(modeling)) if modeling is not None else {}
    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    _scope_to_cuda(modeling, before)
    return f"fused ops: liger ({model_type}: {', '.join(kinds) or 'nothing applicable'})"


def _scope_to_cuda(modeling, before: dict) -> None:
    """Liger's per-model patch also rebinds names of the modeling module (the norm and MLP classes, the RoPE function),
    which would change every model of that type built later in the process, on any device. The instance keeps its patched
    modules; the classes go back; a replaced module-level function (RoPE, looked up at call time by the attention
    forward) becomes a dispatcher that takes Liger's path for CUDA tensors only."""
    if modeling is None:
        return
    for name, old in before.items():
        new = getattr(modeling, name, None)
        if new is old:
            continue
        if isinstance(old, type) or not callable(old) or not callable(new):
            setattr(modeling, name, old)
        else:
            setattr(modeling, name, _cuda_dispatch(new, old))


def _cuda_dispatch(fused, plain):
    if getattr(plain, "_seqpar_plain", None) is not None:  # already a dispatcher (a second model of the same type)
        plain = plain._seqpar_plain

    @functools.wraps(plain)
    def dispatch(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return (fused if first is not None and first.is_cuda else plain)(*args, **kwargs)

    dispatch._seqpar_plain = plain
    return dispatch


def rope_in_place(modeling) -> bool:
    """Whether the RoPE that the modeling module ``modeling`` calls (its module-level ``apply_rotary_pos_emb``, looked up
    at call time) may rotate q and k in place: Liger's does, however it was applied (seqpar's dispatcher to it,
    Liger's own patch, transformers' use_liger_kernel); so may any function from outside the modeling module."""
    rope = getattr(modeling, "apply_rotary_pos_emb", None)
    if rope is None:
        return False
    return getattr(rope, "_seqpar_plain", None) is not None or getattr(rope, "__module__", None) != modeling.__name__
