"""Chat data as a user's SFT run sees it: a byte-level BPE tokenizer with a ChatML template (assistant turns marked with
``{% generation %}``, so TRL's assistant_only_loss and seqpar's data both score only the assistant's tokens), a tiny
Llama whose vocabulary holds it, and a JSONL of English conversations of uneven lengths (so packing leaves a short
last row, as on real data). What the Trainer, export and eval tests of chat data share."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
# ChatML, the assistant's content and its end-of-turn token inside the generation marks (trained to stop)
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VOCAB = 264  # 256 bytes + the special tokens, rounded up
WORDS = (
    "the a model reads long text and answers each question about it with care while the data moves between ranks "
    "of one group so every token sees its past attention keys values split over devices memory grows with length "
    "what is how does why can you explain sequence parallel training loss step batch window document chat user"
).split()


def byte_tokenizer(folder: Path | str):
    """A byte-level BPE tokenizer (the 256 bytes, no merges: GPT-2's byte alphabet) with ChatML's special tokens and
    chat template, saved in ``folder``; returns the PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def tiny_llama(vocab: int = VOCAB, seq: int = 512):
    """A seeded 2-layer Llama (GQA) for the byte tokenizer, fp32."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=seq, use_cache=False, pad_token_id=SPECIAL_IDS["pad"],
        eos_token_id=SPECIAL_IDS["eos"], bos_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).float()


SPECIAL_IDS = {"eos": 257, "pad": 258}  # <|im_start|> is 256: the ids add_special_tokens gives after the 256 bytes


def sentence(rng, lo: int, hi: int) -> str:
    return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), int(rng.integers(lo, hi))))


def conversations(n: int = 24, seed: int = 0) -> list[dict]:
    """``n`` rows {"messages": [...]}: a system prompt on some, one or two user/assistant turns of uneven lengths."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n):
        msgs = [{"role": "system", "content": "be brief"}] if k % 3 == 0 else []
        for _ in range(1 + k % 2):
            msgs += [
                {"role": "user", "content": sentence(rng, 2, 8) + "?"},
                {"role": "assistant", "content": sentence(rng, 3, 14) + "."},
            ]
        rows.append({"messages": msgs})
    return rows


def write_chats(path: Path, n: int = 24, seed: int = 0) -> Path:
    """``conversations(n, seed)`` as a JSONL file, one row a line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in conversations(n, seed)))
    return path
