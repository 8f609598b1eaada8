"""A model's shape (ModelSpec) from its Hugging Face ``config.json``, read as plain JSON (transformers would import torch).

The families are the decoders the cost model describes and the runtime builds (seqpar.runtime.hf.model): Llama-style blocks
(RMSNorm, RoPE, a gated MLP of three h x intermediate matrices). Their config fields, by transformers' names:
``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` (absent: = heads),
``head_dim`` (absent or null: hidden / heads), ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``,
``rope_theta`` (transformers 5 writes it inside ``rope_parameters``), ``max_position_embeddings``, ``attention_bias``
(Qwen2 has no key: its q/k/v always carry a bias), and the sliding window a layer applies (``layer_types`` holding
"sliding_attention", else ``use_sliding_window``, else ``sliding_window``; Mistral's class default is 4096).

Shapes the cost model cannot describe are refused with one line naming the field that shows it, never mis-predicted:
experts (mixture of experts), state-space or linear-attention layers (hybrids), a vision or audio tower (multimodal).
"""

from __future__ import annotations

from pydantic import ValidationError

from seqpar.plan.errors import SeqparError
from seqpar.plan.files import first_error
from seqpar.plan.specs import ModelSpec

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # schema.Architecture; seqpar.runtime.hf.model builds these
_CLASS_DEFAULTS = {"mistral": {"sliding_window": 4096}}  # transformers' MistralConfig default when the key is absent

REQUIRED = {  # ModelSpec field -> config.json field
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
}

# Fields that show a shape the cost model does not describe, most specific first: (field, what it means).
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_HYBRID = ("hybrid_override_pattern", "layers_block_type", "attn_layer_indices", "attn_layer_period", "linear_num_key_heads")
_HYBRID_PREFIXES = ("mamba_", "ssm_")
_TOWERS = ("vision_config", "audio_config", "speech_config", "vision_tower", "image_token_index", "image_token_id")
_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def _refusal(cfg: dict) -> str | None:
    """The field that shows a mixture of experts, a hybrid state-space model or a multimodal model, with its value."""
    for key in _TOWERS:
        if cfg.get(key) is not None:
            return f"{key} is set: a multimodal model (vision/audio tower)"
    for key in _EXPERTS:
        v = cfg.get(key)
        if v not in (None, 0, 1, False):
            return f"{key}={v!r}: a mixture of experts"
    for key in sorted(cfg):
        if key in _HYBRID or key.startswith(_HYBRID_PREFIXES):
            return f"{key} is set: a hybrid of attention and state-space/linear-attention layers"
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        other = sorted({str(t) for t in layer_types} - _ATTENTION_LAYERS)
        if other:
            return f"layer_types holds {', '.join(other)}: a hybrid of attention and other layers"
    return None


def active_sliding_window(cfg: dict) -> int | None:
    """The window some layer applies, None when every layer attends to the whole causal prefix (as transformers and
    seqpar.runtime.hf.apply read it: layer_types first, then use_sliding_window, then sliding_window)."""
    arch = str(cfg.get("model_type") or "llama")
    window = cfg.get("sliding_window", _CLASS_DEFAULTS.get(arch, {}).get("sliding_window"))
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        return window if "sliding_attention" in layer_types else None
    if cfg.get("use_sliding_window") is False or ("use_sliding_window" not in cfg and arch in ("qwen2", "qwen3")):
        return None  # Qwen2/Qwen3: the window only applies with use_sliding_window true (default false)
    return window


def spec_from_config(cfg: dict, name: str, where: str, source: str) -> ModelSpec:
    """The ModelSpec of a config.json's fields; ``where`` names the file in messages, ``source`` goes into the spec."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict) and _refusal(cfg) is None:
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    refused = _refusal(cfg)
    if refused:
        raise SeqparError(
            f"model config {where} is not a dense decoder seqpar's cost model describes ({refused}); "
            f"use a dense {'/'.join(FAMILIES)} model"
        )
    arch = str(cfg.get("model_type") or "llama")
    if arch not in FAMILIES:
        raise SeqparError(
            f"model config {where} has model_type {arch!r}; seqpar's cost model and runtime describe {', '.join(FAMILIES)} "
            f"decoders: use one of those, or a built-in profile (seqpar profiles list)"
        )
    missing = [src for src in REQUIRED.values() if cfg.get(src) is None]
    if missing:
        raise SeqparError(
            f"model config {where} lacks {', '.join(missing)}; seqpar reads decoder configs of {', '.join(FAMILIES)} models"
        )
    fields = {dst: cfg[src] for dst, src in REQUIRED.items()}
    for key in ("num_attention_heads", "hidden_size"):  # head_dim below divides one by the other
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SeqparError(f"model config {where} is invalid: {key} {v!r} must be a positive whole number")
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    try:
        return ModelSpec(
            name=name,
            architecture=arch,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or fields["hidden_size"] // heads,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_theta=float(theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            sliding_window=active_sliding_window(cfg),
            source=source,
            **fields,
        )
    except (ValidationError, TypeError, ValueError, ArithmeticError) as e:  # ArithmeticError: int() of a JSON Infinity
        msg = first_error(e).removeprefix("(plan): ") if isinstance(e, ValidationError) else str(e)
        raise SeqparError(f"model config {where} is invalid: {msg}") from None


__all__ = ["FAMILIES", "REQUIRED", "active_sliding_window", "spec_from_config"]
