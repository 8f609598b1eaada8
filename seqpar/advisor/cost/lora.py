"""What LoRA and QLoRA change in the cost model: a frozen base, the adapters' states, 4-bit weights and their
dequantization, the tensors backward saves, its FLOPs and elementwise traffic. memory.py and throughput.py call these
where the workload has ``lora``; a full fine-tuning never reaches this module.

* The regime (``regime``), mirroring memory.precision for a full fine-tuning: the base is frozen, so it has no
  gradients, no optimizer states and no fp32 master copy, and stays in the model dtype; the adapters (peft's lora_A and
  lora_B, seqpar.plan.lora counts them) train as a full fine-tuning's parameters would in the same sharding: DDP keeps
  them in fp32 (peft's ``autocast_adapter_dtype`` default) under autocast, with fp32 gradients and two fp32 moments
  (4 + 4 + 8 bytes); FSDP2 an fp32 sharded master that it computes in the model dtype; ZeRO the model dtype plus
  DeepSpeed's fp32 master and moments (2 + 2 + 12); adamw-bf16 everything in the model dtype (p + p + 2p); optimizer
  none no states; CPU ranks fp32 throughout.
* nf4 (QLoRA; bitsandbytes 0.50.2 ``functional.quantize_4bit`` with ``blocksize=64``, ``quant_type="nf4"`` and
  ``compress_statistics=True``, what transformers' BitsAndBytesConfig ``bnb_4bit_use_double_quant`` asks and seqpar's
  exports write): each decoder linear's weight as 4-bit codes packed two per byte, one absmax per block of 64 weights
  quantized to 8 bits, those quantized in blocks of 256 with one fp32 absmax each, and per matrix the fp32 offset, the
  256-entry fp32 code of the 8-bit quantization and the 16-entry fp32 NF4 code (``nf4_bytes``): 0.5 + 1/64 + 4/16384
  bytes per weight (the QLoRA paper, Dettmers et al. 2023, sec. 3: 0.127 bits per weight of constants). transformers
  keeps the LM head, and the embedding and the norms, which are no linears, in the model dtype.
* Dequantization: bitsandbytes' ``MatMul4Bit`` multiplies long inputs by dequantizing the whole weight to the compute
  dtype and calling F.linear (``gemm_4bit``'s fallback past a few rows, backends/cuda/ops.py), and its backward
  dequantizes it again for the input's gradient: one full weight matrix of the layer (the largest, h x I) lives in the
  compute dtype while a linear runs (``dequant_buffer_bytes``), and each pass reads every 4-bit weight and writes it
  out in the compute dtype (``dequant_bytes_per_layer``).
* Saved tensors (``saved_bytes_per_token``; measured with torch's saved_tensors_hooks on transformers' Llama under peft,
  tests/advisor/cost/test_lora.py): autograd saves only what the required gradients need, so a frozen linear keeps no
  input (no weight gradient) and a frozen norm keeps neither its normalised input nor its output: each RMSNorm keeps
  its fp32 input, attention its q, k, v, out and lse, the SwiGLU its gate, silu(gate) and up (Liger's: gate and up).
  Each adapter keeps its rank-r intermediate (lora_B's input) and its input (lora_A's): the base's own tensor when the
  adapter computes in its dtype, counted once per distinct input (the q/k/v norm output, attention's out, already
  kept, the gate/up norm output, the SwiGLU product); its own cast copy when it does not (fp32 adapters under autocast:
  peft casts the input to fp32 and autocast back, ``copies``); with dropout its own dropped copy and the mask (one
  byte on CUDA, native_dropout's bool; the input's dtype on CPU). A tiled MLP keeps nothing of its adapters either, but
  keeps its input (the post-attention norm's output, which the frozen base saves nowhere else); tiled norms (seqpar's
  runtime under a tiled MLP) keep their input instead of its fp32 copy (the input norm's is the layer input, counted
  where the layer input is kept).
* Backward: the frozen linears compute their input's gradient only, 2 N FLOPs per token instead of 4 N, and the
  adapters 6 r (in + out) per targeted linear (2 forward, 4 backward), once more forward when recomputed
  (``linear_flops_per_token``). Each adapter's input gradient meets the base's before they are summed, with copies
  after an fp32 round trip (``grad_moment_bytes``).
* Elementwise traffic per targeted linear and forward (``elementwise_bytes_per_token``): the scaled adapter output
  added to the base's (peft's ``result + lora_B(lora_A(x)) * scaling``: 5 p bytes per output), with copies the casts
  to fp32 and back (2 (p + 4) per input), with dropout its read, write and mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from seqpar.plan.base import DTYPE_BYTES
from seqpar.plan.lora import MLP, adapter_params, adapter_params_per_layer, linear_shapes, targeted_shapes
from seqpar.plan.specs import LoraSpec, ModelSpec, Strategy, Workload

NF4_BLOCK = 64  # bitsandbytes quantize_4bit's (and Params4bit's) default blocksize
NF4_STATS_BLOCK = 256  # compress_statistics: the absmax values quantized by quantize_blockwise(..., blocksize=256)
NF4_PER_MATRIX = 4 + 256 * 4 + 16 * 4  # fp32 offset, the 8-bit quantization's 256-entry code, the NF4 code (fp32)


@dataclass(frozen=True)
class Lora:
    """A workload's adapters under one strategy's regime: what the cost model needs of them (``regime``)."""

    spec: LoraSpec
    base: int  # bytes per frozen base weight in the model dtype (the embedding, norms and LM head; every linear but nf4's)
    adapter: int  # bytes per adapter weight as held
    grad: int  # bytes per adapter gradient
    optim: int  # bytes per adapter parameter of optimizer state (master copy + moments)
    compute: int  # the matmuls' and activations' dtype
    copies: bool  # each adapter casts its input to its own dtype and autocast casts it back (fp32 adapters, autocast)
    mask: int  # bytes per element of a dropout mask
    text: str

    @property
    def nf4(self) -> bool:
        return self.spec.base_dtype == "nf4"


def regime(w: Workload, s: Strategy, accelerator: str = "cuda") -> Optional[Lora]:
    """The workload's adapters as the runtime keeps them under ``s`` (module docstring); None for a full fine-tuning."""
    spec = w.lora
    if spec is None:
        return None
    p = DTYPE_BYTES[w.dtype]
    adam = {"adamw": 8, "adamw-bf16": 2 * p, "none": 0}[w.optimizer]
    mask = 1 if accelerator == "cuda" else None
    if accelerator != "cuda" or w.dtype == "fp32":
        return Lora(spec, 4, 4, 4, 8 if w.optimizer != "none" else 0, 4, False, mask or 4, "fp32 base and adapters")
    base = f"frozen {'4-bit NF4' if spec.base_dtype == 'nf4' else w.dtype} base"
    if w.optimizer in ("adamw-bf16", "none"):
        return Lora(spec, p, p, p, adam, p, False, 1, f"{base}, {w.dtype} adapters")
    if s.sharding == "fsdp":
        return Lora(spec, p, 4, 4, adam, p, False, 1, f"{base}, fp32 sharded adapters, FSDP2 computes in {w.dtype}")
    if s.sharding.startswith("zero"):
        return Lora(spec, p, p, p, 12, p, False, 1, f"{base}, DeepSpeed {w.dtype} adapters + fp32 master")
    return Lora(spec, p, 4, 4, adam, p, True, 1, f"{base}, fp32 adapters under autocast to {w.dtype}")


# --------------------------------------------------------------------------------------------- weights


def nf4_bytes(numel: int) -> float:
    """Bytes of one weight matrix of ``numel`` weights in bitsandbytes' NF4 with double quantization (module docstring)."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / NF4_STATS_BLOCK) + NF4_PER_MATRIX


def linear_weights(m: ModelSpec) -> int:
    """Weights of one decoder block's linears (no biases)."""
    return sum(i * o for i, o in linear_shapes(m).values())


def base_layer_bytes(m: ModelSpec, lo: Lora) -> float:
    """Bytes of one decoder block of the frozen base: its linears in nf4 or the model dtype, the rest (norms, biases) in
    the model dtype."""
    if not lo.nf4:
        return m.layer_params * lo.base
    return sum(nf4_bytes(i * o) for i, o in linear_shapes(m).values()) + (m.layer_params - linear_weights(m)) * lo.base


def base_bytes(m: ModelSpec, lo: Lora) -> float:
    """Bytes of the whole frozen base: its decoder blocks, the embedding and LM head, the final norm."""
    return m.num_layers * base_layer_bytes(m, lo) + (m.num_params - m.num_layers * m.layer_params) * lo.base


def model_states(m: ModelSpec, lo: Lora, sharding: str, world: int) -> dict[str, float]:
    """GPU bytes at rest: the frozen base (sharded by ZeRO-3 / FSDP only), the adapters, their gradients and optimizer
    states (sharded as a full fine-tuning's are, ZeRO paper sec. 5), ZeRO-3's two gathered layers (base and adapters)."""
    a = adapter_params(m, lo.spec)
    base, n = base_bytes(m, lo), world
    layer = base_layer_bytes(m, lo) + adapter_params_per_layer(m, lo.spec) * lo.compute
    states = {"weights": base, "adapter_weights": a * lo.adapter, "gradients": a * lo.grad, "optimizer_states": a * lo.optim}
    if sharding == "ddp":
        return states
    if sharding == "zero2":
        return {**states, "gradients": a * lo.grad / n, "optimizer_states": a * lo.optim / n}
    if sharding in ("zero3", "fsdp"):
        return {**{k: v / n for k, v in states.items()}, "gathered_params": 2 * layer}
    if sharding == "zero3_offload":
        return {**{k: 0.0 for k in states}, "gathered_params": 2 * layer}
    raise ValueError(sharding)


def host_state_bytes(m: ModelSpec, lo: Lora) -> float:
    """ZeRO-3 offload's host copy: the frozen base, the adapters' bf16 weights, fp32 gradients and optimizer states."""
    return base_bytes(m, lo) + adapter_params(m, lo.spec) * (lo.compute + 4 + lo.optim)


def mlp_adapter_params_per_layer(m: ModelSpec, spec: LoraSpec) -> int:
    """The adapters of one block's MLP linears (what a tiled MLP's backward accumulates gradients of)."""
    return sum(spec.rank * (i + o) for k, (i, o) in targeted_shapes(m, spec).items() if k in MLP)


def largest_adapter(m: ModelSpec, spec: LoraSpec) -> int:
    """Elements of the largest adapter matrix (r x the wider side of its linear): the optimizer step's largest tensor."""
    return max(spec.rank * max(i, o) for i, o in targeted_shapes(m, spec).values())


def dequant_buffer_bytes(m: ModelSpec, lo: Lora) -> float:
    """nf4: the largest weight matrix of a block dequantized to the compute dtype while its linear runs; 0 otherwise."""
    return max(i * o for i, o in linear_shapes(m).values()) * lo.compute if lo.nf4 else 0.0


def dequant_bytes_per_layer(m: ModelSpec, lo: Lora) -> float:
    """HBM bytes one pass over a block's nf4 linears moves to dequantize them: the 4-bit matrices read, their copies in
    the compute dtype written."""
    if not lo.nf4:
        return 0.0
    return sum(nf4_bytes(i * o) + i * o * lo.compute for i, o in linear_shapes(m).values())


# --------------------------------------------------------------------------------------------- activations


def _untiled(m: ModelSpec, lo: Lora, tiled_mlp: bool) -> dict[str, tuple[int, int]]:
    """The targeted linears whose adapters keep tensors for backward: all, but the MLP's under a tiled MLP."""
    return {k: v for k, v in targeted_shapes(m, lo.spec).items() if not (tiled_mlp and k in MLP)}


def adapter_saved_bytes_per_token(m: ModelSpec, lo: Lora, tiled_mlp: bool = False) -> float:
    """What the adapters of one block keep for backward beyond what the frozen block keeps, bytes per token (module
    docstring): the rank-r intermediates, the inputs (shared or copied), the dropout masks."""
    p, shapes = lo.compute, _untiled(m, lo, tiled_mlp)
    out = sum(p * lo.spec.rank for _ in shapes)
    if lo.copies or lo.spec.dropout:
        out += sum((p + (lo.mask if lo.spec.dropout else 0)) * i for i, _ in shapes.values())
        return out
    distinct = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    for names in distinct.values():  # o_proj's input is attention's out, which attention keeps already
        hit = [shapes[k][0] for k in names if k in shapes]
        out += p * hit[0] if hit else 0
    return out


def saved_bytes_per_token(
    m: ModelSpec,
    lo: Lora,
    residual: Optional[int] = None,
    fused_ops: str = "none",
    tiled_mlp: bool = False,
    tiled_norms: bool = False,
) -> float:
    """Tensors one decoder block with frozen base weights and these adapters keeps for backward, bytes per token:
    each norm its fp32 input (Liger's: its rstd, the post-attention one its input; tiled: the post-attention one its
    input, the input norm's being the layer input), attention q, k, v,
    out and lse, the SwiGLU gate, silu(gate) and up (Liger: gate and up; tiled: its input, the post-attention norm's
    output, which the frozen base saves nowhere else), and the adapters' own."""
    h, d, a, kv, i = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_key_value_heads, m.intermediate_size
    p = lo.compute
    r = residual or p
    # Liger's and the tiled input norm save the layer input itself, counted where it is kept (memory.saved_bytes_per_token)
    norms = 2 * 4 + r * h if fused_ops == "liger" else (r if tiled_norms else 2 * 4) * h
    mlp = p * h if tiled_mlp else (2 if fused_ops == "liger" else 3) * p * i
    return norms + 2 * p * a * d + 2 * p * kv * d + 4 * a + mlp + adapter_saved_bytes_per_token(m, lo, tiled_mlp)


def forward_transient_bytes(m: ModelSpec, lo: Lora, tiled_mlp: bool = False) -> float:
    """Bytes per token an adapter's forward holds for a moment beyond what it keeps: with copies, its input cast to
    fp32 beside the compute-dtype copy made from it; with dropout, the dropped input before lora_A takes it. The largest
    targeted input counts (a tiled MLP's per tile only)."""
    widest = max((i for i, _ in _untiled(m, lo, tiled_mlp).values()), default=0)
    if lo.copies:
        return widest * (lo.adapter + lo.compute)
    return widest * lo.compute if lo.spec.dropout else 0.0


def grad_moment_bytes(m: ModelSpec, lo: Lora, tiled_mlp: bool = False) -> float:
    """Bytes per token of the largest adapter input-gradient moment in backward: the adapter's gradient of its input
    beside the base's, with copies its fp32 round trip in between (in (2 p + 4)); the MLP's, tiled, per tile only."""
    extra = lo.adapter if lo.copies else 0
    return max((i * (2 * lo.compute + extra) for i, _ in _untiled(m, lo, tiled_mlp).values()), default=0.0)


# --------------------------------------------------------------------------------------------- time


def linear_flops_per_token(
    m: ModelSpec, lo: Lora, loss_impl: str, tiled_mlp: bool, recomputed: int, matmul_params: int, layer_matmul_params: int
) -> float:
    """Linear FLOPs per token of one micro-batch: the frozen base 2 N forward + 2 N for its inputs' gradients, +2 N_layer
    per recomputed layer; the adapters 6 per parameter, +2 per recomputed one; the chunked loss's recomputed logits
    (2 V h: its frozen head computes no weight gradient); a tiled MLP's second forward (2 * 3 h I per layer and its
    adapters)."""
    a_layer = adapter_params_per_layer(m, lo.spec)
    f = 4.0 * matmul_params + 2.0 * recomputed * layer_matmul_params + 6.0 * a_layer * m.num_layers + 2.0 * recomputed * a_layer
    if loss_impl == "chunked":
        f += 2.0 * m.vocab_size * m.hidden_size
    if tiled_mlp:
        mlp_adapters = mlp_adapter_params_per_layer(m, lo.spec)
        f += 2.0 * (3 * m.hidden_size * m.intermediate_size + mlp_adapters) * m.num_layers
    return f


def elementwise_bytes_per_token(m: ModelSpec, lo: Lora) -> float:
    """HBM bytes per token and block the adapters add to one forward's elementwise traffic (module docstring)."""
    p, out = lo.compute, 0.0
    for i, o in targeted_shapes(m, lo.spec).values():
        out += 5 * p * o
        if lo.copies:
            out += 2 * (p + lo.adapter) * i
        if lo.spec.dropout:
            q = lo.adapter if lo.copies else p
            out += (2 * q + lo.mask) * i
    return out


__all__ = [
    "Lora",
    "adapter_saved_bytes_per_token",
    "base_bytes",
    "base_layer_bytes",
    "dequant_buffer_bytes",
    "dequant_bytes_per_layer",
    "elementwise_bytes_per_token",
    "forward_transient_bytes",
    "grad_moment_bytes",
    "host_state_bytes",
    "largest_adapter",
    "mlp_adapter_params_per_layer",
    "linear_flops_per_token",
    "linear_weights",
    "model_states",
    "nf4_bytes",
    "regime",
    "saved_bytes_per_token",
]
