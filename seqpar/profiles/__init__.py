"""Hardware and model profiles: JSON data files next to this module, validated into schema models on load.

- ``gpus.json``: GPU datasheet figures (GpuSpec) with aliases, the names NVML reports and each board's usual links.
- ``links.json``: link bandwidths (LinkSpec).
- ``models.json``: model shapes from each model's Hugging Face config.json (ModelSpec).

``get_model`` also accepts a local Hugging Face ``config.json`` (or a folder holding one), read as plain JSON so that the
advisor never imports transformers (which would import torch). Unknown names raise SeqparError with the closest names.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pydantic import ValidationError

from seqpar.errors import SeqparError
from seqpar.schema import GpuSpec, LinkSpec, ModelSpec, first_error, read_json_object

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class GpuProfile:
    """A GPU spec plus what the profile file says about it beyond the schema."""

    spec: GpuSpec
    aliases: tuple[str, ...]
    nvml_names: tuple[str, ...]
    intra_node_link: str
    inter_node_link: str


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _read(file: str, key: str) -> list[dict]:
    data = json.loads((_HERE / file).read_text())
    return data[key]


@cache
def _gpus() -> dict[str, GpuProfile]:
    out = {}
    for e in _read("gpus.json", "gpus"):
        try:
            spec = GpuSpec.model_validate(e["spec"])
        except ValidationError as err:  # a broken data file is a bug in seqpar, not user input
            raise RuntimeError(f"seqpar/profiles/gpus.json: {first_error(err)}") from None
        out[spec.name] = GpuProfile(
            spec, tuple(e.get("aliases", ())), tuple(e.get("nvml_names", ())), e["intra_node_link"], e["inter_node_link"]
        )
    return out


@cache
def _links() -> dict[str, LinkSpec]:
    return {s.kind: s for s in (LinkSpec.model_validate(e) for e in _read("links.json", "links"))}


@cache
def _models() -> tuple[dict[str, ModelSpec], dict[str, str]]:
    specs, aliases = {}, {}
    for e in _read("models.json", "models"):
        spec = ModelSpec.model_validate(e["spec"])
        specs[spec.name] = spec
        for a in list(e.get("aliases", ())) + ([e["hf_id"]] if e.get("hf_id") else []):
            aliases[_norm(a)] = spec.name
    return specs, aliases


def _unknown(kind: str, name: str, choices: list[str], listing: str) -> SeqparError:
    close = difflib.get_close_matches(_norm(name), choices, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(sorted(set(choices))[:12])}"
    return SeqparError(f"unknown {kind} {name!r}; {hint} (see `seqpar profiles list`{listing})")


# --------------------------------------------------------------------------------------------- GPUs and links


def gpu_profile(name: str) -> GpuProfile:
    """The profile of a GPU by canonical name or alias ('a100' -> a100-80g-sxm, 'h100' -> h100-sxm, '4090' -> rtx-4090)."""
    key = _norm(name)
    gpus = _gpus()
    if key in gpus:
        return gpus[key]
    for p in gpus.values():
        if key in p.aliases or key in (_norm(n) for n in p.nvml_names):
            return p
    choices = list(gpus) + [a for p in gpus.values() for a in p.aliases]
    raise _unknown("GPU", name, choices, "")


def get_gpu(name: str) -> GpuSpec:
    return gpu_profile(name).spec


def list_gpus() -> list[GpuSpec]:
    return [p.spec for p in _gpus().values()]


def match_nvml_name(nvml_name: str) -> GpuSpec | None:
    """The profile whose NVML name matches what nvmlDeviceGetName returned (exact, then case-insensitive), or None."""
    want = _norm(nvml_name)
    for p in _gpus().values():
        if any(_norm(n) == want for n in p.nvml_names):
            return p.spec
    return None


def get_link(kind: str) -> LinkSpec:
    links = _links()
    key = _norm(kind).replace("-", "_")
    if key not in links:
        raise _unknown("link", kind, list(links), "")
    return links[key]


def list_links() -> list[LinkSpec]:
    return list(_links().values())


# --------------------------------------------------------------------------------------------- models


def list_models() -> list[ModelSpec]:
    return list(_models()[0].values())


def get_model(name_or_path: str) -> ModelSpec:
    """A model profile by name, alias or Hub id ('meta-llama/Llama-2-7b-hf'), or read from a local config.json / folder."""
    specs, aliases = _models()
    key = _norm(name_or_path)
    if key in specs:
        return specs[key]
    if key in aliases:
        return specs[aliases[key]]
    p = Path(name_or_path).expanduser()
    if p.exists():
        return model_from_config(p)
    if name_or_path.endswith(".json") or name_or_path.startswith((".", "/", "~")):
        raise SeqparError(
            f"model config {name_or_path!r} does not exist; pass a profile name (seqpar profiles list) or a local config.json"
        )
    raise _unknown("model", name_or_path, list(specs) + list(aliases), " or pass a local config.json")


# Fields of llama / mistral / qwen2 / qwen3 configs (transformers' names) -> ModelSpec's.
_REQUIRED = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
}


def model_from_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face config.json (or a folder holding one) as plain JSON: importing transformers would import torch."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    cfg = read_json_object(
        p,
        "model config",
        "config",
        missing_fix="pass a folder holding config.json or the file itself",
        invalid_fix="check the file",
    )
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    missing = [src for src in _REQUIRED.values() if cfg.get(src) is None]
    if missing:
        raise SeqparError(
            f"model config {str(p)!r} lacks {', '.join(missing)}; seqpar reads decoder configs of llama, mistral, qwen2 and qwen3 models"
        )
    fields = {dst: cfg[src] for dst, src in _REQUIRED.items()}
    heads = cfg["num_attention_heads"]
    for key in ("num_attention_heads", "hidden_size"):  # head_dim below divides one by the other
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SeqparError(f"model config {str(p)!r} is invalid: {key} {v!r} must be a positive whole number")
    arch = str(cfg.get("model_type") or "llama")
    # transformers 5 writes rope_theta inside rope_parameters; older configs keep it at the top level.
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    try:
        return ModelSpec(
            name=str(path),
            architecture=arch,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or fields["hidden_size"] // heads,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_theta=float(theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            # Qwen2 configs carry no attention_bias key, yet its q/k/v projections always have a bias.
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            source=f"{p} (config.json)",
            **fields,
        )
    except (ValidationError, TypeError, ValueError, ArithmeticError) as e:  # ArithmeticError: int() of a JSON Infinity
        msg = first_error(e).removeprefix("(plan): ") if isinstance(e, ValidationError) else str(e)
        raise SeqparError(f"model config {str(p)!r} is invalid: {msg}") from None


def find_profile(name: str) -> GpuSpec | LinkSpec | ModelSpec:
    """A GPU, link or model profile by name or alias (for `seqpar profiles show NAME`)."""
    for getter in (get_gpu, get_link):
        try:
            return getter(name)
        except SeqparError:
            pass
    specs, aliases = _models()
    if _norm(name) in specs or _norm(name) in aliases or Path(name).expanduser().exists():
        return get_model(name)
    gpus = _gpus()
    choices = list(gpus) + [a for p in gpus.values() for a in p.aliases] + list(_links()) + list(specs) + list(aliases)
    raise _unknown("profile", name, choices, "")
