"""EasyContext (jzhang38/EasyContext) compatibility: its two entry points, so its scripts switch by changing an import.

``prepare_seq_parallel_inputs`` returns the same dict keys and the same slices as EasyContext's (it slices the
already-shifted target ids it is given), and ``apply_seq_parallel_monkey_patch`` accepts a model instance or
EasyContext's "llama"/"mistral" (every such model created afterwards runs the mode). Both are ``seqpar.<name>``.
"""

from __future__ import annotations

from torch import Tensor

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import check_mode, describe
from seqpar.runtime.hf.apply import apply, register
from seqpar.runtime.parallel.inputs import check_ids
from seqpar.runtime.parallel.layout import shard


def prepare_seq_parallel_inputs(
    seq_algo: str,
    input_ids: Tensor,
    position_ids: Tensor,
    target_ids: Tensor | None,
    rank: int,
    world_size: int,
    device,
    ulysses_degree: int | None = None,
) -> dict:
    """EasyContext's function: {"local_input_ids", "local_position_ids", "local_target_ids"} on ``device``.

    target_ids are already shifted (EasyContext's input = ids[:S], target = ids[1:S+1]) and are sliced like the inputs;
    None stays None. zigzag_ring_attn: chunks r and 2W-1-r of 2W; dist_flash_attn and ulysses_attn: contiguous chunk r;
    data_parallel: everything. Unlike EasyContext, a length the mode cannot split is an error (nearest valid lengths),
    not a silently dropped remainder or uneven chunks. usp_attn (not in EasyContext) needs ulysses_degree."""
    check_ids(input_ids, seq_algo, rank, world_size)

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
    _PATCHED_MODE[cls] = mode
    if getattr(cls.__init__, "_seqpar_wrapped", False):
        return
    original = cls.__init__

    def __init__(self, config, *args, **kwargs):
        patched = _PATCHED_MODE.get(type(self))
        if patched is not None:
            register(describe(patched).implementation)
            config._attn_implementation_internal = describe(patched).implementation
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
                register(describe(patched).implementation)
                config._attn_implementation_internal = describe(patched).implementation
            return autoset.__func__(klass, config, *args, **kwargs)

        cls._autoset_attn_implementation = classmethod(_autoset_attn_implementation)


def apply_seq_parallel_monkey_patch(seq_algo: str, model):
    """EasyContext's function. ``model`` a model instance: seqpar.apply(model, seq_algo) (the default process group),
    returned. ``model`` "llama" or "mistral": every LlamaForCausalLM / MistralForCausalLM created afterwards in this
    process (from_pretrained, from_config, AutoModelForCausalLM) runs seq_algo; returns None like EasyContext."""
    check_mode(seq_algo, "seq_algo")
    if not isinstance(model, str):
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
