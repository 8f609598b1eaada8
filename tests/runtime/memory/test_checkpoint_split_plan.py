"""The plan's checkpointing split (Strategy.checkpoint_layers, offload_layers): the rules plan_problems states for it, old
plans without the fields, the JSON round trip, the text the trainer logs, and `seqpar check` / `seqpar explain` on a plan
that sets them (Llama-2-7B: 32 layers; one H200)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.cli import app
from seqpar.plan.launch_plan import LaunchPlan, Rationale
from seqpar.plan.rules import checkpointed_layers, checkpointing_text, offloaded_layers, plan_problems
from seqpar.plan.specs import Strategy, Workload
from seqpar.profiles import get_model

LAYERS = 32  # Llama-2-7B


def _workload() -> Workload:
    return Workload(model=get_model("llama-2-7b"), seq_len=65536, optimizer="none")


def _plan(**strategy) -> LaunchPlan:
    return LaunchPlan(
        workload=_workload(),
        cluster=cluster_from_flags("h200", 1),
        strategy=Strategy(mode="data_parallel", **strategy),
        rationale=Rationale(policy="pinned"),
    )


@pytest.mark.parametrize(
    "strategy,line",
    [
        (
            dict(checkpointing="none", checkpoint_layers=4),
            "checkpoint_layers 4 picks the layers that checkpointing applies to, but checkpointing is none; remove "
            "checkpoint_layers, or pick checkpointing full, selective or offload",
        ),
        (
            dict(checkpointing="full", checkpoint_layers=33),
            "checkpoint_layers 33 is more than the 32 decoder layers of llama-2-7b; use at most 32 (32 or unset = every "
            "layer checkpointed)",
        ),
        (
            dict(checkpointing="selective", offload_layers=2),
            "offload_layers 2 sends checkpointed layer inputs to host memory, which only checkpointing offload does, but "
            "checkpointing is selective; remove offload_layers, or use checkpointing offload",
        ),
        (
            dict(checkpointing="offload", checkpoint_layers=8, offload_layers=9),
            "offload_layers 9 is more than the 8 checkpointed layers (checkpoint_layers 8); use at most 8",
        ),
        (
            dict(checkpointing="offload", offload_layers=40),
            "offload_layers 40 is more than the 32 checkpointed layers (every layer of llama-2-7b); use at most 32",
        ),
    ],
)
def test_plan_problems_refuses_a_split_with_one_line(strategy, line):
    s = Strategy(mode="data_parallel", **strategy)
    problems = plan_problems(_workload(), cluster_from_flags("h200", 1), s)
    assert problems == [line]
    with pytest.raises(ValidationError) as e:  # the plan raises the same line
        _plan(**strategy)
    assert line in str(e.value)


def test_negative_counts_are_refused_by_the_field():
    for field in ("checkpoint_layers", "offload_layers"):
        with pytest.raises(ValidationError, match="greater than or equal to 0"):
            Strategy(mode="data_parallel", checkpointing="offload", **{field: -1})


@pytest.mark.parametrize(
    "strategy,ckpt,off,text",
    [
        (dict(checkpointing="full"), LAYERS, 0, "full"),
        (dict(checkpointing="full", checkpoint_layers=LAYERS), LAYERS, 0, "full"),  # all layers: the same as unset
        (dict(checkpointing="none"), 0, 0, "none"),
        (
            dict(checkpointing="selective", checkpoint_layers=24),
            24,
            0,
            "selective (layers 0-23: checkpointed; layers 24-31: not checkpointed)",
        ),
        (dict(checkpointing="full", checkpoint_layers=0), 0, 0, "full (layers 0-31: not checkpointed)"),
        (dict(checkpointing="offload"), LAYERS, LAYERS, "offload"),
        (
            dict(checkpointing="offload", checkpoint_layers=24, offload_layers=1),
            24,
            1,
            "offload (layer 0: input in host memory; layers 1-23: input on the GPU; layers 24-31: not checkpointed)",
        ),
        (
            dict(checkpointing="offload", offload_layers=0),
            LAYERS,
            0,
            "offload (layers 0-31: input on the GPU)",
        ),
        (
            dict(checkpointing="offload", checkpoint_layers=31),
            31,
            31,
            "offload (layers 0-30: input in host memory; layer 31: not checkpointed)",
        ),
    ],
)
def test_valid_splits_and_their_text(strategy, ckpt, off, text):
    plan = _plan(**strategy)
    s = plan.strategy
    assert (checkpointed_layers(s, LAYERS), offloaded_layers(s, LAYERS)) == (ckpt, off)
    assert checkpointing_text(s, LAYERS) == text


def test_old_plans_load_and_new_ones_round_trip(tmp_path):
    old = json.loads(_plan(checkpointing="offload").to_json())
    for field in ("checkpoint_layers", "offload_layers"):
        old["strategy"].pop(field)  # a plan written before the fields existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = LaunchPlan.load(tmp_path / "old.json")
    assert (loaded.strategy.checkpoint_layers, loaded.strategy.offload_layers) == (None, None)
    assert loaded == _plan(checkpointing="offload")

    plan = _plan(checkpointing="offload", checkpoint_layers=20, offload_layers=6)
    path = plan.write(tmp_path / "new.json")
    assert LaunchPlan.load(path) == plan
    data = json.loads(path.read_text())["strategy"]
    assert (data["checkpoint_layers"], data["offload_layers"]) == (20, 6)


def test_check_and_explain_read_a_plan_with_a_split(tmp_path):
    path = _plan(checkpointing="offload", checkpoint_layers=20, offload_layers=6).write(tmp_path / "plan.json")
    runner = CliRunner()
    explained = runner.invoke(app, ["explain", str(path)], env={"COLUMNS": "250"})
    assert explained.exit_code == 0, explained.output
    assert (
        "offload (layers 0-5: input in host memory; layers 6-19: input on the GPU; layers 20-31: not checkpointed)"
        in explained.output
    )
    checked = runner.invoke(app, ["check", str(path), "--json"])
    assert checked.exit_code in (0, 1), checked.output  # 1: the plan does not fit; either way a verdict, no crash
    assert "Traceback" not in checked.output


@pytest.mark.parametrize("tool", ["accelerate", "trl", "axolotl", "arctic"])
def test_emitters_say_they_drop_the_split(tool, tmp_path):
    from seqpar.emit import emit

    plan = _plan(checkpointing="offload", checkpoint_layers=20, offload_layers=6)
    em = emit(plan, tool, tmp_path / "plan.json")
    assert (em.strategy.checkpoint_layers, em.strategy.offload_layers) == (None, None)  # no tool runs a layer split
    assert any(
        f"{tool} checkpoints every decoder layer or none (no checkpoint_layers); emitted checkpointing "
        f"{em.strategy.checkpointing} on all 32 layers instead of the first 20" in n
        for n in em.notes
    ), em.notes
    offload_note = any("no offload_layers); emitted all of them in host memory instead of 6 of 20" in n for n in em.notes)
    assert offload_note == (em.strategy.checkpointing == "offload"), em.notes


def test_deepspeed_leaves_the_split_to_the_script(tmp_path):
    from seqpar.emit import emit

    plan = _plan(checkpointing="offload", checkpoint_layers=20, offload_layers=6)
    em = emit(plan, "deepspeed", tmp_path / "plan.json")
    assert (em.strategy.checkpoint_layers, em.strategy.offload_layers) == (20, 6)
    assert (
        "your script keeps checkpointing offload (layers 0-5: input in host memory; layers 6-19: input on the GPU; "
        "layers 20-31: not checkpointed) and loss chunked" in em.notes
    ), em.notes
