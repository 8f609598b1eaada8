"""DeepSpeed ZeRO-2/3 (optionally CPU-offloaded) through accelerate: EasyContext's engine, for zero* plans.

Used only when deepspeed is installed (the trainer refuses earlier otherwise). The config is the one ``seqpar launch``
generates from the plan (seqpar.runtime.launch.deepspeed_config). DeepSpeed averages gradients over all ranks and
divides by the accumulation steps itself, so the trainer scales the loss by sp_degree only (see engine.py).
Not exercised by the CPU test-suite (no deepspeed here). Checkpoints: DeepSpeed's own sharded checkpoint (model, optimizer,
scheduler; what --resume loads) plus the gathered 16-bit weights in save_pretrained format.
"""

from __future__ import annotations

from seqpar.schema import LaunchPlan


def prepare(module, plan: LaunchPlan, total_steps: int):
    """(engine, optimizer, scheduler, backward): backward(loss) runs DeepSpeed's backward and, at the boundary, its step;
    backward.accumulate(engine) is the context each micro-batch's forward runs in."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from seqpar.jobspec import deepspeed_config
    from seqpar.runtime.engine import make_scheduler

    t = plan.training
    if plan.strategy.sharding == "zero3_offload":
        # DeepSpeed refuses a torch optimizer over CPU-offloaded states; its CPU Adam is the AdamW it means (adamw_mode).
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(module.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(module.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
    scheduler = make_scheduler(optimizer, plan, total_steps)
    plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(plan))
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=plan.strategy.gradient_accumulation_steps)
    engine, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)
    if plan.strategy.loss_impl == "chunked" and engine.zero_optimization_stage() == 3:
        # the chunked loss reads lm_head.weight outside lm_head's own forward: ZeRO-3 must gather it for LossModule too
        from deepspeed.zero import register_external_parameter

        register_external_parameter(engine.module, engine.module.model.get_output_embeddings().weight)
    return engine, optimizer, scheduler, DeepSpeedStep(accelerator)


class DeepSpeedStep:
    """accelerate's documented accumulation loop for DeepSpeed: every micro-batch runs inside
    ``accelerator.accumulate(engine)``, whose counter marks the boundary at which ``accelerator.backward`` lets DeepSpeed
    step (DeepSpeed scales by 1/GA itself). Without it every micro-batch would be a boundary (one optimizer step each),
    and DDP-style ``no_sync`` is refused by ZeRO-2/3."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def accumulate(self, engine):
        return self.accelerator.accumulate(engine)

    def __call__(self, loss) -> None:
        self.accelerator.backward(loss)


def is_engine(wrapped) -> bool:
    return hasattr(wrapped, "save_checkpoint") and hasattr(wrapped, "zero_optimization_stage")


def full_weights(wrapped) -> dict:
    """Collective: the 16-bit weights gathered on rank 0 (keys relative to the loss module); {} elsewhere."""
    if wrapped.zero_optimization_stage() == 3:
        return wrapped._zero3_consolidated_16bit_state_dict() or {}
    return {k: v.detach().cpu() for k, v in wrapped.module.state_dict().items()}
