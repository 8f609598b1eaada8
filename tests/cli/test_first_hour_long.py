"""The first day of a long run: training settings from the command line into the plan and the trainer, the default
checkpoint interval (about hourly) and --keep-last, the predicted bill in advise/explain/launch, no silent out-of-memory
plans, the RoPE warning, the end-of-run comparison and the export's place, and plans readable under the user's umask."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seqpar.advisor.bill import duration, plan_bill
from seqpar.cli import app
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.options import hourly
from seqpar.plan.units import format_tokens

runner = CliRunner()
WIDE = {"COLUMNS": "400"}  # one table row per line
TINY = ["-m", "tiny", "--cluster", "cpu:2", "-s", "256", "--mode", "zigzag_ring_attn"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env=WIDE)


def row(stdout: str, label: str) -> str:
    """The text of a table row ('label   text') of the human output."""
    return next(ln[len(label) :].strip() for ln in stdout.splitlines() if ln.startswith(label + "  "))


# --------------------------------------------------------------------------------------------- training settings


def test_training_flags_reach_the_plan_and_explain(tmp_path):
    plan = tmp_path / "plan.json"
    flags = ["--steps", 40, "--lr", "3e-4", "--warmup", 4, "--lr-schedule", "cosine", "--weight-decay", "0.1"]
    flags += ["--rope-theta", "5e5", "--checkpoint-every", 10, "--keep-last", 3]
    r = invoke("advise", *TINY, *flags, "-o", plan)
    assert r.exit_code == 0, r.output
    t = LaunchPlan.load(plan).training
    assert (t.steps, t.learning_rate, t.warmup_steps, t.lr_schedule, t.weight_decay) == (40, 3e-4, 4, "cosine", 0.1)
    assert (t.rope_theta, t.checkpoint_every, t.keep_last) == (5e5, 10, 3)
    out = invoke("explain", plan).stdout
    assert row(out, "learning rate") == "0.0003 peak, cosine, 4 warmup steps"
    assert row(out, "checkpoints") == "every 10 steps" and row(out, "kept") == "the newest 3"
    assert row(out, "RoPE base") == "500000 (model's 10000)"
    auto = tmp_path / "auto.json"
    assert invoke("advise", *TINY, "--checkpoint-every", "auto", "-o", auto).exit_code == 0
    assert LaunchPlan.load(auto).training.checkpoint_every is None


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--lr", "0"], "--lr 0.0 must be a finite number > 0"),
        (["--lr", "nan"], "--lr nan must be a finite number > 0"),
        (["--rope-theta", "inf"], "--rope-theta inf must be a finite number > 0"),
        (["--steps", "10", "--warmup", "10"], "--warmup 10 is not below the 10 steps"),
        (["--checkpoint-every", "hourly"], "--checkpoint-every 'hourly' is not a number of steps"),
        (["--recipe", "smoke", "--rope-theta", "1e6"], "--rope-theta cannot apply to --recipe smoke"),
    ],
)
def test_bad_training_settings_are_one_line_and_write_nothing(tmp_path, flags, match):
    plan = tmp_path / "plan.json"
    args = ["-m", "tiny", "--cluster", "cpu:2", *flags] + ([] if "--recipe" in flags else ["-s", "256"])
    r = invoke("advise", *args, "-o", plan)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == 2 and len(errors) == 1 and match in errors[0], r.stderr
    assert not plan.exists()


def test_default_checkpoint_interval_is_about_hourly_from_the_predicted_step():
    from seqpar.runtime.checkpoint.storage import interval

    r = invoke("advise", "-s", "512k", "--json")
    plan = LaunchPlan.model_validate_json(r.stdout)
    assert plan.training.checkpoint_every is None  # the default: not "only at the end"
    step = plan.prediction.step_time_s
    every = round(3600 / step)
    assert hourly(step) == every and interval(plan, None) == (
        every,
        f"every {every} steps: about hourly at the predicted {step:.3g} s per step",
    )
    assert every * step == pytest.approx(3600, rel=0.05)  # 19 steps x 192 s, not 1000 x 192 s = 53 hours
    assert row(invoke("advise", "-s", "512k", "--verbose").stdout, "checkpoints") == interval(plan, None)[1]


# --------------------------------------------------------------------------------------------- the bill


def test_the_predicted_bill_of_a_recipe_in_advise_explain_and_launch(tmp_path):
    plan_file = tmp_path / "plan.json"
    r = invoke("advise", "--recipe", "1M", "-m", "llama-2-7b", "-o", plan_file)
    assert r.exit_code == 0, r.output
    plan = LaunchPlan.load(plan_file)
    # the reference: the plan's own predictions, each stage's first step (a new process: one-off costs) then warm steps
    walls = [st.prediction.first_step_s + (st.steps - 1) * st.prediction.step_time_s for st in plan.stages]
    assert all(st.prediction.first_step_s > st.prediction.step_time_s for st in plan.stages)
    gpus = plan.cluster.world_size
    bill = plan_bill(plan)
    assert [s.wall_s for s in bill.stages] == pytest.approx(walls)
    assert bill.gpu_hours == pytest.approx(sum(walls) * gpus / 3600)
    assert 100 * 3600 < bill.wall_s < 200 * 3600  # EasyContext's schedule on 8x A100: about 143 hours
    total = f"whole recipe: {duration(sum(walls))}, {sum(walls) * gpus / 3600:,.0f} GPU-hours on {gpus} GPUs"
    explained = invoke("explain", plan_file).stdout
    assert total in r.stdout and total in explained  # advise's one screen has the total, explain each stage's bill too
    for i, st in enumerate(plan.stages):
        assert f"stage {i} ({format_tokens(st.seq_len)}): {st.steps} steps x {st.prediction.step_time_s:.3g} s" in explained
    dry = invoke("launch", plan_file, "--dry-run", "--steps", 10)  # --steps: per stage, so the bill follows it
    assert dry.exit_code == 0, dry.output
    first = [ln for ln in dry.stdout.splitlines() if ln.startswith("# seqpar launch: predicted")]
    assert len(first) == len(walls) + 1 and dry.stdout.index(first[0]) < dry.stdout.index("# stage 0")
    ten = sum(st.prediction.first_step_s + 9 * st.prediction.step_time_s for st in plan.stages)
    assert (
        first[-1]
        == f"# seqpar launch: predicted whole recipe: {duration(ten)}, {ten * gpus / 3600:,.0f} GPU-hours on {gpus} GPUs"
    )


# --------------------------------------------------------------------------------------------- plans that do not fit


def test_advise_exits_1_when_nothing_fits_and_launch_refuses_such_a_plan(tmp_path):
    plan = tmp_path / "plan.json"
    r = invoke("advise", "-s", "4M", "--gpu", "l4", "--gpus", 1, "-o", plan)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == 1 and len(errors) == 1 and "error: no strategy fits" in errors[0], r.stderr
    assert f"the plan was written to {plan}" in errors[0] and LaunchPlan.load(plan).prediction.oom_risk
    r = invoke("advise", "-s", "4M", "--gpu", "l4", "--gpus", 1, "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["prediction"]["oom_risk"] and "nothing written" in r.stderr
    r = invoke("launch", plan, "--output", tmp_path / "o")
    assert r.exit_code == 1 and "prediction says it does not fit" in r.stderr and "--force" in r.stderr
    assert not (tmp_path / "o").exists()
    forced = invoke("launch", plan, "--force", "--output", tmp_path / "o")
    assert "does not fit" not in forced.stderr  # past the verdict (whatever stops it next on this machine)
    dry = invoke("launch", plan, "--dry-run")
    assert dry.exit_code == 0 and "warning: the plan's prediction says it does not fit" in dry.stderr


# --------------------------------------------------------------------------------------------- RoPE


def warned(r) -> bool:
    return any(ln.startswith("warning: ") for ln in r.stderr.splitlines())


def test_rope_warning_past_the_models_positions_and_the_recipes_schedule(tmp_path):
    past = invoke("advise", "-s", "512k")
    assert "warning: seq_len 524288 (512K) is past llama-2-7b's max_position_embeddings 4096" in past.stderr
    assert "max_position_embeddings" not in past.stdout  # said once: on stderr, with --json too
    verbose = invoke("advise", "-s", "512k", "--verbose")
    assert (verbose.stdout + verbose.stderr).count("is past llama-2-7b's max_position_embeddings") == 1
    assert not warned(invoke("advise", "-s", "512k", "--rope-theta", "2.5e8"))
    assert not warned(invoke("advise", "-s", "4k"))
    plan = tmp_path / "recipe.json"
    r = invoke("advise", "--recipe", "1M", "-o", plan, "--verbose")
    assert not warned(r)
    for i, st in enumerate(LaunchPlan.load(plan).stages):
        assert row(r.stdout, f"stage {i}").startswith(f"{st.seq_len // 1024}K, RoPE base {st.rope_theta:g}, {st.steps} steps")


# --------------------------------------------------------------------------------------------- a real run


@pytest.mark.slow
def test_launch_keeps_the_plans_last_checkpoints_and_ends_with_measured_vs_predicted(tmp_path):
    """Two gloo ranks: the plan's keep_last (1) prunes, the first lines are the bill, the last ones the comparison and
    the export. In the slow set: the default set reads the same lines from the README's first run
    (test_first_hour_readme.py), and --keep-last prunes in tests/runtime/checkpoint/test_resume.py."""
    plan = tmp_path / "plan.json"
    assert invoke("advise", *TINY, "--steps", 3, "--checkpoint-every", 1, "--keep-last", 1, "-o", plan).exit_code == 0
    p = subprocess.run(
        [sys.executable, "-m", "seqpar.cli", "launch", str(plan), "--output", str(tmp_path / "run")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr
    steps = sorted(x.name for x in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert steps == ["step-000003"]  # steps 1 and 2 were written and pruned to the plan's keep_last
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("seqpar launch: ")]
    assert lines[0].startswith("seqpar launch: predicted 3 steps x ") and "rank-hours on 2 CPU ranks" in lines[0]
    report = json.loads((tmp_path / "run" / "run_report.json").read_text())
    m, pr = report["measured"]["tokens_per_s"], report["predicted"]["tokens_per_s"]
    assert lines[-2].startswith(
        f"seqpar launch: done, 3 steps; tokens/s {m:,.0f} measured, {pr:,.0f} predicted ({m / pr - 1:+.0%})"
    )
    model = tmp_path / "run" / "checkpoints" / "step-000003" / "model"
    assert lines[-1] == f"seqpar launch: model exported to {model} (transformers' from_pretrained reads it)"
    assert (model / "config.json").is_file()


# --------------------------------------------------------------------------------------------- file modes


@pytest.mark.parametrize("umask, existing, want", [(0o022, None, 0o644), (0o077, None, 0o600), (0o022, 0o640, 0o640)])
def test_plans_are_written_with_the_users_umask(tmp_path, umask, existing, want):
    plan = tmp_path / "plan.json"
    if existing is not None:
        plan.write_text("{}")
        plan.chmod(existing)
    old = os.umask(umask)
    try:
        assert invoke("advise", *TINY, "-o", plan).exit_code == 0
    finally:
        os.umask(old)
    assert plan.stat().st_mode & 0o777 == want
    assert LaunchPlan.load(plan).strategy.mode == "zigzag_ring_attn"
    assert not [x for x in Path(tmp_path).iterdir() if x.name.startswith(".plan.json.")]
