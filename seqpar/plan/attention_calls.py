"""How the cuDNN attention backward is cut over KV heads: the one rule the runtime runs and the memory model prices.

With GQA (fewer KV heads than query heads) cuDNN's SDPA backward holds dK and dV at the query heads' width in fp32
before it sums them onto the KV heads, and the fp32 softmax sum dO.O (NVIDIA/cudnn-frontend,
include/cudnn_frontend/node/scaled_dot_product_flash_attention.h, CompositeSDPABackwardNode: softmax_sum,
dK_fullhead, dV_fullhead). torch allocates it as one block through the caching allocator (run_cudnn_SDP_bprop), so
at long lengths it is the largest block of a layer's backward: Llama-3.1-8B's 32 query heads at 400K tokens ask for
t x 32 x (8 x 128 + 4) bytes, 12.3 GiB. Attention heads are independent, so the backward can run as several calls,
each over a group of whole KV heads and their query heads, and give the same gradients; each call's workspace is its
share, plus the call's own copies of its heads and its gradients before they are written into place. seqpar cuts a
call only as far as needed to keep what it allocates within ``WORKSPACE_BUDGET`` (more calls mean smaller kernels,
which underfill the GPU at short lengths), and never where the cut would take more than one call.

Dependency-free (no torch): seqpar.runtime.parallel.kernels runs it, seqpar.advisor.cost.memory prices it.
"""

from __future__ import annotations

WORKSPACE_BUDGET = 1 << 30  # bytes one backward call may allocate for itself before the call is cut over KV heads


def workspace_bytes(q_tokens: float, k_tokens: float, q_heads: int, kv_heads: int, head_dim: int) -> float:
    """cuDNN's backward workspace of one call over ``q_heads`` query heads: the fp32 softmax sum per query head and
    query token, and with GQA (kv_heads < q_heads) fp32 dK and dV at the query heads' width per key token."""
    gqa = kv_heads < q_heads
    return q_heads * (4.0 * q_tokens + (8.0 * head_dim * k_tokens if gqa else 0.0))


def call_bytes(calls: int, q_tokens: float, k_tokens: float, q_heads: int, kv_heads: int, head_dim: int, p: int = 2) -> float:
    """What one call of the backward cut into ``calls`` allocates for itself beside the whole dq, dk, dv: its
    workspace, and once cut (calls > 1) its own copies of its heads (dO, q, out at its query heads over the queries;
    k, v at its KV heads over the keys) and its gradients before they are written into place; ``p`` bytes an element
    (the fused kernels run in bf16/fp16)."""
    qh, kh = q_heads // calls, kv_heads // calls
    work = workspace_bytes(q_tokens, k_tokens, qh, kh, head_dim)
    if calls == 1:
        return work
    copies = p * head_dim * (3 * qh * q_tokens + 2 * kh * k_tokens)
    grads = p * head_dim * (qh * q_tokens + 2 * kh * k_tokens)
    return work + copies + grads


def backward_calls(q_tokens: float, k_tokens: float, q_heads: int, kv_heads: int, head_dim: int, p: int = 2) -> int:
    """Into how many calls over KV heads the backward is cut: the fewest n dividing ``kv_heads`` whose call takes at
    most ``WORKSPACE_BUDGET`` (call_bytes), else the n whose call takes the least. Without GQA nothing is gained by
    cutting (the workspace is the softmax sum only): one call."""
    if kv_heads >= q_heads or kv_heads <= 1:
        return 1
    cuts = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0]
    size = {n: call_bytes(n, q_tokens, k_tokens, q_heads, kv_heads, head_dim, p) for n in cuts}
    fitting = [n for n in cuts if size[n] <= WORKSPACE_BUDGET]
    return fitting[0] if fitting else min(cuts, key=lambda n: (size[n], n))


def backward_bytes(q_tokens: float, k_tokens: float, q_heads: int, kv_heads: int, head_dim: int, p: int = 2) -> float:
    """What the backward, cut as backward_calls says, allocates for itself at once (one call's call_bytes)."""
    n = backward_calls(q_tokens, k_tokens, q_heads, kv_heads, head_dim, p)
    return call_bytes(n, q_tokens, k_tokens, q_heads, kv_heads, head_dim, p)
