"""The `seqpar` command line: assembles commands; the work lives in seqpar.advisor (and seqpar.runtime for launching).

Conventions for every command (others add theirs here with small edits):
- the docstring is the help and ends with an Examples section: a fenced block, one command per line of at most 76
  characters, so `--help` shows each on one line at 80 columns (commands use ReadableCommand for the same reason);
- ``--json`` puts only JSON on stdout, human text goes to stderr;
- exit 0 ok, 1 a known failure (`check`: risks OOM; `advise`: nothing fits; `launch`: the job failed, or the plan is
  predicted not to fit; any: a missing optional dependency, seqpar.plan.extras), 2 bad usage or invalid input (SeqparError,
  one line, nothing written), 3 an internal error (a bug: one line, SEQPAR_DEBUG=1 shows the traceback), 130 interrupted
  (Ctrl-C); wrap the command with ``@handle_errors`` to get this mapping;
- text from a plan or any other file is printed literally: ``literal`` escapes control characters (an ESC[2K in a plan
  would erase the line before it) and ``shown`` also rich markup, so a file cannot restyle or hide what the terminal shows.
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
from typer.core import TyperCommand, TyperGroup

from seqpar.cli.eval_work import EvalOptions
from seqpar.cli.literal import literal, shown
from seqpar.cli.options import (
    OUTPUT,
    RequestFlags,
    TrainingFlags,
    advise_request,
    parse_checkpoint_every,
    request_doc_mix,
    with_request_flags,
    with_training_flags,
)
from seqpar.plan.errors import SeqparError
from seqpar.plan.extras import MissingExtra, from_error
from seqpar.plan.files import first_error
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.options import KEEP_LAST
from seqpar.plan.units import format_tokens, parse_seq_len

app = typer.Typer(
    name="seqpar",
    help="Plan, check and run sequence-parallel long-context training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
ADVICE = "Advice"


class ReadableCommand(TyperCommand):
    """A command whose --help reads at 80 columns: an option with many choices shows a short name (MODE) in the type
    column, which rich would otherwise fold mid-word, and lists its choices in its help text instead."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.params:
            desc = getattr(p, "type_descriptor", None)  # typer >= 0.2x; older typer keeps click's Choice in p.type
            choices = (
                (desc.choices if desc.is_choice else None)
                if desc is not None
                else getattr(getattr(p, "type", None), "choices", None)
            )
            if choices and p.metavar is None and len(" ".join(map(str, choices))) > 16:
                p.metavar = p.opts[-1].lstrip("-").upper().replace("-", "_")
                p.help = f"{p.help or ''} One of: {', '.join(map(str, choices))}.".strip()


profiles_app = typer.Typer(help="GPU, link and model profiles seqpar knows.", no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(profiles_app, name="profiles")


def stdout() -> Console:
    return Console(file=sys.stdout, soft_wrap=True)


def stderr() -> Console:
    return Console(file=sys.stderr, soft_wrap=True)


EXIT_OOM_OR_FAILED, EXIT_INVALID, EXIT_INTERNAL, EXIT_INTERRUPTED = 1, 2, 3, 130


def note(text: str) -> None:
    """A line for a person, on stderr (stdout stays clean for --json); printed literally."""
    typer.echo(literal(text), err=True)


def say(text: str) -> None:
    """A line for a person on stdout (commands without --json), printed literally."""
    typer.echo(literal(text))


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
    """Map exceptions to exit codes: SeqparError/ValidationError -> 2 (invalid input), a missing optional dependency
    (seqpar.plan.extras) -> 1 with the extra to install, Ctrl-C -> 130, any other error -> 3 (internal: never 1, which `check`
    and `launch` give a meaning; SEQPAR_DEBUG=1 re-raises). One line each."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _PASS_THROUGH:
            raise
        except SeqparError as e:
            note(f"error: {literal(str(e), newlines=False)}")
            raise typer.Exit(EXIT_INVALID) from None
        except MissingExtra as e:  # the install lacks an optional dependency: a known failure, not bad input
            note(f"error: {literal(str(e), newlines=False)}")
            raise typer.Exit(EXIT_OOM_OR_FAILED) from None
        except ValidationError as e:
            note(f"error: {literal(first_error(e), newlines=False)}")
            raise typer.Exit(EXIT_INVALID) from None
        except KeyboardInterrupt:
            note("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as e:
            if os.environ.get("SEQPAR_DEBUG"):
                raise
            missing = from_error(e) if isinstance(e, ModuleNotFoundError) else None
            if missing is not None:  # an optional dependency (seqpar.plan.extras) imported deep in a command
                note(f"error: {missing}")
                raise typer.Exit(EXIT_OOM_OR_FAILED) from None
            first = str(e).splitlines()[0] if str(e) else ""
            note(
                f"internal error: {type(e).__name__}: {literal(first, newlines=False)} (a bug in seqpar; "
                f"run with SEQPAR_DEBUG=1 to see the traceback)"
            )
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


def print_json(obj) -> None:
    typer.echo(obj if isinstance(obj, str) else json.dumps(obj, indent=2))


# --------------------------------------------------------------------------------------------- advise


@app.command(cls=ReadableCommand)
@handle_errors
@with_request_flags
@with_training_flags
def advise(
    flags: RequestFlags,
    training: TrainingFlags,
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
    emit_tool: Optional[Literal["accelerate", "trl", "axolotl", "arctic", "deepspeed"]] = typer.Option(
        None,
        "--emit",
        rich_help_panel=OUTPUT,
        help="Also write, next to the plan (-o), the config this tool runs with the same strategy (or the nearest it has, "
        "with a line per change) and print its command; exit 1, nothing written, when that is predicted to OOM.",
    ),
):
    """Advise a launch plan: which sequence-parallel mode, degrees, checkpointing and sharding, with the reasons.

    The cluster comes from the flags, else from the probe (NVML), else the default (8x A100-80G SXM, EasyContext's hardware);
    stderr says which. The plan carries the training settings (Training options) and its predicted bill: wall time and
    GPU-hours of the whole run. Exit 0 with a plan that fits, 1 when no strategy fits (the plan is still written with -o,
    for `seqpar explain`), 2 invalid input.

    **Examples**

    ```
    seqpar advise --seq-len 512k
    seqpar advise -s 1M -m llama-3-8b --gpu h100 --gpus 8 --nodes 2 -o plan.json
    seqpar advise -s 1k -m tiny --cluster cpu:2 --mode zigzag_ring_attn
    seqpar advise -s 128k --mode zigzag_ring_attn --policy rules --json
    seqpar advise -s 512k --steps 2000 --lr 1e-5 --warmup 100 --rope-theta 2.5e8
    seqpar advise --recipe 1M -m llama-2-7b -o plan.json
    seqpar advise --max-seq-len --gpu h200 --gpus 8
    seqpar advise -s 64k --gpu h200 --gpus 1 --tiled-mlp --fused-ops liger
    seqpar advise -s 128k -m Qwen/Qwen2.5-7B --gpus 8 -o p.json --emit trl
    ```
    """
    from seqpar.advisor.advise import advise as run_advice
    from seqpar.advisor.training import apply_training, rope_warning

    if max_seq_len:
        if emit_tool is not None:
            raise SeqparError(f"--emit {emit_tool} writes the config of a plan; --max-seq-len writes no plan: drop one of them")
        return _max_seq_len_command(flags, json_out)
    seq_len = flags.seq_len
    if recipe is not None and seq_len is None:  # the recipe's last stage; every stage is planned below
        from seqpar.advisor.recipe import recipe_seq_len

        seq_len = str(recipe_seq_len(recipe))
    if seq_len is None:
        raise SeqparError("--seq-len is required (e.g. --seq-len 128k), unless you ask for --max-seq-len")
    n = parse_seq_len(seq_len)
    note(f"seq_len {n} ({format_tokens(n)})")
    overrides = training.overrides()  # bad values refused before the search runs
    req, cluster_note = advise_request(flags, n, policy or "cost", note)
    if recipe is not None:
        from seqpar.advisor.recipe import advise_recipe

        plan = advise_recipe(req, recipe, cluster_note)
    else:
        plan = run_advice(req, cluster_note)
    plan = apply_training(plan, overrides, recipe)
    if output is not None:
        from seqpar.plan.jobspec import launch_spec

        plan = plan.model_copy(update={"launch": launch_spec(plan, output)})
        plan = LaunchPlan.model_validate(plan.model_dump())  # re-validate the edited plan before it touches disk
        emission = _emission(plan, emit_tool, output)
        plan.write(output)
        note(f"wrote {output}")
        if emission is not None:
            from seqpar.emit import emission_lines, write_emission

            write_emission(emission)
            for line in emission_lines(emission):
                note(line)
    elif emit_tool is not None:
        raise SeqparError(f"--emit {emit_tool} writes its config next to the plan: add -o plan.json")
    if json_out:
        print_json(plan.to_json().rstrip("\n"))
    else:
        from seqpar.advisor.render import render_plan

        render_plan(shown(plan), stdout(), shown(str(output)) if output is not None else None)
    warning = rope_warning(plan)
    if warning:
        note(f"warning: {warning}")
    unfit = _does_not_fit(plan)
    if unfit:
        kept = f"the plan was written to {output} (seqpar explain {output} shows the memory)" if output else "nothing written"
        note(f"error: no strategy fits: {unfit}; {kept}")
        raise typer.Exit(EXIT_OOM_OR_FAILED)


def _does_not_fit(plan: LaunchPlan) -> str | None:
    """Why the plan's predicted memory does not fit (the plan or one of its stages), or None (also without a prediction)."""
    parts = [("", plan.prediction)] + [(f"stage {i}: ", st.prediction) for i, st in enumerate(plan.stages)]
    for where, p in parts:
        if p is not None and p.oom_risk:
            why = next((r.removeprefix("nothing fits: ") for r in plan.rationale.reasons if r.startswith("nothing fits")), None)
            why = None if where else why
            return why or (
                f"{where}predicted {p.reserved_memory_gib:.1f} GiB reserved (peak allocated {p.peak_memory_gib:.1f} GiB) "
                f"+ headroom exceeds {p.capacity_gib:.1f} GiB per GPU, or host RAM is short; see seqpar advise --max-seq-len"
            )
    return None


def _emission(plan: LaunchPlan, tool: str | None, output: Path):
    """The --emit config for ``plan`` (None without --emit); exit 1 before anything is written when it risks OOM."""
    if tool is None:
        return None
    from seqpar.emit import emission_lines, emit

    em = emit(plan, tool, output)
    if not em.fits:
        for line in emission_lines(em)[: -1 - len(em.files)]:  # the verdict and the notes: nothing was written
            note(line)
        note(f"{tool}'s nearest strategy is predicted to run out of memory; nothing written (seqpar launch runs the plan)")
        raise typer.Exit(EXIT_OOM_OR_FAILED)
    return em


# --------------------------------------------------------------------------------------------- explain, schema


@app.command(cls=ReadableCommand)
@handle_errors
def explain(
    plan_path: Path = typer.Argument(..., metavar="PLAN.json", help="A plan written by `seqpar advise -o`."),
    json_out: bool = typer.Option(False, "--json", help="Print the validated plan as JSON on stdout."),
    plot: Optional[Path] = typer.Option(
        None,
        "--plot",
        help="Write two PNGs: predicted peak memory vs seq_len per mode with the GPU's capacity (PATH), and the plan's "
        "memory by phase as stacked bars (PATH's name + -phases). Needs matplotlib (seqpar[plot]).",
    ),
):
    """Validate a plan and explain it: workload, cluster, strategy, prediction, training, bill, the rules and why.

    The Training section states the schedule, the checkpoint interval (about hourly by default, from the predicted step
    time) and the RoPE base (a warning when the plan trains past the model's positions without raising it); the
    predicted bill is the wall time and GPU-hours of the whole run (each stage of a recipe, and the recipe).

    **Examples**

    ```
    seqpar explain plan.json
    seqpar explain plan.json --json
    seqpar explain plan.json --plot memory.png
    ```
    """
    plan = LaunchPlan.load(plan_path)
    if plot is not None:
        from seqpar.advisor.plots import explain_plots

        for path in explain_plots(plan, plot):
            note(f"wrote {path}")
    if json_out:
        print_json(plan.to_json().rstrip("\n"))
        return
    from seqpar.advisor.render import render_plan

    plan = shown(plan)  # the plan's text printed literally, never as markup or terminal control
    render_plan(plan, stdout(), shown(str(plan_path)))
    from seqpar.advisor.explain import explain_tables  # the cost model's breakdowns (memory, time, alternatives)

    for t in explain_tables(plan):
        stdout().print(t)


# --------------------------------------------------------------------------------------------- check, max context, calibrate


@app.command(cls=ReadableCommand)
@handle_errors
@with_request_flags
def check(
    flags: RequestFlags,
    paths: Optional[list[Path]] = typer.Argument(
        None,
        metavar="[PLAN.json | CONFIG...]",
        help="A plan written by `seqpar advise -o`, or one launch's tool configs (accelerate YAML, TRL arguments, Axolotl "
        "or ArcticTraining YAML, DeepSpeed JSON); without it, the flags below describe one.",
    ),
    json_out: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT, help="Print the verdict as JSON on stdout."),
):
    """Pre-launch OOM gate: exit 0 when the plan fits, 1 when it risks OOM (with the cheapest fix), 2 when it is invalid.

    Tool configs (accelerate, TRL, Axolotl, ArcticTraining, DeepSpeed) are mapped onto the cost model and judged the
    same way; the fix is named in the tool's own keys, and keys that change memory but are not modelled make it partial.
    With a plan it is re-evaluated on the plan's cluster, or on the Cluster flags' when given; without one, the Workload,
    Cluster and Pins flags describe the configuration, as for `seqpar advise` (the cost model picks whatever is not pinned).

    **Examples**

    ```
    seqpar check plan.json
    seqpar check plan.json --gpu a100-40g --gpus 8
    seqpar check -s 64k --gpu h200 --gpus 1 --mode data_parallel --sharding ddp
    seqpar check -s 128k --gpu h200 --gpus 1 --checkpointing offload --tiled-mlp
    seqpar check axolotl.yaml --gpu h100 --gpus 8
    seqpar check sft.yaml accelerate.yaml --gpu h200
    ```
    """
    from seqpar.advisor.cluster import resolve_cluster, with_pinned_host
    from seqpar.advisor.explain import check_lines
    from seqpar.advisor.gate import check as run_check
    from seqpar.emit.check import is_plan_file

    if paths and (len(paths) > 1 or not is_plan_file(paths[0])):  # a tool's configs: seqpar.emit reads them
        from seqpar.emit.gate import check_configs, config_json, config_lines

        got = check_configs(paths, flags, note)
        if json_out:
            print_json(config_json(got))
        else:
            for line in config_lines(got):
                (say if got.fits else note)(line)
        raise typer.Exit(0 if got.fits else EXIT_OOM_OR_FAILED)
    plan_path = paths[0] if paths else None
    if plan_path is not None:  # re-checked on its own cluster, or on the Cluster flags' (the plan's node shape fills the gaps)
        target = LaunchPlan.load(plan_path)
        mix = request_doc_mix(flags, target.workload.seq_len, target.workload.model.vocab_size)
        if mix is not None:  # --doc-lens / --mean-doc-len / --data: the plan re-checked on that document mix
            target = target.model_validate({**target.model_dump(), "workload": {**target.workload.model_dump(), "doc_lens": mix}})
        f, c = flags, target.cluster
        declared = any(x is not None for x in (f.gpu, f.gpus, f.nodes, f.cluster))
        if declared:
            cl = resolve_cluster(f.gpu, f.gpus or c.gpus_per_node, f.nodes or c.nodes, f.cluster, f.host_ram_gib)[0]
        elif f.host_ram_gib is not None or f.pinned_host_gib is not None:  # the plan's cluster with another host
            ram = c.host_ram_gib if f.host_ram_gib is None else f.host_ram_gib
            cl = c.model_copy(update={"host_ram_gib": ram, "pinned_host_gib": None})
        else:
            cl = None
        if cl is not None:  # the flag's budget, else the one the plan states (the one seqpar launch would pin)
            own = f.pinned_host_gib is None
            pinned = c.pinned_host_gib if own else f.pinned_host_gib
            cl = with_pinned_host(cl, pinned, "the plan's pinned_host_gib" if own else "--pinned-host-gib")
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
            (say if res.fits else note)(line)
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


@app.command(cls=ReadableCommand)
@handle_errors
def calibrate(
    reports: list[Path] = typer.Argument(
        ...,
        metavar="REPORT...",
        help="Run reports written by `seqpar launch` (run_report.json), their run folders (--output of seqpar launch; "
        "a recipe's stage-*/ too), or measurement CSVs.",
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Write the refitted coefficients here (load them with SEQPAR_COEFFICIENTS)."
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print the fit (coefficients, residuals, leave-one-out) as JSON on stdout."
    ),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Write a PNG: every run's measured tokens/s and peak memory against the refitted prediction."
    ),
):
    """Refit the cost model's coefficients to measured runs (plus the shipped measurements); report residuals and leave-one-out.

    `seqpar launch` writes `run_report.json` into its --output folder (default runs/PLAN); give the reports or the folders.

    **Examples**

    ```
    seqpar calibrate runs/*/run_report.json -o coefficients.json
    seqpar calibrate runs/plan --json
    seqpar calibrate runs/a runs/b --plot fit.png
    ```
    """
    from seqpar.advisor.cost.fit import calibrate as run_calibrate
    from seqpar.advisor.cost.fit import run_reports
    from seqpar.advisor.cost.measurements import load_measurements

    res = run_calibrate(run_reports(reports), output)
    if output is not None:
        note(f"wrote {output}")
    if plot is not None:
        from seqpar.advisor.plots import measured_vs_predicted_figure, save

        shipped = len(load_measurements())  # calibrate fits the shipped rows first, then the given ones
        note(f"wrote {save(measured_vs_predicted_figure(res.rows[:shipped], res.rows[shipped:]), plot)}")
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
        say(
            f"{e['label']:<45} tokens/s measured {e['measured_tokens_per_s'] or '-'!s:>9} predicted {e['predicted_tokens_per_s']:>10,.0f} "
            f"residual {'' if r is None else f'{r:+.1%}':>7} LOO {'' if l is None else f'{l:+.1%}':>7}"
        )
    typer.echo(f"max |residual| {res.max_abs_residual:.1%}, max |LOO| {res.max_abs_loo:.1%}")


@app.command(cls=ReadableCommand)
@handle_errors
def schema():
    """Print the JSON schema of a launch plan (the format `seqpar advise -o` writes and `seqpar launch` reads).

    **Examples**

    ```
    seqpar schema > plan.schema.json
    ```
    """
    print_json(LaunchPlan.model_json_schema())


# --------------------------------------------------------------------------------------------- probe, profiles


@app.command(cls=ReadableCommand)
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


# --------------------------------------------------------------------------------------------- launch


@app.command(cls=ReadableCommand)
@handle_errors
def launch(
    plan_path: Path = typer.Argument(..., metavar="PLAN.json", help="A plan written by `seqpar advise -o`."),
    steps: Optional[int] = typer.Option(
        None, "--steps", min=1, help="Optimizer steps (default: the plan's; per stage for staged plans)."
    ),
    data: str = typer.Option(
        "synthetic",
        "--data",
        help='synthetic, a .jsonl of {"text"} or {"messages"} rows, a .bin/.npy token file, or a datasets folder.',
    ),
    no_doc_boundaries: bool = typer.Option(
        False, "--no-doc-boundaries", help="Concatenate documents into windows that attend across them (the older stream)."
    ),
    long_documents: str = typer.Option(
        "split", "--long-documents", help="A document longer than seq_len: split (into window-sized pieces), truncate, error."
    ),
    data_cache: Optional[str] = typer.Option(
        None, "--data-cache", help="Folder of the tokenized-data cache (default ~/.cache/seqpar/data)."
    ),
    data_procs: Optional[int] = typer.Option(None, "--data-procs", min=1, help="Tokenizer processes (default: the cores)."),
    tokenizer: Optional[str] = typer.Option(
        None, "--tokenizer", help="Local tokenizer folder for text data (default: --model-path's)."
    ),
    model_path: Optional[str] = typer.Option(
        None,
        "--model-path",
        help="Hugging Face model folder or Hub id (owner/name, from the HF cache or downloaded; HF_TOKEN for gated "
        "repos, HF_HUB_OFFLINE=1: cache only). Default: the plan's model, random weights.",
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
    report_to: str = typer.Option(
        "",
        "--report-to",
        help="tensorboard,wandb: also log metrics there (accelerate's trackers; the run id survives --resume).",
    ),
    project: Optional[str] = typer.Option(None, "--project", help="Tracker project (default: seqpar)."),
    run_name: Optional[str] = typer.Option(None, "--run-name", help="Tracker run name (default: the output folder's name)."),
    checkpoint_every: Optional[str] = typer.Option(
        None,
        "--checkpoint-every",
        metavar="N|auto",
        help="Steps between checkpoints: 0 = only the final one, auto = about hourly (default: the plan's).",
    ),
    keep_last: Optional[int] = typer.Option(
        None,
        "--keep-last",
        min=0,
        help=f"Checkpoints kept, newest first; 0 = all (default: the plan's training.keep_last, else {KEEP_LAST}).",
    ),
    log_every: Optional[int] = typer.Option(
        None, "--log-every", min=1, help="A log line every N steps when there is no progress bar (default 10)."
    ),
    fsdp_cpu_offload: bool = typer.Option(
        False,
        "--fsdp-cpu-offload",
        help="FSDP2 plans on GPUs: keep parameters and optimizer state in host RAM (slower; not in the plan's prediction).",
    ),
    no_final_checkpoint: bool = typer.Option(
        False, "--no-final-checkpoint", help="No checkpoint or export after the last step (benchmarks)."
    ),
    skip_nonfinite: bool = typer.Option(
        False, "--skip-nonfinite", help="Skip the update of a step with a non-finite loss instead of stopping."
    ),
    profile_step: Optional[int] = typer.Option(
        None,
        "--profile-step",
        min=1,
        metavar="N",
        help="Run step N under torch.profiler: a Chrome trace and a summary (kernel busy time, idle gaps, exposed host "
        "copies, allocator retries) per rank in <output>/profile; that step stays out of the measured speed.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the exact command and generated configs; run nothing."),
    force: bool = typer.Option(
        False, "--force", help="Run even when the plan's cluster does not match this machine, or its prediction says OOM."
    ),
    allow_env: list[str] = typer.Option(
        [],
        "--allow-env",
        metavar="NAME",
        help="Let the plan's launch.env set NAME beyond the allow-list (SEQPAR_*, NCCL_*, TORCH_NCCL_*, CUDA_*, allocator "
        "and thread settings); only for plans you trust: PYTHONPATH, LD_PRELOAD or PATH make the job run other code.",
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
    from seqpar.cli.launch_text import bill_header, launch_tracker_flags, oom_verdict, refuse_fsdp_offload, run_summary
    from seqpar.runtime.data.windows import POLICIES, DataOptions
    from seqpar.runtime.launch.run import LaunchOptions
    from seqpar.runtime.launch.run import launch as run_launch

    if long_documents not in POLICIES:
        raise SeqparError(f"--long-documents {long_documents!r} is not one of {', '.join(POLICIES)}; e.g. --long-documents split")
    data_flags = DataOptions(not no_doc_boundaries, long_documents, data_cache, data_procs, tokenizer).flags()
    tracker_flags = launch_tracker_flags(report_to, project, run_name)
    plan = LaunchPlan.load(plan_path, allow_env=allow_env)
    if fsdp_cpu_offload:
        refuse_fsdp_offload(plan)
    verdict = oom_verdict(plan)
    if verdict and dry_run:
        note(f"warning: {verdict}")
    elif verdict and not force:
        note(f"error: {verdict}")
        raise typer.Exit(EXIT_OOM_OR_FAILED)
    if model_path is not None and not Path(model_path).expanduser().exists():  # a Hub id: its snapshot in the HF cache
        from seqpar.profiles.hub import snapshot

        model_path = str(snapshot(model_path, weights=not dry_run))
        note(f"--model-path: {model_path}")
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
        checkpoint_every=parse_checkpoint_every(checkpoint_every) if checkpoint_every is not None else None,
        keep_last=keep_last,
        final_checkpoint=not no_final_checkpoint,
        skip_nonfinite=skip_nonfinite,
        extra=data_flags  # the trainer's data flags; the launcher's data check reads them too
        + tracker_flags
        + (["--log-every", str(log_every)] if log_every else [])
        + (["--fsdp-cpu-offload"] if fsdp_cpu_offload else [])
        + (["--profile-step", str(profile_step)] if profile_step else []),
        allow_env=list(allow_env),
    )
    if verify_first and not dry_run:
        _verify(plan, plan_path, opts, None, json_out=False)
    header = bill_header(plan, steps)
    if dry_run:
        header = [f"# {line}" for line in header]
    rc = run_launch(plan, plan_path, opts, dry_run=dry_run, echo=say if dry_run else note, header=header)
    if rc:
        raise typer.Exit(rc)
    if not dry_run:
        for line in run_summary(plan, plan_path, opts):
            note(line)


# --------------------------------------------------------------------------------------------- eval


class _PerplexityByDefault(TyperGroup):
    """`seqpar eval PLAN.json ...` runs `seqpar eval perplexity PLAN.json ...`; `seqpar eval needle ...` names its command."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["perplexity", *args]
        return super().parse_args(ctx, args)


eval_app = typer.Typer(
    cls=_PerplexityByDefault,
    help="Forward-only evaluation in a plan's layout: held-out loss and perplexity by position (`seqpar eval PLAN.json` "
    "is `seqpar eval perplexity PLAN.json`), and the needle in a haystack (`seqpar eval needle PLAN.json`).",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(eval_app, name="eval")

PLAN_ARG = typer.Argument(..., metavar="PLAN.json", help="A plan written by `seqpar advise -o`: its mode and degrees are used.")
MODEL_PATH = typer.Option(
    None,
    "--model-path",
    help="Local model folder: transformers' save_pretrained, or seqpar launch's run / checkpoint (its model/). "
    "Default: the plan's model with random weights.",
)
EVAL_OUTPUT = typer.Option(None, "--output", help="Report and plot go here (default runs/eval-PLAN, PLAN the plan file's name).")
EVAL_JSON = typer.Option(False, "--json", help="Print the report as JSON on stdout (only JSON).")
MAX_LEN = typer.Option(False, "--max-seq-len", help="Only print the longest length the plan's cluster can evaluate (advisor).")
FORCE = typer.Option(False, "--force", help="Run even when the plan's cluster does not match this machine.")


def _eval(task: str, plan_path: Path, lengths: list[int] | None, runtime_args: list[str], o: EvalOptions) -> None:
    """seqpar.cli.eval_work does the work; here only the output goes where --json wants it."""
    from seqpar.cli.eval_work import run_eval, show

    rc, report = run_eval(task, plan_path, lengths, runtime_args, o, note)
    if rc:
        raise typer.Exit(rc)
    if "lengths" in report:
        show(task, report, o, stderr() if o.json_out else stdout(), note)
    if o.json_out:
        print_json(report)


def _lengths(values: Optional[list[str]]) -> list[int] | None:
    return [parse_seq_len(x) for v in values or [] for x in v.split(",") if x.strip()] or None


@eval_app.command("perplexity", cls=ReadableCommand)
@handle_errors
def eval_perplexity(
    plan_path: Path = PLAN_ARG,
    model_path: Optional[str] = MODEL_PATH,
    data: str = typer.Option(
        "synthetic", "--data", help="Held-out data: a .jsonl text file, .bin/.npy tokens, a datasets folder, or synthetic."
    ),
    seq_len: Optional[list[str]] = typer.Option(
        None, "--seq-len", "-s", help="Length(s) to evaluate: repeat it or give a comma list (64k,128k); default the plan's."
    ),
    windows: int = typer.Option(4, "--windows", min=1, help="Windows per length, shared out over the data-parallel groups."),
    buckets: int = typer.Option(16, "--buckets", min=1, help="Position buckets per length (the loss by position)."),
    output: Optional[Path] = EVAL_OUTPUT,
    json_out: bool = EVAL_JSON,
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of loss vs position, one line per length."),
    max_seq_len: bool = MAX_LEN,
    force: bool = FORCE,
):
    """Exact held-out loss and perplexity at each length, and the loss by position bucket, forward only in the plan's layout.

    Every token of every window counts once (float64 sums over all ranks), so the numbers are the same for every mode and
    degree. Prints the advisor's forward-only memory and tokens/s first; writes `eval.json` (measured beside predicted) and
    a plot of loss vs position into `--output`.

    **Examples**

    ```
    seqpar eval plan.json --data heldout.npy --seq-len 32k,64k,128k
    seqpar eval plan.json --model-path runs/plan --data test.jsonl --json
    seqpar eval plan.json --max-seq-len
    seqpar eval plan.json --windows 2
    ```
    """
    o = EvalOptions(model_path, data, output, json_out, plot, max_seq_len, force)
    _eval("perplexity", plan_path, _lengths(seq_len), ["--windows", str(windows), "--buckets", str(buckets)], o)


@eval_app.command("needle", cls=ReadableCommand)
@handle_errors
def eval_needle(
    plan_path: Path = PLAN_ARG,
    model_path: Optional[str] = MODEL_PATH,
    lengths: Optional[list[str]] = typer.Option(
        None, "--lengths", help="Context lengths, comma list (8k,16k,32k); default the plan's seq_len."
    ),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="Needle depths, fractions of the haystack."),
    samples: int = typer.Option(1, "--samples", min=1, help="Needles (7-digit numbers) per (length, depth)."),
    data: Optional[str] = typer.Option(
        None,
        "--data",
        help="Haystack: held-out data (as for perplexity); default seqpar's filler text, or random ids without a tokenizer.",
    ),
    output: Optional[Path] = EVAL_OUTPUT,
    json_out: bool = EVAL_JSON,
    plot: Optional[Path] = typer.Option(None, "--plot", help="The heatmap PNG (rows depths, columns lengths)."),
    max_seq_len: bool = MAX_LEN,
    force: bool = FORCE,
):
    """Needle in a haystack (EasyContext's test): a 7-digit number hidden at each depth of a prompt of each length.

    Scored teacher-forced from one forward: exact match (every answer token is the argmax at its position, EasyContext's
    score) and the answer's log-likelihood given the haystack; both exact under sequence parallelism. With a tokenizer
    in --model-path the prompts are text; without one (random-weight plans) token ids with a fixed random needle.
    Writes `needle.json` and a heatmap into `--output`.

    **Examples**

    ```
    seqpar eval needle plan.json --model-path ./my-model --lengths 8k,16k,32k
    seqpar eval needle plan.json --lengths 1k,2k --depths 0,0.5,1 --samples 4
    ```
    """
    try:
        dl = [float(x) for x in depths.split(",") if x.strip()]
    except ValueError:
        raise SeqparError(f"--depths {depths!r} must be a comma list of fractions in [0, 1], e.g. 0,0.25,0.5,0.75,1") from None
    o = EvalOptions(model_path, data, output, json_out, plot, max_seq_len, force, dl, samples)
    _eval("needle", plan_path, _lengths(lengths), ["--depths", depths, "--samples", str(samples)], o)


# --------------------------------------------------------------------------------------------- verify


def _check_machine(plan: LaunchPlan, plan_path: Path, nnodes: Optional[int]) -> None:
    from seqpar.cli.eval_work import check_this_machine

    check_this_machine(plan, plan_path, nnodes)


@app.command(cls=ReadableCommand)
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

    ```
    seqpar verify plan.json
    seqpar verify plan.json --seq-len 32k --model-path ./llama --json
    ```
    """
    from seqpar.runtime.launch.run import LaunchOptions

    plan = LaunchPlan.load(plan_path)
    if not force:
        _check_machine(plan, plan_path, nnodes)
    opts = LaunchOptions(
        data=data, model_path=model_path, output=str(output) if output else None, nnodes=nnodes, node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
    )  # fmt: skip
    _verify(plan, plan_path, opts, parse_seq_len(seq_len) if seq_len else None, json_out=json_out)


def _verify(plan: LaunchPlan, plan_path: Path, opts, seq_len: Optional[int], *, json_out: bool) -> None:
    from seqpar.runtime.train import verify

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
