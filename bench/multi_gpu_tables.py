"""The sections of bench/multi_gpu_report.py's one-page report, as markdown lines: verify, bandwidth, runs, calibrate.

Figures keep one format each: tokens/s as whole numbers, GiB to two decimals, bandwidth to three significant digits,
errors as signed percentages (predicted / measured - 1, seqpar calibrate's residual).
"""

from __future__ import annotations


def pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def error(predicted, measured):
    return predicted / measured - 1 if predicted and measured else None


def size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def table(head: list[str], body: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return out + ["| " + " | ".join(str(x) for x in r) + " |" for r in body]


def verify_section(cases: list[dict], modes: dict) -> list[str]:
    lines = ["## 1. `seqpar verify`: each mode and degree against data_parallel on the same ranks", ""]
    if not modes:
        return lines + ["Not run (the verify stage).", ""]
    passed = sum(c["outcome"] == "passed" for c in cases)
    lines += [
        f"{modes['model']} at {modes['seq_len']} tokens, one step of one batch; loss, gradient norm and every gradient "
        f"within base(dtype) x W. {passed} of {len(cases)} passed.",
        "",
    ]
    body = []
    for c in cases:
        r = c["result"] or {}
        body.append(
            [
                c["mode"],
                c["sp_degree"],
                c["ulysses_degree"],
                r.get("sharding", "-"),
                c["outcome"],
                f"{r['loss']['rel_diff']:.1e}" if r else "-",
                f"{r['grad_norm']['rel_diff']:.1e}" if r else "-",
                f"{r['grads']['max_rel_diff']:.1e}" if r else "-",
                f"{r['tolerance']:.1e}" if r else "-",
            ]
        )
    head = ["mode", "sp", "ulysses", "sharding", "outcome", "loss diff", "grad norm diff", "worst gradient diff", "tolerance"]
    lines += table(head, body) + [""]
    lines += [f"- {m}: not verified on {modes['ranks']} ranks: {why}" for m, why in modes.get("skipped", {}).items()]
    return lines + ([""] if modes.get("skipped") else [])


def bandwidth_section(rows: list[dict], cluster: dict, comm_efficiency: float | None) -> list[str]:
    lines = ["## 2. Collective bandwidth by message size (bus bandwidth, GB/s)", ""]
    if not rows:
        return lines + ["Not run (the bandwidth stage).", ""]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    sizes = sorted({r["bytes"] for r in rows})
    busbw = {(r["op"], r["bytes"]): r["busbw_gb_s"] for r in rows}
    r0 = rows[0]
    lines += [
        f"{r0['ranks']} ranks, {r0['backend']} on {r0['device']}, {r0['dtype']}, {r0['iters']} timed operations per size; "
        "nccl-tests' definitions (NVIDIA/nccl-tests doc/PERFORMANCE.md): algbw = S / t, busbw = algbw x 2(n-1)/n "
        "(all_reduce), (n-1)/n (all_gather, all_to_all), 1 (send_recv: each rank to the next of a ring). "
        "Every row, with time and algbw: `bandwidth.jsonl`.",
        "",
    ]
    body = [[size(s)] + [f"{busbw[(op, s)]:.3g}" if (op, s) in busbw else "-" for op in ops] for s in sizes]
    lines += table(["S"] + ops, body) + [""]
    if comm_efficiency is not None and cluster.get("link_gb_s"):
        predicted = cluster["link_gb_s"] * comm_efficiency
        best = ", ".join(f"{op} {max(busbw[(op, s)] for s in sizes if (op, s) in busbw):.3g}" for op in ops)
        lines += [
            f"The cost model prices every transfer at {predicted:.3g} GB/s per rank whatever its size: the "
            f"{cluster['link']} datasheet {cluster['link_gb_s']:g} GB/s x comm_bandwidth_efficiency {comm_efficiency:g}. "
            f"Best measured: {best}.",
            "",
        ]
    return lines


def _plan_words(plan: dict | None) -> str:
    if not plan:
        return "-"
    s = plan["strategy"]
    words = [f"ckpt {s['checkpointing']}", s["sharding"], f"loss {s['loss_impl']}"]
    if s["mode"] == "usp_attn":
        words.insert(0, f"u{s['ulysses_degree']}xr{s['ring_degree']}")
    if s.get("tiled_mlp"):
        words.append("tiled MLP")
    return ", ".join(words)


def runs_section(cases: list[dict], lengths: dict, cpu: bool, refit: dict[str, dict]) -> list[str]:
    """The runs beside their plans' predictions; ``refit``: seqpar calibrate's row for each case it ingested (its
    prediction with the refitted coefficients), shown on GPUs (calibrate fits no CPU rows)."""
    lines = ["## 3. Each mode at three lengths: predicted against measured", ""]
    if not lengths:
        return lines + ["Not run (the runs stage).", ""]
    counts = {o: sum(c["outcome"] == o for c in cases) for o in ("ok", "oom", "no fit", "failed", "not run")}
    lines += [
        f"{lengths['model']}, the plan `seqpar advise --mode M --sp-degree S` gives at each length; lengths: the longest "
        f"that fits halved until a step is predicted within {lengths['step_budget_s']:g} s, then L, L/2, L/4. "
        f"tokens/s over the steps after the first. Outcomes: " + ", ".join(f"{n} {o}" for o, n in counts.items() if n) + ".",
        "",
    ]
    body = []
    for c in cases:
        rep = c["report"] or {}
        m, p = rep.get("measured") or {}, rep.get("predicted") or (c["plan"] or {}).get("prediction") or {}
        mem_err = None if cpu else error(p.get("peak_memory_gib"), m.get("peak_memory_gib"))
        body.append(
            [
                c["mode"],
                c["sp_degree"],
                c["seq_len"],
                _plan_words(c["plan"]),
                f"{m['tokens_per_s']:,.0f}" if m.get("tokens_per_s") else "-",
                f"{p['tokens_per_s']:,.0f}" if p.get("tokens_per_s") else "-",
                pct(error(p.get("tokens_per_s"), m.get("tokens_per_s"))),
                f"{m['peak_memory_gib']:.2f}" if m.get("peak_memory_gib") else "-",
                f"{p['peak_memory_gib']:.2f}" if p.get("peak_memory_gib") is not None else "-",
                pct(mem_err),
            ]
            + ([] if cpu else [pct((refit.get(c["case"]) or {}).get("tokens_residual"))])
            + [
                c["outcome"] + (f": {c['why']}" if c["why"] and c["outcome"] != "ok" else ""),
            ]
        )
    head = ["mode", "sp", "seq_len", "plan", "tok/s", "predicted", "error", "peak GiB", "predicted", "error"]
    lines += table(head + ([] if cpu else ["error refitted"]) + ["outcome"], body) + [""]
    if cpu:
        lines += [
            "CPU ranks: the measured peak is the process's resident memory (interpreter, libraries, model), which the "
            "prediction (tensors only) does not count, so no memory error is given; the CPU profile's figures are "
            "nominal, so tokens/s errors check the pipeline, not the cost model.",
            "",
        ]
    lines += [f"- {m}: not run: {why}" for m, why in lengths.get("skipped", {}).items()]
    return lines + ([""] if lengths.get("skipped") else [])


def calibrate_section(calib: dict | None, ours: int, cpu: bool) -> list[str]:
    lines = ["## 4. `seqpar calibrate rows.json`", ""]
    if calib is None:
        return lines + ["Not run (the report stage found no rows, or calibrate failed: see logs/calibrate.log).", ""]
    mine = calib["rows"][-ours:] if ours else []
    residuals = [abs(r["tokens_residual"]) for r in mine if r["tokens_residual"] is not None]
    lines.append(
        f"Ingested the {len(mine)} rows of this bench beside {len(calib['rows']) - len(mine)} shipped ones; the refitted "
        "coefficients are in `coefficients.json` (`SEQPAR_COEFFICIENTS=coefficients.json` uses them). "
        + (
            "calibrate shows CPU rows apart and fits none of them: the coefficients are GPUs'."
            if cpu
            else f"After the refit, this bench's rows: max |tokens/s error| {max(residuals, default=0):.1%} (column "
            f"'error refitted'); every GPU row: max |residual| {calib['max_abs_residual']:.1%}, max |leave-one-out| "
            f"{calib['max_abs_loo']:.1%}."
        )
    )
    return lines + [""]
