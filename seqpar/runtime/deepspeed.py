"""DeepSpeed ZeRO-2/3 (optionally CPU-offloaded) through accelerate: EasyContext's engine, for zero* plans.

Used only when deepspeed is installed (the trainer refuses earlier otherwise). The config is the one ``seqpar launch``
generates from the plan (seqpar.runtime.launch.deepspeed_config). DeepSpeed averages gradients over all ranks and
divides by the accumulation steps itself, so the trainer scales the loss by sp_degree only (see engine.py).
Not exercised by the CPU test-suite (no deepspeed here); checkpoints under ZeRO save the gathered 16-bit weights.
"""

from __future__ import annotations

from seqpar.schema import LaunchPlan


def prepare(module, optimizer, scheduler, plan: LaunchPlan):
    """(engine, optimizer, scheduler, backward): backward(loss) runs DeepSpeed's backward and, at the boundary, its step."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from seqpar.runtime.launch import deepspeed_config

    plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(plan))
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=plan.strategy.gradient_accumulation_steps)
    engine, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)
    return engine, optimizer, scheduler, accelerator.backward
