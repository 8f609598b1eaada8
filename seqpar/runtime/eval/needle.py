"""The needle-in-a-haystack sweep of ``seqpar eval needle``: prompts of exactly each requested length with a needle at
each depth, scored in one forward by teacher forcing.

Scoring (EasyContext's eval_needle.py, github.com/jzhang38/EasyContext): the answer is appended to the prompt and the
model reads it teacher-forced; a cell is an exact match when every answer token is the argmax at the position that
predicts it. The same forward also gives the log-likelihood of the answer given the haystack (the sum of the answer
tokens' log-probabilities), a graded score that still moves when exact match is 0 or 1. Both come from the per-token
scores of seqpar.runtime.eval.run.score, which every sequence-parallel rank computes for its own positions and one
all-reduce assembles: exact under any mode and degree.

Prompts, ``seq_len`` tokens each, the haystack trimmed to fit (so every prompt splits like a training window):
* with a tokenizer: EasyContext's text without its city names: [BOS] "This is a very long story book: <book>"
  + haystack with "\\nThe special magic number is: NNNNNNN.\\n" inserted at ``depth`` of it (moved forward to just after
  the next sentence end, as EasyContext does) + "</book>.\\n Based on the content of the book, Question: What is the
  special magic number? Answer: The special magic number is:" + the number. The haystack is the held-out data (--data,
  tokenized) or FILLER, prose written for seqpar and given to the public domain, repeated.
* without a tokenizer (the tiny model): token ids. A fixed random key (4 ids) and value (7 ids) form the needle, the
  question is a fixed random marker (4 ids) followed by the key, the answer is the value; the haystack is held-out
  tokens or seeded random ids.
Numbers are 7-digit (10^6 .. 10^7 - 1), drawn once from a fixed seed: sample s of every cell uses the same needle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seqpar.plan.errors import SeqparError

NEEDLE_SEED = 24242424  # EasyContext's eval_needle.py seed
PREFIX = "This is a very long story book: <book>"
NEEDLE = "\nThe special magic number is: {}.\n"
QUESTION = (
    "</book>.\n Based on the content of the book, Question: What is the special magic number? "
    "Answer: The special magic number is:"
)
FILLER = (
    "The ferry left the harbour at first light, and the gulls followed it until the town was only a line of roofs. "
    "On the deck a boy counted the buoys aloud while his grandmother mended a net with quick, patient hands. "
    "The wind came from the west and smelled of rain, though the sky stayed clear all morning. "
    "By noon the island rose out of the water, green at the top and grey where the cliffs met the sea. "
    "Nobody on the boat spoke much; they watched the water change colour as the bottom came closer. "
    "The keeper of the lighthouse waved from the rocks, and the captain answered with two short blasts of the horn. "
    "In the village the bakery had opened early, and the smell of bread drifted down the lane to the quay. "
    "Children ran along the wall, daring each other to jump into the cold green water of the harbour. "
    "An old dog slept in the doorway of the post office and did not move for anyone, not even the postman. "
    "In the afternoon the clouds came in low, and the first drops fell on the slate roofs like scattered seeds. "
    "The fishermen pulled their boats higher on the shingle and sat in the shelter to mend what the week had torn. "
    "When the lamps were lit the whole street glowed, and the sound of a fiddle came from the inn by the church. "
)


@dataclass(frozen=True)
class Prompt:
    seq_len: int
    depth: float  # where the needle sits, as a fraction of the haystack
    sample: int
    ids: np.ndarray  # (seq_len,) int64: the whole prompt, the answer last
    answer: np.ndarray  # (a,) int64: the prompt's last a ids
    needle_at: int  # index of the needle's first token
    number: str  # the needle's number (text prompts) or its value ids (token prompts)


def _tokenizer(path: str | None, trust_remote_code: bool = False):
    """A local tokenizer, or None when ``path`` holds none (token-id prompts then). A folder that asks for custom code
    is refused (seqpar.runtime.data.hf_folder), never read as one without a tokenizer."""
    if not path:
        return None
    from transformers import AutoTokenizer

    from seqpar.runtime.data.hf_folder import refuse_remote_code

    if Path(path).is_dir():
        refuse_remote_code(path, "tokenizer folder", trust_remote_code)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None


def _stream(data: str | None, tok, vocab: int, n: int, seed: int, trust_remote_code: bool = False) -> np.ndarray:
    """n haystack tokens: the held-out data's token stream (repeated when shorter), else FILLER or seeded random ids."""
    if data and data != "synthetic":
        from seqpar.runtime.data.windows import open_data

        src = open_data(
            data,
            seq_len=1,
            vocab_size=vocab,
            seed=seed,
            tokenizer_path=getattr(tok, "name_or_path", None),
            trust_remote_code=trust_remote_code,
        )
        base = np.asarray(src.tokens, dtype=np.int64)
        top = int(base.max())
        if top >= vocab:
            raise SeqparError(
                f"data {data!r} holds token id {top}, outside the model's vocabulary of {vocab}; tokenize with its tokenizer"
            )
    elif tok is not None and data is None:
        base = np.asarray(tok(FILLER, add_special_tokens=False)["input_ids"], dtype=np.int64)
    else:
        return np.random.default_rng([seed, 1]).integers(0, vocab, size=n, dtype=np.int64)
    return np.resize(base, n) if n else base[:0]


def _text_parts(tok, number: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """(prefix, needle, question, answer) ids; the answer is cut from the question+answer text tokenized together, so
    it is tokenized as it would be in running text."""
    enc = lambda s: list(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    q, qa = enc(QUESTION), enc(f"{QUESTION} {number}")
    answer = qa[len(q) :] if qa[: len(q)] == q and len(qa) > len(q) else enc(number)
    return bos + enc(PREFIX), enc(NEEDLE.format(number)), q, answer


def _id_parts(vocab: int, rng: np.random.Generator, samples: int) -> tuple[list, list[list[int]], list[int], list]:
    key, marker = rng.integers(0, vocab, 4).tolist(), rng.integers(0, vocab, 4).tolist()
    values = [rng.integers(0, vocab, 7).tolist() for _ in range(samples)]
    return [], [key + v for v in values], marker + key, values


def _sentence_end(hay: np.ndarray, idx: int, tok) -> int:
    """Move a text insertion point forward to just after the next sentence end (EasyContext's rule); ids stay put."""
    if tok is None or idx in (0, len(hay)):
        return idx
    window = hay[idx : idx + 512]
    ends = {t for t in set(window.tolist()) if tok.decode([t]).rstrip().endswith(".")}
    for j, t in enumerate(window.tolist()):
        if t in ends:
            return idx + j + 1
    return idx


def build_prompts(
    lengths: list[int],
    depths: list[float],
    samples: int,
    tokenizer_path: str | None,
    data: str | None,
    vocab: int,
    *,
    trust_remote_code: bool = False,
) -> tuple[list[Prompt], object]:
    """Every (length, depth, sample) prompt, and the tokenizer (None: token-id prompts). SeqparError for depths outside
    [0, 1], samples < 1 or a length the fixed parts (prefix, needle, question, answer) do not fit in."""
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad or not depths:
        raise SeqparError(f"needle depths {bad or depths} must be fractions of the haystack in [0, 1]; e.g. --depths 0,0.5,1")
    if samples < 1:
        raise SeqparError(f"--samples {samples} must be at least 1 needle per (length, depth)")
    tok = _tokenizer(tokenizer_path, trust_remote_code)
    rng = np.random.default_rng(NEEDLE_SEED)
    if tok is not None:
        numbers = [str(int(x)) for x in rng.integers(10**6, 10**7, samples)]
        parts = [_text_parts(tok, n) for n in numbers]
    else:
        prefix, needles, question, values = _id_parts(vocab, rng, samples)
        parts = [(prefix, nd, question, v) for nd, v in zip(needles, values)]
        numbers = [" ".join(map(str, v)) for v in values]
    fixed = max(sum(len(x) for x in p) for p in parts)
    short = [L for L in lengths if L < fixed]
    if short:
        pre, nd, q, a = (len(x) for x in parts[0])
        raise SeqparError(
            f"the needle prompt needs {fixed} tokens before any haystack (prefix {pre}, needle {nd}, question {q}, "
            f"answer {a}), longer than the context of {short[0]} tokens; use lengths of at least {fixed}"
        )
    hay_all = _stream(data, tok, vocab, max(lengths), NEEDLE_SEED, trust_remote_code)
    prompts = []
    for L in lengths:
        for d in depths:
            for s, (prefix, needle, question, answer) in enumerate(parts):
                n_hay = L - len(prefix) - len(needle) - len(question) - len(answer)
                hay = hay_all[:n_hay]
                at = _sentence_end(hay, int(n_hay * d), tok)
                ids = np.concatenate([prefix, hay[:at], needle, hay[at:], question, answer]).astype(np.int64)
                prompts.append(Prompt(L, d, s, ids, np.asarray(answer, dtype=np.int64), len(prefix) + at, numbers[s]))
    return prompts, tok


def sweep(ev, prompts: list[Prompt], tok=None) -> list[dict]:
    """Score prompts of one length (data-parallel groups take every dp-th one); every rank returns every cell.
    Collective over the world."""
    import torch
    import torch.distributed as dist

    from seqpar.runtime.eval.forward import score
    from seqpar.runtime.parallel.inputs import shift_labels
    from seqpar.runtime.parallel.loss import IGNORE_INDEX

    A = max(len(p.answer) for p in prompts)
    acc = torch.zeros(len(prompts), 2 * A, dtype=torch.float64, device=ev.device)  # per answer token: log p, argmax id
    for i in range(ev.dp_rank, len(prompts), ev.dp_degree):
        p = prompts[i]
        ids = torch.from_numpy(p.ids)[None]  # (1, L)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[0, -len(p.answer) :] = torch.from_numpy(p.answer)
        r = score(ev, ids, shift_labels(labels))  # targets: the answer, predicted from the position before each token
        keep = r["target"] != IGNORE_INDEX
        j = r["position"][keep] - (p.seq_len - len(p.answer) - 1)  # answer token index of each scored position
        acc[i, j] = -r["ce"][keep].double()
        acc[i, A + j] = r["pred"][keep].double()
    dist.all_reduce(acc)  # each answer token is scored on exactly one rank of one group
    cells = []
    for i, p in enumerate(prompts):
        a = len(p.answer)
        pred = acc[i, A : A + a].long().cpu().numpy()
        hits = int((pred == p.answer).sum())
        cell = {
            "seq_len": p.seq_len,
            "depth": p.depth,
            "sample": p.sample,
            "needle": p.number,
            "needle_at": p.needle_at,
            "answer_ids": p.answer.tolist(),
            "predicted_ids": pred.tolist(),
            "answer_tokens_hit": hits,
            "exact_match": hits == a,
            "log_likelihood": float(acc[i, :a].sum()),
        }
        if tok is not None:
            cell["predicted_text"] = tok.decode(pred.tolist())
        cells.append(cell)
    return cells


def grid(rows: list[dict]) -> dict:
    """The heatmap's data: rows depths, columns lengths; each cell the mean over samples of exact match (0..1) and of
    the answer's log-likelihood."""
    lengths = [r["seq_len"] for r in rows]
    depths = sorted({c["depth"] for r in rows for c in r["cells"]})
    em = [[0.0] * len(lengths) for _ in depths]
    ll = [[0.0] * len(lengths) for _ in depths]
    for j, r in enumerate(rows):
        for i, d in enumerate(depths):
            cs = [c for c in r["cells"] if c["depth"] == d]
            em[i][j] = sum(c["exact_match"] for c in cs) / len(cs)
            ll[i][j] = sum(c["log_likelihood"] for c in cs) / len(cs)
    return {
        "scoring": "teacher-forced exact match (every answer token is the argmax at its position, EasyContext's score) "
        "and the answer's log-likelihood given the haystack, from the same forward",
        "grid": {"lengths": lengths, "depths": depths, "exact_match": em, "log_likelihood": ll},
    }


__all__ = ["FILLER", "NEEDLE", "PREFIX", "QUESTION", "Prompt", "build_prompts", "grid", "sweep"]
