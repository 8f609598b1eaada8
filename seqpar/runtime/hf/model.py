"""The model the trainer trains: a local Hugging Face folder, or the plan's ModelSpec with seeded random weights.

Random-weight models (benchmarks, smoke tests) are built from a transformers config made out of the ModelSpec, so a plan
alone is enough to run. Every rank seeds the same generator before building, so all ranks start from identical weights.
The RoPE base can be overridden (EasyContext's recipe raises it per stage); transformers 5 keeps it in
``config.rope_parameters``, 4.x in ``config.rope_theta``: both are set.

Host memory: only rank 0 builds the model with its weights (``meta=False``); every other rank builds it on the meta
device (shapes, no storage), the engine wraps it (FSDP2 shards the meta parameters), ``materialize`` allocates what the
rank keeps, and ``share_from_rank0`` broadcasts rank 0's values tensor by tensor (torch.distributed.checkpoint's
``broadcast_from_rank0``), each rank keeping its shard. A W-rank job so holds one full copy (rank 0's, while it
broadcasts) instead of W, and an FSDP2 rank other than 0 never more than its shard. A 4-bit (QLoRA) base is built by
every rank itself, one decoder layer at a time, each quantized before the next is allocated
(``quantize_4bit``, seqpar.runtime.hf.quantized_build): it is never broadcast and never whole in 16 bits.

A model folder is data (seqpar.runtime.data.hf_folder): no custom code without ``--trust-remote-code``, weights only from
safetensors, and a folder whose safetensors are torn or miss a weight the config has is one line (exit 2), never a
model trained from partly random weights. To train with a plan, the folder's shape must be the plan's
(``check_shape``): the plan's memory, speed and layout were worked out for that shape.
"""

from __future__ import annotations

from pathlib import Path

from seqpar.plan.errors import SeqparError
from seqpar.plan.safe import printable
from seqpar.plan.specs import ModelSpec
from seqpar.runtime.data.hf_folder import check_weights, read_config, refuse_remote_code, shown
from seqpar.runtime.hf.quantized_build import tied_names

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


# (the ModelSpec field, the transformers config attribute): what a plan's figures and its layout depend on
SHAPE = (
    ("num_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("intermediate_size", "intermediate_size"),
    ("vocab_size", "vocab_size"),
)


def check_shape(config, spec: ModelSpec, model_path: str) -> None:
    """SeqparError naming the first shape field where the model folder's config differs from the plan's model."""
    for field, attr in SHAPE:
        got = getattr(config, attr, None)
        if attr == "num_key_value_heads" and got is None:  # transformers' default: multi-head attention
            got = getattr(config, "num_attention_heads", None)
        if attr == "head_dim" and got is None:
            heads = getattr(config, "num_attention_heads", None)
            got = config.hidden_size // heads if heads else None
        want = getattr(spec, field)
        if got != want:
            raise SeqparError(
                f"--model-path {shown(model_path)}: config.json has {attr} {printable(got, 60)}, the plan's model "
                f"{printable(spec.name, 80)!r} has {field} {want}; the plan's memory, speed and layout are worked out "
                f"for its model: advise a plan for this folder (seqpar advise --model {shown(model_path)} ...) or pass "
                f"the folder of the plan's model"
            )


def load_config(model_path: str, *, trust_remote_code: bool = False):
    """transformers' config of a local model folder, after the folder's checks (seqpar.runtime.data.hf_folder)."""
    from transformers import AutoConfig

    p = Path(model_path)
    if not (p / "config.json").is_file():
        raise SeqparError(f"--model-path {shown(model_path)} holds no config.json; pass a local Hugging Face model folder")
    refuse_remote_code(p, "--model-path", trust_remote_code)  # reads config.json bounded, as a JSON object, first
    try:
        return AutoConfig.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as e:  # a model_type transformers does not know, a bad field
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SeqparError(
            f"--model-path {shown(model_path)}: transformers cannot read its config.json ({printable(first)}); pass a "
            "folder written by save_pretrained"
        ) from None


def weight_names(model_path: str) -> set[str]:
    """The tensor names of the folder's safetensors files, each file's header checked (safetensors' own reader: its
    size, JSON and offsets against the file); SeqparError naming the file otherwise. Cheap (headers only), so every
    rank runs it and a bad folder is the same one line on all of them."""
    return set(weight_index(model_path))


def weight_index(model_path: str) -> dict[str, tuple[Path, list[int]]]:
    """Each tensor of the folder's safetensors files: (its file, its shape), from the headers (see weight_names)."""
    p = Path(model_path)
    check_weights(p)
    index = read_config(p, "model.safetensors.index.json", "--model-path")
    if index is None:
        files = ["model.safetensors"]
    else:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SeqparError(f"--model-path {shown(p / 'model.safetensors.index.json')} has no weight_map; restore the folder")
        files = sorted({str(v) for v in weight_map.values()})
        for name in files:  # a file beside the index, never a path elsewhere
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise SeqparError(
                    f"--model-path {shown(p / 'model.safetensors.index.json')} names {printable(name, 80)!r}, not a "
                    ".safetensors file beside it; restore the folder"
                )
    return headers([p / name for name in files], _unreadable_folder_file)


def checkpoint_index(folder: str | Path) -> dict[str, tuple[Path, list[int]]]:
    """Each tensor of a checkpoint folder's safetensors files (``--init-from``, what load_weights reads): (its file,
    its shape), from the headers."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise SeqparError(_no_checkpoint_weights(folder))
    return headers(files, _unreadable_checkpoint_file)


def headers(files: list[Path], unreadable) -> dict[str, tuple[Path, list[int]]]:
    """{tensor name: (file, shape)} of ``files`` (safetensors' own header reader); SeqparError(``unreadable(file,
    first line of the reader's error)``) for a file it refuses."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, tuple[Path, list[int]]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                out.update({k: (path, list(f.get_slice(k).get_shape())) for k in f.keys()})
        except (SafetensorError, OSError) as e:  # torn, not safetensors at all, missing
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise SeqparError(unreadable(path, first)) from None
    return out


def _unreadable_folder_file(path: Path, first: str) -> str:
    return (
        f"--model-path {shown(path)} is not a readable safetensors file ({printable(first)}); restore the folder or "
        "write it again with save_pretrained"
    )


def _unreadable_checkpoint_file(path: Path, first: str) -> str:
    return (
        f"checkpoint file {shown(path)} is not a readable safetensors file ({printable(first)}); restore it or start "
        "from another checkpoint"
    )


def _no_checkpoint_weights(folder) -> str:
    return f"checkpoint folder {str(folder)!r} holds no .safetensors weights; it is not a finished checkpoint"


def check_coverage(model, names: set[str], model_path: str) -> None:
    """SeqparError when the model has a tensor the folder's weights lack: it would train from random values."""
    missing = sorted(set(model.state_dict()) - names - tied_names(model))
    if missing:
        raise SeqparError(
            f"--model-path {shown(model_path)}: its weights lack {len(missing)} of the model's tensors (e.g. "
            f"{printable(missing[0])}), which would train from random values; pass a complete folder (config.json and "
            "safetensors from the same save_pretrained)"
        )


def load_pretrained(model_path: str, config, dtype, *, trust_remote_code: bool = False):
    """The folder's weights (safetensors only) into the model of ``config``; every weight the model has must be in the
    files (a tied output head may be absent)."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            Path(model_path),
            config=config,
            dtype=dtype,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    except torch.OutOfMemoryError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError, KeyError) as e:  # a tensor of another shape or dtype
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise SeqparError(
            f"--model-path {shown(model_path)}: its safetensors weights cannot be loaded ({type(e).__name__}: "
            f"{printable(first)}); restore the folder or write it again with save_pretrained"
        ) from None
    missing = sorted(set(info.get("missing_keys", ())) - tied_names(model))
    if missing:
        raise SeqparError(
            f"--model-path {shown(model_path)}: its weights lack {len(missing)} of the model's tensors (e.g. "
            f"{printable(missing[0])}), which would train from random values; pass a complete folder"
        )
    return model


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
    trust_remote_code: bool = False,
    match_plan: bool = False,
    quantize_4bit: bool = False,
    compute_dtype=None,
):
    """The causal LM; weights from model_path, init_from, or seeded random. Random weights are created directly on
    ``device`` in ``dtype`` (a 7B model initialised in fp32 on the host would take ~27 GB of RAM and a minute of CPU);
    loaded weights come in ``dtype`` on the host and the caller moves them. ``meta``: shapes only, no weights.
    ``match_plan``: a model folder must have ``spec``'s shape (the trainer's; eval reads the folder's own shape).
    ``quantize_4bit`` (a QLoRA base): the model is built on ``device`` one piece at a time, each decoder layer's linear
    layers quantized to NF4 (matmuls in ``compute_dtype``) before the next layer exists, so the whole model never
    exists in ``dtype`` (seqpar.runtime.hf.quantized_build says why)."""
    import torch
    from transformers import AutoModelForCausalLM

    if model_path:
        config = load_config(model_path, trust_remote_code=trust_remote_code)
        if match_plan:
            check_shape(config, spec, model_path)
        index = weight_index(model_path)  # every rank, rank 0 loading them and the meta ranks alike
    else:
        config = config_from_spec(spec)
    config.use_cache = False
    if rope_theta is not None:
        set_rope_theta(config, rope_theta)
    torch.manual_seed(seed)
    dtype = dtype or torch.float32
    if meta or quantize_4bit:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        if model_path:
            check_coverage(model, set(index), model_path)
        if meta:
            return model
        from seqpar.runtime.hf.quantized_build import FolderWeights, materialize_4bit

        if init_from:  # every weight the model has comes from it (as load_weights below), the folder's are not read
            weights = FolderWeights(checkpoint_index(init_from), f"checkpoint {str(init_from)!r}", checkpoint=True)
        elif model_path:
            weights = FolderWeights(index, f"--model-path {shown(model_path)}")
        else:
            weights = None
        materialize_4bit(model, weights, seed=seed, device=device or "cpu", compute_dtype=compute_dtype)
        return model
    if model_path:
        model = load_pretrained(model_path, config, dtype, trust_remote_code=trust_remote_code)
        check_coverage(model, set(index), model_path)
    else:
        with torch.device(device or "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)  # seqpar's own config
    if init_from:
        load_weights(model, init_from)
    return model


def load_weights(model, folder: str | Path) -> None:
    """Load the safetensors files of a save_pretrained folder into ``model`` (tied weights may be absent from the files)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise SeqparError(_no_checkpoint_weights(folder))
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:  # torn by a full disk, or not safetensors at all
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise SeqparError(_unreadable_checkpoint_file(f, first)) from None
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape: the folder is another model's
        first = next((ln for ln in str(e).splitlines() if ln.strip() and "Error" not in ln), type(e).__name__)
        raise SeqparError(
            f"checkpoint {shown(folder)} does not fit the model ({printable(first.strip())}); resume with the plan that wrote it"
        ) from None
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
