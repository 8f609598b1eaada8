"""`seqpar calibrate`: refit the cost model's coefficients to measured runs (seqpar.advisor.cost.fit does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from seqpar.cli.base import handle_errors, note, print_json, say


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


__all__ = ["calibrate"]
