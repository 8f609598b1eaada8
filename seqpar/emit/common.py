"""What the tool modules share: the model reference they load, the DeepSpeed JSON both ways, YAML text, and ``Reading``
(what one tool config says, for ``seqpar check CONFIG``).

DeepSpeed JSON keys (deepspeed ``runtime/constants.py`` and ``runtime/zero/config.py``): ``zero_optimization.stage``
0 (no sharding: DDP's replicas), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters); ``offload_param`` /
``offload_optimizer`` ``{"device": "cpu"|"nvme"}``; ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``
(``"auto"`` where the HF Trainer fills them), ``bf16.enabled``, ``sequence_parallel_size`` (Ulysses),
``seq_parallel_communication_data_type`` (default fp32; seqpar's all-to-all runs in the model dtype).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seqpar.emit.capabilities import TABLE, deepspeed_ulysses
from seqpar.plan.errors import SeqparError
from seqpar.plan.jobspec import deepspeed_config
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.specs import ModelSpec, Strategy
from seqpar.plan.units import INT64_MAX

STAGE_OF = {"ddp": 0, "zero2": 2, "zero3": 3, "zero3_offload": 3, "fsdp": 3}


@dataclass
class Reading:
    """What one tool config says about the workload and the strategy, and what seqpar made of each key."""

    kind: str  # the tool: accelerate | trl | axolotl | arctic | deepspeed
    path: Path
    values: dict[str, Any] = field(default_factory=dict)  # Strategy / Workload field names, plus model, world_size, nodes
    used: list[str] = field(default_factory=list)  # "key value" read into the values
    ignored: list[str] = field(default_factory=list)  # keys seqpar does not read (no effect on memory)
    not_understood: list[str] = field(default_factory=list)  # keys that change memory and the cost model does not describe
    notes: list[str] = field(default_factory=list)
    assumed: dict[str, Any] = field(default_factory=dict)  # its seqpar: block (seqpar.emit.assumed), in the values' names

    def put(self, name: str, value, key: str) -> None:
        """Record ``name = value``, read from ``key`` (its value is appended unless ``key`` already says it)."""
        self.values[name] = value
        self.used.append(key if " " in key else f"{key} {value}")


def count(value, key: str, path: Path, *, least: int = 1) -> int:
    """``value`` of ``key`` in the config ``path`` as a whole number from ``least`` to INT64_MAX; SeqparError with one line
    for anything else a YAML or JSON file can hold there: NaN, .inf, a fraction, a negative or zero count, true, text, a
    number no tool could hold. A config that says "fits" for micro-batch NaN would gate nothing."""
    if isinstance(value, int) and not isinstance(value, bool) and least <= value <= INT64_MAX:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > INT64_MAX:
        raise SeqparError(f"{path}: {key} {value} is more than {INT64_MAX} (2**63 - 1), more than any tool holds; fix the file")
    raise SeqparError(f"{path}: {key} {_short(value)} is not a whole number >= {least}; fix the file")


def zero_stage(value, key: str, path: Path) -> int:
    """A DeepSpeed ZeRO stage: 0, 1, 2 or 3 (deepspeed ``runtime/zero/config.py``'s ZeroStageEnum); as text too, where
    accelerate's YAML holds it."""
    if isinstance(value, str) and value.strip() in ("0", "1", "2", "3"):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return value
    raise SeqparError(f"{path}: {key} {_short(value)} is not a ZeRO stage (0, 1, 2 or 3); fix the file")


def _short(value) -> str:
    from seqpar.plan.safe import printable

    return printable(repr(value), limit=60)


def model_ref(spec: ModelSpec) -> tuple[str, str | None]:
    """What a tool loads for the plan's model: its Hub id, else the local path it was read from, else its name (with a
    note: a profile without a repository, like 'tiny', is a shape, not weights)."""
    from seqpar.profiles import hub_id

    repo = hub_id(spec)
    if repo:
        return repo, None
    if Path(spec.name).expanduser().exists():
        p = Path(spec.name)
        return str(p.parent if p.name == "config.json" else p), None
    return spec.name, f"model {spec.name!r} has no Hugging Face repository: set the model key to your model's id or folder"


def yaml_text(data: dict, header: str) -> str:
    """YAML in the order written, one '# ' header line per line of ``header``."""
    import yaml

    comments = "".join(f"# {line}\n" for line in header.splitlines())
    return comments + yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=200)


def ds_config(plan: LaunchPlan, s: Strategy, *, sp_key: bool) -> dict:
    """The DeepSpeed JSON for ``s`` on ``plan``'s workload: seqpar launch's ZeRO settings (jobspec.deepspeed_config),
    stage 0 for ddp; ``sp_key``: also ``sequence_parallel_size`` (a plain deepspeed launch; accelerate, the HF Trainer and
    ArcticTraining set it themselves)."""
    ds = deepspeed_config(plan.model_copy(update={"strategy": s}))  # model_copy: the tool's strategy, not seqpar's rules
    ds.pop("steps_per_print", None)  # seqpar's own trainer logs; the tools keep DeepSpeed's default
    ds["zero_optimization"]["stage"] = STAGE_OF[s.sharding]
    if s.sharding == "ddp":
        ds["zero_optimization"] = {"stage": 0}
    if deepspeed_ulysses(s):
        ds["seq_parallel_communication_data_type"] = plan.workload.dtype
        if sp_key:
            ds["sequence_parallel_size"] = s.sp_degree
    return ds


def trainer_ds(plan: LaunchPlan, s: Strategy) -> dict:
    """ds_config for the HF Trainer (TRL, Axolotl): "auto" where the Trainer fills the value from its own arguments (it
    refuses a mismatch), and DeepSpeed's AdamW where the optimizer states live in host RAM (a torch optimizer is refused
    over offloaded states; DeepSpeed then runs its CPU Adam)."""
    ds = ds_config(plan, s, sp_key=False)
    ds |= {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    if s.sharding == "zero3_offload":
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    return ds


def read_ds(r: Reading, ds: dict, prefix: str = "") -> None:
    """The sharding, batch sizes, dtype and Ulysses degree a DeepSpeed config sets, into ``r``."""
    z = ds.get("zero_optimization") or {}
    if not isinstance(z, dict):
        z = {}
    stage = zero_stage(z.get("stage", 0), f"{prefix}zero_optimization.stage", r.path)
    dev = {
        k: (z.get(k) or {}).get("device", "none") if isinstance(z.get(k), dict) else "none"
        for k in ("offload_param", "offload_optimizer")
    }
    if stage == 3 and dev["offload_param"] == "cpu":
        r.put("sharding", "zero3_offload", f"{prefix}zero_optimization stage 3, offload_param cpu")
        if dev["offload_optimizer"] != "cpu":
            r.not_understood.append(f"{prefix}offload_param cpu without offload_optimizer cpu (predicted as both offloaded)")
    else:
        r.put("sharding", {0: "ddp", 1: "zero2", 2: "zero2", 3: "zero3"}[stage], f"{prefix}zero_optimization stage {stage}")
        if stage == 1:
            r.not_understood.append(f"{prefix}zero_optimization stage 1 (gradients not sharded; predicted as stage 2)")
        if dev["offload_optimizer"] != "none":
            r.not_understood.append(
                f"{prefix}offload_optimizer {dev['offload_optimizer']} at stage {stage} (predicted on the GPU)"
            )
    if "nvme" in dev.values():
        r.not_understood.append(f"{prefix}offload to nvme (predicted as cpu)")
    for key, name in (
        ("train_micro_batch_size_per_gpu", "micro_batch_size"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    ):
        if ds.get(key) not in (None, "auto"):  # "auto": the HF Trainer fills it from its own arguments
            r.put(name, count(ds[key], f"{prefix}{key}", r.path), f"{prefix}{key} {ds[key]}")
    for dt in ("bf16", "fp16"):
        if isinstance(ds.get(dt), dict) and ds[dt].get("enabled") is True:
            r.put("dtype", dt, f"{prefix}{dt}.enabled")
    sp = ds.get("sequence_parallel_size")
    sp = 1 if sp is None else count(sp, f"{prefix}sequence_parallel_size", r.path)
    if sp > 1:
        r.put("mode", TABLE["deepspeed"].mode_named("sequence_parallel_size"), f"{prefix}sequence_parallel_size {sp}")
        r.values["sp_degree"] = sp


def load_json(path: Path, what: str) -> dict:
    from seqpar.plan.files import read_json_object

    return read_json_object(
        path, what, "config", missing_fix="check the path", invalid_fix="fix the file", finite=True, int_max=INT64_MAX
    )


def dump_json(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"


__all__ = [
    "Reading",
    "STAGE_OF",
    "count",
    "ds_config",
    "dump_json",
    "load_json",
    "model_ref",
    "read_ds",
    "trainer_ds",
    "yaml_text",
    "zero_stage",
]
