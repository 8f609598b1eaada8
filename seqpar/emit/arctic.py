"""ArcticTraining: the YAML ``arctic_training`` reads, written for a plan and read back.

Keys (arctic-training 0.8.0 ``config/trainer.py``, ``model.py``, ``data.py``, ``optimizer.py``; its schema forbids
unknown keys): top level ``type`` (sft), ``micro_batch_size``, ``gradient_accumulation_steps``,
``sequence_parallel_size`` (DeepSpeed Ulysses, the ALST reference), ``activation_checkpoint_cpu_offload`` (checkpointed
inputs in host RAM: seqpar's offload), ``tiled_mlp_compute``, ``train_iters``, ``seed``, ``deepspeed`` (an inline dict;
without ``zero_optimization`` it runs ZeRO stage 2); ``model``: ``type`` (huggingface | liger), ``name_or_path``,
``attn_implementation``, ``dtype``, ``disable_activation_checkpoint`` (default false: checkpointing on), ``peft_config``;
``data``: ``sources`` (required), ``max_length`` (a HumanInt: ``k m b t`` are powers of 10 and ``ki mi gi ti`` powers of
2, so its ``128k`` is 128000 where seqpar's is 131072); ``optimizer``: ``type`` (fused_adam | cpu_adam),
``learning_rate``, ``weight_decay``; ``scheduler`` (``config/scheduler.py``, ``scheduler/hf_factory.py``): ``type``
huggingface, ``name`` (transformers' get_scheduler name), ``warmup_ratio`` (default 0.1: without the key a run warms
up over a tenth of its steps and decays linearly to 0, whatever the plan says), the warmup being
``int(warmup_ratio * train_iters) * sequence_parallel_size`` steps of a schedule over ``train_iters *
sequence_parallel_size``, stepped once per iteration (so at sp > 1 the ratio is the plan's warmup / sp). It computes the loss on logits a tile at a time (seqpar's chunked).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from seqpar.emit import lora
from seqpar.emit.capabilities import TABLE
from seqpar.emit.common import Reading, count, ds_config, model_ref, read_ds, yaml_text
from seqpar.emit.nearest import attn_implementation
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.safe import printable
from seqpar.plan.specs import Strategy

CAPS = TABLE["arctic"]


def scheduler(steps: int, warmup_steps: int, schedule: str, sp: int = 1) -> dict:
    """The plan's schedule as ArcticTraining's huggingface scheduler factory builds it: transformers' get_scheduler with
    ``int(warmup_ratio * steps) * sp`` warmup steps over ``steps * sp`` (scheduler/hf_factory.py multiplies both by
    sequence_parallel_size, and the schedule still steps once per optimizer step), so the ratio is the smallest float
    that gives exactly ``warmup_steps / sp``: the plan's warmup where sp divides it (``stretched`` says where not)."""
    name = "cosine" if schedule == "cosine" else "constant_with_warmup" if warmup_steps else "constant"
    want = warmup_steps // sp
    ratio = want / steps
    while int(ratio * steps) < want:  # 7 / 300 * 300 is 6.999...: int() would warm up one step short
        ratio = math.nextafter(ratio, 1.0)
    return {"type": "huggingface", "name": name, "warmup_ratio": ratio}


def stretched(warmup_steps: int, schedule: str, sp: int) -> str:
    """Why ArcticTraining cannot step the plan's schedule at sequence_parallel_size ``sp`` ('' where it can)."""
    if sp > 1 and schedule == "cosine":
        return f"ArcticTraining decays a cosine schedule over sequence_parallel_size x train_iters ({sp}x the plan's steps)"
    if warmup_steps % sp:
        return (
            f"ArcticTraining warms up in multiples of sequence_parallel_size {sp}: "
            f"{warmup_steps // sp * sp} steps for the plan's {warmup_steps}"
        )
    return ""


def arctic_config(plan: LaunchPlan, s: Strategy) -> dict:
    w, t = plan.workload, plan.training
    ds = ds_config(plan, s, sp_key=False)
    deepspeed = {"zero_optimization": ds["zero_optimization"]}  # ArcticTraining fills batch sizes, bf16 and SP itself
    if "seq_parallel_communication_data_type" in ds:
        deepspeed["seq_parallel_communication_data_type"] = ds["seq_parallel_communication_data_type"]
    cfg = {
        "type": "sft",
        "micro_batch_size": w.micro_batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "sequence_parallel_size": s.sp_degree,
        "activation_checkpoint_cpu_offload": s.checkpointing == "offload",
        "tiled_mlp_compute": s.tiled_mlp,
        "train_iters": t.steps,
        "seed": t.seed,
        "deepspeed": deepspeed,
        "optimizer": {
            "type": "cpu_adam" if s.sharding == "zero3_offload" else "fused_adam",
            "learning_rate": t.learning_rate,
            "weight_decay": t.weight_decay,
        },
        "scheduler": scheduler(t.steps, t.warmup_steps, t.lr_schedule, s.sp_degree),
        "model": {
            "type": "liger" if s.fused_ops == "liger" else "huggingface",
            "name_or_path": model_ref(w.model)[0],
            "attn_implementation": attn_implementation(plan.cluster),
            "dtype": w.dtype,
            "disable_activation_checkpoint": s.checkpointing == "none",
        },
        "data": {"sources": [{"type": "huggingface_instruct", "name_or_path": "YOUR/DATASET"}], "max_length": w.seq_len},
    }
    if w.lora is not None:  # peft's LoraConfig arguments (seqpar.emit.lora)
        cfg["model"]["peft_config"] = lora.arctic_peft_config(w.lora)
    return cfg


def files(plan: LaunchPlan, s: Strategy, stem: Path) -> tuple[dict[Path, str], str, list[str]]:
    yml = stem.with_name(stem.name + ".arctic.yaml")
    text = yaml_text(
        arctic_config(plan, s), f"ArcticTraining config for {plan.workload.model.name}, written by seqpar advise --emit arctic"
    )
    notes = ["set data.sources to your data (YOUR/DATASET is a placeholder)"]
    notes += [model_ref(plan.workload.model)[1]] if model_ref(plan.workload.model)[1] else []
    t = plan.training
    notes += [why] if (why := stretched(t.warmup_steps, t.lr_schedule, s.sp_degree)) else []
    return {yml: text}, f"arctic_training {yml} --num_gpus {plan.cluster.gpus_per_node}", notes


# --------------------------------------------------------------------------------------------- read back

NEUTRAL = {"type", "code", "skip_validation", "tokenizer", "logger", "wandb", "scheduler", "epochs", "loss_log_interval",
           "train_log_iter_interval", "train_log_metrics_path", "seed", "checkpoint", "train_iters", "eval_interval",
           "eval_log_iter_interval", "exit_iteration", "exit_iteration_this_run", "min_iterations", "overfit_first_batch",
           "mem_profiler", "mem_profiler_dir", "mem_profiler_max_entries", "kill_switch_path"}  # fmt: skip
_HUMAN = re.compile(r"^(-?\d+(?:\.\d+)?)(k|m|b|t|ki|mi|gi|ti)?$")
_SCALE = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def human_int(value, key: str, path: Path) -> int:
    """ArcticTraining's HumanInt: '_' allowed; k m b t = 10**3..10**12, ki mi gi ti = 2**10..2**40 ('128k' = 128000)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _HUMAN.match(str(value).replace("_", "").strip().lower())
        if not m:
            raise SeqparError(
                f"{path}: {key} {printable(repr(value), 60)} is not a number (ArcticTraining writes 500000, 500_000, 128k "
                "or 128ki)"
            )
        n = float(m.group(1)) * _SCALE.get(m.group(2) or "", 1)
        if not math.isfinite(n):  # a number of hundreds of digits reads as inf
            raise SeqparError(f"{path}: {key} {str(value)[:20]}... is more than any count a tool holds; fix the file")
        if n != int(n):
            raise SeqparError(f"{path}: {key} {value!r} is not a whole number")
        n = int(n)
    return count(n, key, path)


def read(data: dict, path: Path) -> Reading:
    r = Reading("arctic", path)
    known = NEUTRAL | {"model", "data", "deepspeed", "optimizer", "micro_batch_size", "gradient_accumulation_steps",
                       "sequence_parallel_size", "activation_checkpoint_cpu_offload", "tiled_mlp_compute"}  # fmt: skip
    r.ignored += [k for k in data if k not in known]
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    if not model.get("name_or_path"):
        raise SeqparError(f"{path}: model.name_or_path is missing; ArcticTraining needs the model to train")
    r.put("model", str(model["name_or_path"]), f"model.name_or_path {model['name_or_path']}")
    lora.read_arctic(model, r)
    dmap = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}
    r.put(
        "dtype",
        dmap.get(str(model.get("dtype", "bf16")).replace("torch.", ""), "bf16"),
        f"model.dtype {model.get('dtype', 'bf16')}",
    )
    r.put("fused_ops", "liger" if model.get("type") == "liger" else "none", f"model.type {model.get('type', 'huggingface')}")
    data_cfg = data.get("data") if isinstance(data.get("data"), dict) else {}
    if "max_length" not in data_cfg:
        raise SeqparError(
            f"{path}: data.max_length is missing (ArcticTraining then uses the model's max_position_embeddings); set it"
        )
    r.put("seq_len", human_int(data_cfg["max_length"], "data.max_length", path), f"data.max_length {data_cfg['max_length']}")
    r.put("micro_batch_size", human_int(data.get("micro_batch_size", 1), "micro_batch_size", path), "micro_batch_size")
    r.put(
        "gradient_accumulation_steps",
        human_int(data.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", path),
        "gradient_accumulation_steps",
    )
    sp = human_int(data.get("sequence_parallel_size", 1), "sequence_parallel_size", path)
    r.put("mode", CAPS.mode_named("sequence_parallel_size" if sp > 1 else ""), f"sequence_parallel_size {sp}")
    r.values["sp_degree"] = sp
    ck = (
        "none"
        if model.get("disable_activation_checkpoint")
        else "offload"
        if data.get("activation_checkpoint_cpu_offload")
        else "full"
    )
    r.put("checkpointing", ck, f"model.disable_activation_checkpoint {bool(model.get('disable_activation_checkpoint'))}")
    r.put("tiled_mlp", bool(data.get("tiled_mlp_compute")), f"tiled_mlp_compute {bool(data.get('tiled_mlp_compute'))}")
    r.put("loss_impl", "chunked", "ArcticTraining's tiled loss")
    ds = data.get("deepspeed") if isinstance(data.get("deepspeed"), dict) else {}
    read_ds(r, {"zero_optimization": {"stage": 2}} | ds, "deepspeed: ")  # ArcticTraining's default: stage 2
    r.values["optimizer"] = "adamw"  # DeepSpeed's bf16 keeps an fp32 master copy
    return r


__all__ = ["CAPS", "arctic_config", "files", "human_int", "read", "scheduler", "stretched"]
