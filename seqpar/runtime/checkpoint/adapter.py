"""A LoRA run's export (the plan's ``workload.lora``): the adapter in peft's layout, and on request the merged model.

The final checkpoint of a LoRA run holds, instead of the whole model (seqpar.runtime.checkpoint.shards.export)::

    adapter/   peft's save_pretrained folder: adapter_config.json, adapter_model.safetensors (the adapters in fp32, their
               training dtype), its model card, and the run's tokenizer; ``PeftModel.from_pretrained(base, folder)``
               loads it onto the base model as it is
    model/     with ``--merge-lora`` only: the merged model (every adapter folded into its base weight by peft's own
               ``merge_and_unload``; a 4-bit base dequantized first) as a save_pretrained folder in the plan's dtype,
               which AutoModelForCausalLM loads as it is (and ``--init-from`` starts a next stage from)

Both are gathered the way the full export is (one tensor at a time, rank 0 keeping the whole): under FSDP2 each
adapter's DTensor, under DeepSpeed its fp32 master (``safe_get_full_fp32_param``). The merge runs on rank 0 in host
memory, on a copy of the model built on the meta device and filled with the gathered tensors (no second allocation),
so the trained model itself is never changed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

ADAPTER_DIR, MODEL_DIR = "adapter", "model"
PEFT_PREFIX = "base_model.model."  # what PeftModel's state dict puts before the transformers model's names


def export_lora(
    tmp: Path,
    *,
    wrapped,
    hf_model,
    adapter,
    dtype: torch.dtype,
    rank: int,
    merge: bool,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
) -> None:
    """Collective: ``tmp/adapter`` (peft's layout) and, with ``merge``, ``tmp/model`` (the merged model in ``dtype``).
    ``adapter`` is peft's PeftModel around ``hf_model``; ``wrapped`` the engine around the loss module."""
    from seqpar.runtime.checkpoint.shards import _deepspeed, save_model, save_tokenizer, trainable_names

    ds = _deepspeed(wrapped)
    if ds is not None:
        lora = ds.trainable_fp32(wrapped)
    else:
        keep = trainable_names(wrapped)
        sd = get_model_state_dict(wrapped, options=StateDictOptions(ignore_frozen_params=True))
        lora = {}
        for name, t in sd.items():
            if name in keep:
                full = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2's DTensor: all-gather this one
                if rank == 0:
                    lora[name] = full.detach().to(device="cpu", dtype=torch.float32, copy=True)
    lora = {k.removeprefix("model."): v for k, v in lora.items()}  # the loss module's prefix
    if rank == 0:
        folder = tmp / ADAPTER_DIR
        adapter.save_pretrained(str(folder), state_dict={PEFT_PREFIX + k: v for k, v in lora.items()})
        save_tokenizer(folder, tokenizer, trust_remote_code)
    if not merge:
        return
    weights = _whole(wrapped, hf_model, rank, ds)
    if rank == 0:
        weights.update(lora)  # the adapters in fp32 (DeepSpeed's module copy may be 16-bit)
        merged = merged_model(hf_model.config, adapter.peft_config[adapter.active_adapter], weights)
        save_model(tmp / MODEL_DIR, merged, {k: v.to(dtype) for k, v in merged.state_dict().items()}, dtype)
        save_tokenizer(tmp / MODEL_DIR, tokenizer, trust_remote_code)


def _whole(wrapped, hf_model, rank: int, ds) -> dict[str, torch.Tensor]:
    """Collective: every weight of the model (base and adapters), whole, as copies on rank 0 ({} elsewhere), keyed as
    the transformers model names them. A 4-bit base (DDP only: every rank holds it whole) is read off rank 0's model,
    dequantized."""
    if any(is_4bit(m) for m in hf_model.modules()):
        return plain_state(hf_model) if rank == 0 else {}
    sd = ds.full_weights(wrapped) if ds is not None else get_model_state_dict(wrapped)
    out = {}
    for name, t in sd.items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if rank == 0:
            out[name.removeprefix("model.")] = full.detach().to(device="cpu", copy=True)
    return out


def merged_model(config, lora_config, weights: dict[str, torch.Tensor]) -> nn.Module:
    """peft's ``merge_and_unload`` of ``weights`` (the transformers model's names, adapters included): the model is
    built on the meta device with ``config``, the adapters put in with ``lora_config``, the tensors assigned (not
    copied), then merged in place. Returns the plain transformers model."""
    import warnings

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from seqpar.plan.errors import SeqparError

    config = copy.deepcopy(config)
    with torch.device("meta"), warnings.catch_warnings():
        # peft asks transformers for is_gradient_checkpointing, deprecated in transformers 5: not this user's call
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        base = AutoModelForCausalLM.from_config(config, trust_remote_code=False)  # the trained model's own config
        skeleton = get_peft_model(base, copy.deepcopy(lora_config))
    missing, unexpected = base.load_state_dict(weights, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise SeqparError(
            f"the merged model's weights do not fit its config (missing {missing[:3]}, unexpected {list(unexpected)[:3]}); "
            "export without --merge-lora and merge the adapter with peft"
        )
    if tied:
        base.tie_weights()
    return skeleton.merge_and_unload()


def is_4bit(module: nn.Module) -> bool:
    """Whether ``module`` is bitsandbytes' Linear4bit (told by name: bitsandbytes is imported only where one exists)."""
    return type(module).__name__ == "Linear4bit"


def dequantized(module: nn.Module) -> torch.Tensor:
    """The weight a bitsandbytes Linear4bit computes with: its NF4 weight dequantized (bitsandbytes' own function)."""
    import bitsandbytes.functional as bnbf

    w = module.weight
    return bnbf.dequantize_4bit(w.data, w.quant_state).to(module.compute_dtype or torch.float32)


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s parameters and persistent buffers on the host by name, a 4-bit weight dequantized (what a
    merge, or a model without bitsandbytes, takes); bitsandbytes' quantization statistics are left out."""
    out = {}
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        for pname, p in module.named_parameters(recurse=False):
            t = dequantized(module) if (is_4bit(module) and pname == "weight") else p.detach()
            out[prefix + pname] = t.to(device="cpu", copy=True)
        for bname, b in module.named_buffers(recurse=False):
            if b is not None and bname not in module._non_persistent_buffers_set:
                out[prefix + bname] = b.detach().to(device="cpu", copy=True)
    return out


__all__ = ["ADAPTER_DIR", "MODEL_DIR", "dequantized", "export_lora", "is_4bit", "merged_model", "plain_state"]
