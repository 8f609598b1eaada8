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

import click
import typer
from pydantic import ValidationError
from rich.console import Console

from seqpar.schema import (
    Checkpointing,
    LaunchPlan,
    LossImpl,
    Mode,
    Optimizer,
    SeqparError,
    Sharding,
    first_error,
    format_tokens,
    parse_seq_len,
)

app = typer.Typer(
    name="seqpar",
    help="Plan, check and run sequence-parallel long-context training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
profiles_app = typer.Typer(help="GPU, link and model profiles seqpar knows.", no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(profiles_app, name="profiles")


def stdout() -> Console:
    return Console(file=sys.stdout, soft_wrap=True)


def stderr() -> Console:
    return Console(file=sys.stderr, soft_wrap=True)


def note(text: str) -> None:
    """A line for a person, on stderr (stdout stays clean for --json)."""
    typer.echo(text, err=True)


def handle_errors(fn):
    """Map exceptions to exit codes: SeqparError/ValidationError -> 2, any other error -> 1 (SEQPAR_DEBUG=1 re-raises)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, click.exceptions.ClickException, click.exceptions.Abort):
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
def advise(
    seq_len: str = typer.Option(..., "--seq-len", "-s", help="Tokens per sequence: 131072, 128k, 512K, 1M (k = 1024, M = 1024^2)."),
    model: str = typer.Option("llama-2-7b", "--model", "-m", help="Profile name (seqpar profiles list), Hub id, or a local config.json / folder."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU profile of the declared cluster, e.g. a100, h100, h200."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="GPUs per node of the declared cluster."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Nodes of the declared cluster."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="cpu:N for N gloo CPU ranks (instead of --gpu/--gpus/--nodes)."),
    host_ram_gib: Optional[float] = typer.Option(None, "--host-ram-gib", min=1, help="Host RAM per node, GiB (default: 2x the node's GPU memory)."),
    mode: Optional[Mode] = typer.Option(None, "--mode", help="Pin the sequence-parallel mode."),
    sp_degree: Optional[int] = typer.Option(None, "--sp-degree", min=1, help="Pin the sequence-parallel degree."),
    ulysses_degree: Optional[int] = typer.Option(None, "--ulysses-degree", min=1, help="Pin the Ulysses degree (usp_attn)."),
    checkpointing: Optional[Checkpointing] = typer.Option(None, "--checkpointing", help="Pin activation checkpointing."),
    sharding: Optional[Sharding] = typer.Option(None, "--sharding", help="Pin model-state sharding."),
    optimizer: Optimizer = typer.Option("adamw", "--optimizer", help="Optimizer of the workload."),
    loss_impl: Optional[LossImpl] = typer.Option(None, "--loss-impl", help="Pin the loss implementation."),
    micro_batch: int = typer.Option(1, "--micro-batch", min=1, help="Sequences per data-parallel rank per forward pass."),
    tokens_per_step: Optional[int] = typer.Option(None, "--tokens-per-step", min=1, help="Tokens per optimizer step (sets gradient accumulation)."),
    policy: Optional[Literal["rules", "cost"]] = typer.Option(None, "--policy", help="rules: the guide's tree; cost: the cost-model search (default when installed)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the plan here (atomically; nothing is written on error)."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON on stdout (only JSON)."),
):
    """Advise a launch plan: which sequence-parallel mode, degrees, checkpointing and sharding, with the reasons.

    The cluster comes from the flags, else from the probe (NVML), else the default (8x A100-80G SXM, EasyContext's hardware);
    stderr says which.

    **Examples**

        seqpar advise --seq-len 512k
        seqpar advise --seq-len 1M --model llama-3-8b --gpu h100 --gpus 8 --nodes 2 -o plan.json
        seqpar advise --seq-len 256 --model tiny --cluster cpu:2 -o plan.json
        seqpar advise --seq-len 128k --mode zigzag_ring_attn --policy rules --json
    """
    from seqpar.advisor.advise import advise as run_advice, default_policy
    from seqpar.advisor.cluster import resolve_cluster
    from seqpar.advisor.request import AdviseRequest
    from seqpar.profiles import get_model

    n = parse_seq_len(seq_len)
    note(f"seq_len {n} ({format_tokens(n)})")
    spec = get_model(model)
    cl, cluster_note = resolve_cluster(gpu, gpus, nodes, cluster, host_ram_gib)
    note(f"cluster: {cluster_note}")
    req = AdviseRequest(
        model=spec, seq_len=n, cluster=cl, micro_batch_size=micro_batch, tokens_per_step=tokens_per_step,
        dtype="fp32" if cl.accelerator == "cpu" else "bf16", optimizer=optimizer, policy=policy or default_policy(),
        mode=mode, sp_degree=sp_degree, ulysses_degree=ulysses_degree, checkpointing=checkpointing, sharding=sharding, loss_impl=loss_impl,
    )
    notes: list[str] = []
    plan = run_advice(req, cluster_note, notes)
    for line in notes:
        note(f"note: {line}")
    if output is not None:
        from seqpar.advisor.rules import launch_spec

        plan = plan.model_copy(update={"launch": launch_spec(plan.cluster, str(output))})
        plan = LaunchPlan.model_validate(plan.model_dump())  # re-validate the edited plan before it touches disk
        plan.write(output)
        note(f"wrote {output}")
    if json_out:
        print_json(plan.to_json().rstrip("\n"))
    else:
        from seqpar.advisor.report import render_plan

        render_plan(plan, stdout())


# --------------------------------------------------------------------------------------------- explain, schema


@app.command()
@handle_errors
def explain(
    plan_path: Path = typer.Argument(..., metavar="PLAN.json", help="A plan written by `seqpar advise -o`."),
    json_out: bool = typer.Option(False, "--json", help="Print the validated plan as JSON on stdout."),
):
    """Validate a plan and explain it: workload, cluster, strategy, prediction, the rules followed and why.

    **Examples**

        seqpar explain plan.json
        seqpar explain plan.json --json
    """
    plan = LaunchPlan.load(plan_path)
    if json_out:
        print_json(plan.to_json().rstrip("\n"))
        return
    from seqpar.advisor.report import render_plan

    render_plan(plan, stdout())


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
    from seqpar.advisor.report import cluster_line, probe_tables

    con = stdout()
    for t in probe_tables(res):
        con.print(t)
    con.print(f"advise would use: {cluster_line(cl)}" if cl else f"advise would use the flags or the default cluster ({why or res.reason})")


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
    from seqpar.advisor.report import profile_tables

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
    from seqpar.advisor.report import spec_table

    stdout().print(spec_table(spec))


def main() -> None:
    """Console-script entry (`seqpar`)."""
    app(prog_name="seqpar")


if __name__ == "__main__":
    main()
