"""``seqpar launch``: check a plan against this machine and its inputs, then run the job(s) seqpar.jobspec builds for it.

Torch-free on purpose (it only checks, starts a subprocess and reads what the ranks leave), so ``--dry-run`` works on any
machine. What runs (torchrun, or accelerate for DeepSpeed plans; one job per stage of a staged plan) is seqpar.jobspec's,
the builder the advisor records in ``plan.launch`` too. torchrun's ``--max-restarts 0``: a failing rank ends the job, its
elastic agent stops every local worker (SIGTERM, then SIGKILL) and exits non-zero, and the process-group timeout
(SEQPAR_PG_TIMEOUT_S) bounds how long ranks on other nodes wait in a collective with a dead peer.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

from seqpar.errors import SeqparError
from seqpar.jobspec import Job, LaunchOptions, jobs_for, require_deepspeed
from seqpar.schema import ClusterSpec, LaunchPlan

__all__ = ["LaunchOptions", "check_machine", "failure_message", "launch", "preflight", "run_job"]


# --------------------------------------------------------------------------------------------- machine check


def check_machine(
    cluster: ClusterSpec, *, gpu_names: list[str], gpu_profile: str | None, cpu_count: int, nnodes: int
) -> list[str]:
    """What differs between the plan's cluster and this machine (empty = it matches). gpu_names/gpu_profile: probed."""
    diffs = []
    if nnodes != cluster.nodes:
        diffs.append(f"the plan has {cluster.nodes} node(s), this launch {nnodes} (--nnodes)")
    if cluster.accelerator == "cpu":
        # gloo ranks may oversubscribe the cores (cpu:4 on 2 cores is fine for checks), not without bound.
        if cluster.gpus_per_node > 4 * cpu_count:
            diffs.append(f"the plan runs {cluster.gpus_per_node} CPU ranks per node, more than 4 x the {cpu_count} cores here")
        return diffs
    if not gpu_names:
        diffs.append(
            f"the plan needs {cluster.gpus_per_node} x {cluster.gpu.name} per node, this machine has no NVIDIA GPU visible"
        )
        return diffs
    if len(gpu_names) != cluster.gpus_per_node:
        diffs.append(f"the plan needs {cluster.gpus_per_node} GPUs per node, this machine has {len(gpu_names)}")
    if gpu_profile != cluster.gpu.name:
        diffs.append(f"the plan is for {cluster.gpu.name}, this machine has {gpu_names[0]} (profile {gpu_profile})")
    return diffs


def preflight(plan: LaunchPlan, jobs, opts: LaunchOptions, dry_run: bool) -> None:
    """Everything that can be checked before a process starts; SeqparError (exit 2, nothing written) otherwise."""
    from seqpar.runtime.data import open_data  # numpy only; text data loads the tokenizer to count tokens

    for job, sp in jobs:
        p = sp or plan
        open_data(
            opts.data,
            seq_len=p.workload.seq_len,
            vocab_size=p.workload.model.vocab_size,
            seed=p.training.seed,
            tokenizer_path=opts.model_path,
        )
        if not opts.resume and not dry_run:
            ck = job.output / "checkpoints"
            if ck.is_dir() and any(x.name.startswith("step-") for x in ck.iterdir()):
                raise SeqparError(f"output {str(job.output)!r} already holds checkpoints; pass --resume or pick another --output")
        if not dry_run:
            require_deepspeed(p)
    if opts.model_path and not (Path(opts.model_path) / "config.json").is_file():
        raise SeqparError(f"--model-path {opts.model_path!r} holds no config.json; pass a local Hugging Face model folder")


def _stage_done(job: Job, steps: int) -> bool:
    pointer = job.output / "checkpoints" / "latest"
    if not pointer.is_file():
        return False
    state = job.output / "checkpoints" / pointer.read_text().strip() / "trainer_state.json"
    return state.is_file() and json.loads(state.read_text()).get("step") == steps


def launch(plan: LaunchPlan, plan_path: str | Path, opts: LaunchOptions, *, dry_run: bool = False, echo=print) -> int:
    """Check, then print (dry run) or run the job(s); returns the exit status of the (last) job."""
    plan_path = Path(plan_path)
    jobs = jobs_for(plan, plan_path, opts)
    preflight(plan, jobs, opts, dry_run)
    for n, (job, sp) in enumerate(jobs):
        title = (
            f"stage {n}: seq_len {sp.workload.seq_len}, rope_theta {sp.training.rope_theta}, {sp.strategy.mode}" if sp else "job"
        )
        if dry_run:
            echo(f"# {title}")
            for k, v in job.env.items():
                echo(f"export {k}={shlex.quote(v)}")
            echo(shlex.join(job.argv))
            for name, text in job.configs.items():
                echo(f"# {job.output / name}:\n{text.rstrip()}")
            continue
        steps = opts.steps or (sp or plan).training.steps
        if sp is not None and opts.resume and _stage_done(job, steps):
            echo(f"seqpar launch: {title} already finished, skipping")
            continue
        job.output.mkdir(parents=True, exist_ok=True)
        if sp is not None:
            sp.write(job.plan_file)
        for name, text in job.configs.items():
            (job.output / name).write_text(text)
        for stale in job.output.glob("failed-rank*.txt"):
            stale.unlink()
        echo(f"seqpar launch: {title}: {shlex.join(job.argv)}")
        rc = run_job(job)
        if rc != 0:
            echo(failure_message(job, rc))
            return rc
    return 0


def run_job(job: Job) -> int:
    env = dict(os.environ)
    env.update(job.env)
    proc = subprocess.Popen(job.argv, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the job got the same SIGINT; give torchrun time to stop its workers
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def failure_message(job: Job, rc: int) -> str:
    """Name the rank that failed first (the trainer leaves failed-rank<R>.txt), else point at torchrun's summary."""

    def key(p: Path):
        stamp, _, line = p.read_text().strip().partition(" ")
        # A rank whose peer died fails too ("connection closed/reset by peer"): a consequence, never the cause.
        consequence = any(w in line.lower() for w in ("closed by peer", "reset by peer", "connection closed", "broken pipe"))
        return consequence, float(stamp or 0), line

    files = sorted(job.output.glob("failed-rank*.txt"), key=key)
    if files:
        first = key(files[0])[2]
        others = [p.stem.removeprefix("failed-rank") for p in files[1:]]
        tail = f" (then rank(s) {', '.join(others)} stopped)" if others else ""
        return f"seqpar launch: the job failed with exit status {rc}; first failure: {first}{tail}"
    return f"seqpar launch: the job failed with exit status {rc}; torchrun's error summary above names the failing rank"
