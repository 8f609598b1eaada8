"""GPU memory DeepSpeed ZeRO holds beyond the ZeRO paper's model states: its gradient buffers, its bucket, the gathered
parameters it keeps for reuse, and what its optimizer step allocates.

Read from DeepSpeed 0.19's runtime/zero/stage_1_and_2.py, stage3.py and partitioned_param_coordinator.py, with the
config seqpar writes (seqpar.plan.jobspec.deepspeed_config: DeepSpeed's defaults for the sizes below); checked against
`seqpar launch` runs in BENCHMARKS.md, "DeepSpeed ZeRO on one H200".

* Gradients live in buffers sized for the whole partition from the first backward on, not built layer by layer:
  ZeRO-2's ``grads_in_partition`` and ZeRO-3's ``grad_partitions_flat_buffer`` (the partition's numel in the gradient
  dtype, the model dtype under bf16), on the GPU unless the optimizer is offloaded.
* ZeRO-3 keeps one contiguous gradient bucket of ``reduce_bucket_size`` (5e8) elements on the GPU, offload or not.
* ZeRO-3 gathers parameters and releases a layer's only when its next use is more than ``stage3_max_reuse_distance``
  (1e9) parameter elements away. With recomputation the layers nearest the loss are used again soon after their forward,
  so the tied or untied output embedding and the top layers stay gathered through the backward: the head plus the k top
  layers with head + 2 k layer_params < 1e9 (each layer is used by the recomputation and its backward in between). On one
  GPU without offload the partition is the parameter itself: nothing extra.
* The optimizer step (torch AdamW, ``foreach=False``, on DeepSpeed's flat fp32 partition): ZeRO-2 converts the gradient
  partition to one fp32 tensor and the update's ``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` briefly holds two fp32
  temporaries of that size; ZeRO-3 steps in sub-groups of at most ``sub_group_size`` (1e9) elements, the same three
  fp32 tensors per sub-group, beside its bf16 gradient buffer and bucket. Offloaded optimizers step on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from seqpar.plan.specs import ModelSpec

REDUCE_BUCKET = 5e8  # zero_optimization.reduce_bucket_size (DeepSpeed's default; seqpar's config does not set it)
MAX_REUSE = 1e9  # zero_optimization.stage3_max_reuse_distance (default)
SUB_GROUP = 1e9  # zero_optimization.sub_group_size (default)
# Sizes seqpar's configs also leave at DeepSpeed's defaults (deepspeed/runtime/zero/config.py), held by no term above:
ALLGATHER_BUCKET = 5e8  # allgather_bucket_size: ZeRO-2 gathers the updated partitions into the existing flat buffer
PREFETCH_BUCKET = 5e7  # stage3_prefetch_bucket_size: elements gathered ahead of use (below one decoder layer of a 7B)
PERSISTENCE_THRESHOLD = 1e5  # stage3_param_persistence_threshold: smaller parameters (norms) stay gathered
MAX_LIVE = 1e9  # stage3_max_live_parameters: gathered elements allowed at once (above a layer and its prefetch)
# Host bytes one parameter costs in ZeRO's offloaded optimizer step: DeepSpeed's CPU Adam kernel loads fp32 param, grad,
# exp_avg, exp_avg_sq and stores param, exp_avg, exp_avg_sq (csrc/includes/cpu_adam.h, Step_AVX: 28), the step scales the
# fp32 gradient in place (stage3.py unscale_and_clip_grads: 8) and copies the fp32 partition into the 16-bit one
# (_reassign_or_swap_out_partitioned_parameters: 4 read + 2 written), and the gradient arrives from the GPU (4 written).
CPU_ADAM_HOST_BYTES = 28 + 8 + 6 + 4


@dataclass(frozen=True)
class DeepSpeedTerms:
    grads_preallocated: bool  # the whole partition's gradient buffer exists in every phase
    bucket: float  # bytes, every phase
    kept_gathered: float  # bytes of parameters kept gathered through the loss and the backward
    step_fp32: float  # bytes the optimizer step adds: the fp32 gradient and two fp32 temporaries of one flat piece
    step_frees_grads: bool  # ZeRO-2 converts (and drops) the model-dtype gradient partition before the update


NONE = DeepSpeedTerms(False, 0.0, 0.0, 0.0, False)


def terms(
    m: ModelSpec,
    sharding: str,
    optimizer: str,
    p: float,
    world: int,
    trainable: Optional[float] = None,
    layer_bytes: Optional[float] = None,
) -> DeepSpeedTerms:
    """DeepSpeed's extra GPU bytes for a zero* plan (NONE for ddp/fsdp); ``p``: bytes per element of the parameters and
    gradients DeepSpeed keeps in the model dtype. ``trainable``: the parameters its optimizer holds (default all; LoRA:
    the adapters, the frozen base has no gradient partition nor optimizer piece); ``layer_bytes``: bytes of one
    gathered decoder layer (default layer_params * p)."""
    if not sharding.startswith("zero"):
        return NONE
    psi = m.num_params if trainable is None else trainable
    offload = sharding == "zero3_offload"
    step = 0.0
    if optimizer == "adamw" and not offload:
        piece = psi / world if sharding == "zero2" else min(psi / world, SUB_GROUP)
        step = 3 * 4 * piece
    if sharding == "zero2":
        return DeepSpeedTerms(True, 0.0, 0.0, step, True)
    head = m.vocab_size * m.hidden_size
    kept = 0.0
    if offload or world > 1:
        top = max(0, min(m.num_layers, int((MAX_REUSE - head) // (2 * m.layer_params)))) if head < MAX_REUSE else 0
        layer = m.layer_params * p if layer_bytes is None else layer_bytes
        kept = head * p + top * layer if head < MAX_REUSE else 0.0
    return DeepSpeedTerms(not offload, REDUCE_BUCKET * p, kept, step, False)
