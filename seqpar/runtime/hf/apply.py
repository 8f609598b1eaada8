"""The transformers integration: any Hugging Face causal LM that uses the AttentionInterface, in any seqpar mode.

``apply(model, mode)`` registers the mode's sequence-parallel attention with transformers' ``AttentionInterface`` (and a
mask function with ``AttentionMaskInterface``, so no mask is ever materialised: causality comes from the kernels) and
switches the model to it. Only the attention call changes: the model's own projections, RoPE, q/k norms and MLPs run as
they are, on this rank's shard of the sequence (RoPE is right because the shard carries global position ids, see
``prepare_inputs``). Features a mode cannot reproduce exactly are refused with a SeqparError naming the model and the
feature: a model that bypasses the interface, sliding windows shorter than the sequence, logit soft-capping, attention
dropout, padding masks and attention biases.

Packed documents reach the attention function the way transformers passes them to its own varlen kernels (it forwards
the model's keyword arguments to attention functions, 4.48+ and 5.x): ``cu_seq_lens_q``/``cu_seq_lens_k`` when the
caller passes them (read as seqpar's GLOBAL boundaries over the unsharded row: seqpar.prepare_inputs returns them as
"cu_seqlens"), else the ``position_ids`` every layer receives, restarting at 0 at each document. Those are this rank's
shard, so the group gathers them once per forward (cached on the tensor for every layer and the recomputation) and
derives the boundaries of the whole row; one document per row is the plain causal path.

Layouts: transformers hands the attention function q (B, Hq, S, D), k/v (B, Hkv, S, D) after RoPE and expects
(out (B, S, Hq, D), weights); seqpar.runtime.parallel.attention speaks (B, S, H, D), so only transposed views cross the boundary.

Works on transformers 5.x and on 4.48+ (4.x before 4.53 has no AttentionMaskInterface: there the model builds its local
causal mask itself and the attention function ignores it; padding is still refused by a pre-hook on the model).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import check_mode, degrees, describe, names, takes_ulysses_degree
from seqpar.runtime.memory.activation_checkpoint import apply_checkpointing, decoder_layers, from_deprecated, policy

__all__ = ["apply", "implementations", "register"]


def implementations() -> dict[str, str]:
    """Each registered mode's attn_implementation name (seqpar.plan.modes: never containing "flash", which transformers 5
    reads as a hub kernel request), read when asked for, so modes registered later are in it."""
    return {m: describe(m).implementation for m in names()}


@dataclass(frozen=True)
class _Context:
    """What the attention function needs and cannot get from transformers; stored on every module of the model."""

    mode: str
    group: Any  # torch.distributed ProcessGroup or None (the default group)
    ulysses_degree: int | None
    backend: str | None
    model_name: str
    sliding_window: int | None  # the config's active window, checked against the global length at run time
    keep_attention: bool = False  # selective checkpointing: seqpar.runtime.memory.selective keeps out + lse per layer


@functools.cache
def _has_mask_interface() -> bool:
    try:
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401  (4.53+)
    except ImportError:
        return False
    return True


def _refuse(model_name: str, feature: str, fix: str) -> Exception:
    return SeqparError(f"{model_name}: {feature} cannot run under seqpar's sequence-parallel attention; {fix}")


def _global_len(ctx: _Context, local_len: int) -> int:
    if describe(ctx.mode).layout == "whole":  # data_parallel: every rank holds whole sequences
        return local_len
    import torch.distributed as dist

    return local_len * (dist.get_world_size(ctx.group) if dist.is_initialized() else 1)


def _seqpar_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: q (B, Hq, S, D), k/v (B, Hkv, S, D) -> (out (B, S, Hq, D), None)."""
    ctx: _Context | None = getattr(module, "_seqpar_ctx", None)
    if ctx is None:
        raise SeqparError(
            f"{type(module).__name__} reached seqpar's attention without seqpar.apply; call seqpar.apply(model, mode) "
            "on the whole model (it sets the mode, the group and the checks)"
        )
    name = ctx.model_name
    if attention_mask is not None and _has_mask_interface():
        raise _refuse(
            name,
            "an attention mask or bias (padding, packed documents or a custom 4D mask)",
            "pass attention_mask=None with one unpadded document per row",
        )
    if kwargs.get("softcap") is not None:
        raise _refuse(
            name,
            f"attention logit soft-capping (softcap={kwargs['softcap']})",
            "train it without seqpar (plain transformers eager attention)",
        )
    if kwargs.get("s_aux") is not None:
        raise _refuse(name, "attention sinks (s_aux)", "use a model without attention sinks")
    if dropout and module.training:
        raise _refuse(name, f"attention dropout {dropout}", "set config.attention_dropout = 0.0")
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        raise _refuse(name, "bidirectional (non-causal) attention", "seqpar trains causal language models only")
    if key.shape[2] != query.shape[2]:
        raise _refuse(
            name,
            f"a KV cache ({key.shape[2]} keys for {query.shape[2]} queries, as in generation)",
            "call the model with use_cache=False; generate with a plain copy of the model",
        )
    window = kwargs.get("sliding_window") or ctx.sliding_window
    total = _global_len(ctx, query.shape[2])
    if window is not None and window < total:
        raise _refuse(
            name,
            f"sliding window attention (window {window} < sequence length {total})",
            f"set config.sliding_window = None for full attention, or train at most {window} tokens",
        )
    from seqpar.runtime.hf.documents import boundaries
    from seqpar.runtime.memory.selective import kept_attention
    from seqpar.runtime.parallel.attention import attention

    cu = boundaries(ctx, kwargs, query.shape[0], query.shape[2])  # packed documents, or None
    # (B, S, H, D). v is usually already contiguous that way (a projection viewed and transposed); q and k after
    # RoPE are not, and ring/all-to-all buffers must be, so they are copied once here.
    q, k, v = _common_dtype(*(t.transpose(1, 2).contiguous() for t in (query, key, value)))
    kw = dict(
        group=ctx.group, causal=True, softmax_scale=scaling, ulysses_degree=ctx.ulysses_degree, backend=ctx.backend, cu_seqlens=cu
    )
    if ctx.keep_attention:  # the recomputation in backward gets out from the first forward (seqpar.runtime.memory.selective)
        out, _lse = kept_attention(module, q, k, v, ctx.mode, **kw)  # out (B, S, Hq, D)
    else:
        out, _lse = attention(q, k, v, ctx.mode, **kw)
    return out, None


def _no_mask(
    batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs
):
    """AttentionMaskInterface function: never builds a mask; refuses a 2D mask with padding in it."""
    if attention_mask is not None and not bool(attention_mask.all()):
        config = kwargs.get("config")
        name = getattr(config, "model_type", "the model") if config is not None else "the model"
        raise _refuse(name, "a padding attention_mask (it has zeros)", "pass unpadded rows and attention_mask=None")
    return None


def _refuse_padding_hook(model_name: str):
    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if isinstance(mask, torch.Tensor) and (mask.dim() != 2 or not bool(mask.all())):
            raise _refuse(
                model_name, "an attention_mask with padding or a 4D mask/bias", "pass unpadded rows and attention_mask=None"
            )
        return None

    return hook


def register(name: str) -> None:
    """Register seqpar's attention (and its no-mask function) with transformers under the implementation ``name``."""
    try:
        from transformers import AttentionInterface  # 4.50+

        AttentionInterface.register(name, _seqpar_attention)
    except ImportError:  # 4.48/4.49: a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = _seqpar_attention
    if _has_mask_interface():
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(name, _no_mask)


def _active_sliding_window(config) -> int | None:
    """The window some layer applies, or None: layer_types (5.x, late 4.x) first, then use_sliding_window (Qwen2)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if getattr(config, "use_sliding_window", None) is False:
        return None
    return window


def _uses_attention_interface(model: nn.Module) -> bool:
    """transformers' own flag where it exists (PreTrainedModel defines it, False by default); before it (4.48/4.49)
    the modeling module importing ALL_ATTENTION_FUNCTIONS is the sign that its attention dispatches through it."""
    from transformers import PreTrainedModel

    if hasattr(PreTrainedModel, "_supports_attention_backend"):
        return bool(getattr(type(model), "_supports_attention_backend", False))
    return hasattr(sys.modules.get(type(model).__module__), "ALL_ATTENTION_FUNCTIONS")


def apply(
    model: nn.Module,
    mode: str,
    group=None,
    ulysses_degree: int | None = None,
    *,
    checkpointing: str | None = None,
    checkpoint_layers: int | None = None,
    offload_layers: int | None = None,
    kept_saves: str = "all",
    kept_host_layers: int = 0,
    pinned_budget_gib: float | None = None,
    offload_stride: int = 1,
    backend: str | None = None,
    offload_checkpoints: bool | None = None,
    keep_attention: bool | None = None,
) -> nn.Module:
    """Switch a transformers causal LM to the mode's sequence-parallel attention (in place; returns the model).

    group: the sequence-parallel process group (None = the default group). ulysses_degree: usp_attn's Ulysses degree.
    checkpointing: none | full | offload | selective (seqpar.runtime.memory.activation_checkpoint); None leaves the model's own
    setting (e.g. your gradient_checkpointing_enable()) as it is. offload keeps each layer's input in pinned host memory;
    selective keeps each layer's attention out + lse, so backward's recomputation skips attention's forward.
    checkpoint_layers: the policy applies to the first k decoder layers, the rest keep all their activations (None = all);
    offload_layers: under offload, the first k checkpointed layers send their input to host memory, the others keep it
    on the GPU (None = all); offload_stride k: of those, only the first and every k-th after it send their input to host
    memory, backward recomputes the others' from them (1 = each its own). kept_saves "matmuls": the layers past
    checkpoint_layers keep only their matmul outputs and attention's out + lse (the elementwise ops recomputed in
    backward), ``kept_host_layers`` of them (spread over those layers: seqpar.plan.options.LayerSplit.host_kept) in page-locked host memory (seqpar.runtime.memory.matmul_keep). pinned_budget_gib: page-locked host GiB this process may hold
    for both (a plan's ClusterSpec.stated_pinned_gib_per_rank; None = 40% of the host's RAM shared by the node's ranks,
    or SEQPAR_PINNED_BUDGET_GIB).
    backend: kernels backend override (see seqpar.runtime.parallel.kernels.select_backend). offload_checkpoints=True and
    keep_attention=True are the deprecated spellings of checkpointing="offload" and "selective"."""
    check_mode(mode)
    checkpointing = from_deprecated(checkpointing, offload_checkpoints, keep_attention)
    keep = policy(checkpointing).keep_attention if checkpointing is not None else False  # validates the name first
    if checkpointing is None and (
        checkpoint_layers is not None
        or offload_layers is not None
        or kept_saves != "all"
        or kept_host_layers
        or offload_stride != 1
    ):
        raise SeqparError(
            f"checkpoint_layers={checkpoint_layers}, offload_layers={offload_layers}, offload_stride={offload_stride}, "
            f"kept_saves={kept_saves!r}, kept_host_layers={kept_host_layers} split the layers between checkpointing "
            "policies, but checkpointing is None (the model's own setting); pass checkpointing='full', 'selective' or "
            "'offload'"
        )
    config = getattr(model, "config", None)
    name = f"{type(model).__name__} ({getattr(config, 'model_type', '?')})"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise _refuse(
            name,
            f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})",
            "use a model without soft-capping",
        )
    if config is None or not _uses_attention_interface(model):
        raise _refuse(
            name,
            "attention that does not go through transformers' AttentionInterface",
            "use a model whose modeling code calls ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Qwen2, Qwen3, ...)",
        )
    if ulysses_degree is not None or takes_ulysses_degree(mode):
        import torch.distributed as dist

        if dist.is_initialized():  # validates the degrees now rather than at the first forward
            degrees(mode, dist.get_world_size(group), ulysses_degree)

    impl = describe(mode).implementation
    register(impl)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # 4.x before set_attn_implementation
        config._attn_implementation = impl
    if getattr(model.config, "_attn_implementation", None) != impl:
        raise _refuse(
            name,
            "attention that transformers cannot switch dynamically",
            "use a model that supports set_attn_implementation (AttentionInterface-based modeling code)",
        )

    ctx = _Context(mode, group, ulysses_degree, backend, name, _active_sliding_window(config), keep)
    for module in model.modules():
        object.__setattr__(module, "_seqpar_ctx", ctx)  # plain attribute: not a parameter, buffer or submodule
    if not getattr(model, "_seqpar_hooked", False):
        model.register_forward_pre_hook(_refuse_padding_hook(name), with_kwargs=True)
        model._seqpar_hooked = True

    if checkpointing is not None:
        apply_checkpointing(
            model,
            checkpointing,
            checkpoint_layers,
            offload_layers,
            kept_saves,
            kept_host_layers,
            pinned_budget_gib=pinned_budget_gib,
            offload_stride=offload_stride,
        )
        if (keep and checkpoint_layers is not None) or kept_saves == "matmuls":
            _keep_where_recomputed(model, ctx)
    return model


def _keep_where_recomputed(model: nn.Module, ctx: _Context) -> None:
    """Selective keeps attention's out + lse for a layer's recomputation; a layer past checkpoint_layers recomputes
    nothing, so its attention runs the plain path: no kept entry, no fingerprint of q (seqpar.runtime.memory.selective). A
    layer that keeps its matmul outputs (kept_saves matmuls) recomputes around attention, so it keeps out + lse under
    any policy."""
    from seqpar.runtime.memory.matmul_keep import MatmulKeep

    plain, kept = replace(ctx, keep_attention=False), replace(ctx, keep_attention=True)
    for layer in decoder_layers(model):
        matmuls = isinstance(getattr(layer, "_gradient_checkpointing_func", None), MatmulKeep)
        if matmuls or not layer.gradient_checkpointing:
            for module in layer.modules():
                object.__setattr__(module, "_seqpar_ctx", kept if matmuls else plain)


def _common_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One dtype for the kernels. Under autocast, RoPE's fp32 cos/sin promote q and k to fp32 while v stays in the
    autocast dtype; a mixed call would fall back to the exact fp32 kernel (S x S scores). Cast to the autocast dtype then,
    to v's dtype (the projections') otherwise."""
    dev = q.device.type
    target = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else v.dtype
    return tuple(t if t.dtype == target else t.to(target) for t in (q, k, v))
