"""A LoRA adapter's shapes and size, counted from the model's shapes: the one count the cost model, the FLOP count and
the answer share.

peft (0.21.2, ``tuners/lora/layer.py``: ``LoraLayer.update_layer``) gives each targeted ``nn.Linear`` of in_features x
out_features two matrices, lora_A (r x in) and lora_B (out x r), without bias (``LoraConfig(bias="none")``, the
default): r * (in + out) parameters. The linear layers of a Llama-style decoder block (transformers'
``LlamaDecoderLayer``; Qwen2/3 and Mistral name them alike), h = hidden, a / kv = query / key-value heads of d, I = MLP
width: q_proj h -> a*d, k_proj and v_proj h -> kv*d, o_proj a*d -> h, gate_proj and up_proj h -> I, down_proj I -> h.
peft's ``all-linear`` targets these seven and leaves the LM head out. Checked against peft's own count in
tests/advisor/cost/test_lora.py.

Pure Python: reads a seqpar.plan.specs.ModelSpec's and LoraSpec's fields (this module stands below specs, with flops).
"""

from __future__ import annotations

from typing import Any

ModelSpec = Any  # a seqpar.plan.specs.ModelSpec
LoraSpec = Any  # a seqpar.plan.specs.LoraSpec

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def linear_shapes(m: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of one decoder block, by peft's module names."""
    h, i, q, kv = m.hidden_size, m.intermediate_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def targeted_shapes(m: ModelSpec, lora: LoraSpec) -> dict[str, tuple[int, int]]:
    """The (in, out) of the linears ``lora`` targets, in block order."""
    return {k: v for k, v in linear_shapes(m).items() if k in lora.target_modules}


def adapter_params_per_layer(m: ModelSpec, lora: LoraSpec) -> int:
    """r * (in + out) summed over the targeted linears of one decoder block."""
    return sum(lora.rank * (i + o) for i, o in targeted_shapes(m, lora).values())


def adapter_params(m: ModelSpec, lora: LoraSpec) -> int:
    """The trainable parameters: every decoder block's adapters (peft's ``get_nb_trainable_parameters()[0]``)."""
    return m.num_layers * adapter_params_per_layer(m, lora)


def targets_text(lora: LoraSpec) -> str:
    """'7 linear layers' (all of them), else their names: 'q_proj v_proj'."""
    n = len(lora.target_modules)
    if n == len(linear_shapes_names()):
        return f"all {n} linear layers"
    return " ".join(x for x in linear_shapes_names() if x in lora.target_modules)


def linear_shapes_names() -> tuple[str, ...]:
    return ATTENTION + MLP


def lora_text(lora: LoraSpec) -> str:
    """One line: 'LoRA r=32 on all 7 linear layers (bf16 base)', 'QLoRA r=16 on q_proj v_proj (4-bit NF4 base)'."""
    base = "4-bit NF4 base" if lora.base_dtype == "nf4" else f"{lora.base_dtype} base"
    name = "QLoRA" if lora.base_dtype == "nf4" else "LoRA"
    extra = f", alpha {lora.alpha:g}" + (f", dropout {lora.dropout:g}" if lora.dropout else "")
    return f"{name} r={lora.rank} on {targets_text(lora)} ({base}{extra})"


__all__ = [
    "ATTENTION",
    "MLP",
    "adapter_params",
    "adapter_params_per_layer",
    "linear_shapes",
    "linear_shapes_names",
    "lora_text",
    "targeted_shapes",
    "targets_text",
]
