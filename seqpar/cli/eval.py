"""`seqpar eval`: forward-only evaluation in a plan's layout, perplexity (the default command) and the needle.

The job's options (windows, buckets, depths, samples, model and data) are declared on seqpar.plan.job_options's
EvalJobOptions and offered here through seqpar.cli.params; the lengths, the report's place and the output switches are
the commands' own. seqpar.cli.eval_work does the work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from seqpar.cli.base import ReadableCommand, handle_errors, note, print_json, stderr, stdout
from seqpar.cli.eval_work import EvalOptions
from seqpar.cli.params import with_options
from seqpar.plan.job_options import EvalJobOptions
from seqpar.plan.units import parse_seq_len


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

PLAN_ARG = typer.Argument(..., metavar="PLAN.json", help="A plan written by `seqpar advise -o`: its mode and degrees are used.")
EVAL_OUTPUT = typer.Option(
    None, "--output", "--output-dir", help="Report and plot go here (default runs/eval-PLAN, PLAN the plan file's name)."
)
EVAL_JSON = typer.Option(False, "--json", help="Print the report as JSON on stdout (only JSON).")
MAX_LEN = typer.Option(False, "--max-seq-len", help="Only print the longest length the plan's cluster can evaluate (advisor).")
FORCE = typer.Option(False, "--force", help="Run even when the plan's cluster does not match this machine.")
# the options of the job a command does not offer: the other task's, and what seqpar eval sets itself
SET_HERE = ("task", "seq_len", "prediction", "plan", "output")


def _eval(plan_path: Path, job: EvalJobOptions, o: EvalOptions) -> None:
    """seqpar.cli.eval_work does the work; here only the output goes where --json wants it."""
    from seqpar.cli.eval_work import run_eval, show

    rc, report = run_eval(plan_path, job, o, note)
    if rc:
        raise typer.Exit(rc)
    if "lengths" in report:
        show(job.task, report, o, stderr() if o.json_out else stdout(), note)
    if o.json_out:
        print_json(report)


def _lengths(values: Optional[list[str]]) -> tuple[int, ...]:
    return tuple(parse_seq_len(x) for v in values or [] for x in v.split(",") if x.strip())


@eval_app.command("perplexity", cls=ReadableCommand)
@handle_errors
@with_options(EvalJobOptions, "job", leave_out=("depths", "samples", *SET_HERE))
def eval_perplexity(
    job: EvalJobOptions,
    plan_path: Path = PLAN_ARG,
    seq_len: Optional[list[str]] = typer.Option(
        None, "--seq-len", "-s", help="Length(s) to evaluate: repeat it or give a comma list (64k,128k); default the plan's."
    ),
    output: Optional[Path] = EVAL_OUTPUT,
    json_out: bool = EVAL_JSON,
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of loss vs position, one line per length."),
    max_seq_len: bool = MAX_LEN,
    force: bool = FORCE,
):
    """Exact held-out loss and perplexity at each length, and the loss by position bucket, forward only in the plan's layout.

    Every token of every window counts once (float64 sums over all ranks), so the numbers are the same for every mode and
    degree. On chat data the loss counts what training scores, the assistant's tokens (`--score all`: every token). Prints the advisor's forward-only memory and tokens/s first; writes `eval.json` (measured beside predicted) and
    a plot of loss vs position into `--output`.

    **Examples**

    ```
    seqpar eval plan.json --data heldout.npy --seq-len 32k,64k,128k
    seqpar eval plan.json --model-path runs/plan --data test.jsonl --json
    seqpar eval plan.json --model-path out --tokenizer tok --data chats.jsonl
    seqpar eval plan.json --max-seq-len
    seqpar eval plan.json --windows 2
    ```
    """
    from dataclasses import replace

    o = EvalOptions(output, json_out, plot, max_seq_len, force)
    _eval(plan_path, replace(job, task="perplexity", seq_len=_lengths(seq_len)), o)


@eval_app.command("needle", cls=ReadableCommand)
@handle_errors
@with_options(EvalJobOptions, "job", leave_out=("windows", "buckets", "score", *SET_HERE))
def eval_needle(
    job: EvalJobOptions,
    plan_path: Path = PLAN_ARG,
    lengths: Optional[list[str]] = typer.Option(
        None, "--lengths", help="Context lengths, comma list (8k,16k,32k); default the plan's seq_len."
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
    from dataclasses import replace

    o = EvalOptions(output, json_out, plot, max_seq_len, force)
    _eval(plan_path, replace(job, task="needle", seq_len=_lengths(lengths)), o)


__all__ = ["eval_app"]
