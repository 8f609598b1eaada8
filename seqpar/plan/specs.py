"""What a plan is made of: the hardware (GPU, links, cluster), the model, the workload (with its packed-document
mix) and the strategy. Each validates where it is built, and its messages carry the numbers and a fix.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, ValidationError, model_validator

from seqpar.plan.base import (
    Accelerator,
    Architecture,
    Checkpointing,
    DType,
    Frozen,
    FusedOps,
    KeptSaves,
    LinkKind,
    LossImpl,
    Mode,
    Optimizer,
    Sharding,
)
from seqpar.plan.display import Shown
from seqpar.plan.flops import square_fraction
from seqpar.plan.lora import adapter_params as lora_adapter_params
from seqpar.plan.modes import check_heads, check_split, hybrid_names, splits_sequence, takes_ulysses_degree, ulysses_arg
from seqpar.plan.options import PINNED_FRACTION

# The linear layers of a Llama / Qwen / Mistral decoder block, by the names peft targets (its "all-linear").
LORA_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class GpuSpec(Frozen):
    name: str = Field(description="Canonical profile name, e.g. 'h100-sxm'.")
    display_name: str = Field(description="The name the vendor and NVML use, e.g. 'NVIDIA H100 80GB HBM3'.")
    memory_gib: float = Field(gt=0, description="Device memory in GiB as NVML reports it (total, before the CUDA context).")
    driver_reserved_gib: Optional[float] = Field(
        default=None,
        ge=0,
        description="Of memory_gib, what the driver keeps and no process can allocate (NVML v2 'reserved'; torch's "
        "total is memory_gib minus this). None = not measured: the cost model's default.",
    )
    bf16_tflops: float = Field(gt=0, description="Datasheet dense bf16 tensor-core peak, TFLOP/s (no sparsity).")
    hbm_bandwidth_gb_s: float = Field(gt=0, description="Datasheet device-memory bandwidth, GB/s.")
    compute_capability: Optional[str] = Field(default=None, description="CUDA compute capability, e.g. '9.0'; None for CPU.")
    source: str = Field(default="", description="Where the figures come from (datasheet, measurement with date and machine).")


class LinkSpec(Frozen):
    kind: LinkKind = Field(description="Link technology.")
    bandwidth_gb_s: float = Field(gt=0, description="Usable bandwidth per GPU per direction, GB/s.")
    source: str = Field(default="", description="Where the figure comes from.")


class ClusterSpec(Frozen):
    accelerator: Accelerator = Field(default="cuda", description="'cuda' (NCCL) or 'cpu' (gloo ranks, tests and smoke runs).")
    nodes: int = Field(ge=1, description="Number of nodes.")
    gpus_per_node: int = Field(ge=1, description="Accelerators (or CPU ranks) per node.")
    gpu: GpuSpec = Field(description="The accelerator on every node (homogeneous clusters only).")
    intra_node_link: LinkSpec = Field(description="GPU-to-GPU link inside a node.")
    inter_node_link: Optional[LinkSpec] = Field(default=None, description="Node-to-node link per GPU; None on one node.")
    host_ram_gib: float = Field(gt=0, description="Host RAM per node, GiB (CPU offload must fit in it).")
    pinned_host_gib: Optional[float] = Field(
        default=None,
        gt=0,
        description="Host RAM per node that may be page-locked for the checkpoint offload's layer inputs and the host-kept "
        "matmul outputs, GiB, shared by the node's ranks; None = 40% of host_ram_gib in the cost model and 40% of the "
        "machine's physical RAM at run time. Stated, the runtime pins within exactly this (per rank: / gpus_per_node).",
    )
    source: str = Field(default="declared", description="'probed' (NVML), 'declared' (flags) or 'default' (built-in).")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def pinned_gib_per_node(self) -> float:
        """Page-locked host GiB a node may hold: pinned_host_gib, else options.PINNED_FRACTION of host_ram_gib."""
        return self.pinned_host_gib if self.pinned_host_gib is not None else PINNED_FRACTION * self.host_ram_gib

    @property
    def pinned_gib_per_rank(self) -> float:
        """Page-locked host GiB one rank may hold: the node's, shared by its ranks."""
        return self.pinned_gib_per_node / self.gpus_per_node

    @property
    def stated_pinned_gib_per_rank(self) -> Optional[float]:
        """What the runtime pins per rank: the stated pinned_host_gib's share, else None (the runtime's own default, from
        the machine's physical RAM, which a declared host_ram_gib may overstate)."""
        return None if self.pinned_host_gib is None else self.pinned_gib_per_rank

    @model_validator(mode="after")
    def _inter_node(self) -> ClusterSpec:
        if self.nodes > 1 and self.inter_node_link is None:
            raise ValueError(f"nodes = {self.nodes} needs an inter_node_link (e.g. ib_ndr); none was given")
        return self

    @model_validator(mode="after")
    def _pinned_within_host(self) -> ClusterSpec:
        if self.pinned_host_gib is not None and self.pinned_host_gib > self.host_ram_gib:
            raise ValueError(
                f"pinned_host_gib {self.pinned_host_gib:g} is more than the node's host_ram_gib {self.host_ram_gib:g}: "
                f"page-locked memory is part of host RAM; pin at most {self.host_ram_gib:g} GiB (--pinned-host-gib; the "
                f"default is {PINNED_FRACTION:.0%}, {PINNED_FRACTION * self.host_ram_gib:g} GiB), or declare more host RAM "
                "(--host-ram-gib)"
            )
        return self


# --------------------------------------------------------------------------------------------- model and workload


class ModelSpec(Frozen):
    name: str = Field(description="Profile name or the path it was read from.")
    architecture: Architecture = Field(
        default="llama",
        description="Hugging Face model_type: the Llama-style decoders (RMSNorm, RoPE, SwiGLU) the cost model describes and "
        "the runtime builds (seqpar.runtime.hf.model).",
    )
    num_layers: int = Field(ge=1, description="Transformer blocks.")
    hidden_size: int = Field(ge=1, description="Model width h.")
    num_attention_heads: int = Field(ge=1, description="Query heads a.")
    num_key_value_heads: int = Field(ge=1, description="Key/value heads (GQA when fewer than query heads).")
    head_dim: int = Field(ge=1, description="Per-head width d.")
    intermediate_size: int = Field(ge=1, description="MLP inner width (SwiGLU: three matrices of h x this).")
    vocab_size: int = Field(ge=1, description="Vocabulary size V.")
    tie_word_embeddings: bool = Field(default=False, description="Output projection shares the embedding matrix.")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base.")
    max_position_embeddings: int = Field(default=4096, ge=1, description="Context length the checkpoint was trained for.")
    attention_bias: bool = Field(default=False, description="q/k/v projections carry a bias (Qwen2).")
    sliding_window: Optional[int] = Field(
        default=None,
        ge=1,
        description="Tokens a sliding-window layer attends to (Mistral-7B-v0.1: 4096); None = every layer attends to the "
        "whole causal prefix. seqpar's modes compute full causal attention, so a plan's seq_len may not exceed it.",
    )
    source: str = Field(default="", description="Where the figures come from (the model's config.json).")

    @model_validator(mode="after")
    def _heads(self) -> ModelSpec:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by num_key_value_heads "
                f"{self.num_key_value_heads}; GQA needs whole groups"
            )
        return self

    @property
    def layer_params(self) -> int:
        """Parameters of one Llama-style decoder layer: q, k, v, o (biases on q, k, v with attention_bias), the SwiGLU MLP's
        three matrices and two RMSNorm weights."""
        h, d, a, kv = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        attn = 2 * h * a * d + 2 * h * kv * d + ((a + 2 * kv) * d if self.attention_bias else 0)
        return attn + 3 * h * self.intermediate_size + 2 * h

    @property
    def num_params(self) -> int:
        """Parameter count of the model: the layers, the input embedding and LM head (one matrix when tied), the final norm."""
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + emb + self.hidden_size


class DocMix(Frozen):
    """The lengths of the documents packed into the windows (``seqpar advise --doc-lens / --mean-doc-len / --data``).

    A query attends only to its own document, so causal attention costs the sum of the documents' squared lengths, not
    S^2 (seqpar.plan.flops). The histogram is the whole description; the other fields summarise it."""

    source: str = Field(description="Where the lengths come from: a lengths file, a data sample, or a modelled mix.")
    documents: Optional[int] = Field(
        default=None, ge=1, description="Documents in the sample the histogram was made from; None for a modelled mix."
    )
    mean_tokens: float = Field(gt=0, description="Mean document length (of the histogram), tokens.")
    sum_sq_fraction: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="E[sum over a window's documents of l^2] / seq_len^2 at the workload's seq_len (documents concatenated "
        "and cut into windows; seqpar.plan.flops.square_fraction): the share of one-document causal attention FLOPs a packed "
        "window costs. Derived: recomputed from the histogram whenever the workload is built.",
    )
    histogram: list[tuple[float, float]] = Field(
        min_length=1,
        max_length=1024,
        description="(mean length of the bin's documents in tokens, share of documents) per quarter-octave length bin, "
        "shortest first; the shares sum to 1.",
    )

    @model_validator(mode="after")
    def _bins(self) -> DocMix:
        lengths = [l for l, _ in self.histogram]
        if any(l < 1 for l in lengths) or any(b <= a for a, b in zip(lengths, lengths[1:])):
            raise ValueError("histogram lengths must be at least 1 token and increasing; regenerate it with seqpar advise")
        total = sum(p for _, p in self.histogram)
        if any(p <= 0 for _, p in self.histogram) or abs(total - 1) > 1e-6:
            raise ValueError(f"histogram shares must be positive and sum to 1 (they sum to {total:g}); regenerate it")
        mean = sum(l * p for l, p in self.histogram) / total
        if abs(mean - self.mean_tokens) > 1e-3 * mean:
            raise ValueError(f"mean_tokens {self.mean_tokens:g} is not the histogram's mean ({mean:g}); regenerate it")
        return self

    def at(self, seq_len: int) -> DocMix:
        """This mix with sum_sq_fraction at ``seq_len`` tokens per window."""
        return self.model_copy(update={"sum_sq_fraction": square_fraction(self.histogram, seq_len)})


class LoraSpec(Frozen):
    """A LoRA (or QLoRA) adapter: the base model is frozen, only the adapters train (peft's LoraConfig)."""

    rank: int = Field(default=32, ge=1, le=4096, description="LoRA rank r (peft's r).")
    alpha: float = Field(default=32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_ALL_LINEAR),
        min_length=1,
        description="Linear layers that get an adapter, by their name in the decoder block "
        "(q_proj k_proj v_proj o_proj gate_proj up_proj down_proj = all linear layers).",
    )
    base_dtype: Literal["bf16", "nf4"] = Field(
        default="bf16",
        description="bf16: the frozen base in bf16 (LoRA); nf4: the base quantized to 4 bits by bitsandbytes (QLoRA).",
    )

    @model_validator(mode="after")
    def _known_modules(self):
        unknown = [m for m in self.target_modules if m not in LORA_ALL_LINEAR]
        if unknown:
            raise ValueError(
                f"target module {unknown[0]!r} is not a linear layer of a decoder block; use some of {' '.join(LORA_ALL_LINEAR)}"
            )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError("target_modules lists a module twice; list each once")
        return self

    def adapter_params(self, model: ModelSpec) -> int:
        """Parameters of the adapters on ``model``: rank x (in + out features) per targeted linear layer per decoder
        layer (peft's lora_A is (rank, in), lora_B (out, rank))."""
        return lora_adapter_params(model, self)  # the one count (seqpar.plan.lora, checked against peft's)


class Workload(Frozen):
    model: ModelSpec = Field(description="The model being trained.")
    seq_len: int = Field(ge=1, description="Tokens per sequence (one sample).")
    micro_batch_size: int = Field(default=1, ge=1, description="Sequences per data-parallel rank per forward pass.")
    tokens_per_step: Optional[int] = Field(
        default=None,
        ge=1,
        description="Tokens per optimizer step (sets gradient accumulation); None = one micro-batch per DP rank.",
    )
    dtype: DType = Field(default="bf16", description="Parameter and activation dtype.")
    optimizer: Optimizer = Field(
        default="adamw",
        description="adamw: mixed precision (fp32 master + two fp32 moments); adamw-bf16: two moments in the parameter dtype; none: forward+backward only.",
    )
    lora: Optional[LoraSpec] = Field(
        default=None,
        description="LoRA / QLoRA: train adapters on a frozen base; None = full fine-tuning of every parameter.",
    )
    doc_lens: Optional[DocMix] = Field(
        default=None,
        description="Packed documents: the lengths of the documents each window holds (attention stays inside a "
        "document); None = one document per window, attention over the whole window.",
    )

    @model_validator(mode="before")
    @classmethod
    def _mix_at_seq_len(cls, data):
        """doc_lens.sum_sq_fraction is derived: state it at this workload's seq_len (a bad mix is left to field validation)."""
        if isinstance(data, dict) and data.get("doc_lens") is not None and isinstance(data.get("seq_len"), int):
            try:
                mix = DocMix.model_validate(data["doc_lens"])
            except ValidationError:
                return data
            if data["seq_len"] >= 1:
                data = {**data, "doc_lens": mix.at(data["seq_len"])}
        return data


class Strategy(Frozen):
    mode: Mode = Field(description="Sequence-parallel mode (EasyContext's names).")
    sp_degree: int = Field(default=1, ge=1, description="Ranks that share one sequence.")
    ulysses_degree: int = Field(default=1, ge=1, description="usp_attn: all-to-all group size inside the sp group (1 otherwise).")
    ring_degree: int = Field(default=1, ge=1, description="usp_attn: ring size across Ulysses groups (1 otherwise).")
    dp_degree: int = Field(default=1, ge=1, description="Data-parallel replicas; sp_degree * dp_degree = world size.")
    checkpointing: Checkpointing = Field(
        default="full",
        description="none | full (keep layer inputs) | offload (layer inputs in host RAM) | selective (keep attention out+lse).",
    )
    checkpoint_layers: Optional[int] = Field(
        default=None,
        ge=0,
        description="Decoder layers, counted from the first, that the checkpointing policy applies to; the remaining (last) "
        "layers keep all their activations and recompute nothing (memory-budget checkpointing, Megatron's "
        "recompute_num_layers with its block method). None = every layer (the same as the model's num_layers); not "
        "with checkpointing none.",
    )
    offload_layers: Optional[int] = Field(
        default=None,
        ge=0,
        description="checkpointing offload only: of the checkpointed layers, how many, counted from the first, send their "
        "checkpointed input to host memory (pinned within the budget); the other checkpointed layers keep it on the GPU "
        "(plain full checkpointing; Megatron's cpu_offloading_num_layers). None = every checkpointed layer.",
    )
    offload_stride: int = Field(
        default=1,
        ge=1,
        description="checkpointing offload only: of the offloaded layers, one in every offload_stride (the first, then "
        "every offload_stride-th) sends its input to host memory; each layer between recomputes its input in backward "
        "from the nearest one below (one more forward of those layers; up to offload_stride - 1 layer inputs on the GPU "
        "at once). Host memory for the checkpoints divides by offload_stride: for a host too small for every layer's "
        "input. 1 = every offloaded layer sends its own.",
    )
    kept_saves: KeptSaves = Field(
        default="all",
        description="What the layers past checkpoint_layers keep for backward. all: every activation, nothing recomputed; "
        "matmuls: only their matmul outputs (all but the MLP's last) and attention's out + lse, the norms, RoPE and the "
        "SwiGLU product recomputed in backward (op-level selective checkpointing: about 2/3 of the memory of a fully kept "
        "layer for the same matmul time saved).",
    )
    kept_host_layers: int = Field(
        default=0,
        ge=0,
        description="kept_saves matmuls only: of the layers past checkpoint_layers, how many, counted from the first, hold "
        "their kept matmul outputs in page-locked host memory (copied out during forward, fetched back one layer ahead "
        "in backward, both on a side stream) instead of on the GPU.",
    )
    sharding: Sharding = Field(default="ddp", description="Model-state sharding: ddp | zero2 | zero3 | zero3_offload | fsdp.")
    loss_impl: LossImpl = Field(
        default="chunked", description="hf: full fp32 logits as transformers computes them; chunked: logits a chunk at a time."
    )
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    fused_ops: Annotated[FusedOps, Shown(row="fused ops", name="ops={}", label="{}", title="{} kernels")] = Field(
        default="none",
        description="none: the model's own RMSNorm, RoPE and SwiGLU modules; liger: Liger-Kernel's fused Triton kernels for them "
        "(CUDA and the liger-kernel package; fewer bytes moved and saved per token).",
    )
    tiled_mlp: Annotated[bool, Shown(row="tiled MLP", name="mlp=tiled", label="tiled", title="tiled MLP")] = Field(
        default=False,
        description="Run each decoder MLP one sequence tile at a time (ALST's TiledMLP): its intermediates exist for one tile "
        "only, at the cost of one more MLP forward per step.",
    )

    @model_validator(mode="after")
    def _degrees(self) -> Strategy:
        if not splits_sequence(self.mode) and self.sp_degree != 1:
            raise ValueError(
                f"{self.mode} keeps whole sequences, so sp_degree must be 1, not {self.sp_degree}; pick a sequence-parallel mode"
            )
        if takes_ulysses_degree(self.mode):
            if self.ulysses_degree * self.ring_degree != self.sp_degree:
                raise ValueError(
                    f"{self.mode} needs ulysses_degree x ring_degree = sp_degree, got {self.ulysses_degree} x {self.ring_degree} "
                    f"= {self.ulysses_degree * self.ring_degree} != {self.sp_degree}"
                )
        elif self.ulysses_degree != 1 or self.ring_degree != 1:
            raise ValueError(f"ulysses_degree/ring_degree are for {hybrid_names()} only; {self.mode} takes sp_degree alone")
        return self

    @property
    def world_size(self) -> int:
        return self.sp_degree * self.dp_degree

    @classmethod
    def over(cls, mode: str, sp_degree: int, world_size: int, ulysses_degree: Optional[int] = None, **options) -> Strategy:
        """``mode`` over groups of sp_degree ranks, data parallel across the groups of ``world_size`` ranks (usp_attn:
        ulysses_degree x ring_degree = sp_degree); ``options``: the other fields."""
        usp = takes_ulysses_degree(mode)
        u = ulysses_degree if usp and ulysses_degree else 1
        return cls(
            mode=mode,
            sp_degree=sp_degree,
            dp_degree=max(1, world_size // sp_degree),
            ulysses_degree=u,
            ring_degree=sp_degree // u if usp else 1,
            **options,
        )


def check_strategy_shape(strategy: Strategy, seq_len: int, model: ModelSpec) -> None:
    """SeqparError when the strategy's mode cannot split seq_len over its ranks or split the model's heads
    (seqpar.plan.modes holds the rules; this maps a Strategy onto them)."""
    u = ulysses_arg(strategy.mode, strategy.ulysses_degree)
    check_split(strategy.mode, seq_len, strategy.sp_degree, u)
    check_heads(strategy.mode, model.num_attention_heads, model.num_key_value_heads, strategy.sp_degree, u, owner=model.name)
