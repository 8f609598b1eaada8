"""`seqpar launch` and `seqpar verify`: run a plan, and check its sequence parallelism against an sp = 1 reference.

Their options are declared on seqpar.plan.job_options (LaunchOptions: the trainer's options and where the nodes meet;
VerifyOptions: the verify job's) and offered here through seqpar.cli.params; seqpar.runtime.launch runs the job(s)
seqpar.plan.jobspec builds from them. `--dry-run` needs no torch: the runtime is imported inside the commands.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from seqpar.cli.base import EXIT_OOM_OR_FAILED, handle_errors, note, print_json, say
from seqpar.cli.params import with_options
from seqpar.plan.job_options import LaunchOptions, TrainOptions, VerifyOptions
from seqpar.plan.launch_plan import LaunchPlan

PLAN_ARG = typer.Argument(..., metavar="PLAN.json", help="A plan written by `seqpar advise -o`.")


@handle_errors
@with_options(LaunchOptions, "opts", leave_out=("train.plan", "train.init_from", "train.async_checkpoint"))
def launch(
    opts: LaunchOptions,
    plan_path: Path = PLAN_ARG,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the exact command and generated configs; run nothing."),
    force: bool = typer.Option(
        False, "--force", help="Run even when the plan's cluster does not match this machine, or its prediction says OOM."
    ),
    verify_first: bool = typer.Option(False, "--verify", help="Run `seqpar verify` first; train only if it passes."),
):
    """Run a plan: torchrun (accelerate for DeepSpeed plans) starts the trainer on every rank.

    Checks first (exit 2, nothing written): the plan, the data, the output folder (one launch at a time), the free space
    there for the checkpoints and the export, and that this machine is the plan's cluster (`--force` skips that); a plan
    predicted not to fit (exit 1, `--force` runs it) and a missing dependency (exit 1, the extra to install) are refused
    too. Then the predicted bill (wall time, GPU-hours), the run, and at its end measured vs predicted tokens/s and peak
    memory and where the exported model is. Writes checkpoints (about hourly by default), `run_report.json`,
    `metrics.jsonl` and `train.log` into `--output`. Staged plans (`seqpar advise --recipe`) run stage by stage. A
    non-finite loss stops the run before its update (exit 1, the step named; `latest` stays the last good checkpoint).
    Exit 0 done, 1 a rank failed (the last line names it and how), 2 invalid input, 130/143 stopped by Ctrl-C/SIGTERM
    after a final checkpoint (the last line names it). `--dry-run` needs no torch. Data: documents are packed whole
    with their boundaries (no attention across them), chats scored on the assistant's tokens only, tokenized once into a
    cache before the ranks start (README, "Data").

    **Examples**

    ```
    seqpar launch plan.json --steps 5 --data synthetic
    seqpar launch plan.json --data docs.jsonl --tokenizer ./tokenizer
    seqpar launch plan.json --data chats.jsonl --model-path ./qwen
    seqpar launch plan.json --data tokens.npy --output runs/a --resume
    seqpar launch plan.json --report-to tensorboard,wandb --project long-ctx
    seqpar launch plan.json --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500
    seqpar launch plan.json --verify --data tokens.npy
    seqpar launch plan.json --steps 3 --profile-step 3
    seqpar launch plan.json --dry-run
    ```
    """
    from seqpar.cli.launch_text import (
        bill_header,
        check_trackers,
        oom_verdict,
        refuse_fsdp_offload,
        refuse_merge_lora,
        run_summary,
    )
    from seqpar.runtime.launch.run import launch as run_launch

    t = opts.train
    check_trackers(t.report_to)
    plan = LaunchPlan.load(plan_path, allow_env=t.allow_env)
    if t.fsdp_cpu_offload:
        refuse_fsdp_offload(plan)
    if t.merge_lora:
        refuse_merge_lora(plan, t.final_checkpoint)
    verdict = oom_verdict(plan)
    if verdict and dry_run:
        note(f"warning: {verdict}")
    elif verdict and not force:
        note(f"error: {verdict}")
        raise typer.Exit(EXIT_OOM_OR_FAILED)
    if t.model_path is not None and not Path(t.model_path).expanduser().exists():  # a Hub id: its snapshot in the HF cache
        from seqpar.profiles.hub import snapshot

        opts = replace(opts, train=replace(t, model_path=str(snapshot(t.model_path, weights=not dry_run))))
        note(f"--model-path: {opts.train.model_path}")
    if not dry_run and not force:
        _check_machine(plan, plan_path, opts.nnodes)
    if verify_first and not dry_run:
        ranks = VerifyOptions(data=t.data, model_path=opts.train.model_path, allow_env=t.allow_env)
        _verify(plan, plan_path, opts, ranks, json_out=False)
    header = bill_header(plan, t.steps)
    if dry_run:
        header = [f"# {line}" for line in header]
    rc = run_launch(plan, plan_path, opts, dry_run=dry_run, echo=say if dry_run else note, header=header)
    if rc:
        raise typer.Exit(rc)
    if not dry_run:
        for line in run_summary(plan, plan_path, opts):
            note(line)


def _check_machine(plan: LaunchPlan, plan_path: Path, nnodes: Optional[int]) -> None:
    from seqpar.cli.eval_work import check_this_machine

    check_this_machine(plan, plan_path, nnodes)


@handle_errors
@with_options(VerifyOptions, "ranks", leave_out=("output", "plan"))
@with_options(LaunchOptions, "nodes", leave_out=("train",))
def verify(
    ranks: VerifyOptions,
    nodes: LaunchOptions,
    plan_path: Path = PLAN_ARG,
    output: Optional[Path] = typer.Option(None, "--output", "--output-dir", help="Logs and verify.json go to OUTPUT/verify."),
    force: bool = typer.Option(False, "--force", help="Run even when the plan's cluster does not match this machine."),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout."),
):
    """Check the plan's sequence parallelism on this machine: one step of one batch with the plan's mode, degrees, engine
    and model, next to the same batch with sp = 1 (data parallel over the same ranks); loss, gradient norm and every
    parameter's gradient must agree within base(dtype) x world size (fp32 1e-5, bf16 8e-3, fp16 1e-3).

    Exit 0 with the figures, 1 with the first mismatch (the worst parameter named), 2 for invalid input. Run it for every
    new plan and after every library upgrade (`seqpar launch --verify` runs it before training).

    **Examples**

    ```
    seqpar verify plan.json
    seqpar verify plan.json --seq-len 32k --model-path ./llama --json
    ```
    """
    plan = LaunchPlan.load(plan_path, allow_env=ranks.allow_env)
    if not force:
        _check_machine(plan, plan_path, nodes.nnodes)
    train = TrainOptions(data=ranks.data, model_path=ranks.model_path, output=str(output) if output else None)
    _verify(plan, plan_path, replace(nodes, train=replace(train, allow_env=ranks.allow_env)), ranks, json_out=json_out)


def _verify(plan: LaunchPlan, plan_path: Path, opts: LaunchOptions, ranks: VerifyOptions, *, json_out: bool) -> None:
    from seqpar.runtime.train import verify as run

    try:
        results = run.run_verify(plan, plan_path, opts, ranks=ranks, echo=note)
    except run.VerifyFailed as e:
        note(f"seqpar verify: {e}")
        raise typer.Exit(1) from None
    if json_out:
        print_json(results)
    for r in results:
        note(f"seqpar verify: {run.summary(r)}")
    if not all(r["ok"] for r in results):
        raise typer.Exit(1)


__all__ = ["launch", "verify"]
