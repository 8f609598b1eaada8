"""Hardware and model profiles: JSON data files next to this module, validated into schema models on load.

- ``gpus.json``: GPU datasheet figures (GpuSpec) with aliases, the names NVML reports and each board's usual links.
- ``links.json``: link bandwidths (LinkSpec).
- ``models.json``: model shapes from each model's Hugging Face config.json (ModelSpec).

``get_model`` also accepts a local Hugging Face ``config.json`` (or a folder holding one) and any Hub model id (its
config.json from the cache or the Hub, seqpar.profiles.hub), read as plain JSON by ``hf_config`` so that the advisor never imports
transformers (which would import torch). The profiles stay the offline fallback: their names and Hub ids resolve without
a download. Unknown names raise SeqparError with the closest names.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pydantic import ValidationError

from seqpar.plan.errors import SeqparError
from seqpar.plan.files import first_error, read_json_object
from seqpar.plan.specs import GpuSpec, LinkSpec, ModelSpec
from seqpar.profiles.hf_config import spec_from_config

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
    """A model by profile name, alias or profiled Hub id ('meta-llama/Llama-2-7b-hf': the figures of that very config.json,
    nothing downloaded), a local config.json / folder, or any other Hub id ``owner/name[@revision]`` (its config.json
    from the Hugging Face cache, else the Hub: seqpar.profiles.hub)."""
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
    from seqpar.profiles import hub

    parsed = hub.parse_hub_id(name_or_path)
    if parsed is not None:
        got = hub.fetch_config(*parsed)
        return spec_from_config(got.data, name_or_path.strip(), f"{name_or_path.strip()!r} ({got.path})", got.source)
    raise _unknown("model", name_or_path, list(specs) + list(aliases), ", a Hub id owner/name, or a local config.json")


def hub_id(spec: ModelSpec) -> str | None:
    """The Hub repository a model comes from: a profile's hf_id, a Hub id the spec was read under, else None (a local
    config.json or a shape without a repository, like 'tiny')."""
    for e in _read("models.json", "models"):
        if e["spec"]["name"] == spec.name:
            return e.get("hf_id")
    from seqpar.profiles.hub import parse_hub_id

    return spec.name if parse_hub_id(spec.name) and not Path(spec.name).exists() else None


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
    return spec_from_config(cfg, str(path), repr(str(p)), f"{p} (config.json)")


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
    from seqpar.profiles.hub import parse_hub_id

    if parse_hub_id(name):
        return get_model(name)
    gpus = _gpus()
    choices = list(gpus) + [a for p in gpus.values() for a in p.aliases] + list(_links()) + list(specs) + list(aliases)
    raise _unknown("profile", name, choices, "")
