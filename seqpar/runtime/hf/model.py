"""The model the trainer trains: a local Hugging Face folder, or the plan's ModelSpec with seeded random weights.

Random-weight models (benchmarks, smoke tests) are built from a transformers config made out of the ModelSpec, so a plan
alone is enough to run. Every rank seeds the same generator before building, so all ranks start from identical weights.
The RoPE base can be overridden (EasyContext's recipe raises it per stage); transformers 5 keeps it in
``config.rope_parameters``, 4.x in ``config.rope_theta``: both are set.

Host memory: only rank 0 builds the model with its weights (``meta=False``); every other rank builds it on the meta
device (shapes, no storage), the engine wraps it (FSDP2 shards the meta parameters), ``materialize`` allocates what the
rank keeps, and ``share_from_rank0`` broadcasts rank 0's values tensor by tensor (torch.distributed.checkpoint's
``broadcast_from_rank0``), each rank keeping its shard. A W-rank job so holds one full copy (rank 0's, while it
broadcasts) instead of W, and an FSDP2 rank other than 0 never more than its shard.
"""

from __future__ import annotations

from pathlib import Path

from seqpar.plan.errors import SeqparError
from seqpar.plan.specs import ModelSpec

_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def config_from_spec(spec: ModelSpec):
    """A transformers config with the ModelSpec's shapes (architecture picks the class)."""
    import transformers

    name = _CONFIGS.get(spec.architecture)
    if name is None:
        raise SeqparError(
            f"model architecture {spec.architecture!r} has no random-weight builder; use one of {sorted(_CONFIGS)} "
            f"or pass --model-path with a local Hugging Face folder"
        )
    kwargs = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        use_cache=False,
    )
    if spec.architecture in ("llama", "qwen3"):
        kwargs["attention_bias"] = spec.attention_bias
    if spec.architecture == "mistral":
        kwargs["sliding_window"] = None  # sequence-parallel attention is exact causal attention, no window
    return getattr(transformers, name)(**kwargs)


def set_rope_theta(config, theta: float) -> None:
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = float(theta)
    if hasattr(config, "rope_theta") or not isinstance(rp, dict):
        config.rope_theta = float(theta)


def build_model(
    spec: ModelSpec,
    *,
    model_path: str | None,
    seed: int,
    rope_theta: float | None,
    init_from: str | None = None,
    device=None,
    dtype=None,
    meta: bool = False,
):
    """The causal LM; weights from model_path, init_from, or seeded random. Random weights are created directly on
    ``device`` in ``dtype`` (a 7B model initialised in fp32 on the host would take ~27 GB of RAM and a minute of CPU);
    loaded weights come in ``dtype`` on the host and the caller moves them. ``meta``: shapes only, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_path:
        p = Path(model_path)
        if not (p / "config.json").is_file():
            raise SeqparError(f"--model-path {model_path!r} holds no config.json; pass a local Hugging Face model folder")
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    else:
        config = config_from_spec(spec)
    config.use_cache = False
    if rope_theta is not None:
        set_rope_theta(config, rope_theta)
    torch.manual_seed(seed)
    dtype = dtype or torch.float32
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    if model_path:
        model = AutoModelForCausalLM.from_pretrained(p, config=config, dtype=dtype, local_files_only=True)
    else:
        with torch.device(device or "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if init_from:
        load_weights(model, init_from)
    return model


def load_weights(model, folder: str | Path) -> None:
    """Load the safetensors files of a save_pretrained folder into ``model`` (tied weights may be absent from the files)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise SeqparError(f"checkpoint folder {str(folder)!r} holds no .safetensors weights; it is not a finished checkpoint")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if isinstance(getattr(model, "_tied_weights_keys", None), dict):
        tied = set(model._tied_weights_keys)
    real_missing = [k for k in missing if k not in tied and not (model.config.tie_word_embeddings and k == "lm_head.weight")]
    if real_missing or unexpected:
        raise SeqparError(
            f"checkpoint {str(folder)!r} does not fit the model: missing {real_missing[:3]}, unexpected {list(unexpected)[:3]}; "
            f"resume with the plan that wrote it"
        )


def full_state(module) -> dict:
    """Rank 0's values to broadcast, keyed as torch.distributed.checkpoint keys the module (wrappers' prefixes removed)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module)


def materialize(module, device) -> None:
    """Allocate the meta tensors of ``module`` on ``device`` (uninitialised: share_from_rank0 fills them)."""
    import itertools

    if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        module.to_empty(device=device)


def share_from_rank0(module, full: dict | None) -> None:
    """Collective: every parameter and buffer of ``module`` (wrapped or not) takes rank 0's value; ``full`` is rank 0's
    ``full_state`` taken before wrapping, None elsewhere. FSDP2 ranks keep their shard of each parameter."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, full or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for b in module.buffers():  # non-persistent buffers (RoPE's inv_freq) are in no state dict
        dist.broadcast(b, src=0)


def wrap_from_rank0(module, wrap, *, rank: int, device, sharded: bool, offload: bool):
    """Collective: ``wrap(module)`` (the engine) with every rank's tensors allocated and holding rank 0's values.
    DDP (``sharded`` False) checks and broadcasts real tensors, so they are allocated before wrapping; FSDP2 shards the
    meta parameters first, so a rank allocates only its shards (in host memory when ``offload``)."""
    full = full_state(module) if rank == 0 else None
    if not sharded:
        materialize(module, device)
    wrapped = wrap(module)
    materialize(wrapped, "cpu" if offload else device)
    share_from_rank0(wrapped, full)
    return wrapped
