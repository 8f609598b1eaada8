"""The exact global loss of a sequence-parallel step: token cross-entropy summed, tokens counted, both summed over the group.

Each rank holds a shard of the (already shifted) labels, so the mean over the full sequence is
sum_r loss_sum_r / sum_r count_r, not the mean of the ranks' means (shards can hold different numbers of -100).

Gradient convention: the all-reduce's backward is the identity. Every rank holds the same replicated total, and each
rank's backward carries only its own tokens' share, so summing a parameter's gradient over the group gives the
gradient of the full-sequence loss. An engine that AVERAGES gradients over the sequence-parallel ranks (DDP, ZeRO,
FSDP with the SP ranks inside its data-parallel group) needs the loss multiplied by the group size before backward.

``loss_from_hidden`` is the memory-lean path (the plan's loss_impl="chunked"): it computes the logits and the
cross-entropy a chunk of tokens at a time and recomputes each chunk's logits in backward, so the (N, vocab) fp32
logits never exist; peak extra memory is one (chunk, vocab) fp32 block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from seqpar.plan.errors import SeqparError

IGNORE_INDEX = -100  # transformers' and torch's cross-entropy ignore index: labels that are not scored


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) forward, identity backward (see the module docstring for why)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        import torch.distributed as dist

        from seqpar.runtime.parallel.comm import _staged

        staged = _staged(x, group)  # gloo ranks sharing a GPU: reduce the two numbers in host memory
        y = x.detach().cpu() if staged else x.clone()
        dist.all_reduce(y, group=group)
        return y.to(x.device) if staged else y

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _global_mean(loss_sum: Tensor, count: Tensor, group) -> Tensor:
    """(sum over the group) / (count over the group), one all-reduce of a float64 pair."""
    import torch.distributed as dist

    pair = torch.stack([loss_sum.double(), count.double()])  # (2,) float64: counts stay exact far past 2**24
    if dist.is_available() and dist.is_initialized():
        pair = _SumOverGroup.apply(pair, group)
    return (pair[0] / pair[1].clamp_min(1)).to(loss_sum.dtype)


def _check(labels: Tensor, tokens: int, what: str) -> None:
    if labels.numel() != tokens:
        raise SeqparError(
            f"labels {tuple(labels.shape)} hold {labels.numel()} tokens but {what} holds {tokens}; "
            "pass the labels from seqpar.prepare_inputs for the same shard"
        )


def _ce_sum(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")  # () fp32


def loss(logits: Tensor, labels: Tensor, group=None, chunk_size: int | None = None) -> Tensor:
    """Global mean token cross-entropy over the group, differentiable. logits (B, S_local, V), labels (B, S_local)
    already shifted (seqpar.prepare_inputs). chunk_size: upcast and score that many tokens at a time (checkpointed),
    so the fp32 copy of the logits is never whole."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # (N, V)
    _check(labels, flat.shape[0], "logits")
    targets = labels.reshape(-1).to(flat.device)  # (N,)
    if chunk_size is None or chunk_size >= flat.shape[0]:
        total = _ce_sum(flat, targets)
    else:
        from torch.utils.checkpoint import checkpoint

        total = sum(
            checkpoint(_ce_sum, flat[i : i + chunk_size], targets[i : i + chunk_size], use_reentrant=False)
            for i in range(0, flat.shape[0], chunk_size)
        )
    return _global_mean(total, (targets != IGNORE_INDEX).sum(), group)


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T, label_i) without materialising all logits; backward recomputes them per chunk."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        # Under autocast the forward's products run in the autocast dtype; backward runs outside autocast, so it casts
        # to the same dtype itself (else it would recompute the logits in fp32: another function, and no tensor cores).
        dev = hidden.device.type
        ctx.compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for i in range(0, hidden.shape[0], chunk):
            logits = hidden[i : i + chunk] @ weight.t()  # (c, V) in the model dtype, as the lm_head would produce
            total += _ce_sum(logits, targets[i : i + chunk])
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight, targets = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cd = ctx.compute_dtype
        w_c = weight if cd is None else weight.to(cd)  # (V, H) in the dtype the forward's products used
        d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None  # (N, H)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None  # (V, H)
        for i in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[i : i + ctx.chunk], targets[i : i + ctx.chunk]  # (c, H), (c,)
            h = h if cd is None else h.to(cd)
            valid = (y != IGNORE_INDEX)[:, None]  # (c, 1)
            d_logits = torch.softmax((h @ w_c.t()).float(), dim=-1)  # (c, V) fp32: dCE/dlogits = p - onehot(y)
            # sync-free (no boolean indexing): subtract the one-hot, zero the ignored rows, scale by the upstream grad
            d_logits.scatter_add_(1, y.clamp_min(0)[:, None], -valid.to(d_logits.dtype))
            d_logits.masked_fill_(~valid, 0.0).mul_(grad)
            d_logits = d_logits.to(h.dtype)
            if need_h:
                if d_hidden.dtype == h.dtype:
                    torch.mm(d_logits, w_c, out=d_hidden[i : i + ctx.chunk])  # (c, H)
                else:
                    d_hidden[i : i + ctx.chunk] = d_logits @ w_c  # (c, H) computed in the autocast dtype
            if need_w:
                if d_weight.dtype == d_logits.dtype:
                    d_weight.addmm_(d_logits.t(), h)  # (V, H) in place
                else:
                    d_weight += d_logits.t() @ h  # (V, H) bf16 product accumulated in fp32 across chunks
        return d_hidden, (d_weight.to(weight.dtype) if need_w else None), None, None


def loss_from_hidden(hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, group=None, chunk_size: int = 4096) -> Tensor:
    """Global mean cross-entropy of logits = hidden @ lm_head_weight.T, computed chunk_size tokens at a time.

    hidden (B, S_local, H): the base model's last hidden state (e.g. model.model(...).last_hidden_state);
    lm_head_weight (V, H); labels (B, S_local) shifted. Exact for heads that are a plain bias-free linear layer
    (Llama, Mistral, Qwen2/3); a model that scales or soft-caps its logits needs seqpar.loss on its logits instead."""
    if chunk_size < 1:
        raise SeqparError(f"chunk_size {chunk_size} must be positive; use e.g. 4096 tokens")
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    _check(labels, flat.shape[0], "hidden")
    if lm_head_weight.shape[-1] != flat.shape[-1]:
        raise SeqparError(
            f"lm_head_weight {tuple(lm_head_weight.shape)} does not match hidden size {flat.shape[-1]}; "
            "pass model.lm_head.weight (vocab, hidden)"
        )
    targets = labels.reshape(-1).to(flat.device)  # (N,)
    total = _ChunkedLinearCE.apply(flat, lm_head_weight, targets, int(chunk_size))
    return _global_mean(total, (targets != IGNORE_INDEX).sum(), group)
