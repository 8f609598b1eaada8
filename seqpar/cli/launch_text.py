"""What `seqpar launch` tells people around the run (seqpar.cli.launch is the command; seqpar.runtime.launch.run runs it).

Before: the plan's predicted bill (seqpar.advisor.bill: wall time and GPU-hours), and the refusal of a plan whose
prediction says it does not fit (unless --force). After: what the run measured beside what the plan predicted (tokens/s,
peak memory, from each job's run_report.json) and where the exported model is. Torch-free: it reads files and the plan.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from seqpar.plan.errors import SeqparError
from seqpar.plan.jobspec import LaunchOptions, jobs_for
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.units import format_tokens


def bill_header(plan: LaunchPlan, steps: int | None) -> list[str]:
    """The first lines of a launch: the predicted bill of the run (each stage and the whole recipe), or why there is none."""
    from seqpar.advisor.bill import NOT_COUNTED, bill_lines, plan_bill

    bill = plan_bill(plan, steps)
    if bill is None:
        return ["seqpar launch: no predicted bill (the plan has no prediction: advise it with --policy cost)"]
    return [f"seqpar launch: predicted {line}" for line in bill_lines(bill)] + [f"seqpar launch: ({NOT_COUNTED})"]


def oom_verdict(plan: LaunchPlan) -> str | None:
    """One line when the plan's prediction (or a stage's) says it risks running out of memory, else None."""
    parts = [("", plan.workload.seq_len, plan.prediction)]
    parts += [(f"stage {i} ", st.seq_len, st.prediction) for i, st in enumerate(plan.stages)]
    for where, n, p in parts:
        if p is not None and p.oom_risk:
            return (
                f"the plan's {where}prediction says it does not fit: {p.reserved_memory_gib:.1f} GiB reserved per GPU at "
                f"{format_tokens(n)} tokens (peak allocated {p.peak_memory_gib:.1f} GiB) against {p.capacity_gib:.1f} GiB, "
                f"or host RAM is short; seqpar check shows the cheapest fix; pass --force to run it anyway"
            )
    return None


def refuse_fsdp_offload(plan: LaunchPlan) -> None:
    """--fsdp-cpu-offload keeps FSDP2's shards in host RAM: only plans that run FSDP2 have them."""
    s = plan.strategy
    if s.sharding == "fsdp" or (s.sharding.startswith("zero") and plan.cluster.accelerator == "cpu"):
        return
    raise SeqparError(
        f"--fsdp-cpu-offload applies to FSDP2 plans (sharding fsdp); this plan's sharding is {s.sharding!r}"
        + (" (zero3_offload offloads through DeepSpeed)" if s.sharding.startswith("zero") else "")
        + "; advise with --sharding fsdp, or drop the flag"
    )


def refuse_merge_lora(plan: LaunchPlan, final_checkpoint: bool) -> None:
    """--merge-lora merges a LoRA plan's adapters into its final export: a plan without adapters has none to merge,
    and --no-final-checkpoint writes no export."""
    if plan.workload.lora is None:
        raise SeqparError(
            "--merge-lora merges a LoRA plan's adapters into the final export, and this plan trains every parameter "
            "(no workload.lora; its export is the whole model already); advise with --lora-rank, or drop the flag"
        )
    if not final_checkpoint:
        raise SeqparError(
            "--merge-lora writes the merged model into the final checkpoint, which --no-final-checkpoint skips; drop one"
        )


def check_trackers(report_to: str) -> None:
    """SeqparError (exit 2) for a ``--report-to`` name that is unknown or not installed, checked before anything runs
    (seqpar.runtime.train.trackers.parse, torch-free)."""
    from seqpar.runtime.train.trackers import parse

    parse(report_to)


def run_summary(plan: LaunchPlan, plan_path: Path, opts: LaunchOptions) -> list[str]:
    """After a run that ended well: measured vs predicted per job (stage), and where the exported model is."""
    from seqpar.runtime.launch.run import last_checkpoint

    lines = []
    for n, (job, sp) in enumerate(jobs_for(plan, plan_path, opts)):
        head = f"seqpar launch: stage {n}: " if sp is not None else "seqpar launch: "
        path = job.output / "run_report.json"
        try:
            report = json.loads(path.read_bytes()[: 1 << 20])
        except (OSError, ValueError, RecursionError):
            report = None
        if not isinstance(report, dict):  # missing, or no report the ranks wrote: nothing to compare
            lines.append(f"{head}no run report at {path}")
            continue
        m, p = (x if isinstance(x, dict) else {} for x in (report.get("measured"), report.get("predicted")))
        cpu = (sp or plan).cluster.accelerator == "cpu"
        lines.append(f"{head}done, {report.get('steps', '?')} steps; " + "; ".join(_compare(m, p, cpu)))
        last = last_checkpoint(job)
        model = last / "model" if last is not None else None
        adapter = last is not None and (last / "adapter" / "adapter_config.json").is_file()  # a LoRA plan's export
        if adapter:
            lines.append(f"{head}LoRA adapter exported to {last / 'adapter'} (peft's PeftModel.from_pretrained reads it)")
        if model is not None and (model / "config.json").is_file():
            lines.append(f"{head}model exported to {model} (transformers' from_pretrained reads it)")
        elif adapter:
            lines.append(f"{head}no merged model (--merge-lora writes one)")
        elif opts.train.final_checkpoint:
            lines.append(f"{head}no exported model found under {job.output / 'checkpoints'}")
        else:
            lines.append(f"{head}no export (--no-final-checkpoint)")
    return lines


def _compare(measured: dict, predicted: dict, cpu: bool) -> list[str]:
    """tokens/s and peak memory, measured beside predicted. On CPU ranks the measured memory is the process's resident
    set (interpreter, libraries, model), which the prediction (tensors only) does not count: not compared."""
    out = []
    for key, what, fmt in (("tokens_per_s", "tokens/s", "{:,.0f}"), ("peak_memory_gib", "peak GiB allocated", "{:.2f}")):
        m, p = (
            x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None
            for x in (measured.get(key), predicted.get(key))
        )
        if m is None:
            continue
        text = f"{what} {fmt.format(m)} measured"
        if cpu and key == "peak_memory_gib":
            text = f"peak resident memory {fmt.format(m)} GiB (CPU ranks: not compared with the prediction)"
        elif p:
            text += f", {fmt.format(p)} predicted ({m / p - 1:+.0%})"
        out.append(text)
    return out or ["nothing measured"]


__all__ = ["bill_header", "check_trackers", "oom_verdict", "refuse_fsdp_offload", "refuse_merge_lora", "run_summary"]
