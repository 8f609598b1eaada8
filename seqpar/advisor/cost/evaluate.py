"""The cost model of ``seqpar eval``: forward-only peak memory and tokens/s per GPU, and the longest evaluable length.

Evaluation runs the model forward under ``torch.no_grad`` in the plan's mode and degrees (seqpar.runtime.eval.run): no
gradients, no optimizer state, no checkpointing, weights whole on every rank in the model dtype (the plan's sharding is
for training), one window per forward, the loss a chunk of tokens at a time from the final hidden state. Nothing of a
layer outlives it, so the peak is the weights plus ONE layer's working set (or the loss), not L layers' activations.

Memory (bytes per GPU; t = seq_len / sp_degree local tokens; p = bytes of the model dtype, 4 on CPU ranks; a, kv query
and KV heads of width d; h the width, I the MLP width), read off transformers' Llama modules (modeling_llama.py, 5.x):
* weights: Psi * p.
* rope_tables: the (t, d) cos and sin LlamaModel computes once per forward and hands every layer: 2 t d p.
* held_activations: LlamaModel keeps the embedding output (``inputs_embeds``) for the whole forward and passes each
  layer's input while the layer runs, so two (t, h) tensors (one in the first layer) are live under every layer: 2 t p h.
* layer_working_set, the larger of two moments of one decoder layer:
  - attention's kernel call: the normed input (p h; the residual is the layer input, held above), q, k after RoPE and
    v (p (a d + 2 kv d)), the (B, S, H, D) copies of q and k seqpar.runtime.hf.apply hands the kernel (p (a d + kv d)), its
    output (p a d) and fp32 lse (4 a), plus the mode's forward buffers (seqpar.advisor.cost.memory.mode_buffers: ring K,V
    blocks in flight and fp32 accumulators, Ulysses' all-to-all copies, dist flash's peer blocks);
  - the SwiGLU MLP (``down(act(gate(x)) * up(x))``): the post-attention residual and its normed copy (2 p h) plus
    act(gate), up and their product (3 p I) while the product is formed.
* loss phase (after the last layer): the final hidden state (p h per token), one chunk of logits in the model dtype, its
  fp32 copy and fp32 log-softmax (chunk x V x (p + 8); p + 4 when the model is fp32, where the copy is the tensor itself),
  and the per-token results the eval keeps (fp32 loss, int64 argmax, bool hit: 13 bytes, rounded to 16).
peak = weights + rope_tables + max(held_activations + layer_working_set, loss phase). Reserved memory adds the allocator's
slack, the CUDA context and NCCL buffers as for training (seqpar.advisor.cost.memory.estimate_memory). The attention terms
assume the fused CUDA kernels (cuDNN / flash): CPU ranks' exact kernel also builds (t x S) scores, not modelled.

Time of one window per data-parallel group (the terms of seqpar.advisor.cost.throughput, forward pass only):
* linear: 2 N_lin FLOPs per token (the layers and the LM head, whose logits the chunked loss computes once): a third of
  training's 6 N_lin; at the measured matmul rate x the width efficiency x the fitted linear factor.
* attention: the causal forward 2 S^2 a d per layer, divided by sp_degree: 1/3.5 of training's forward + backward, at
  the measured attention rate x eff(n) x the head-width efficiency x the fitted attention factor.
* elementwise traffic (the model's own norms, RoPE, SwiGLU: eval applies neither fused_ops nor tiled_mlp): one forward
  pass of bytes over the HBM bandwidth those kernels reach (elementwise_efficiency).
* sequence-parallel communication: the forward pass only (ring: P-1 K,V blocks per layer against each step's
  attention, partly hidden; Ulysses: one set of all-to-alls per layer; dist flash: P/2 helper steps). No gradient or
  optimizer traffic. tokens/s (cluster) = seq_len x dp_degree / that time.
Pure Python: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from seqpar.advisor.cost.coefficients import Coefficients, load_coefficients
from seqpar.advisor.cost.memory import capacity_bytes, mode_buffers, ring_ranks, ulysses_ranks
from seqpar.advisor.cost.throughput import (
    _bw,
    _hidden,
    call_efficiency,
    call_tokens,
    elementwise_bytes_per_token,
    head_dim_efficiency,
    imbalance,
    width_efficiency,
)
from seqpar.plan.base import DTYPE_BYTES
from seqpar.plan.flops import attention_fwd_flops, matmul_params
from seqpar.plan.modes import describe, split_multiple, takes_ulysses_degree
from seqpar.plan.specs import ClusterSpec, ModelSpec, Strategy
from seqpar.plan.units import GIB, longest

RESULT_BYTES_PER_TOKEN = 16  # fp32 loss + int64 argmax + bool hit per local token (13 B), rounded up


@dataclass(frozen=True)
class EvalPrediction:
    """What the cost model predicts for one eval length: per GPU memory, cluster tokens/s, and whether it fits."""

    seq_len: int
    peak_memory_gib: float  # torch.cuda.max_memory_allocated
    reserved_memory_gib: float  # + allocator slack, CUDA context, NCCL buffers
    capacity_gib: float
    peak_phase: str  # "layer" or "loss"
    memory_breakdown_gib: dict[str, float]  # terms at the peak phase; they sum to peak_memory_gib
    tokens_per_s: float  # whole cluster (data-parallel groups evaluate different windows at once)
    forward_time_s: float  # one window per group
    time_breakdown_s: dict[str, float] = field(default_factory=dict)
    fits: bool = True
    reason: str = ""  # why it does not fit; empty when it does

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _dtype_bytes(dtype: str, cluster: ClusterSpec) -> int:
    """The runtime's eval dtype: the plan's on CUDA, fp32 on CPU ranks (seqpar.runtime.eval.run keeps CPU runs exact)."""
    return DTYPE_BYTES[dtype] if cluster.accelerator == "cuda" else 4


def estimate_eval_memory(m: ModelSpec, seq_len: int, cluster: ClusterSpec, s: Strategy, dtype: str, c: Coefficients) -> dict:
    """{"peak_bytes", "reserved_bytes", "capacity_bytes", "peak_phase", "breakdown", "fits", "reason"} of one forward of
    seq_len tokens (see the module docstring for every term)."""
    p = _dtype_bytes(dtype, cluster)
    t = seq_len / s.sp_degree
    h, i, a, kv, d = m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim
    base = {"weights": m.num_params * p, "rope_tables": 2 * t * d * p}
    held = (2 if m.num_layers > 1 else 1) * t * p * h
    fwd_buffers = mode_buffers(m, "fp32" if p == 4 else dtype, s, t)[0]
    attention = t * (p * h + p * (3 * a * d + 3 * kv * d) + 4 * a) + fwd_buffers
    mlp = t * (2 * p * h + 3 * p * i)
    chunk = min(t, c.loss_chunk_tokens)
    phases = {
        "layer": {**base, "held_activations": held, "layer_working_set": max(attention, mlp)},
        "loss": {
            **base,
            "final_hidden": t * p * h,
            "loss_chunk": chunk * m.vocab_size * (p + (4 if p == 4 else 8)),
            "token_results": t * RESULT_BYTES_PER_TOKEN,
        },
    }
    totals = {k: sum(v.values()) for k, v in phases.items()}
    phase = max(totals, key=totals.get)
    peak = totals[phase]
    groups = 0 if s.world_size == 1 else 1 + (s.sp_degree > 1) + takes_ulysses_degree(s.mode)
    reserved = peak + c.allocator_slack(peak) + (c.cuda_context_gib + c.nccl_buffer_gib_per_group * groups) * GIB
    capacity = capacity_bytes(cluster, c)
    # no measured evaluation runs among the margin's rows (seqpar.advisor.cost.margin): the floor
    kept = c.memory_margin_floor * peak
    # as the training gate (seqpar.advisor.cost.memory): the allocator gives back its cache before it fails
    required = peak + (c.allocator_reserve_gib + c.cuda_context_gib + c.nccl_buffer_gib_per_group * groups) * GIB
    reason = ""
    if required + kept > capacity:
        reason = (
            f"predicted peak {peak / GIB:.1f} GiB allocated in the {phase} + {(required - peak) / GIB:.1f} GiB CUDA "
            f"context and allocator + {kept / GIB:.1f} GiB margin > {capacity / GIB:.1f} GiB a process can allocate "
            f"on {cluster.gpu.name}"
        )
    breakdown = {k: v for k, v in phases[phase].items() if v > 0}
    return dict(
        peak_bytes=peak,
        reserved_bytes=reserved,
        capacity_bytes=capacity,
        peak_phase=phase,
        breakdown=breakdown,
        fits=not reason,
        reason=reason,
    )


def estimate_eval_time(m: ModelSpec, seq_len: int, cluster: ClusterSpec, s: Strategy, dtype: str, c: Coefficients) -> dict:
    """{"forward_time_s", "tokens_per_s", "breakdown"} of one window per data-parallel group (module docstring)."""
    p = _dtype_bytes(dtype, cluster)
    S, P = seq_len, s.sp_degree
    t = S / P
    a, d, kv, L = m.num_attention_heads, m.head_dim, m.num_key_value_heads, m.num_layers
    lin_factor, attn_factor = c.factors(cluster)
    linear = t * 2.0 * matmul_params(m) / (c.kernel_rate_tflops(cluster, "matmul") * 1e12)
    linear = linear / width_efficiency(m.hidden_size, c.matmul_width_h0) * lin_factor
    eff = call_efficiency(call_tokens(s, S), c) * head_dim_efficiency(d, c.attn_head_dim_d0)
    attn_rate = c.kernel_rate_tflops(cluster, c.attention_backend(cluster)) * 1e12
    attention = attention_fwd_flops(m, S) / P / attn_rate / eff * attn_factor * imbalance(s)  # the busiest rank
    # the model's own norms, RoPE and SwiGLU: eval applies neither the plan's fused_ops nor its tiled MLP
    hbm = cluster.gpu.hbm_bandwidth_gb_s * 1e9 * c.elementwise_efficiency
    elementwise = t * L * elementwise_bytes_per_token(m, "none")[0] / hbm

    comm = 0.0
    u, r = ulysses_ranks(s), ring_ranks(s)
    kv_eff = kv if (u == 1 or kv % u == 0) else u
    if u > 1:  # q, k, v in and o out, once per layer
        comm += (u - 1) / u * t * p * (2 * a * d + 2 * kv_eff * d) * L / _bw(cluster, u, c)
    if r > 1:
        step_comm = 2 * p * t * kv_eff * d / _bw(cluster, r, c, contiguous_inner=u)
        comm += L * (r - 1) * _hidden(step_comm, attention / L / r, c.ring_overlap)
    shape = describe(s.mode).comm
    if "peer_blocks" in shape and P > 1:
        steps = P / 2
        fwd_bytes = t * (p * (a * d + 2 * kv * d) + 4 * a * d + 4 * a)
        comm += L * steps * _hidden(fwd_bytes / _bw(cluster, P, c), attention / L / (steps + 1), c.ring_overlap)
    if "all_gather_kv" in shape and P > 1:  # the other ranks' K and V, gathered once per layer
        comm += L * (P - 1) * t * 2 * p * kv * d / _bw(cluster, P, c)
    total = linear + attention + elementwise + comm
    return {
        "forward_time_s": total,
        "tokens_per_s": S * s.dp_degree / total if total > 0 else 0.0,
        "breakdown": {"linear": linear, "attention": attention, "elementwise": elementwise, "exposed_comm": comm},
    }


def predict_eval(
    m: ModelSpec, seq_len: int, cluster: ClusterSpec, s: Strategy, dtype: str = "bf16", coeffs: Optional[Coefficients] = None
) -> EvalPrediction:
    """Forward-only peak memory (per GPU), tokens/s (cluster) and the OOM verdict of evaluating seq_len tokens."""
    c = coeffs or load_coefficients()
    mem = estimate_eval_memory(m, seq_len, cluster, s, dtype, c)
    tim = estimate_eval_time(m, seq_len, cluster, s, dtype, c)
    return EvalPrediction(
        seq_len=seq_len,
        peak_memory_gib=mem["peak_bytes"] / GIB,
        reserved_memory_gib=mem["reserved_bytes"] / GIB,
        capacity_gib=mem["capacity_bytes"] / GIB,
        peak_phase=mem["peak_phase"],
        memory_breakdown_gib={k: v / GIB for k, v in mem["breakdown"].items()},
        tokens_per_s=round(tim["tokens_per_s"], 1),
        forward_time_s=tim["forward_time_s"],
        time_breakdown_s=dict(tim["breakdown"]),
        fits=mem["fits"],
        reason=mem["reason"],
    )


def max_eval_seq_len(
    m: ModelSpec,
    cluster: ClusterSpec,
    s: Strategy,
    dtype: str = "bf16",
    coeffs: Optional[Coefficients] = None,
    limit: int = 2**27,
) -> int:
    """The longest seq_len (a multiple of 1024 and of the mode's split) whose forward fits the strategy on the cluster;
    0 when even 1024 tokens do not. Memory grows with seq_len: a doubling, then a bisection."""
    c = coeffs or load_coefficients()
    unit = math.lcm(1024, split_multiple(s.mode, s.sp_degree, s.ulysses_degree))

    return longest(unit, limit, lambda n: estimate_eval_memory(m, n, cluster, s, dtype, c)["fits"])


__all__ = ["EvalPrediction", "estimate_eval_memory", "estimate_eval_time", "max_eval_seq_len", "predict_eval"]
