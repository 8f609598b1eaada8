"""Axolotl: the YAML ``axolotl train`` reads, written for a plan and read back.

Keys (axolotl 0.19.0 ``utils/schemas/config.py`` and ``validation.py``; FSDP2 keys from its ``schemas/fsdp.py`` and
``examples/alst/llama3-8b-fsdp2-alst.yaml``): ``base_model``, ``sequence_len``, ``micro_batch_size``,
``gradient_accumulation_steps``, ``context_parallel_size`` (ring attention through ring-flash-attn's CUDA kernels;
its validator ``check_context_parallel_size`` refuses ``context_parallel_size > 1`` unless ``attn_implementation`` is
flash_attention_2 or flash_attention_3, so it is written on CPU clusters too, where the config then cannot run;
``ring_attn_func`` batch_ring or varlen_llama3, the only two its enum accepts), ``lr_scheduler`` (transformers'
scheduler names: ``constant`` ignores ``warmup_steps``, so a warmed-up constant plan is ``constant_with_warmup``), ``gradient_checkpointing``, ``activation_offloading`` (``hidden_states``: each checkpointed layer's input in
host RAM, seqpar's offload; ``true``/``legacy``/``disk`` offload every saved tensor), ``selective_checkpointing``,
``tiled_mlp``, the Liger plugin (``plugins: [axolotl.integrations.liger.LigerPlugin]``, ``liger_rms_norm``,
``liger_rope``, ``liger_glu_activation``, ``liger_fused_linear_cross_entropy``: the chunked loss), ``deepspeed`` (a path
or an inline dict), ``fsdp_version: 2`` + ``fsdp_config``, ``bf16``, ``optimizer``, ``datasets`` (required).
Unknown keys pass axolotl's validation silently (its schema does not forbid extras).
"""

from __future__ import annotations

from pathlib import Path

from seqpar.emit import lora
from seqpar.emit.capabilities import TABLE
from seqpar.emit.common import Reading, count, load_json, model_ref, read_ds, trainer_ds, yaml_text
from seqpar.emit.nearest import attn_implementation
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.specs import Strategy

CAPS = TABLE["axolotl"]
RING_ATTN = "flash_attention_2"  # what axolotl's context parallelism requires (ring-flash-attn), on any cluster
LIGER = "axolotl.integrations.liger.LigerPlugin"
CCE = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
LAYER_CLASS = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
}


def axolotl_config(plan: LaunchPlan, s: Strategy, output_dir: str) -> dict:
    w, t = plan.workload, plan.training
    ring = CAPS.native(s.mode) == "context_parallel_size"
    cfg: dict = {
        "base_model": model_ref(w.model)[0],
        "datasets": [{"path": "YOUR/DATASET", "type": "completion"}],
        "output_dir": output_dir,
        "sequence_len": w.seq_len,
        "micro_batch_size": w.micro_batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "max_steps": t.steps,
        "learning_rate": t.learning_rate,
        "lr_scheduler": t.lr_schedule if t.lr_schedule == "cosine" or not t.warmup_steps else "constant_with_warmup",
        "warmup_steps": t.warmup_steps,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.grad_clip,
        "seed": t.seed,
        "optimizer": "adamw_torch_fused" if plan.cluster.accelerator == "cuda" else "adamw_torch",
        "bf16": w.dtype == "bf16",
        "fp16": w.dtype == "fp16",
        "attn_implementation": RING_ATTN if ring else attn_implementation(plan.cluster),
        "gradient_checkpointing": s.checkpointing != "none",
    }
    if s.checkpointing == "offload":
        cfg["activation_offloading"] = "hidden_states"
    if s.checkpointing == "selective":
        cfg |= {"selective_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if ring:
        cfg |= {"context_parallel_size": s.sp_degree, "ring_attn_func": "batch_ring"}
    if s.tiled_mlp:
        cfg["tiled_mlp"] = True
    if s.fused_ops == "liger" or s.loss_impl == "chunked":
        cfg["plugins"] = [LIGER]
    if s.fused_ops == "liger":
        cfg |= {"liger_rms_norm": True, "liger_rope": True, "liger_glu_activation": True}
        if s.tiled_mlp:  # axolotl refuses Liger's GLU with tiled_mlp unless the original MLP runs inside the tiles
            cfg["tiled_mlp_use_original_mlp"] = True
    if s.loss_impl == "chunked":
        cfg["liger_fused_linear_cross_entropy"] = True
    if w.lora is not None:  # adapter, lora_r, ... (seqpar.emit.lora)
        cfg |= lora.axolotl_keys(w.lora)
    if s.sharding.startswith("zero"):
        cfg["deepspeed"] = trainer_ds(plan, s)
    elif s.sharding == "fsdp":
        cfg["fsdp_version"] = 2
        cfg["fsdp_config"] = {
            "offload_params": False,
            "state_dict_type": "SHARDED_STATE_DICT",
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": LAYER_CLASS.get(w.model.architecture, "LlamaDecoderLayer"),
            "reshard_after_forward": True,
        }
    return cfg


def files(plan: LaunchPlan, s: Strategy, stem: Path) -> tuple[dict[Path, str], str, list[str]]:
    yml = stem.with_name(stem.name + ".axolotl.yaml")
    cfg = axolotl_config(plan, s, f"./{stem.name}-axolotl")
    text = yaml_text(cfg, f"axolotl config for {plan.workload.model.name}, written by seqpar advise --emit axolotl")
    notes = ["set datasets: to your data (YOUR/DATASET is a placeholder)"]
    notes += [model_ref(plan.workload.model)[1]] if model_ref(plan.workload.model)[1] else []
    # on CPU ranks capabilities.cannot_run says the config cannot run there (the flash-attn kernels need CUDA)
    notes += ["context_parallel_size needs pip install ring-flash-attn flash-attn"] if CAPS.native(s.mode) else []
    return {yml: text}, f"axolotl train {yml}", notes


# --------------------------------------------------------------------------------------------- read back

NEUTRAL = {
    "datasets", "output_dir", "max_steps", "num_epochs", "learning_rate", "lr_scheduler", "warmup_steps", "warmup_ratio",
    "weight_decay", "max_grad_norm", "seed", "attn_implementation", "flash_attention", "sdp_attention", "sample_packing",
    "pad_to_sequence_len", "dataset_prepared_path", "val_set_size", "logging_steps", "saves_per_epoch", "evals_per_epoch",
    "save_steps", "eval_steps", "special_tokens", "wandb_project", "wandb_entity", "wandb_name", "wandb_watch",
    "wandb_log_model", "tf32", "strict", "resume_from_checkpoint", "hub_model_id", "min_sample_len", "ring_attn_func",
    "heads_k_stride", "dp_shard_size", "dp_replicate_size", "tokenizer_type", "model_type", "trust_remote_code",
    "cosine_min_lr_ratio", "cosine_constant_lr_ratio", "save_only_model", "excess_length_strategy", "eval_sequence_len",
    "tiled_mlp_num_shards", "tiled_mlp_use_original_mlp", "liger_layer_norm", "liger_cross_entropy", "chat_template",
    "gradient_checkpointing_kwargs", "torch_compile", "group_by_length", "train_on_inputs", "plugins",
}  # fmt: skip
MAPPED = {
    "base_model", "sequence_len", "micro_batch_size", "gradient_accumulation_steps", "context_parallel_size",
    "sequence_parallel_degree", "gradient_checkpointing", "activation_offloading", "selective_checkpointing", "tiled_mlp",
    "liger_rms_norm", "liger_rope", "liger_glu_activation", "liger_swiglu", "liger_fused_linear_cross_entropy",
    "deepspeed", "fsdp_version", "fsdp_config", "fsdp", "bf16", "fp16", "optimizer", "tensor_parallel_size",
}  # fmt: skip
MEMORY = ("fp8", "unfrozen_parameters")  # the adapter keys: seqpar.emit.lora
ADAPTER = (
    "adapter", "load_in_4bit", "load_in_8bit", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
    "lora_target_linear", "lora_modules_to_save", "lora_target_parameters", "lora_model_dir", "lora_fan_in_fan_out",
    "peft_use_dora", "peft_use_rslora", "peft_layers_to_transform", "peft_autocast_adapter_dtype", "lora_on_cpu",
    "qlora_sharded_model_loading",
)  # fmt: skip
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")


def read(data: dict, path: Path) -> Reading:
    r = Reading("axolotl", path)
    for k, v in data.items():
        if k.startswith(MEMORY):
            if v not in (False, None, ""):
                r.not_understood.append(f"{k} {v!r}")
        elif k not in MAPPED and k not in NEUTRAL and k not in ADAPTER:
            r.ignored.append(k)
    if not data.get("base_model"):
        raise SeqparError(f"{path}: base_model is missing; axolotl needs the model to train (a Hub id or folder)")
    r.put("model", str(data["base_model"]), f"base_model {data['base_model']}")
    lora.read_axolotl(data, r)
    r.put("seq_len", count(data.get("sequence_len", 512), "sequence_len", path), "sequence_len")
    r.put("micro_batch_size", count(data.get("micro_batch_size", 1), "micro_batch_size", path), "micro_batch_size")
    r.put(
        "gradient_accumulation_steps",
        count(data.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", path),
        "gradient_accumulation_steps",
    )
    degrees = [(k, data[k]) for k in ("context_parallel_size", "sequence_parallel_degree") if data.get(k) is not None]
    cp = [count(v, k, path) for k, v in degrees][0] if degrees else 1  # the first given, as axolotl reads them
    if cp > 1:
        r.put("mode", CAPS.mode_named("context_parallel_size"), f"context_parallel_size {cp} (ring-flash-attn)")
        r.values["sp_degree"] = cp
        if data.get("ring_attn_func", "batch_ring" if not data.get("sample_packing") else "varlen_llama3") == "varlen_llama3":
            r.not_understood.append("ring_attn_func varlen_llama3 (Llama-3-style all-gather of K/V; predicted as ring attention)")
    else:
        r.put("mode", CAPS.mode_named(""), "context_parallel_size 1")
        r.values["sp_degree"] = 1
    if data.get("tensor_parallel_size") is not None and count(data["tensor_parallel_size"], "tensor_parallel_size", path) > 1:
        r.not_understood.append(f"tensor_parallel_size {data['tensor_parallel_size']}")
    gc, off = data.get("gradient_checkpointing", False), data.get("activation_offloading", False)
    if gc == "offload" or off in ("hidden_states",):
        ck = "offload"
    elif data.get("selective_checkpointing"):
        ck = "selective"
    else:
        ck = "full" if gc else "none"
    if off in (True, "legacy", "disk") or gc == "offload_disk":
        r.not_understood.append(f"activation_offloading {off!r} (every saved tensor offloaded; predicted as checkpoint offload)")
        ck = "offload"
    r.put("checkpointing", ck, f"gradient_checkpointing {gc}, activation_offloading {off}")
    r.put("tiled_mlp", bool(data.get("tiled_mlp")), f"tiled_mlp {bool(data.get('tiled_mlp'))}")
    plugins = data.get("plugins") or []
    liger = any(data.get(k) for k in ("liger_rms_norm", "liger_rope", "liger_glu_activation", "liger_swiglu"))
    r.put("fused_ops", "liger" if liger else "none", f"liger_rms_norm/rope/glu_activation {liger}")
    chunked = bool(data.get("liger_fused_linear_cross_entropy")) or CCE in plugins
    r.put(
        "loss_impl",
        "chunked" if chunked else "hf",
        "liger_fused_linear_cross_entropy / CutCrossEntropyPlugin" if chunked else "no fused loss",
    )
    if data.get("fp16"):
        r.put("dtype", "fp16", "fp16 true")
    else:
        r.put("dtype", "bf16" if data.get("bf16", "auto") in (True, "auto") else "fp32", f"bf16 {data.get('bf16', 'auto')}")
    if str(data.get("optimizer", "adamw_torch_fused")) not in ADAMW:
        r.not_understood.append(f"optimizer {data['optimizer']} (predicted as AdamW)")
    if data.get("deepspeed"):
        ds = data["deepspeed"]
        if not isinstance(ds, dict):
            p = Path(str(ds))
            ds = load_json(p if p.is_file() else path.parent / p, "DeepSpeed config")
        read_ds(r, ds, "deepspeed: ")
    elif data.get("fsdp_version") or data.get("fsdp_config") or data.get("fsdp"):
        r.put("sharding", "fsdp", f"fsdp_version {data.get('fsdp_version', 1)}")
        if (data.get("fsdp_config") or {}).get("offload_params"):
            r.not_understood.append("fsdp_config.offload_params true (predicted with parameters on the GPU)")
    else:
        r.put("sharding", "ddp", "no deepspeed / fsdp: DDP")
    return r


__all__ = ["CAPS", "axolotl_config", "files", "read"]
