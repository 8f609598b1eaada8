"""What a user asks the advisor: the workload, the cluster and the choices they pinned.

Shared by both policies (the guide's rules in rules.py and the cost-model search in search.py) and by the CLI.
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

from pydantic import Field, model_validator

from seqpar.plan.base import Checkpointing, DType, Frozen, FusedOps, KeptSaves, LossImpl, Mode, Optimizer, Sharding
from seqpar.plan.display import option_names
from seqpar.plan.errors import SeqparError
from seqpar.plan.rules import plan_problems
from seqpar.plan.specs import ClusterSpec, DocMix, LoraSpec, ModelSpec, Strategy, Workload


def check_workload(workload: Workload, cluster: ClusterSpec, fused_ops: Optional[str] = None) -> None:
    """SeqparError when no strategy can train ``workload`` (with these fused kernels) on ``cluster``: the plan rules
    (schema.plan_problems) refuse every sharding, e.g. fp16 needs DeepSpeed's loss scaling, which runs AdamW only, or
    Liger's kernels need CUDA. Probed with whole sequences on every rank, so only the option rules can refuse."""
    probes = [
        Strategy.over("data_parallel", 1, cluster.world_size, sharding=sh, fused_ops=fused_ops or "none")
        for sh in get_args(Sharding)
    ]
    problems = [plan_problems(workload, cluster, st) for st in probes]
    if all(problems):
        raise SeqparError(problems[0][0])


class AdviseRequest(Frozen):
    model: ModelSpec = Field(description="The model to train.")
    seq_len: int = Field(ge=1, description="Tokens per sequence.")
    cluster: ClusterSpec = Field(description="The hardware (probed, declared or the default).")
    micro_batch_size: int = Field(default=1, ge=1, description="Sequences per data-parallel rank per forward pass.")
    tokens_per_step: Optional[int] = Field(
        default=None, ge=1, description="Tokens per optimizer step; None = one micro-batch per DP rank."
    )
    dtype: DType = Field(default="bf16", description="Parameter and activation dtype.")
    optimizer: Optimizer = Field(default="adamw", description="Optimizer (part of the workload, not searched).")
    lora: Optional[LoraSpec] = Field(
        default=None, description="LoRA / QLoRA adapters on a frozen base (part of the workload); None = full fine-tuning."
    )
    doc_lens: Optional[DocMix] = Field(
        default=None, description="Packed documents' length mix (part of the workload); None = one document per window."
    )
    policy: Literal["rules", "cost"] = Field(default="cost", description="rules: the guide's tree; cost: the cost-model search.")
    # Pins: None = let the advisor choose.
    mode: Optional[Mode] = Field(default=None, description="Pinned mode.")
    sp_degree: Optional[int] = Field(default=None, ge=1, description="Pinned sequence-parallel degree.")
    ulysses_degree: Optional[int] = Field(default=None, ge=1, description="Pinned Ulysses degree (usp_attn).")
    checkpointing: Optional[Checkpointing] = Field(default=None, description="Pinned checkpointing.")
    checkpoint_layers: Optional[int] = Field(
        default=None, ge=0, description="Pinned layers checkpointed, from the first (None = the search picks how many keep all)."
    )
    offload_layers: Optional[int] = Field(
        default=None,
        ge=0,
        description="Pinned offloaded layers, from the first (None = the search picks how many stay on the GPU).",
    )
    offload_stride: Optional[int] = Field(
        default=None,
        ge=1,
        description="Pinned offload_stride: one offloaded layer input in this many goes to host memory, backward "
        "recomputes the others (None = the search uses 1 unless the host's RAM needs more).",
    )
    kept_saves: Optional[KeptSaves] = Field(
        default=None,
        description="Pinned kept_saves for the layers past checkpoint_layers (None = all: the search uses matmuls only "
        "when it is pinned, and says when it would be faster).",
    )
    kept_host_layers: Optional[int] = Field(
        default=None,
        ge=0,
        description="kept_saves matmuls: at most this many kept layers hold their matmul outputs in host memory (None = 0).",
    )
    sharding: Optional[Sharding] = Field(default=None, description="Pinned sharding.")
    loss_impl: Optional[LossImpl] = Field(default=None, description="Pinned loss implementation.")
    fused_ops: Optional[FusedOps] = Field(
        default=None, description="Pinned fused kernels (None = none: liger is an optional dependency, never picked unasked)."
    )
    tiled_mlp: Optional[bool] = Field(default=None, description="Pinned TiledMLP (None = the search tries both).")

    @model_validator(mode="after")
    def _runnable(self) -> AdviseRequest:
        one = self.micro_batch_size * self.seq_len  # one micro-batch on one rank: the least a step can hold
        if self.tokens_per_step is not None and self.tokens_per_step < one:
            raise SeqparError(
                f"--tokens-per-step {self.tokens_per_step} is less than one micro-batch ({self.micro_batch_size} x "
                f"{self.seq_len} tokens = {one}); a step holds whole micro-batches: give at least {one}, or leave it out"
            )
        check_workload(self.workload(), self.cluster, self.fused_ops)
        if self.lora is not None and self.lora.base_dtype == "nf4" and self.optimizer == "none":
            raise SeqparError(
                "--qlora trains adapters on a 4-bit base that never changes, but --optimizer none (forward and backward "
                "only) updates nothing; use --optimizer adamw (or adamw-bf16) with --qlora, or drop --qlora"
            )
        if self.kept_host_layers and self.kept_saves != "matmuls":
            raise SeqparError(
                f"--kept-host-layers {self.kept_host_layers} puts kept layers' matmul outputs in host memory, which only "
                "--kept-saves matmuls keeps; add --kept-saves matmuls, or drop --kept-host-layers"
            )
        if self.kept_saves == "matmuls" and self.tiled_mlp:
            raise SeqparError(
                "--kept-saves matmuls keeps the MLP's matmul outputs, but --tiled-mlp recomputes the MLP a tile at a "
                "time; drop one of them"
            )
        if self.offload_stride and self.offload_stride > 1 and self.checkpointing not in (None, "offload"):
            raise SeqparError(
                f"--offload-stride {self.offload_stride} spaces the layer inputs that checkpointing offload sends to host "
                f"memory, but --checkpointing is {self.checkpointing}; use --checkpointing offload, or drop --offload-stride"
            )
        if self.kept_host_layers and self.cluster.accelerator != "cuda":
            raise SeqparError(
                f"--kept-host-layers {self.kept_host_layers} copies through page-locked memory on a CUDA GPU, but the "
                f"cluster's accelerator is {self.cluster.accelerator}; drop --kept-host-layers"
            )
        return self

    def accumulation_steps(self, dp_degree: int) -> int:
        """Micro-batches per optimizer step that make tokens_per_step (rounded, at least 1) over dp_degree replicas."""
        if not self.tokens_per_step:
            return 1
        return max(1, round(self.tokens_per_step / (self.micro_batch_size * self.seq_len * dp_degree)))

    def option_pins(self) -> dict:
        """The Strategy options (seqpar.plan.display.option_names: fused_ops, tiled_mlp, ...) this request pins, by name;
        the others (and an option the request has no pin for) keep the Strategy's default unless the search tries them."""
        return {k: getattr(self, k) for k in option_names(Strategy) if getattr(self, k, None) is not None}

    def workload(self) -> Workload:
        """What is trained: the request's fields that Workload has (all of them)."""
        return Workload(**{k: getattr(self, k) for k in Workload.model_fields})
