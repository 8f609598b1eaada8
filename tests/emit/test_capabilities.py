"""The emitters' capability table (seqpar.emit.capabilities): every row complete for today's vocabularies, every mode's
export rows naming modes its tools run, and whatever a row lacks reported as unsupported (one line), never a KeyError or
a config written for something the tool does not run."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest
from typer.testing import CliRunner

from seqpar.advisor.cluster import cpu_cluster
from seqpar.emit.capabilities import TABLE, Unsupported
from seqpar.emit.nearest import expressible
from seqpar.plan import modes
from seqpar.plan.base import Checkpointing, FusedOps, LossImpl, Sharding
from seqpar.plan.specs import Strategy, Workload
from seqpar.profiles import get_model

VALUES = {"checkpointing": get_args(Checkpointing), "loss_impl": get_args(LossImpl), "fused_ops": get_args(FusedOps)}
VALUES["tiled_mlp"] = (False, True)
# a mode no tool runs: registered for a test, with no export row (the advisor needs no runtime module to plan it)
LONE = modes.ModeDescription(
    name="lone_test_mode",
    implementation="seqpar_lone_test",
    runtime="no_such_module",
    layout="contiguous",
    degrees="sequence",
    comm=("all_gather_kv",),
    balance="contiguous",
    summary="a registered mode without export rows",
)


@pytest.mark.parametrize("tool", list(TABLE))
def test_every_row_covers_the_plan_vocabulary(tool):
    caps = TABLE[tool]
    for name, values in VALUES.items():
        assert set(getattr(caps, name)) == set(values), (tool, name)
    for mode in caps.runs:
        assert set(caps.shardings[mode]) == set(get_args(Sharding)), (tool, mode)
        assert caps.modes_for(mode)[0] == mode  # a mode the tool runs, it runs as itself
    for mode in modes.names():
        for m in caps.modes_for(mode):  # the built-in modes' export rows name modes the tool runs
            assert m in caps.runs


def test_export_rows_name_known_tools():
    for mode in modes.names():
        assert set(modes.describe(mode).exports) <= set(TABLE), mode


@pytest.mark.parametrize("tool", list(TABLE))
def test_a_mode_without_an_export_row_is_unsupported(tool, tmp_path):
    from seqpar.cli import app

    with modes.registered(LONE):
        with pytest.raises(Unsupported, match=f"{tool} runs no equivalent of mode lone_test_mode"):
            TABLE[tool].modes_for(LONE.name)
        assert not expressible(TABLE[tool], Strategy.over(LONE.name, 2, 2))
        argv = ["advise", "-s", "1k", "-m", "tiny", "--cluster", "cpu:2", "--mode", LONE.name, "-o", str(tmp_path / "p.json")]
        r = CliRunner().invoke(app, argv + ["--emit", tool])
    assert LONE.name not in modes.names()
    assert r.exit_code == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --emit {tool}: {tool} runs no equivalent of mode lone_test_mode"), last
    assert list(tmp_path.iterdir()) == [tmp_path / "p.json"]  # the plan, whatever the emission's outcome; no tool file


def test_an_option_missing_from_a_row_is_unsupported():
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.emit.space import search
    from seqpar.plan.launch_plan import LaunchPlan, Rationale

    caps = dataclasses.replace(TABLE["accelerate"], checkpointing={"none": "none", "full": "full"})
    s = Strategy.over("zigzag_ring_attn", 2, 2, checkpointing="selective", sharding="fsdp")
    w = Workload(model=get_model("tiny"), seq_len=1024)
    plan = LaunchPlan(workload=w, cluster=cpu_cluster(2), strategy=s, rationale=Rationale(policy="pinned"))
    with pytest.raises(Unsupported, match="accelerate's capability row has no checkpointing selective"):
        search(caps, plan, w, {"checkpointing": "selective"}, load_coefficients())
    assert not expressible(caps, s)
    assert expressible(TABLE["accelerate"], s.model_copy(update={"checkpointing": "full"}))


def test_a_mode_a_tool_does_not_run_is_unsupported_when_writing_its_config():
    from seqpar.emit.axolotl import CAPS

    with pytest.raises(Unsupported, match="axolotl does not run mode ulysses_attn"):
        CAPS.native("ulysses_attn")
