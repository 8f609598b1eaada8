"""Document lengths from a sample of the training data (`seqpar advise --data FILE`), read without torch, numpy or a tokenizer.

So it is an approximation, said here:
* ``.jsonl`` / ``.json`` (``{"text": ...}`` or ``{"messages": [...]}`` per line; the first SAMPLE_DOCS documents):
  characters / 4 tokens (the usual ratio of English BPE tokenizers) plus 1 for the EOS seqpar.runtime.data.windows appends to a
  text; a chat sample's characters / 4 plus 4 tokens per message for the chat template's role markers.
* ``.bin`` / ``.npy`` token ids (the first SAMPLE_TOKENS tokens): exact lengths, documents ending at ``--eos-id`` as
  seqpar.runtime.data.windows writes them (a trailing piece without EOS is dropped unless the file ends there). ``.bin`` holds
  uint16 ids when the model's vocabulary fits in 16 bits, uint32 otherwise (seqpar.runtime.data.windows's rule); ``.npy`` is read
  from its header (numpy's format: magic, version, a Python dict literal).
* ``synthetic`` (seeded random tokens) has no documents: no mix. A ``datasets`` folder is not read (it needs that package).
"""

from __future__ import annotations

import array
import ast
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

from seqpar.plan.errors import SeqparError

SAMPLE_DOCS = 100_000  # JSONL documents read from the start of the file
SAMPLE_TOKENS = 1 << 25  # token ids read from the start of a .bin/.npy file (32M: 64 MiB of uint16)
CHARS_PER_TOKEN = 4
MESSAGE_TOKENS = 4  # a chat template's role markers per message (Llama-3's header is 4-5 tokens)


def _jsonl_lengths(p: Path, name: str) -> list[int]:
    out: list[int] = []
    with p.open(encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if len(out) >= SAMPLE_DOCS:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # ValueError: also an integer of over 4300 digits
                raise SeqparError(f'{name} line {i} is not a JSON object; write one {{"text": ...}} per line') from None
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                out.append(math.ceil(len(row["text"]) / CHARS_PER_TOKEN) + 1)
            elif isinstance(row, dict) and isinstance(row.get("messages"), list):
                msgs = [m for m in row["messages"] if isinstance(m, dict)]
                chars = sum(len(_content(m.get("content"))) for m in msgs)
                out.append(max(1, math.ceil(chars / CHARS_PER_TOKEN) + MESSAGE_TOKENS * len(msgs)))
            else:
                raise SeqparError(f'{name} line {i} has neither a "text" string nor a "messages" list; fix the line')
    if not out:
        raise SeqparError(f'{name} holds no documents; write one {{"text": ...}} per line')
    return out


def _content(c) -> str:
    """A message's text: a string, or the text parts of a list of parts (transformers' multimodal form)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(x.get("text", "") for x in c if isinstance(x, dict) and isinstance(x.get("text"), str))
    return ""


_TYPECODES = {
    ("u", 1): "B",
    ("u", 2): "H",
    ("u", 4): "I",
    ("u", 8): "Q",
    ("i", 1): "b",
    ("i", 2): "h",
    ("i", 4): "i",
    ("i", 8): "q",
}


def _npy_header(f, name: str) -> tuple[str, bool, int]:
    """(kind+size descr, big-endian, header end) of a .npy file (numpy's format: magic, version, a Python dict literal)."""
    magic = f.read(8)
    if magic[:6] != b"\x93NUMPY":
        raise SeqparError(f"{name} is not a .npy file (no NUMPY magic); save it with numpy.save")
    size = int.from_bytes(f.read(2 if magic[6] == 1 else 4), "little")
    try:
        header = ast.literal_eval(f.read(size).decode("latin1"))
        descr = header["descr"]
    except (ValueError, SyntaxError, KeyError, TypeError):
        raise SeqparError(f"{name} has an unreadable .npy header; save it with numpy.save") from None
    if not isinstance(descr, str) or len(descr) < 3 or descr[1] not in "ui":
        raise SeqparError(f"{name} holds {descr!r} values; token files must hold unsigned or signed integers")
    return descr[1:], descr[0] == ">", f.tell()


def _token_lengths(p: Path, name: str, eos_id: Optional[int], vocab_size: int) -> list[int]:
    if eos_id is None:
        raise SeqparError(
            f"{name} holds token ids: give the id that ends each document with --eos-id (e.g. 2 for Llama-2, 128001 for "
            f"Llama-3), or the lengths with --doc-lens"
        )
    with p.open("rb") as f:
        if p.suffix.lower() == ".npy":
            descr, big, start = _npy_header(f, name)
            code = _TYPECODES.get((descr[0], int(descr[1:]) if descr[1:].isdigit() else 0))
            if code is None or array.array(code).itemsize != int(descr[1:]):
                raise SeqparError(f"{name}: token ids of type {descr!r} are not supported; save uint16/uint32/int32/int64 ids")
        else:
            code, big, start = ("H" if vocab_size <= 2**16 else "I"), False, 0
        item = array.array(code).itemsize
        f.seek(start)
        raw = f.read(SAMPLE_TOKENS * item)
        whole = len(raw) < SAMPLE_TOKENS * item  # the sample reaches the end of the file
    ids = array.array(code, raw[: len(raw) - len(raw) % item])
    if big != (sys.byteorder == "big"):
        ids.byteswap()
    out, pos = [], 0
    while True:
        try:
            end = ids.index(eos_id, pos)
        except ValueError:
            break
        out.append(end + 1 - pos)  # the document and its EOS
        pos = end + 1
    if not out:
        raise SeqparError(
            f"{name}: no EOS id {eos_id} in its first {len(ids)} tokens, so no document boundary to measure; check "
            f"--eos-id, or give the lengths with --doc-lens"
        )
    if whole and pos < len(ids):
        out.append(len(ids) - pos)  # the last document, without an EOS
    return out


def sample_data(spec: str, vocab_size: int, eos_id: Optional[int] = None) -> Optional[tuple[list[tuple[int, int]], str]]:
    """The document lengths of a sample of ``spec`` (module docstring) as sorted (length, count) pairs, with a line saying
    where they come from (seqpar.advisor.doc_lens bins them into a mix); None for synthetic data (no documents)."""
    if spec == "synthetic":
        return None
    p = Path(spec)
    name = f"--data {spec!r}"
    if p.is_dir():
        raise SeqparError(f"{name} is a datasets folder, which the advisor does not read; give --doc-lens or --mean-doc-len")
    if not p.is_file():
        raise SeqparError(f"{name} does not exist; give a .jsonl, .bin or .npy file (or --doc-lens / --mean-doc-len)")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        lengths, how = _jsonl_lengths(p, name), f"characters/{CHARS_PER_TOKEN} tokens"
    elif suffix in (".bin", ".npy"):
        lengths, how = _token_lengths(p, name, eos_id, vocab_size), f"documents ending at EOS id {eos_id}"
    else:
        raise SeqparError(f"{name} has an unknown type {suffix!r}; use .jsonl (text), .bin/.npy (token ids) or --doc-lens")
    counts = Counter(lengths)
    return sorted(counts.items()), f"sample of {p.name}: {len(lengths)} document(s), {how}"


__all__ = ["sample_data"]
