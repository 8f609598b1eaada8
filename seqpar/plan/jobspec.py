"""What ``seqpar launch`` runs for a plan: the launcher's argv, the job's environment and the configs it writes.

One builder for both sides, torch-free (it reads the schema only): the advisor records its result in ``plan.launch``, so a
plan names the very command its launch runs, and ``seqpar.runtime.launch.run`` checks and runs it. The job is
``python -m torch.distributed.run`` (torchrun) with the c10d rendezvous: ``--standalone`` on one node, or
``--rdzv-endpoint HOST:PORT`` shared by every node; ``--max-restarts 0`` so a failing rank ends the job. zero* plans run
under ``accelerate launch`` with a generated DeepSpeed config (EasyContext's engine: ZeRO-3, parameters and optimizer on
CPU), on CUDA and on CPU ranks alike (DeepSpeed's CPU accelerator over gloo): accelerate's "standard" multi-node launcher is
torchrun with the same c10d rendezvous, so both engines need the same endpoint on several nodes.

Staged plans (``plan.stages``, progressive recipes) are one job per stage, into ``<output>/stage-<i>``; each stage starts
its weights from the previous stage's final checkpoint (``--init-from``), with a fresh optimizer, as EasyContext does.

The ranks' flags are their options dataclass written by seqpar.plan.flags.to_argv (seqpar.plan.job_options declares
them): only the options that differ from their defaults, in field order, never assembled here.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from seqpar.plan.env import ALLOWED_ENV_TEXT, env_refusals
from seqpar.plan.errors import SeqparError
from seqpar.plan.flags import to_argv
from seqpar.plan.job_options import EvalJobOptions, LaunchOptions, default_output
from seqpar.plan.launch_plan import LaunchPlan, LaunchSpec

# What a recorded multi-node command leaves to each node: its rank and the rendezvous host (the shell fills them in).
NODE_RANK_VAR, ENDPOINT_VAR = "$NODE_RANK", "$MASTER_ADDR:29500"


@dataclass
class Job:
    argv: list[str]
    env: dict[str, str]  # only what seqpar sets on top of the caller's environment
    configs: dict[str, str]  # file name (in the output folder) -> text, e.g. the DeepSpeed config
    output: Path
    plan_file: Path
    launcher: str = "torchrun"  # or "accelerate" (zero* plans: DeepSpeed)


def uses_deepspeed(plan: LaunchPlan) -> bool:
    """zero* sharding runs DeepSpeed through accelerate, on CUDA and CPU ranks; nothing else stands in for it."""
    return plan.strategy.sharding.startswith("zero")


def require_deepspeed(plan: LaunchPlan) -> None:
    """Refuse a zero* plan where deepspeed is not installed (one line; checked by launch and again by every rank)."""
    import importlib.util

    if uses_deepspeed(plan) and importlib.util.find_spec("deepspeed") is None:
        raise SeqparError(
            f"sharding {plan.strategy.sharding!r} runs on DeepSpeed ZeRO through accelerate, and deepspeed is not installed; "
            "`DS_BUILD_OPS=0 pip install --no-build-isolation 'seqpar[deepspeed]'` (after torch), or advise with "
            "--sharding fsdp (`seqpar launch --dry-run` shows the DeepSpeed config)"
        )


# --------------------------------------------------------------------------------------------- configs


def deepspeed_config(plan: LaunchPlan) -> dict:
    """The DeepSpeed config for a zero2/zero3/zero3_offload plan (EasyContext's engine: ZeRO-3, params+optimizer on CPU)."""
    s, w, t = plan.strategy, plan.workload, plan.training
    cuda = plan.cluster.accelerator == "cuda"  # CPU ranks compute in fp32 (seqpar.runtime.train.engine.compute_dtype)
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
        "bf16": {"enabled": cuda and w.dtype == "bf16"},
        "fp16": {"enabled": cuda and w.dtype == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # seqpar logs its own metrics
    }


def accelerate_config(plan: LaunchPlan, ds_path: Path, nnodes: int, node_rank: int | str, endpoint: str | None) -> str:
    """accelerate's config for a DeepSpeed job. Several nodes: the "standard" multi-node launcher (torchrun with the c10d
    rendezvous at ``endpoint``, as the FSDP and DDP jobs; accelerate's default would be pdsh over ssh with a hostfile).
    One node: port 0, which accelerate replaces by a free port (torchrun's --standalone does the same)."""
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": str(ds_path), "deepspeed_multinode_launcher": "standard"},
        "num_machines": nnodes,
        "num_processes": nnodes * plan.cluster.gpus_per_node,
        "machine_rank": node_rank,
        "rdzv_backend": "c10d" if nnodes > 1 else "static",
    }
    if nnodes > 1:
        host, _, port = _endpoint(endpoint, nnodes).rpartition(":")
        cfg.update(main_process_ip=host, main_process_port=int(port), same_network=False)
    else:
        cfg["main_process_port"] = 0
    return json.dumps(cfg, indent=2) + "\n"  # accelerate reads YAML, and JSON is YAML


def _endpoint(endpoint: str | None, nnodes: int) -> str:
    """The rendezvous HOST:PORT every node of a multi-node job must share (refused when missing, for every engine)."""
    require_endpoint(nnodes, endpoint)
    host, _, port = (endpoint or "").rpartition(":")
    if endpoint and not (host and port.isdigit()):
        raise SeqparError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; pass e.g. node0:29500")
    return endpoint or ""


def job_env(plan: LaunchPlan, cpu_count: int, allow: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """seqpar's settings for the job's processes, then the plan's own ``launch.env`` over them: only names the plan may
    set (schema.plan_env_allowed) or ``allow`` names (SeqparError otherwise; LaunchPlan.load refuses them first)."""
    refused = env_refusals(plan.launch.env, allow)
    if refused:
        raise SeqparError(
            f"the plan's launch.env sets {', '.join(refused)}, which a plan may not set (a plan may set {ALLOWED_ENV_TEXT}); "
            f"remove it, or pass {' '.join('--allow-env ' + k for k in refused)} if you trust the plan"
        )
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


def torchrun_argv(plan: LaunchPlan, opts: LaunchOptions, *, rdzv_id: str, python: str = sys.executable) -> list[str]:
    """``python -m torch.distributed.run`` for the plan's nodes and ranks, up to (not including) ``-m MODULE``."""
    nnodes = opts.nnodes or plan.cluster.nodes
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(plan.cluster.gpus_per_node),
        "--max-restarts",
        "0",
    ]
    endpoint = _endpoint(opts.rdzv_endpoint, nnodes)  # refused when several nodes have none (every engine alike)
    if endpoint:
        argv += ["--node-rank", str(opts.node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        return argv + ["--rdzv-id", rdzv_id]
    require_endpoint(nnodes, opts.rdzv_endpoint)
    return argv + ["--standalone"]  # c10d rendezvous on a free local port


def require_endpoint(nnodes: int, endpoint: str | None) -> None:
    """Several nodes meet at one HOST:PORT that every node names; none is guessed (127.0.0.1 would leave each node waiting
    for itself), whatever the launcher (torchrun, or accelerate for DeepSpeed plans)."""
    if nnodes > 1 and not endpoint:
        raise SeqparError(
            f"a job on {nnodes} nodes needs --rdzv-endpoint HOST:PORT, the same on every node (e.g. --rdzv-endpoint "
            f"node0:29500, node0 being the host of node rank 0); nothing is assumed for it"
        )


def eval_job(plan: LaunchPlan, plan_file: Path, opts: EvalJobOptions, *, output: Path, python: str = sys.executable) -> Job:
    """What ``seqpar eval`` runs: torchrun on this node starting ``seqpar.runtime.eval.run`` with ``opts`` on every rank
    (forward only, so never DeepSpeed: weights are whole on every rank), in the environment of a launch."""
    argv = torchrun_argv(plan, LaunchOptions(), rdzv_id=f"seqpar-eval-{plan_file.stem}", python=python)
    argv += ["-m", opts.MODULE, *to_argv(replace(opts, plan=str(plan_file), output=str(output)))]
    return Job(argv, job_env(plan, os.cpu_count() or 1), {}, output, plan_file)


def build_job(
    plan: LaunchPlan,
    plan_file: Path,
    opts: LaunchOptions,
    *,
    output: Path,
    init_from: str | None = None,
    python: str = sys.executable,
) -> Job:
    """The job that runs ``plan`` (read from ``plan_file``) with ``python`` as the interpreter: every rank runs the
    module of ``opts.ranks(...)`` (the trainer, or the verify job) with those options as its flags."""
    nnodes = opts.nnodes or plan.cluster.nodes
    _endpoint(opts.rdzv_endpoint, nnodes)
    ranks = opts.ranks(plan_file, output, init_from)
    configs: dict[str, str] = {}
    if uses_deepspeed(plan):
        require_endpoint(nnodes, opts.rdzv_endpoint)
        ds_path, acc_path = output / "deepspeed.json", output / "accelerate.yaml"
        configs[ds_path.name] = json.dumps(deepspeed_config(plan), indent=2) + "\n"
        configs[acc_path.name] = accelerate_config(plan, ds_path, nnodes, opts.node_rank, opts.rdzv_endpoint)
        argv = [python, "-m", "accelerate.commands.launch", "--config_file", str(acc_path), "-m", ranks.MODULE]
    else:
        argv = torchrun_argv(plan, opts, rdzv_id=f"seqpar-{plan_file.stem}", python=python) + ["-m", ranks.MODULE]
    return Job(
        argv + to_argv(ranks),
        job_env(plan, os.cpu_count() or 1, ranks.allow_env),
        configs,
        output,
        plan_file,
        "accelerate" if uses_deepspeed(plan) else "torchrun",
    )


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


def jobs_for(
    plan: LaunchPlan, plan_path: Path, opts: LaunchOptions, python: str = sys.executable
) -> list[tuple[Job, LaunchPlan | None]]:
    """One job, or one per stage (with the stage plan to write before it runs)."""
    out = Path(opts.train.output) if opts.train.output else default_output(plan_path)
    if not plan.stages:
        return [(build_job(plan, plan_path, opts, output=out, python=python), None)]
    jobs, prev = [], None
    for i in range(len(plan.stages)):
        sp = stage_plan(plan, i)
        sout = out / f"stage-{i}"
        jobs.append(
            (build_job(sp, sout / "plan.json", opts, output=sout, init_from=str(prev) if prev else None, python=python), sp)
        )
        prev = sout
    return jobs


def launch_spec(plan: LaunchPlan, plan_path: str | Path = "plan.json") -> LaunchSpec:
    """What ``seqpar launch PLAN_PATH`` runs (a staged plan: its first stage's job), as the plan records it: ``python`` for
    the interpreter seqpar runs under, and on several nodes ``$NODE_RANK`` and ``$MASTER_ADDR:29500`` for each node to fill."""
    several = plan.cluster.nodes > 1
    opts = LaunchOptions(node_rank=NODE_RANK_VAR if several else 0, rdzv_endpoint=ENDPOINT_VAR if several else None)
    job = jobs_for(plan, Path(plan_path), opts, python="python")[0][0]
    return LaunchSpec(launcher=job.launcher, command=job.argv, env=job.env)


__all__ = [
    "ENDPOINT_VAR",
    "Job",
    "LaunchOptions",
    "NODE_RANK_VAR",
    "accelerate_config",
    "build_job",
    "deepspeed_config",
    "default_output",
    "eval_job",
    "job_env",
    "jobs_for",
    "launch_spec",
    "require_deepspeed",
    "require_endpoint",
    "stage_plan",
    "torchrun_argv",
    "uses_deepspeed",
]
