"""`seqpar advise`, `explain` and `schema`: a plan from a request (or the longest sequence that fits), the plan explained,
and the plan's format.

The work lives in seqpar.advisor (and seqpar.emit for --emit and tool configs); the options are RequestFlags and
TrainingFlags (seqpar.cli.options). Importing this module imports neither torch nor the advisor.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Literal, Optional

import typer

from seqpar.cli.base import EXIT_OOM_OR_FAILED, handle_errors, note, print_json, say, stdout
from seqpar.cli.glossary import GLOSSARY
from seqpar.cli.literal import shown
from seqpar.cli.options import (
    OUTPUT,
    RequestFlags,
    TrainingFlags,
    advise_request,
    with_request_flags,
    with_training_flags,
)
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.units import format_tokens, parse_seq_len

ADVICE = "Advice"


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
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        rich_help_panel=OUTPUT,
        help="Print the whole plan as seqpar explain does: settings, reasons, alternatives, memory, step time.",
    ),
    emit_tool: Optional[Literal["accelerate", "trl", "axolotl", "arctic", "deepspeed"]] = typer.Option(
        None,
        "--emit",
        rich_help_panel=OUTPUT,
        help="Also write, next to the plan (-o), the config of the fastest strategy this tool can express that fits "
        "(a line per change from the plan) and print its command; exit 1 with the plan but no tool files when nothing "
        "it expresses fits.",
    ),
):
    """Advise a launch plan: which sequence-parallel mode, degrees, checkpointing and sharding, with the reasons.

    The answer fits one screen: the plan, its prediction, its bill (wall time and GPU-hours of the whole run), the
    command to run next and why; --verbose or `seqpar explain plan.json` print the rest (settings, reasons, the
    alternatives). The cluster comes from the flags, else the probe (NVML), else the default (8x A100-80G SXM,
    EasyContext's hardware); stderr says which. Exit 0 with a plan that fits, 1 when no strategy fits (the plan is
    still written with -o, for `seqpar explain`), 2 invalid input.

    **Examples**

    ```
    seqpar advise --seq-len 512k
    seqpar advise --seq-len 512k --verbose
    seqpar advise -s 1M -m llama-3-8b --gpu h100 --gpus 8 --nodes 2 -o plan.json
    seqpar advise -s 1k -m tiny --cluster cpu:2 --mode zigzag_ring_attn
    seqpar advise -s 128k --mode zigzag_ring_attn --policy rules --json
    seqpar advise -s 512k --steps 2000 --lr 1e-5 --warmup 100 --rope-theta 2.5e8
    seqpar advise --recipe 1M -m llama-2-7b -o plan.json
    seqpar advise --max-seq-len --gpu h200 --gpus 8
    seqpar advise -s 64k --gpu h200 --gpus 1 --tiled-mlp --fused-ops liger
    seqpar advise -s 128k -m Qwen/Qwen2.5-7B --gpus 8 -o p.json --emit trl
    seqpar advise --max-seq-len -m llama-3.1-8b --gpus 1 --lora-rank 32 --qlora
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
    if recipe is not None:
        flags = _recipe_defaults(flags, recipe, note)
    req, cluster_note = advise_request(flags, n, policy or "cost", note)
    emission = None
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
        if emit_tool is not None:  # a usage error (a staged plan) is refused before anything is written
            from seqpar.emit import emittable

            emittable(plan, emit_tool)
        plan.write(output)  # whatever the emission's outcome
        note(f"wrote {output}")
        emission = _emission(plan, emit_tool, output, flags.pins())
    elif emit_tool is not None:
        raise SeqparError(f"--emit {emit_tool} writes its config next to the plan: add -o plan.json")
    if json_out:
        print_json(plan.to_json().rstrip("\n"))
    elif verbose:
        _print_explained(shown(plan), shown(str(output)) if output is not None else None, warn=False)
    else:
        from seqpar.advisor.render import render_answer

        where = shown(str(output)) if output is not None else None
        details = f"seqpar explain {where}" if where else "add --verbose"
        render_answer(shown(plan), stdout(), where, details)
    warning = rope_warning(plan)  # said once, here (the Training section of --verbose leaves it out)
    if warning:
        note(f"warning: {warning}")
    unfit = _does_not_fit(plan)
    if unfit:
        kept = f"the plan was written to {output} (seqpar explain {output} shows the memory)" if output else "nothing written"
        note(f"error: no strategy fits: {unfit}; {kept}")
    refused = emission is not None and not emission.files
    if refused:
        from seqpar.emit import refusal_line

        note(f"error: {refusal_line(emission, output)}")  # the last line: what was written, and why the rest was not
    if unfit or refused:
        raise typer.Exit(EXIT_OOM_OR_FAILED)


advise.__doc__ += "\n" + textwrap.indent(GLOSSARY, "    ")  # the words of the answer, after the examples


def _does_not_fit(plan: LaunchPlan) -> str | None:
    """Why the plan's predicted memory does not fit (the plan or one of its stages), or None (also without a prediction)."""
    parts = [("", plan.prediction)] + [(f"stage {i}: ", st.prediction) for i, st in enumerate(plan.stages)]
    for where, p in parts:
        if p is not None and p.oom_risk:
            why = next((r.removeprefix("nothing fits: ") for r in plan.rationale.reasons if r.startswith("nothing fits")), None)
            why = None if where else why
            return why or (
                f"{where}predicted {p.required_memory_gib:.1f} GiB needed (peak allocated {p.peak_memory_gib:.1f} GiB, the "
                f"CUDA context and the allocator's floor) + {p.memory_margin_gib:.1f} GiB margin exceeds the "
                f"{p.capacity_gib:.1f} GiB a process can allocate per GPU, or host RAM is short; see seqpar advise --max-seq-len"
            )
    return None


def _emission(plan: LaunchPlan, tool: str | None, output: Path, pins: dict):
    """The --emit config for ``plan`` (None without --emit): its lines said and, where it has files, the files written.
    Where nothing the tool expresses fits it has none; the caller ends with the refusal line and exit 1."""
    if tool is None:
        return None
    from seqpar.emit import emission_lines, emit, write_emission

    em = emit(plan, tool, output, pins=pins)
    write_emission(em)
    for line in emission_lines(em):
        note(line)
    return em


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
    _print_explained(shown(plan), shown(str(plan_path)))  # the plan's text printed literally, never as markup


def _print_explained(plan: LaunchPlan, plan_path: str | None, warn: bool = True) -> None:
    """`seqpar explain`'s view (also `advise --verbose`): the plan's sections, then the cost model's breakdowns (memory,
    time, alternatives); ``plan`` already passed through ``shown``. ``warn``: the RoPE warning in the Training section."""
    from seqpar.advisor.explain import explain_tables
    from seqpar.advisor.render import render_plan

    render_plan(plan, stdout(), plan_path, warn)
    for t in explain_tables(plan):
        stdout().print(t)


def _recipe_defaults(flags, recipe: str, note):
    """The cluster and model a recipe is meant for (the smoke recipe: the tiny model on 2 CPU ranks) where the command
    declares none: without them the CPU recipe would be planned for the default 8 A100s."""
    import dataclasses

    from seqpar.advisor.recipe import get_recipe

    r = get_recipe(recipe)
    changes = {}
    if r.cluster and all(getattr(flags, k) is None for k in ("cluster", "gpu", "gpus", "nodes")):
        changes["cluster"] = r.cluster
    default_model = next(f.default for f in dataclasses.fields(flags) if f.name == "model")
    if r.model and flags.model == default_model:
        changes["model"] = r.model
    if changes:
        said = " and ".join(f"--{k} {v}" for k, v in changes.items())
        note(f"--recipe {recipe}: {said} (what the recipe is meant for; give them to change)")
    return dataclasses.replace(flags, **changes)


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
        lora=req.lora,
        micro_batch_size=req.micro_batch_size,
        dtype=req.dtype,
        **pins,
    )
    if json_out:
        print_json({m: {"max_seq_len": n, "strategy": s.model_dump() if s else None} for m, (n, s) in res.items()})
        return
    cannot = _cannot_run(req, [m for m, (_, s) in res.items() if s is None])
    ranks = "CPU ranks" if req.cluster.accelerator == "cpu" else "GPUs"
    stdout().print(max_seq_len_table(res, req.cluster.gpu.memory_gib, cannot, ranks))
    for mode, why in cannot.items():
        say(f"{mode} cannot run here: {why}")


def _cannot_run(req, modes: list[str]) -> dict[str, str]:
    """Why each of ``modes`` has no valid strategy on the request's cluster with its pins, at a length every mode splits
    (the refusal `seqpar advise --mode M` gives); modes that have one are left out (nothing fits them: memory)."""
    import math

    from seqpar.advisor.refusal import no_valid_strategy
    from seqpar.advisor.search import enumerate_strategies

    out = {}
    any_len = 2 * math.lcm(1024, *range(1, req.cluster.world_size + 1))
    for mode in modes:
        r = req.model_copy(update={"mode": mode, "seq_len": any_len})
        valid, invalid = enumerate_strategies(r, r.workload())
        if not valid:
            out[mode] = no_valid_strategy(r, r.workload(), invalid).split(": ", 1)[1]
    return out


@handle_errors
def schema():
    """Print the JSON schema of a launch plan (the format `seqpar advise -o` writes and `seqpar launch` reads).

    **Examples**

    ```
    seqpar schema > plan.schema.json
    ```
    """
    print_json(LaunchPlan.model_json_schema())


__all__ = ["advise", "explain", "schema"]
