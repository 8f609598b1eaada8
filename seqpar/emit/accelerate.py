"""accelerate: the config YAML ``accelerate launch --config_file`` reads, written for a plan and read back.

Keys (accelerate 1.16.0 ``commands/config/config_args.py`` ClusterConfig and ``commands/launch.py``): top level
``distributed_type`` (NO | MULTI_CPU | MULTI_GPU | DEEPSPEED | FSDP, required), ``num_processes`` (all machines),
``num_machines``, ``machine_rank``, ``mixed_precision`` (no | fp16 | bf16 | fp8; not allowed next to a
``deepspeed_config_file``, which must carry ``bf16`` itself), ``use_cpu``; ``deepspeed_config``:
``deepspeed_config_file`` (a path from the launch's working directory), ``zero3_init_flag``, or inline ``zero_stage``,
``offload_optimizer_device``, ``offload_param_device``; ``fsdp_config``: ``fsdp_version`` 2, ``fsdp_offload_params``,
``fsdp_activation_checkpointing``, ``fsdp_activation_checkpointing_offload`` (FSDP2 only); ``parallelism_config``, its
keys prefixed ``parallelism_config_`` (copied to the launch flags as written): ``dp_replicate_size``, ``dp_shard_size``,
``tp_size``, ``cp_size`` + ``cp_backend`` torch + ``cp_comm_strategy`` (allgather | alltoall), ``sp_size`` +
``sp_backend`` deepspeed + ``sp_seq_length_is_variable`` + ``sp_attn_implementation``. ParallelismConfig's rules:
cp and sp exclusive; dp_replicate x dp_shard x tp x cp x sp = num_processes except under DeepSpeed's sequence
parallelism; torch CP runs on FSDP2 only.
"""

from __future__ import annotations

from pathlib import Path

from seqpar.emit.capabilities import TABLE
from seqpar.emit.common import Reading, count, ds_config, dump_json, load_json, read_ds, yaml_text, zero_stage
from seqpar.emit.nearest import attn_implementation
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.specs import Strategy

CAPS = TABLE["accelerate"]


def accelerate_config(plan: LaunchPlan, s: Strategy, ds_path: str | None, *, fsdp_checkpointing: bool = True) -> dict:
    """The accelerate YAML for ``s``; ``ds_path``: the DeepSpeed JSON it names (zero* shardings)."""
    cpu = plan.cluster.accelerator == "cpu"
    nodes = plan.cluster.nodes
    cfg: dict = {"compute_environment": "LOCAL_MACHINE"}
    if s.sharding == "fsdp":
        fsdp = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": False,
        }
        if fsdp_checkpointing and s.checkpointing != "none":
            fsdp["fsdp_activation_checkpointing"] = True
            fsdp["fsdp_activation_checkpointing_offload"] = s.checkpointing == "offload"
        cfg |= {"distributed_type": "FSDP", "fsdp_config": fsdp, "mixed_precision": _precision(plan)}
    elif s.sharding.startswith("zero"):
        cfg |= {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": ds_path}}
        cfg["deepspeed_config"]["zero3_init_flag"] = s.sharding != "zero2"
    else:
        cfg |= {"distributed_type": "MULTI_CPU" if cpu else "MULTI_GPU", "mixed_precision": _precision(plan)}
    cfg |= {"num_machines": nodes, "num_processes": s.world_size, "machine_rank": 0, "use_cpu": cpu}
    cfg |= {"main_training_function": "main", "rdzv_backend": "c10d" if nodes > 1 else "static", "same_network": True}
    if nodes > 1:
        cfg |= {"main_process_ip": "127.0.0.1", "main_process_port": 29500}
    pc = {"dp_replicate_size": 1, "dp_shard_size": s.dp_degree}
    axis = CAPS.native(s.mode)  # the ParallelismConfig axis of the mode (capabilities.py), "" for none
    if axis == "sp_size":
        pc |= {"sp_size": s.sp_degree, "sp_backend": "deepspeed", "sp_seq_length_is_variable": True}
        pc["sp_attn_implementation"] = attn_implementation(plan.cluster)
    elif axis == "cp_size":
        pc |= {"cp_size": s.sp_degree, "cp_backend": "torch", "cp_comm_strategy": "alltoall"}
    if axis:
        cfg["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in pc.items()}
    return cfg


def _precision(plan: LaunchPlan) -> str:
    return {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[plan.workload.dtype]


def files(plan: LaunchPlan, s: Strategy, stem: Path) -> tuple[dict[Path, str], str, list[str]]:
    """The accelerate YAML (and the DeepSpeed JSON it names), the command, and what the config leaves to the script."""
    out: dict[Path, str] = {}
    ds_path = None
    if s.sharding.startswith("zero"):
        ds_file = stem.with_name(stem.name + ".ds_config.json")
        out[ds_file] = dump_json(ds_config(plan, s, sp_key=False))
        ds_path = str(ds_file)
    yml = stem.with_name(stem.name + ".accelerate.yaml")
    header = (
        f"accelerate config for {plan.workload.model.name} at {plan.workload.seq_len} tokens, written by seqpar advise --emit"
    )
    out[yml] = yaml_text(accelerate_config(plan, s, ds_path), header)
    left = [
        f"your script keeps the rest: checkpointing {s.checkpointing}, micro-batch {plan.workload.micro_batch_size}, "
        f"gradient accumulation {s.gradient_accumulation_steps}, loss {s.loss_impl}"
        + (", Liger kernels" if s.fused_ops == "liger" else "")
        + (", TiledMLP" if s.tiled_mlp else "")
    ]
    return out, f"accelerate launch --config_file {yml} YOUR_SCRIPT.py", left


# --------------------------------------------------------------------------------------------- read back

KNOWN = {
    "compute_environment", "distributed_type", "num_processes", "num_machines", "machine_rank", "mixed_precision", "use_cpu",
    "main_training_function", "rdzv_backend", "same_network", "main_process_ip", "main_process_port", "debug", "gpu_ids",
    "enable_cpu_affinity", "downcast_bf16", "deepspeed_config", "fsdp_config", "parallelism_config", "dynamo_config",
    "fp8_config", "megatron_lm_config", "mpirun_config", "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo",
    "command_file", "commands", "tpu_vm", "tpu_env",
}  # fmt: skip


def read(data: dict, path: Path) -> Reading:
    r = Reading("accelerate", path)
    r.ignored += sorted(k for k in data if k not in KNOWN)
    dt = str(data.get("distributed_type", "NO")).upper()
    if data.get("num_processes") not in (None, -1):  # -1: accelerate's "not set" (a scheduler passes it)
        r.put("world_size", count(data["num_processes"], "num_processes", path), f"num_processes {data['num_processes']}")
    if data.get("num_machines") is not None:
        r.put("nodes", count(data["num_machines"], "num_machines", path), f"num_machines {data['num_machines']}")
    mp = data.get("mixed_precision")
    if mp in ("bf16", "fp16", "no"):
        r.put("dtype", {"no": "fp32"}.get(mp, mp), f"mixed_precision {mp}")
    elif mp is not None:
        r.not_understood.append(f"mixed_precision {mp}")
    if dt == "DEEPSPEED":
        _read_deepspeed(r, data.get("deepspeed_config") or {}, path)
    elif dt == "FSDP":
        _read_fsdp(r, data.get("fsdp_config") or {})
    elif dt in ("NO", "MULTI_GPU", "MULTI_CPU"):
        r.put("sharding", "ddp", f"distributed_type {dt}")
    else:
        raise SeqparError(f"{path}: distributed_type {dt!r} is not one seqpar models (NO, MULTI_GPU, MULTI_CPU, DEEPSPEED, FSDP)")
    if data.get("use_cpu") is True or dt == "MULTI_CPU":  # CPU ranks, judged as seqpar advise --cluster cpu:N judges them
        r.put("accelerator", "cpu", "use_cpu true" if data.get("use_cpu") is True else "distributed_type MULTI_CPU")
    if data.get("megatron_lm_config"):
        r.not_understood.append("megatron_lm_config")
    _read_parallelism(r, data.get("parallelism_config") or {}, path, deepspeed=dt == "DEEPSPEED")
    return r


def _read_deepspeed(r: Reading, dsc: dict, path: Path) -> None:
    if dsc.get("deepspeed_config_file"):
        p = Path(str(dsc["deepspeed_config_file"]))
        for cand in (p, path.parent / p, path.parent / p.name):  # the launch's working directory, then beside the YAML
            if cand.is_file():
                read_ds(r, load_json(cand, "DeepSpeed config"), f"{cand.name}: ")
                return
        raise SeqparError(
            f"{path}: deepspeed_config_file {str(p)!r} does not exist; run seqpar check where accelerate launch runs"
        )
    stage = zero_stage(dsc.get("zero_stage", 2), "deepspeed_config.zero_stage", path)  # 2: DeepSpeedPlugin's default
    off_p, off_o = dsc.get("offload_param_device", "none"), dsc.get("offload_optimizer_device", "none")
    inline = {"zero_optimization": {"stage": stage, "offload_param": {"device": off_p}, "offload_optimizer": {"device": off_o}}}
    read_ds(r, inline, "deepspeed_config: ")


def _read_fsdp(r: Reading, f: dict) -> None:
    r.put("sharding", "fsdp", f"distributed_type FSDP (fsdp_version {f.get('fsdp_version', 1)})")
    if f.get("fsdp_offload_params"):
        r.not_understood.append("fsdp_offload_params true (predicted with parameters on the GPU)")
    if (
        str(f.get("fsdp_sharding_strategy", "FULL_SHARD")).upper() not in ("FULL_SHARD", "1")
        or f.get("fsdp_reshard_after_forward") is False
    ):
        r.not_understood.append("FSDP without resharding after forward (predicted as full sharding)")
    if f.get("fsdp_activation_checkpointing"):
        ck = "offload" if f.get("fsdp_activation_checkpointing_offload") else "full"
        r.put("checkpointing", ck, f"fsdp_activation_checkpointing{'_offload' if ck == 'offload' else ''}")


def _read_parallelism(r: Reading, pc: dict, path: Path, *, deepspeed: bool) -> None:
    size = {k: pc.get(f"parallelism_config_{k}_size", 1) for k in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    size = {k: count(v, f"parallelism_config_{k}_size", path) for k, v in size.items()}
    if size["cp"] > 1 and size["sp"] > 1:
        raise SeqparError(f"{path}: cp_size {size['cp']} and sp_size {size['sp']} are both > 1; accelerate allows one of them")
    if size["tp"] > 1:
        r.not_understood.append(f"parallelism_config_tp_size {size['tp']} (tensor parallelism)")
    if size["sp"] > 1:
        r.put("mode", CAPS.mode_named("sp_size"), f"parallelism_config_sp_size {size['sp']}")
        r.values["sp_degree"] = size["sp"]
    elif size["cp"] > 1:
        r.put("mode", CAPS.mode_named("cp_size"), f"parallelism_config_cp_size {size['cp']} (torch ring attention)")
        r.values["sp_degree"] = size["cp"]
    elif "mode" not in r.values:  # neither axis (nor a DeepSpeed JSON's Ulysses degree): whole sequences on every rank
        r.put("mode", CAPS.mode_named(""), "no parallelism_config sp_size or cp_size")
        r.values["sp_degree"] = 1
    total = size["dp_replicate"] * size["dp_shard"] * size["tp"] * size["cp"] * size["sp"]
    world = r.values.get("world_size")
    if pc and world and total != world and not (deepspeed and size["sp"] > 1):
        raise SeqparError(
            f"{path}: dp_replicate {size['dp_replicate']} x dp_shard {size['dp_shard']} x tp {size['tp']} x cp {size['cp']} "
            f"x sp {size['sp']} = {total}, but num_processes is {world}; make the product equal num_processes"
        )
    if world and world % max(size["sp"], size["cp"]):
        raise SeqparError(
            f"{path}: the sequence-parallel degree {max(size['sp'], size['cp'])} does not divide num_processes {world}"
        )


__all__ = ["CAPS", "accelerate_config", "files", "read"]
