"""``seqpar launch``: turn a plan into the torchrun (or accelerate, for DeepSpeed) command, check first, run it, report.

Torch-free on purpose (it only builds argv and starts a subprocess), so ``--dry-run`` works on any machine. The job is
``python -m torch.distributed.run`` (torchrun) with the c10d rendezvous: ``--standalone`` on one node, or
``--rdzv-endpoint HOST:PORT`` shared by every node; ``--max-restarts 0`` so a failing rank ends the job: torchrun's
elastic agent then stops every local worker (SIGTERM, then SIGKILL) and exits non-zero, and the process-group timeout
(SEQPAR_PG_TIMEOUT_S) bounds how long ranks on other nodes wait in a collective with a dead peer.

Staged plans (``plan.stages``, progressive recipes) run stage by stage into ``<output>/stage-<i>``; each stage starts
its weights from the previous stage's final checkpoint (``--init-from``), with a fresh optimizer, as EasyContext does.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from seqpar.schema import ClusterSpec, LaunchPlan, SeqparError


@dataclass
class LaunchOptions:
    steps: int | None = None
    data: str = "synthetic"
    model_path: str | None = None
    output: str | None = None
    resume: bool = False
    nnodes: int | None = None
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    report_to: str = ""
    extra: list[str] = field(default_factory=list)


@dataclass
class Job:
    argv: list[str]
    env: dict[str, str]  # only what seqpar sets on top of the caller's environment
    configs: dict[str, str]  # file name (in the output folder) -> text, e.g. the DeepSpeed config
    output: Path
    plan_file: Path


def default_output(plan_path: str | Path) -> Path:
    return Path("runs") / Path(plan_path).stem


# --------------------------------------------------------------------------------------------- machine check


def check_machine(cluster: ClusterSpec, *, gpu_names: list[str], gpu_profile: str | None, cpu_count: int, nnodes: int) -> list[str]:
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
        diffs.append(f"the plan needs {cluster.gpus_per_node} x {cluster.gpu.name} per node, this machine has no NVIDIA GPU visible")
        return diffs
    if len(gpu_names) != cluster.gpus_per_node:
        diffs.append(f"the plan needs {cluster.gpus_per_node} GPUs per node, this machine has {len(gpu_names)}")
    if gpu_profile != cluster.gpu.name:
        diffs.append(f"the plan is for {cluster.gpu.name}, this machine has {gpu_names[0]} (profile {gpu_profile})")
    return diffs


# --------------------------------------------------------------------------------------------- configs


def deepspeed_config(plan: LaunchPlan) -> dict:
    """The DeepSpeed config for a zero2/zero3/zero3_offload plan (EasyContext's engine: ZeRO-3, params+optimizer on CPU)."""
    s, w, t = plan.strategy, plan.workload, plan.training
    zero: dict = {"stage": 2 if s.sharding == "zero2" else 3, "overlap_comm": True, "contiguous_gradients": True}
    if s.sharding == "zero3_offload":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if zero["stage"] == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": w.micro_batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "gradient_clipping": t.grad_clip,
        "bf16": {"enabled": w.dtype == "bf16"},
        "fp16": {"enabled": w.dtype == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # seqpar logs its own metrics
    }


def accelerate_config(plan: LaunchPlan, ds_path: Path, nnodes: int, node_rank: int, endpoint: str | None) -> str:
    host, _, port = (endpoint or "127.0.0.1:29500").partition(":")
    lines = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": str(ds_path)},
        "num_machines": nnodes,
        "num_processes": nnodes * plan.cluster.gpus_per_node,
        "machine_rank": node_rank,
        "main_process_ip": host,
        "main_process_port": int(port or 29500),
        "rdzv_backend": "c10d" if nnodes > 1 else "static",
    }
    return json.dumps(lines, indent=2) + "\n"  # accelerate reads YAML, and JSON is YAML


def job_env(plan: LaunchPlan, cpu_count: int) -> dict[str, str]:
    env: dict[str, str] = {}
    if plan.cluster.accelerator == "cuda":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # fewer fragmentation OOMs at long sequence lengths
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # a failed/timed-out collective tears the process down
        env["SEQPAR_PG_TIMEOUT_S"] = "600"
    else:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count // plan.cluster.gpus_per_node))
        env["SEQPAR_PG_TIMEOUT_S"] = "60"
    env.update(plan.launch.env)
    return env


# --------------------------------------------------------------------------------------------- command


def build_job(plan: LaunchPlan, plan_file: Path, opts: LaunchOptions, *, output: Path, init_from: str | None = None) -> Job:
    nnodes = opts.nnodes or plan.cluster.nodes
    train = ["--plan", str(plan_file), "--data", opts.data, "--output", str(output)]
    if opts.steps:
        train += ["--steps", str(opts.steps)]
    if opts.model_path:
        train += ["--model-path", opts.model_path]
    if opts.resume:
        train.append("--resume")
    if init_from:
        train += ["--init-from", init_from]
    if opts.report_to:
        train += ["--report-to", opts.report_to]
    train += opts.extra
    configs: dict[str, str] = {}
    if plan.strategy.sharding.startswith("zero") and plan.cluster.accelerator == "cuda":  # CPU ranks run ZeRO as FSDP2
        ds_path, acc_path = output / "deepspeed.json", output / "accelerate.yaml"
        configs[ds_path.name] = json.dumps(deepspeed_config(plan), indent=2) + "\n"
        configs[acc_path.name] = accelerate_config(plan, ds_path, nnodes, opts.node_rank, opts.rdzv_endpoint)
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc_path), "-m", "seqpar.runtime.train"]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                "--nproc-per-node", str(plan.cluster.gpus_per_node), "--max-restarts", "0"]
        if opts.rdzv_endpoint:
            argv += ["--node-rank", str(opts.node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", opts.rdzv_endpoint,
                     "--rdzv-id", f"seqpar-{plan_file.stem}"]
        elif nnodes > 1:
            raise SeqparError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        else:
            argv.append("--standalone")  # c10d rendezvous on a free local port
        argv += ["-m", "seqpar.runtime.train"]
    return Job(argv + train, job_env(plan, os.cpu_count() or 1), configs, output, plan_file)


def stage_plan(plan: LaunchPlan, i: int) -> LaunchPlan:
    """The plain plan of stage i (its seq_len, rope theta, steps, strategy and prediction), validated like any plan."""
    st = plan.stages[i]
    data = json.loads(plan.model_dump_json())
    data["workload"]["seq_len"] = st.seq_len
    data["strategy"] = json.loads(st.strategy.model_dump_json())
    data["prediction"] = json.loads(st.prediction.model_dump_json()) if st.prediction else None
    data["training"]["steps"] = st.steps
    data["training"]["rope_theta"] = st.rope_theta
    data["stages"] = []
    return LaunchPlan.model_validate(data)


def jobs_for(plan: LaunchPlan, plan_path: Path, opts: LaunchOptions) -> list[tuple[Job, LaunchPlan | None]]:
    """One job, or one per stage (with the stage plan to write before it runs)."""
    out = Path(opts.output) if opts.output else default_output(plan_path)
    if not plan.stages:
        return [(build_job(plan, plan_path, opts, output=out), None)]
    jobs, prev = [], None
    for i in range(len(plan.stages)):
        sp = stage_plan(plan, i)
        sout = out / f"stage-{i}"
        jobs.append((build_job(sp, sout / "plan.json", opts, output=sout, init_from=str(prev) if prev else None), sp))
        prev = sout
    return jobs


def preflight(plan: LaunchPlan, jobs, opts: LaunchOptions, dry_run: bool) -> None:
    """Everything that can be checked before a process starts; SeqparError (exit 2, nothing written) otherwise."""
    from seqpar.runtime.data import open_data  # numpy only; text data loads the tokenizer to count tokens

    for job, sp in jobs:
        p = sp or plan
        open_data(opts.data, seq_len=p.workload.seq_len, vocab_size=p.workload.model.vocab_size,
                  seed=p.training.seed, tokenizer_path=opts.model_path)
        if not opts.resume and not dry_run:
            ck = job.output / "checkpoints"
            if ck.is_dir() and any(x.name.startswith("step-") for x in ck.iterdir()):
                raise SeqparError(f"output {str(job.output)!r} already holds checkpoints; pass --resume or pick another --output")
        if p.strategy.sharding.startswith("zero") and p.cluster.accelerator == "cuda" and not dry_run:
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                raise SeqparError(
                    f"sharding {p.strategy.sharding!r} runs on DeepSpeed through accelerate, and deepspeed is not installed; "
                    f"`pip install 'seqpar[deepspeed]'` or advise with --sharding fsdp (--dry-run shows the DeepSpeed config)"
                )
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
        title = f"stage {n}: seq_len {sp.workload.seq_len}, rope_theta {sp.training.rope_theta}, {sp.strategy.mode}" if sp else "job"
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
