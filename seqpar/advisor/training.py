"""A plan's training settings: applying those of the command line, and what people are told about them.

``apply_training(plan, overrides)`` puts `seqpar advise --steps/--lr/...` into ``plan.training`` (a recipe keeps its own
steps and RoPE bases per stage). ``training_rows`` is the Training section of `seqpar advise` and `seqpar explain`: the
schedule, the checkpoint interval and how many are kept (the trainer's defaults, seqpar.plan.options), the RoPE base, and a
recipe's stages with their bill. ``rope_warning`` says when the plan trains past the model's positions with the RoPE
base it was trained with.
"""

from __future__ import annotations

from seqpar.advisor.bill import duration, gpu_hours, plan_bill
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan, TrainingSpec
from seqpar.plan.options import interval, kept
from seqpar.plan.units import format_tokens

RECIPE_OWN = {"steps": "--steps", "rope_theta": "--rope-theta"}  # a recipe sets these per stage


def apply_training(plan: LaunchPlan, overrides: dict, recipe: str | None = None) -> LaunchPlan:
    """``plan`` with ``overrides`` (TrainingSpec field -> value) in its training settings, validated; SeqparError naming
    the flag when they contradict each other or the recipe."""
    if not overrides:
        return plan
    if recipe is not None:
        clash = [flag for name, flag in RECIPE_OWN.items() if name in overrides]
        if clash:
            schedule = ", ".join(f"{format_tokens(st.seq_len)}: {st.steps} steps, theta {st.rope_theta:g}" for st in plan.stages)
            raise SeqparError(
                f"{' and '.join(clash)} cannot apply to --recipe {recipe}: the recipe sets each stage's steps and RoPE base "
                f"({schedule}); drop {' and '.join(clash)}, or advise one --seq-len without --recipe"
            )
    t = TrainingSpec.model_validate({**plan.training.model_dump(), **overrides})
    steps = min((st.steps for st in plan.stages), default=t.steps)
    if t.warmup_steps >= steps and "warmup_steps" in overrides:
        raise SeqparError(
            f"--warmup {t.warmup_steps} is not below the {steps} steps of the run (stage): the learning rate would never "
            f"reach its peak; give fewer warmup steps (e.g. --warmup {max(0, steps // 10)}) or more --steps"
        )
    return LaunchPlan.model_validate({**plan.model_dump(), "training": t.model_dump()})


def rope_warning(plan: LaunchPlan) -> str | None:
    """The warning when a sequence goes past the model's max_position_embeddings and the RoPE base stays the model's."""
    m, t = plan.workload.model, plan.training
    if plan.stages or t.rope_theta is not None or plan.workload.seq_len <= m.max_position_embeddings:
        return None
    return (
        f"seq_len {plan.workload.seq_len} ({format_tokens(plan.workload.seq_len)}) is past {m.name}'s "
        f"max_position_embeddings {m.max_position_embeddings} and the plan keeps its RoPE base {m.rope_theta:g}: positions "
        f"beyond {m.max_position_embeddings} are new to the model; raise the base (--rope-theta, e.g. EasyContext's 2.5e8 "
        f"at 512K) or extend in stages (--recipe 1M)"
    )


def training_rows(plan: LaunchPlan) -> list[tuple[str, str]]:
    """The Training section: (label, text) rows."""
    t, m = plan.training, plan.workload.model
    warm = f", {t.warmup_steps} warmup steps" if t.warmup_steps else ", no warmup"
    rows = [
        ("steps", f"{t.steps}" if not plan.stages else "per stage (below)"),
        ("learning rate", f"{t.learning_rate:g} peak, {t.lr_schedule}{warm}"),
        ("weight decay / clip", f"{t.weight_decay:g} / {t.grad_clip:g}" + ("" if t.grad_clip else " (off)")),
        ("seed", str(t.seed)),
    ]
    if not plan.stages:
        _, why = interval(t.checkpoint_every, plan.prediction.step_time_s if plan.prediction else None, t.steps)
        rows.append(("checkpoints", why))
    else:
        rows.append(("checkpoints", _stage_interval(plan)))
    rows.append(("kept", f"the newest {kept(None, t.keep_last)}" if kept(None, t.keep_last) else "all"))
    if plan.stages:
        rows.append(("RoPE base", "per stage (below)"))
    else:
        base = f"{t.rope_theta:g} (model's {m.rope_theta:g})" if t.rope_theta is not None else f"{m.rope_theta:g} (the model's)"
        rows.append(("RoPE base", base))
    warning = rope_warning(plan)
    if warning:
        rows.append(("[bold yellow]warning[/]", warning))
    bill = plan_bill(plan)
    for i, st in enumerate(plan.stages):
        s = st.strategy
        cost = bill.stages[i] if bill else None
        rows.append(
            (
                f"stage {i}",
                f"{format_tokens(st.seq_len)}, RoPE base {st.rope_theta:g}, {st.steps} steps, {s.mode} sp {s.sp_degree}"
                + (f": {duration(cost.wall_s)}, {gpu_hours(cost.gpu_hours)}" if cost else ""),
            )
        )
    return rows


def _stage_interval(plan: LaunchPlan) -> str:
    t = plan.training
    if isinstance(t.checkpoint_every, int):
        return interval(t.checkpoint_every, None)[1]
    every = [interval(None, st.prediction.step_time_s if st.prediction else None)[0] for st in plan.stages]
    if any(n is None for n in every):
        return "about hourly, from each stage's measured step time"
    return "about hourly: every " + ", ".join(map(str, every)) + " steps (stage by stage, from the predicted step times)"


__all__ = ["apply_training", "rope_warning", "training_rows"]
