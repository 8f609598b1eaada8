"""The `seqpar` command line: assembles commands; the work lives in seqpar.advisor (and seqpar.runtime for launching).

Conventions for every command (others add theirs here with small edits):
- the docstring is the help and ends with an Examples section;
- ``--json`` puts only JSON on stdout, human text goes to stderr;
- exit 0 ok, 1 a known failure (one line, SEQPAR_DEBUG=1 shows the traceback), 2 bad usage or invalid input (SeqparError);
  wrap the command with ``@handle_errors`` to get this mapping.
Importing this module must not import torch: runtime commands import their modules inside the command body.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Literal, Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from seqpar.cli_options import OUTPUT, RequestFlags, advise_request, with_request_flags
from seqpar.errors import SeqparError
from seqpar.schema import LaunchPlan, first_error, format_tokens, parse_seq_len

app = typer.Typer(
    name="seqpar",
    help="Plan, check and run sequence-parallel long-context training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
ADVICE = "Advice"
profiles_app = typer.Typer(help="GPU, link and model profiles seqpar knows.", no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(profiles_app, name="profiles")


def stdout() -> Console:
    return Console(file=sys.stdout, soft_wrap=True)


def stderr() -> Console:
    return Console(file=sys.stderr, soft_wrap=True)


def note(text: str) -> None:
    """A line for a person, on stderr (stdout stays clean for --json)."""
    typer.echo(text, err=True)


def _pass_through() -> tuple[type[BaseException], ...]:
    """typer's own exits and usage errors: typer >= 0.2x vendors click (typer.TyperException), older typer uses click."""
    kinds: list[type[BaseException]] = [typer.Exit, typer.Abort]
    if hasattr(typer, "TyperException"):
        kinds.append(typer.TyperException)
    try:
        from click.exceptions import Abort, ClickException
    except ImportError:
        pass
    else:
        kinds += [ClickException, Abort]
    return tuple(kinds)


_PASS_THROUGH = _pass_through()


def handle_errors(fn):
    """Map exceptions to exit codes: SeqparError/ValidationError -> 2, any other error -> 1 (SEQPAR_DEBUG=1 re-raises)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _PASS_THROUGH:
            raise
        except SeqparError as e:
            note(f"error: {e}")
            raise typer.Exit(2) from None
        except ValidationError as e:
            note(f"error: {first_error(e)}")
            raise typer.Exit(2) from None
        except Exception as e:
            if os.environ.get("SEQPAR_DEBUG"):
                raise
            note(f"error: {type(e).__name__}: {e} (run with SEQPAR_DEBUG=1 to see the traceback)")
            raise typer.Exit(1) from None

    return wrapper


def print_json(obj) -> None:
    typer.echo(obj if isinstance(obj, str) else json.dumps(obj, indent=2))


# --------------------------------------------------------------------------------------------- advise


@app.command()
@handle_errors
@with_request_flags
def advise(
    flags: RequestFlags,
    policy: Optional[Literal["rules", "cost"]] = typer.Option(
        None, "--policy", rich_help_panel=ADVICE, help="rules: the guide's tree; cost: the cost-model search (default)."
    ),
    max_seq_len: bool = typer.Option(
        False,
        "--max-seq-len",
        rich_help_panel=ADVICE,
        help="Instead of a plan: the longest sequence that fits, per mode (pins apply).",
    ),
    recipe: Optional[str] = typer.Option(
        None,
        "--recipe",
        rich_help_panel=ADVICE,
        help="Staged context extension: 1M (EasyContext's Llama-2-7B schedule) or smoke (CPU); each stage planned; seqpar launch runs them in order.",
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", rich_help_panel=OUTPUT, help="Write the plan here (atomically; nothing is written on error)."
    ),
    json_out: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT, help="Print the plan as JSON on stdout (only JSON)."),
):
    """Advise a launch plan: which sequence-parallel mode, degrees, checkpointing and sharding, with the reasons.

    The cluster comes from the flags, else from the probe (NVML), else the default (8x A100-80G SXM, EasyContext's hardware);
    stderr says which.

    **Examples**

        seqpar advise --seq-len 512k
        seqpar advise --seq-len 1M --model llama-3-8b --gpu h100 --gpus 8 --nodes 2 -o plan.json
        seqpar advise --seq-len 256 --model tiny --cluster cpu:2 -o plan.json
        seqpar advise --seq-len 128k --mode zigzag_ring_attn --policy rules --json
        seqpar advise --max-seq-len --gpu h200 --gpus 8 --optimizer adamw
        seqpar advise --seq-len 64k --gpu h200 --gpus 1 --optimizer none --tiled-mlp --fused-ops liger -o plan.json
    """
    from seqpar.advisor.advise import advise as run_advice

    if max_seq_len:
        return _max_seq_len_command(flags, json_out)
    seq_len = flags.seq_len
    if recipe is not None and seq_len is None:  # the recipe's last stage; every stage is planned below
        from seqpar.advisor.recipe import recipe_seq_len

        seq_len = str(recipe_seq_len(recipe))
    if seq_len is None:
        raise SeqparError("--seq-len is required (e.g. --seq-len 128k), unless you ask for --max-seq-len")
    n = parse_seq_len(seq_len)
    note(f"seq_len {n} ({format_tokens(n)})")
    req, cluster_note = advise_request(flags, n, policy or "cost", note)
    if recipe is not None:
        from seqpar.advisor.recipe import advise_recipe

        plan = advise_recipe(req, recipe, cluster_note)
    else:
        plan = run_advice(req, cluster_note)
    if output is not None:
        from seqpar.jobspec import launch_spec

        plan = plan.model_copy(update={"launch": launch_spec(plan, output)})
        plan = LaunchPlan.model_validate(plan.model_dump())  # re-validate the edited plan before it touches disk
        plan.write(output)
        note(f"wrote {output}")
    if json_out:
        print_json(plan.to_json().rstrip("\n"))
    else:
        from seqpar.advisor.render import render_plan

        render_plan(plan, stdout(), str(output or "plan.json"))


# --------------------------------------------------------------------------------------------- explain, schema


@app.command()
@handle_errors
def explain(
    plan_path: Path = typer.Argument(..., metavar="PLAN.json", help="A plan written by `seqpar advise -o`."),
    json_out: bool = typer.Option(False, "--json", help="Print the validated plan as JSON on stdout."),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Write a PNG: predicted peak memory vs seq_len per mode, with the GPU's capacity."
    ),
):
    """Validate a plan and explain it: workload, cluster, strategy, prediction, the rules followed and why.

    **Examples**

        seqpar explain plan.json
        seqpar explain plan.json --json
        seqpar explain plan.json --plot memory.png
    """
    plan = LaunchPlan.load(plan_path)
    if plot is not None:
        from seqpar.advisor.explain import plot_memory

        note(f"wrote {plot_memory(plan, plot)}")
    if json_out:
        print_json(plan.to_json().rstrip("\n"))
        return
    from seqpar.advisor.render import render_plan

    render_plan(plan, stdout(), str(plan_path))
    from seqpar.advisor.explain import explain_tables  # the cost model's breakdowns (memory, time, alternatives)

    for t in explain_tables(plan):
        stdout().print(t)


# --------------------------------------------------------------------------------------------- check, max context, calibrate


@app.command()
@handle_errors
@with_request_flags
def check(
    flags: RequestFlags,
    plan_path: Optional[Path] = typer.Argument(
        None, metavar="[PLAN.json]", help="A plan written by `seqpar advise -o`; without it, the flags below describe one."
    ),
    json_out: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT, help="Print the verdict as JSON on stdout."),
):
    """Pre-launch OOM gate: exit 0 when the plan fits, 1 when it risks OOM (with the cheapest fix), 2 when it is invalid.

    With a plan it is re-evaluated on the plan's cluster, or on the Cluster flags' when given; without one, the Workload,
    Cluster and Pins flags describe the configuration, as for `seqpar advise` (the cost model picks whatever is not pinned).

    **Examples**

        seqpar check plan.json
        seqpar check plan.json --gpu a100-40g --gpus 8
        seqpar check --seq-len 64k --gpu h200 --gpus 1 --mode data_parallel --checkpointing full --sharding ddp --loss-impl hf
        seqpar check --seq-len 128k --gpu h200 --gpus 1 --optimizer none --checkpointing offload --tiled-mlp --fused-ops liger
    """
    from seqpar.advisor.cluster import resolve_cluster
    from seqpar.advisor.explain import check_lines
    from seqpar.advisor.gate import check as run_check

    if plan_path is not None:  # re-checked on its own cluster, or on the Cluster flags' (the plan's node shape fills the gaps)
        target = LaunchPlan.load(plan_path)
        f, c = flags, target.cluster
        declared = any(x is not None for x in (f.gpu, f.gpus, f.nodes, f.cluster))
        cl = (
            resolve_cluster(f.gpu, f.gpus or c.gpus_per_node, f.nodes or c.nodes, f.cluster, f.host_ram_gib)[0]
            if declared
            else None
        )
    else:
        if flags.seq_len is None:
            raise SeqparError("give a plan file or --seq-len (with the advise flags); e.g. seqpar check plan.json")
        target, cl = advise_request(flags, parse_seq_len(flags.seq_len), "cost", note)[0], None
    res = run_check(target, cl)
    if json_out:
        print_json(
            {
                "fits": res.fits,
                "exit_code": res.exit_code,
                "reason": res.reason,
                "fix": res.fix,
                "fix_strategy": res.fix_strategy.model_dump() if res.fix_strategy else None,
                "biggest_terms_gib": dict(res.biggest_terms),
                "strategy": res.plan.strategy.model_dump(),
                "prediction": res.prediction.model_dump(),
            }
        )
    else:
        for line in check_lines(res):
            (typer.echo if res.fits else note)(line)
    raise typer.Exit(res.exit_code)


def _max_seq_len_command(flags: RequestFlags, json_out: bool) -> None:
    """`seqpar advise --max-seq-len`: the longest sequence that fits, per mode (the pins apply)."""
    from seqpar.advisor.explain import max_seq_len_table
    from seqpar.advisor.search import max_seq_len as run_max

    req, _ = advise_request(flags, 1024, "cost", note)  # the workload, cluster and pins; each mode's length is searched
    pins = {k: v for k, v in flags.pins().items() if k != "mode"}
    res = run_max(
        req.model,
        req.cluster,
        [flags.mode] if flags.mode else None,
        optimizer=req.optimizer,
        micro_batch_size=req.micro_batch_size,
        dtype=req.dtype,
        **pins,
    )
    if json_out:
        print_json({m: {"max_seq_len": n, "strategy": s.model_dump() if s else None} for m, (n, s) in res.items()})
    else:
        stdout().print(max_seq_len_table(res, req.cluster.gpu.memory_gib))


@app.command()
@handle_errors
def calibrate(
    reports: list[Path] = typer.Argument(
        ..., metavar="REPORT.json...", help="Run reports written by `seqpar launch` (or measurement CSVs)."
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Write the refitted coefficients here (load them with SEQPAR_COEFFICIENTS)."
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print the fit (coefficients, residuals, leave-one-out) as JSON on stdout."
    ),
):
    """Refit the cost model's coefficients to measured runs (plus the shipped measurements); report residuals and leave-one-out.

    **Examples**

        seqpar calibrate runs/*/report.json -o coefficients.json
        seqpar calibrate report.json --json
    """
    from seqpar.advisor.fit import calibrate as run_calibrate

    res = run_calibrate(reports, output)
    if output is not None:
        note(f"wrote {output}")
    if json_out:
        print_json(
            {
                "coefficients": res.coefficients.values(),
                "time_factors": res.coefficients.time_factors,
                "rows": res.rows,
                "max_abs_residual": res.max_abs_residual,
                "max_abs_loo": res.max_abs_loo,
            }
        )
        return
    for e in res.rows:
        r, l = e["tokens_residual"], e["loo_tokens_error"]
        typer.echo(
            f"{e['label']:<45} tokens/s measured {e['measured_tokens_per_s'] or '-'!s:>9} predicted {e['predicted_tokens_per_s']:>10,.0f} "
            f"residual {'' if r is None else f'{r:+.1%}':>7} LOO {'' if l is None else f'{l:+.1%}':>7}"
        )
    typer.echo(f"max |residual| {res.max_abs_residual:.1%}, max |LOO| {res.max_abs_loo:.1%}")


@app.command()
@handle_errors
def schema():
    """Print the JSON schema of a launch plan (the format `seqpar advise -o` writes and `seqpar launch` reads).

    **Examples**

        seqpar schema > plan.schema.json
    """
    print_json(LaunchPlan.model_json_schema())


# --------------------------------------------------------------------------------------------- probe, profiles


@app.command()
@handle_errors
def probe(json_out: bool = typer.Option(False, "--json", help="Print the probe result as JSON on stdout.")):
    """Describe this machine through NVML: GPUs, memory, NVLinks, topology, PCIe, nodes, host RAM, InfiniBand.

    Without an NVIDIA driver it says so (exit 0); `seqpar advise` then uses the flags or the default cluster.

    **Examples**

        seqpar probe
        seqpar probe --json
    """
    from seqpar.advisor.probe import probe as run_probe

    res = run_probe()
    try:
        cl, why = res.to_cluster(), ""
    except SeqparError as e:
        cl, why = None, str(e)
    if json_out:
        print_json({"probe": res.model_dump(), "cluster": cl.model_dump() if cl else None})
        return
    from seqpar.advisor.render import cluster_line, probe_tables

    con = stdout()
    for t in probe_tables(res):
        con.print(t)
    con.print(
        f"advise would use: {cluster_line(cl)}"
        if cl
        else f"advise would use the flags or the default cluster ({why or res.reason})"
    )


@profiles_app.command("list")
@handle_errors
def profiles_list(json_out: bool = typer.Option(False, "--json", help="Print every profile as JSON on stdout.")):
    """List the GPU, link and model profiles.

    **Examples**

        seqpar profiles list
        seqpar profiles list --json
    """
    from seqpar.profiles import list_gpus, list_links, list_models

    gpus, links, models = list_gpus(), list_links(), list_models()
    if json_out:
        print_json({k: [s.model_dump() for s in v] for k, v in (("gpus", gpus), ("links", links), ("models", models))})
        return
    from seqpar.advisor.render import profile_tables

    con = stdout()
    for t in profile_tables(gpus, links, models):
        con.print(t)


@profiles_app.command("show")
@handle_errors
def profiles_show(
    name: str = typer.Argument(..., help="GPU, link or model name, an alias, or a local config.json."),
    json_out: bool = typer.Option(False, "--json", help="Print the profile as JSON on stdout."),
):
    """Show one profile with its figures and their source.

    **Examples**

        seqpar profiles show h100
        seqpar profiles show llama-3-8b --json
        seqpar profiles show ./my-model/config.json
    """
    from seqpar.profiles import find_profile

    spec = find_profile(name)
    if json_out:
        print_json(spec.model_dump())
        return
    from seqpar.advisor.render import spec_table

    stdout().print(spec_table(spec))


# --------------------------------------------------------------------------------------------- launch


@app.command()
@handle_errors
def launch(
    plan_path: Path = typer.Argument(..., metavar="PLAN.json", help="A plan written by `seqpar advise -o`."),
    steps: Optional[int] = typer.Option(
        None, "--steps", min=1, help="Optimizer steps (default: the plan's; per stage for staged plans)."
    ),
    data: str = typer.Option(
        "synthetic", "--data", help="synthetic, a .jsonl text file, a .bin/.npy token file, or a datasets folder."
    ),
    model_path: Optional[str] = typer.Option(
        None, "--model-path", help="Local Hugging Face model folder (default: the plan's model, random weights)."
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", help="Checkpoints, run report, metrics and log go here (default runs/<plan name>)."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint in --output."),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", min=1, help="Nodes of the job (default: the plan's)."),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="This node's rank (multi-node)."),
    rdzv_endpoint: Optional[str] = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous, the same on every node."
    ),
    report_to: str = typer.Option("", "--report-to", help="tensorboard,wandb: also log metrics there (when installed)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the exact command and generated configs; run nothing."),
    force: bool = typer.Option(False, "--force", help="Run even when the plan's cluster does not match this machine."),
    verify_first: bool = typer.Option(False, "--verify", help="Run `seqpar verify` first; train only if it passes."),
):
    """Run a plan: torchrun (accelerate for DeepSpeed plans) starts the trainer on every rank; exit status = the job's.

    Checks first (exit 2, nothing written): the plan, the data, the output folder, and that this machine is the plan's
    cluster (`--force` skips that). Writes checkpoints, `run_report.json` (measured beside predicted), `metrics.jsonl` and
    `train.log` into `--output`. Staged plans (`seqpar advise --recipe`) run stage by stage.

    **Examples**

        seqpar advise --model tiny --cluster cpu:2 --seq-len 256 -o plan.json && seqpar launch plan.json --steps 5 --data synthetic
        seqpar launch plan.json --data tokens.npy --output runs/a --resume
        seqpar launch plan.json --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500
        seqpar launch plan.json --dry-run
        seqpar launch plan.json --verify --data tokens.npy
    """
    from seqpar.runtime.launch import LaunchOptions
    from seqpar.runtime.launch import launch as run_launch

    plan = LaunchPlan.load(plan_path)
    if not dry_run and not force:
        _check_machine(plan, plan_path, nnodes)
    opts = LaunchOptions(
        steps=steps,
        data=data,
        model_path=model_path,
        output=str(output) if output else None,
        resume=resume,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        report_to=report_to,
    )
    if verify_first and not dry_run:
        _verify(plan, plan_path, opts, None, json_out=False)
    rc = run_launch(plan, plan_path, opts, dry_run=dry_run, echo=typer.echo if dry_run else note)
    if rc:
        raise typer.Exit(rc)


def _check_machine(plan: LaunchPlan, plan_path: Path, nnodes: Optional[int]) -> None:
    from seqpar.advisor.probe import probe as run_probe
    from seqpar.runtime.launch import check_machine

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


@app.command()
@handle_errors
def verify(
    plan_path: Path = typer.Argument(..., metavar="PLAN.json", help="A plan written by `seqpar advise -o`."),
    seq_len: Optional[str] = typer.Option(None, "--seq-len", help="Length to check at (default: seq_len / sp_degree)."),
    data: str = typer.Option("synthetic", "--data", help="As for `seqpar launch`: synthetic or a token/text file."),
    model_path: Optional[str] = typer.Option(None, "--model-path", help="Local Hugging Face model folder (default: random)."),
    output: Optional[Path] = typer.Option(None, "--output", help="Logs and verify.json go to <output>/verify."),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", min=1, help="Nodes of the job (default: the plan's)."),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="This node's rank (multi-node)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT, the same on every node."),
    force: bool = typer.Option(False, "--force", help="Run even when the plan's cluster does not match this machine."),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout."),
):
    """Check the plan's sequence parallelism on this machine: one step of one batch with the plan's mode, degrees, engine
    and model, next to the same batch with sp = 1 (data parallel over the same ranks); loss, gradient norm and every
    parameter's gradient must agree within base(dtype) x world size (fp32 1e-5, bf16 8e-3, fp16 1e-3).

    Exit 0 with the figures, 1 with the first mismatch (the worst parameter named), 2 for invalid input. Run it for every
    new plan and after every library upgrade (`seqpar launch --verify` runs it before training).

    **Examples**

        seqpar verify plan.json
        seqpar verify plan.json --seq-len 32k --model-path ./llama --json
    """
    from seqpar.runtime.launch import LaunchOptions

    plan = LaunchPlan.load(plan_path)
    if not force:
        _check_machine(plan, plan_path, nnodes)
    opts = LaunchOptions(
        data=data, model_path=model_path, output=str(output) if output else None, nnodes=nnodes, node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
    )  # fmt: skip
    _verify(plan, plan_path, opts, parse_seq_len(seq_len) if seq_len else None, json_out=json_out)


def _verify(plan: LaunchPlan, plan_path: Path, opts, seq_len: Optional[int], *, json_out: bool) -> None:
    from seqpar.runtime import verify

    try:
        results = verify.run_verify(plan, plan_path, opts, seq_len=seq_len, echo=note)
    except verify.VerifyFailed as e:
        note(f"seqpar verify: {e}")
        raise typer.Exit(1) from None
    if json_out:
        print_json(results)
    for r in results:
        note(f"seqpar verify: {verify.summary(r)}")
    if not all(r["ok"] for r in results):
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry (`seqpar`)."""
    app(prog_name="seqpar")


if __name__ == "__main__":
    main()
