"""The second hour's output: `seqpar advise` answers on one screen at 80 columns (the plan, its prediction, its bill and
the next command first; one line where the guide's tree and the cost model part), --verbose / explain list each kind of
alternative once, the RoPE warning is said once, the glossary is in --help, refusals say why with the cluster's own
words and the nearest lengths that split, and the help panels, the eval table and calibrate read at 80 columns."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.plan.launch_plan import LaunchPlan

runner = CliRunner()
NARROW = {"COLUMNS": "80"}
WIDE = {"COLUMNS": "400"}  # one table row per line
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def screen_lines(text: str, width: int = 80) -> int:
    """Lines a terminal of ``width`` columns shows for ``text`` (a longer line wraps)."""
    return sum(max(1, math.ceil(len(line) / width)) for line in text.splitlines())


def cli(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    """The real `seqpar` entry point in a fresh process, as a person runs it at ``columns`` columns."""
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run([sys.executable, "-m", "seqpar.cli", *args], capture_output=True, text=True, env=env, timeout=120)


def rows(stdout: str) -> list[tuple[str, str]]:
    """(label, text) of the one-screen answer (a wide terminal: one row per line; continuations have no label)."""
    return [(ln[:12].strip(), ln[12:].strip()) for ln in stdout.splitlines() if ln.strip()]


# --------------------------------------------------------------------------------------------- one screen


@pytest.fixture(scope="module")
def plan_512k() -> LaunchPlan:
    r = runner.invoke(app, ["advise", "-s", "512k", "--json"])
    assert r.exit_code == 0, r.stderr
    return LaunchPlan.model_validate_json(r.stdout)


def test_advise_fits_one_screen_with_the_plan_first(plan_512k):
    p = cli("advise", "--seq-len", "512k")
    assert p.returncode == 0, p.stderr
    assert max(map(len, p.stdout.splitlines())) <= 80
    assert screen_lines(p.stdout) + screen_lines(p.stderr) <= 25, p.stdout + p.stderr  # notes and answer, one screen
    labels = [label for label, _ in rows(cli("advise", "--seq-len", "512k", columns=400).stdout) if label]
    assert labels == ["Plan", "Prediction", "Bill", "Next", "Why", "More"]
    wide = dict(rows(cli("advise", "--seq-len", "512k", columns=400).stdout))
    s, pr = plan_512k.strategy, plan_512k.prediction
    assert wide["Plan"].startswith(f"{s.mode}, sp {s.sp_degree} x dp {s.dp_degree}: llama-2-7b at 512K tokens")
    assert wide["Prediction"].startswith(f"{pr.tokens_per_s:,.0f} tokens/s, MFU {pr.mfu:.1%}")
    assert wide["Next"] == "add -o plan.json to write the plan, then: seqpar launch plan.json"
    assert "--verbose" in wide["More"]


def test_one_line_where_the_tree_and_the_cost_model_part(plan_512k):
    r = plan_512k.rationale
    assert r.rules_choice != plan_512k.strategy.mode  # the case the line is for: the tree says zigzag, the model dist flash
    theirs = max(
        a.prediction.tokens_per_s for a in r.alternatives if a.strategy.mode == r.rules_choice and not a.prediction.oom_risk
    )
    mine = plan_512k.prediction.tokens_per_s
    line = (
        f"the guide's tree says {r.rules_choice}; the cost model picks {plan_512k.strategy.mode}, predicted "
        f"{mine / theirs - 1:.0%} faster ({mine:,.0f} vs {theirs:,.0f} tokens/s)"
    )
    assert line in cli("advise", "--seq-len", "512k", columns=400).stdout
    verbose = runner.invoke(app, ["advise", "-s", "512k", "--verbose"], env=WIDE).stdout
    assert verbose.count(line) == 1 and f"rules: {r.rules_choice}; cost model" not in verbose
    narrow = cli("advise", "--seq-len", "512k", "--verbose").stdout  # the whole plan reads at 80 columns too
    assert max(map(len, narrow.splitlines())) <= 80 and "…" not in narrow


def test_the_rope_warning_is_said_once():
    for args in (["advise", "-s", "512k"], ["advise", "-s", "512k", "--verbose"], ["advise", "-s", "512k", "--json"]):
        r = runner.invoke(app, args, env=WIDE)
        assert (r.stdout + r.stderr).count("is past llama-2-7b's max_position_embeddings 4096") == 1, args


def test_a_recipe_lists_its_stages_and_the_whole_bill_on_one_screen():
    p = cli("advise", "--recipe", "1M")
    assert p.returncode == 0, p.stderr
    assert screen_lines(p.stdout) + screen_lines(p.stderr) <= 25, p.stdout
    wide = cli("advise", "--recipe", "1M", columns=400).stdout
    assert "Stages" in wide and wide.count("RoPE") == 7 and re.search(r"Bill +whole recipe: .* GPU-hours on 8 GPUs", wide)


def _changed(plan: LaunchPlan, a) -> tuple:
    """What an alternative changes from the plan (the reference for the table's grouping): another mode is a kind of
    its own; otherwise the names of the choices it changes (a layer count alone is none)."""
    s = plan.strategy
    names = ("sp_degree", "dp_degree", "ulysses_degree", "checkpointing", "kept_saves", "sharding", "loss_impl")
    names += ("fused_ops", "tiled_mlp")
    key = (a.mode,) if a.mode != s.mode else tuple(n for n in names if getattr(a, n) != getattr(s, n))
    return key + tuple(n for n in names[3:] if a.mode != s.mode and getattr(a, n) != getattr(s, n))


@pytest.mark.parametrize("args", [["-s", "512k"], ["-s", "1k", "-m", "tiny", "--cluster", "cpu:2"]])
def test_verbose_lists_each_kind_of_alternative_once_the_best_of_it(args, tmp_path):
    out = tmp_path / "plan.json"
    r = runner.invoke(app, ["advise", *args, "-o", str(out), "--verbose"], env=WIDE)
    assert r.exit_code == 0, r.stderr
    plan = LaunchPlan.load(out)
    groups: dict[tuple, list[float]] = {}
    for a in plan.rationale.alternatives:
        oom = a.prediction.oom_risk
        groups.setdefault(_changed(plan, a.strategy) + (oom,), []).append((oom, -a.prediction.tokens_per_s))
    best = sorted(f"{-min(v)[1]:,.0f}" for v in groups.values())
    table = r.stdout.split("Alternatives, the best of each kind")[1].split("\n\n")[0].splitlines()[4:]
    shown = sorted(re.search(r"  ([\d,]+) \([+-][\d.]+%\)", ln)[1] for ln in table if ln.strip())
    assert shown == best  # each kind once, its best
    assert "(-0%)" not in r.stdout and "(+0%)" not in r.stdout  # a small difference reads -0.1%, not -0%
    if len(groups) < len(plan.rationale.alternatives):
        assert "alike)" in r.stdout
    explained = runner.invoke(app, ["explain", str(out)], env=WIDE).stdout
    assert explained.split("Alternatives, the best")[1] == r.stdout.split("Alternatives, the best")[1]


def test_the_glossary_is_in_the_help():
    for args in (["--help"], ["advise", "--help"]):
        out = " ".join(runner.invoke(app, args, env=NARROW).stdout.replace("│", " ").split())
        for word in ("sp / dp", "zero2 / zero3", "zero3_offload", "offload", "chunked loss", "selective", "MFU", "bill"):
            assert word in out, (args, word)


# --------------------------------------------------------------------------------------------- refusals


def refusal(*args: str) -> str:
    r = runner.invoke(app, ["advise", *args, "--json"])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == 2 and len(lines) == 1 and r.stdout == "", (r.exit_code, r.stderr)
    return lines[0]


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["-s", "1k", "-m", "tiny", "--mode", "usp_attn", "--cluster", "cpu:2"],
            [
                "on 2 CPU ranks",
                "a Ulysses degree and a ring degree of at least 2 each",
                "at least 4 ranks",
                "tiny's 4 query and 2 KV heads divisible by the Ulysses degree",
                "--cluster cpu:4",
            ],
        ),
        (
            ["-s", "128k", "--mode", "usp_attn", "--gpu", "h100", "--gpus", "8", "--sp-degree", "3"],
            ["on 8 GPUs", "--sp-degree 3 has no such split", "pin an sp_degree in [4, 8]"],
        ),
        (
            ["-s", "1k", "-m", "tiny", "--mode", "zigzag_ring_attn", "--cluster", "cpu:1"],
            ["on 1 CPU rank:", "at least 2 ranks", "--cluster cpu:2"],
        ),
        (
            ["-s", "1k", "-m", "tiny", "--mode", "data_parallel", "--cluster", "cpu:2", "--sp-degree", "2"],
            ["keeps whole sequences on each rank", "drop --sp-degree"],
        ),
        (
            ["-s", "128k", "--gpu", "h100", "--gpus", "8", "--ulysses-degree", "3"],
            ["--ulysses-degree 3 forms no split of sp_degree 2, 4 or 8", "pick --ulysses-degree 2 or 4"],
        ),
    ],
)
def test_a_refusal_says_why_in_the_clusters_words(args, says):
    line = refusal(*args)
    for text in says:
        assert text in line, (text, line)
    assert "nothing to try" not in line
    if "cpu:" in " ".join(args):
        assert "GPU" not in line


@pytest.mark.parametrize(
    "args, seq_len, below, above",
    [
        (["-m", "tiny", "--mode", "zigzag_ring_attn", "--cluster", "cpu:2"], 1001, 1000, 1004),
        (["--mode", "zigzag_ring_attn", "--gpu", "h200", "--gpus", "8"], 100001, 100000, 100004),
        (["--gpu", "h100", "--gpus", "8", "--sp-degree", "8"], 100001, 100000, 100008),
    ],
)
def test_a_length_that_does_not_split_names_the_nearest_that_do(args, seq_len, below, above):
    line = refusal("-s", str(seq_len), *args)
    assert f"seq_len {seq_len} does not split evenly" in line and f"nearest valid: {below} or {above}" in line
    for n in range(below, above + 1):  # the reference: the advisor itself at each length in between
        code = runner.invoke(app, ["advise", "-s", str(n), *args, "--json"]).exit_code
        assert code == (0 if n in (below, above) else 2), n


def test_max_seq_len_says_which_modes_cannot_run_and_why():
    r = runner.invoke(app, ["advise", "--max-seq-len", "--cluster", "cpu:2", "-m", "tiny"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert "(16 GiB CPU ranks)" in r.stdout and "GPU" not in r.stdout
    row = next(ln for ln in r.stdout.splitlines() if "│ usp_attn " in ln)
    assert "cannot run here (below)" in row and "none fits" not in r.stdout
    assert "usp_attn cannot run here: usp_attn needs a Ulysses degree and a ring degree of at least 2 each" in r.stdout


# --------------------------------------------------------------------------------------------- 80 columns


def _panels(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    name = None
    for ln in text.splitlines():
        m = re.match(r"╭─ (.+?) ─", ln)
        if m:
            name = m[1]
            out[name] = []
        elif ln.startswith("╰"):
            name = None
        elif name:
            out[name].append(ln.strip("│ ").rstrip(" │"))
    return out


@pytest.mark.parametrize("command", ["advise", "check"])
def test_every_help_panel_reads_at_80_columns(command):
    panels = _panels(runner.invoke(app, [command, "--help"], env=NARROW).stdout)
    assert "Pins (default: the advisor chooses)" in panels
    for name, lines in panels.items():
        options = [ln for ln in lines if ln.startswith("--")]
        if options:  # help a line or three per option, not a word or two a line
            assert len(lines) <= 3 * len(options) + 1, (name, lines)
        starts = [len(ln) - len(re.split(r"\s{2,}", ln)[-1]) for ln in lines if len(re.split(r"\s{2,}", ln)) >= 3]
        assert min(starts) <= 46, (name, starts)  # the help column is at least 30 wide


def test_the_eval_table_keeps_its_columns_at_80():
    from seqpar.runtime.eval.show import needle_table, perplexity_table

    length = {
        "seq_len": 1048576,
        "windows": 64,
        "tokens": 67108864,
        "loss": 9.421312,
        "perplexity": 12345.678,
        "buckets": [{"loss": 9.50912}, {"loss": 9.31234}],
        "measured": {"peak_memory_gib": 71.234, "tokens_per_s": 1234567.8},
        "predicted": {"peak_memory_gib": 69.87, "tokens_per_s": 1198765.4},
    }
    report = {"strategy": {"mode": "zigzag_ring_attn", "sp_degree": 8, "dp_degree": 1}, "device": "8x H100", "lengths": [length]}
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(perplexity_table(report))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    for figure in (
        "1M",
        "64",
        "67,108,864",
        "9.4213",
        "12345.68",
        "9.509",
        "9.312",
        "71.23",
        "(69.87)",
        "1,234,568",
        "(1,198,765)",
    ):
        assert re.search(rf"(?<![\d,.]){re.escape(figure)}(?![\d,.])", text), figure  # whole, never cut or folded
    grid = {"lengths": [1024 << i for i in range(8)], "depths": [0, 0.5, 1], "exact_match": [[1.0] * 8] * 3}
    grid["log_likelihood"] = [[-12.34] * 8] * 3
    console.print(needle_table({"grid": grid, "prompts": "3 samples", **report}))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80 and text.count("(-12.3)") == 24


def test_calibrate_formats_its_figures_alike_and_keeps_cpu_rows_apart(tmp_path):
    plan = tmp_path / "plan.json"
    assert runner.invoke(app, ["advise", "-s", "256", "-m", "tiny", "--cluster", "cpu:2", "-o", str(plan)]).exit_code == 0
    report = {"plan": json.loads(plan.read_text()), "measured": {"tokens_per_s": 5169.23823479724, "peak_memory_gib": 0.3757}}
    (tmp_path / "run_report.json").write_text(json.dumps(report))
    r = runner.invoke(app, ["calibrate", str(tmp_path)], env=NARROW)
    assert r.exit_code == 0, r.output
    assert max(map(len, r.stdout.splitlines())) <= 80 and "…" not in r.stdout
    assert not re.search(r"\d\.\d{3,}", r.stdout)  # no raw float beside the formatted ones
    gpu, cpu = r.stdout.split("CPU ranks (gloo), apart")
    assert "5,169" in cpu and "5,169" not in gpu and "tiny" in cpu
    assert "not fitted: the cost model's coefficients are fitted to GPU runs" in cpu
    residuals = [float(x) for x in re.findall(r"([+-]\d+\.\d)%\s+(?:[+-]\d+\.\d%|-)\s*$", gpu, re.M)]
    top = re.search(r"GPU rows: max \|residual\| (\d+\.\d)%", gpu)
    assert residuals and float(top[1]) == max(abs(x) for x in residuals)  # the GPU rows' own maximum, not the CPU row's


def test_the_calibration_picture_keeps_cpu_runs_apart_with_a_caveat():
    from seqpar.advisor.plots import CPU_CAVEAT, measured_vs_predicted_figure

    def row(m: float, p: float, gib: float) -> dict:
        keys = ("measured_tokens_per_s", "predicted_tokens_per_s", "measured_peak_gib", "predicted_peak_gib")
        return dict(zip(keys, (m, p, gib, gib * 1.02)))

    shipped, yours, cpu = [row(2000, 2100, 60), row(8000, 7900, 70)], [row(4000, 4100, 40)], [row(5169, 12272, 0.38)]
    fig = measured_vs_predicted_figure(shipped, yours, cpu)
    speed, memory = fig.axes
    labelled = {c.get_label(): len(c.get_offsets()) for c in speed.collections}
    assert labelled["your runs on CPU ranks (not fitted)"] == 1 and labelled["shipped measurements"] == 2
    assert "your runs on CPU ranks (not fitted)" not in {c.get_label() for c in memory.collections}
    assert min(memory.get_xlim()) > 1  # the CPU run's RSS does not stretch the memory axis
    assert CPU_CAVEAT in [t.get_text() for t in fig.texts]
    assert not measured_vs_predicted_figure(shipped, yours).texts  # no CPU run, no caveat


# --------------------------------------------------------------------------------------------- the README shows them


def _readme_examples() -> dict[str, list[str]]:
    """The README's ```text examples that start with a `$ seqpar ...` line: command -> the lines it shows, each command
    of a block with the lines up to the next command."""
    out: dict[str, list[str]] = {}
    for body in re.findall(r"```text\n(.*?)```", README, re.S):
        command = None
        for ln in body.splitlines():
            if ln.startswith("$ seqpar "):
                command = ln[2:]
                out[command] = []
            elif command:
                out[command].append(ln.rstrip())
    return out


def test_the_readme_shows_the_one_screen_answer_the_refusals_and_the_alternatives():
    examples = _readme_examples()
    shown = examples["seqpar advise --seq-len 512k"]
    p = cli("advise", "--seq-len", "512k")
    out = [ln.rstrip() for ln in p.stdout.splitlines()]
    assert shown[2:-1] == out  # the answer as printed at 80 columns
    assert shown[0] == "seq_len 524288 (512K)" and shown[1].startswith("cluster: default: 8x A100-80G SXM")
    assert shown[-1] == p.stderr.splitlines()[-1] and shown[-1].startswith("warning: seq_len 524288 (512K) is past")
    for command, lines in examples.items():
        if command.startswith("seqpar advise -s "):  # a refusal: its one line, as printed
            r = runner.invoke(app, command.split()[1:])
            assert r.exit_code == 2 and lines == [r.stderr.splitlines()[-1]], command
    verbose = cli("advise", "--seq-len", "512k", "--verbose").stdout.split("Alternatives, the best of each kind")[1]
    table = [ln.rstrip() for ln in ("Alternatives, the best of each kind" + verbose).splitlines() if ln.strip()]
    assert "\n".join(table) in README  # `seqpar advise --seq-len 512k --verbose`'s alternatives, as printed
