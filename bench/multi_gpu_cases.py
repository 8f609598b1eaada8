"""What bench/multi_gpu.sh runs on N ranks: every (mode, degree) that `seqpar verify` checks, and each mode's three lengths.

Both are asked of the advisor exactly as `seqpar advise` asks it (seqpar.cli.options: the same flags, the same cluster
resolution, the same request), so the bench runs only what a plan can hold:

- ``degrees``: for every registered mode, each (sp_degree, ulysses_degree) of the advisor's search on N ranks that has a
  valid strategy at the verify length (seqpar.advisor.search.enumerate_strategies, judged by the plan rules); a mode with
  none is written with the advisor's own refusal (usp_attn on 2 ranks: it needs a Ulysses and a ring degree of at
  least 2 each, so at least 4 ranks).
- ``lengths``: each mode at its full degree (sp_degree N; data_parallel 1): the longest length the cost model fits
  (what `seqpar advise --max-seq-len` reports), halved until the plan advised there predicts a step within
  ``--step-budget-s`` (a bench times a few steps, not a run), then that length L, L/2 and L/4. L is the unit (the
  least common multiple of ``--unit`` and 2 x sp_degree, which every mode's split divides) times the largest power of
  two that fits, and is halved no lower than 4 units, so the three lengths are whole and distinct wherever 4 units fit.

Each writes its JSON (cases and skipped modes with the reason) to ``--out`` and prints one case a line for the shell:
``mode sp_degree ulysses_degree`` (degrees) or ``mode sp_degree seq_len`` (lengths).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path


def _flags(args, mode: str | None = None, seq_len: int = 1024, **pins):
    from seqpar.cli.options import RequestFlags

    return replace(
        RequestFlags(),
        seq_len=str(seq_len),
        model=args.model,
        gpu=args.gpu,
        gpus=args.gpus,
        cluster=args.cluster,
        host_ram_gib=args.host_ram_gib,
        mode=mode,
        **pins,
    )


def _request(args, mode: str | None, seq_len: int, **pins):
    from seqpar.cli.options import advise_request

    req, _ = advise_request(_flags(args, mode, seq_len, **pins), seq_len, "cost", note=lambda *_: None)
    return req


def _refusal(req) -> str:
    """The advisor's one line on why ``req`` has no valid strategy (what `seqpar advise --mode M` says), without its head."""
    from seqpar.advisor.refusal import no_valid_strategy
    from seqpar.advisor.search import enumerate_strategies

    valid, invalid = enumerate_strategies(req, req.workload())
    return "" if valid else no_valid_strategy(req, req.workload(), invalid).split(": ", 1)[1]


def degrees(args) -> dict:
    """{"ranks", "verify": [{mode, sp_degree, ulysses_degree}], "skipped": {mode: why}} at the verify length."""
    from seqpar.advisor.search import enumerate_strategies
    from seqpar.plan.modes import names

    cases, skipped, ranks = [], {}, None
    for mode in [m for m in names() if not args.modes or m in args.modes]:
        req = _request(args, mode, args.seq_len)
        ranks = req.cluster.world_size
        valid, _ = enumerate_strategies(req, req.workload())
        found = sorted({(s.sp_degree, s.ulysses_degree) for s in valid})
        if not found:
            skipped[mode] = _refusal(req)
        cases += [{"mode": mode, "sp_degree": sp, "ulysses_degree": u} for sp, u in found]
    return {
        "ranks": ranks,
        "cluster": _cluster(req.cluster),
        "model": args.model,
        "seq_len": args.seq_len,
        "verify": cases,
        "skipped": skipped,
    }


def _cluster(c) -> dict:
    """What the report names: the GPU (or CPU ranks), the link inside the node and its datasheet bandwidth."""
    link = c.intra_node_link
    return {
        "accelerator": c.accelerator,
        "gpu": c.gpu.name,
        "gpus_per_node": c.gpus_per_node,
        "nodes": c.nodes,
        "link": link.kind,
        "link_gb_s": link.bandwidth_gb_s,
    }


def pick_lengths(top: int, unit: int) -> list[int]:
    """top, top/2 and top/4 (top is unit x a power of two), those of at least unit, shortest first."""
    return sorted({top // k for k in (4, 2, 1) if top // k >= unit})


def lengths(args) -> dict:
    """{"ranks", "runs": [{mode, sp_degree, seq_len, max_seq_len}], "skipped": {mode: why}}."""
    from seqpar.advisor.search import advise_by_cost, max_seq_len
    from seqpar.plan.errors import SeqparError
    from seqpar.plan.modes import names, splits_sequence

    runs, skipped, ranks = [], {}, None
    modes = [m for m in names() if not args.modes or m in args.modes]
    for mode in modes:
        req = _request(args, mode, 1024)
        ranks = req.cluster.world_size
        sp = ranks if splits_sequence(mode) else 1
        why = _refusal(_request(args, mode, 2 * math.lcm(1024, *range(1, ranks + 1)), sp_degree=sp))
        if why:
            skipped[mode] = why
            continue
        most, _ = max_seq_len(
            req.model, req.cluster, [mode], optimizer=req.optimizer, micro_batch_size=req.micro_batch_size,
            dtype=req.dtype, sp_degree=sp,
        )[mode]  # fmt: skip
        unit = math.lcm(args.unit, 2 * sp)
        if most < unit:
            skipped[mode] = f"the cost model fits no length of {unit} tokens or more at sp_degree {sp} on {ranks} ranks"
            continue
        top = unit * 2 ** int(math.log2(most // unit))  # unit x a power of two: L, L/2 and L/4 stay whole multiples
        while top > 4 * unit:
            try:
                step = advise_by_cost(_request(args, mode, top, sp_degree=sp)).prediction.step_time_s
            except SeqparError:
                step = math.inf
            if step <= args.step_budget_s:
                break
            top //= 2
        runs += [{"mode": mode, "sp_degree": sp, "seq_len": n, "max_seq_len": most} for n in pick_lengths(top, unit)]
    return {
        "ranks": ranks,
        "cluster": _cluster(req.cluster),
        "model": args.model,
        "step_budget_s": args.step_budget_s,
        "runs": runs,
        "skipped": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("degrees", "lengths"))
    ap.add_argument("--out", type=Path, required=True, help="The JSON written (cases and skipped modes).")
    ap.add_argument("--model", required=True)
    ap.add_argument("--cluster", help="cpu:N for N gloo CPU ranks, as `seqpar advise --cluster`.")
    ap.add_argument("--gpu")
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--host-ram-gib", type=float)
    ap.add_argument("--seq-len", type=int, default=4096, help="degrees: the verify length.")
    ap.add_argument(
        "--modes",
        type=lambda s: [m for m in s.split(",") if m],
        default=[],
        help="These modes only (default: every registered one).",
    )
    ap.add_argument("--unit", type=int, default=1024, help="lengths: each a multiple of this.")
    ap.add_argument("--step-budget-s", type=float, default=10.0, help="lengths: the longest run's predicted step time.")
    args = ap.parse_args(argv)
    from seqpar.plan.errors import SeqparError
    from seqpar.plan.files import write_atomic
    from seqpar.plan.modes import names

    unknown = [m for m in args.modes if m not in names()]
    if unknown:
        print(f"multi_gpu_cases: --modes {','.join(unknown)} is not a mode; the modes are {', '.join(names())}", file=sys.stderr)
        return 2
    try:
        res = degrees(args) if args.what == "degrees" else lengths(args)
    except SeqparError as e:
        print(f"multi_gpu_cases: {e}", file=sys.stderr)
        return 2
    write_atomic(args.out, json.dumps(res, indent=2) + "\n")
    for c in res["verify" if args.what == "degrees" else "runs"]:
        print(c["mode"], c["sp_degree"], c["ulysses_degree"] if args.what == "degrees" else c["seq_len"])
    for mode, why in res["skipped"].items():
        print(f"multi_gpu_cases: {mode} skipped: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
