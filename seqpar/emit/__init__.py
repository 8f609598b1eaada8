"""Plans handed to the tools users already train with (``seqpar advise --emit TOOL``) and those tools' configs read back
(``seqpar check CONFIG...``, in check.py): accelerate, TRL's SFTTrainer, Axolotl, ArcticTraining, DeepSpeed.

What each tool runs is one table, capabilities.py (``CAPS`` in each tool's module is its row; a mode's own description
says which of a tool's modes it runs for it). One module per tool holds both directions, so a key has one home:
``files(plan, strategy, stem)`` (the config files, the command, what the config leaves to the user) and
``read(data, path)`` (a Reading). ``emit`` searches the tool's own space (space.py: the advisor's search with the
tool's row pinned and filtered) for the fastest strategy that fits, says in one line per choice what the tool lacks and
what the cost model re-picked, and writes the files with what the prediction assumed (assumed.py), so that ``seqpar
check`` on them predicts the same with no flags. Where nothing the tool expresses fits, it writes no tool files and
names the binding constraint (the plan itself is the CLI's to write, whatever the outcome). Torch-free, like the advisor.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from seqpar.emit.assumed import KEY, assumptions, with_block
from seqpar.emit.capabilities import TABLE, Unsupported, cannot_run, caps
from seqpar.emit.common import dump_json
from seqpar.plan.errors import SeqparError
from seqpar.plan.files import write_atomic
from seqpar.plan.launch_plan import LaunchPlan, Prediction
from seqpar.plan.specs import Strategy

TOOLS = tuple(TABLE)  # accelerate, trl, axolotl, arctic, deepspeed


def tool_module(tool: str):
    caps(tool)  # SeqparError naming the tools for an unknown one
    return importlib.import_module(f"seqpar.emit.{tool}")


@dataclass
class Emission:
    tool: str
    strategy: Strategy | None  # what the tool runs: the best it expresses (None: nothing it expresses splits the model)
    prediction: Prediction | None  # the cost model's, for that strategy
    files: dict[Path, str]  # path -> text, written next to the plan (none when nothing the tool expresses fits)
    command: str
    notes: list[str] = field(default_factory=list)  # one line per plan choice the tool changed, and what it leaves to you
    blocked: list[str] = field(default_factory=list)  # why the tool cannot run it on the plan's cluster (capabilities)
    refused: str = ""  # why no files: nothing the tool expresses fits (the binding constraint), or none is valid

    @property
    def fits(self) -> bool:
        return self.prediction is not None and not self.prediction.oom_risk and not self.refused


def emittable(plan: LaunchPlan, tool: str) -> None:
    """SeqparError (a usage error, before anything is written) for an emission no outcome can have."""
    tool_module(tool)
    from seqpar.emit.lora import cannot_express

    why = cannot_express(tool, plan.workload.lora)
    if why:
        raise SeqparError(f"--emit {tool}: {why}")
    if plan.stages:
        raise SeqparError(
            f"--emit {tool} writes one config, and this plan has {len(plan.stages)} stages (--recipe); advise each stage's "
            f"length on its own with --emit"
        )


def emit(plan: LaunchPlan, tool: str, plan_path: str | Path, coeffs=None, pins: dict | None = None) -> Emission:
    """The config ``tool`` runs for ``plan`` (whose file is ``plan_path``): the fastest strategy the tool expresses that
    fits the plan's workload on its cluster (seqpar.emit.space), with the files carrying what the prediction assumed
    (seqpar.emit.assumed). ``pins``: the request's pinned choices (seqpar.emit.space.PINS), honoured where the tool
    has them; None: what the plan implies (space.plan_pins). Nothing fits: no files, and ``refused`` says why."""
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.predict import predict
    from seqpar.emit.space import plan_pins, search

    emittable(plan, tool)
    mod = tool_module(tool)
    c = coeffs or load_coefficients()
    w, cl = plan.workload, plan.cluster
    notes: list[str] = []
    if w.optimizer == "none":
        w = w.model_copy(update={"optimizer": "adamw"})
        notes.append("optimizer none is seqpar's forward+backward benchmark; the tools train, so AdamW is predicted")
    from seqpar.emit.lora import tool_workload

    w, why = tool_workload(tool, w)  # how the tool keeps the adapters, where it differs from the plan
    notes += [why] if why else []
    try:
        found = search(mod.CAPS, plan, w, plan_pins(plan) if pins is None else pins, c)
    except Unsupported as e:  # a pinned mode the tool has no equivalent of
        return Emission(tool, None, None, {}, "", notes, refused=str(e).split("; use ")[0])
    if found.strategy is None:
        return Emission(tool, None, None, {}, "", notes, refused=found.refused)
    s, pred = found.strategy, predict(w, cl, found.strategy, c, **mod.CAPS.runtime())  # priced as the tool runs it
    blocked = cannot_run(mod.CAPS, s, cl.accelerator, cl.world_size)
    stem = Path(plan_path).with_suffix("")
    files, command, left = mod.files(plan.model_copy(update={"workload": w}), s, stem)
    if not found.fits:  # what the nearest would have left to the script is said all the same
        return Emission(tool, s, pred, {}, "", notes + found.notes + left, blocked, refused=found.refused)
    files = _with_assumptions(files, assumptions(w, cl, s, pred), tool)
    if cl.accelerator == "cuda":
        # the cost model's OOM gate assumes the caching allocator's expandable segments, as seqpar launch sets them:
        # the default allocator fragments at long lengths and fails before the tensors' sum reaches the capacity
        command = f"{ALLOC_ENV} {command}"
    return Emission(tool, s, pred, files, command, notes + found.notes + left, blocked)


ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def _with_assumptions(files: dict[Path, str], assumed: dict, tool: str) -> dict[Path, str]:
    """The files with a seqpar: block of what the prediction assumed and the tool's keys do not say: the files are read
    back by the tool's own readers (as seqpar check reads them) and whatever they set is left out of the block. Every
    YAML of the launch carries the block; a launch of one DeepSpeed JSON carries it as its "seqpar" key."""
    import tempfile

    from seqpar.emit.check import merge, read_all

    with tempfile.TemporaryDirectory(prefix="seqpar-emit-") as tmp:
        here = {p: Path(tmp) / p.name for p in files}
        for p, text in files.items():
            for q in files:  # a file named in another (accelerate's deepspeed_config_file): this copy, not an older one
                text = text.replace(str(q), str(here[q]))
            here[p].write_text(text)
        said = merge(read_all([here[p] for p in files if not p.name.endswith(".ds_config.json")]))
    block = {k: v for k, v in assumed.items() if k not in said}
    out = {}
    yamls = [p for p in files if p.suffix == ".yaml"]
    for p, text in files.items():
        if p in yamls:
            text = with_block(text, block, tool)
        elif not yamls and p.suffix == ".json":
            text = dump_json(json.loads(text) | {KEY: block})
        out[p] = text
    return out


def write_emission(em: Emission) -> list[Path]:
    """Write the emitted files (each atomically); returns their paths."""
    return [write_atomic(p, text) for p, text in em.files.items()]


def emission_lines(em: Emission) -> list[str]:
    """What the CLI says about an emission: its prediction, each note, the files and the command (where it has files)."""
    lines = []
    p = em.prediction
    if p is not None:
        verdict = "RISKS OOM" if p.oom_risk else "CANNOT RUN on this cluster" if em.blocked else "fits"
        lines.append(
            f"{em.tool}: {verdict}, predicted peak {p.peak_memory_gib:.1f} GiB allocated, {p.reserved_memory_gib:.1f} GiB "
            f"reserved of {p.capacity_gib:.1f} GiB, {p.tokens_per_s:,.0f} tokens/s"
        )
    lines += [f"note: {n}" for n in em.blocked + em.notes]
    if not em.files:
        return lines
    return lines + [f"wrote {p}" for p in em.files] + [f"run: {em.command}"]


def refusal_line(em: Emission, plan_path: str | Path) -> str:
    """The one line that ends an emission with no files: the binding constraint, and what was written instead."""
    return f"--emit {em.tool}: {em.refused}; wrote {plan_path} only, no {em.tool} files (seqpar launch {plan_path} runs the plan)"


__all__ = ["Emission", "TOOLS", "emission_lines", "emit", "emittable", "refusal_line", "tool_module", "write_emission"]
