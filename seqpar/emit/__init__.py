"""Plans handed to the tools users already train with (``seqpar advise --emit TOOL``) and those tools' configs read back
(``seqpar check CONFIG...``, in check.py): accelerate, TRL's SFTTrainer, Axolotl, ArcticTraining, DeepSpeed.

What each tool runs is one table, capabilities.py (``CAPS`` in each tool's module is its row; a mode's own description
says which of a tool's modes it runs for it). One module per tool holds both directions, so a key has one home:
``files(plan, strategy, stem)`` (the config files, the command, what the config leaves to the user) and
``read(data, path)`` (a Reading). Where a tool cannot express a plan's choice, ``emit`` says so in one line per choice
and emits the nearest strategy the tool runs, predicted by the cost model as that strategy; it refuses only when no
strategy the tool has splits the model and the sequence on the plan's cluster. Torch-free, like the advisor.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

from seqpar.emit.capabilities import TABLE, cannot_run, caps
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
    strategy: Strategy  # what the tool runs: the plan's, or the nearest it has
    prediction: Prediction  # the cost model's, for that strategy
    files: dict[Path, str]  # path -> text, written next to the plan
    command: str
    notes: list[str] = field(default_factory=list)  # one line per plan choice the tool changed, and what it leaves to you
    blocked: list[str] = field(default_factory=list)  # why the tool cannot run it on the plan's cluster (capabilities)

    @property
    def fits(self) -> bool:
        return not self.prediction.oom_risk


def emit(plan: LaunchPlan, tool: str, plan_path: str | Path, coeffs=None) -> Emission:
    """The config ``tool`` runs for ``plan`` (whose file is ``plan_path``): the plan's strategy when the tool has every
    choice, else the nearest strategies it runs, the first the cost model predicts to fit (else the nearest)."""
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.predict import predict
    from seqpar.advisor.search import describe
    from seqpar.emit.nearest import nearest

    mod = tool_module(tool)
    if plan.stages:
        raise SeqparError(
            f"--emit {tool} writes one config, and this plan has {len(plan.stages)} stages (--recipe); advise each stage's "
            f"length on its own with --emit"
        )
    c = coeffs or load_coefficients()
    w, cl = plan.workload, plan.cluster
    notes: list[str] = []
    if w.optimizer == "none":
        w = w.model_copy(update={"optimizer": "adamw"})
        notes.append("optimizer none is seqpar's forward+backward benchmark; the tools train, so AdamW is predicted")
    cands = [(s, n, predict(w, cl, s, c)) for s, n in _first(nearest(mod.CAPS, plan.strategy, w, cl), 6)]
    if not cands:
        raise SeqparError(
            f"{tool} runs none of its modes for {plan.workload.model.name} at {plan.workload.seq_len} tokens on "
            f"{cl.world_size} GPUs (the heads or the sequence do not split); use seqpar launch, or another --emit target"
        )
    s, changed, pred = next(((s, n, p) for s, n, p in cands if not p.oom_risk), cands[0])
    if s != plan.strategy:
        notes.append(f"{tool} runs {describe(s)}")
    stem = Path(plan_path).with_suffix("")
    files, command, left = mod.files(plan.model_copy(update={"workload": w}), s, stem)
    blocked = cannot_run(mod.CAPS, s, cl.accelerator, cl.world_size)
    return Emission(tool, s, pred, files, command, notes + changed + left, blocked)


def _first(it, n: int) -> list:
    out = []
    for x in it:
        out.append(x)
        if len(out) == n:
            break
    return out


def write_emission(em: Emission) -> list[Path]:
    """Write the emitted files (each atomically); returns their paths."""
    return [write_atomic(p, text) for p, text in em.files.items()]


def emission_lines(em: Emission) -> list[str]:
    """What the CLI says about an emission: its prediction, each note, the files and the command."""
    p = em.prediction
    verdict = "RISKS OOM" if not em.fits else "CANNOT RUN on this cluster" if em.blocked else "fits"
    head = (
        f"{em.tool}: {verdict}, predicted peak {p.peak_memory_gib:.1f} GiB allocated, {p.reserved_memory_gib:.1f} GiB "
        f"reserved of {p.capacity_gib:.1f} GiB, {p.tokens_per_s:,.0f} tokens/s"
    )
    lines = [head] + [f"note: {n}" for n in em.blocked + em.notes]
    return lines + [f"wrote {p}" for p in em.files] + [f"run: {em.command}"]


__all__ = ["Emission", "TOOLS", "emission_lines", "emit", "tool_module", "write_emission"]
