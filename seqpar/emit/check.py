"""``seqpar check CONFIG...``: the OOM gate for the configs accelerate, TRL, Axolotl, ArcticTraining and DeepSpeed run.

Each file's kind is told from its keys (``detect``), each is read by its tool's module into a Reading, and the readings
of one launch are merged (TRL's arguments over the accelerate YAML over the DeepSpeed JSON it names). What no file says
comes from the flags (--seq-len, --model, --gpu/--gpus, the pins), else from the default of a plain transformers script
(no checkpointing, full logits); every such value is listed. The result is predicted as seqpar's strategy and judged
like a plan; when it does not fit, the cheapest fix is the fastest single change the TOOL can write (seqpar.emit.nearest's
table), named in its own keys. Keys that change memory and that the cost model does not describe (LoRA, quantization,
tensor parallelism, other optimizers) make the verdict partial and are named; other unknown keys are ignored and listed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from seqpar.emit import tool_module
from seqpar.emit.common import Reading
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan, Prediction
from seqpar.plan.specs import Strategy

COMBOS = ({"trl", "accelerate", "deepspeed"}, {"axolotl"}, {"arctic"})
ORDER = ("deepspeed", "accelerate", "trl", "axolotl", "arctic")  # later readings take precedence
SCRIPT_DEFAULTS = {"mode": "data_parallel", "sp_degree": 1, "sharding": "ddp", "checkpointing": "none", "loss_impl": "hf"}
SCRIPT_DEFAULTS |= {"fused_ops": "none", "tiled_mlp": False, "gradient_accumulation_steps": 1}


def load_config(path: Path) -> dict:
    """A JSON or YAML mapping; SeqparError with one line for a missing, malformed or non-mapping file."""
    import yaml

    if not path.is_file():
        raise SeqparError(
            f"config {str(path)!r} does not exist; pass a plan or an accelerate/TRL/Axolotl/ArcticTraining/DeepSpeed config"
        )
    text = path.read_text(errors="replace")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except RecursionError:  # a hostile file nests thousands of levels deep
        raise SeqparError(f"config {str(path)!r} nests too deeply to be a config; fix the file") from None
    except json.JSONDecodeError as e:
        raise SeqparError(f"config {str(path)!r} is not valid JSON ({e}); fix the file") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f"line {where.line + 1}: " if where is not None else ""
        raise SeqparError(
            f"config {str(path)!r} is not valid YAML ({line}{getattr(e, 'problem', None) or e}); fix the file"
        ) from None
    if not isinstance(data, dict):
        raise SeqparError(f"config {str(path)!r} holds a {type(data).__name__}, not a mapping of keys")
    return data


def detect(data: dict, path: Path) -> str:
    """plan | accelerate | trl | axolotl | arctic | deepspeed, from the keys only that tool's config has."""
    if "schema_version" in data or {"workload", "strategy"} <= set(data):
        return "plan"
    if "distributed_type" in data or "compute_environment" in data:
        return "accelerate"
    if "base_model" in data:
        return "axolotl"
    if isinstance(data.get("model"), dict) and isinstance(data.get("data"), dict):
        return "arctic"
    if "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data:
        return "deepspeed"
    trl_keys = ("max_length", "max_seq_length", "per_device_train_batch_size", "model_name_or_path", "output_dir")
    if any(k in data for k in trl_keys):
        return "trl"
    raise SeqparError(
        f"config {str(path)!r} is none seqpar reads: not a plan, nor an accelerate (distributed_type), TRL (max_length, "
        f"per_device_train_batch_size), Axolotl (base_model), ArcticTraining (model + data) or DeepSpeed (zero_optimization) config"
    )


def is_plan_file(path: Path) -> bool:
    """Does ``seqpar check PATH`` mean a plan (the plan gate's own messages for a broken one), not a tool config?"""
    if path.suffix != ".json":
        return False
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # the plan gate names what is wrong with it
        return True
    return not isinstance(data, dict) or detect_or_none(data) in (None, "plan")


def detect_or_none(data: dict) -> str | None:
    try:
        return detect(data, Path("-"))
    except SeqparError:
        return None


@dataclass
class ConfigCheck:
    readings: list[Reading]
    tool: str  # whose capabilities judge the fix: trl when TRL's arguments are among the files
    plan: LaunchPlan  # the configs as a (not validated) plan: workload, cluster, strategy
    prediction: Prediction
    reason: str
    defaults: list[str] = field(default_factory=list)  # "field value (where from)" for what no file said
    fix: str = ""
    fix_keys: list[str] = field(default_factory=list)
    fix_strategy: Strategy | None = None

    @property
    def fits(self) -> bool:
        return not self.prediction.oom_risk

    @property
    def not_understood(self) -> list[str]:
        return [f"{r.path.name}: {k}" for r in self.readings for k in r.not_understood]

    @property
    def ignored(self) -> list[str]:
        return [f"{r.path.name}: {k}" for r in self.readings for k in r.ignored]


def read_all(paths: list[Path]) -> list[Reading]:
    readings = []
    for p in paths:
        data = load_config(p)
        kind = detect(data, p)
        if kind == "plan":
            raise SeqparError(f"{p} is a seqpar plan: check it on its own (seqpar check {p}), not with tool configs")
        try:
            readings.append(tool_module(kind).read(data, p))
        except (TypeError, AttributeError, ValueError) as e:  # a key holding a list where a number belongs, ...
            raise SeqparError(f"{p}: a key holds a value of the wrong type for {kind} ({e}); fix the file") from None
    kinds = [r.kind for r in readings]
    if len(set(kinds)) != len(kinds) or not any(set(kinds) <= c for c in COMBOS):
        raise SeqparError(
            f"check one launch's configs at a time: TRL arguments with its accelerate YAML and DeepSpeed JSON, or one "
            f"Axolotl or ArcticTraining YAML (got {', '.join(f'{r.path.name} ({r.kind})' for r in readings)})"
        )
    return sorted(readings, key=lambda r: ORDER.index(r.kind))


def merge(readings: list[Reading]) -> dict:
    """Later readings over earlier ones (ORDER), except checkpointing: either the Trainer's arguments or accelerate's
    fsdp_activation_checkpointing turns it on (TRL's docs set one of them under FSDP), so any reading's 'on' counts."""
    values: dict = {}
    for r in readings:
        values |= r.values
    on = [r.values["checkpointing"] for r in reversed(readings) if r.values.get("checkpointing", "none") != "none"]
    if on:
        values["checkpointing"] = on[0]
    return values


__all__ = ["COMBOS", "ConfigCheck", "detect", "is_plan_file", "load_config", "merge", "read_all"]
