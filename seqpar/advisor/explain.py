"""The cost model's side of `seqpar explain` / `check` / `advise --max-seq-len`: breakdown tables and the OOM verdict.

render.py renders the plan itself (with its training settings and predicted bill); these add the memory breakdown at the
peak phase with every phase's total, the step time split, the alternatives with their predictions and why each lost (the
best of each kind of change, answer.alternative_groups), and the check verdict. The pictures are plots.py's.
"""

from __future__ import annotations

from typing import Optional

from rich import box
from rich.console import RenderableType
from rich.table import Table

from seqpar.advisor.answer import alternative_groups, percent, why_lost
from seqpar.advisor.cost import packed
from seqpar.advisor.cost.coefficients import Coefficients, load_coefficients
from seqpar.advisor.cost.memory import estimate_memory
from seqpar.advisor.cost.throughput import call_efficiency, call_tokens
from seqpar.advisor.gate import CheckResult
from seqpar.advisor.render import documents_line
from seqpar.advisor.search import describe
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.units import GIB, format_tokens


def _table(title: str, *cols: str) -> Table:
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 else "right")
    return t


def explain_tables(plan: LaunchPlan, coeffs: Optional[Coefficients] = None) -> list[RenderableType]:
    """Memory at the peak phase (and each phase's total), the step-time split, and the alternatives."""
    c = coeffs or load_coefficients()
    out: list[RenderableType] = []
    mem = estimate_memory(plan.workload, plan.cluster, plan.strategy, c)
    t = _table(f"Memory per GPU at the peak phase ({mem.peak_phase}), GiB", "term", "GiB", "share")
    for k, v in sorted(mem.breakdown.items(), key=lambda kv: -kv[1]):
        t.add_row(k, f"{v / GIB:.2f}", f"{v / mem.peak_bytes:.0%}")
    t.add_row("[bold]peak allocated[/]", f"[bold]{mem.peak_bytes / GIB:.2f}[/]", "")
    t.add_row("reserved (+ allocator slack, CUDA context, NCCL)", f"{mem.reserved_bytes / GIB:.2f}", "")
    t.add_row("capacity", f"{mem.capacity_bytes / GIB:.2f}", "")
    t.add_row("phases: " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in mem.phases.items()), "", "")
    if mem.host_bytes and (plan.strategy.checkpointing == "offload" or plan.strategy.sharding == "zero3_offload"):
        t.add_row("host RAM per node", f"{mem.host_bytes / GIB:.1f}", f"of {mem.host_capacity_bytes / GIB:.0f} usable")
    out.append(t)
    p = plan.prediction
    if p is not None:
        tt = _table(f"Step time ({p.step_time_s:.3f} s, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%})", "part", "s", "share")
        for k, v in p.step_time_breakdown_s.items():
            tt.add_row(k, f"{v:.3f}", f"{v / p.step_time_s:.0%}" if p.step_time_s else "")
        out.append(tt)
    if plan.workload.doc_lens is not None:
        out.append(packed_table(plan, c))
    if plan.rationale.alternatives:
        out.append(alternatives_table(plan))
    return out


def alternatives_table(plan: LaunchPlan) -> Table:
    """The alternatives, the best of each kind of change (answer.alternative_groups), against the plan's prediction; why
    each lost beside it when its numbers do not say (a slower one says it in its tokens/s)."""
    p = plan.prediction
    mine = f" (plan: {p.tokens_per_s:,.0f} tokens/s, {p.peak_memory_gib:.1f} GiB)" if p else ""
    t = Table(title=f"Alternatives, the best of each kind{mine}", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("changes from the plan: why it lost")
    t.add_column("tokens/s", justify="right", no_wrap=True)
    t.add_column("peak GiB", justify="right", no_wrap=True)
    for g in alternative_groups(plan):
        ap = g.best.prediction
        vs = f" ({percent(ap.tokens_per_s / p.tokens_per_s - 1)})" if ap and p and p.tokens_per_s else ""
        more = f" [dim](+{g.more} alike)[/]" if g.more else ""
        why = why_lost(plan, g.best)
        t.add_row(
            g.changes + more + ("" if why == "slower" else f": {why}"),
            f"{ap.tokens_per_s:,.0f}{vs}" if ap else "-",
            f"{ap.peak_memory_gib:.1f}" if ap else "-",
        )
    return t


def packed_table(plan: LaunchPlan, c: Coefficients) -> Table:
    """What the packed documents change in the prediction (seqpar.advisor.cost.packed): attention work and time, balance, transfers."""
    w, s, cl = plan.workload, plan.strategy, plan.cluster
    mix, S = w.doc_lens, w.seq_len
    n = call_tokens(s, S)
    short = c.kernel_rate_tflops(cl, "flash") / c.kernel_rate_tflops(cl, c.attention_backend(cl))
    t = _table(f"Packed documents ({mix.source})", "term", "value", "vs one document per window")
    t.add_row("mean document", f"{mix.mean_tokens:,.0f} tokens", f"{mix.mean_tokens / S:.2%} of the window")
    t.add_row("attention FLOPs: E(sum of l^2) / S^2", f"{mix.at(S).sum_sq_fraction:.4f}", "x dense")
    share = packed.attention_time_share(mix, S, n, lambda x: call_efficiency(x, c), short)
    t.add_row("attention time (per-document kernel rates)", f"{share:.4f}", "x dense")
    t.add_row("busiest rank / mean (measured, W = 8)", f"{packed.imbalance(s, mix, S):.2f}", "1.00 dense")
    t.add_row("sequence-parallel transfers still needed", f"{packed.transfer_share(s, mix, S):.0%}", "100% dense")
    t.add_row("memory", "unchanged", "flash-style kernels keep O(S)")
    return t


def check_lines(res: CheckResult) -> list[str]:
    p = res.prediction
    head = "fits" if res.fits else "RISKS OOM"
    lines = [
        f"{head}: {describe(res.plan.strategy) if res.plan else ''}",
        f"predicted peak {p.peak_memory_gib:.1f} GiB allocated, {p.reserved_memory_gib:.1f} GiB reserved, capacity {p.capacity_gib:.1f} GiB"
        + (f", host {p.host_memory_gib:.0f} GiB" if p.host_memory_gib else ""),
        "biggest terms (" + (p.peak_phase or "peak") + "): " + ", ".join(f"{k} {v:.1f} GiB" for k, v in res.biggest_terms),
    ]
    if res.plan is not None and res.plan.workload.doc_lens is not None:
        lines.append(f"documents: {documents_line(res.plan.workload)}")
    if not res.fits:
        lines += [f"why: {res.reason}", f"cheapest fix: {res.fix}"]
    else:
        lines.append(f"predicted {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}")
    return lines


def max_seq_len_table(result: dict, capacity_gib: float, cannot: dict | None = None, ranks: str = "GPUs") -> Table:
    """``cannot``: the modes with no valid strategy here (they run at no length), shown as such, not as "none fits";
    ``ranks``: what the cluster's ranks are ("GPUs", "CPU ranks")."""
    t = _table(f"Longest sequence that fits per mode ({capacity_gib:.0f} GiB {ranks})", "mode", "seq_len", "with")
    for mode, (n, s) in result.items():
        none = "cannot run here (below)" if mode in (cannot or {}) else "none fits"
        t.add_row(mode, f"{n} ({format_tokens(n)})" if n else none, describe(s) if s else "-")
    return t
