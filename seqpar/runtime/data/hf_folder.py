"""A Hugging Face model or tokenizer folder (``--model-path``, ``--tokenizer``) read as data, never as code.

* Its JSON files (config.json, tokenizer_config.json) are read bounded: a regular file (a FIFO would block), at most
  ``CONFIG_LIMIT`` bytes, an object; anything else is one line naming the file.
* Custom code: a folder whose config.json or tokenizer_config.json has ``auto_map`` asks transformers to import Python
  shipped in the folder (``trust_remote_code``). seqpar refuses such a folder with one line naming the file, unless the
  user passes ``--trust-remote-code``; every ``from_pretrained`` in seqpar passes ``trust_remote_code`` explicitly, so
  transformers never asks "run custom code? [y/N]" on a rank's terminal. A folder with ``auto_map`` and a model_type
  transformers knows would load with transformers' own class instead of the one the folder names: refused too, since
  the model would not be the one its authors meant.
* Weights: only safetensors (``model.safetensors`` or a sharded ``model.safetensors.index.json``). ``pytorch_model.bin``
  and other pickles can run code when loaded; a folder holding only those is refused with the fix (convert it).

Pure Python (json, os): every loader of a folder in seqpar checks with it first, the CLI's and the launcher's before any
rank starts, and the ranks' again.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from seqpar.plan.errors import SeqparError
from seqpar.plan.safe import printable

CONFIG_LIMIT = 1 << 25  # bytes: a config.json is a few KiB; a tokenizer_config.json with its added tokens a few MiB
CODE_FILES = ("config.json", "tokenizer_config.json")  # where transformers reads auto_map from
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
TRUST_FLAG = "--trust-remote-code"


def shown(path: str | Path) -> str:
    """A path as an error line shows it: escaped, quoted."""
    return repr(printable(str(path)))


def read_config(folder: str | Path, name: str, what: str) -> dict | None:
    """The JSON object in ``folder/name``; None when there is no such file. SeqparError (one line) when it is not a
    regular file (the Hub cache links its files into blobs/: links are followed here, FIFOs and devices refused), is
    over CONFIG_LIMIT bytes, or is not a JSON object."""
    path = Path(folder) / name
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SeqparError(f"{what} {shown(path)} cannot be read ({e.strerror}); pass a folder you can read") from None
    if not stat.S_ISREG(st.st_mode):
        raise SeqparError(f"{what} {shown(path)} is not a regular file; pass a Hugging Face folder of plain files")
    if st.st_size > CONFIG_LIMIT:
        raise SeqparError(
            f"{what} {shown(path)} holds {st.st_size} bytes, more than the {CONFIG_LIMIT} a {name} can hold; it is not "
            "one transformers wrote"
        )
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        raw = f.read(CONFIG_LIMIT + 1)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8 or JSON, a 5000-digit number, nesting past the parser's depth
        reason = "nests too deeply" if isinstance(e, RecursionError) else printable(str(e).splitlines()[0] if str(e) else e)
        raise SeqparError(f"{what} {shown(path)} is not valid JSON ({reason}); restore the file") from None
    if not isinstance(data, dict):
        raise SeqparError(f"{what} {shown(path)} holds a {type(data).__name__}, not a JSON object; restore the file")
    return data


def refuse_remote_code(folder: str | Path, what: str, trust_remote_code: bool) -> None:
    """SeqparError naming the file when ``folder`` asks for custom code (``auto_map``) and the user did not pass
    ``--trust-remote-code``."""
    if trust_remote_code:
        return
    for name in CODE_FILES:
        cfg = read_config(folder, name, what)
        if cfg and cfg.get("auto_map"):
            auto = cfg["auto_map"]
            classes = ", ".join(map(str, auto)) if isinstance(auto, (dict, list)) else str(auto)
            raise SeqparError(
                f"{what} {shown(folder)}: {name} asks for custom code (auto_map: {printable(classes, 120)}), Python "
                f"shipped in the folder that loading would run; seqpar runs none unless you pass {TRUST_FLAG} (only "
                f"for a folder you trust), or use a folder without auto_map"
            )


def check_weights(folder: str | Path, what: str = "--model-path") -> None:
    """SeqparError unless ``folder`` holds safetensors weights; a folder of pickled weights is told how to convert."""
    p = Path(folder)
    names = sorted(x.name for x in p.iterdir())
    if any(n in names for n in SAFETENSORS):
        return
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise SeqparError(
            f"{what} {shown(p)} holds its weights as a pickle ({printable(pickles[0])}), which can run code when "
            f"loaded; seqpar loads only safetensors: convert it once where you trust the file (load it with "
            f"transformers and save_pretrained it to a new folder, which writes model.safetensors) and pass that folder"
        )
    raise SeqparError(
        f"{what} {shown(p)} holds no model.safetensors (nor model.safetensors.index.json); pass a folder written by "
        "save_pretrained"
    )


__all__ = ["CONFIG_LIMIT", "TRUST_FLAG", "check_weights", "read_config", "refuse_remote_code", "shown"]
