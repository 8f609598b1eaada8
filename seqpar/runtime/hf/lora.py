"""LoRA and QLoRA on a transformers model: the plan's ``workload.lora`` (seqpar.plan.specs.LoraSpec), applied through peft.

``apply_lora(model, spec, seed=...)`` injects peft's LoRA layers into ``model`` in place and returns the PeftModel around
it (what writes the adapter: seqpar.runtime.checkpoint.adapter). The model object stays the transformers model the rest
of seqpar works on: seqpar.apply switches its attention, the memory features wrap its layers and MLPs, the engines wrap
it inside the trainer's LossModule. peft freezes every base parameter; the adapters (lora_A (rank, in) and lora_B
(out, rank) beside each targeted linear layer) are the only parameters that require grad, so the optimizer, the
gradient reduction and the checkpoint hold them alone. peft keeps adapters in fp32 over a 16-bit base
(``autocast_adapter_dtype``): their updates are AdamW's fp32 ones, while the frozen base needs no fp32 copy.

QLoRA (``base_dtype: nf4``): before the adapters go in (or while the model is built, layer by layer:
seqpar.runtime.hf.quantized_build, which the trainer uses so that a 70B base never exists whole in bf16; apply_lora then
finds the layers quantized and only adds the adapters), every linear layer of the decoder blocks (q k v o gate up down,
targeted or not; embeddings, norms and the output head stay as they are, as in QLoRA and transformers' bitsandbytes
quantizer) becomes bitsandbytes' ``Linear4bit`` holding its weight as NF4 with double-quantized block scales (blocks of
64: bitsandbytes' defaults, QLoRA's recipe, Dettmers et al. 2023, arXiv:2305.14314). Its forward dequantizes the weight
to the compute dtype and multiplies: the model computes exactly what the same model with the dequantized weights
computes (tests/runtime/parallel/test_lora_exact.py checks it). bitsandbytes quantizes on the device the layer is moved
to; its CPU backend quantizes and dequantizes NF4 too (bitsandbytes 0.50, the ``qlora`` extra's floor), so QLoRA runs
on CPU ranks as on GPUs (in training mode: in eval mode, on a CPU with AVX512-BF16, bitsandbytes repacks the weight
for a bf16 inference kernel instead). Every rank quantizes the same weights itself (quantization is deterministic): a
4-bit base is never broadcast.

Randomness: the adapters' initial values (peft draws lora_A, lora_B starts at zero) come from a generator seeded with
the run's seed, so ranks that build their own model (DeepSpeed, a 4-bit base) hold the same adapters.
"""

from __future__ import annotations

import torch
from torch import nn

from seqpar.plan.errors import SeqparError
from seqpar.plan.extras import require
from seqpar.plan.specs import LORA_ALL_LINEAR, LoraSpec
from seqpar.runtime.checkpoint.adapter import is_4bit


def lora_config(spec: LoraSpec):
    """peft's LoraConfig for ``spec`` (a causal LM, no bias training: only lora_A and lora_B train)."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(
    model: nn.Module,
    spec: LoraSpec,
    *,
    seed: int,
    device=None,
    compute_dtype: torch.dtype | None = None,
    adapter_dtype: torch.dtype | None = None,
):
    """Put ``spec``'s adapters into ``model`` (in place; a 4-bit base first when ``spec.base_dtype`` is nf4, quantized on
    ``device`` with ``compute_dtype`` its matmul dtype, unless it was built quantized); returns peft's PeftModel around ``model``. peft keeps the
    adapters in fp32; ``adapter_dtype`` casts them (a plan without fp32 states or autocast, optimizer adamw-bf16 or
    none: fp32 adapters there would each cast and save an fp32 copy of their input, which the cost model does not
    count for those plans, seqpar.advisor.cost.lora.regime)."""
    require("peft", "workload.lora (LoRA adapters)")
    _quiet_bitsandbytes()
    if spec.base_dtype == "nf4":
        quantize_base(model, device=device, compute_dtype=compute_dtype)
    name = f"{type(model).__name__} ({getattr(getattr(model, 'config', None), 'model_type', '?')})"
    present = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_4bit(m)}
    absent = [m for m in spec.target_modules if m not in present]
    if absent:
        raise SeqparError(
            f"{name} has no linear layer named {absent[0]!r} for workload.lora.target_modules; target some of "
            f"{' '.join(m for m in LORA_ALL_LINEAR if m in present)}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft_model(model, lora_config(spec))
    if adapter_dtype is not None:
        for prm in wrapped.parameters():
            if prm.requires_grad and prm.dtype != adapter_dtype:
                prm.data = prm.data.to(adapter_dtype)
    return wrapped


def peft_model(model: nn.Module, config):
    """peft's ``get_peft_model(model, config)``, without two notes that concern neither the run nor its user: peft
    asks transformers for ``is_gradient_checkpointing`` (deprecated in transformers 5 for the name seqpar's
    activation_checkpoint already uses), and bitsandbytes, which peft imports where it is installed, tries a Hub kernel
    for one-token CPU decoding at import and warns when it cannot (offline, or an untrusted repository)."""
    import warnings

    _quiet_bitsandbytes()
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def _quiet_bitsandbytes() -> None:
    """Before bitsandbytes is imported (peft imports it where it is installed): drop its import-time note about the Hub
    kernel it could not load (see peft_model)."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_no_hub_kernel_note)


def _no_hub_kernel_note(record) -> bool:
    return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


def quantize_base(model: nn.Module, *, device=None, compute_dtype: torch.dtype | None = None) -> int:
    """Replace every linear layer of the decoder blocks with bitsandbytes' NF4 Linear4bit holding the same weight
    (bitsandbytes' own modules: ``Params4bit`` quantizes when moved to ``device``); returns how many were replaced.
    Layers already 4-bit are left as they are: a base built quantized (seqpar.runtime.hf.quantized_build, which calls
    this on one decoder layer at a time) has none left to replace."""
    require("bitsandbytes", "workload.lora.base_dtype nf4 (a 4-bit QLoRA base)")
    _quiet_bitsandbytes()
    import bitsandbytes as bnb

    found = [
        (parent, child, module)
        for parent in model.modules()
        for child, module in parent.named_children()
        if child in LORA_ALL_LINEAR and type(module) is nn.Linear
    ]
    if not found and any(is_4bit(m) for m in model.modules()):
        return 0
    if not found:
        raise SeqparError(
            f"{type(model).__name__}: workload.lora.base_dtype nf4 found no decoder linear layer to quantize "
            f"({' '.join(LORA_ALL_LINEAR)}); use base_dtype bf16"
        )
    for parent, child, lin in found:
        dev = torch.device(device) if device is not None else lin.weight.device
        if dev.type == "meta":
            raise SeqparError("a 4-bit base is quantized from real weights: build the model on a device, not on meta")
        q = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            bias=lin.bias is not None,
            compute_dtype=compute_dtype or lin.weight.dtype,
            quant_type="nf4",
            device="meta",
        )
        q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4")
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        setattr(parent, child, q.to(dev))  # quantized here (bitsandbytes quantizes on the move to a device)
    return len(found)


__all__ = ["apply_lora", "lora_config", "peft_model", "quantize_base"]
