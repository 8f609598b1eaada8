"""`seqpar calibrate`: refit the cost model's coefficients to measured runs (seqpar.advisor.cost.fit does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from seqpar.cli.base import handle_errors, note, print_json, say, stdout
from seqpar.cli.literal import literal


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
    Runs on CPU ranks are shown apart and left out of the fit: the cost model's coefficients are fitted to GPU runs.

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

    files = run_reports(reports)
    res = run_calibrate(files, output)
    if output is not None:
        note(f"wrote {output}")
    # which rows ran on CPU ranks: the fit leaves them out (its coefficients are GPUs'), so they are shown apart
    shipped = load_measurements()
    on_cpu = [m.cluster.accelerator == "cpu" for m in shipped + load_measurements(files)]
    if plot is not None:
        from seqpar.advisor.plots import measured_vs_predicted_figure, save

        n = len(shipped)  # calibrate fits the shipped rows first, then the given ones
        yours = list(zip(res.rows[n:], on_cpu[n:]))
        fig = measured_vs_predicted_figure(res.rows[:n], [e for e, c in yours if not c], [e for e, c in yours if c])
        note(f"wrote {save(fig, plot)}")
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
    gpu = [e for e, c in zip(res.rows, on_cpu) if not c]
    cpu = [e for e, c in zip(res.rows, on_cpu) if c]
    out = stdout()
    out.print(_rows_table("Tokens/s: measured, and predicted by the refitted cost model", gpu))
    residual = max((abs(e["tokens_residual"]) for e in gpu if e["tokens_residual"] is not None), default=0.0)
    loo = max((abs(e["loo_tokens_error"]) for e in gpu if e["loo_tokens_error"] is not None), default=0.0)
    say(f"GPU rows: max |residual| {residual:.1%}, max |leave-one-out| {loo:.1%} ({len(gpu)} rows)")
    if cpu:
        out.print(_rows_table("CPU ranks (gloo), apart", cpu))
        say(f"CPU rows: {len(cpu)}, not fitted: the cost model's coefficients are fitted to GPU runs,")
        say("so a CPU rank's prediction is a rough figure, not a check of the fit")


def _rows_table(title: str, rows: list[dict]):
    """Calibration rows at 80 columns: the run's label wraps, the figures keep one format each."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    def pct(x) -> str:
        return "-" if x is None else f"{x:+.1%}"

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("run", overflow="fold")
    for col in ("measured", "predicted", "residual", "LOO"):
        t.add_column(col, justify="right", no_wrap=True)
    for e in rows:
        m = e["measured_tokens_per_s"]
        t.add_row(
            Text(literal(e["label"], newlines=False)),  # a report's label is printed as it reads, never as markup
            "-" if not m else f"{m:,.0f}",
            f"{e['predicted_tokens_per_s']:,.0f}",
            pct(e["tokens_residual"]),
            pct(e["loo_tokens_error"]),
        )
    return t


__all__ = ["calibrate"]
