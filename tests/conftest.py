"""pytest setup shared by every test file.

DeepSpeed JIT-builds its CPU ops (CPU Adam, shared-memory collectives) with torch's cpp_extension, into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), and rebuilds one whenever the build's sources or flags
differ from the cached build's; the flags name the DeepSpeed install's path. Two checkouts with their own venvs on one
machine (CI runners, worktrees) then rebuild each other's ops again and again, minutes of compiling each time, inside the
tests' timeouts. So the tests (and every rank and launch they start: the variable is inherited) cache the ops per
DeepSpeed install: one build per venv, kept across runs. A TORCH_EXTENSIONS_DIR set by the caller wins.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path


def _extensions_dir() -> str | None:
    spec = importlib.util.find_spec("deepspeed")  # no import: DeepSpeed's import costs seconds
    if spec is None or spec.origin is None:
        return None
    key = hashlib.sha1(str(Path(spec.origin).resolve().parent).encode()).hexdigest()[:10]
    return str(Path.home() / ".cache" / "torch_extensions" / f"deepspeed-{key}")


if "TORCH_EXTENSIONS_DIR" not in os.environ and (_dir := _extensions_dir()):
    os.environ["TORCH_EXTENSIONS_DIR"] = _dir
