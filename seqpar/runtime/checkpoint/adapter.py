"""A LoRA run's export (the plan's ``workload.lora``): the adapter in peft's layout, and on request the merged model.

The final checkpoint of a LoRA run holds, instead of the whole model (seqpar.runtime.checkpoint.shards.export)::

    adapter/   peft's save_pretrained folder: adapter_config.json, adapter_model.safetensors (the adapters in fp32, their
               training dtype), its model card, and the run's tokenizer; ``PeftModel.from_pretrained(base, folder)``
               loads it onto the base model as it is
    model/     with ``--merge-lora`` only: the merged model (every adapter folded into its base weight by peft's own
               ``merge_and_unload``; into a 4-bit base's weight dequantized, with the same arithmetic, by
               ``save_merged_4bit``) as a save_pretrained folder in the plan's dtype,
               which AutoModelForCausalLM loads as it is (and ``--init-from`` starts a next stage from)

Both are gathered the way the full export is (one tensor at a time, rank 0 keeping the whole): under FSDP2 each
adapter's DTensor, under DeepSpeed its fp32 master (``safe_get_full_fp32_param``). The merge runs on rank 0 in host
memory, on a copy of the model built on the meta device and filled with the gathered tensors (no second allocation),
so the trained model itself is never changed. A 4-bit base (DDP only, whole on every rank) is merged without a whole
copy: ``save_merged_4bit`` writes the live model one shard at a time, the shards divided among the ranks, each tensor
made on the model's device as its shard is written (the same bits as that path on the same weights).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from seqpar.plan.errors import SeqparError

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
    if any(is_4bit(m) for m in hf_model.modules()):  # DDP only: every rank holds the whole 4-bit base and the adapters
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        save_merged_4bit(tmp / MODEL_DIR, hf_model, adapter.active_adapter, dtype, rank=rank, world=world)
        if rank == 0:
            save_tokenizer(tmp / MODEL_DIR, tokenizer, trust_remote_code)
        return
    weights = _whole(wrapped, hf_model, rank, ds)
    if rank == 0:
        weights.update(lora)  # the adapters in fp32 (DeepSpeed's module copy may be 16-bit)
        merged = merged_model(hf_model.config, adapter.peft_config[adapter.active_adapter], weights)
        save_model(tmp / MODEL_DIR, merged, {k: v.to(dtype) for k, v in merged.state_dict().items()}, dtype)
        save_tokenizer(tmp / MODEL_DIR, tokenizer, trust_remote_code)


def _whole(wrapped, hf_model, rank: int, ds) -> dict[str, torch.Tensor]:
    """Collective: every weight of the model (base and adapters), whole, as copies on rank 0 ({} elsewhere), keyed as
    the transformers model names them."""
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


MERGED_SHARD_SIZE = "5GB"  # the streamed merge's shards (the size of the Hub's Llama checkpoints): rank 0's host holds one


def save_merged_4bit(
    folder: Path, hf_model: nn.Module, adapter_name: str, dtype: torch.dtype, *, rank: int = 0, world: int = 1
) -> None:
    """The merged model of a 4-bit (QLoRA) run written into ``folder`` one safetensors shard at a time, so a host never
    holds more than a shard (a Llama-3.3-70B merged in bf16 is 141 GB: more than a 125 GiB host). Every rank of a DDP
    job holds the whole 4-bit base and the same adapters, so rank ``rank`` of ``world`` writes every world-th shard
    (the work divided, and no rank idles at the checkpoint's barrier while one writes it all); rank 0 the index and
    config. ``folder`` is the checkpoint's temporary folder, renamed into place only when every rank is done.

    The shards are the transformers model's own names and shapes (the model built from the run's config on the meta
    device), split by huggingface_hub's ``split_torch_state_dict_into_shards`` as ``save_pretrained`` splits them, with
    its index file and the config.json save_pretrained writes (its ``architectures`` set, ``dtype`` stated). Each tensor
    is made where the model lives (its GPU) when its shard is written: an adapted linear layer's weight is its NF4
    weight dequantized (``dequantized``) plus the adapter's delta, B @ A times the scaling computed from the adapters
    in fp32 (peft's ``get_delta_weight``) and added in place in the dequantized weight's dtype, as peft's
    ``merge_and_unload`` adds it (lora.Linear.merge; a test checks the files equal that path's bit for bit on CPU); a
    4-bit layer without an adapter is its weight dequantized; the rest is read off the model; all cast to ``dtype``. A
    head tied to the embeddings is left out, as save_pretrained leaves it out."""
    import warnings

    from huggingface_hub import constants, split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from seqpar.plan.files import write_atomic
    from seqpar.runtime.checkpoint.shards import state_dtype

    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        plain = AutoModelForCausalLM.from_config(copy.deepcopy(hf_model.config), trust_remote_code=False)
    tied = getattr(hf_model.config, "tie_word_embeddings", False)
    shapes = {
        n: torch.empty(t.shape, dtype=dtype, device="meta")
        for n, t in plain.state_dict().items()
        if not (tied and n == "lm_head.weight")
    }
    split = split_torch_state_dict_into_shards(shapes, max_shard_size=MERGED_SHARD_SIZE)
    folder.mkdir(parents=True, exist_ok=True)
    for filename, names in list(split.filename_to_tensors.items())[rank::world]:
        shard = {n: _merged_tensor(hf_model, n, adapter_name).to(device="cpu", dtype=dtype).contiguous() for n in names}
        save_file(shard, str(folder / filename), metadata={"format": "pt"})
        del shard
    if rank != 0:
        return
    if split.is_sharded:
        total = {"total_size": sum(t.nbytes for t in shapes.values()), "total_parameters": plain.num_parameters()}
        index = {"metadata": {**split.metadata, **total}, "weight_map": split.tensor_to_filename}
        write_atomic(folder / constants.SAFETENSORS_INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
    plain.config.architectures = [type(plain).__name__]  # as save_pretrained sets it (vLLM and TGI pick the class by it)
    plain.config.save_pretrained(str(folder))
    state_dtype(folder, dtype)
    if plain.can_generate() and plain.generation_config is not None:
        plain.generation_config.save_pretrained(str(folder))


def _merged_tensor(hf_model: nn.Module, name: str, adapter_name: str) -> torch.Tensor:
    """The merged model's tensor ``name`` (the transformers model's name) from ``hf_model`` (adapters in it)."""
    path, _, leaf = name.rpartition(".")
    module = hf_model.get_submodule(path)
    if hasattr(module, "lora_A") and adapter_name in module.lora_A:  # peft's LoRA layer around the base linear
        base = module.get_base_layer()
        if leaf != "weight":
            return getattr(base, leaf).detach()
        variant = getattr(module, "lora_variant", {}).get(adapter_name)  # peft >= 0.16; use_dora before it
        if variant is not None or getattr(module, "use_dora", {}).get(adapter_name) or getattr(module, "fan_in_fan_out", False):
            raise SeqparError(  # seqpar's plans put only vanilla adapters in; a model changed by hand may not
                f"{name}: a LoRA variant (DoRA, fan_in_fan_out) cannot be merged into a 4-bit base here; export "
                "without --merge-lora and merge the adapter with peft"
            )
        w = dequantized(base) if is_4bit(base) else base.weight.detach().clone()
        a, b = module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight
        w += (b.detach().float() @ a.detach().float()) * module.scaling[adapter_name]  # peft's get_delta_weight
        return w
    if is_4bit(module) and leaf == "weight":
        return dequantized(module)
    return getattr(module, leaf).detach()


def is_4bit(module: nn.Module) -> bool:
    """Whether ``module`` is bitsandbytes' Linear4bit (told by name: bitsandbytes is imported only where one exists)."""
    return type(module).__name__ == "Linear4bit"


def dequantized(module: nn.Module) -> torch.Tensor:
    """The weight a bitsandbytes Linear4bit computes with: its NF4 weight dequantized (bitsandbytes' own function)."""
    import bitsandbytes.functional as bnbf

    w = module.weight
    return bnbf.dequantize_4bit(w.data, w.quant_state).to(module.compute_dtype or torch.float32)


__all__ = [
    "ADAPTER_DIR",
    "MODEL_DIR",
    "dequantized",
    "export_lora",
    "is_4bit",
    "merged_model",
    "save_merged_4bit",
]
