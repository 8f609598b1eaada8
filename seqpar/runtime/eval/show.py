"""What ``seqpar eval`` shows from the report its ranks write: rich tables and matplotlib figures (files only).

Torch-free, so the command renders ``eval.json`` / ``needle.json`` (seqpar.runtime.eval.run, seqpar.runtime.eval.needle) without
importing the runtime. The plot functions return the data they drew, so tests check the figure's data, not its pixels:
``plot_loss_by_position`` -> {seq_len: (bucket mid positions, bucket losses)}; ``plot_needle_heatmap`` -> the
(depths x lengths) matrix of exact-match scores, one cell per (length, depth), as EasyContext's heatmap has.
"""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.table import Table

from seqpar.plan.units import format_tokens

NEEDLE_COLOURS = ("#F0496E", "#EBB839", "#0CD79F")  # EasyContext's heatmap colours: fail, partial, pass


def _gib(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _rate(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _pair(row: dict, key: str, fmt) -> tuple[str, str]:
    pred = row.get("predicted") or {}
    return fmt(row["measured"].get(key)), fmt(pred.get(key))


def _title(report: dict, what: str) -> str:
    s = report["strategy"]
    return f"{what}: {s['mode']} sp {s['sp_degree']} x dp {s['dp_degree']}, {report['device']}"


def _narrow(title: str) -> Table:
    """A table that keeps every figure whole at 80 columns: no vertical rules, cells wrap at their spaces, never cut."""
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)


def perplexity_table(report: dict) -> Table:
    """Per length: windows, tokens, loss, perplexity, the first and last position bucket's loss, and measured peak memory
    and tokens/s with the prediction under each."""
    t = _narrow(_title(report, "Held-out loss"))
    for col in ("length", "windows", "tokens", "loss", "ppl", "first\nlast", "peak GiB\n(pred)", "tokens/s\n(pred)"):
        t.add_column(col, justify="right", overflow="fold")
    for r in report["lengths"]:
        b = r["buckets"]
        mem, mem_p = _pair(r, "peak_memory_gib", _gib)
        tps, tps_p = _pair(r, "tokens_per_s", _rate)
        t.add_row(
            format_tokens(r["seq_len"]),
            str(r["windows"]),
            f"{r['tokens']:,}",
            f"{r['loss']:.4f}",
            f"{r['perplexity']:.2f}",
            f"{_loss(b[0]['loss'])}\n{_loss(b[-1]['loss'])}",
            f"{mem}\n({mem_p})",  # the prediction under the measurement: two narrow lines, not one wide one
            f"{tps}\n({tps_p})",
        )
    return t


def _loss(value: float | None) -> str:
    """A bucket's loss; "-" where it counts no token (chat data: no assistant token at those positions)."""
    return "-" if value is None else f"{value:.3f}"


def needle_table(report: dict) -> Table:
    """Rows depths, columns lengths: exact match over the samples and, under it, the answer's mean log-likelihood."""
    g = report["grid"]
    t = _narrow(_title(report, f"Needle, exact match (answer log-likelihood), {report['prompts']}"))
    t.add_column("depth", justify="right")
    for L in g["lengths"]:
        t.add_column(format_tokens(L), justify="right", overflow="fold")
    for i, d in enumerate(g["depths"]):
        cells = [f"{g['exact_match'][i][j]:.2f}\n({g['log_likelihood'][i][j]:.1f})" for j in range(len(g["lengths"]))]
        t.add_row(f"{d:.0%}", *cells)
    return t


def prediction_lines(predictions: list[dict], max_seq_len: int, where: str) -> list[str]:
    """What the advisor predicts for each length (seqpar.advisor.cost.evaluate.EvalPrediction dicts), printed before running."""
    out = [f"predicted (seqpar's cost model, forward only, {where}):"]
    for p in predictions:
        line = (
            f"  {format_tokens(p['seq_len'])}: peak {p['peak_memory_gib']:.2f} GiB allocated, {p['reserved_memory_gib']:.2f} GiB "
            f"reserved of {p['capacity_gib']:.1f} GiB; {p['tokens_per_s']:,.0f} tokens/s ({p['forward_time_s']:.2f} s per window)"
        )
        out.append(line + ("" if p["fits"] else f"; risks OOM: {p['reason']}"))
    out.append(f"  longest evaluable length: {max_seq_len} ({format_tokens(max_seq_len) if max_seq_len else 'none fits'})")
    return out


def measured_lines(report: dict) -> list[str]:
    """One line per length: measured peak memory and tokens/s beside the advisor's prediction."""
    out = []
    for r in report["lengths"]:
        m, p = r["measured"], r.get("predicted") or {}
        line = f"{format_tokens(r['seq_len'])}: peak {m['peak_memory_gib']:.2f} GiB ({m['memory']}), {m['tokens_per_s']:,.0f} tokens/s"
        if p:
            line += f"; predicted {p['peak_memory_gib']:.2f} GiB, {p['tokens_per_s']:,.0f} tokens/s"
        out.append(line)
    return out


def _pyplot():
    from seqpar.plan.extras import require

    require("matplotlib", "plots (--plot)")  # MissingExtra: one line with the install command, exit 1
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_loss_by_position(report: dict, path: str | Path) -> dict[int, tuple[list[float], list[float]]]:
    """Loss against global position, one line per length (each bucket at its middle position); returns the lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = {}
    for r in report["lengths"]:
        counted = [b for b in r["buckets"] if b["loss"] is not None]  # chat data: buckets without assistant tokens
        xs = [(b["start"] + b["end"]) / 2 for b in counted]
        ys = [b["loss"] for b in counted]
        ax.plot(xs, ys, marker=".", label=f"{format_tokens(r['seq_len'])}: loss {r['loss']:.3f}, ppl {r['perplexity']:.2f}")
        lines[r["seq_len"]] = (xs, ys)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the window (tokens)")
    ax.set_ylabel("held-out loss (nats per token)")
    s = report["strategy"]
    ax.set_title(f"{Path(str(report['model'])).name}, {s['mode']} sp {s['sp_degree']} x dp {s['dp_degree']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=110)
    plt.close(fig)
    return lines


def plot_needle_heatmap(report: dict, path: str | Path):
    """EasyContext's heatmap: rows depths, columns lengths, one cell each coloured by exact match (annotated with the
    answer's log-likelihood); returns the (depths, lengths) matrix drawn."""
    import numpy as np

    plt = _pyplot()
    from matplotlib.colors import LinearSegmentedColormap

    g = report["grid"]
    em = np.asarray(g["exact_match"], dtype=float)  # (depths, lengths)
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(g["lengths"]) + 2), max(3, 0.6 * len(g["depths"]) + 1.5)))
    im = ax.imshow(em, cmap=LinearSegmentedColormap.from_list("needle", NEEDLE_COLOURS), vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(g["lengths"])), [format_tokens(L) for L in g["lengths"]], rotation=45)
    ax.set_yticks(range(len(g["depths"])), [f"{d:.0%}" for d in g["depths"]])
    for i in range(em.shape[0]):
        for j in range(em.shape[1]):
            ax.text(j, i, f"{g['log_likelihood'][i][j]:.1f}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title("exact match (cell text: answer log-likelihood)")
    fig.colorbar(im, ax=ax, label="score")
    fig.tight_layout()
    fig.savefig(Path(path), dpi=110)
    plt.close(fig)
    return np.asarray(im.get_array())


__all__ = [
    "prediction_lines",
    "measured_lines",
    "needle_table",
    "perplexity_table",
    "plot_loss_by_position",
    "plot_needle_heatmap",
]
