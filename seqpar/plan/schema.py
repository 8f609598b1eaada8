"""The launch plan and everything it is made of: the one vocabulary the advisor and the runtime share.

Ground floor of seqpar: pydantic v2 models only, no torch, nothing else of the project imported.
Every model is frozen with ``extra="forbid"``; every field has a description and its unit in its name
(``_gib`` = 2**30 bytes, ``_gb_s`` = 10**9 bytes per second per direction, ``_tflops`` = 10**12 FLOP/s, ``_s`` = seconds).
Cross-field rules live in validators and their messages carry the numbers and a fix. Which strategies a workload can run
on a cluster is judged once, by ``plan_problems``: LaunchPlan raises its first problem, the advisor's search filters with
it, so the advisor cannot propose a plan this module refuses.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import MODES, check_heads, check_split
from seqpar.plan.options import CHECKPOINTING, KEEP_LAST, KEPT_SAVES, PINNED_FRACTION, LayerSplit, layer_split

SCHEMA_VERSION = 1
SEED_MAX = 2**32 - 1

Mode = Literal[MODES]  # the names of seqpar.plan.modes.MODES_TABLE
Checkpointing = Literal[CHECKPOINTING]  # seqpar.plan.options: the runtime reads the same names
KeptSaves = Literal[KEPT_SAVES]
Sharding = Literal["ddp", "zero2", "zero3", "zero3_offload", "fsdp"]
LossImpl = Literal["hf", "chunked"]
FusedOps = Literal["none", "liger"]
Optimizer = Literal["adamw", "adamw-bf16", "none"]
DType = Literal["bf16", "fp16", "fp32"]
LinkKind = Literal["nvlink3", "nvlink4", "pcie4", "pcie5", "ib_hdr", "ib_ndr", "ethernet", "loopback"]
Accelerator = Literal["cuda", "cpu"]
Architecture = Literal["llama", "mistral", "qwen2", "qwen3"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Frozen(BaseModel):
    # No Infinity/NaN anywhere: JSON cannot write them back (a plan must round-trip) and no quantity here is unbounded.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _text(cls, v):
        """No lone surrogates (how Python holds bytes of a file name that are not UTF-8): they cannot be written out."""
        if isinstance(v, str) and _SURROGATE.search(v):
            raise ValueError(f"{v!r} holds bytes that are not UTF-8 text (a lone surrogate); use a UTF-8 name or path")
        return v


# --------------------------------------------------------------------------------------------- parsing helpers

_SEQ_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_seq_len(text: str | int) -> int:
    """'131072', '128k', '512K', '1M' (k = 1024, M = 1024**2) -> a positive int; SeqparError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SEQ_RE.match(str(text))
        if not m:
            raise SeqparError(f"sequence length {text!r} is not a number; write it as 131072, 128k or 1M (k = 1024, M = 1048576)")
        # Fraction, not float: 9007199254740993 must stay itself (a float rounds it to ...992)
        num, suffix = Fraction(m.group(1)), m.group(2).lower()
        scaled = num * {"": 1, "k": 1024, "m": 1024**2}[suffix]
        if scaled.denominator != 1:
            raise SeqparError(f"sequence length {text!r} is not a whole number of tokens ({float(scaled)}); use e.g. 128k")
        value = int(scaled)
    if value <= 0:
        raise SeqparError(f"sequence length {text!r} must be positive; use e.g. 128k")
    return value


def format_tokens(n: int) -> str:
    """131072 -> '128K', 1048576 -> '1M', 100000 -> '100000'."""
    if n % (1024**2) == 0:
        return f"{n // 1024**2}M"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


# --------------------------------------------------------------------------------------------- hardware


class GpuSpec(_Frozen):
    name: str = Field(description="Canonical profile name, e.g. 'h100-sxm'.")
    display_name: str = Field(description="The name the vendor and NVML use, e.g. 'NVIDIA H100 80GB HBM3'.")
    memory_gib: float = Field(gt=0, description="Device memory in GiB as NVML reports it (total, before the CUDA context).")
    bf16_tflops: float = Field(gt=0, description="Datasheet dense bf16 tensor-core peak, TFLOP/s (no sparsity).")
    hbm_bandwidth_gb_s: float = Field(gt=0, description="Datasheet device-memory bandwidth, GB/s.")
    compute_capability: Optional[str] = Field(default=None, description="CUDA compute capability, e.g. '9.0'; None for CPU.")
    source: str = Field(default="", description="Where the figures come from (datasheet, measurement with date and machine).")


class LinkSpec(_Frozen):
    kind: LinkKind = Field(description="Link technology.")
    bandwidth_gb_s: float = Field(gt=0, description="Usable bandwidth per GPU per direction, GB/s.")
    source: str = Field(default="", description="Where the figure comes from.")


class ClusterSpec(_Frozen):
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


class ModelSpec(_Frozen):
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


class DocMix(_Frozen):
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
        from seqpar.plan.flops import square_fraction

        return self.model_copy(update={"sum_sq_fraction": square_fraction(self.histogram, seq_len)})


class Workload(_Frozen):
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


class Strategy(_Frozen):
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
    fused_ops: FusedOps = Field(
        default="none",
        description="none: the model's own RMSNorm, RoPE and SwiGLU modules; liger: Liger-Kernel's fused Triton kernels for them "
        "(CUDA and the liger-kernel package; fewer bytes moved and saved per token).",
    )
    tiled_mlp: bool = Field(
        default=False,
        description="Run each decoder MLP one sequence tile at a time (ALST's TiledMLP): its intermediates exist for one tile "
        "only, at the cost of one more MLP forward per step.",
    )

    @model_validator(mode="after")
    def _degrees(self) -> Strategy:
        if self.mode == "data_parallel" and self.sp_degree != 1:
            raise ValueError(
                f"data_parallel keeps whole sequences, so sp_degree must be 1, not {self.sp_degree}; pick a sequence-parallel mode"
            )
        if self.mode == "usp_attn":
            if self.ulysses_degree * self.ring_degree != self.sp_degree:
                raise ValueError(
                    f"usp_attn needs ulysses_degree x ring_degree = sp_degree, got {self.ulysses_degree} x {self.ring_degree} "
                    f"= {self.ulysses_degree * self.ring_degree} != {self.sp_degree}"
                )
        elif self.ulysses_degree != 1 or self.ring_degree != 1:
            raise ValueError(f"ulysses_degree/ring_degree are for usp_attn only; {self.mode} takes sp_degree alone")
        return self

    @property
    def world_size(self) -> int:
        return self.sp_degree * self.dp_degree

    @classmethod
    def over(cls, mode: str, sp_degree: int, world_size: int, ulysses_degree: Optional[int] = None, **options) -> Strategy:
        """``mode`` over groups of sp_degree ranks, data parallel across the groups of ``world_size`` ranks (usp_attn:
        ulysses_degree x ring_degree = sp_degree); ``options``: the other fields."""
        usp = mode == "usp_attn"
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
    u = strategy.ulysses_degree if strategy.mode == "usp_attn" else None
    check_split(strategy.mode, seq_len, strategy.sp_degree, u)
    check_heads(strategy.mode, model.num_attention_heads, model.num_key_value_heads, strategy.sp_degree, u, owner=model.name)


# --------------------------------------------------------------------------------------------- plan validity

ZERO3 = ("zero3", "zero3_offload")  # ZeRO-3: parameters gathered by module hooks


def layout_problems(strategy: Strategy, seq_len: int, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """Why the strategy's ranks and split cannot hold seq_len tokens of ``model`` on ``cluster`` (empty = they can):
    the world size, then the mode's sequence split and head split (seqpar.plan.modes)."""
    s, c, out = strategy, cluster, []
    if s.world_size != c.world_size:
        if c.world_size % s.sp_degree:
            divisors = [d for d in range(1, c.world_size + 1) if c.world_size % d == 0]
            out.append(
                f"sp_degree {s.sp_degree} does not divide the {c.world_size} ranks of the cluster ({c.nodes} x "
                f"{c.gpus_per_node}), so no dp_degree fills it; use an sp_degree in {divisors}"
            )
        else:
            out.append(
                f"sp_degree {s.sp_degree} x dp_degree {s.dp_degree} = {s.world_size} ranks, but the cluster has "
                f"{c.nodes} x {c.gpus_per_node} = {c.world_size}; make them equal"
            )
    try:
        check_strategy_shape(s, seq_len, model)
    except SeqparError as e:
        out.append(str(e))
    if model.sliding_window is not None and seq_len > model.sliding_window:
        out.append(
            f"{model.name} attends within a sliding window of {model.sliding_window} tokens (its config.json), shorter than "
            f"seq_len {seq_len}; seqpar's modes compute full causal attention, which would change the model: train at most "
            f"{model.sliding_window} tokens, or set sliding_window to null in its config.json for full attention"
        )
    return out


def option_problems(workload: Workload, cluster: ClusterSpec, strategy: Strategy) -> list[str]:
    """Why the strategy's options (sharding, fused ops, the checkpointing split, tiled MLP) cannot train this workload on
    this cluster: the engines behind them (seqpar.runtime.train.engine and deepspeed.py, fused.py, activation_checkpoint.py,
    tiled_mlp.py) refuse the combination."""
    s, c, w, out = strategy, cluster, workload, []
    cuda, zero = c.accelerator == "cuda", s.sharding.startswith("zero")  # zero* runs DeepSpeed on CUDA and CPU ranks
    if zero and w.optimizer != "adamw":
        out.append(
            f"sharding {s.sharding} runs DeepSpeed's AdamW with an fp32 master copy, so optimizer {w.optimizer} cannot "
            f"run there; use sharding fsdp (or ddp), or optimizer adamw"
        )
    if cuda and w.dtype == "fp16" and not zero:
        fix = (
            "use dtype bf16, or a zero* sharding"
            if w.optimizer == "adamw"
            else f"use dtype bf16 (zero* shardings run AdamW only, not optimizer {w.optimizer})"
        )
        out.append(
            f"dtype fp16 needs a zero* sharding (fp16 needs DeepSpeed's loss scaling), so sharding {s.sharding} would "
            f"train without loss scaling; {fix}"
        )
    if s.fused_ops == "liger" and not cuda:
        out.append(
            f"fused_ops liger runs Triton kernels on CUDA GPUs (Liger-Kernel), but the cluster's accelerator is "
            f"{c.accelerator}; use fused_ops none"
        )
    out += split_problems(s.checkpointing, s.checkpoint_layers, s.offload_layers, w.model.num_layers, w.model.name)
    out += kept_problems(
        s.checkpointing,
        s.checkpoint_layers,
        s.offload_layers,
        s.kept_saves,
        s.kept_host_layers,
        s.tiled_mlp,
        w.model.num_layers,
        w.model.name,
        cuda,
    )
    if s.tiled_mlp and s.sharding in ZERO3:
        out.append(
            f"tiled_mlp with sharding {s.sharding}: ZeRO-3 gathers parameters through module hooks that the tiles' "
            "recomputation in backward bypasses; use sharding fsdp or ddp, or tiled_mlp false"
        )
    return out


def kept_problems(
    checkpointing: str,
    checkpoint_layers: Optional[int],
    offload_layers: Optional[int],
    kept_saves: str,
    kept_host_layers: int,
    tiled_mlp: bool,
    num_layers: int,
    owner: str,
    cuda: bool = True,
) -> list[str]:
    """Why kept_saves / kept_host_layers cannot apply to the kept layers (the ones past checkpoint_layers) of ``owner``'s
    ``num_layers`` decoder layers (empty = they can). The plan (option_problems) and seqpar.apply both ask it."""
    out = []
    kept = layer_split(checkpointing, num_layers, checkpoint_layers, offload_layers).kept
    if kept_saves == "matmuls":
        if checkpointing == "none" or kept == 0:
            why = "checkpointing is none" if checkpointing == "none" else f"checkpoint_layers covers every layer of {owner}"
            out.append(
                f"kept_saves matmuls applies to the layers past checkpoint_layers, but there are none ({why}); set "
                f"checkpoint_layers below {num_layers} with checkpointing full, selective or offload, or kept_saves all"
            )
        if tiled_mlp:
            out.append(
                "kept_saves matmuls with tiled_mlp: the tiled MLP recomputes its own tiles, so its matmul outputs cannot "
                "be kept; use tiled_mlp false, or kept_saves all"
            )
    if kept_host_layers:
        if kept_saves != "matmuls":
            out.append(
                f"kept_host_layers {kept_host_layers} sends kept matmul outputs to host memory, but kept_saves is "
                f"{kept_saves}; set kept_saves matmuls, or kept_host_layers 0"
            )
        elif kept_host_layers > kept:
            out.append(f"kept_host_layers {kept_host_layers} is more than the {kept} kept layers; use at most {kept}")
        if not cuda:
            out.append(
                f"kept_host_layers {kept_host_layers} copies through page-locked memory on a CUDA GPU, but the cluster "
                "has none; use kept_host_layers 0"
            )
    return out


def layers_of(strategy: Strategy, num_layers: int) -> LayerSplit:
    """The plan's seqpar.plan.options.LayerSplit over ``num_layers`` decoder layers."""
    s = strategy
    return layer_split(s.checkpointing, num_layers, s.checkpoint_layers, s.offload_layers, s.kept_saves, s.kept_host_layers)


def checkpointed_layers(strategy: Strategy, num_layers: int) -> int:
    """How many decoder layers the checkpointing policy applies to (0 under none); the rest keep their activations."""
    return layers_of(strategy, num_layers).checkpointed


def offloaded_layers(strategy: Strategy, num_layers: int) -> int:
    """How many checkpointed layers send their input to host memory (0 unless checkpointing offload)."""
    return layers_of(strategy, num_layers).host


# The strategy fields that split the decoder layers between policies, at the values that mean "the policy on every
# layer, no split": a strategy updated with these is its whole-model twin (the advisor's search and fixes start there).
NO_SPLIT: dict = {"checkpoint_layers": None, "offload_layers": None, "kept_saves": "all", "kept_host_layers": 0}


def split_tag(strategy: Strategy) -> str:
    """The layer split in a strategy's one-line name, e.g. "[18 offloaded]", "[21 checkpointed]"; empty without one."""
    parts = [f"{strategy.offload_layers} offloaded"] if strategy.offload_layers is not None else []
    parts += [f"{strategy.checkpoint_layers} checkpointed"] if strategy.checkpoint_layers is not None else []
    if strategy.kept_saves != "all":
        parts += [f"kept {strategy.kept_saves}" + (f", {strategy.kept_host_layers} on host" if strategy.kept_host_layers else "")]
    return f"[{', '.join(parts)}]" if parts else ""


def _runs(layers: tuple[int, ...]) -> str:
    """(0, 2, 3, 4, 7) -> "layers 0, 2-4, 7"."""
    runs: list[list[int]] = []
    for j in layers:
        if runs and j == runs[-1][1] + 1:
            runs[-1][1] = j
        else:
            runs.append([j, j])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"layer{'s' if len(layers) > 1 else ''} {text}"


def checkpointing_text(strategy: Strategy, num_layers: int) -> str:
    """The policy and its split over the layers (0-based, as the model's layer list), e.g. "offload (layers 0-7: input
    in host memory; layers 8-23: input on the GPU; layers 24-31: not checkpointed)", or under kept_saves matmuls
    "selective (layers 0-14: checkpointed; layers 15-31: matmul outputs kept, in host memory for layers 15, 17, 19)"; the
    bare policy name when it applies to every layer alike."""
    s, n = strategy, num_layers
    ck, off, cut = checkpointed_layers(s, n), offloaded_layers(s, n), layers_of(s, n)
    if s.checkpointing == "none" or (ck == n and (s.checkpointing != "offload" or off == n)):
        return s.checkpointing

    def span(a: int, b: int) -> str:
        return f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}"

    if s.checkpointing == "offload":
        parts = [f"{span(0, off)}: input in host memory"] if off else []
        parts += [f"{span(off, ck)}: input on the GPU"] if ck > off else []
    else:
        parts = [f"{span(0, ck)}: checkpointed"] if ck else []
    if cut.matmuls and cut.kept_host == cut.kept:
        parts += [f"{span(ck, n)}: matmul outputs kept in host memory"]
    elif cut.matmuls:
        host = f", in host memory for {_runs(cut.host_kept)}" if cut.kept_host else ""
        parts += [f"{span(ck, n)}: matmul outputs kept{host}"]
    else:
        parts += [f"{span(ck, n)}: not checkpointed"] if n > ck else []
    return f"{s.checkpointing} ({'; '.join(parts)})"


def split_problems(
    checkpointing: str, checkpoint_layers: Optional[int], offload_layers: Optional[int], num_layers: int, owner: str
) -> list[str]:
    """Why checkpoint_layers / offload_layers cannot split the ``num_layers`` decoder layers of ``owner`` under the
    ``checkpointing`` policy (empty = they can). The plan (option_problems) and seqpar.apply both ask it."""
    ck, off, n, out = checkpoint_layers, offload_layers, num_layers, []
    if ck is not None and checkpointing == "none":
        out.append(
            f"checkpoint_layers {ck} picks the layers that checkpointing applies to, but checkpointing is none; remove "
            "checkpoint_layers, or pick checkpointing full, selective or offload"
        )
    elif ck is not None and ck > n:
        out.append(
            f"checkpoint_layers {ck} is more than the {n} decoder layers of {owner}; use at most {n} ({n} or unset = every "
            "layer checkpointed)"
        )
    if off is not None and checkpointing != "offload":
        out.append(
            f"offload_layers {off} sends checkpointed layer inputs to host memory, which only checkpointing offload does, "
            f"but checkpointing is {checkpointing}; remove offload_layers, or use checkpointing offload"
        )
    elif off is not None and off > (kept := n if ck is None else min(ck, n)):
        why = f"checkpoint_layers {ck}" if ck is not None else f"every layer of {owner}"
        out.append(f"offload_layers {off} is more than the {kept} checkpointed layers ({why}); use at most {kept}")
    return out


def plan_problems(workload: Workload, cluster: ClusterSpec, strategy: Strategy) -> list[str]:
    """Every reason ``strategy`` cannot train ``workload`` on ``cluster``, one line each naming the value, the rule and a
    fix; empty when it can. The one judge of plan validity: LaunchPlan raises the first, the advisor's search drops a
    strategy with any and records the first as the reason, the rules and the request ask it too."""
    return layout_problems(strategy, workload.seq_len, workload.model, cluster) + option_problems(workload, cluster, strategy)


# --------------------------------------------------------------------------------------------- prediction and plan


class Prediction(_Frozen):
    peak_memory_gib: float = Field(
        ge=0,
        description="Predicted peak allocated by PyTorch's caching allocator per GPU (torch.cuda.max_memory_allocated), GiB.",
    )
    reserved_memory_gib: float = Field(
        ge=0, description="Predicted peak reserved (allocated + allocator slack) plus CUDA context and NCCL buffers, GiB."
    )
    capacity_gib: float = Field(ge=0, description="Device memory of the target GPU, GiB.")
    memory_breakdown_gib: dict[str, float] = Field(description="Terms at the peak phase, GiB; they sum to peak_memory_gib.")
    peak_phase: str = Field(
        default="", description="The phase of the step where the peak occurs (forward, loss, backward, optimizer)."
    )
    host_memory_gib: float = Field(
        default=0.0, ge=0, description="Host RAM per node needed for offloaded state and checkpoints, GiB."
    )
    tokens_per_s: float = Field(ge=0, description="Predicted training throughput of the whole cluster, tokens/s.")
    step_time_s: float = Field(ge=0, description="Predicted time of one optimizer step, s (a warm step).")
    first_step_s: Optional[float] = Field(
        default=None,
        ge=0,
        description="Predicted time of the first step, s: a warm step plus its one-off costs (kernel selection, allocator "
        "growth, page-locking the offload's pinned host blocks). None in plans written before it was predicted.",
    )
    step_time_breakdown_s: dict[str, float] = Field(description="compute / exposed communication / offload / optimizer, s.")
    mfu: float = Field(ge=0, description="Model FLOPs utilisation against the datasheet bf16 peak (no recompute counted).")
    oom_risk: bool = Field(description="True when reserved memory plus headroom exceeds capacity (or host RAM is exceeded).")
    coefficients_version: str = Field(default="", description="Version of the fitted coefficients used.")


class Alternative(_Frozen):
    strategy: Strategy = Field(description="A strategy the advisor considered.")
    prediction: Optional[Prediction] = Field(default=None, description="Its prediction, when it was valid.")
    rejected_because: str = Field(description="Why it lost (invalid, risks OOM, slower by x%).")


class Rationale(_Frozen):
    policy: Literal["rules", "cost", "pinned"] = Field(
        description="rules: the guide's decision tree; cost: the cost-model search; pinned: flags fixed everything."
    )
    rule_path: list[str] = Field(
        default_factory=list, description="The guide's rules followed, in order, ending with its choice."
    )
    rules_choice: Optional[Mode] = Field(default=None, description="The mode the guide's tree picks.")
    reasons: list[str] = Field(default_factory=list, description="Why this strategy, in words, with numbers.")
    alternatives: list[Alternative] = Field(default_factory=list, description="What else was considered and why it lost.")
    cluster_note: str = Field(default="", description="Where the cluster description came from (probe, flags, default).")


class TrainingSpec(_Frozen):
    steps: int = Field(default=1000, ge=1, description="Optimizer steps.")
    learning_rate: float = Field(default=2e-5, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "cosine"] = Field(default="constant", description="After warmup.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, ge=0, description="Max gradient norm, 0 = off.")
    seed: int = Field(
        default=0,
        ge=0,
        le=SEED_MAX,
        description="Random seed, 0 to 2**32 - 1 (the range Python's, NumPy's and torch's generators all accept).",
    )
    checkpoint_every: Optional[int] = Field(
        default=None,
        ge=0,
        description="Save every K steps; 0 = only at the end; None = about hourly, from the predicted (else the first "
        "measured) step time.",
    )
    rope_theta: Optional[float] = Field(
        default=None, gt=0, description="Override of the model's RoPE base (EasyContext raises it per stage)."
    )
    keep_last: Optional[int] = Field(
        default=None,
        ge=0,
        description=f"Checkpoints kept, newest first; 0 = all; None = seqpar's default ({KEEP_LAST}). "
        "seqpar launch --keep-last overrides it.",
    )


# --------------------------------------------------------------------------------------------- the job's environment

# A plan is a file people download and share, and launch.env reaches the environment of torchrun and every rank: PYTHONPATH
# (a sitecustomize.py), LD_PRELOAD or PATH there would run code from elsewhere. So a plan may set only what seqpar itself
# sets and the settings of the libraries the job runs that change how, not what, code runs; any other name needs
# `seqpar launch --allow-env NAME`.
PLAN_ENV_NAMES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "TOKENIZERS_PARALLELISM",
    "GLOO_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
)
PLAN_ENV_PREFIXES = ("SEQPAR_", "NCCL_", "TORCH_NCCL_", "CUDA_")
# ...except names that point at a file or a library: NCCL_NET_PLUGIN / NCCL_TUNER_PLUGIN load a shared library,
# NCCL_DEBUG_FILE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE write wherever they name.
PLAN_ENV_REFUSED_PARTS = ("PLUGIN", "FILE", "PATH", "DIR", "LIB")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def plan_env_allowed(name: str) -> bool:
    """May a plan's launch.env set ``name`` without ``--allow-env``?"""
    if name in PLAN_ENV_NAMES:
        return True
    return name.startswith(PLAN_ENV_PREFIXES) and not any(part in name for part in PLAN_ENV_REFUSED_PARTS)


def env_refusals(env: dict[str, str], allow: Iterable[str] = ()) -> list[str]:
    """The names in ``env`` a plan may not set (neither on the allow-list nor in ``allow``), in order."""
    extra = set(allow)
    return [k for k in env if not plan_env_allowed(k) and k not in extra]


ALLOWED_ENV_TEXT = f"{', '.join(p + '*' for p in PLAN_ENV_PREFIXES)} (no *PLUGIN/FILE/PATH/DIR/LIB*), {', '.join(PLAN_ENV_NAMES)}"


class LaunchSpec(_Frozen):
    launcher: Literal["torchrun", "accelerate", "python"] = Field(default="torchrun", description="What starts the processes.")
    command: list[str] = Field(
        default_factory=list,
        description="The command `seqpar launch` runs on each node (argv; a staged plan: its first stage's). 'python' is the "
        "interpreter seqpar runs under; on several nodes $NODE_RANK and $MASTER_ADDR are each node's to fill in.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables set for the job (they override seqpar launch's); names outside the allow-list "
        "(schema.plan_env_allowed: SEQPAR_*, NCCL_*, TORCH_NCCL_*, CUDA_*, allocator and thread settings) need "
        "`seqpar launch --allow-env NAME`.",
    )

    @field_validator("env")
    @classmethod
    def _env_syntax(cls, env: dict[str, str]) -> dict[str, str]:
        for k, v in env.items():
            if not _ENV_NAME.fullmatch(k):
                raise ValueError(
                    f"environment variable name {k!r} is not a name (letters, digits and _, not starting with a digit; "
                    f"no '=', NUL or spaces); fix or remove it"
                )
            if "\0" in v:
                raise ValueError(f"environment variable {k} holds a NUL character, which no environment can carry; remove it")
        return env


class Stage(_Frozen):
    seq_len: int = Field(ge=1, description="Tokens per sequence in this stage.")
    rope_theta: float = Field(gt=0, description="RoPE base for this stage (EasyContext raises it with the length).")
    steps: int = Field(ge=1, description="Optimizer steps of this stage.")
    strategy: Strategy = Field(description="How this stage is split (planned for its own seq_len).")
    prediction: Optional[Prediction] = Field(
        default=None, description="The cost model's prediction for this stage (None under rules)."
    )


class LaunchPlan(_Frozen):
    schema_version: int = Field(default=SCHEMA_VERSION, description="Version of this format; a newer one is refused.")
    created_by: str = Field(default="", description="Tool and version that wrote the plan.")
    created_at: str = Field(default="", description="ISO-8601 UTC time of writing.")
    workload: Workload = Field(description="What is trained.")
    cluster: ClusterSpec = Field(description="Where it is trained.")
    strategy: Strategy = Field(description="How it is split.")
    prediction: Optional[Prediction] = Field(
        default=None, description="The cost model's prediction (None under the rules-only policy)."
    )
    rationale: Rationale = Field(description="Why this strategy.")
    launch: LaunchSpec = Field(default_factory=LaunchSpec, description="How to start it.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="The training loop's settings.")
    stages: list[Stage] = Field(
        default_factory=list,
        description="Progressive recipe (seqpar advise --recipe): stages run in order, each starting from the previous one's final checkpoint; empty = one run.",
    )

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v > SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {v} is newer than this seqpar understands ({SCHEMA_VERSION}); upgrade seqpar to read it"
            )
        if v < 1:
            raise ValueError(f"schema_version {v} is not a valid version (expected {SCHEMA_VERSION})")
        return v

    @model_validator(mode="after")
    def _fits_cluster(self) -> LaunchPlan:
        problems = plan_problems(self.workload, self.cluster, self.strategy)
        for i, st in enumerate(self.stages):
            stage_workload = self.workload.model_copy(update={"seq_len": st.seq_len})
            problems += [f"stage {i}: {p}" for p in plan_problems(stage_workload, self.cluster, st.strategy)]
        if problems:
            raise ValueError(problems[0])
        return self

    # ----- files

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    def write(self, path: str | Path) -> Path:
        """Write atomically: a temporary file in the same folder, then rename."""
        return write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path, allow_env: Iterable[str] = ()) -> LaunchPlan:
        """Read and validate a plan file; SeqparError with one line on any problem. ``allow_env``: names its launch.env
        may set beyond the allow-list (``seqpar launch --allow-env``)."""
        p = Path(path)
        data = read_json_object(
            p,
            "plan file",
            "plan",
            missing_fix=f"write one with `seqpar advise ... -o {p}`",
            invalid_fix="regenerate it with `seqpar advise -o`",
        )
        ver = data.get("schema_version", SCHEMA_VERSION)
        if isinstance(ver, int) and ver > SCHEMA_VERSION:
            raise SeqparError(
                f"plan file {str(p)!r} has schema_version {ver}, newer than this seqpar understands ({SCHEMA_VERSION}); upgrade seqpar"
            )
        try:
            plan = cls.model_validate(data)
        except ValidationError as e:
            raise SeqparError(f"plan file {str(p)!r} is invalid: {first_error(e)}") from None
        refused = env_refusals(plan.launch.env, allow_env)
        if refused:
            flags = " ".join(f"--allow-env {k}" for k in refused)
            raise SeqparError(
                f"plan file {str(p)!r} sets launch.env {', '.join(refused)}, which a plan may not set (it could make the job "
                f"run code from elsewhere; a plan may set {ALLOWED_ENV_TEXT}); remove it, or if you trust the plan run "
                f"`seqpar launch {p} {flags}`"
            )
        return plan


def first_error(e: ValidationError) -> str:
    """One line from a pydantic error: the field path and the message."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = err.get("msg", "invalid").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = f"unknown field (not part of schema version {SCHEMA_VERSION})"
    return f"{loc}: {msg}" if loc else msg  # a rule across fields (a model validator) has no field path


def read_json_object(path: Path, what: str, kind: str, *, missing_fix: str, invalid_fix: str) -> dict:
    """The JSON object in ``path``; SeqparError naming ``what`` file it is, what is wrong and a fix otherwise."""
    if not path.is_file():
        raise SeqparError(f"{what} {str(path)!r} does not exist; {missing_fix}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SeqparError(f"{what} {str(path)!r} is not valid JSON ({e}); {invalid_fix}") from None
    except RecursionError:  # a hostile file nests thousands of levels deep
        raise SeqparError(f"{what} {str(path)!r} nests too deeply to be a {kind}; {invalid_fix}") from None
    if not isinstance(data, dict):
        raise SeqparError(f"{what} {str(path)!r} holds a {type(data).__name__}, not a {kind} object")
    bad = _lone_surrogate(data)
    if bad is not None:
        raise SeqparError(
            f"{what} {str(path)!r}: {bad} holds a lone surrogate (\\ud800-\\udfff), which is not text; {invalid_fix}"
        )
    return data


def _lone_surrogate(obj, where: str = "") -> str | None:
    """The path of the first string (key or value) in a JSON value that holds a lone UTF-16 surrogate, else None (JSON's
    \\ud800 escapes decode to them; they cannot be printed or written as UTF-8)."""
    if isinstance(obj, str):
        return (where or "the value") if any("\ud800" <= ch <= "\udfff" for ch in obj) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        here = f"{where}.{k}" if where else str(k)
        if isinstance(k, str) and _lone_surrogate(k) is not None:
            return f"a key of {where or 'the object'}"
        found = _lone_surrogate(v, here)
        if found is not None:
            return found
    return None


def write_atomic(path: str | Path, text: str) -> Path:
    """Write text to path via a temporary sibling and os.replace, so readers never see half a file. Only a new path or a
    regular file is written: a folder, FIFO, device or socket there is refused (SeqparError), never replaced."""
    import os
    import stat
    import tempfile

    p = Path(path)
    try:
        mode = p.stat().st_mode  # follows a symbolic link: a link to /dev/null is a device
    except FileNotFoundError:
        mode = None
    except OSError as e:  # e.g. a file where a folder of the path must be
        raise SeqparError(f"cannot write {str(p)!r}: {e.strerror}; pick another path") from None
    if mode is not None and not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise SeqparError(f"{str(p)!r} is {kind}, not a file; seqpar writes only new paths or regular files: pick a file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        raise SeqparError(f"cannot write {str(p)!r}: {e.strerror} ({e.filename}); pick another path") from None
    try:
        # mkstemp makes the file 0600; a plan on a shared file system must be as readable as any file the user writes:
        # the mode of the file replaced, else 0666 less the umask.
        os.fchmod(fd, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask sets as it reads: a thread creating
    a file meanwhile would get the wrong mode)."""
    import os

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
