"""``seqpar launch``: check a plan against this machine and its inputs, then run the job(s) seqpar.plan.jobspec builds for it.

Torch-free at import (it checks, runs the job and reads what the ranks leave), so ``--dry-run`` works on any machine.
What runs (torchrun, or accelerate for DeepSpeed plans; one job per stage of a staged plan) is seqpar.plan.jobspec's, the
builder the advisor records in ``plan.launch`` too. torchrun runs in this process (seqpar.runtime.launch.agent) with
``--max-restarts 0``: a failing rank ends the job, the agent stops every other rank, and the launcher names the rank that
failed first, and how, from each rank's exit status and the line the trainer leaves in ``failed-rank<R>.json``; the
process-group timeout (SEQPAR_PG_TIMEOUT_S) bounds how long ranks wait for a dead or stopped peer, and the peer's
heartbeat (seqpar.runtime.train.liveness) names the one that stopped answering.

Stopping: SIGTERM or Ctrl-C (SIGINT) reaches the agent, which sends SIGTERM to every rank; the ranks finish their step,
write a checkpoint and exit; once every rank has exited the launcher prints one line with that checkpoint and exits
128 + the first signal (143, 130), however many follow it. The ranks die with the launcher (seqpar.runtime.launch.stopping), so
even ``kill -9`` of its process group leaves none behind.

One job at a time per output folder (seqpar.runtime.launch.lock): the launcher holds a lock on the folder, its ranks
another, so the folder stays taken until every process of the job has exited; a second launch is refused naming the
launcher's pid, and one that comes while the ranks of a killed launcher are still stopping waits for them.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

from seqpar.plan.env import env_value_problem
from seqpar.plan.errors import SeqparError
from seqpar.plan.extras import require
from seqpar.plan.jobspec import Job, LaunchOptions, default_output, jobs_for, uses_deepspeed
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.specs import ClusterSpec
from seqpar.runtime.launch.lock import LOCK_NAME, RANKS_ENV, check_free, lock_holder, lock_output, wait_for_ranks
from seqpar.runtime.launch.stopping import STOP_SIGNALS, grace_s

__all__ = [
    "LOCK_NAME",
    "LaunchOptions",
    "check_machine",
    "failure_message",
    "launch",
    "lock_holder",
    "lock_output",
    "preflight",
    "require_dependencies",
    "run_job",
]

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


def preflight(plan: LaunchPlan, jobs, opts: LaunchOptions, dry_run: bool, out: Path | None = None, echo=None) -> list[str]:
    """Everything that can be checked before a process starts; SeqparError (exit 2, nothing written) otherwise.
    ``out``: the output folder (default: the first job's). Returns what the data holds, one line per stage; text data
    is tokenized here, into the cache every rank then reads (seqpar.runtime.data.cache). Ranks of an earlier launch
    that are still stopping are waited for first (``echo`` says so), before anything of the folder is read."""
    from seqpar.runtime.checkpoint.resume import launch_check
    from seqpar.runtime.checkpoint.storage import launch_problem
    from seqpar.runtime.data import windows as datasrc

    reserved = 0  # an earlier stage's checkpoints stay in its folder while the next one runs
    out = out or jobs[0][0].output
    if out.exists() and not out.is_dir():
        raise SeqparError(f"--output {str(out)!r} is a file, not a folder; pick a folder (it is created when missing)")
    if not dry_run:
        check_free(out, _ranks_wait_s(), echo)
    t, notes = opts.train, []  # the trainer's options: what every job's ranks will read
    data_opts = t.data_options
    for job, sp in jobs:
        p = sp or plan
        data = datasrc.open_training_data(
            t.data,
            data_opts,
            seq_len=p.workload.seq_len,
            vocab_size=p.workload.model.vocab_size,
            seed=p.training.seed,
            tokenizer_path=data_opts.tokenizer or t.model_path,
        )
        notes.append(data.note)
        if t.data != "synthetic":
            notes += _repeats(t.steps or p.training.steps, p, data.num_windows)
        if not t.resume and not dry_run:
            ck = job.output / "checkpoints"
            if ck.is_dir() and any(x.name.startswith("step-") for x in ck.iterdir()):
                raise SeqparError(f"output {str(job.output)!r} already holds checkpoints; pass --resume or pick another --output")
        if t.resume and not dry_run:
            # a torn, foreign or incompatible checkpoint: one line
            packing = datasrc.packing_fact(t.data, data_opts)
            launch_check(p, job.output, t.data, t.steps, packing, foreign=t.accept_foreign_run)
        if not dry_run:
            problem, need = launch_problem(p, job.output, t, reserved)
            if problem:
                raise SeqparError(problem)
            reserved += need
        if not dry_run:  # what the ranks will import: one line naming the extra (exit 1), not a rank's traceback
            require_dependencies(p)
    if t.model_path and not dry_run and Path(t.model_path).is_dir():  # the ranks check again; this is before any starts
        from seqpar.runtime.data import hf_folder

        hf_folder.refuse_remote_code(t.model_path, "--model-path", data_opts.trust_remote_code)
        hf_folder.check_weights(t.model_path)
    for name in ("SEQPAR_PG_TIMEOUT_S", "SEQPAR_PINNED_BUDGET_GIB"):  # set in the shell: the ranks read them too
        problem = env_value_problem(name, os.environ[name]) if name in os.environ else None
        if problem:
            raise SeqparError(f"the environment's {problem}")
    if t.model_path and not (Path(t.model_path) / "config.json").is_file():
        raise SeqparError(f"--model-path {t.model_path!r} holds no config.json; pass a local Hugging Face model folder")
    return notes


def _repeats(steps: int, plan: LaunchPlan, windows: int) -> list[str]:
    """A line when the steps take more windows than the data holds: the trainer then starts over (a new order each
    pass), which a user who thinks in epochs wants to know before the run, not from the loss curve."""
    from seqpar.runtime.checkpoint.resume import windows_per_step

    per = windows_per_step(plan)
    if steps * per <= windows:
        return []
    one = max(1, windows // per)
    return [
        f"the data repeats: {steps} steps x {per} window(s) = {steps * per:,} windows from {windows:,}, about "
        f"{steps * per / windows:.1f} passes (epochs); --steps {one} is about one pass"
    ]


def require_dependencies(plan: LaunchPlan) -> None:
    """MissingExtra (seqpar.plan.extras) naming the extra to install when the job would fail to import what the plan needs."""
    needs = [("torch", "seqpar launch"), ("transformers", "seqpar launch")]
    if uses_deepspeed(plan):
        why = f"sharding {plan.strategy.sharding!r} (DeepSpeed through accelerate; or advise with --sharding fsdp)"
        needs += [("accelerate", why), ("deepspeed", why)]
    if plan.strategy.fused_ops == "liger":
        needs.append(("liger_kernel", "fused_ops liger"))
    if plan.workload.lora is not None:
        needs.append(("peft", "workload.lora (LoRA adapters)"))
        if plan.workload.lora.base_dtype == "nf4":
            needs.append(("bitsandbytes", "workload.lora.base_dtype nf4 (a 4-bit QLoRA base)"))
    for module, why in needs:
        require(module, why)


def _stage_done(job: Job, steps: int) -> bool:
    """Whether the stage's newest checkpoint is its last step (read as the resume reads it: checked and signed)."""
    from seqpar.runtime.checkpoint.resume import latest, read_state

    folder = latest(job.output / "checkpoints")
    return folder is not None and read_state(folder).get("step") == steps


def launch(plan: LaunchPlan, plan_path: str | Path, opts: LaunchOptions, *, dry_run: bool = False, echo=print, header=()) -> int:
    """Check, then print (dry run) or run the job(s); returns 0, 1 when a rank failed, or 128 + the signal that stopped
    the launch. ``header``: lines to echo once the checks pass, before anything runs (the CLI's predicted bill)."""
    plan_path = Path(plan_path)
    jobs = jobs_for(plan, plan_path, opts)
    out = Path(opts.train.output) if opts.train.output else default_output(plan_path)
    notes = preflight(plan, jobs, opts, dry_run, out, echo)
    if opts.train.data != "synthetic":  # a dry run shows them too, as comments of its script
        for line in dict.fromkeys(notes):  # once per distinct packing (recipe stages differ in seq_len)
            echo(f"{'# ' if dry_run else ''}seqpar launch: {line}")  # a dry run prints a script: comments there
    lock = None if dry_run else lock_output(out)
    for line in header:
        echo(line)
    try:
        for n, (job, sp) in enumerate(jobs):
            title = (
                f"stage {n}: seq_len {sp.workload.seq_len}, rope_theta {sp.training.rope_theta}, {sp.strategy.mode}"
                if sp
                else "job"
            )
            if dry_run:
                echo(f"# {title}")
                for k, v in job.env.items():
                    echo(f"export {k}={shlex.quote(v)}")
                echo(shlex.join(job.argv))
                for name, text in job.configs.items():
                    echo(f"# {job.output / name}:\n{text.rstrip()}")
                continue
            steps = opts.train.steps or (sp or plan).training.steps
            if sp is not None and opts.train.resume and _stage_done(job, steps):
                echo(f"seqpar launch: {title} already finished, skipping")
                continue
            job.output.mkdir(parents=True, exist_ok=True)
            if sp is not None:
                sp.write(job.plan_file)
            for name, text in job.configs.items():
                (job.output / name).write_text(text)
            for stale in list(job.output.glob("failed-rank*.json")) + list(job.output.glob("failed-rank*.txt")):
                stale.unlink()
            echo(f"seqpar launch: {title}: {shlex.join(job.argv)}")
            outcome = run_job(replace(job, env={**job.env, RANKS_ENV: str(lock.ranks_file)}))
            if outcome.signum is not None:
                left = wait_for_ranks(out, _ranks_wait_s())  # what the ranks left is known once they are gone
                echo(stop_message(job, outcome.signum, left))
                # The rest of a burst is ignored from here to the exit: the interpreter's teardown puts back the default
                # action of a signal that has a Python handler, and a late one would end the launcher -15, not 143.
                for s in STOP_SIGNALS:
                    signal.signal(s, signal.SIG_IGN)
                return outcome.rc
            if outcome.rc != 0:
                invalid = [r for r in _records(job) if r.get("kind") == "invalid"]
                if invalid and all(e.exitcode == 2 for e in outcome.failures.values()):  # every rank refused its input
                    raise SeqparError(invalid[0]["message"])
                echo(failure_message(job, outcome.rc, outcome.failures, (sp or plan).strategy.world_size, outcome.oom_kills))
                return outcome.rc
        return 0
    finally:
        if lock is not None:
            lock.close()


def _ranks_wait_s() -> float:
    """How long a rank may still run after its launcher is gone or stopped: its grace after the stop signal (then it
    exits whatever it is doing), and time to flush and exit on a busy machine."""
    return grace_s() + 15


# --------------------------------------------------------------------------------------------- running and reporting


def run_job(job: Job):
    """Run the job; an agent.Outcome (exit code, how the failed ranks ended, the signal that stopped it)."""
    from seqpar.runtime.launch.agent import run_torchrun

    if job.launcher == "torchrun":
        return run_torchrun(job.argv, job.env)
    return _run_child(job)


def _run_child(job: Job):
    """accelerate (DeepSpeed plans) as a child in a session of its own: the first SIGTERM/SIGINT sends it SIGTERM (its
    agent stops the ranks and waits for them), later ones are noted only; it dies with this process."""
    from seqpar.runtime.launch.agent import Outcome
    from seqpar.runtime.launch.stopping import die_with_parent

    proc = subprocess.Popen(job.argv, env={**os.environ, **job.env}, start_new_session=True, preexec_fn=die_with_parent)
    got: list[int] = []

    def forward(signum, frame):
        got.append(signum)
        if len(got) == 1:
            os.killpg(proc.pid, signal.SIGTERM)  # as torchrun's agent does for seqpar (seqpar.runtime.launch.agent)

    old = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        rc = proc.wait()
    finally:
        if not got:  # after a stop they stay: the rest of a burst must not kill the launcher before it exits 128 + n
            for s, h in old.items():
                signal.signal(s, h)
    if got:
        return Outcome(128 + got[0], signum=got[0])
    return Outcome(1 if rc else 0)


def last_checkpoint(job: Job) -> Path | None:
    """The checkpoint a stopped launch names (``latest``, never followed through a link or out of the folder); None
    when there is none, or none to trust."""
    from seqpar.runtime.checkpoint.resume import latest

    try:
        return latest(job.output / "checkpoints")
    except SeqparError:
        return None


def stop_message(job: Job, signum: int, left: list[int] | None = None) -> str:
    """The one line a stopped launch ends with: the signal and the checkpoint to resume from (read once the ranks are
    gone); ``left``: ranks that still held the folder when the launcher stopped waiting (pids; -1 unknown)."""
    last = last_checkpoint(job)
    where = f"last checkpoint {last} (continue with --resume)" if last else "no checkpoint was written"
    if left:
        pids = ", ".join(str(p) for p in left if p > 0) or "unknown"
        where += f"; ranks still running (pid {pids}) may write a later one"
    return f"seqpar launch: stopped by {signal.Signals(signum).name}; {where}"


def _records(job: Job) -> list[dict]:
    out = []
    for f in job.output.glob("failed-rank*.json"):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
            out.append(rec)
    return sorted(out, key=lambda r: float(r.get("time", 0)))


def failure_message(job: Job, rc: int, ends: dict | None = None, world_size: int | None = None, oom_kills: int = 0) -> str:
    """One line naming the rank that failed first, and how. The ranks' records (failed-rank<R>.json) and torchrun's exit
    statuses, in this order: a rank's own error; a rank that received a stop signal from outside; a rank killed by a
    signal that left no record (the OOM killer, kill -9); a rank its peers waited for in vain (named by their records, or
    the one that neither failed nor exited), which torchrun then killed. The survivors' "connection reset by peer" and
    timeouts are consequences, named last."""
    ends, recs = ends or {}, _records(job)
    by_kind = {k: [r for r in recs if r.get("kind") == k] for k in ("error", "invalid", "stopped", "peer")}
    by_kind["error"] += by_kind.pop("invalid")
    heard = {r["rank"] for r in recs}
    waits = by_kind["peer"][0] if by_kind["peer"] else None
    waited_for = (waits.get("peers") or [k for k in range(world_size or 0) if k not in heard]) if waits else []
    # killed by a signal with no record of its own; before the first peer gave up (else torchrun killed it afterwards)
    killed = sorted(
        (e for e in ends.values() if e.exitcode < 0 and e.rank not in heard),
        key=lambda e: (e.timestamp, e.rank),
    )
    if by_kind["error"] or by_kind["stopped"]:
        r = (by_kind["error"] or by_kind["stopped"])[0]
        first, cause = f"rank {r['rank']} {'failed' if r['kind'] == 'error' else 'stopped:'} {r['message']}", r["rank"]
    elif killed and not (waits and killed[0].rank in waited_for and killed[0].timestamp >= int(waits["time"]) + 1):
        e = killed[0]
        how = f"killed by {e.signal_name}"
        if e.signal_name == "SIGKILL":
            how += " (the kernel's OOM killer)" if oom_kills else " (kill -9, or an out-of-memory killer)"
        first, cause = f"rank {e.rank} was {how}", e.rank
    elif waits:
        who = (
            f"rank {waited_for[0]}" if len(waited_for) == 1 else f"ranks {', '.join(map(str, waited_for))}" if waited_for else ""
        )
        first = (f"{who} stopped answering; " if who else "") + f"rank {waits['rank']} failed: {waits['message']}"
        cause = waited_for[0] if len(waited_for) == 1 else waits["rank"]
        heard = heard - {waits["rank"]}  # named already
    elif ends:
        e = min(ends.values(), key=lambda e: (e.timestamp, e.rank))
        first, cause = f"rank {e.rank} exited with status {e.exitcode}", e.rank
    else:
        return f"seqpar launch: the job failed with exit status {rc}; torchrun's error summary above names the failing rank"
    others = sorted((heard | set(ends)) - {cause})
    tail = f" (then rank(s) {', '.join(map(str, others))} stopped)" if others else ""
    return f"seqpar launch: the job failed with exit status {rc}; first failure: {first}{tail}"
