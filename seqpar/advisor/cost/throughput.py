"""Time of one training step per GPU: FLOPs over effective kernel rates, plus the communication each mode cannot hide.

Counting (per GPU, one micro-batch, t = b*S/sp local tokens, N_lin = parameters in matmuls incl. the LM head):
* Linear part (Kaplan et al. 2020; Narayanan et al. 2021, eq. 3): 2*N_lin FLOPs per token forward, 6*N_lin forward +
  backward, +2*N_lin per token for the decoder layers checkpointing recomputes (all, or the plan's checkpoint_layers)
  (Korthikanti et al. 2022);
  ``tiled_mlp`` adds one more MLP forward, 2 * 3*h*I*L per token (ALST's TiledMLP runs its tiles under no_grad in the
  forward and again with grad in backward).
* Elementwise traffic (norms, RoPE, SwiGLU), bound by HBM bandwidth, bytes per token and layer per forward:
  unfused (the model's own modules, with autocast's fp32 upcasts) 68h + 24(a+kv)d + 10I, Liger's fused kernels
  8h + 4(a+kv)d + 6I; passes = forward + recompute (the checkpointed layers) + backward (2 forward's worth), and
  tiled_mlp's extra MLP forward moves the SwiGLU bytes once more (in seqpar's runtime, which tiles the unfused norms
  too, their 56h as well: TILED_NORMS_BYTES_PER_H): time = t * L * bytes * passes / (HBM bandwidth x
  elementwise_efficiency, the share of it these small kernels reach: fitted on a grid, as h0 below). Not scaled by
  the time factors, like the communication (the fit's ``rest``).
* Causal attention: forward 2*S^2*a*d per layer and sequence (half of the 4*S^2*a*d full-mask count), backward 2.5x
  forward (FlashAttention-2, Dao 2023), +1x forward when checkpointing recomputes the layer (full and offload; selective
  keeps attention's output and lse, so its recomputation skips attention, LightSeq sec. 3.3: 3.5x instead of 4.5x, and the
  ring's forward K,V pass is not repeated; Ulysses' backward sends q, k, v and out across again, as full's recomputation
  does). Sequence parallelism divides it by sp_degree, times the
  mode's imbalance: zigzag, Ulysses and our dist flash schedule (last step split by query rows) are balanced.
* Packed documents (``workload.doc_lens``; None = one document per window, all of the above as it is): attention counts
  the documents' squares (seqpar.plan.flops), each document at its own kernel rate, times the busiest rank's share where the
  layout leaves ranks uneven, and ring / dist flash transfers only where a block shares a document (packed.py).
* Rates: kernel TFLOP/s per GPU profile (coefficients.json kernel_tflops) times fitted factors (the GPU's own when it
  has measurement rows, else the global pair); the matmul rate falls with model width, h / (h + h0), normalised to the
  8192-wide GEMM of kernel_tflops; the attention rate falls for short kernel calls, eff(n) ~ n/(n+n0) (n = query tokens
  per call: S for data parallel and Ulysses, S/(2P) for zigzag chunks, S/P for dist flash blocks), and for narrow heads,
  d / (d + d0), normalised to the 128-wide heads of kernel_tflops; past 64K-token calls it stays flat. h0, d0, n0 and
  the elementwise efficiency: coefficients.json (each with its source); what each term fixed: BENCHMARKS.md, "Cost
  model accuracy".
* Communication (bytes per GPU; bandwidth = NCCL's bus bandwidth for the operation and its per-call message size on the
  link, from published nccl-tests rows: collectives.py): ring: P-1 K,V blocks per layer and pass (plus fp32 dK,dV one
  step behind in backward), each step exposing max(0, transfer - its 1/P of the pass's attention) and backward's last
  dK,dV hop exposed whole (``ring_exposed_s``: the send/recv of step i+1 runs during step i's compute, as
  zigzag_ring_attn and ring-flash-attention lay it out); Ulysses: four all-to-alls per layer and pass, each moving (u-1)/u
  of a q/k/v/o tensor, not hidden; dist flash: P/2 helper steps carrying Q,K,V out and O,lse back, hidden up to
  ``ring_overlap``; all-gather of K,V: the other ranks' K,V gathered in forward and again in backward, their gradients
  reduce-scattered, not hidden (which of these a mode has is its description's ``comm``); gradients: ring all-reduce
  2(N-1)/N*2Psi in DDP's 25 MiB buckets (DDP), reduce-scatter in DeepSpeed's reduce buckets + all-gather of the updated
  partitions (ZeRO-2), per-layer all-gathers in forward and backward + reduce-scatter (ZeRO-3 / FSDP), hidden up to
  ``grad_comm_overlap`` under backward; ZeRO-3 offload adds PCIe copies of the parameter shards and fp32 gradients and
  the CPU Adam step (its host bytes per parameter: deepspeed_memory.CPU_ADAM_HOST_BYTES).
* Checkpoint offload (the plan's offloaded layers): pinned copies mostly hidden under compute, pageable ones beyond the
  pinned budget exposed (``offload_copy_time``, rates: coefficients.json); the first step adds its one-off costs
  (``first_step_extra_s``: the prediction's first_step_s, which the bill counts once).
* LoRA / QLoRA (``workload.lora``; seqpar.advisor.cost.lora): the frozen linears' backward computes their inputs'
  gradients only (4 N_lin per token instead of 6), the adapters add 6 FLOPs per parameter and their elementwise
  traffic; QLoRA dequantizes every 4-bit weight once per forward, recompute and backward (HBM-bound, at the elementwise
  efficiency: ``dequantize``); the model-state traffic moves the adapters' gradients and the frozen base's gathers
  (``lora_state_time``).
* MFU: seqpar.plan.flops' model FLOPs (no recompute) over the datasheet bf16 peak of every GPU, the count measured MFU
  (seqpar.runtime.train.report) uses too.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.advisor.cost import collectives, deepspeed_memory, lora, packed
from seqpar.advisor.cost.coefficients import Coefficients
from seqpar.advisor.cost.memory import (
    kept_host_matmuls,
    offloaded_inputs,
    optimizer_bytes_per_param,
    precision,
    ring_ranks,
    split,
    ulysses_ranks,
)
from seqpar.plan.base import DTYPE_BYTES
from seqpar.plan.flops import attention_fwd_flops, layer_matmul_params, matmul_params, model_flops_per_sequence
from seqpar.plan.modes import describe, split_multiple
from seqpar.plan.options import pinned_block
from seqpar.plan.rules import tiles_norms
from seqpar.plan.specs import ClusterSpec, ModelSpec, Strategy, Workload
from seqpar.plan.units import GIB

REF_CALL_TOKENS = 65536  # kernel_tflops rows are measured at long calls (16K-128K); eff(n) is normalised to 1 here
REF_WIDTH = 8192  # the matmul rate of kernel_tflops is an 8192^3 GEMM; the width efficiency is normalised to 1 there
REF_HEAD_DIM = 128  # the attention rates of kernel_tflops are measured with 128-wide heads (Llama-2-7B's)
DDP_BUCKET_BYTES = 25 * 2**20  # torch DistributedDataParallel's bucket_cap_mb default: 25 MiB per all-reduce call


@dataclass(frozen=True)
class TimeEstimate:
    step_time_s: float
    tokens_per_s: float  # whole cluster
    breakdown_s: dict[str, float]  # compute / elementwise / exposed_comm / offload / optimizer, per optimizer step
    mfu: float
    parts_s: dict[
        str, float
    ]  # unscaled components the fit works on (ideal linear / attention time, fixed rest incl. elementwise)


def linear_flops_per_token(
    m: ModelSpec, checkpointing: str, loss_impl: str, tiled_mlp: bool = False, recomputed: int | None = None
) -> float:
    """6*N_lin forward+backward, +2*N_lin of the recomputed layers (``recomputed``; None = all when checkpointing),
    +2*V*h when the chunked loss recomputes logits, +2*3*h*I*L when tiled_mlp runs each MLP forward once more (its tiles
    are recomputed in backward)."""
    if recomputed is None:
        recomputed = m.num_layers if checkpointing != "none" else 0
    f = 6.0 * matmul_params(m) + 2.0 * recomputed * layer_matmul_params(m)
    if loss_impl == "chunked":
        f += 2.0 * m.vocab_size * m.hidden_size
    if tiled_mlp:
        f += 2.0 * 3 * m.hidden_size * m.intermediate_size * m.num_layers
    return f


def elementwise_bytes_per_token(m: ModelSpec, fused_ops: str = "none") -> tuple[float, float]:
    """(all, SwiGLU's share) of the HBM bytes the norms, RoPE and SwiGLU move per token and layer in one forward."""
    h, i, ad = m.hidden_size, m.intermediate_size, (m.num_attention_heads + m.num_key_value_heads) * m.head_dim
    if fused_ops == "liger":
        return 8.0 * h + 4.0 * ad + 6.0 * i, 6.0 * i
    return 68.0 * h + 24.0 * ad + 10.0 * i, 10.0 * i


# the two unfused RMSNorms' share of a layer's forward bytes (elementwise_bytes_per_token's 68h less the two residual
# adds, 3 x 2h each): what seqpar's tiled norms (tiled_mlp.tile_norms) move once more, recomputing each tile in backward
TILED_NORMS_BYTES_PER_H = 56.0


def elementwise_time(
    m: ModelSpec, cluster: ClusterSpec, s: Strategy, tokens: float, efficiency: float = 1.0, norms_tiled: bool = True
) -> float:
    """Seconds of elementwise traffic for ``tokens`` local tokens: forward, recompute (the checkpointed layers, and the
    kept ones under kept_saves matmuls),
    backward (2), at ``efficiency`` x the GPU's HBM bandwidth (coefficients' elementwise_efficiency; 1 = the bytes
    alone). ``norms_tiled``: under a tiled MLP the unfused norms run in tiles too (seqpar's runtime), one more pass."""
    total, swiglu = elementwise_bytes_per_token(m, s.fused_ops)
    layers = split(m, s)
    recomputed = layers.recomputed + (layers.kept if layers.matmuls else 0)  # kept_saves matmuls: elementwise again
    again = swiglu if s.tiled_mlp else 0.0
    if norms_tiled and tiles_norms(s):
        again += TILED_NORMS_BYTES_PER_H * m.hidden_size
    moved = (total * 3 + again) * m.num_layers + total * recomputed
    return tokens * moved / (cluster.gpu.hbm_bandwidth_gb_s * 1e9 * efficiency)


def attention_recompute_share(m: ModelSpec, s: Strategy) -> float:
    """Share of the layers whose recomputation runs attention's forward again: the checkpointed layers under full and
    offload, and once more each layer whose input an offload_stride rebuilds (so it can pass 1); selective recomputes the layer around attention (seqpar.runtime.memory.selective hands the kept output back), none
    recomputes nothing."""
    if s.checkpointing not in ("full", "offload"):
        return 0.0
    return split(m, s).recomputed / m.num_layers


def attention_multiplier(m: ModelSpec, s: Strategy) -> float:
    return 3.5 + attention_recompute_share(m, s)


def first_step_extra_s(w: Workload, cluster: ClusterSpec, s: Strategy, c: Coefficients) -> float:
    """What the first step costs beyond a warm one: a fixed part (kernel selection, allocator growth, lazy init) and the
    page-locking of the pinned host blocks the checkpoint offload and the host-kept matmul outputs allocate then (both
    reuse them in later steps): the offload's through the caching host allocator (cudaHostAlloc, pinned_alloc_gib_s),
    the kept outputs' registered in place (fresh pages touched by torch's threads, then cudaHostRegister: pinned_register_gib_s)."""
    host, layer, pinned = offloaded_inputs(w, cluster, s)
    _, mm_layer, mm_pinned = kept_host_matmuls(w, cluster, s)
    return (
        c.first_step_s
        + pinned * pinned_block(layer) / GIB / c.pinned_alloc_gib_s
        + mm_pinned * mm_layer / GIB / c.pinned_register_gib_s
    )


def offload_copy_time(w: Workload, cluster: ClusterSpec, s: Strategy, c: Coefficients, compute_s: float) -> float:
    """Exposed seconds of one micro-batch's checkpoint offload: each offloaded layer input goes to the host in forward
    and comes back in backward. Within the pinned budget (ClusterSpec.pinned_gib_per_rank, each block
    rounded to a power of two as the caching host allocator does) the copies are asynchronous and mostly hidden under
    compute; beyond it seqpar.runtime.memory.offload falls back to pageable memory, whose copies are synchronous: exposed.
    The host-kept matmul outputs (kept_host_layers) go out and come back the same way, on a side stream, each layer's
    fetched one layer ahead (the top one, with no GPU-kept layer above it to start it, when its own backward begins).
    Their overlap: coefficients.json side_copy_overlap (fitted)."""
    host, layer, pinned = offloaded_inputs(w, cluster, s)
    _, mm_layer, mm_pinned = kept_host_matmuls(w, cluster, s)
    if not host and not mm_pinned:
        return 0.0
    bw = c.pinned_copy_gb_s * 1e9
    # under offload_stride a host-held input with rebuilt layers above it comes back twice: for the rebuild, then for
    # its own layer's backward
    twice = split(w.model, s).rebuilt_groups
    again_pinned = min(twice, pinned)
    hidden = _hidden((2 * pinned + again_pinned) * layer / bw, compute_s, c.grad_comm_overlap)  # out, back (and again)
    hidden += _hidden(2 * mm_pinned * mm_layer / bw, compute_s, c.side_copy_overlap)
    # no GPU-kept layer above the host-kept ones: the top one's outputs come back when its backward starts, unhidden
    top = mm_layer / (c.pinned_copy_gb_s * 1e9) if mm_pinned and not split(w.model, s).kept_gpu else 0.0
    return hidden + top + (2 * (host - pinned) + twice - again_pinned) * layer / (c.pageable_bandwidth_gb_s * 1e9)


def recomputed_matmul_layers(w: Workload, cluster: ClusterSpec, s: Strategy) -> int:
    """Layers whose matmuls backward runs again: the checkpointed ones (those whose input it recomputes under
    offload_stride once more), and host-kept ones beyond the pinned budget."""
    kept_host, _, fit = kept_host_matmuls(w, cluster, s)
    return split(w.model, s).recomputed + kept_host - fit


def call_tokens(s: Strategy, seq_len: int) -> float:
    """Query tokens of one attention kernel call: one chunk of the mode's split (seqpar.plan.modes), its Ulysses group's chunks
    gathered (S for data parallel and Ulysses, S/(2P) for zigzag, S/(2R) for usp, S/P for dist flash)."""
    return seq_len * ulysses_ranks(s) / split_multiple(s.mode, s.sp_degree, s.ulysses_degree)


def call_efficiency(n: float, c: Coefficients) -> float:
    """eff(n) = n / (n + n0) of a kernel call of n query tokens, normalised to 1 at REF_CALL_TOKENS and no higher beyond
    it: the causal kernel's rate is flat past 64K-token calls (BENCHMARKS.md, "Cost model accuracy"), so longer calls
    gain nothing the curve would give them."""
    n0 = c.attn_block_tokens
    return min(1.0, (n / (n + n0)) / (REF_CALL_TOKENS / (REF_CALL_TOKENS + n0)))


def head_dim_efficiency(head_dim: int, d0: float) -> float:
    """Attention kernel efficiency vs head width, d / (d + d0), relative to the 128-wide heads of the kernel rates: a
    64-wide head does half the FLOPs per byte of q, k, v loaded and per softmax element (Dao 2023, fig. 4; d0:
    coefficients.json)."""
    return (head_dim / (head_dim + d0)) / (REF_HEAD_DIM / (REF_HEAD_DIM + d0))


def imbalance(s: Strategy) -> float:
    """The busiest rank's causal attention work over the mean, by the mode's balance (seqpar.plan.modes).

    zigzag and Ulysses are balanced by construction; our dist_flash_attn schedule is too: LightSeq's P/2+1 steps leave
    the busiest rank P/2+1/2 blocks, but seqpar.runtime.parallel.dist_flash_attn splits the last step's blocks by query
    rows between owner and idle helper (odd P balances exactly as it is), so every rank does P/2 blocks of work. A plain
    contiguous split leaves the last of P ranks r + 1/2 = P - 1/2 blocks against a mean of P/2: (2P - 1)/P."""
    P = s.sp_degree
    if describe(s.mode).balance == "contiguous" and P > 1:
        return (2 * P - 1) / P
    return 1.0


def width_efficiency(hidden: int, h0: float) -> float:
    """Matmul efficiency vs model width, h / (h + h0), relative to the 8192-wide GEMM the kernel rate was measured on:
    narrower GEMMs (h 2048) have fewer tiles and a lower arithmetic intensity per byte of activations moved."""
    return (hidden / (hidden + h0)) / (REF_WIDTH / (REF_WIDTH + h0))


def _bw(
    cluster: ClusterSpec,
    group: int,
    c: Coefficients,
    contiguous_inner: int = 1,
    op: str | None = None,
    message_bytes: float = 0.0,
) -> float:
    """Bytes/s per GPU for a group of ``group`` ranks laid out ``contiguous_inner`` apart: NVLink inside a node, else the
    NIC. With ``op``: NCCL's bus bandwidth for that operation at ``message_bytes`` per call (collectives.py: published
    nccl-tests rows per link); without: the link x comm_bandwidth_efficiency."""
    spans = group * contiguous_inner > cluster.gpus_per_node
    link = cluster.inter_node_link if spans and cluster.inter_node_link else cluster.intra_node_link
    if op is None:
        return link.bandwidth_gb_s * 1e9 * c.comm_bandwidth_efficiency
    return collectives.bus_bandwidth(link.kind, link.bandwidth_gb_s, op, message_bytes, c.comm_bandwidth_efficiency)


def ring_exposed_s(kv_s: float, dkv_s: float, step_compute_s: float, ranks: int) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's ring (zigzag_ring_attn; ring-flash-attention's
    zigzag_ring_flash_attn.py is laid out the same): each step posts the next K,V block's send/recv before its own
    attention and waits for it after, so a step exposes max(0, transfer - compute). Forward: P-1 steps carry K,V, the last
    none. Backward: dK,dV travel one step behind K,V on a second ring, so step 0 carries K,V only, steps 1..P-2 both, step
    P-1 the previous dK,dV only, and the last hop of dK,dV (home to its owner) is waited for after the loop, with no
    compute left to hide it."""
    if ranks <= 1:
        return 0.0, 0.0
    fwd = (ranks - 1) * max(0.0, kv_s - step_compute_s)
    bwd = max(0.0, kv_s - step_compute_s) + max(0.0, dkv_s - step_compute_s) + dkv_s
    bwd += (ranks - 2) * max(0.0, kv_s + dkv_s - step_compute_s)
    return fwd, bwd


def _hidden(comm: float, compute: float, overlap: float) -> float:
    """Exposed time of a transfer run alongside compute: what exceeds it, plus the share overlap cannot hide."""
    return max(comm - compute, 0.0) + (1.0 - overlap) * min(comm, compute)


def estimate_time(w: Workload, cluster: ClusterSpec, s: Strategy, c: Coefficients, norms_tiled: bool = True) -> TimeEstimate:
    """One training step's time (module docstring); ``norms_tiled`` False: a tiled MLP's runtime that leaves the
    model's own norms whole (another tool's, or seqpar's before it tiled them)."""
    m, p = w.model, DTYPE_BYTES[w.dtype]
    b, S, P, world = w.micro_batch_size, w.seq_len, s.sp_degree, s.world_size
    t = b * S / P
    a, d, kv, L = m.num_attention_heads, m.head_dim, m.num_key_value_heads, m.num_layers
    accum = s.gradient_accumulation_steps

    # ---- compute of one micro-batch
    lo = lora.regime(w, s, cluster.accelerator)  # None for a full fine-tuning
    recomputed = recomputed_matmul_layers(w, cluster, s)
    if lo is not None:
        lin_flops = lora.linear_flops_per_token(
            m, lo, s.loss_impl, s.tiled_mlp, recomputed, matmul_params(m), layer_matmul_params(m)
        )
    else:
        lin_flops = linear_flops_per_token(m, s.checkpointing, s.loss_impl, s.tiled_mlp, recomputed)
    lin_ideal = t * lin_flops / (c.kernel_rate_tflops(cluster, "matmul") * 1e12)
    lin_ideal /= width_efficiency(m.hidden_size, c.matmul_width_h0)
    n = call_tokens(s, S)
    eff = call_efficiency(n, c)
    attn_flops = b * attention_fwd_flops(m, S) / P * attention_multiplier(m, s) * imbalance(s)  # dense: packing below
    attn_rate = c.kernel_rate_tflops(cluster, c.attention_backend(cluster)) * 1e12
    attn_ideal = attn_flops / attn_rate / eff / head_dim_efficiency(d, c.attn_head_dim_d0)
    mix, transfers = w.doc_lens, 1.0
    if mix is not None:  # packed documents: their squares at their own kernel rates, on the busiest rank (packed.py)
        short = c.kernel_rate_tflops(cluster, "flash") * 1e12 / attn_rate  # FA2 varlen runs the short documents
        attn_ideal *= packed.attention_time_share(mix, S, n, lambda x: call_efficiency(x, c), short)
        attn_ideal *= packed.imbalance(s, mix, S)
        transfers = packed.transfer_share(s, mix, S)
    lin_factor, attn_factor = c.factors(cluster)
    lin_t, attn_t = lin_ideal * lin_factor, attn_ideal * attn_factor
    # forward, (recompute forward), backward; selective's Ulysses backward re-sends q, k, v, out (runtime/ulysses_attn.py head_split_backward)
    layers = split(m, s)
    passes = 2 + (layers.recomputed + (layers.kept if layers.matmuls else 0)) / L
    attn_fwd_t = attn_t / attention_multiplier(m, s)  # one forward pass over all layers
    recompute_share = attention_recompute_share(m, s)

    # ---- sequence-parallel communication of one micro-batch
    sp_comm = 0.0
    u, r = ulysses_ranks(s), ring_ranks(s)
    kv_eff = kv if (u == 1 or kv % u == 0) else u
    if u > 1:
        a2a_bytes = (u - 1) / u * t * p * (2 * a * d + 2 * kv_eff * d) * L  # q, k, v in and o out, one pass
        call = t * p * (2 * a * d + 2 * kv_eff * d) / 4  # one of the four all-to-alls of a layer (q, k, v, o), on average
        sp_comm += passes * a2a_bytes / _bw(cluster, u, c, op="alltoall", message_bytes=call)
    if r > 1:
        kv_block = 2 * p * t * kv_eff * d  # K and V of t tokens (usp: t*u tokens at kv_eff/u heads)
        dkv_block = 8 * t * kv_eff * d  # their fp32 gradients, one step behind (backward)
        kv_s = kv_block / _bw(cluster, r, c, contiguous_inner=u, op="sendrecv", message_bytes=kv_block)
        dkv_s = dkv_block / _bw(cluster, r, c, contiguous_inner=u, op="sendrecv", message_bytes=dkv_block)
        fwd_x, _ = ring_exposed_s(kv_s, dkv_s, attn_fwd_t / L / r, r)
        _, bwd_x = ring_exposed_s(kv_s, dkv_s, 2.5 * attn_fwd_t / L / r, r)
        # the recomputed layers' forward K,V pass, once more for each layer whose recomputation runs attention
        sp_comm += L * transfers * (fwd_x * (1 + recompute_share) + bwd_x)
    comm = describe(s.mode).comm
    if "peer_blocks" in comm and P > 1:
        bw = _bw(cluster, P, c, op="sendrecv", message_bytes=t * p * (a * d + 2 * kv * d))
        steps = P / 2
        fwd_bytes = t * (p * (a * d + 2 * kv * d) + 4 * a * d + 4 * a)
        bwd_bytes = t * (p * (3 * a * d + 2 * kv * d) + 4 * (a * d + 2 * kv * d))
        # a recomputed layer runs LightSeq's forward, transfers included, once more
        df_passes = [(fwd_bytes, attn_fwd_t, 1.0), (bwd_bytes, 2.5 * attn_fwd_t, 1.0), (fwd_bytes, attn_fwd_t, recompute_share)]
        for pass_bytes, pass_compute, share in df_passes:
            step_compute = pass_compute / L / (steps + 1)
            sp_comm += share * L * steps * transfers * _hidden(pass_bytes / bw, step_compute, c.ring_overlap)
    if "all_gather_kv" in comm and P > 1:
        gathered = (P - 1) * t * 2 * p * kv * d  # the other ranks' K and V of one layer
        # forward gathers; backward gathers again and reduce-scatters dK, dV (as many bytes); a recomputed layer gathers again
        ag = _bw(cluster, P, c, op="all_gather", message_bytes=P / (P - 1) * gathered)
        sp_comm += (3 + recompute_share) * L * gathered / ag

    # ---- model-state traffic
    psi = m.num_params
    bwd_compute = (lin_t + attn_t) * 0.6  # backward (with its recompute) is ~2/3 of the FLOPs; keep some slack
    grad_exposed = offload = opt_t = 0.0
    if world > 1:
        frac = (world - 1) / world
        if s.sharding == "ddp":  # DDP all-reduces the gradients in their dtype: fp32 under autocast (memory.precision)
            gb = precision(w, s, cluster.accelerator).grad
            bw = _bw(cluster, world, c, op="all_reduce", message_bytes=DDP_BUCKET_BYTES)
            grad_exposed = _hidden(2 * frac * psi * gb / bw, bwd_compute * accum, c.grad_comm_overlap)
        elif s.sharding == "zero2":  # reduce-scatter in reduce_bucket_size buckets, then the updated partitions gathered
            rs = _bw(cluster, world, c, op="reduce_scatter", message_bytes=deepspeed_memory.REDUCE_BUCKET * p)
            ag = _bw(cluster, world, c, op="all_gather", message_bytes=psi * p)
            grad_exposed = _hidden(frac * psi * p / rs, bwd_compute * accum, c.grad_comm_overlap) + frac * psi * p / ag
        else:  # zero3 / fsdp / zero3_offload: gathers in forward and backward + reduce-scatter, every micro-batch, a layer a call
            bw = _bw(cluster, world, c, op="all_gather", message_bytes=m.layer_params * p)
            # a layer run again to rebuild an input (offload_stride) gathers its parameters once more
            moved = (3 + layers.recomputed_inputs / L) * frac * psi * p
            grad_exposed = accum * _hidden(moved / bw, lin_t + attn_t, c.grad_comm_overlap)
    if s.sharding == "zero3_offload":
        pcie = c.offload_bandwidth_gb_s * 1e9
        offload = accum * (2 * psi * p / world + psi * 4 / world) / pcie  # parameter shards twice, fp32 gradients once
        opt_t = psi / cluster.nodes / (c.cpu_adam_gparams_per_s * 1e9) if w.optimizer != "none" else 0.0
    elif w.optimizer != "none":
        local = psi if s.sharding == "ddp" else psi / world
        opt_t = local * (2 * optimizer_bytes_per_param(w.optimizer, w.dtype) + 3 * p) / (cluster.gpu.hbm_bandwidth_gb_s * 1e9)
    if lo is not None:  # the adapters' gradients and states, the frozen base's gathers
        grad_exposed, offload, opt_t = lora_state_time(w, cluster, s, c, lo, bwd_compute, lin_t + attn_t)
    offload += accum * offload_copy_time(w, cluster, s, c, lin_t + attn_t)

    compute = accum * (lin_t + attn_t)
    elementwise = accum * elementwise_time(m, cluster, s, t, c.elementwise_efficiency, norms_tiled)
    dequantize = 0.0
    if lo is not None:
        elementwise += accum * lora_elementwise_time(m, cluster, s, lo, t, c.elementwise_efficiency)
        dequantize = accum * dequantize_time(m, cluster, s, lo, c.elementwise_efficiency)
    exposed = accum * sp_comm + grad_exposed
    step = compute + elementwise + exposed + offload + opt_t + dequantize
    tokens = S * b * s.dp_degree * accum
    # seqpar.plan.flops: measured MFU counts the same
    model_flops = b * s.dp_degree * accum * model_flops_per_sequence(m, S, mix, w.lora)
    mfu = model_flops / step / (world * cluster.gpu.bf16_tflops * 1e12)
    parts = {
        "linear_ideal": accum * lin_ideal,
        "attn_ideal": accum * attn_ideal,
        "cpu_adam": opt_t if s.sharding == "zero3_offload" else 0.0,
        "elementwise": elementwise,
    }
    parts["rest"] = (
        step - compute - parts["cpu_adam"]
    )  # fixed, unscaled by the fit: elementwise + communication + offload + GPU Adam
    breakdown = {"compute": compute, "elementwise": elementwise, "exposed_comm": exposed, "offload": offload, "optimizer": opt_t}
    if dequantize:
        breakdown["dequantize"] = dequantize
    return TimeEstimate(step, tokens / step, breakdown, mfu, parts)


# --------------------------------------------------------------------------------------------- LoRA's own terms


def lora_elementwise_time(m: ModelSpec, cluster: ClusterSpec, s: Strategy, lo: lora.Lora, tokens: float, eff: float) -> float:
    """Seconds of the adapters' elementwise traffic (lora.elementwise_bytes_per_token) for ``tokens`` local tokens, over
    the same passes as the block's own (elementwise_time: forward, recompute, backward's two)."""
    layers = split(m, s)
    passes = 3 * m.num_layers + layers.recomputed + (layers.kept if layers.matmuls else 0)
    return tokens * lora.elementwise_bytes_per_token(m, lo) * passes / (cluster.gpu.hbm_bandwidth_gb_s * 1e9 * eff)


def dequantize_time(m: ModelSpec, cluster: ClusterSpec, s: Strategy, lo: lora.Lora, eff: float) -> float:
    """QLoRA: seconds of one micro-batch's dequantization, every 4-bit weight read and written in the compute dtype once
    per forward, per recompute (the checkpointed layers) and per backward (its inputs' gradients); 0 without nf4."""
    passes = 2 * m.num_layers + split(m, s).recomputed
    return lora.dequant_bytes_per_layer(m, lo) * passes / (cluster.gpu.hbm_bandwidth_gb_s * 1e9 * eff)


def lora_state_time(
    w: Workload, cluster: ClusterSpec, s: Strategy, c: Coefficients, lo: lora.Lora, bwd_compute: float, compute: float
) -> tuple[float, float, float]:
    """(exposed gradient communication, ZeRO-3 offload copies, optimizer step) seconds of one step with LoRA: DDP and
    ZeRO-2 reduce the adapters' gradients only; ZeRO-3 / FSDP gather every layer (the frozen base with its adapters) in
    forward and backward and reduce-scatter the adapters' gradients; ZeRO-3 offload copies the base's shards in both
    passes and the adapters' fp32 gradients back, and steps the adapters on the CPU; otherwise the adapters' AdamW on
    the GPU (the frozen base has no update)."""
    m, p = w.model, DTYPE_BYTES[w.dtype]
    world, accum = s.world_size, s.gradient_accumulation_steps
    a, base = lora.adapter_params(m, lo.spec), lora.base_bytes(m, lo)
    grad_exposed = offload = opt_t = 0.0
    if world > 1:
        bw = _bw(cluster, world, c)
        frac = (world - 1) / world
        if s.sharding == "ddp":
            grad_exposed = _hidden(2 * frac * a * lo.grad / bw, bwd_compute * accum, c.grad_comm_overlap)
        elif s.sharding == "zero2":
            grad_exposed = _hidden(frac * a * p / bw, bwd_compute * accum, c.grad_comm_overlap) + frac * a * p / bw
        else:  # a layer run again to rebuild an input (offload_stride) gathers once more
            rebuilt = split(m, s).recomputed_inputs / m.num_layers
            moved = frac * ((2 + rebuilt) * (base + a * p) + a * p)
            grad_exposed = accum * _hidden(moved / bw, compute, c.grad_comm_overlap)
    if s.sharding == "zero3_offload":
        offload = accum * (2 * (base + a * p) / world + a * 4 / world) / (c.offload_bandwidth_gb_s * 1e9)
        opt_t = a / cluster.nodes / (c.cpu_adam_gparams_per_s * 1e9) if w.optimizer != "none" else 0.0
    elif w.optimizer != "none":
        local = a if s.sharding == "ddp" else a / world
        opt_t = local * (2 * lo.optim + 3 * p) / (cluster.gpu.hbm_bandwidth_gb_s * 1e9)
    return grad_exposed, offload, opt_t
