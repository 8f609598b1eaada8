"""`seqpar probe` and `seqpar profiles`: this machine through NVML, and the GPU, link and model profiles seqpar knows."""

from __future__ import annotations

import typer

from seqpar.cli.base import ReadableCommand, handle_errors, print_json, stdout
from seqpar.cli.literal import shown
from seqpar.plan.errors import SeqparError

profiles_app = typer.Typer(help="GPU, link and model profiles seqpar knows.", no_args_is_help=True, rich_markup_mode="markdown")


@handle_errors
def probe(json_out: bool = typer.Option(False, "--json", help="Print the probe result as JSON on stdout.")):
    """Describe this machine through NVML: GPUs, memory, NVLinks, topology, PCIe, nodes, host RAM, InfiniBand.

    Without an NVIDIA driver it says so (exit 0); `seqpar advise` then uses the flags or the default cluster.

    **Examples**

    ```
    seqpar probe
    seqpar probe --json
    ```
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


@profiles_app.command("list", cls=ReadableCommand)
@handle_errors
def profiles_list(json_out: bool = typer.Option(False, "--json", help="Print every profile as JSON on stdout.")):
    """List the GPU, link and model profiles.

    **Examples**

    ```
    seqpar profiles list
    seqpar profiles list --json
    ```
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


@profiles_app.command("show", cls=ReadableCommand)
@handle_errors
def profiles_show(
    name: str = typer.Argument(..., help="GPU, link or model name, an alias, or a local config.json."),
    json_out: bool = typer.Option(False, "--json", help="Print the profile as JSON on stdout."),
):
    """Show one profile with its figures and their source.

    **Examples**

    ```
    seqpar profiles show h100
    seqpar profiles show llama-3-8b --json
    seqpar profiles show ./my-model/config.json
    ```
    """
    from seqpar.profiles import find_profile

    spec = find_profile(name)
    if json_out:
        print_json(spec.model_dump())
        return
    from seqpar.advisor.render import spec_table

    stdout().print(spec_table(shown(spec)))  # a local config.json's text, printed literally


__all__ = ["probe", "profiles_app"]
