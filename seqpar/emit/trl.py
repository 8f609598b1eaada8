"""TRL's SFTTrainer: the ``trl sft`` arguments (``--config sft.yaml``) for a plan, next to the accelerate YAML that
carries its parallelism, and those arguments read back.

Fields (trl 1.16.0 ``SFTConfig`` over transformers' ``TrainingArguments``; ``ScriptArguments`` and ``ModelConfig`` of
``trl/scripts/sft.py``): ``max_length`` (the global sequence length; ``max_seq_length`` was removed in TRL 0.20),
``per_device_train_batch_size`` (default 8), ``gradient_accumulation_steps``, ``activation_checkpointing`` and
``activation_checkpointing_kwargs`` (transformers 5.25's names: its ``gradient_checkpointing`` and
``gradient_checkpointing_kwargs`` are deprecated aliases, removed in v6, and TRL's default ``gradient_checkpointing:
true`` warns unless ``activation_checkpointing`` is set; the kwargs hold ``selective: true``, TRL >= 1.15's selective
checkpointing that keeps attention, or ``offload: true``, transformers >= 5.17's checkpointed inputs in pinned host
memory), ``pad_to_multiple_of`` (the multiple the mode splits), ``average_tokens_across_devices: false`` (the loss
averaged over data-parallel ranks as seqpar launch averages it), ``bf16``, ``optim``, ``dtype`` (ModelConfig,
default float32: fp32 weights under bf16 autocast, i.e. seqpar's adamw with an fp32 master; bfloat16 weights make
AdamW's moments bf16, seqpar's adamw-bf16), ``attn_implementation``, ``model_name_or_path``. ``parallelism_config``
cannot come from a YAML (HfArgumentParser keeps a dict a dict): accelerate's YAML carries it, and SFTTrainer reads it off
the accelerator. Under FSDP the checkpointing goes to accelerate's fsdp keys (TRL's docs: not both). ``env:`` (set by
TRL's parser before the trainer starts) turns off accelerate 1.16's ``sp_disable_in_eval``, which would evaluate whole
sequences on every rank.
"""

from __future__ import annotations

from pathlib import Path

from seqpar.emit import accelerate, lora
from seqpar.emit.capabilities import TABLE
from seqpar.emit.common import Reading, count, dump_json, model_ref, read_ds, trainer_ds, yaml_text
from seqpar.emit.nearest import attn_implementation
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.modes import split_multiple
from seqpar.plan.specs import Strategy

CAPS = TABLE["trl"]


def sft_args(plan: LaunchPlan, s: Strategy, output_dir: str) -> dict:
    w, t, cl = plan.workload, plan.training, plan.cluster
    fp32_master = w.optimizer != "adamw-bf16" or s.sharding.startswith("zero")  # DeepSpeed keeps an fp32 master itself
    axis = CAPS.native(s.mode)  # accelerate's ParallelismConfig axis (capabilities.py)
    args: dict = {
        "model_name_or_path": model_ref(w.model)[0],
        "dtype": "float32" if fp32_master or w.dtype == "fp32" else "bfloat16",
        "attn_implementation": "sdpa" if axis == "cp_size" else attn_implementation(cl),  # torch CP: SDPA only
        "output_dir": output_dir,
        "max_length": w.seq_len,
        "per_device_train_batch_size": w.micro_batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "max_steps": t.steps,
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_schedule if t.lr_schedule == "cosine" or not t.warmup_steps else "constant_with_warmup",
        "warmup_steps": t.warmup_steps,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.grad_clip,
        # seqpar's loss is each data-parallel rank's token mean, averaged over the ranks (runtime/train/engine.py);
        # transformers' default divides every rank's token sum by the tokens of all ranks, another gradient
        "average_tokens_across_devices": False,
        "seed": t.seed,
        "bf16": w.dtype == "bf16",
        "fp16": w.dtype == "fp16",
        "use_cpu": cl.accelerator == "cpu",
        "optim": "adamw_torch_fused" if cl.accelerator == "cuda" else "adamw_torch",
        "activation_checkpointing": s.checkpointing != "none" and s.sharding != "fsdp",
        "report_to": "none",
    }
    if args["activation_checkpointing"]:
        kw: dict = {"use_reentrant": False}
        kw |= {"selective": True} if s.checkpointing == "selective" else {}
        kw |= {"offload": True} if s.checkpointing == "offload" else {}
        args["activation_checkpointing_kwargs"] = kw
    mult = split_multiple(s.mode, s.sp_degree, s.ulysses_degree)
    if mult > 1:
        args["pad_to_multiple_of"] = mult
    if w.lora is not None:  # the frozen base loads in bf16 (peft keeps its adapters in fp32): seqpar.emit.lora
        args["dtype"] = "float32" if w.dtype == "fp32" else "bfloat16"
        args |= lora.trl_keys(w.lora)
    if axis == "sp_size":  # accelerate >= 1.16 evaluates whole sequences on every rank unless told (env only)
        args["env"] = {"PARALLELISM_CONFIG_SP_DISABLE_IN_EVAL": "false"}
    return args


def files(plan: LaunchPlan, s: Strategy, stem: Path) -> tuple[dict[Path, str], str, list[str]]:
    out: dict[Path, str] = {}
    ds_path = None
    if s.sharding.startswith("zero"):
        ds = trainer_ds(plan, s)
        ds_file = stem.with_name(stem.name + ".ds_config.json")
        out[ds_file] = dump_json(ds)
        ds_path = str(ds_file)
    acc = stem.with_name(stem.name + ".accelerate.yaml")
    out[acc] = yaml_text(
        accelerate.accelerate_config(plan, s, ds_path), "accelerate config for trl sft, written by seqpar advise --emit trl"
    )
    sft = stem.with_name(stem.name + ".sft.yaml")
    args = sft_args(plan, s, f"{stem.name}-sft")
    out[sft] = yaml_text(args, f"trl sft arguments for {plan.workload.model.name}, written by seqpar advise --emit trl")
    notes = [model_ref(plan.workload.model)[1]] if model_ref(plan.workload.model)[1] else []
    if s.checkpointing == "selective" and args["activation_checkpointing"]:
        notes.append("selective checkpointing needs TRL >= 1.15")
    if s.checkpointing == "offload" and args["activation_checkpointing"]:
        notes.append("activation_checkpointing_kwargs offload needs transformers >= 5.17")
    cmd = f"accelerate launch --config_file {acc} -m trl.scripts.sft --config {sft} --dataset_name YOUR/DATASET"
    return out, cmd, notes


# --------------------------------------------------------------------------------------------- read back

MAPPED = {
    "model_name_or_path", "dtype", "max_length", "per_device_train_batch_size", "gradient_accumulation_steps",
    "gradient_checkpointing", "activation_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
    "use_liger_kernel", "bf16", "fp16", "optim", "deepspeed", "fsdp", "fsdp_config", "use_cpu",
}  # fmt: skip
NEUTRAL = {
    "output_dir", "max_steps", "num_train_epochs", "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
    "weight_decay", "max_grad_norm", "seed", "data_seed", "report_to", "run_name", "logging_steps", "logging_dir",
    "logging_strategy", "save_steps", "save_strategy", "save_total_limit", "eval_strategy", "eval_steps",
    "per_device_eval_batch_size", "average_tokens_across_devices", "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split",
    "dataset_text_field", "attn_implementation", "packing", "packing_strategy", "padding_free", "pad_to_multiple_of",
    "loss_type", "completion_only_loss", "assistant_only_loss", "push_to_hub", "hub_model_id", "resume_from_checkpoint",
    "dataloader_num_workers", "remove_unused_columns", "trust_remote_code", "eos_token", "pad_token", "chat_template_path",
    "model_revision", "env", "adam_beta1", "adam_beta2", "adam_epsilon", "ddp_timeout", "disable_tqdm", "log_level",
}  # fmt: skip
MEMORY = ("activation_offloading", "torch_compile", "model_init_kwargs")  # LoRA's keys: seqpar.emit.lora
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")


def read(data: dict, path: Path) -> Reading:
    r = Reading("trl", path)
    if "max_seq_length" in data:
        raise SeqparError(f"{path}: max_seq_length was removed in TRL 0.20; write max_length (the global sequence length)")
    for k in data:
        if k.startswith(MEMORY) and data[k] not in (False, None):
            r.not_understood.append(f"{k} {data[k]!r}")
        elif k not in MAPPED and k not in NEUTRAL and k not in lora.TRL_KEYS and not k.startswith(MEMORY):
            r.ignored.append(k)
    if data.get("model_name_or_path"):
        r.put("model", str(data["model_name_or_path"]), f"model_name_or_path {data['model_name_or_path']}")
    if data.get("max_length", 1024) is not None:  # None: no truncation, the longest sample (then --seq-len says it)
        seq = count(data.get("max_length", 1024), "max_length", path)
        r.put("seq_len", seq, f"max_length {data.get('max_length', '1024 (default)')}")
    micro = count(data.get("per_device_train_batch_size", 8), "per_device_train_batch_size", path)
    r.put("micro_batch_size", micro, "per_device_train_batch_size")
    ga = count(data.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", path)
    r.put("gradient_accumulation_steps", ga, "gradient_accumulation_steps")
    on = data.get("activation_checkpointing", data.get("gradient_checkpointing", True))  # TRL's default: on
    kw = data.get("activation_checkpointing_kwargs", data.get("gradient_checkpointing_kwargs")) or {}
    ck = "none" if not on else "selective" if kw.get("selective") else "offload" if kw.get("offload") else "full"
    r.put("checkpointing", ck, f"gradient_checkpointing {bool(on)}" + (f" {kw}" if kw else ""))
    if kw.get("every_n_layers", 1) != 1:
        r.not_understood.append(f"gradient_checkpointing_kwargs every_n_layers {kw['every_n_layers']}")
    r.put("loss_impl", "chunked", "SFTTrainer's fused LM head loss (TRL >= 1.15)")
    liger = bool(data.get("use_liger_kernel"))
    r.put("fused_ops", "liger" if liger else "none", f"use_liger_kernel {liger}")
    r.put("tiled_mlp", False, "no TiledMLP in TRL")
    cpu = bool(data.get("use_cpu"))
    if cpu:  # CPU ranks, judged as seqpar advise --cluster cpu:N judges them
        r.put("accelerator", "cpu", "use_cpu true")
    dtype = "fp16" if data.get("fp16") else "fp32" if data.get("bf16") is False or cpu else "bf16"
    r.put("dtype", dtype, f"bf16 {data.get('bf16', 'default')}")
    r.put(
        "optimizer",
        "adamw-bf16" if str(data.get("dtype", "float32")) in ("bfloat16", "auto") else "adamw",
        f"dtype {data.get('dtype', 'float32')}",
    )
    adapters = lora.read_trl(data, r)
    if adapters is not None:  # dtype is the frozen base's; peft keeps the adapters in fp32, SFTTrainer a 4-bit base's in bf16
        bf16_adapters = adapters.base_dtype == "nf4"
        r.values["optimizer"] = "adamw-bf16" if bf16_adapters else "adamw"
        r.used.append("adapters in bf16 (SFTTrainer casts a 4-bit base's)" if bf16_adapters else "adapters in fp32 (peft)")
    optim = str(data.get("optim", "adamw_torch"))
    if optim not in ADAMW:
        r.not_understood.append(f"optim {optim} (predicted as AdamW)")
    if isinstance(data.get("deepspeed"), (str, dict)):
        ds = data["deepspeed"] if isinstance(data["deepspeed"], dict) else _load(path, str(data["deepspeed"]))
        read_ds(r, ds, "deepspeed: ")
        r.values["optimizer"] = "adamw"  # DeepSpeed's bf16 keeps an fp32 master copy
    elif data.get("fsdp"):
        r.put("sharding", "fsdp", f"fsdp {data['fsdp']!r}")
    return r


def _load(path: Path, name: str) -> dict:
    from seqpar.emit.common import load_json

    p = Path(name)
    return load_json(p if p.is_file() else path.parent / p, "DeepSpeed config")


__all__ = ["CAPS", "files", "read", "sft_args"]
