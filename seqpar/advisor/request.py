"""What a user asks the advisor: the workload, the cluster and the choices they pinned.

Shared by both policies (the guide's rules in rules.py and the cost-model search in search.py) and by the CLI.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from seqpar.errors import SeqparError
from seqpar.schema import (
    Checkpointing,
    ClusterSpec,
    DType,
    FusedOps,
    LossImpl,
    Mode,
    ModelSpec,
    Optimizer,
    Sharding,
    Workload,
    _Frozen,
)


def check_fused_ops(fused_ops: Optional[str], cluster: ClusterSpec) -> None:
    """SeqparError (one line) when Liger's Triton kernels are asked for on a cluster without CUDA GPUs."""
    if fused_ops == "liger" and cluster.accelerator != "cuda":
        raise SeqparError(f"fused_ops liger runs Liger-Kernel's Triton kernels on CUDA GPUs, but this cluster's accelerator is "
                          f"{cluster.accelerator} ({cluster.gpu.name}); use --fused-ops none")


class AdviseRequest(_Frozen):
    model: ModelSpec = Field(description="The model to train.")
    seq_len: int = Field(ge=1, description="Tokens per sequence.")
    cluster: ClusterSpec = Field(description="The hardware (probed, declared or the default).")
    micro_batch_size: int = Field(default=1, ge=1, description="Sequences per data-parallel rank per forward pass.")
    tokens_per_step: Optional[int] = Field(default=None, ge=1, description="Tokens per optimizer step; None = one micro-batch per DP rank.")
    dtype: DType = Field(default="bf16", description="Parameter and activation dtype.")
    optimizer: Optimizer = Field(default="adamw", description="Optimizer (part of the workload, not searched).")
    policy: Literal["rules", "cost"] = Field(default="cost", description="rules: the guide's tree; cost: the cost-model search.")
    # Pins: None = let the advisor choose.
    mode: Optional[Mode] = Field(default=None, description="Pinned mode.")
    sp_degree: Optional[int] = Field(default=None, ge=1, description="Pinned sequence-parallel degree.")
    ulysses_degree: Optional[int] = Field(default=None, ge=1, description="Pinned Ulysses degree (usp_attn).")
    checkpointing: Optional[Checkpointing] = Field(default=None, description="Pinned checkpointing.")
    sharding: Optional[Sharding] = Field(default=None, description="Pinned sharding.")
    loss_impl: Optional[LossImpl] = Field(default=None, description="Pinned loss implementation.")
    fused_ops: Optional[FusedOps] = Field(default=None, description="Pinned fused kernels (None = none: liger is an optional dependency, never picked unasked).")
    tiled_mlp: Optional[bool] = Field(default=None, description="Pinned TiledMLP (None = the search tries both).")

    @model_validator(mode="after")
    def _fp16(self) -> "AdviseRequest":
        if self.dtype == "fp16" and self.optimizer != "adamw" and self.cluster.accelerator == "cuda":
            raise ValueError(
                f"dtype fp16 needs DeepSpeed's loss scaling, which seqpar runs with AdamW only, not optimizer "
                f"{self.optimizer}; use dtype bf16"
            )
        check_fused_ops(self.fused_ops, self.cluster)
        return self

    def workload(self) -> Workload:
        return Workload(
            model=self.model,
            seq_len=self.seq_len,
            micro_batch_size=self.micro_batch_size,
            tokens_per_step=self.tokens_per_step,
            dtype=self.dtype,
            optimizer=self.optimizer,
        )
