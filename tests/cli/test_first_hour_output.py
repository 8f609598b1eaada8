"""Output people read: every command's help at 80 columns (examples one per line, nothing cut), profile listings with
whole names and rounded figures, each alternative once with a reason that does not repeat it, the three pictures (their
axes read back from the figures), and the lazy public API in dir(seqpar)."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.plan.launch_plan import LaunchPlan

runner = CliRunner()
NARROW = {"COLUMNS": "80"}


def _commands(group, path=()):
    """(command path, click command) for every leaf command of the CLI."""
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


COMMANDS = list(_commands(typer.main.get_command(app)))


def _examples(cmd) -> list[str]:
    doc = inspect.getdoc(cmd.callback) or ""
    block = re.search(r"\*\*Examples\*\*\s*```\n(.*?)```", doc, re.S)
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip()] if block else []


@pytest.mark.parametrize("path, cmd", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_reads_at_80_columns(path, cmd):
    r = runner.invoke(app, [*path, "--help"], env=NARROW)
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in r.stdout
    shown = {ln.strip() for ln in lines}
    examples = _examples(cmd)
    assert examples, f"seqpar {' '.join(path)}: its help has no Examples block"
    for ex in examples:  # one per line, whole
        assert ex in shown, f"example not on one line at 80 columns: {ex}"
    for p in cmd.params:  # every option's name shown whole (not folded), its choices readable
        if getattr(p, "hidden", False):
            continue
        for opt in p.opts:
            if opt.startswith("--"):
                assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", r.stdout), opt
        choices = getattr(getattr(p, "type_descriptor", None), "choices", None)
        if choices:
            flat = " ".join(r.stdout.replace("│", " ").split())
            assert all(str(c) in flat for c in choices), (p.opts, choices)


def test_advise_help_groups_its_options_in_panels():
    out = runner.invoke(app, ["advise", "--help"], env=NARROW).stdout
    titles = re.findall(r"╭─ (.+?) ─", out)
    assert titles == [
        "Options",
        "Workload",
        "LoRA (default: full fine-tuning)",
        "Cluster",
        "Pins (default: the advisor chooses)",
        "Training (default: the plan's defaults)",
        "Advice",
        "Output",
    ]
    training = out.split("Training (default")[1].split("╰")[0]
    for flag in (
        "--steps",
        "--lr",
        "--warmup",
        "--lr-schedule",
        "--weight-decay",
        "--rope-theta",
        "--checkpoint-every",
        "--keep-last",
    ):
        assert re.search(rf"{flag}(?![\w-])", training), flag


def test_profile_listings_keep_whole_names_and_round_figures():
    from seqpar.profiles import list_gpus, list_links, list_models

    names = [g.name for g in list_gpus()] + [x.kind for x in list_links()] + [m.name for m in list_models()]
    piped = subprocess.run(
        [sys.executable, "-m", "seqpar.cli", "profiles", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"},
    ).stdout
    for out in (piped, runner.invoke(app, ["profiles", "list"], env=NARROW).stdout):
        assert "…" not in out and max(map(len, out.splitlines())) <= 80
        first = {ln.split()[0] for ln in out.splitlines() if ln.strip()}
        assert set(names) <= first, set(names) - first
    shown = runner.invoke(app, ["profiles", "show", "h100"], env=NARROW).stdout
    fields = {ln.split()[0]: ln.split()[1] for ln in shown.splitlines() if len(ln.split()) > 1}
    assert (fields["memory_gib"], fields["bf16_tflops"], fields["hbm_bandwidth_gb_s"]) == ("79.65", "989", "3350")
    assert json.loads(runner.invoke(app, ["profiles", "show", "h100", "--json"]).stdout)["memory_gib"] == 79.6474609375


def test_each_alternative_once_and_its_reason_does_not_repeat_it():
    from seqpar.advisor.search import describe

    r = runner.invoke(app, ["advise", "-s", "512k", "--json"])
    plan = LaunchPlan.model_validate_json(r.stdout)
    alts = plan.rationale.alternatives
    assert len(alts) >= 5
    assert len({a.strategy for a in alts}) == len(alts) and plan.strategy not in {a.strategy for a in alts}
    for a in alts:
        assert describe(a.strategy) not in a.rejected_because and a.strategy.mode not in a.rejected_because
    # people see them once, in explain's (and --verbose's) table, the best of each kind of change (test_one_screen.py)
    human = runner.invoke(app, ["advise", "-s", "512k", "--verbose"], env={"COLUMNS": "400"}).stdout
    table = human.split("Alternatives, the best of each kind")[1].split("\n\n")[0].splitlines()[4:]
    rows = [ln.strip() for ln in table if ln.strip()]
    assert 5 <= len(rows) <= len(alts) and len(set(rows)) == len(rows)
    assert not [ln for ln in human.splitlines() if ln.startswith("not ")]  # no second listing in the Why section


# --------------------------------------------------------------------------------------------- pictures


@pytest.fixture(scope="module")
def plan_512k():
    return LaunchPlan.model_validate_json(runner.invoke(app, ["advise", "-s", "512k", "--json"]).stdout)


def test_memory_vs_seq_len_picture(plan_512k):
    from matplotlib.colors import to_hex

    from seqpar.advisor.plots import memory_vs_seq_len_figure

    ax = memory_vs_seq_len_figure(plan_512k).axes[0]
    assert ax.get_yscale() == "log" and ax.get_xscale() == "log"
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert {"32K", "128K", "512K"} <= set(labels)
    modes = [
        ln
        for ln in ax.get_lines()
        if ln.get_label().split(" ")[0] in ("data_parallel", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")
    ]
    assert len(modes) == 5
    looks = {(to_hex(ln.get_color()), ln.get_linestyle(), ln.get_marker()) for ln in modes}
    assert len(looks) == 5  # each mode its colour, line style and marker
    cap = [ln for ln in ax.get_lines() if "capacity" in ln.get_label()]
    assert len(cap) == 1 and set(cap[0].get_ydata()) == {plan_512k.cluster.gpu.memory_gib}


def test_memory_by_phase_picture(plan_512k):
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.memory import estimate_memory
    from seqpar.advisor.plots import memory_by_phase_figure
    from seqpar.plan.units import GIB

    mem = estimate_memory(plan_512k.workload, plan_512k.cluster, plan_512k.strategy, load_coefficients())
    ax = memory_by_phase_figure(plan_512k).axes[0]
    tops = {}
    for bar in ax.patches:  # stacked: each phase's bars reach its predicted total
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    assert [t.get_text() for t in ax.get_xticklabels()] == list(mem.phases)
    assert [tops[i] for i in range(len(mem.phases))] == pytest.approx([v / GIB for v in mem.phases.values()], rel=1e-9)
    assert any("capacity" in ln.get_label() for ln in ax.get_lines())


def test_explain_and_calibrate_write_their_pictures(tmp_path):
    plan = tmp_path / "plan.json"
    assert runner.invoke(app, ["advise", "-s", "128k", "--gpu", "h200", "--gpus", "8", "-o", str(plan)]).exit_code == 0
    r = runner.invoke(app, ["explain", str(plan), "--plot", str(tmp_path / "memory.png")])
    assert r.exit_code == 0, r.output
    for name in ("memory.png", "memory-phases.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {tmp_path / name}" in r.stderr
    report = tmp_path / "run_report.json"
    report.write_text(
        json.dumps({"plan": json.loads(plan.read_text()), "measured": {"tokens_per_s": 25000.0, "peak_memory_gib": 60.0}})
    )
    r = runner.invoke(app, ["calibrate", str(tmp_path), "--plot", str(tmp_path / "fit.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measured_vs_predicted_picture():
    from seqpar.advisor.cost.fit import evaluate
    from seqpar.advisor.cost.measurements import load_measurements
    from seqpar.advisor.plots import measured_vs_predicted_figure

    rows = evaluate(load_measurements()).rows
    mine = rows[-1:]
    fig = measured_vs_predicted_figure(rows[:-1], mine)
    speed, memory = fig.axes
    timed = [r for r in rows if r["measured_tokens_per_s"]]
    points = [c for c in speed.collections]
    assert sum(len(c.get_offsets()) for c in points) == len(timed)
    assert speed.get_xscale() == speed.get_yscale() == "log"
    assert any(ln.get_label() == "predicted = measured" for ln in speed.get_lines())
    drawn = sorted(float(v) for c in points for p in c.get_offsets() for v in p)
    want = sorted(v for r in timed for v in (r["measured_tokens_per_s"], r["predicted_tokens_per_s"]))
    assert drawn == pytest.approx(want)
    assert memory.get_xlabel() == "measured peak allocated GiB"


# --------------------------------------------------------------------------------------------- the package


def test_dir_lists_the_lazy_public_api():
    import seqpar

    api = {
        "apply",
        "prepare_inputs",
        "loss",
        "loss_from_hidden",
        "prepare_seq_parallel_inputs",
        "apply_seq_parallel_monkey_patch",
    }
    assert api <= set(dir(seqpar)) and api <= set(seqpar.__all__)
    assert callable(seqpar.apply)
