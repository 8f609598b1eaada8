"""Forward-only scoring in a plan's layout, the core of ``seqpar eval`` (seqpar.runtime.eval.run runs it on every rank).

``score`` runs one full-length row through a model switched to the plan's attention mode (seqpar.runtime.hf.apply.apply):
seqpar.runtime.parallel.inputs.prepare_inputs splits the row and its global positions as for a training step, the model stops at
its final hidden state, and ``token_scores`` derives each local token's cross-entropy, argmax and hit a chunk of tokens
at a time, so the (tokens, vocab) fp32 logits never exist (extra memory: one (chunk, vocab) block). Each rank returns
its own tokens with their global positions; callers sum what they need in float64 and all-reduce once, so every token
counts exactly once whatever the degrees (``perplexity``; seqpar.runtime.eval.needle for the needle's answer tokens).
Layout: rows (1, S) in, per-token tensors (S_local,) out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.plan.errors import SeqparError
from seqpar.runtime.parallel.inputs import prepare_inputs
from seqpar.runtime.parallel.layout import shard
from seqpar.runtime.parallel.loss import IGNORE_INDEX

CHUNK_TOKENS = 4096  # tokens per logits chunk: the trainer's (engine.LossModule) and the advisor's loss_chunk_tokens


@dataclass
class Evaluator:
    """A model switched to the plan's attention mode, and where this rank sits: what every forward needs."""

    model: Any  # transformers causal LM after seqpar.runtime.hf.apply.apply
    mode: str
    sp_degree: int
    sp_rank: int
    dp_degree: int
    dp_rank: int
    ulysses_degree: int | None  # usp_attn's, None for the other modes
    device: torch.device
    chunk: int = CHUNK_TOKENS


def check_head(model) -> None:
    """token_scores computes logits as hidden @ lm_head.weight.T: refuse heads that add a bias, a scale or a cap."""
    cfg, head = model.config, model.get_output_embeddings()
    extra = [k for k in ("final_logit_softcapping", "logit_scale") if getattr(cfg, k, None) not in (None, 1.0)]
    if getattr(head, "bias", None) is not None:
        extra.append("an LM head bias")
    if extra:
        raise SeqparError(
            f"{type(model).__name__}: its logits use {', '.join(extra)}, which seqpar eval's chunked loss does not apply; "
            f"evaluate it without seqpar (plain transformers)"
        )


@torch.no_grad()
def token_scores(hidden, weight, targets, chunk: int = CHUNK_TOKENS):
    """Per token: cross-entropy (fp32, fp64 for fp64 models; 0 where the target is -100), argmax and hit (argmax ==
    target). hidden (N, H), weight (V, H), targets (N,). Logits exist one (chunk, V) block at a time."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    n = hidden.shape[0]
    ce = torch.empty(n, dtype=acc, device=hidden.device)  # (N,)
    pred = torch.empty(n, dtype=torch.long, device=hidden.device)  # (N,)
    for i in range(0, n, chunk):
        logits = (hidden[i : i + chunk] @ weight.t()).to(acc)  # (c, V): the model dtype's product, upcast
        ce[i : i + chunk] = F.cross_entropy(logits, targets[i : i + chunk], ignore_index=IGNORE_INDEX, reduction="none")
        pred[i : i + chunk] = logits.argmax(-1)
    return ce, pred == targets, pred


@torch.no_grad()
def score(ev: Evaluator, ids, targets) -> dict:
    """One forward of a full-length row: ids (1, S) and its already shifted targets (1, S), the same on every rank of
    the group. Returns this rank's tokens: global position, target, ce, hit, pred, each (S_local,)."""
    batch = prepare_inputs(ids, mode=ev.mode, rank=ev.sp_rank, world_size=ev.sp_degree, ulysses_degree=ev.ulysses_degree)
    tgt = shard(targets, ev.mode, ev.sp_rank, ev.sp_degree, dim=1, ulysses_degree=ev.ulysses_degree)  # (1, S_local)
    pos = batch["position_ids"].to(ev.device)  # (1, S_local), global positions
    hidden = ev.model.base_model(input_ids=batch["input_ids"].to(ev.device), position_ids=pos).last_hidden_state  # (1, s, h)
    flat_t = tgt.reshape(-1).to(ev.device)
    head = ev.model.get_output_embeddings().weight  # (V, h)
    ce, hit, pred = token_scores(hidden.reshape(-1, hidden.shape[-1]), head, flat_t, ev.chunk)
    return {"position": pos.reshape(-1), "target": flat_t, "ce": ce, "hit": hit, "pred": pred}


def window_targets(data, k: int, which: str = "trained"):
    """Window ``k`` of ``data`` as (inputs (1, L), targets (1, L)): the targets are the next tokens, -100 where training
    scores nothing (a chat's tokens other than the assistant's: TokenData.scored) unless ``which`` is "all"."""
    w = torch.from_numpy(data.window(k))[None]  # (1, L+1)
    targets = w[:, 1:].clone()  # (1, L)
    scored = data.scored(k) if which == "trained" else None
    if scored is not None:
        targets[0, ~torch.from_numpy(scored[1:])] = IGNORE_INDEX
    return w[:, :-1], targets


def perplexity(ev: Evaluator, data, windows: int, buckets: int, which: str = "trained") -> dict:
    """Exact held-out loss and perplexity over the first ``windows`` windows of ``data`` (a seqpar.runtime.data.windows.TokenData
    at this length), with the loss per position bucket and per window. ``which``: "trained" counts the tokens training
    scores (a chat's assistant tokens; every token of text), "all" every token; a bucket or window that counts none
    has loss None. Collective over the world."""
    L = data.seq_len
    K, B = min(windows, data.num_windows), max(1, min(buckets, L))
    edges = [L * b // B for b in range(B + 1)]  # bucket b holds global positions edges[b] <= p < edges[b+1]
    inner = torch.tensor(edges[1:-1], dtype=torch.long, device=ev.device)
    acc = torch.zeros(2 * B + 2 * K, dtype=torch.float64, device=ev.device)  # bucket sums, counts; window sums, counts
    for k in range(ev.dp_rank, K, ev.dp_degree):
        r = score(ev, *window_targets(data, k, which))
        b = torch.bucketize(r["position"], inner, right=True)  # (s,) bucket of each local token
        ce = r["ce"].double()  # 0 where the target is -100
        counted = (r["target"] != IGNORE_INDEX).double()
        acc[:B].index_add_(0, b, ce)
        acc[B : 2 * B].index_add_(0, b, counted)
        acc[2 * B + k] += ce.sum()
        acc[2 * B + K + k] += counted.sum()
    dist.all_reduce(acc)  # every token of every window on exactly one rank: the sums are the whole
    sums, counts = acc[:B].tolist(), acc[B : 2 * B].tolist()
    w_sums, w_counts = acc[2 * B : 2 * B + K].tolist(), acc[2 * B + K :].tolist()
    total, tokens = sum(sums), sum(counts)
    if not tokens:
        raise SeqparError(
            f"the {K} held-out windows of {L} tokens hold no token that training scores (a chat's assistant tokens); "
            "evaluate more windows (--windows), or every token with --score all"
        )
    loss = total / tokens
    return {
        "seq_len": L,
        "windows": K,
        "tokens": int(tokens),
        "loss": loss,
        "perplexity": math.exp(loss),
        "loss_sum": total,
        "buckets": [
            {
                "start": edges[b],
                "end": edges[b + 1],
                "tokens": int(counts[b]),
                "loss_sum": sums[b],
                "loss": sums[b] / counts[b] if counts[b] else None,
            }
            for b in range(B)
        ],
        "window_losses": [s / c if c else None for s, c in zip(w_sums, w_counts)],
        "scored": which,
    }


__all__ = ["CHUNK_TOKENS", "Evaluator", "check_head", "perplexity", "score", "token_scores", "window_targets"]
