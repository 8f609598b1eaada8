"""The pictures: predicted memory vs seq_len per mode, the memory of one step by phase, and measured vs predicted.

``seqpar explain PLAN --plot memory.png`` writes the first two (``memory.png``, ``memory-phases.png``); ``seqpar calibrate
... --plot fit.png`` the third. Each ``*_figure`` function returns the matplotlib Figure (the tests read its axes) and
``save`` writes it. matplotlib is an optional dependency (``seqpar[plot]``), imported only here and only when asked for;
without it the command says which extra to install (seqpar.plan.extras).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from seqpar.advisor.cost.coefficients import Coefficients, load_coefficients
from seqpar.advisor.cost.memory import estimate_memory
from seqpar.plan.display import tags
from seqpar.plan.extras import require
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.modes import names, split_multiple, splits_sequence, takes_ulysses_degree
from seqpar.plan.specs import Strategy
from seqpar.plan.units import GIB, format_tokens

# One look per mode, told apart by colour, line style and marker (several modes' curves nearly coincide at one degree):
# the registered modes take them in registration order (seqpar.plan.modes), the five built-in ones first.
STYLES = (
    ("tab:gray", "-", "o"),
    ("tab:blue", "-", "s"),
    ("tab:orange", "--", "^"),
    ("tab:green", "-.", "D"),
    ("tab:purple", ":", "v"),
    ("tab:brown", "--", "x"),
    ("tab:pink", "-.", "P"),
    ("tab:olive", ":", "*"),
)


def mode_style(mode: str) -> tuple[str, str, str]:
    """(colour, line style, marker) of a registered mode."""
    return STYLES[names().index(mode) % len(STYLES)]


def _pyplot():
    require("matplotlib", "pictures (--plot)")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _title(plan: LaunchPlan) -> str:
    w, cl, s = plan.workload, plan.cluster, plan.strategy
    options = "".join(f", {t}" for t in tags(s, "title"))
    return f"{w.model.name}, {cl.world_size}x {cl.gpu.name}, ckpt={s.checkpointing}, {s.sharding}, loss={s.loss_impl}{options}"


def _mode_strategy(s: Strategy, mode: str, world: int) -> Optional[Strategy]:
    """The plan's choices in ``mode`` over all ranks (data_parallel: sp 1), or None when the mode cannot take them."""
    if not splits_sequence(mode):
        return s.model_copy(update={"mode": mode, "sp_degree": 1, "dp_degree": world, "ulysses_degree": 1, "ring_degree": 1})
    if world < 2:
        return None
    u, ring = 1, 1
    if takes_ulysses_degree(mode):
        u = next((u for u in range(world // 2, 1, -1) if world % u == 0 and world // u >= 2), None)
        if u is None:
            return None
        ring = world // u
    st = s.model_copy(update={"mode": mode, "sp_degree": world, "dp_degree": 1, "ulysses_degree": u, "ring_degree": ring})
    return Strategy.model_validate(st.model_dump())


def _power_ticks(lo: int, hi: int, keep: int) -> list[int]:
    """Powers of two in [lo, hi], every other one when there are many, keeping ``keep``'s parity (32K, 128K, 512K)."""
    ticks = [2**e for e in range(lo.bit_length() - 1, hi.bit_length()) if lo <= 2**e <= hi]
    if len(ticks) > 8:
        parity = (keep.bit_length() - 1) % 2
        ticks = [t for t in ticks if (t.bit_length() - 1) % 2 == parity]
    return ticks


def memory_vs_seq_len_figure(plan: LaunchPlan, coeffs: Optional[Coefficients] = None, points: int = 24):
    """Predicted peak allocated memory per GPU against seq_len for each mode (over all ranks, the plan's other choices),
    both axes logarithmic, x labelled in tokens (32K, 128K, ...), the GPU's capacity and the plan's length marked."""
    plt = _pyplot()
    c = coeffs or load_coefficients()
    w, cl, s = plan.workload, plan.cluster, plan.strategy
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    lo, top = 1024, max(w.seq_len * 4, 8192)
    for mode in names():
        st = _mode_strategy(s, mode, cl.world_size)
        if st is None:
            continue
        mult = split_multiple(st.mode, st.sp_degree, st.ulysses_degree)
        xs, ys = [], []
        for i in range(points):
            n = int(lo * (top / lo) ** (i / (points - 1)))
            n = max(mult, n - n % mult)
            xs.append(n)
            ys.append(estimate_memory(w.model_copy(update={"seq_len": n}), cl, st, c).peak_bytes / GIB)
        color, line, marker = mode_style(mode)
        ax.plot(xs, ys, color=color, linestyle=line, marker=marker, markersize=4, label=f"{mode} (sp {st.sp_degree})")
    ax.axhline(cl.gpu.memory_gib, color="red", linestyle="--", label=f"{cl.gpu.name} capacity {cl.gpu.memory_gib:.0f} GiB")
    ax.axvline(w.seq_len, color="black", linestyle=":", linewidth=1, label=f"plan: {format_tokens(w.seq_len)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = _power_ticks(lo, top, w.seq_len)
    ax.set_xticks(ticks, [format_tokens(t) for t in ticks])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_xlabel("seq_len (tokens; K = 1024)")
    ax.set_ylabel("predicted peak allocated per GPU (GiB, log)")
    ax.set_title(_title(plan), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def memory_by_phase_figure(plan: LaunchPlan, coeffs: Optional[Coefficients] = None):
    """The plan's predicted memory per GPU in each phase of a step (forward, loss, backward, optimizer) as stacked bars of
    its terms (weights, optimizer state, activations...), the same colour for a term in every bar, with the capacity."""
    plt = _pyplot()
    c = coeffs or load_coefficients()
    mem = estimate_memory(plan.workload, plan.cluster, plan.strategy, c)
    phases = list(mem.phase_terms)
    terms = sorted(
        {k for v in mem.phase_terms.values() for k, b in v.items() if b > 0},
        key=lambda k: -max(mem.phase_terms[p].get(k, 0.0) for p in phases),
    )
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.get_cmap("tab20").colors
    bottom = [0.0] * len(phases)
    for i, term in enumerate(terms):
        heights = [mem.phase_terms[p].get(term, 0.0) / GIB for p in phases]
        ax.bar(phases, heights, bottom=bottom, color=colors[i % len(colors)], label=term, edgecolor="white", linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights)]
    cap = plan.cluster.gpu.memory_gib
    ax.axhline(cap, color="red", linestyle="--", label=f"capacity {cap:.0f} GiB")
    peak = mem.phases[mem.peak_phase] / GIB
    ax.annotate(f"peak {peak:.1f} GiB", (phases.index(mem.peak_phase), peak), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(cap, peak) * 1.12)
    ax.set_ylabel("predicted allocated per GPU (GiB)")
    ax.set_title(
        f"{plan.strategy.mode} sp {plan.strategy.sp_degree}, seq_len {format_tokens(plan.workload.seq_len)}: " + _title(plan),
        fontsize=8,
    )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


CPU_CAVEAT = (
    "x: runs on CPU ranks, not fitted: the cost model's coefficients are fitted to GPU runs, so their predictions are\n"
    "rough; their memory (the process's RSS, not the allocator's peak) is not drawn"
)


def measured_vs_predicted_figure(shipped: list[dict], yours: list[dict], cpu: list[dict] = ()):
    """Calibration: every measured run (seqpar calibrate's rows: the shipped measurements, your GPU runs and your runs on
    CPU ranks, told apart, the last with a caveat under the figure: the fit leaves them out) against the refitted
    prediction, tokens/s and peak memory, log-log, with y = x and a +-10% band."""
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    panels = (
        ("measured_tokens_per_s", "predicted_tokens_per_s", "tokens/s"),
        ("measured_peak_gib", "predicted_peak_gib", "peak allocated GiB"),
    )
    looks = (
        ("o", "tab:gray", "shipped measurements"),
        ("*", "tab:red", "your runs"),
        ("x", "tab:blue", "your runs on CPU ranks (not fitted)"),
    )
    for ax, (mk, pk, what) in zip(axes, panels):
        # a CPU rank's memory is its process's RSS, not the allocator's peak: its runs are drawn on tokens/s only
        groups = [
            [(r[mk], r[pk]) for r in rows if r.get(mk) and r.get(pk)] if rows is not cpu or mk == panels[0][0] else []
            for rows in (shipped, yours, cpu)
        ]
        pts = groups[0] + groups[1] + groups[2]
        for sel, (marker, color, label) in zip(groups, looks):
            if sel:
                ax.scatter([m for m, _ in sel], [p for _, p in sel], marker=marker, color=color, s=40, label=label, zorder=3)
        if pts:
            lo = min(min(m, p) for m, p in pts) / 1.3
            hi = max(max(m, p) for m, p in pts) * 1.3
            ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="predicted = measured")
            for f in (0.9, 1.1):
                ax.plot([lo, hi], [lo * f, hi * f], color="black", linestyle=":", linewidth=0.8)
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor ticks' labels overlap on a narrow decade
        ax.set_xlabel(f"measured {what}")
        ax.set_ylabel(f"predicted {what}")
        ax.set_title(f"{what}: {len(pts)} runs (dotted: +-10%)", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    if cpu:
        fig.text(0.01, 0.005, CPU_CAVEAT, fontsize=8, color="tab:blue")
    fig.tight_layout(rect=(0, 0.07 if cpu else 0, 1, 1))
    return fig


def save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def phases_path(path: str | Path) -> Path:
    """Where the second picture of `seqpar explain --plot PATH` goes: PATH's name with -phases (memory-phases.png)."""
    p = Path(path)
    return p.with_name(f"{p.stem}-phases{p.suffix or '.png'}")


def explain_plots(plan: LaunchPlan, path: str | Path) -> list[Path]:
    """`seqpar explain --plot PATH`: memory vs seq_len at PATH, the plan's memory by phase beside it."""
    return [save(memory_vs_seq_len_figure(plan), path), save(memory_by_phase_figure(plan), phases_path(path))]


__all__ = [
    "STYLES",
    "mode_style",
    "explain_plots",
    "measured_vs_predicted_figure",
    "memory_by_phase_figure",
    "memory_vs_seq_len_figure",
    "phases_path",
    "save",
]
