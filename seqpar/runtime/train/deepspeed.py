"""DeepSpeed ZeRO-2/3 (ZeRO-3 optionally CPU-offloaded) through accelerate: EasyContext's engine, for zero* plans.

Every zero* plan runs here, on CUDA ranks (NCCL) and on CPU ranks (DeepSpeed's CPU accelerator over gloo); FSDP2 runs only
when the plan says ``fsdp``. The DeepSpeed config is the one ``seqpar launch`` writes beside the run
(seqpar.plan.jobspec.deepspeed_config). Gradient math (engine.py): DeepSpeed averages gradients over all W ranks and divides by
the accumulation steps itself, so the trainer scales the loss by sp_degree only. Clipping is DeepSpeed's
(``gradient_clipping``); its pre-clip global norm is what the trainer reports as ``grad_norm``, as clip_grad_norm_'s return
is for DDP and FSDP2. The LR scheduler stays outside accelerate: accelerate would step a LambdaLR ``num_processes`` times per
optimizer step (it assumes a per-process dataloader) and DeepSpeed steps only its own scheduler types; the trainer steps it
once per optimizer step, as for the other engines, and the checkpoint stores it beside DeepSpeed's.

Checkpoints: DeepSpeed's own sharded checkpoint (fp32 master partitions, optimizer moments, its step counters; what
--resume loads), written and read by seqpar's pickle-free checkpoint engine instead of torch.save/torch.load, plus the
gathered weights in the model's dtype (16-bit under bf16) as a save_pretrained folder.
"""

from __future__ import annotations

import os

from seqpar.plan.launch_plan import LaunchPlan


def prepare(module, plan: LaunchPlan, total_steps: int):
    """(engine, optimizer, scheduler, step): ``step(loss)`` runs DeepSpeed's backward and, at the accumulation boundary,
    its clipped optimizer step; ``step.accumulate(engine)`` is the context each micro-batch's forward runs in.
    Collective over the job."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    from seqpar.plan.jobspec import deepspeed_config
    from seqpar.runtime.checkpoint.deepspeed import install as install_checkpoint_engine
    from seqpar.runtime.train.engine import make_scheduler, trainable

    _torchrun_env()
    # One process may build several engines (verify's two runs, the tests' cases): accelerate keeps one shared state and
    # refuses a second DeepSpeed plugin over it, so start each engine from a clean state (accelerate's tests do the same).
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    t = plan.training
    # torch's AdamW for every stage: with optimizer offload accelerate swaps it for DeepSpeedCPUAdam(adamw_mode=True), the
    # AdamW DeepSpeed runs on CPU (it maps only torch.optim.AdamW to adamw_mode; a DeepSpeedCPUAdam handed in would come
    # back as Adam with L2 decay).
    # Under LoRA only the adapters train: DeepSpeed partitions gradients and optimizer states of these alone and keeps
    # the frozen base out of its checkpoint (seqpar.runtime.checkpoint.deepspeed.save).
    optimizer = torch.optim.AdamW(trainable(module), lr=t.learning_rate, weight_decay=t.weight_decay, foreach=False)
    plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(plan))
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=plan.strategy.gradient_accumulation_steps)
    engine, optimizer = accelerator.prepare(module, optimizer)
    install_checkpoint_engine(engine)  # its states saved and loaded without pickle (seqpar.runtime.checkpoint.deepspeed)
    # The schedule drives the optimizer DeepSpeed steps (basic_optimizer: the CPU Adam under offload, not the one built
    # above), and after prepare: DeepSpeed's checkpoint load replaces that optimizer's param_groups, and a scheduler on a
    # stale list would leave the LR of a resumed run where the checkpoint left it.
    scheduler = make_scheduler(engine.basic_optimizer, plan, total_steps)
    # The plugin registered its config with transformers, which then builds every later model of this process under
    # ZeRO-3's zero.Init (partitioned, unusable by another engine). This model is built and wrapped: unregister it.
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    if plan.strategy.loss_impl == "chunked" and engine.zero_optimization_stage() == 3:
        # the chunked loss reads lm_head.weight outside lm_head's own forward: ZeRO-3 must gather it for LossModule too
        from deepspeed.runtime.zero import register_external_parameter

        register_external_parameter(engine.module, engine.module.model.get_output_embeddings().weight)
    return engine, optimizer, scheduler, DeepSpeedStep(accelerator, engine)


def _torchrun_env() -> None:
    """accelerate and DeepSpeed read the rank from torchrun's variables; a job whose process group was made in-process
    (the test harness) has the group but not the variables, so derive them from it."""
    import torch.distributed as dist

    if not dist.is_initialized() or "LOCAL_RANK" in os.environ:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # read, not bound: the group exists already


class DeepSpeedStep:
    """accelerate's documented accumulation loop for DeepSpeed: every micro-batch runs inside
    ``accelerator.accumulate(engine)``, whose counter marks the boundary at which ``accelerator.backward`` lets DeepSpeed
    step (DeepSpeed scales by 1/GA itself). Without it every micro-batch would be a boundary (one optimizer step each),
    and DDP-style ``no_sync`` is refused by ZeRO-2/3."""

    def __init__(self, accelerator, engine):
        self.accelerator, self.engine = accelerator, engine

    def accumulate(self, engine):
        return self.accelerator.accumulate(engine)

    def __call__(self, loss) -> None:
        self.accelerator.backward(loss)

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step, before clipping (DeepSpeed computes it for clipping)."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)
