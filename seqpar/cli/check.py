"""`seqpar check`: the pre-launch OOM gate, for a plan, the request the flags describe, or one launch's tool configs.

The work lives in seqpar.advisor.gate (and seqpar.emit for tool configs); the options are RequestFlags (seqpar.cli.options),
shared with `seqpar advise`. Importing this module imports neither torch nor the advisor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from seqpar.cli.base import EXIT_OOM_OR_FAILED, handle_errors, note, print_json, say
from seqpar.cli.options import OUTPUT, RequestFlags, advise_request, request_doc_mix, with_request_flags
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.units import parse_seq_len


@handle_errors
@with_request_flags
def check(
    ctx: typer.Context,
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
    What the tool's keys do not say comes from the flags, else from the files' `seqpar:` block (`seqpar advise --emit`
    writes one, so its files check back to its prediction with no flags), else from a default, one "assumed:" line each.
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
    seqpar check plan.sft.yaml plan.accelerate.yaml
    ```
    """
    from seqpar.advisor.cluster import resolve_cluster, with_pinned_host
    from seqpar.advisor.explain import check_lines
    from seqpar.advisor.gate import check as run_check
    from seqpar.emit.check import is_plan_file

    if paths and (len(paths) > 1 or not is_plan_file(paths[0])):  # a tool's configs: seqpar.emit reads them
        from seqpar.emit.gate import check_configs, config_json, config_lines
        from seqpar.emit.sources import given_flags

        got = check_configs(paths, flags, note, given=given_flags(flags, ctx))
        if json_out:
            print_json(config_json(got))
        else:
            for line in config_lines(got):
                (say if got.fits and not got.blocked else note)(line)
        raise typer.Exit(0 if got.fits and not got.blocked else EXIT_OOM_OR_FAILED)
    plan_path = paths[0] if paths else None
    if plan_path is not None:  # re-checked on its own cluster, or on the Cluster flags' (the plan's node shape fills the gaps)
        target = LaunchPlan.load(plan_path)
        mix = request_doc_mix(flags, target.workload.seq_len, target.workload.model.vocab_size)
        if mix is not None:  # --doc-lens / --mean-doc-len / --data: the plan re-checked on that document mix
            target = target.model_validate({**target.model_dump(), "workload": {**target.workload.model_dump(), "doc_lens": mix}})
        lora = flags.lora_spec()
        if lora is not None:  # --lora-rank ...: the plan re-checked training those adapters
            work = {**target.workload.model_dump(), "lora": lora.model_dump()}
            target = target.model_validate({**target.model_dump(), "workload": work})
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


__all__ = ["check"]
