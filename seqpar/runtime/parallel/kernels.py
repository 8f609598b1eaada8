"""Local attention kernels on one device: forward and backward that return and take the log-sum-exp.

Every parallel mode is built from these primitives: a block of queries against a block of keys, either the causal
diagonal block (``causal=True``: Sq == Sk, query i sees keys j <= i) or a full block (``causal=False``). No autograd
here: seqpar.runtime.parallel.attention wraps every mode built from these in its one autograd Function (whole local sequences:
``seqpar.runtime.local_attention``, the data_parallel mode).

Layout (the whole runtime): q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D) with Hq % Hkv == 0 (GQA: query head i uses KV head
i // (Hq // Hkv)); out like q; lse (B, Hq, Sq), natural log, float32 (float64 when the inputs are float64, so the
exact path keeps float64 accuracy end to end).

Backends (``select_backend`` picks one by device, dtype and GPU capability; an override wins; the choice is logged):
- ``exact``: plain torch math in float32/float64 on any device, backward written out by hand (CPU runs and tests).
- ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` (+ ``_backward``); Hopper and newer, bf16/fp16. With GQA at
  long lengths the backward runs as several calls over groups of KV heads (seqpar.plan.attention_calls).
- ``flash``: ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``); Ampere and newer, bf16/fp16.
- ``flash_attn``: the optional flash-attn package (Tri Dao), when installed.
The aten ops take (B, H, S, D): we pass transposed views of (B, S, H, D) tensors, so no copy is made.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from seqpar.plan.attention_calls import backward_calls
from seqpar.plan.errors import SeqparError

log = logging.getLogger(__name__)

BACKENDS = ("exact", "cudnn", "flash", "flash_attn")
_HALF = (torch.bfloat16, torch.float16)
_reported: set[tuple] = set()
_cudnn_no_gqa = False  # set once cuDNN refuses Hq != Hkv on this build; then K,V heads are expanded for it


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(device, dtype: torch.dtype, override: str | None = None) -> str:
    """The kernel for this device and dtype: override if given (validated), else the fastest one that applies."""
    device = torch.device(device)
    if override is not None:
        if override not in BACKENDS:
            raise SeqparError(f"attention backend {override!r} is unknown; use one of {', '.join(BACKENDS)} or None (automatic)")
        if override != "exact" and (device.type != "cuda" or dtype not in _HALF):
            raise SeqparError(
                f"attention backend {override!r} needs a CUDA device and bf16/fp16, got {device.type} {dtype}; "
                f"use 'exact' or None (automatic)"
            )
        if override == "flash_attn" and not _has_flash_attn():
            raise SeqparError(
                "attention backend 'flash_attn' needs the flash-attn package; pip install flash-attn, or use 'cudnn'/'flash'"
            )
        choice, why = override, "override"
    elif device.type != "cuda" or dtype not in _HALF:
        choice, why = "exact", f"{device.type} {dtype}: fused kernels need CUDA and bf16/fp16"
    else:
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 9 and torch.backends.cudnn.is_available():
            choice, why = (
                "cudnn",
                f"sm_{major}{minor}: cuDNN attention is the fastest on Hopper",
            )
        elif major >= 8:
            choice, why = "flash", f"sm_{major}{minor}: PyTorch's flash attention"
        else:
            choice, why = "exact", f"sm_{major}{minor} is older than Ampere: no fused kernel with lse"
    key = (device.type, dtype, choice)
    if key not in _reported:
        _reported.add(key)
        log.info("seqpar attention backend: %s (%s)", choice, why)
    return choice


# --------------------------------------------------------------------------------------------- exact (any device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _exact_probs(q, k, causal, scale, lse=None, mask=None):
    """Scores and probabilities per KV-head group: P (B, Hkv, G, Sq, Sk) and lse (B, Hkv, G, Sq), in the compute dtype.
    ``mask`` (Sq, Sk) bool, True where a query must not see a key, replaces the causal mask (documents: varlen.py)."""
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.view(B, Sq, Hkv, Hq // Hkv, D)  # (B, Sq, Hkv, G, D): a view, K and V are never repeated
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale  # (B, Hkv, G, Sq, Sk)
    if mask is None and causal:
        mask = torch.ones(Sq, k.shape[1], dtype=torch.bool, device=q.device).triu_(1)
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Sq)
    return torch.exp(s - lse.unsqueeze(-1)), lse


def _exact_forward(q, k, v, causal, scale, mask=None):
    B, Sq, Hq, D = q.shape
    cd = _compute_dtype(q.dtype)
    p, lse = _exact_probs(q.to(cd), k.to(cd), causal, scale, mask=mask)
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(cd)).reshape(B, Sq, Hq, v.shape[-1])  # (B, Sq, Hq, D)
    lse_dtype = torch.float64 if cd == torch.float64 else torch.float32
    return out.to(q.dtype), lse.reshape(B, Hq, Sq).to(lse_dtype)


def _exact_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    """FlashAttention-2's backward in closed form: P = exp(S*scale - lse), dV = P^T dO, dP = dO V^T,
    Dlt = rowsum(dO*O), dS = P*(dP - Dlt), dQ = scale*dS K, dK = scale*dS^T Q. out and lse may be the merged result of
    several blocks: then P is this block's share of the global softmax, which is what ring attention needs."""
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    cd = _compute_dtype(q.dtype)
    q_, k_, v_ = q.to(cd), k.to(cd), v.to(cd)
    do = dout.to(cd).reshape(B, Sq, Hkv, G, -1)  # (B, Sq, Hkv, G, D)
    p, _ = _exact_probs(q_, k_, causal, scale, lse=lse.to(cd).reshape(B, Hkv, G, Sq), mask=mask)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", p, do)  # (B, Sk, Hkv, D): summed over the G query heads of a group
    dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v_)  # (B, Hkv, G, Sq, Sk)
    delta = (do * out.to(cd).reshape(B, Sq, Hkv, G, -1)).sum(-1).permute(0, 2, 3, 1)  # (B, Hkv, G, Sq)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k_).reshape(B, Sq, Hq, D) * scale  # (B, Sq, Hq, D)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, q_.view(B, Sq, Hkv, G, D)) * scale  # (B, Sk, Hkv, D)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------- CUDA (aten, flash-attn)


def _heads(x: Tensor) -> Tensor:
    return x.contiguous().transpose(1, 2)  # (B, S, H, D) -> (B, H, S, D) view: the layout the aten ops read


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)  # (B, S, Hkv*G, D)


def _fold_kv(dx: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return dx
    B, S, H, D = dx.shape
    return dx.view(B, S, H // groups, groups, D).sum(3)  # (B, S, Hkv, D): sum over the query heads of a group


def _aten_forward(q, k, v, causal, scale, backend):
    global _cudnn_no_gqa
    B, Sq, Hq, _ = q.shape
    if backend == "flash":  # PyTorch's flash kernel reads GQA K,V directly
        r = torch.ops.aten._scaled_dot_product_flash_attention(_heads(q), _heads(k), _heads(v), 0.0, causal, False, scale=scale)
        return r[0].transpose(1, 2), r[1][..., :Sq].reshape(B, Hq, Sq)
    groups = Hq // k.shape[2]
    if groups > 1 and not _cudnn_no_gqa:
        try:
            r = torch.ops.aten._scaled_dot_product_cudnn_attention(
                _heads(q), _heads(k), _heads(v), None, True, 0.0, causal, False, scale=scale
            )
            return r[0].transpose(1, 2), r[1].reshape(B, Hq, Sq)
        except RuntimeError as e:  # this cuDNN build wants equal heads: expand K,V from now on
            _cudnn_no_gqa = True
            log.info("cuDNN attention refused GQA (%s); expanding K,V heads for it", str(e).splitlines()[0])
    k, v = _expand_kv(k, groups if _cudnn_no_gqa else 1), _expand_kv(v, groups if _cudnn_no_gqa else 1)
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads(q), _heads(k), _heads(v), None, True, 0.0, causal, False, scale=scale
    )
    return r[0].transpose(1, 2), r[1].reshape(B, Hq, Sq)


def _aten_backward(dout, q, k, v, out, lse, causal, scale, backend):
    B, Sq, Hq, _ = q.shape
    Sk = k.shape[1]
    seed = torch.empty((), dtype=torch.long, device=q.device)  # no dropout: the RNG state is never read
    lse = lse.float().contiguous()
    if backend == "flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _heads(dout.to(q.dtype)),
            _heads(q),
            _heads(k),
            _heads(v),
            _heads(out.to(q.dtype)),
            lse,
            None,
            None,
            Sq,
            Sk,
            0.0,
            causal,
            seed,
            seed,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    groups = Hq // k.shape[2]
    g = groups if _cudnn_no_gqa else 1
    dout, out = dout.to(q.dtype), out.to(q.dtype)
    Hkv = k.shape[2]
    calls = 1 if _cudnn_no_gqa else backward_calls(B * Sq, B * Sk, Hq, Hkv, q.shape[3], q.element_size())
    if calls == 1:
        return _cudnn_backward(dout, q, k, v, out, lse, causal, scale, g, seed)
    # GQA's workspace grows with the query heads of a call: cut the call over whole KV heads (heads are independent,
    # so the gradients are the same) and write each group's gradients into place (seqpar.plan.attention_calls)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kv_per, q_per = Hkv // calls, Hq // calls
    for c in range(calls):
        qs, ks = slice(c * q_per, (c + 1) * q_per), slice(c * kv_per, (c + 1) * kv_per)
        r = _cudnn_backward(
            dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, qs], causal, scale, 1, seed
        )
        dq[:, :, qs], dk[:, :, ks], dv[:, :, ks] = r
        del r  # this group's gradients are in place: free them before the next call allocates its own
    return dq, dk, dv


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale, g, seed):
    """One cuDNN backward call over the heads given (B, S, H, D); ``g`` > 1 expands K, V for a build without GQA."""
    B, Sq, Hq, _ = q.shape
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _heads(dout),
        _heads(q),
        _heads(_expand_kv(k, g)),
        _heads(_expand_kv(v, g)),
        _heads(out),
        lse.contiguous().view(B, Hq, Sq, 1),
        seed,
        seed,
        None,
        None,
        None,
        Sq,
        k.shape[1],
        0.0,
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), _fold_kv(dk.transpose(1, 2), g), _fold_kv(dv.transpose(1, 2), g)


def _flash_attn_call(fn, **kw):
    """flash-attn's private functions changed arguments between releases: pass only the ones this version takes."""
    import inspect

    params = inspect.signature(fn).parameters
    if "window_size" in params:  # <= 2.6 took a tuple
        kw["window_size"] = (kw.pop("window_size_left"), kw.pop("window_size_right"))
    return fn(**{n: val for n, val in kw.items() if n in params})


# what seqpar never uses in flash-attn's private functions: no dropout, no window, no soft-capping, no ALiBi
_FLASH_ATTN_OFF = dict(dropout_p=0.0, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None)


def _flash_attn_forward(q, k, v, causal, scale):
    from flash_attn import flash_attn_interface as fa

    r = _flash_attn_call(
        fa._flash_attn_forward,
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        softmax_scale=scale,
        causal=causal,
        return_softmax=False,
        **_FLASH_ATTN_OFF,
    )
    out, lse = (r[0], r[1]) if len(r) == 4 else (r[0], r[5])  # 2.7+: (out, lse, p, rng); 2.6: (out, q, k, v, out_pad, lse, ...)
    return out, lse[..., : q.shape[1]]


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    from flash_attn import flash_attn_interface as fa

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_call(
        fa._flash_attn_backward,
        dout=dout.to(q.dtype).contiguous(),
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        out=out.to(q.dtype).contiguous(),
        softmax_lse=lse.float().contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        softmax_scale=scale,
        causal=causal,
        deterministic=False,
        rng_state=None,
        **_FLASH_ATTN_OFF,
    )
    return dq, dk, dv


# --------------------------------------------------------------------------------------------- public primitives


def check_shapes(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    """SeqparError unless q, k, v are (B, S, H, D) blocks one kernel call can take (GQA heads; square when causal)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise SeqparError(f"attention wants (B, S, H, D) tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise SeqparError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must match each other and q {tuple(q.shape)} in batch and head dim"
        )
    if q.shape[2] % k.shape[2]:
        raise SeqparError(
            f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} KV heads (GQA needs Hq % Hkv == 0); check the model config"
        )
    if causal and q.shape[1] != k.shape[1]:
        raise SeqparError(f"a causal block must be square (the diagonal), got Sq={q.shape[1]} and Sk={k.shape[1]}")


def attn_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """One block of attention without autograd: (out (B, Sq, Hq, D) in q.dtype, lse (B, Hq, Sq) float32)."""
    check_shapes(q, k, v, causal)
    if backend == "exact":
        return _exact_forward(q, k, v, causal, softmax_scale)
    if backend == "flash_attn":
        return _flash_attn_forward(q, k, v, causal, softmax_scale)
    return _aten_forward(q, k, v, causal, softmax_scale, backend)


def attn_backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the (possibly merged, global) out and lse: dq like q, dk and dv with Hkv heads."""
    if backend == "exact":
        return _exact_backward(dout, q, k, v, out, lse, causal, softmax_scale)
    if backend == "flash_attn":
        return _flash_attn_backward(dout, q, k, v, out, lse, causal, softmax_scale)
    return _aten_backward(dout, q, k, v, out, lse, causal, softmax_scale, backend)


def merge(out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Fold one block's (out, lse) into the running result with a stable log-sum-exp update (fp32 or fp64 accumulators).

    out (B, S, H, D), lse (B, H, S); out=None starts the accumulation. Written as a sigmoid of the lse difference
    (as ring-flash-attention and PyTorch CP do) so no exp can overflow.
    """
    acc = torch.promote_types(block_out.dtype, torch.float32)
    lacc = torch.promote_types(block_lse.dtype, torch.float32)
    block_out, block_lse = block_out.to(acc), block_lse.to(lacc)
    if out is None:
        return block_out, block_lse
    w = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1): the new block's share
    out = out - w.to(acc) * (out - block_out)
    lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
    return out, lse


def default_scale(q: Tensor, softmax_scale: float | None) -> float:
    """softmax_scale, or 1/sqrt(head_dim) when None (the transformers default)."""
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
