"""Progressive recipes: the staged plan follows EasyContext's schedule, and `seqpar launch` runs the stages in order.

The end-to-end case runs the `smoke` recipe (2 stages, tiny model, 2 gloo ranks): stage 1 must start from stage 0's
final weights with its own rope theta, and `--resume` on a finished staged run must skip every stage. It is in the slow
set; the default set builds a stage's model from the previous stage's export in-process (what ``--init-from`` loads),
and tests/runtime/launch/test_launch.py checks that each stage's job passes it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.plan.launch_plan import LaunchPlan

runner = CliRunner()

# train_scripts/EasyContext-1M-Llama-2-7B.sh: (seq_len, rope_theta, steps, mode) per stage.
EASYCONTEXT_1M = [
    (32768, 1e6, 1000),
    (65536, 5e6, 1000),
    (256000, 1e7, 500),
    (256000, 2.5e7, 500),
    (256000, 5e7, 150),
    (512000, 1e8, 300),
    (512000, 2.5e8, 90),
]


@pytest.mark.parametrize("policy", ["rules", "cost"])
def test_1m_recipe_is_easycontexts_schedule_planned_per_stage(tmp_path, policy):
    out = tmp_path / "plan.json"
    r = runner.invoke(app, ["advise", "--recipe", "1M", "--model", "llama-2-7b", "--policy", policy, "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    plan = LaunchPlan.load(out)
    assert [(s.seq_len, s.rope_theta, s.steps) for s in plan.stages] == EASYCONTEXT_1M
    for s in plan.stages:  # each stage fills the cluster and splits its own length
        assert s.strategy.world_size == plan.cluster.world_size
        assert s.seq_len % (2 * s.strategy.sp_degree if s.strategy.mode == "zigzag_ring_attn" else s.strategy.sp_degree) == 0
        assert (s.prediction is None) == (policy == "rules")
    assert plan.workload.seq_len == 512000 and plan.training.rope_theta == 2.5e8 and plan.strategy == plan.stages[-1].strategy
    assert any(s.strategy.sp_degree > 1 for s in plan.stages[2:])  # 256K+ does not fit data parallel on 80 GB
    assert plan.rationale.reasons[0].startswith("recipe 1M")


def test_unknown_recipe_is_exit_2(tmp_path):
    r = runner.invoke(app, ["advise", "--recipe", "2M", "--model", "tiny", "--cluster", "cpu:2", "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "recipe '2M' is unknown; use one of 1M, smoke" in r.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_stage_starts_from_the_weights_the_previous_stage_exported(tmp_path):
    """What ``--init-from <previous stage's output>`` gives a stage: the saved weights, under its own rope theta."""
    from seqpar.profiles import get_model
    from seqpar.runtime.hf.model import build_model

    spec, folder = get_model("tiny"), tmp_path / "stage-0"
    build_model(spec, model_path=None, seed=1, rope_theta=None).save_pretrained(folder)
    saved = load_file(str(folder / "model.safetensors"))
    start = build_model(spec, model_path=None, seed=2, rope_theta=1e5, init_from=str(folder))
    fresh = build_model(spec, model_path=None, seed=2, rope_theta=1e5).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert start.state_dict()[name].equal(saved[name]) and not fresh[name].equal(saved[name])
    theta = start.config.to_dict().get("rope_parameters", {}).get("rope_theta", getattr(start.config, "rope_theta", None))
    assert theta == 1e5


@pytest.mark.slow
def test_launch_runs_stages_in_order_from_the_previous_weights(tmp_path):
    plan = tmp_path / "staged.json"
    r = runner.invoke(
        app,
        [
            "advise",
            "--recipe",
            "smoke",
            "--model",
            "tiny",
            "--cluster",
            "cpu:2",
            "--policy",
            "rules",
            "--mode",
            "zigzag_ring_attn",
            "--sp-degree",
            "2",
            "-o",
            str(plan),
        ],
    )
    assert r.exit_code == 0, r.stderr
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(plan), "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    s0, s1 = out / "stage-0", out / "stage-1"
    final0 = load_file(str(s0 / "checkpoints" / "step-000003" / "model" / "model.safetensors"))
    cfg1 = json.loads((s1 / "checkpoints" / "step-000003" / "model" / "config.json").read_text())
    theta = cfg1.get("rope_parameters", {}).get("rope_theta", cfg1.get("rope_theta"))
    assert theta == 1e5
    assert f"weights from {s0}" in (s1 / "train.log").read_text()
    # The weights stage 1 starts from (what --init-from <stage-0 output> loads) are stage 0's final ones, not a fresh init.
    from seqpar.runtime.hf.model import build_model

    staged = LaunchPlan.load(s1 / "plan.json")
    assert staged.workload.seq_len == 128
    start = build_model(
        staged.workload.model,
        model_path=None,
        seed=staged.training.seed,
        rope_theta=1e5,
        init_from=str(s0 / "checkpoints" / "step-000003" / "model"),
    ).state_dict()
    fresh = build_model(staged.workload.model, model_path=None, seed=staged.training.seed, rope_theta=1e5).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert start[name].equal(final0[name]) and not fresh[name].equal(final0[name])
    assert len((s1 / "metrics.jsonl").read_text().splitlines()) == 3
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.count("already finished, skipping") == 2, r.stderr[-2000:]
