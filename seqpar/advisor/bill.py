"""The predicted bill of a plan: wall time and GPU-hours of the whole run (each stage of a recipe, and all of them).

wall = the predicted first step + (steps - 1) x the predicted warm step time (plan.prediction.first_step_s and
step_time_s, per stage for staged plans: each stage starts a new process, so each pays a first step), GPU-hours = wall x
the GPUs of the cluster (every GPU is held for the whole run). Training steps only: start-up (model build), checkpoint
writes and evaluation come on top. EasyContext's 1M recipe (7 stages) on 8x A100-80G comes to about
143 h and 1,143 GPU-hours. Plans without a prediction (``--policy rules``) have no bill. Shown by ``seqpar advise``,
``seqpar explain`` and the first lines of ``seqpar launch``.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.units import format_tokens


@dataclass(frozen=True)
class StageBill:
    label: str  # "run", or "stage i"
    seq_len: int
    steps: int
    step_time_s: float
    wall_s: float
    gpu_hours: float
    first_step_s: float = 0.0  # the first step (warm step + its one-off costs), included in wall_s


@dataclass(frozen=True)
class Bill:
    stages: tuple[StageBill, ...]  # one for a plain plan
    gpus: int
    cpu: bool = False  # gloo CPU ranks: the "GPUs" are processes

    @property
    def wall_s(self) -> float:
        return sum(s.wall_s for s in self.stages)

    @property
    def gpu_hours(self) -> float:
        return sum(s.gpu_hours for s in self.stages)


def plan_bill(plan: LaunchPlan, steps: int | None = None) -> Bill | None:
    """The bill of ``plan`` (``steps``: seqpar launch --steps, per stage for staged plans); None without predictions."""
    gpus = plan.cluster.world_size
    if plan.stages:
        parts = [(f"stage {i}", st.seq_len, steps or st.steps, st.prediction) for i, st in enumerate(plan.stages)]
    else:
        parts = [("run", plan.workload.seq_len, steps or plan.training.steps, plan.prediction)]
    if any(p is None for *_, p in parts):
        return None
    out = []
    for label, seq_len, n, p in parts:
        first = p.first_step_s if p.first_step_s is not None else p.step_time_s  # older plans: a warm step
        wall = first + (n - 1) * p.step_time_s if n > 0 else 0.0
        out.append(StageBill(label, seq_len, n, p.step_time_s, wall, wall * gpus / 3600.0, first))
    return Bill(tuple(out), gpus, plan.cluster.accelerator == "cpu")


def duration(seconds: float) -> str:
    """A wall time people read: seconds, minutes, hours, and days beyond two."""
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    hours = f"{seconds / 3600:,.1f} h"
    return hours if seconds < 48 * 3600 else f"{hours} ({seconds / 86400:.1f} days)"


def gpu_hours(h: float, unit: str = "GPU-hours") -> str:
    return f"{h:,.0f} {unit}" if h >= 10 else f"{h:.2g} {unit}"


def bill_lines(bill: Bill) -> list[str]:
    """One line per stage (staged plans) and the total: steps x step time = wall time, GPU-hours on the cluster's GPUs."""
    noun = ("CPU rank" if bill.cpu else "GPU") + ("" if bill.gpus == 1 else "s")
    unit, on = ("rank-hours" if bill.cpu else "GPU-hours"), f"{bill.gpus} {noun}"
    lines = []
    for s in bill.stages:
        head = f"{s.label} ({format_tokens(s.seq_len)}): " if len(bill.stages) > 1 else ""
        # the first step's one-off costs, said only where they show at the precision printed
        first = f" (the first {s.first_step_s:.3g} s)" if f"{s.first_step_s:.3g}" != f"{s.step_time_s:.3g}" else ""
        lines.append(
            f"{head}{s.steps} steps x {s.step_time_s:.3g} s{first} = {duration(s.wall_s)}, {gpu_hours(s.gpu_hours, unit)} on {on}"
        )
    if len(bill.stages) > 1:
        lines.append(f"whole recipe: {duration(bill.wall_s)}, {gpu_hours(bill.gpu_hours, unit)} on {on}")
    return lines


NOT_COUNTED = "training steps only: start-up, checkpoint writes and evaluation come on top"

__all__ = ["Bill", "NOT_COUNTED", "StageBill", "bill_lines", "duration", "gpu_hours", "plan_bill"]
