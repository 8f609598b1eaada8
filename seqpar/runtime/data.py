"""Training data for the trainer: token sources packed into ``seq_len + 1`` windows, and who reads which window.

Sources: a ``datasets`` folder written by ``save_to_disk`` (needs the ``datasets`` package), JSONL text tokenized with a local
tokenizer, raw token files (``.bin`` of uint16 when the vocabulary fits in 16 bits, uint32 otherwise, nanoGPT's format;
``.npy`` of uint16/uint32/int), or ``synthetic`` (seeded random tokens, for benchmarks and tests).

Documents are concatenated (text documents end with the tokenizer's EOS) and cut into non-overlapping windows of
``seq_len + 1`` tokens: inputs are ``window[:-1]`` and targets ``window[1:]``, EasyContext's shift on the whole sequence.
Window order is fixed by the step alone, so a resumed run reads exactly what the uninterrupted one would have read:

    window(step, micro, dp_rank, b) = ((step * grad_accum + micro) * dp_degree + dp_rank) * micro_batch + b   (mod #windows)

Every sequence-parallel rank of a group reads the same windows (they keep their shard through ``prepare_inputs``);
different data-parallel groups read different ones. This module imports numpy only (torch lazily), so the launcher can
check data before starting any process.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from seqpar.errors import SeqparError


class TokenData:
    """A token stream cut into windows; ``batch(...)`` returns (micro_batch, seq_len + 1) int64 tensors."""

    def __init__(self, name: str, seq_len: int, vocab_size: int, tokens: np.ndarray | None = None, seed: int = 0):
        self.name, self.seq_len, self.vocab_size, self.seed = name, seq_len, vocab_size, seed
        self.tokens = tokens  # 1-D token ids; None = synthetic
        window = seq_len + 1
        if tokens is None:
            self.num_windows = 2**31 - 1
        else:
            self.num_windows = len(tokens) // window
            if self.num_windows == 0:
                raise SeqparError(
                    f"data {name!r} holds {len(tokens)} tokens, shorter than one window of seq_len + 1 = {window}; "
                    f"add data or lower seq_len"
                )

    def window(self, index: int) -> np.ndarray:
        """Tokens of window ``index`` (wrapping around the data: one more epoch), (seq_len + 1,) int64."""
        w = self.seq_len + 1
        i = index % self.num_windows
        if self.tokens is None:
            # A generator per window: any window can be produced without generating the ones before it.
            return np.random.default_rng([self.seed, i]).integers(0, self.vocab_size, size=w, dtype=np.int64)
        ids = np.asarray(self.tokens[i * w : (i + 1) * w], dtype=np.int64)
        top = int(ids.max())
        if top >= self.vocab_size:
            raise SeqparError(
                f"data {self.name!r} window {i} holds token id {top}, outside the model's vocabulary of {self.vocab_size}; "
                f"tokenize with the model's tokenizer"
            )
        return ids

    def batch(self, step: int, micro: int, dp_rank: int, *, grad_accum: int, dp_degree: int, micro_batch: int):
        """The (micro_batch, seq_len + 1) int64 tensor this data-parallel rank trains on at (step, micro)."""
        import torch

        first = ((step * grad_accum + micro) * dp_degree + dp_rank) * micro_batch
        rows = [self.window(first + b) for b in range(micro_batch)]
        return torch.from_numpy(np.stack(rows))  # (B, S + 1)


def open_data(spec: str, *, seq_len: int, vocab_size: int, seed: int = 0, tokenizer_path: str | None = None) -> TokenData:
    """Open ``spec`` ('synthetic', a .bin/.npy/.jsonl file or a datasets folder); SeqparError with one line if it cannot."""
    if spec == "synthetic":
        return TokenData("synthetic", seq_len, vocab_size, None, seed)
    p = Path(spec)
    if not p.exists():
        raise SeqparError(
            f"data path {spec!r} does not exist; pass --data synthetic, a .jsonl/.bin/.npy file or a datasets folder"
        )
    if p.is_dir():
        return TokenData(spec, seq_len, vocab_size, _from_datasets(p, tokenizer_path), seed)
    suffix = p.suffix.lower()
    if suffix == ".bin":
        dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
        if p.stat().st_size % np.dtype(dtype).itemsize:
            raise SeqparError(
                f"data file {spec!r} is not a whole number of {np.dtype(dtype).name} tokens; write it with numpy .tofile"
            )
        return TokenData(spec, seq_len, vocab_size, np.memmap(p, dtype=dtype, mode="r"), seed)
    if suffix == ".npy":
        arr = np.load(p, mmap_mode="r")
        if arr.dtype.kind not in "ui":
            raise SeqparError(f"data file {spec!r} holds {arr.dtype} values; token files must be uint16/uint32 (or int)")
        return TokenData(spec, seq_len, vocab_size, arr.reshape(-1), seed)
    if suffix in (".jsonl", ".json"):
        return TokenData(spec, seq_len, vocab_size, _from_jsonl(p, tokenizer_path), seed)
    raise SeqparError(f"data file {spec!r} has an unknown type {suffix!r}; use .jsonl (text), .bin/.npy (token ids) or synthetic")


def _tokenizer(path: str | None, what: str):
    if not path:
        raise SeqparError(
            f"{what} holds text, which needs a tokenizer; pass --model-path (or --tokenizer) with a local tokenizer folder"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise SeqparError(
            f"cannot load a tokenizer from {path!r} ({str(e).splitlines()[0]}); pass a local folder with tokenizer files"
        ) from None


def _encode(texts, tok) -> np.ndarray:
    eos = tok.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)  # document boundary inside a packed window
    return np.asarray(ids, dtype=np.int64)


def _from_jsonl(p: Path, tokenizer_path: str | None) -> np.ndarray:
    texts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SeqparError(f"data file {str(p)!r} line {n} is not JSON ({e}); write one object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise SeqparError(f'data file {str(p)!r} line {n} has no string field \'text\'; write {{"text": "..."}} per line')
        texts.append(row["text"])
    return _encode(texts, _tokenizer(tokenizer_path, f"data file {str(p)!r}"))


def _from_datasets(p: Path, tokenizer_path: str | None) -> np.ndarray:
    if not ((p / "dataset_info.json").exists() or (p / "state.json").exists() or (p / "dataset_dict.json").exists()):
        raise SeqparError(f"data folder {str(p)!r} is not a `datasets` save_to_disk folder (no dataset_info.json/state.json)")
    try:
        import datasets
    except ImportError:
        raise SeqparError(
            f"data folder {str(p)!r} is a `datasets` folder, and reading it needs the datasets package, which is not installed; "
            f"`pip install datasets`, or export it to .jsonl/.npy"
        ) from None
    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError, KeyError) as e:  # a torn or foreign folder: datasets' own words, one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SeqparError(
            f"data folder {str(p)!r} is not a readable `datasets` save_to_disk folder ({first}); re-save it"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if "input_ids" in ds.column_names:
        return np.concatenate([np.asarray(r, dtype=np.int64) for r in ds["input_ids"]])
    if "text" in ds.column_names:
        return _encode(ds["text"], _tokenizer(tokenizer_path, f"data folder {str(p)!r}"))
    raise SeqparError(f"data folder {str(p)!r} has neither an 'input_ids' nor a 'text' column (it has {ds.column_names})")
