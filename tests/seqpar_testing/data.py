"""The data tests' inputs: a word-level tokenizer with a chat template (and the same template without transformers'
generation marks), and a JSONL corpus mixing text documents, an empty one, one longer than a window and chats."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = ["<pad>", "</s>", "<user>", "<assistant>", "<system>"] + [f"w{i}" for i in range(200)]
# A chat template that marks the assistant's text with {% generation %} (transformers' assistant mask), and the same
# template without the marks (seqpar finds the assistant's tokens by rendering prefixes).
TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '> ' }}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] + ' </s> ' }}{% endgeneration %}{% else %}{{ m['content'] + ' </s> ' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
)
PLAIN = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def make_tokenizer(folder: Path, template: str | None = TEMPLATE) -> str:
    """A word-level fast tokenizer (whitespace split, 206 ids: fits the tiny model's 256) saved in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)} | {"[UNK]": len(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="[UNK]", pad_token="<pad>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return str(folder)


def text(rng, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in rng.integers(0, 200, n))


def write_corpus(path: Path, *, seed: int = 0, docs: int = 40, long: int = 150, chats: int = 4) -> Path:
    """A JSONL of text documents of 0 to 40 words (a 1-token document: only EOS), one of ``long`` words (longer than
    a 64-token window) and ``chats`` conversations of two turns."""
    rng = np.random.default_rng(seed)
    rows = [{"text": text(rng, int(n))} for n in rng.integers(0, 40, docs)]
    rows[3] = {"text": text(rng, long)}
    rows[5] = {"text": ""}
    for _ in range(chats):
        turns = [("user", 3), ("assistant", 5), ("user", 2), ("assistant", 4)]
        rows.append({"messages": [{"role": r, "content": text(rng, n)} for r, n in turns]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
