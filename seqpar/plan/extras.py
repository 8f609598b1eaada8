"""Optional dependencies and the extra that installs each: one line naming the install instead of a bare ModuleNotFoundError.

``pip install -e .`` (or ``pip install 'seqpar @ git+URL'``) installs the advisor only (pydantic, typer, rich,
nvidia-ml-py, numpy); training, plots and some kernels need more, declared as extras in pyproject.toml. The CLI maps a
``MissingExtra`` (raised by ``require`` before the work starts) or a ``ModuleNotFoundError`` of a module below to exit 1
with one line (a known failure: the install, not the input, is what is missing). Dependency-free and torch-free.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from importlib import metadata
from pathlib import Path

# top-level module -> (extra in pyproject.toml, what it is for); most specific first is not needed: names are unique.
EXTRAS: dict[str, tuple[str, str]] = {
    "torch": ("runtime", "training and evaluation"),
    "transformers": ("runtime", "training and evaluation"),
    "accelerate": ("runtime", "DeepSpeed plans (accelerate launch)"),
    "safetensors": ("runtime", "checkpoints"),
    "matplotlib": ("plot", "pictures (--plot)"),
    "deepspeed": ("deepspeed", "zero2/zero3/zero3_offload sharding on GPUs"),
    "liger_kernel": ("liger", "fused_ops liger"),
    "flash_attn": ("flash", "flash-attn kernels"),
    "peft": ("lora", "LoRA adapters (workload.lora)"),
    "bitsandbytes": ("qlora", "a 4-bit QLoRA base (workload.lora.base_dtype nf4)"),
    "tensorboard": ("track", "--report-to tensorboard"),
    "wandb": ("track", "--report-to wandb"),
}


class MissingExtra(Exception):
    """An optional dependency is not installed; the message names the extra that installs it (CLI: exit 1)."""


def install_line(extra: str) -> str:
    """The command that installs ``extra`` where this seqpar came from (it is not on PyPI): from its checkout, from its
    git URL (pip's direct_url.json), else by name."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():  # a checkout, installed with pip install -e . (or run from the tree)
        return f"pip install -e {shlex.quote(f'{root}[{extra}]')}"
    try:
        info = json.loads(metadata.distribution("seqpar").read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        info = {}
    if "vcs_info" in info:
        url = info.get("url", "")
        return f"pip install {shlex.quote(f'seqpar[{extra}] @ git+{url}')}"
    return f"pip install 'seqpar[{extra}]'"


def missing_message(module: str, why: str | None = None) -> str | None:
    """The one line for a missing ``module`` (a dotted name is fine), or None when no extra provides it."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        return None
    extra, used_for = EXTRAS[top]
    return f"{why or used_for} needs {top}, which is not installed: {install_hint(extra)}"


def install_hint(extra: str) -> str:
    """``install_line(extra)``, with DeepSpeed's recipe: its ops are built on first use, and its setup imports torch, so
    pip must not build it in an isolated environment (that also makes it install without a network, from an sdist)."""
    if extra == "deepspeed":
        return (
            f"DS_BUILD_OPS=0 {install_line(extra).replace('pip install', 'pip install --no-build-isolation', 1)} "
            "(after torch; offline, from DeepSpeed's source archive: DS_BUILD_OPS=0 pip install --no-build-isolation "
            "deepspeed-VERSION.tar.gz)"
        )
    return install_line(extra)


def require(module: str, why: str | None = None) -> None:
    """MissingExtra when ``module`` cannot be imported here (checked without importing it)."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(missing_message(module, why) or f"{module} is not installed")


def from_error(e: ModuleNotFoundError) -> str | None:
    """The one line for a ModuleNotFoundError raised by an import deep in seqpar, or None when it is not an optional
    dependency (then it is a bug, reported as such)."""
    return missing_message(e.name) if e.name else None


def lazy_api(package: str, api: dict[str, str], namespace: dict):
    """A package's ``__getattr__`` and ``__dir__`` for names defined in modules imported on first use (``api``: name ->
    module): a missing optional dependency raises one line naming the extra to install instead of ModuleNotFoundError."""

    def __getattr__(name: str):
        if name not in api:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        try:
            module = importlib.import_module(api[name])
        except ModuleNotFoundError as e:
            line = from_error(e)
            if line is None:
                raise
            raise MissingExtra(f"{package}.{name}: {line}") from None
        return getattr(module, name)

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(api))

    return __getattr__, __dir__


__all__ = ["EXTRAS", "MissingExtra", "from_error", "install_line", "lazy_api", "missing_message", "require"]
