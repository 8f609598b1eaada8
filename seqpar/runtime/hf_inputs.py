"""Per-rank inputs for a sequence-parallel step, and the EasyContext-compatible entry points.

``prepare_inputs`` shifts the labels over the whole sequence first (so the token at a shard's edge is still predicted
from its true successor), builds global position ids (RoPE must see the token's position in the full sequence), then
splits input ids, position ids and labels with ``seqpar.runtime.layout.shard`` in the mode's layout. Tensors are
(B, S) on the way in and (B, S_local) on the way out.

EasyContext (jzhang38/EasyContext) scripts switch by changing their import: ``prepare_seq_parallel_inputs`` returns
the same dict keys and the same slices (EasyContext slices the already-shifted target ids it is given), and
``apply_seq_parallel_monkey_patch`` accepts a model instance or EasyContext's "llama"/"mistral".
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqpar.errors import SeqparError
from seqpar.modes import check_mode
from seqpar.runtime.layout import shard

IGNORE_INDEX = -100  # transformers' and torch's cross-entropy ignore index


def shift_labels(labels: Tensor) -> Tensor:
    """(B, S) labels in transformers' convention (label i = token i) -> target of position i = label i+1; last -100."""
    pad = labels.new_full((labels.shape[0], 1), IGNORE_INDEX)  # (B, 1)
    return torch.cat([labels[:, 1:], pad], dim=1)  # (B, S)


def _check_ids(input_ids: Tensor, mode: str, rank: int, world_size: int) -> None:
    check_mode(mode)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise SeqparError(f"input_ids {shape} must be a (batch, seq_len) tensor; add a batch dim with input_ids[None]")
    if not 0 <= rank < world_size:
        raise SeqparError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")


def _check_positions(position_ids: Tensor) -> None:
    # The kernels apply one causal mask over the whole row: positions restarting mean packed documents, which
    # transformers would mask per document, so the results would differ. Refuse rather than train on the wrong mask.
    steps = torch.diff(position_ids, dim=-1)  # (B, S-1)
    if steps.numel() and not bool((steps == 1).all()):
        where = int((steps != 1).nonzero()[0, -1]) + 1
        raise SeqparError(
            f"position_ids do not increase by 1 at index {where} (packed documents?); seqpar applies one causal mask "
            "per row, so pass one document per row with consecutive positions"
        )


def prepare_inputs(input_ids: Tensor, mode: str, rank: int, world_size: int, labels: Tensor | None = None,
                   position_ids: Tensor | None = None, ulysses_degree: int | None = None) -> dict[str, Tensor]:
    """This rank's {"input_ids", "position_ids", "labels"} (each (B, S_local)) of a full (B, S) batch.

    labels: transformers' convention (unshifted; default input_ids); they are shifted over the whole sequence here, so
    call the model without labels and compute the loss with seqpar.loss. position_ids: global, default 0..S-1.
    Lengths the mode cannot split raise SeqparError with the nearest valid lengths."""
    _check_ids(input_ids, mode, rank, world_size)
    batch, seq_len = input_ids.shape
    if labels is None:
        labels = input_ids
    if labels.shape != input_ids.shape:
        raise SeqparError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device)[None]  # (1, S)
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.shape[-1] != seq_len:
        raise SeqparError(f"position_ids {tuple(position_ids.shape)} must have seq_len {seq_len} like input_ids")
    _check_positions(position_ids)
    position_ids = position_ids.expand(batch, seq_len)  # (B, S)
    full = {"input_ids": input_ids, "position_ids": position_ids, "labels": shift_labels(labels)}
    return {k: shard(v, mode, rank, world_size, dim=1, ulysses_degree=ulysses_degree) for k, v in full.items()}


def prepare_seq_parallel_inputs(seq_algo: str, input_ids: Tensor, position_ids: Tensor, target_ids: Tensor | None,
                                rank: int, world_size: int, device, ulysses_degree: int | None = None) -> dict:
    """EasyContext's function: {"local_input_ids", "local_position_ids", "local_target_ids"} on ``device``.

    target_ids are already shifted (EasyContext's input = ids[:S], target = ids[1:S+1]) and are sliced like the inputs;
    None stays None. zigzag_ring_attn: chunks r and 2W-1-r of 2W; dist_flash_attn and ulysses_attn: contiguous chunk r;
    data_parallel: everything. Unlike EasyContext, a length the mode cannot split is an error (nearest valid lengths),
    not a silently dropped remainder or uneven chunks. usp_attn (not in EasyContext) needs ulysses_degree."""
    _check_ids(input_ids, seq_algo, rank, world_size)

    def local(x: Tensor | None) -> Tensor | None:
        if x is None:
            return None
        return shard(x, seq_algo, rank, world_size, dim=1, ulysses_degree=ulysses_degree).to(device)

    return {
        "local_input_ids": local(input_ids),
        "local_position_ids": local(position_ids),
        "local_target_ids": local(target_ids),
    }


# model class names EasyContext's string form patches; models constructed afterwards get seqpar.apply(mode)
_EASYCONTEXT_FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
_PATCHED_MODE: dict[type, str] = {}


def _patch_class(cls: type, mode: str) -> None:
    """Make every new instance of cls run seqpar's attention: the config is switched before transformers' own
    __init__ validates it (so an EasyContext script's attn_implementation="flash_attention_2" is replaced instead of
    failing on a machine without flash-attn), and seqpar.apply runs right after."""
    from seqpar.runtime.hf import IMPLEMENTATIONS, _register, apply

    _PATCHED_MODE[cls] = mode
    if getattr(cls.__init__, "_seqpar_wrapped", False):
        return
    original = cls.__init__

    def __init__(self, config, *args, **kwargs):
        patched = _PATCHED_MODE.get(type(self))
        if patched is not None:
            _register(IMPLEMENTATIONS[patched])
            config._attn_implementation_internal = IMPLEMENTATIONS[patched]
        original(self, config, *args, **kwargs)
        if patched is not None:
            apply(self, patched)

    __init__._seqpar_wrapped = True
    __init__.__wrapped__ = original
    cls.__init__ = __init__
    autoset = getattr(cls, "_autoset_attn_implementation", None)
    if autoset is not None:  # 4.x: from_pretrained validates the request before __init__; switch it there too
        def _autoset_attn_implementation(klass, config, *args, **kwargs):
            patched = _PATCHED_MODE.get(klass)
            if patched is not None:
                _register(IMPLEMENTATIONS[patched])
                config._attn_implementation_internal = IMPLEMENTATIONS[patched]
            return autoset.__func__(klass, config, *args, **kwargs)

        cls._autoset_attn_implementation = classmethod(_autoset_attn_implementation)


def apply_seq_parallel_monkey_patch(seq_algo: str, model):
    """EasyContext's function. ``model`` a model instance: seqpar.apply(model, seq_algo) (the default process group),
    returned. ``model`` "llama" or "mistral": every LlamaForCausalLM / MistralForCausalLM created afterwards in this
    process (from_pretrained, from_config, AutoModelForCausalLM) runs seq_algo; returns None like EasyContext."""
    check_mode(seq_algo, "seq_algo")
    if not isinstance(model, str):
        from seqpar.runtime.hf import apply

        return apply(model, seq_algo)
    family = model.lower()
    if family not in _EASYCONTEXT_FAMILIES:
        raise SeqparError(
            f"model {model!r} is not one of EasyContext's names ({', '.join(_EASYCONTEXT_FAMILIES)}); pass the model "
            "instance instead: any transformers causal LM that uses the AttentionInterface works"
        )
    import transformers

    _patch_class(getattr(transformers, _EASYCONTEXT_FAMILIES[family]), seq_algo)
    return None
