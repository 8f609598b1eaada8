"""The random generators of a rank (Python, NumPy, torch, CUDA) as JSON: written beside a checkpoint as
``rng-<rank>.json`` and restored on the same world size. JSON, not a pickle, and checked for the shapes the generators
take before any value reaches them: a forged file fails with one line."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import numpy as np
import torch

from seqpar.plan.errors import SeqparError
from seqpar.plan.files import write_atomic
from seqpar.plan.safe import read_bytes

_MT_WORDS = 624  # the Mersenne Twister's state words (Python's and NumPy's), plus Python's position


def write(folder: Path, rank: int) -> None:
    write_atomic(folder / f"rng-{rank}.json", json.dumps(state()) + "\n")


def state() -> dict:
    version, mt, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    st = {
        "python": [version, list(mt), gauss],
        "numpy": [name, key.tolist(), pos, has_gauss, cached],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = _b64(torch.cuda.get_rng_state())
    return st


def read(folder: Path, path: Path) -> dict:
    """The state in ``path``, shaped as ``state`` makes it; SeqparError naming the file otherwise."""
    try:
        st = json.loads(read_bytes(path, what="RNG state", limit=1 << 20))
        version, mt, gauss = st["python"]
        name, key, pos, has_gauss, cached = st["numpy"]
        ok = (
            type(version) is int
            and _words(mt, _MT_WORDS + 1)
            and mt[-1] <= _MT_WORDS
            and (gauss is None or type(gauss) is float)
            and name == "MT19937"
            and _words(key, _MT_WORDS)
            and type(pos) is int
            and 0 <= pos <= _MT_WORDS
            and type(has_gauss) is int
            and type(cached) is float
            and len(base64.b64decode(st["torch"], validate=True)) == torch.get_rng_state().numel()
            and isinstance(st.get("cuda", ""), str)
        )
    except (ValueError, TypeError, KeyError, RecursionError, UnicodeDecodeError):  # binascii.Error is a ValueError
        ok = False
    if not ok:
        raise SeqparError(
            f"checkpoint {str(folder)!r}: {path.name} is not an RNG state seqpar writes; resume from another checkpoint "
            f"(edit `latest`), or start a new --output"
        )
    return st


def restore(st: dict) -> None:
    def tensor(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    version, mt, gauss = st["python"]
    random.setstate((version, tuple(mt), gauss))
    name, key, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensor(st["torch"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(st["cuda"]))


def _words(xs, n: int) -> bool:
    return isinstance(xs, list) and len(xs) == n and all(type(x) is int and 0 <= x < 2**32 for x in xs)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


__all__ = ["read", "restore", "state", "write"]
