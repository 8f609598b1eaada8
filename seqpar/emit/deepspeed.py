"""DeepSpeed: the JSON a ``deepspeed`` launch (or the HF Trainer's ``--deepspeed``) reads, written for a plan and read back.

It carries the engine (ZeRO stage and offload, batch sizes, gradient clipping, bf16), the plan's AdamW (``optimizer``:
what ``deepspeed.initialize`` builds; a warmup or cosine schedule stays in the script) and, for Ulysses,
``sequence_parallel_size`` with ``seq_parallel_communication_data_type``; the script registers DeepSpeed's Ulysses
attention itself (``deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF``, the ALST integration).
Checkpointing (with its split over the layers), the loss and fused kernels stay in the script. Stage 0 is DeepSpeed without sharding (DDP's replicas).
"""

from __future__ import annotations

from pathlib import Path

from seqpar.emit.capabilities import TABLE
from seqpar.emit.common import Reading, ds_config, dump_json, read_ds
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.rules import checkpointing_text
from seqpar.plan.specs import Strategy

CAPS = TABLE["deepspeed"]


def files(plan: LaunchPlan, s: Strategy, stem: Path) -> tuple[dict[Path, str], str, list[str]]:
    ds = ds_config(plan, s, sp_key=True)
    t = plan.training
    # The plan's AdamW, so deepspeed.initialize builds what seqpar launch trains with (without an optimizer a ZeRO-3
    # engine cannot step); DeepSpeed's CPU AdamW runs an offloaded update.
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": t.learning_rate, "weight_decay": t.weight_decay}}
    path = stem.with_name(stem.name + ".deepspeed.json")
    ckpt = checkpointing_text(s, plan.workload.model.num_layers)
    left = [f"your script keeps checkpointing {ckpt} and loss {s.loss_impl}"]
    if t.warmup_steps or t.lr_schedule != "constant":
        # DeepSpeed's WarmupLR and WarmupCosineLR (0.19.8 runtime/lr_schedules.py) start a step behind transformers'
        # schedules (their first step runs at warmup_min_lr): none gives seqpar launch's rates
        left.append(
            f"your script keeps the schedule: deepspeed.initialize(lr_scheduler=...) with transformers' "
            f"get_{t.lr_schedule}_schedule_with_warmup, {t.warmup_steps} warmup steps"
            + (f" over {t.steps} steps" if t.lr_schedule == "cosine" else "")
        )
    if CAPS.native(s.mode):
        left.append("register Ulysses in your script (deepspeed UlyssesSPAttentionHF.register_with_transformers)")
    return {path: dump_json(ds)}, f"deepspeed --num_gpus {plan.cluster.gpus_per_node} YOUR_SCRIPT.py --deepspeed {path}", left


def read(data: dict, path: Path) -> Reading:
    r = Reading("deepspeed", path)
    known = {"zero_optimization", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16",
             "sequence_parallel_size", "seq_parallel_communication_data_type", "gradient_clipping", "train_batch_size",
             "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
             "zero_force_ds_cpu_optimizer", "prescale_gradients", "bfloat16", "activation_checkpointing"}  # fmt: skip
    r.ignored += [k for k in data if k not in known]
    if isinstance(data.get("activation_checkpointing"), dict):
        r.not_understood.append("activation_checkpointing (DeepSpeed's own checkpointing API)")
    read_ds(r, data)
    if "mode" not in r.values:  # no sequence_parallel_size: every rank holds whole sequences
        r.put("mode", CAPS.mode_named(""), "no sequence_parallel_size")
        r.values["sp_degree"] = 1
    r.values["optimizer"] = "adamw"  # DeepSpeed's bf16 keeps an fp32 master copy
    return r


__all__ = ["CAPS", "files", "read"]
