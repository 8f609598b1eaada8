"""Per-GPU memory of one training step: peak allocated bytes as the maximum over the step's phases, not one sum.

What is modelled (bytes per GPU; t = micro_batch * seq_len / sp_degree local tokens; p = bytes of the model dtype):

* Model states (Rajbhandari et al. 2020, "ZeRO", sec. 3 and 5: mixed-precision Adam holds 2 + 2 + 12 bytes per parameter,
  ZeRO-2 keeps 2Psi + 14Psi/N, ZeRO-3 16Psi/N). Sharding runs over all N = world ranks in every engine seqpar launches or
  emits: seqpar's own sequence parallelism leaves DeepSpeed's data-parallel group whole (EasyContext's set-up), DeepSpeed's
  Ulysses / ALST partitions over its sequence-data-parallel group (sp x dp = world; accelerate's sp_size hands DeepSpeed
  that group and builds no mesh of its own), and FSDP2 shards over accelerate's dp_shard_cp mesh dimension (dp_shard x
  cp = world) or seqpar's whole-world mesh (tests/advisor/cost/test_engine_semantics.py reads each from the tool's source).
  ``gradient_as_bucket_view`` DDP: no second copy of the gradients.
* Activations saved for backward by a Hugging Face Llama decoder layer (transformers 5, eager modules, torch SDPA with the
  cuDNN / flash kernel, GQA through ``enable_gqa``: K/V are not repeated), per token and layer:
    RMSNorm x2: fp32 copy of the input (4h) + normalised bf16 (ph) + output (ph)       -> 2 (4 + 2p) h
    attention: q, k, v after RoPE + output + fp32 lse (seqpar's attention returns out as (B, S, H, D), the tensor
    o_proj saves: no transposed copy, unlike transformers' own sdpa path)             -> 2p*a*d + 2p*kv*d + 4a
    SwiGLU MLP: gate, silu(gate), up, their product                                   -> 4p*I
  This is Korthikanti et al. 2022 ("Reducing Activation Recomputation", eq. 2) specialised to this block: no dropout masks,
  flash-style attention (no 5as^2b term), SwiGLU instead of GeLU.
* ``fused_ops liger`` (Liger-Kernel's Triton RMSNorm, RoPE, SwiGLU): each RMSNorm saves its input and an fp32 rstd per row,
  its output being the tensor the next matmuls save -> 2 (p h + 4) + r h (the post-attention norm's input is a new tensor,
  the input norm's input is the layer input, counted where it is kept); the SwiGLU kernel saves gate and up and recomputes
  silu in backward (the product is saved by down_proj) -> 3p*I. RoPE saves nothing the attention does not already hold.
* ``tiled_mlp`` (ALST's TiledMLP): each MLP runs one sequence tile of ceil(t / ceil(t/h)) tokens (about h) at a time, its
  forward under no_grad, so the layer saves nothing of the MLP (its input is the post-attention norm's output, counted
  there; under LoRA, whose frozen base saves that output nowhere else, in the MLP's term: lora.saved_bytes_per_token);
  forward and backward hold one tile's intermediates (3p*I forward, 4p*I or 3p*I recomputed plus 2p*I of their
  gradients in backward) and backward one fp32 weight-gradient accumulator per MLP matrix (3*h*I*4 bytes).
  seqpar's runtime runs the model's own (unfused) RMSNorms in tiles alike (tiled_mlp.tile_norms): each saves its input
  (r h; the input norm's is the layer input itself, counted where the layer input is kept) instead of its fp32 copy
  and the product the weight takes, and its backward holds the five fp32 temporaries
  (NORM_BACKWARD_BYTES) for one tile instead of the whole sequence; another tool's TiledMLP leaves them whole
  (estimate_memory's ``norms_tiled``).
* Checkpointing: ``full`` keeps each layer's input (B, S, h) and recomputes one layer at a time in backward (its saved
  tensors above plus the gradients flowing through it); ``offload`` moves the layer inputs to host RAM (two in flight on the
  GPU); ``selective`` keeps the layer input plus attention's output (B, S, a*d, model dtype) and fp32 lse (B, a, S) per
  layer, so the recomputation skips attention's forward (LightSeq, Li et al. 2023, sec. 3.3; seqpar.runtime.memory.selective).
  A split (strategy.checkpoint_layers / offload_layers, seqpar.plan.options.layer_split) sums per layer: offloaded inputs
  nothing on the GPU (two in flight only while those layers run; under offload_stride k, one in k goes to the host and
  the backward of an offloaded layer holds up to k - 1 inputs its group recomputed), GPU-checkpointed ones their input,
  the last layers everything they save; backward is checked at the top layer, the top checkpointed layer and the bottom one.
  ``kept_saves matmuls`` (seqpar.runtime.memory.matmul_keep): a kept layer holds its input, attention's out + lse and its
  matmul outputs but the MLP's last (p (a d + 2 kv d + h + 2 I) per token); its backward rebuilds the rest of what it
  saves. ``kept_host_layers`` of them, spread over the kept layers (seqpar.plan.options.LayerSplit.host_kept), hold their
  matmul outputs in host memory: on the GPU only while their backward runs (their own and the layer below's, fetched
  one layer ahead), checked at each of them and the layer above it.
* Precision (``precision()``, mirroring seqpar.runtime.train.engine.compute_dtype): DDP keeps fp32 parameters and autocasts, so
  weights, gradients and the residual stream (hence the checkpointed layer inputs) are fp32 and a bf16 copy of every matmul
  weight is cached while the forward runs; FSDP2 keeps an fp32 sharded master and computes in bf16; ZeRO follows the paper;
  adamw-bf16 keeps everything in the model dtype.
* LoRA / QLoRA (``workload.lora``): a frozen base, the adapters' states, 4-bit weights, their dequantization buffer and
  what the adapters keep for backward: seqpar.advisor.cost.lora, called where a term differs.
* The loss: ``hf`` = transformers' ForCausalLMLoss: forward holds the bf16 logits (t, V), ``logits.float()`` and the
  log_softmax output (10 bytes per token and vocabulary entry); backward the saved output, its incoming gradient and the
  result (12). seqpar's LossModule returns only the loss, so no logits outlive it.
  ``chunked`` = seqpar's runtime: logits one chunk at a time, recomputed in backward; the fp32 gradient of the final hidden.
  TRL's SFTTrainer (estimate_memory's ``loss_path="trl"``) runs its fused LM head for every plan: a compacted copy of the
  hidden states, one (4096, 32768) tile, fp32 gradients of the hidden and the head; its logged entropy and token accuracy
  are per-token vectors, so no logits stay alive for them.
* Mode buffers: ring (zigzag, usp's ring part): K,V blocks double-buffered, fp32 out and lse accumulators, in backward
  dq / dk / dv fp32 accumulators plus dk, dv in flight; Ulysses: the all-to-all send/receive copies of q, k, v, o at full
  length and 1/P heads (KV heads replicated up to P); dist flash: the Q, K, V block it computes for a peer and the O / lse
  it returns; all-gather of K,V: the whole sequence's K and V in forward, and again with their gradients in backward.
  Which of these a mode has is its description's ``comm`` (seqpar.plan.modes).
* DeepSpeed ZeRO's own buffers (preallocated gradient partitions, ZeRO-3's bucket and the gathered parameters it keeps
  for reuse, its optimizer step's fp32 pieces): seqpar.advisor.cost.deepspeed_memory.
* Outside PyTorch's allocator (reserved only): the caching allocator's slack, the CUDA context, NCCL buffers.
Every term can be checked against ``torch.cuda.max_memory_allocated`` by switching the others off (e.g. optimizer none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from seqpar.advisor.cost import deepspeed_memory, lora
from seqpar.advisor.cost.coefficients import Coefficients
from seqpar.advisor.cost.margin import memory_margin
from seqpar.plan import attention_calls
from seqpar.plan.base import DTYPE_BYTES
from seqpar.plan.flops import matmul_params
from seqpar.plan.modes import degrees, describe, head_degree, takes_ulysses_degree
from seqpar.plan.options import LayerSplit, pinned_block
from seqpar.plan.rules import layers_of, tiles_norms
from seqpar.plan.specs import ClusterSpec, ModelSpec, Strategy, Workload
from seqpar.plan.units import GIB

# transformers' unfused RMSNorm (LlamaRMSNorm: the input upcast to fp32, pow, mean, rsqrt, mul, cast back, times the
# weight) holds at its backward's peak five fp32 tensors of the hidden state's shape at once (the upcast output's
# gradient, its products with the scale and with the input, mean's expanded gradient, pow's): 20 bytes per element
# beyond its saved tensors, whatever the input dtype and whether the weight trains (allocations in time order under
# torch's profiler over the real module: tests/advisor/cost/test_memory.py). Beside them only the residual stream's
# gradient waits (the norm's incoming gradient is freed by its first op). Liger's fused RMSNorm writes dX in one
# kernel: no such moment.
NORM_BACKWARD_BYTES = 20
OPTIMIZER_BYTES = {"adamw": 12, "none": 0}  # per parameter: fp32 master + two fp32 moments (ZeRO paper's K = 12)


@dataclass(frozen=True)
class MemoryEstimate:
    peak_bytes: float  # peak allocated (torch.cuda.max_memory_allocated)
    peak_phase: str
    breakdown: dict[str, float]  # terms at the peak phase, they sum to peak_bytes
    phases: dict[str, float]  # total allocated per phase
    reserved_bytes: float  # peak allocated + allocator slack + CUDA context + NCCL buffers
    capacity_bytes: float
    host_bytes: float  # per node
    host_capacity_bytes: float
    fits: bool
    reason: str  # empty when it fits
    phase_terms: dict[str, dict[str, float]] = field(default_factory=dict)  # every phase's terms (explain's stacked bars)
    required_bytes: float = 0.0  # what the gate asks to fit, margin aside: peak + CUDA context + NCCL + the allocator's floor
    margin_bytes: float = (
        0.0  # the gate's margin over the peak: the measured error on runs like this (seqpar.advisor.cost.margin)
    )
    margin_basis: str = ""


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what the runtime keeps, mirroring seqpar.runtime.train.engine.compute_dtype."""

    weight: float  # per parameter on the GPU (before sharding)
    grad: float
    optim: float  # optimizer state per parameter (master copy + moments)
    compute: int  # activations of matmuls and attention
    residual: int  # the residual stream, hence checkpointed layer inputs
    autocast_cache: bool  # bf16 copies of fp32 weights cached while the forward runs under autocast
    regime: str


def precision(w: Workload, s: Strategy, accelerator: str = "cuda") -> Precision:
    """fp32 on CPU; adamw-bf16: everything in the model dtype; fsdp: fp32 sharded master, FSDP2 computes in bf16;
    ZeRO: DeepSpeed's bf16 params + fp32 master (ZeRO paper); otherwise (DDP): fp32 parameters under autocast, so the
    residual stream (embedding output + fp32 adds) and the checkpointed layer inputs are fp32 while matmuls run in bf16.
    LoRA: the frozen base stays in the model dtype, and so does the residual stream (lora.regime: the adapters')."""
    lo = lora.regime(w, s, accelerator)
    if lo is not None:
        return Precision(lo.base, lo.grad, lo.optim, lo.compute, lo.compute, False, lo.text)
    p = DTYPE_BYTES[w.dtype]
    adam = 8 if w.optimizer == "adamw" else 2 * p if w.optimizer == "adamw-bf16" else 0
    if accelerator != "cuda" or w.dtype == "fp32":
        return Precision(4, 4, adam, 4, 4, False, "fp32")
    if w.optimizer == "adamw-bf16":
        return Precision(p, p, 2 * p, p, p, False, f"{w.dtype} parameters and moments")
    if w.optimizer == "none":  # the runtime keeps parameters in the model dtype when nothing is updated
        return Precision(p, p, 0, p, p, False, f"{w.dtype} parameters and gradients, no optimizer")
    if s.sharding == "fsdp":
        return Precision(4, 4, adam, p, p, False, f"fp32 sharded master, FSDP2 computes in {w.dtype}")
    if s.sharding.startswith("zero"):
        return Precision(p, p, optimizer_bytes_per_param(w.optimizer, w.dtype), p, p, False, f"DeepSpeed {w.dtype} + fp32 master")
    return Precision(4, 4, adam, p, 4, True, f"fp32 parameters, autocast to {w.dtype}")


def optimizer_bytes_per_param(optimizer: str, dtype: str) -> int:
    if optimizer == "adamw-bf16":
        return 2 * DTYPE_BYTES[dtype]  # two moments in the parameter dtype, no master copy
    return OPTIMIZER_BYTES[optimizer]


def model_states(
    m: ModelSpec, sharding: str, optimizer: str, dtype: str, world: int, prec: Precision | None = None
) -> dict[str, float]:
    """GPU bytes of weights, gradients and optimizer state at rest (ZeRO paper, sec. 5), plus ZeRO-3's gathered layers.

    Without ``prec``: the ZeRO paper's mixed-precision accounting (2 + 2 + K bytes); with it, the runtime's regime."""
    psi, n = m.num_params, world
    p = prec.compute if prec else DTYPE_BYTES[dtype]
    wb, gb, k = (prec.weight, prec.grad, prec.optim) if prec else (p, p, optimizer_bytes_per_param(optimizer, dtype))
    lp = m.layer_params
    if sharding == "ddp":
        return {"weights": psi * wb, "gradients": psi * gb, "optimizer_states": psi * k}
    if sharding == "zero2":
        return {"weights": psi * wb, "gradients": psi * gb / n, "optimizer_states": psi * k / n}
    if sharding in ("zero3", "fsdp"):
        # unsharded copies of the current and the prefetched layer live while they are used
        return {
            "weights": psi * wb / n,
            "gradients": psi * gb / n,
            "optimizer_states": psi * k / n,
            "gathered_params": 2 * lp * p,
        }
    if sharding == "zero3_offload":  # params, grads and optimizer in host RAM; only the gathered layers on the GPU
        return {"weights": 0.0, "gradients": 0.0, "optimizer_states": 0.0, "gathered_params": 2 * lp * p}
    raise ValueError(sharding)


def mlp_tile_tokens(t: float, h: int) -> float:
    """Tokens of one TiledMLP tile: the local tokens split into ceil(t/h) equal tiles (about h tokens each)."""
    if t <= 0:
        return 0.0
    return float(math.ceil(t / math.ceil(t / h)))


def saved_bytes_per_token(
    m: ModelSpec,
    dtype: str,
    residual: int | None = None,
    fused_ops: str = "none",
    tiled_mlp: bool = False,
    adapters: lora.Lora | None = None,
    tiled_norms: bool = False,
) -> float:
    """Tensors one decoder layer saves for backward, bytes per token (see the module docstring).

    ``residual``: bytes of the residual stream (4 under autocast with fp32 parameters: the unfused norms then also save the
    bf16 cast autocast makes for the next matmul). ``fused_ops`` liger: Liger's RMSNorm and SwiGLU save less;
    ``tiled_mlp``: the MLP saves nothing but its input (its tiles are recomputed in backward; the input is counted with
    the norm that makes it, or under LoRA in the MLP's term). ``adapters``: a frozen base's block
    with LoRA adapters (lora.saved_bytes_per_token). ``tiled_norms``: the unfused norms run in tiles (seqpar's runtime
    under a tiled MLP): each saves its input instead of its fp32 copy and the normalized product the weight takes. The
    input norm's input (Liger's or tiled) is the layer input itself, which is counted where it is kept: the checkpoint,
    or under policy none kept_bytes_per_token, not here (an allocation replay of a LoRA layer's recomputation found the
    model 2 bytes per token and hidden unit over with it counted twice: 73.8 GiB predicted, 70.1 measured at 427K)."""
    if adapters is not None:
        return lora.saved_bytes_per_token(m, adapters, residual, fused_ops, tiled_mlp, tiled_norms)
    h, d, a, kv, i = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_key_value_heads, m.intermediate_size
    p = DTYPE_BYTES[dtype]
    r = residual or p
    if fused_ops == "liger":
        norms = 2 * (p * h + 4) + r * h
        mlp = 3 * p * i
    elif tiled_norms:  # the input norm's input is the layer input: counted where it is kept (kept_bytes_per_token)
        norms = (2 * (2 * r + (p if r != p else 0)) - r) * h
        mlp = 4 * p * i
    else:
        norms = 2 * (4 + 2 * r + (p if r != p else 0)) * h
        mlp = 4 * p * i
    if tiled_mlp:
        mlp = 0
    return norms + 2 * p * a * d + 2 * p * kv * d + 4 * a + mlp


def matmul_bytes_per_token(m: ModelSpec, dtype: str) -> float:
    """Outputs of a decoder layer's matmuls but the MLP's last (q, k, v, o, gate, up), bytes per token in the model
    dtype: what a layer under kept_saves matmuls keeps beside its input and attention's out + lse
    (seqpar.runtime.memory.matmul_keep)."""
    p, h, d = DTYPE_BYTES[dtype], m.hidden_size, m.head_dim
    return p * ((m.num_attention_heads + 2 * m.num_key_value_heads) * d + h + 2 * m.intermediate_size)


def kept_bytes_per_token(
    m: ModelSpec,
    dtype: str,
    strategy: Strategy,
    residual: int | None = None,
    policy: str | None = None,
    adapters: lora.Lora | None = None,
    tiled_norms: bool = False,
) -> float:
    """What one layer under ``policy`` (default: the plan's checkpointing) keeps between its forward and its backward,
    per token, on the GPU (``tiled_norms``: see saved_bytes_per_token).

    full: the layer input (B, S, h) in the residual dtype; selective adds attention's output (B, S, a, d) in the model
    dtype and its fp32 lse (B, a, S) (seqpar.runtime.memory.selective); offload: nothing (the input waits in host RAM);
    none: everything the layer saves, plus, under fused_ops liger or tiled norms, the layer input the input norm saves."""
    r = residual or DTYPE_BYTES[dtype]
    ck = policy or strategy.checkpointing
    if ck == "none":
        extra = r * m.hidden_size if strategy.fused_ops == "liger" or tiled_norms else 0
        saved = saved_bytes_per_token(m, dtype, residual, strategy.fused_ops, strategy.tiled_mlp, adapters, tiled_norms)
        return saved + extra
    if ck == "offload":
        return 0.0
    if ck == "selective":
        a = m.num_attention_heads
        return r * m.hidden_size + DTYPE_BYTES[dtype] * a * m.head_dim + 4 * a
    return r * m.hidden_size


def split(m: ModelSpec, s: Strategy) -> LayerSplit:
    """The plan's decoder layers by what backward needs of them (seqpar.plan.options.layer_split): host-offloaded inputs,
    GPU-kept checkpoints, layers that are not recomputed."""
    return layers_of(s, m.num_layers)


def kept_by_layer(
    m: ModelSpec, dtype: str, s: Strategy, r: int, adapters: lora.Lora | None = None, tiled_norms: bool = False
) -> list[float]:
    """Bytes per token each decoder layer keeps on the GPU until its backward, first layer first: the offloaded layers
    nothing, the GPU-checkpointed ones their input (selective: + attention's out and lse), the last ``kept`` layers
    everything they save; under kept_saves matmuls their input, attention's out + lse and (on the GPU) their matmul
    outputs, the host-kept ones (LayerSplit.host_kept, spread over the kept layers) with those in host memory."""
    sp = split(m, s)
    ck = "full" if s.checkpointing == "offload" else s.checkpointing
    if sp.matmuls:
        around = kept_bytes_per_token(m, dtype, s, r, "selective")
        on_host = set(sp.host_kept)
        kept = [around + (0 if j in on_host else matmul_bytes_per_token(m, dtype)) for j in range(sp.checkpointed, m.num_layers)]
    else:
        kept = [kept_bytes_per_token(m, dtype, s, r, "none", adapters, tiled_norms)] * sp.kept
    return [0.0] * sp.host + [kept_bytes_per_token(m, dtype, s, r, ck)] * sp.gpu + kept


def ulysses_ranks(s: Strategy) -> int:
    """Ranks of the all-to-all head split (ulysses_attn, usp_attn's Ulysses part); 1 without one (seqpar.plan.modes)."""
    return head_degree(s.mode, s.sp_degree, s.ulysses_degree)


def ring_ranks(s: Strategy) -> int:
    """Ranks of the ring passing K,V blocks (comm ring_kv: zigzag_ring_attn, usp_attn's ring part); 1 without one.
    dist_flash_attn's contiguous schedule moves other tensors and is costed on its own."""
    return degrees(s.mode, s.sp_degree, s.ulysses_degree)[0] if "ring_kv" in describe(s.mode).comm else 1


def mode_buffers(m: ModelSpec, dtype: str, strategy: Strategy, t: float) -> tuple[float, float]:
    """(forward, backward) bytes of the mode's communication buffers and accumulators for one layer, t local tokens."""
    p, a, d, kv = DTYPE_BYTES[dtype], m.num_attention_heads, m.head_dim, m.num_key_value_heads
    fwd = bwd = 0.0
    u, r = ulysses_ranks(strategy), ring_ranks(strategy)
    if u > 1:
        kv_eff = kv if kv % u == 0 else u  # KV heads replicated up to the Ulysses degree
        qkvo = t * p * (2 * a * d + 2 * kv_eff * d)  # same bytes at (S, heads/u) as at (S/u, heads)
        fwd += qkvo  # send + receive copies of one tensor set in flight
        bwd += 2 * qkvo
    if r > 1:
        kv_loc = kv if u == 1 else max(kv // u, 1)
        hq = a // u
        # forward: next K,V block (double buffer) + fp32 out and lse accumulators
        fwd += t * (2 * p * kv_loc * d) + t * (4 * hq * d + 4 * hq)
        # backward: K,V in flight, dq/dk/dv fp32, dk/dv fp32 in flight, the kernel's bf16 block grads
        bwd += t * (2 * p * kv_loc * d + 4 * hq * d + 16 * kv_loc * d + p * (hq * d + 2 * kv_loc * d))
    comm, P = describe(strategy.mode).comm, strategy.sp_degree
    if "peer_blocks" in comm and P > 1:
        fwd += t * (p * (2 * a * d + 2 * kv * d) + 4 * a * d + 4 * a)  # a peer's q,k,v + its o,lse to return (fp32)
        bwd += t * (p * (3 * a * d + 2 * kv * d) + 4 * (a * d + 2 * kv * d))  # + do; dq, dk, dv fp32 for the peer
    if "all_gather_kv" in comm and P > 1:
        gathered = P * t * 2 * p * kv * d  # every rank's K and V: the whole sequence's
        fwd += gathered
        bwd += 2 * gathered  # gathered again, and their gradients at full length before the reduce-scatter
    return fwd, bwd


# TRL's fused LM head (trl 1.16 trl/kernels/chunked_logprob.py): TOKEN_CHUNK_SIZE tokens x the chunk_size the trainer passes
# (trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE) vocabulary entries per projected tile
TRL_TOKEN_CHUNK, TRL_VOCAB_CHUNK = 4096, 32768


def _loss_bytes(
    m: ModelSpec,
    dtype: str,
    strategy: Strategy,
    t: float,
    c: Coefficients,
    r: int,
    path: str = "seqpar",
    wb: float = 0.0,
    tiled_norm: bool = False,
) -> dict:
    """Terms at the loss's peak. hf: forward holds bf16 logits + fp32 copy + log_softmax output (10 B/token/vocab), its
    backward the saved output + incoming grad + result (12); seqpar's LossModule returns only the loss, so nothing of the
    logits outlives the loss. chunked: one (chunk, V) block in both dtypes and its fp32 grads, the fp32 grad of the hidden,
    and the fp32 (V, h) accumulator of the head's weight gradient (seqpar.runtime.parallel.loss sums the chunks' products in
    fp32). ``path`` "trl": TRL's SFTTrainer (its fused LM head, what a chunked plan runs there; ``wb``: bytes per element
    of the head's weight): it saves a compacted copy of the labelled positions' hidden states, projects one (4096, 32768)
    tile at a time in the compute dtype, and its metrics (entropy, token accuracy) are fp32 / bool per-token vectors, no
    logits; its backward accumulates the hidden's and the head's gradients in fp32 and casts both to their dtypes on
    return (no copy for an fp32 head). ``tiled_norm``: the final norm runs in tiles (seqpar's runtime under a tiled
    MLP): it saves its input, not its fp32 copy and the weight's product."""
    p, v, h = DTYPE_BYTES[dtype], m.vocab_size, m.hidden_size
    if strategy.fused_ops == "liger":  # Liger's RMSNorm: its input (the last layer's output), fp32 rstd, its output
        final_norm = t * (r * h + 4 + p * h)
    elif tiled_norm:
        final_norm = t * (2 * r + (p if r != p else 0)) * h
    else:
        final_norm = t * (4 + 2 * r + (p if r != p else 0)) * h
    if path == "trl":
        return {
            "final_norm": final_norm,
            "loss_hidden_copy": t * h * p,
            "hidden_grad_fp32": t * h * (4 + p),
            "head_grad_fp32": v * h * (4 + (wb if wb != 4 else 0)),
            "loss_chunk": min(t, TRL_TOKEN_CHUNK) * min(v, TRL_VOCAB_CHUNK) * p + 8 * t,  # tile + saved log_z, entropy
        }
    if strategy.loss_impl == "hf":
        return {"final_norm": final_norm, "loss_fp32_logits": t * v * 12}
    chunk = min(t, c.loss_chunk_tokens)
    # one chunk: its logits in the model dtype, their fp32 copy and the fp32 log-softmax (forward), or the fp32 product,
    # its softmax and the gradient in the model dtype (backward): p + 8 bytes per token and vocabulary entry
    return {
        "final_norm": final_norm,
        "hidden_grad_fp32": t * h * 4,
        "head_grad_fp32": v * h * 4,
        "loss_chunk": chunk * v * (p + 8),
    }


def _nccl_groups(strategy: Strategy, world: int) -> int:
    if world == 1:
        return 0
    return 1 + (strategy.sp_degree > 1) + takes_ulysses_degree(strategy.mode)  # a hybrid mode: ring and Ulysses groups


def attention_backward_workspace(
    m: ModelSpec, t: float, cluster: ClusterSpec, c: Coefficients, heads_split: int = 1, cut: bool = True
) -> float:
    """Bytes the attention kernel's backward allocates for itself while it runs, for t query tokens of one call (the
    local tokens in every mode: a ring step's KV block and a Ulysses call's whole sequence at 1/P heads come to the
    same), beside dq, dk, dv.

    cuDNN (Hopper and newer; torch's run_cudnn_SDP_bprop allocates the graph's workspace through the caching
    allocator as one block): the softmax sum dO.O, fp32 per query head and token; with GQA, dK and dV at the query
    heads' width before they are summed onto the KV heads, 8 bytes per element together (seqpar.plan.attention_calls,
    with its source): Llama-3.1-8B at 172032 tokens on an H100 asked for 5.27 GiB = 172032 x 32 x (128 x 8 + 4) bytes,
    its out-of-memory message. Past ``attention_calls.WORKSPACE_BUDGET`` the runtime cuts the backward into calls over
    groups of KV heads (the same rule, seqpar.runtime.parallel.kernels): then one call's workspace, plus that call's
    own copies of its heads (dO, q, out at its query heads; k, v at its KV heads) and its gradients before they are
    written into place.
    flash (FlashAttention-2, PyTorch's and flash-attn's): not counted. Its source allocates an fp32 dq accumulator and,
    with GQA, dk, dv at the query heads' width (flash_api.cpp, mha_bwd: dq_accum, dk_expanded, dv_expanded), but the
    published ALST runs on FlashAttention-2 (seqpar/profiles/published_runs.json, 14M and 15M tokens at sp 32) used
    74.5 and 78.5 GiB of device memory in all, where the dq accumulator alone would add 6.7 GiB to a prediction that
    already meets them within 2%: without a measurement of our own the term stays out, and the margin carries it.
    ``heads_split``: Ulysses' degree u; a call then sees a / u query heads and kv / u KV heads (at least one: the KV
    heads are replicated when u > kv) over u t tokens, so GQA, and its full-head workspace, is gone once a call holds as
    many KV heads as query heads (u >= a, e.g. Llama-3.1-8B's 32 heads at sp 32). ``cut`` False: one call whatever
    its size, as the runtime ran before it cut the backward (measured runs from then, seqpar.advisor.cost.measurements)."""
    if cluster.accelerator != "cuda" or c.attention_backend(cluster) != "cudnn":
        return 0.0
    u = max(heads_split, 1)
    a, kv, d = m.num_attention_heads, m.num_key_value_heads, m.head_dim
    q_local, kv_local, tokens = max(a // u, 1), max(kv // u, 1), t * u
    if not cut:
        return attention_calls.workspace_bytes(tokens, tokens, q_local, kv_local, d)
    return attention_calls.backward_bytes(tokens, tokens, q_local, kv_local, d)


def capacity_bytes(cluster: ClusterSpec, c: Coefficients) -> float:
    """What one process can allocate on the GPU in all: NVML's total less the driver's own reserve (torch.cuda.mem_get_info's
    total; measured per profile or probed through NVML, else the coefficients' default). The CUDA context, the allocator's
    slack and NCCL's buffers come out of it too, as part of the reserved memory."""
    g = cluster.gpu
    if cluster.accelerator != "cuda":
        return g.memory_gib * GIB
    reserve = g.driver_reserved_gib if g.driver_reserved_gib is not None else c.driver_reserve_gib
    return (g.memory_gib - reserve) * GIB


def estimate_memory(
    w: Workload,
    cluster: ClusterSpec,
    s: Strategy,
    c: Coefficients,
    margin: bool = True,
    loss_path: str = "seqpar",
    attention_cut: bool = True,
    norms_tiled: bool = True,
) -> MemoryEstimate:
    """Peak allocated bytes per GPU over a step's phases, what the allocator and CUDA reserve beyond it, and whether it
    fits with the gate's margin (``margin=False``: with none, as the margin's own rows are predicted). ``loss_path``: whose
    loss runs, seqpar's own (``seqpar``) or TRL's SFTTrainer (``trl``: its fused LM head whatever the plan's loss_impl,
    _loss_bytes). ``attention_cut`` False: the attention backward as one call (attention_backward_workspace).
    ``norms_tiled`` False: under a tiled MLP the model's own RMSNorms run whole, as in another tool's runtime or a run
    from before seqpar tiled them (seqpar's runtime tiles them with the MLP, tiled_mlp.tile_norms)."""
    m, dtype = w.model, w.dtype
    prec = precision(w, s, cluster.accelerator)
    p, r = prec.compute, prec.residual
    if cluster.accelerator != "cuda":
        dtype = "fp32"
    world, L = s.world_size, m.num_layers
    t = w.micro_batch_size * w.seq_len / s.sp_degree
    h, i = m.hidden_size, m.intermediate_size
    accum = s.gradient_accumulation_steps
    lo = lora.regime(w, s, cluster.accelerator)  # None for a full fine-tuning
    states = lora.model_states(m, lo, s.sharding, world) if lo else model_states(m, s.sharding, w.optimizer, dtype, world, prec)
    grads_full = states["gradients"]
    ds = _deepspeed_terms(w, s, prec, world, lo)  # DeepSpeed's own buffers (zero* only)
    opt = {"weights": states["weights"], "optimizer_states": states["optimizer_states"], "deepspeed_bucket": ds.bucket}
    if lo is not None:
        opt["adapter_weights"] = states["adapter_weights"]
    gathered = states.get("gathered_params", 0.0)
    layers = split(m, s)
    kept_cum = [0.0]  # kept_cum[j]: bytes kept on the GPU by layers 0..j-1
    tn = norms_tiled and tiles_norms(s)  # the model's own norms, in tiles
    for b in kept_by_layer(m, dtype, s, r, lo, tn):
        kept_cum.append(kept_cum[-1] + b * t)
    # two offloaded layer inputs in flight on the GPU while the offloaded layers run (forward: going out; backward: coming
    # back); the GPU-kept layers above them move nothing, so with a split the top of the step has none in flight
    offload_inflight = 2 * r * h * t if layers.host else 0.0
    top_inflight = offload_inflight if layers.host == L else 0.0
    # kept_saves matmuls: a layer's kept matmul outputs; the last host-kept layer's are still on their way out at the end
    # of the forward when no GPU-kept layer follows it
    mm = matmul_bytes_per_token(m, dtype) * t if layers.matmuls else 0.0
    if layers.kept_host and not layers.kept_gpu:
        top_inflight += mm
    # autocast caches a bf16 copy of every fp32 matmul weight until the forward's autocast region exits (before backward)
    cache = 2 * matmul_params(m) if prec.autocast_cache else 0.0
    # LoRA: the frozen base is in the model dtype already; fp32 adapters under autocast are cast (lora.regime)
    cache += lora_adapter_cache(m, lo)
    dequant = lora.dequant_buffer_bytes(m, lo) if lo else 0.0  # QLoRA: one layer's weight dequantized at a time
    fwd_buf, bwd_buf = mode_buffers(m, dtype, s, t)
    # gradient accumulation keeps them between micro-batches; DeepSpeed allocates the partition's buffer once
    carried_grads = grads_full if accum > 1 or ds.grads_preallocated else 0.0

    tile = mlp_tile_tokens(t, h) if s.tiled_mlp else 0.0
    # forward, at the end of the last layer: every layer's kept tensors plus the working set of one layer
    if s.tiled_mlp:  # the MLP's intermediates exist for one tile at a time
        work_fwd = t * 2 * p * h + tile * 3 * p * i
    else:
        # the last layer's transient activations, unless it is one that keeps them all (counted in kept_cum)
        # (kept_saves matmuls: its gate and up outputs are counted there, the SwiGLU product is not)
        if layers.kept == 0:
            work_fwd = t * (2 * p * h + 3 * p * i)
        else:
            work_fwd = t * (2 * p * h + (p * i if layers.matmuls else 0))
    forward = {
        **opt,
        "gradients": carried_grads,
        "gathered_params": gathered,
        "autocast_weight_cache": cache,
        "checkpointed_activations": max(kept_cum[L] + top_inflight, kept_cum[layers.host] + offload_inflight),
        "layer_working_set": work_fwd + (lora.forward_transient_bytes(m, lo, s.tiled_mlp) * t if lo else 0.0),
        "mode_buffers": fwd_buf,
        "dequantized_weight": dequant,
    }
    # the loss's backward: logits and their fp32 copies; the head's gradient appears
    loss_terms = _loss_bytes(m, dtype, s, t, c, r, loss_path, prec.weight, tiled_norm=tn)
    share = grads_full / max(m.num_params, 1)  # gradient bytes per parameter on this GPU
    head_grad = 0.0 if m.tie_word_embeddings else m.vocab_size * h * share
    if lo is not None:  # the LM head is frozen: no gradient, and the chunked loss accumulates none for it
        loss_terms.pop("head_grad_fp32", None)
        share, head_grad = grads_full / max(lora.adapter_params(m, lo.spec), 1), 0.0
    # the loss's forward runs inside the autocast region (weight cache live, 10 of the 12 bytes), its backward after it
    base_loss = {
        **opt,
        "gathered_params": max(m.vocab_size * h * p if gathered else 0.0, ds.kept_gathered),
        "checkpointed_activations": kept_cum[L] + top_inflight,
    }
    loss_bwd = {**base_loss, "gradients": max(carried_grads, head_grad), **loss_terms}
    loss_fwd = {**base_loss, "gradients": carried_grads, "autocast_weight_cache": cache, **loss_terms}
    if "loss_fp32_logits" in loss_fwd:
        loss_fwd["loss_fp32_logits"] *= 10 / 12
    loss = max(loss_fwd, loss_bwd, key=lambda d: sum(d.values()))
    # backward of layer j, recomputing it when it is checkpointed: linear in j within each block of the split, so its
    # maximum is at the top layer (j = L-1), the top checkpointed layer or the bottom one (j = 0)
    recompute = saved_bytes_per_token(m, dtype, r, s.fused_ops, s.tiled_mlp, lo, tn) * t
    # the layer's backward peaks either in the MLP's backward (two intermediates' gradients) or in attention's (dq, dk,
    # dv beside the saved q, k, v, out); untiled the MLP moment is larger, tiled it is attention's
    attn_grads = t * p * (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    attn_grads += attention_backward_workspace(
        m, t, cluster, c, head_degree(s.mode, s.sp_degree, s.ulysses_degree), cut=attention_cut
    )
    if s.tiled_mlp:
        grad_flow = t * 2 * r * h + max(tile * 2 * p * i, attn_grads)  # hidden grads in and out + the larger moment
        # one tile's recomputed intermediates (unfused: gate, silu, up, product; liger: gate, up, product) and the fp32
        # weight-gradient accumulators of one MLP (gate, up, down: 3 h x I; LoRA: of its adapters, what trains)
        accumulators = 4 * lora.mlp_adapter_params_per_layer(m, lo.spec) if lo else 3 * h * i * 4
        tiled_buffers = tile * (3 if s.fused_ops == "liger" else 4) * p * i + accumulators
    else:
        # Liger's SwiGLU backward writes the gate and up gradients into its saved inputs (in place): only the
        # product's gradient is new there
        mlp_grads = (1 if s.fused_ops == "liger" else 2) * p * i
        # attention's backward runs after the MLP's, whose saved tensors (gate, up, product; unfused silu too) are
        # freed by then: that moment has them less
        mlp_saved = (3 if s.fused_ops == "liger" else 4) * p * i
        grad_flow = t * 2 * r * h + max(t * mlp_grads, attn_grads - t * mlp_saved)
        tiled_buffers = 0.0
    per_layer_grad = m.layer_params * share
    gathered_grad = m.layer_params * p if gathered else 0.0  # the gathered layer's gradient before its reduce-scatter
    if lo is not None:  # the adapters' gradients only; their input gradients meet the frozen base's (lora.grad_moment_bytes)
        grad_flow = max(grad_flow, t * (2 * r * h + lora.grad_moment_bytes(m, lo, s.tiled_mlp)))
        per_layer_grad = lora.adapter_params_per_layer(m, lo.spec) * share
        gathered_grad = lora.adapter_params_per_layer(m, lo.spec) * p if gathered else 0.0
    if tn:  # a tiled norm's backward: the residual's gradient, the incoming one, dX, and one tile's temporaries (the
        # five fp32 ones, the tile's recomputed output, its input gradient and the weight's first product: 3 r more)
        grad_flow = max(grad_flow, t * 3 * r * h + min(t, tile) * (NORM_BACKWARD_BYTES + 3 * r) * h)
    elif s.fused_ops != "liger":
        # an unfused norm's backward, a moment of its own: the post-attention norm's runs after the MLP's backward,
        # whose saved tensors (in layer_recompute when untiled) are freed by then; tiled, it is the layer's largest
        mlp_gone = 0.0 if s.tiled_mlp else t * 4 * p * i
        grad_flow = max(grad_flow, t * (r * h + NORM_BACKWARD_BYTES * h) - mlp_gone)
    ck, on_host = layers.checkpointed, set(layers.host_kept)

    # a kept_saves matmuls layer's recomputation makes what the layer saves but its kept matmul outputs (v, gate, up)
    # and attention's kept out + lse: the norms, q and k after RoPE, the SwiGLU product (and silu, unfused)
    p_m, a, kv, d = DTYPE_BYTES[dtype], m.num_attention_heads, m.num_key_value_heads, m.head_dim
    elementwise = (recompute / t - p_m * (a * d + kv * d + 2 * i) - 4 * a) * t if layers.matmuls and t else 0.0

    def rebuilt(j: int) -> float:
        """What layer j's backward rebuilds: a checkpointed layer everything it saves; a kept_saves matmuls layer its
        elementwise tensors, plus its own outputs fetched back when it is host-kept and the layer below's when that one
        is (fetched one layer ahead)."""
        if j < ck:
            return recompute
        if not layers.matmuls:
            return 0.0
        fetched = (j in on_host) + (j - 1 in on_host and j - 1 >= ck)
        return elementwise + fetched * mm

    # offload_stride k: backward of an offloaded layer recomputes the inputs of its group below it from the host-held
    # one and keeps them until their own backward: up to k - 1 layer inputs on the GPU
    chain = (layers.stride - 1) * r * h * t
    backward = {}
    points = {L - 1, max(ck - 1, 0), 0}
    # each host-kept layer and the layer above it (which fetches it): the GPU holds one or two layers' outputs more there
    points |= {j + d for j in on_host for d in (0, 1) if j + d < L}
    for j in sorted(points, reverse=True):
        g = max(carried_grads, head_grad + (L - 1 - j) * per_layer_grad + gathered_grad)
        cand = {
            **opt,
            "gradients": g,
            "gathered_params": gathered + ds.kept_gathered,
            "checkpointed_activations": kept_cum[j + 1] + (offload_inflight + chain if j < layers.host else 0.0),
            "layer_recompute": rebuilt(j),
            "gradient_flow": grad_flow,
            "tiled_mlp_buffers": tiled_buffers,
            "mode_buffers": bwd_buf,
            "dequantized_weight": dequant,
        }
        if sum(cand.values()) > sum(backward.values()):
            backward = cand
    # optimizer step: the states plus one fp32 temporary of the largest local tensor (per-tensor update)
    largest = (lora.largest_adapter(m, lo.spec) if lo else max(m.vocab_size * h, h * i)) * (
        1.0 if s.sharding in ("ddp",) else 1.0 / world
    )
    optimizer = {
        **opt,
        "gradients": grads_full,
        "optimizer_temporaries": (2 * prec.grad * largest if w.optimizer != "none" else 0.0),
    }
    if s.sharding == "zero3_offload":
        optimizer["optimizer_temporaries"] = 0.0  # the update runs on the CPU
    elif ds.step_fp32:  # DeepSpeed's flat fp32 pieces (seqpar.advisor.cost.deepspeed_memory)
        optimizer["optimizer_temporaries"] = ds.step_fp32
        optimizer["gradients"] = 0.0 if ds.step_frees_grads else grads_full

    phases = {"forward": forward, "loss": loss, "backward": backward, "optimizer": optimizer}
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak_phase = max(totals, key=totals.get)
    breakdown = {k: v for k, v in phases[peak_phase].items() if v > 0}
    peak = totals[peak_phase]
    fixed = (c.cuda_context_gib + c.nccl_buffer_gib_per_group * _nccl_groups(s, world)) * GIB
    reserved = peak + c.allocator_slack(peak) + fixed
    # what must fit: the caching allocator hands back its cached blocks and retries before it raises out-of-memory
    # (torch c10/cuda/CUDACachingAllocator.cpp, malloc: release_available_cached_blocks, then release_cached_blocks),
    # so of its slack only the part it cannot give back counts (allocator_reserve_gib), not the share of the peak it
    # keeps cached while memory is plentiful
    required = peak + c.allocator_reserve_gib * GIB + fixed
    capacity = capacity_bytes(cluster, c)
    host = host_bytes(w, cluster, s, c)
    host_cap = cluster.host_ram_gib * GIB * c.host_ram_usable_fraction
    kept, basis = 0.0, ""
    if margin and cluster.accelerator == "cuda":
        got = memory_margin(w, s, c, estimate_memory)  # it predicts the measured runs with this function
        kept, basis = got.fraction * peak, got.basis
    elif margin:  # CPU ranks: no measured runs to take an error from
        kept, basis = c.memory_margin_floor * peak, f"CPU ranks: the floor of {c.memory_margin_floor:.0%}"
    reason = ""
    if required + kept > capacity:
        reason = (
            f"predicted peak {peak / GIB:.1f} GiB allocated in {peak_phase} + {(required - peak) / GIB:.1f} GiB CUDA "
            f"context and allocator + {kept / GIB:.1f} GiB margin > {capacity / GIB:.1f} GiB a process can allocate on "
            f"{cluster.gpu.name}"
        )
    elif host > host_cap:
        reason = f"host RAM: {host / GIB:.0f} GiB per node needed > {host_cap / GIB:.0f} GiB usable"
    return MemoryEstimate(
        peak,
        peak_phase,
        breakdown,
        totals,
        reserved,
        capacity,
        host,
        host_cap,
        not reason,
        reason,
        phase_terms=phases,
        required_bytes=required,
        margin_bytes=kept,
        margin_basis=basis,
    )


def host_bytes(w: Workload, cluster: ClusterSpec, s: Strategy, c: Coefficients) -> float:
    """Host RAM per node: every CUDA rank's own process (libraries and CUDA's host-side state: host_process_gib),
    ZeRO-3 offload's bf16 params, fp32 grads and optimizer, and the offloaded layer inputs. CPU clusters count none of it
    here: their ranks' memory is the "GPU" memory the rest of this module estimates."""
    m, p = w.model, DTYPE_BYTES[w.dtype]
    out = 0.0
    if cluster.accelerator == "cuda":
        out += cluster.gpus_per_node * c.host_process_gib * GIB
    if s.sharding == "zero3_offload":
        lo = lora.regime(w, s, cluster.accelerator)
        states = lora.host_state_bytes(m, lo) if lo else m.num_params * (p + 4 + optimizer_bytes_per_param(w.optimizer, w.dtype))
        out += states / cluster.nodes
    layers = split(m, s)
    t = w.micro_batch_size * w.seq_len / s.sp_degree
    if layers.host:  # the layer inputs in the residual stream's dtype (fp32 under autocast with fp32 parameters)
        r = precision(w, s, cluster.accelerator).residual
        out += layers.host_inputs * r * m.hidden_size * t * cluster.gpus_per_node
    # exact-size page-locked blocks (seqpar.runtime.memory.matmul_keep), those the pinned budget holds: beyond it the outputs
    # are not kept anywhere (their matmuls run again)
    _, layer, fit = kept_host_matmuls(w, cluster, s)
    return out + fit * layer * cluster.gpus_per_node


def kept_host_matmuls(w: Workload, cluster: ClusterSpec, s: Strategy) -> tuple[int, float, int]:
    """(layers holding their matmul outputs in host memory, bytes of one layer's, how many fit the pinned budget left
    by the offloaded inputs): seqpar.runtime.memory.matmul_keep takes exact-size page-locked blocks while the budget lasts and
    recomputes the matmuls of the rest."""
    layers = split(w.model, s)
    if not layers.kept_host:
        return 0, 0.0, 0
    t = w.micro_batch_size * w.seq_len / s.sp_degree
    layer = matmul_bytes_per_token(w.model, w.dtype) * t
    _, inp, pinned = offloaded_inputs(w, cluster, s)
    budget = cluster.pinned_gib_per_rank * GIB - pinned * pinned_block(inp)
    return layers.kept_host, layer, max(0, min(layers.kept_host, int(budget // layer)))


def offloaded_inputs(w: Workload, cluster: ClusterSpec, s: Strategy) -> tuple[int, float, int]:
    """(layers offloaded, bytes of one layer input, how many of them fit the pinned budget): the cluster's pinned host
    memory per rank (ClusterSpec.pinned_gib_per_rank), each input in a power-of-two block as the caching host allocator
    takes it; seqpar.runtime.memory.offload pins the first layers' inputs while they fit and puts the rest in pageable memory."""
    host = split(w.model, s).host_inputs  # under offload_stride, every stride-th offloaded layer's
    if not host:
        return 0, 0.0, 0
    layer = precision(w, s, cluster.accelerator).residual * w.model.hidden_size * w.micro_batch_size * w.seq_len / s.sp_degree
    budget = cluster.pinned_gib_per_rank * GIB
    return host, layer, min(host, int(budget // pinned_block(layer)))


# --------------------------------------------------------------------------------------------- LoRA's own terms


def lora_adapter_cache(m: ModelSpec, lo: lora.Lora | None) -> float:
    """Autocast's copies of fp32 adapters in the compute dtype while the forward runs (lora.regime's copies); 0 else."""
    return lora.adapter_params(m, lo.spec) * lo.compute if lo is not None and lo.copies else 0.0


def _deepspeed_terms(w: Workload, s: Strategy, prec: Precision, world: int, lo: lora.Lora | None):
    """DeepSpeed's own buffers (deepspeed_memory.terms); with LoRA its optimizer holds the adapters only and a gathered
    layer is the frozen base's block (4-bit under nf4) with its adapters."""
    if lo is None:
        return deepspeed_memory.terms(w.model, s.sharding, w.optimizer, prec.grad, world)
    m = w.model
    layer = lora.base_layer_bytes(m, lo) + lora.adapter_params_per_layer(m, lo.spec) * lo.compute
    return deepspeed_memory.terms(
        m, s.sharding, w.optimizer, prec.grad, world, trainable=lora.adapter_params(m, lo.spec), layer_bytes=layer
    )
