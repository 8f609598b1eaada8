"""The work behind ``seqpar eval`` (the commands in seqpar.cli.eval only offer options): check the inputs, print the
advisor's forward-only prediction, start seqpar.runtime.eval.run on every rank with torchrun (seqpar.plan.jobspec.eval_job, the
environment of a launch), then show the report the ranks wrote (seqpar.runtime.eval.show).

Order: what needs no torch first (the plan, the model folder, every length's split), then the prediction, then the
checks that read data or a tokenizer (seqpar.runtime.eval.run.preflight) and the machine; nothing starts, and nothing is
written, unless all of them pass. A bad input is one line and exit code 2 (SeqparError), as everywhere in seqpar.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from seqpar.plan.errors import SeqparError
from seqpar.plan.extras import MissingExtra
from seqpar.plan.files import write_atomic
from seqpar.plan.job_options import EvalJobOptions
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.safe import inside, printable, read_bytes
from seqpar.plan.specs import check_strategy_shape
from seqpar.plan.units import format_tokens

PLOTS = {"perplexity": "loss_by_position.png", "needle": "needle_heatmap.png"}


@dataclass(frozen=True)
class EvalOptions:
    """What seqpar eval does around the job (the job's own options: seqpar.plan.job_options.EvalJobOptions)."""

    output: Optional[Path] = None
    json_out: bool = False
    plot: Optional[Path] = None
    max_seq_len: bool = False
    force: bool = False


def resolve_model_path(path: str | None) -> str | None:
    """A local model folder: one holding config.json, or seqpar launch's output (its latest checkpoint's model/) or one
    of its checkpoints (step-N/model/). SeqparError otherwise; Hub ids are not fetched."""
    if not path:
        return None
    p = Path(path)
    candidates = [p, p / "model"]
    latest = p / "checkpoints" / "latest"
    if latest.is_file() or latest.is_symlink():  # a run folder: data from whoever wrote it, read as such
        name = read_bytes(latest, what="checkpoints/latest", limit=4096).decode("utf-8", "replace").strip()
        step = p / "checkpoints" / name
        if not re.fullmatch(r"step-\d{1,12}", name) or not inside(p / "checkpoints", step):
            raise SeqparError(
                f"{str(latest)!r} names {printable(name)!r}, not a checkpoint folder beside it; it was not written by "
                "seqpar launch: pass the checkpoint's model folder (checkpoints/step-N/model) as --model-path"
            )
        candidates.append(step / "model")
    for c in candidates:
        if (c / "config.json").is_file():
            return str(c)
    raise SeqparError(
        f"--model-path {path!r} is not a local model folder (no config.json in it, nor in a seqpar run's latest checkpoint); "
        f"pass a transformers folder or seqpar launch's checkpoints/step-N/model (Hub ids are not fetched)"
    )


def check_this_machine(plan: LaunchPlan, plan_path: Path, nnodes: int | None = None) -> None:
    """SeqparError when the plan's cluster is not this machine (probed through NVML): the check of seqpar launch, verify
    and eval (``nnodes``: the job's nodes, default the plan's)."""
    from seqpar.advisor.probe import probe as run_probe
    from seqpar.runtime.launch.run import check_machine

    res = run_probe()
    matched = res.matched_gpu()
    diffs = check_machine(
        plan.cluster,
        gpu_names=[g.name for g in res.gpus],
        gpu_profile=matched.name if matched else None,
        cpu_count=os.cpu_count() or 1,
        nnodes=nnodes or plan.cluster.nodes,
    )
    if diffs:
        raise SeqparError(
            f"plan {str(plan_path)!r} does not match this machine: {'; '.join(diffs)}; "
            f"advise a plan here (seqpar advise ...) or pass --force"
        )


def run_eval(plan_path: Path, job: EvalJobOptions, o: EvalOptions, note: Callable[[str], None]) -> tuple[int, dict | None]:
    """(exit status, report): the longest evaluable length alone with --max-seq-len (report {"max_eval_seq_len": N}),
    else the job's exit status and, when it succeeded, the report it wrote. ``job.seq_len`` empty: the plan's."""
    from seqpar.advisor.cost.evaluate import max_eval_seq_len, predict_eval
    from seqpar.profiles import model_from_config
    from seqpar.runtime.eval.show import prediction_lines

    plan = LaunchPlan.load(plan_path)
    s, cl = plan.strategy, plan.cluster
    task, model_path = job.task, resolve_model_path(job.model_path)
    if model_path:  # a folder is data: no custom code unless --trust-remote-code, weights only as safetensors
        from seqpar.runtime.data.hf_folder import check_weights, refuse_remote_code

        refuse_remote_code(model_path, "--model-path", job.trust_remote_code)
        check_weights(model_path)
    spec = model_from_config(model_path) if model_path else plan.workload.model
    lengths = list(job.seq_len) or [plan.workload.seq_len]
    for n in lengths:  # one line naming the length, the mode's rule and the nearest valid lengths
        check_strategy_shape(s, n, spec)
    longest = max_eval_seq_len(spec, cl, s, plan.workload.dtype)
    if o.max_seq_len:
        where = f"{s.mode} sp {s.sp_degree} on {cl.world_size} x {cl.gpu.name}"
        note(f"longest evaluable length with {where}: {longest} ({format_tokens(longest) if longest else 'none fits'})")
        return 0, {"max_eval_seq_len": longest, "strategy": s.model_dump()}
    from seqpar.runtime.eval import run as rt

    rt.preflight(
        task,
        lengths,
        job.data,
        job.tokenizer or model_path,
        spec.vocab_size,
        list(job.depths),
        job.samples,
        trust_remote_code=job.trust_remote_code,
    )
    if cl.nodes > 1:
        raise SeqparError(
            f"plan {str(plan_path)!r} spans {cl.nodes} nodes; seqpar eval starts the ranks of one node, so evaluate with a "
            f"one-node plan (seqpar advise --nodes 1 ...)"
        )
    if not o.force:
        check_this_machine(plan, plan_path)
    preds = [predict_eval(spec, n, cl, s, plan.workload.dtype).to_dict() for n in lengths]
    for line in prediction_lines(preds, longest, f"{plan.workload.dtype} weights, {cl.world_size} x {cl.gpu.name}"):
        note(line)
    out = output_dir(plan_path, o)
    pred_file = out / "prediction.json"
    write_atomic(pred_file, json.dumps({"lengths": {str(p["seq_len"]): p for p in preds}, "max_eval_seq_len": longest}, indent=2))
    from seqpar.plan.jobspec import eval_job

    ranks = replace(job, seq_len=tuple(lengths), prediction=str(pred_file), model_path=model_path)
    run = eval_job(plan, plan_path, ranks, output=out)
    note(f"seqpar eval: {' '.join(run.argv)}")
    report = out / rt.REPORTS[task]
    report.unlink(missing_ok=True)  # a failed job must not leave an older report to be shown as its own
    # With --json the ranks' output goes to stderr (fd 2: the process's own, also under a test runner).
    rc = subprocess.run(run.argv, env={**os.environ, **run.env}, stdout=2 if o.json_out else None).returncode
    if rc:
        done = json.loads(report.read_text())["lengths"] if report.is_file() else []
        kept = (
            f"; {report} holds the lengths done before it ({', '.join(format_tokens(r['seq_len']) for r in done)})"
            if done
            else ""
        )
        note(f"error: the eval job failed with exit status {rc}; the ranks' errors are above{kept}")
        return 1, None
    return 0, json.loads(report.read_text())


def output_dir(plan_path: Path, o: EvalOptions) -> Path:
    return Path(o.output or Path("runs") / f"eval-{Path(plan_path).stem}")


def show(task: str, report: dict, o: EvalOptions, console, note: Callable[[str], None]) -> Path | None:
    """The table on ``console``, measured-vs-predicted lines and the plot (its path; None without matplotlib unless
    --plot asked for it, then MissingExtra)."""
    from seqpar.runtime.eval import show as er

    console.print(er.perplexity_table(report) if task == "perplexity" else er.needle_table(report))
    for line in er.measured_lines(report):
        note(line)
    out = output_dir(report["plan"], o)
    plot = o.plot or out / PLOTS[task]
    try:
        (er.plot_loss_by_position if task == "perplexity" else er.plot_needle_heatmap)(report, plot)
    except MissingExtra as e:
        if o.plot:
            raise
        note(f"no plot: {e}")
        return None
    note(f"wrote the report and {plot} into {out}" if not o.plot else f"wrote the report into {out}, the plot to {plot}")
    return Path(plot)


__all__ = ["EvalOptions", "check_this_machine", "output_dir", "resolve_model_path", "run_eval", "show"]
