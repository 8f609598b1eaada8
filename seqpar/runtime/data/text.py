"""Text and chat documents to token ids with the `datasets` library: read, check, tokenize (batched, several processes,
a progress bar) and write one cache entry (seqpar.runtime.data.cache) of flat arrays.

Rows: a JSONL line ``{"text": "..."}`` is a text document (its tokens, then the tokenizer's EOS, all scored); a line
``{"messages": [{"role": ..., "content": ...}, ...]}`` is a chat, rendered with the tokenizer's chat template
(``apply_chat_template``), of which only the assistant's tokens are scored. A ``save_to_disk`` folder with a ``text``
or ``messages`` column is read the same way. The assistant tokens come from transformers' own
``return_assistant_tokens_mask`` when the template marks them with ``{% generation %}``; otherwise from rendering
prefixes: for the k-th message, when it is the assistant's, the characters between the render of the messages before
it (with the generation prompt) and the render up to it, mapped to tokens by the fast tokenizer's offsets (a token
overlapping the span is the assistant's, transformers' rule). A template that renders a conversation other than as
its beginnings followed by the rest is refused with one line (add ``{% generation %}`` markers to it).

Entry files: ``tokens.npy`` (uint16 when the vocabulary fits, else uint32), ``offsets.npy`` (int64, n+1: document i is
tokens[offsets[i]:offsets[i+1]]), ``lines.npy`` (the JSONL line, or the row, of each document: for error messages),
``scored.npy`` (uint8 per token, only when the data holds chats), ``meta.json``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np

from seqpar.plan.errors import SeqparError
from seqpar.plan.extras import install_line
from seqpar.plan.safe import printable
from seqpar.runtime.data import cache as data_cache
from seqpar.runtime.data.hf_folder import refuse_remote_code, shown

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test for the keyword
ROW_SHAPE = '{"text": "..."} or {"messages": [{"role": "user", "content": "..."}, ...]}'


def require_datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise SeqparError(
            f"{what} is tokenized with the `datasets` package, which is not installed; {install_line('runtime')} "
            "(or pip install datasets), or pass pre-tokenized .npy/.bin token files"
        ) from None
    return datasets


def load_tokenizer(path: str | None, what: str, *, trust_remote_code: bool = False):
    """The tokenizer of a local folder (seqpar.runtime.data.hf_folder: no custom code unless ``trust_remote_code``)."""
    if not path:
        raise SeqparError(
            f"{what} holds text, which needs a tokenizer; pass --model-path (or --tokenizer) with a local tokenizer folder"
        )
    # a path that is no folder here: said as such, where transformers would read it as a Hub repo id (org/name, from
    # the local cache only) and answer with the Hub's naming rules
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or Path(path).expanduser().is_file():
        if not Path(path).expanduser().is_dir():
            raise SeqparError(
                f"tokenizer {path!r} is not a folder ({'a file' if Path(path).expanduser().exists() else 'no such path'}); "
                "pass a local folder with the tokenizer's files (tokenizer.json or tokenizer_config.json), e.g. the "
                "model's folder"
            )
    from transformers import AutoTokenizer

    if Path(path).expanduser().is_dir():
        refuse_remote_code(Path(path).expanduser(), "tokenizer folder", trust_remote_code)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SeqparError(
            f"cannot load a tokenizer from {shown(path)} ({printable(first)}); pass a local folder with tokenizer files"
        ) from None


def mask_method(tok) -> str:
    """'generation' (the template marks assistant text) or 'prefix' (found by rendering prefixes)."""
    return "generation" if GENERATION.search(getattr(tok, "chat_template", None) or "") else "prefix"


# --------------------------------------------------------------------------------------------- reading rows


def jsonl_rows(path: Path):
    """Rows {"text", "messages" (JSON text), "line"} of a JSONL file, checked line by line (one line naming the first
    bad one: not UTF-8, not JSON (a number of more digits than Python reads, nesting past the parser's depth, a lone
    surrogate escape such as \\ud800, which is no text), or neither a text nor a chat row)."""
    where = f"data file {shown(path)}"
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SeqparError(
                    f"{where} line {n} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as e:  # JSONDecodeError, "Exceeds the limit (4300 digits)", depth
                reason = "nests too deeply" if isinstance(e, RecursionError) else printable(e)
                raise SeqparError(f"{where} line {n} is not JSON ({reason}); write one object per line: {ROW_SHAPE}") from None
            if "\\u" in line and _has_surrogate(row):
                raise SeqparError(
                    f"{where} line {n} holds a lone surrogate escape (\\ud800-\\udfff), which is not text; write the "
                    "character itself, or its escaped surrogate pair"
                )
            yield _checked(row, f"{where} line {n}") | {"line": n}


def _has_surrogate(obj) -> bool:
    """Whether a JSON value holds a lone UTF-16 surrogate in a string (JSON's \\ud800 escapes decode to one; it cannot be
    written as UTF-8, so tokenizers and Arrow fail on it)."""
    if isinstance(obj, str):
        return any("\ud800" <= ch <= "\udfff" for ch in obj)
    if isinstance(obj, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_surrogate(v) for v in obj)
    return False


def _checked(row, where: str) -> dict:
    if isinstance(row, dict) and isinstance(row.get("text"), str):
        return {"text": row["text"], "messages": None}
    msgs = row.get("messages") if isinstance(row, dict) else None
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
        return {"text": None, "messages": json.dumps(msgs)}
    if isinstance(row, dict) and "messages" in row:
        raise SeqparError(
            f'{where} has \'messages\' that are not a non-empty list of {{"role": ..., "content": ...}} objects; '
            f"write {ROW_SHAPE}"
        )
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise SeqparError(f"{where} is neither a text nor a chat row (it has {keys}); write {ROW_SHAPE}")


# --------------------------------------------------------------------------------------------- tokenizing


def _assistant_mask_by_prefixes(tok, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    full = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True) if k else ""
        upto = tok.apply_chat_template(messages[: k + 1], tokenize=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise SeqparError(
                f"{where}: the chat template renders this conversation other than as its beginnings followed by the rest, "
                "so the assistant's tokens cannot be found by rendering prefixes; use a template that marks them with "
                "{% generation %} ... {% endgeneration %}"
            )
        spans.append((len(before), len(upto)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(e > a and s < b for a, b in spans)) for s, e in enc["offset_mapping"]]
    return enc["input_ids"], mask


def _chat(tok, messages, method: str, where: str) -> tuple[list[int], list[int]]:
    if isinstance(messages, str):
        messages = json.loads(messages)
    try:
        if method == "generation":
            out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), list(out["assistant_masks"])
        return _assistant_mask_by_prefixes(tok, messages, where)
    except SeqparError:
        raise
    except Exception as e:  # jinja's own refusals ("roles must alternate"), a template that needs other fields
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SeqparError(f"{where}: the tokenizer's chat template refused these messages ({first}); fix the row") from None


def encode_batch(batch: dict, tok, *, method: str, chat: bool, where: str) -> dict:
    """``datasets.map`` function (batched): {"input_ids", "line"} (+ "scored" when the data holds chats); ``where``
    names a row in errors, followed by its number ("data file 'x.jsonl' line")."""
    eos = tok.eos_token_id
    texts = [i for i, t in enumerate(batch["text"]) if t is not None]
    ids: list = [None] * len(batch["line"])
    scored: list = [None] * len(batch["line"])
    if texts:  # one batched call for the text rows
        enc = tok([batch["text"][i] for i in texts], add_special_tokens=False)["input_ids"]
        for i, e in zip(texts, enc):
            ids[i] = list(e) + ([eos] if eos is not None else [])  # the document's end, scored: the model learns to stop
            scored[i] = [1] * len(ids[i])
    for i, msgs in enumerate(batch["messages"]):
        if msgs is not None:
            ids[i], scored[i] = _chat(tok, msgs, method, f"{where} {batch['line'][i]}")
    out = {"input_ids": ids, "line": batch["line"]}
    if chat:
        out["scored"] = scored
    return out


def _unwrap(e: BaseException) -> SeqparError | None:
    """The SeqparError under `datasets`' wrapping of a generator's or a worker's exception."""
    seen = e
    while seen is not None:
        if isinstance(seen, SeqparError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def build(tmp: Path, *, source, tok, procs: int | None, where: str, unit: str = "line") -> dict:
    """Write the entry's arrays into ``tmp``. source: a JSONL Path, or a datasets.Dataset with the columns text,
    messages and line (its row numbers); ``where`` names the data in errors, ``unit`` a row of it ("line", "row")."""
    datasets = require_datasets(where)
    # bars on a terminal only (as the trainer's): elsewhere an error stays the one line a log or a test reads
    quiet = not sys.stderr.isatty() and datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        return _build(tmp, datasets, source=source, tok=tok, procs=procs, where=where, unit=unit)
    finally:
        if quiet:
            datasets.enable_progress_bars()


def _build(tmp: Path, datasets, *, source, tok, procs: int | None, where: str, unit: str) -> dict:
    features = datasets.Features(
        {"text": datasets.Value("string"), "messages": datasets.Value("string"), "line": datasets.Value("int64")}
    )
    try:
        if isinstance(source, Path):
            with open(source, "rb") as f:  # datasets refuses a generator that yields nothing with a message of its own
                if not any(line.strip() for line in f):
                    raise SeqparError(f"{where} holds no documents; pass a file with at least one {ROW_SHAPE} line")
            ds = datasets.Dataset.from_generator(
                jsonl_rows, gen_kwargs={"path": source}, features=features, cache_dir=str(tmp / "hf")
            )
        else:
            ds = source
        if len(ds) == 0:
            raise SeqparError(f"{where} holds no documents; pass a file with at least one {ROW_SHAPE} line")
        chat = ds.data.column("messages").null_count < len(ds)
        if chat and not getattr(tok, "chat_template", None):
            raise SeqparError(
                f"{where} holds chats ('messages'), and the tokenizer {tok.name_or_path!r} has no chat template; use the "
                'tokenizer of a chat model (its folder has chat_template.jinja or tokenizer_config.json "chat_template")'
            )
        if chat and not tok.is_fast:
            raise SeqparError(f"{where} holds chats, whose assistant tokens need a fast tokenizer (offsets); use one")
        method = mask_method(tok) if chat else None
        n_procs = max(1, min(procs or os.cpu_count() or 1, len(ds) // 1000))  # processes cost seconds: not for small data
        out_features = {"input_ids": datasets.Sequence(datasets.Value("int32")), "line": datasets.Value("int64")}
        if chat:
            out_features["scored"] = datasets.Sequence(datasets.Value("uint8"))
        mapped = ds.map(
            encode_batch,
            fn_kwargs={"tok": tok, "method": method, "chat": chat, "where": f"{where} {unit}"},
            batched=True,
            num_proc=n_procs if n_procs > 1 else None,
            remove_columns=ds.column_names,
            features=datasets.Features(out_features),
            cache_file_name=str(tmp / "hf" / "tokenized.arrow"),
            desc=f"tokenizing {where}",
        )
    except Exception as e:
        found = _unwrap(e)
        if found is None:
            raise
        raise found from None
    meta = write_arrays(tmp, mapped, chat, len(tok))
    shutil.rmtree(tmp / "hf", ignore_errors=True)  # datasets' intermediate arrow files: the arrays are the entry
    meta.update(kind="chat" if chat else "text", mask=method, tokenizer=str(tok.name_or_path), processes=n_procs)
    data_cache.write_meta(tmp, meta)
    return meta


def write_arrays(tmp: Path, mapped, chat: bool, vocab: int) -> dict:
    """tokens.npy, offsets.npy, lines.npy (and scored.npy) of a dataset with the columns input_ids and line (and
    scored); the counts for meta.json."""
    import pyarrow.compute as pc

    table = mapped.data
    ids_col = table.column("input_ids")
    lengths = np.concatenate([pc.list_value_length(c).to_numpy(zero_copy_only=False) for c in ids_col.chunks]).astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    tokens = np.lib.format.open_memmap(tmp / "tokens.npy", mode="w+", dtype=dtype, shape=(int(offsets[-1]),))
    scored = np.lib.format.open_memmap(tmp / "scored.npy", mode="w+", dtype=np.uint8, shape=tokens.shape) if chat else None
    top, low, at = -1, 0, 0
    for batch in table.to_batches():  # record batches keep the columns aligned
        flat = batch.column("input_ids").flatten().to_numpy(zero_copy_only=False)
        if flat.size:
            top, low = max(top, int(flat.max())), min(low, int(flat.min()))
            tokens[at : at + flat.size] = flat
            if chat:
                scored[at : at + flat.size] = batch.column("scored").flatten().to_numpy(zero_copy_only=False)
        at += flat.size
    tokens.flush()
    if scored is not None:
        scored.flush()
    np.save(tmp / "offsets.npy", offsets)
    np.save(tmp / "lines.npy", np.asarray(table.column("line").to_numpy(), dtype=np.int64))
    counts = {"documents": len(lengths), "tokens": int(offsets[-1]), "longest": int(lengths.max(initial=0))}
    return counts | {"max_token_id": top, "min_token_id": low}
