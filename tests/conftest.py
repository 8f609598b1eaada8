"""pytest setup shared by every test file: where DeepSpeed's CPU ops are built and cached, and the session fixture that
builds them.

The helpers the tests share are modules of ``seqpar_testing`` rather than fixtures, because rank bodies run them in
other processes and module-level case lists need them at import: ``seqpar_testing`` (the rank harness: one forkserver,
W gloo ranks), ``seqpar_testing.train`` (the tiny model's plans and the trainer on ranks), ``seqpar_testing.hf``,
``.memory``, ``.attention``, ``.data``, ``.advisor`` and ``.cli``; ``reference`` (float64 attention) and ``hub_cache``
(an offline Hub cache) beside them.

DeepSpeed JIT-builds its CPU ops (CPU Adam, shared-memory collectives) with torch's cpp_extension, into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), and rebuilds one whenever the build's sources or flags
differ from the cached build's; the flags name the DeepSpeed install's path. Two checkouts with their own venvs on one
machine (CI runners, worktrees) then rebuild each other's ops again and again, minutes of compiling each time, inside the
tests' timeouts. The ninja that runs the build counts too: its build log keeps a hash of each command, ninja versions
hash differently (1.11 and 1.13 do), and the ninja found first on PATH is the venv's when it is activated and the
system's when the venv's python runs alone, so runs of the two kinds rebuilt each other's ops. So the tests (and every
rank and launch they start: the variable is inherited) cache the ops per DeepSpeed install and ninja: one build each,
kept across runs. A TORCH_EXTENSIONS_DIR set by the caller wins.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest


def _extensions_dir() -> str | None:
    spec = importlib.util.find_spec("deepspeed")  # no import: DeepSpeed's import costs seconds
    if spec is None or spec.origin is None:
        return None
    ninja = shutil.which("ninja")  # what torch's cpp_extension runs
    build = f"{Path(spec.origin).resolve().parent}\0{Path(ninja).resolve() if ninja else ''}"
    key = hashlib.sha1(build.encode()).hexdigest()[:10]
    return str(Path.home() / ".cache" / "torch_extensions" / f"deepspeed-{key}")


if "TORCH_EXTENSIONS_DIR" not in os.environ and (_dir := _extensions_dir()):
    os.environ["TORCH_EXTENSIONS_DIR"] = _dir

# Checkpoints are signed with a key per user, in ~/.config (seqpar.runtime.checkpoint.integrity): the tests, and every rank
# and launch they start (the variable is inherited), sign with a key of their own session, never the user's.
os.environ["SEQPAR_RUN_KEY_FILE"] = str(Path(tempfile.mkdtemp(prefix="seqpar-test-key-")) / "run-key")


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed JIT-builds two CPU ops on first use, its shared-memory collectives and CPU Adam (about 2 and 3 minutes of
    one core; then cached per DeepSpeed install, above): build them once, side by side, before W ranks would race to build
    them inside their timeout. Nothing without DeepSpeed (its tests skip, or run their plans on FSDP2)."""
    if importlib.util.find_spec("deepspeed") is None:
        return
    from concurrent.futures import ThreadPoolExecutor

    from deepspeed.accelerator import get_accelerator

    builders = [get_accelerator().create_op_builder(name) for name in ("ShareMemCommBuilder", "CPUAdamBuilder")]
    with ThreadPoolExecutor(len(builders)) as pool:
        list(pool.map(lambda b: b.load(verbose=False), builders))
