"""``seqpar check CONFIG...``: the OOM gate for the configs accelerate, TRL, Axolotl, ArcticTraining and DeepSpeed run.

Each file's kind is told from its keys (``detect``), each is read by its tool's module into a Reading, and the readings
of one launch are merged (TRL's arguments over the accelerate YAML over the DeepSpeed JSON it names). What no tool key
says comes from the flags given (--seq-len, --model, --gpu/--gpus, the pins), else from the files' ``seqpar:`` block
(what ``--emit`` predicted with, seqpar.emit.assumed: so its files check back to its prediction with no flags), else from
a default (a plain transformers script's: no checkpointing, full logits; the probe's or the default GPU); each default is
one "assumed:" line. ``use_cpu`` (accelerate, TRL) makes the ranks gloo CPU ranks, as ``--cluster cpu:N``. The result
is predicted as seqpar's strategy and judged like a plan; when it does not fit, the cheapest fix is the fastest single
change the TOOL can write (seqpar.emit.nearest.expressible), named in its own keys. LoRA and QLoRA keys are read into the
workload (seqpar.emit.lora); keys that change memory and that the cost model does not describe (DoRA, 8-bit bases,
tensor parallelism, other optimizers) make the verdict partial and are named; other unknown keys are ignored and listed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from seqpar.emit import tool_module
from seqpar.emit.common import Reading
from seqpar.plan.errors import SeqparError
from seqpar.plan.files import MAX_JSON_BYTES, read_bounded, read_json_object
from seqpar.plan.launch_plan import LaunchPlan, Prediction
from seqpar.plan.safe import printable
from seqpar.plan.specs import Strategy
from seqpar.plan.units import INT64_MAX, MAX_INT_DIGITS

COMBOS = ({"trl", "accelerate", "deepspeed"}, {"axolotl"}, {"arctic"})
ORDER = ("deepspeed", "accelerate", "trl", "axolotl", "arctic")  # later readings take precedence
SCRIPT_DEFAULTS = {"mode": "data_parallel", "sp_degree": 1, "sharding": "ddp", "checkpointing": "none", "loss_impl": "hf"}
SCRIPT_DEFAULTS |= {"fused_ops": "none", "tiled_mlp": False, "gradient_accumulation_steps": 1}


# A YAML alias repeats its anchor's value without copying it, so a file of a few lines can describe a value of billions
# (the "billion laughs"); a reader that prints a key's value (a partial verdict names it) would then spell them all out.
# A tool's config is some hundreds of values once its aliases are spelled out.
MAX_YAML_VALUES = 100_000


def load_config(path: Path) -> dict:
    """A JSON or YAML mapping; SeqparError with one line for a missing, oversized, malformed or non-mapping file, one
    with a number no value can be (over MAX_INT_DIGITS digits, NaN in JSON), or YAML whose aliases spell out more than
    MAX_YAML_VALUES values."""
    fix = "pass a plan or an accelerate/TRL/Axolotl/ArcticTraining/DeepSpeed config"
    if path.suffix == ".json":
        return read_json_object(
            path, "config", "config", missing_fix=fix, invalid_fix="fix the file", finite=True, int_max=INT64_MAX
        )
    import yaml

    text = read_bounded(path, "config", fix, MAX_JSON_BYTES).decode("utf-8", errors="replace")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        values = _spelled_out(node)
        if values > MAX_YAML_VALUES:
            raise SeqparError(
                f"config {_shown(path)} spells out {'endlessly many' if values == math.inf else f'over {values:,}'} values "
                f"through its YAML aliases (*name), more than the {MAX_YAML_VALUES:,} a tool's config holds; fix the file"
            )
        data = loader.construct_document(node) if node is not None else None
    except SeqparError:
        raise
    except RecursionError:  # a hostile file nests thousands of levels deep
        raise SeqparError(f"config {_shown(path)} nests too deeply to be a config; fix the file") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f"line {where.line + 1}: " if where is not None else ""
        raise SeqparError(
            f"config {_shown(path)} is not valid YAML ({line}{getattr(e, 'problem', None) or e}); fix the file"
        ) from None
    except ValueError as e:  # Python's int() past 4300 digits ("Exceeds the limit"), a date such as 2024-13-45
        what = (
            f"an integer of over 4300 digits (no value seqpar reads has more than {MAX_INT_DIGITS})"
            if "Exceeds the limit" in str(e)
            else f"a value YAML cannot read ({printable(str(e), 60)})"
        )
        raise SeqparError(f"config {_shown(path)} holds {what}; fix the file") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise SeqparError(f"config {_shown(path)} holds a {type(data).__name__}, not a mapping of keys")
    return data


def _spelled_out(root) -> float:
    """How many values the YAML node graph ``root`` holds with every alias spelled out (a node reached twice counts
    twice); inf for an alias inside its own anchor. Walked without recursion, each node's count computed once."""
    if root is None:
        return 0
    total: dict[int, float] = {}
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in total and not done:
            continue
        kids = _children(node)
        if not done:
            total[id(node)] = math.inf  # in progress: an alias to it from below is a cycle
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in total)
        else:
            total[id(node)] = 1 + sum(total[id(k)] for k in kids)
            if total[id(node)] > MAX_YAML_VALUES:
                return total[id(node)]
    return total[id(root)]


def _children(node) -> list:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return []


def _shown(path: Path) -> str:
    return repr(printable(str(path)))


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
        data = json.loads(read_bounded(path, "config", "", MAX_JSON_BYTES))
    except (OSError, ValueError, RecursionError, SeqparError):  # the plan gate names what is wrong with it
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
    defaults: list[str] = field(default_factory=list)  # "given: ..." / "assumed: ...", a line per value no file said
    fix: str = ""
    fix_keys: list[str] = field(default_factory=list)
    fix_strategy: Strategy | None = None
    emitted: dict = field(default_factory=dict)  # what --emit predicted, as the files' seqpar: block records it

    @property
    def fits(self) -> bool:
        return not self.prediction.oom_risk

    @property
    def not_understood(self) -> list[str]:
        return [f"{r.path.name}: {k}" for r in self.readings for k in r.not_understood]

    @property
    def blocked(self) -> list[str]:
        """Why the tool cannot run these configs on their cluster (capabilities.cannot_run); [] where it can."""
        from seqpar.emit.capabilities import TABLE, cannot_run

        cl = self.plan.cluster
        return cannot_run(TABLE[self.tool], self.plan.strategy, cl.accelerator, cl.world_size)

    @property
    def ignored(self) -> list[str]:
        return [f"{r.path.name}: {k}" for r in self.readings for k in r.ignored]


def read_all(paths: list[Path]) -> list[Reading]:
    readings = []
    for p in paths:
        data = load_config(p)
        block = _block(p, data)
        kind = detect(data, p)
        if kind == "plan":
            raise SeqparError(f"{p} is a seqpar plan: check it on its own (seqpar check {p}), not with tool configs")
        try:
            readings.append(tool_module(kind).read(data, p))
        except SeqparError:
            raise
        except (TypeError, AttributeError, ValueError) as e:  # a key holding a list where a number belongs, ...
            raise SeqparError(f"{p}: a key holds a value of the wrong type for {kind} ({e}); fix the file") from None
        readings[-1].assumed = block
    kinds = [r.kind for r in readings]
    if len(set(kinds)) != len(kinds) or not any(set(kinds) <= c for c in COMBOS):
        raise SeqparError(
            f"check one launch's configs at a time: TRL arguments with its accelerate YAML and DeepSpeed JSON, or one "
            f"Axolotl or ArcticTraining YAML (got {', '.join(f'{r.path.name} ({r.kind})' for r in readings)})"
        )
    return sorted(readings, key=lambda r: ORDER.index(r.kind))


def _block(path: Path, data: dict) -> dict:
    """The file's seqpar: block (seqpar.emit.assumed), validated; a JSON file's "seqpar" key is taken out of ``data`` so
    the tool's reader does not list it as a key it ignores."""
    from seqpar.emit.assumed import KEY, block_of_yaml, validated

    if path.suffix == ".json":
        raw = data.pop(KEY, None)
        return {} if raw is None else validated(raw, str(path))
    text = read_bounded(path, "config", "", MAX_JSON_BYTES).decode("utf-8", errors="replace")
    try:
        raw = block_of_yaml(text)
    except SeqparError as e:
        raise SeqparError(f"{path}: {e}") from None
    return validated(raw, str(path)) if raw else {}


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


def merge_assumed(readings: list[Reading]) -> dict:
    """The readings' seqpar: blocks, later over earlier (ORDER)."""
    out: dict = {}
    for r in readings:
        out |= r.assumed
    return out


__all__ = ["COMBOS", "ConfigCheck", "detect", "is_plan_file", "load_config", "merge", "merge_assumed", "read_all"]
