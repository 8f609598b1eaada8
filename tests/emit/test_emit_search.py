"""`seqpar advise --emit TOOL` searches the strategies the tool can express (its modes, degrees, shardings, checkpointing
with the per-layer split where its script has one, loss, kernels) for the fastest that fits; it writes no tool files
only when none fits, naming the binding constraint on its last line; plan.json is written whatever the outcome.

The issue's case: 8x H100, Qwen2.5-7B's shape, 128K tokens. The plan is usp_attn at sp 8 with a per-layer split; DeepSpeed
runs Ulysses only, whose degree cannot be 8 over Qwen2.5-7B's 4 KV heads, and the nearest strategy (the plan's split
kept at sp 4) ran out of memory, so `--emit deepspeed` used to write nothing, not even the plan. The reference for "the
fastest it can express" is a brute force over every strategy the tool's row runs (every degree, sharding, checkpointing
policy, loss and, where the script splits it, every checkpoint_layers), predicted one by one."""

from __future__ import annotations

import json

import pytest

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.search import evaluate
from seqpar.emit.capabilities import TABLE
from seqpar.emit.nearest import expressible
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.modes import splits_sequence
from seqpar.plan.rules import plan_problems
from seqpar.plan.specs import Strategy, Workload
from seqpar.profiles import get_model

from seqpar_testing.cli import run

H100x8 = ["--gpu", "h100", "--gpus", "8"]
ISSUE = ["-s", "128k", "-m", "qwen2.5-7b", *H100x8]
TOOLS = list(TABLE)


def brute_force_best(tool: str, w: Workload, cl) -> float:
    """The most tokens/s of any strategy the tool's row runs that fits (tiled_mlp off: it is never faster; the offload
    split not enumerated, so this is a floor for the search, which also splits offloading)."""
    caps, c, world = TABLE[tool], load_coefficients(), cl.world_size
    best = 0.0
    for mode in caps.runs:
        for sp in [d for d in range(2, world + 1) if world % d == 0] if splits_sequence(mode) else [1]:
            for sh in set(caps.shardings[mode].values()):
                for ck in ("none", "full", "selective", "offload"):
                    splits = [None] + (list(range(w.model.num_layers)) if caps.layer_split and ck != "none" else [])
                    for loss in ("hf", "chunked"):
                        for k in splits:
                            s = Strategy.over(mode, sp, world, checkpointing=ck, sharding=sh, loss_impl=loss, checkpoint_layers=k)
                            if plan_problems(w, cl, s) or not expressible(caps, s):
                                continue
                            x = evaluate(w, cl, s, c)
                            if x.fits:
                                best = max(best, x.tokens_per_s)
    return best


@pytest.fixture(scope="module")
def issue_workload():
    return Workload(model=get_model("qwen2.5-7b"), seq_len=131072), cluster_from_flags("h100", 8)


@pytest.mark.parametrize("tool", TOOLS)
def test_the_issue_case_emits_the_fastest_the_tool_expresses(tool, tmp_path, issue_workload):
    r = run("advise", *ISSUE, "-o", tmp_path / "plan.json", "--emit", tool, "--json")
    assert r.exit_code == 0, r.stderr
    verdict = next(x for x in r.stderr.splitlines() if x.startswith(f"{tool}: "))
    assert verdict.startswith(f"{tool}: fits, predicted peak ")
    got = json.loads(run("check", *_tool_files(tmp_path), "--json").stdout)  # the strategy the files say
    s = Strategy.model_validate(got["strategy"])
    assert expressible(TABLE[tool], s) and got["fits"]
    tokens = float(verdict.rsplit(", ", 1)[1].split(" tokens/s")[0].replace(",", ""))
    assert tokens >= brute_force_best(tool, *issue_workload) - 0.5  # the printed figure is rounded to a token
    assert r.stderr.strip().splitlines()[-1].startswith("run: ")


def test_deepspeed_now_writes_ulysses_at_a_degree_the_heads_split(tmp_path):
    """The issue's plan (usp_attn at sp 8, its checkpointing split by memory) pinned, whatever the cost model prefers."""
    r = run("advise", *ISSUE, "--mode", "usp_attn", "--sp-degree", "8", "-o", tmp_path / "plan.json", "--emit", "deepspeed")
    assert r.exit_code == 0, r.stderr
    plan = LaunchPlan.load(tmp_path / "plan.json")
    assert plan.strategy.checkpoint_layers is not None or plan.strategy.offload_layers is not None
    ds = json.loads((tmp_path / "plan.deepspeed.json").read_text())
    assert ds["sequence_parallel_size"] in (2, 4)  # 4 KV heads: Ulysses over 8 ranks does not split them
    block = ds["seqpar"]  # the script's checkpointing, split by the cost model for this degree
    assert block["checkpointing"] in ("full", "selective", "offload") and block["model"] == "qwen2.5-7b"
    assert "sp_degree 8 cannot split qwen2.5-7b's heads or the sequence in ulysses_attn" in r.stderr
    assert "DeepSpeed's sequence parallelism is Ulysses only (no ring half)" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.deepspeed.json", "plan.json"]


@pytest.mark.parametrize("tool", TOOLS)
def test_pins_the_tool_has_are_kept(tool, tmp_path):
    pins = ["--mode", "data_parallel", "--checkpointing", "full", "--loss-impl", "chunked", "--sharding", "zero3"]
    r = run("advise", "-s", "32k", "-m", "llama-3.2-1b", *H100x8, *pins, "-o", tmp_path / "p.json", "--emit", tool)
    assert r.exit_code == 0, r.stderr
    s = Strategy.model_validate(json.loads(run("check", *_tool_files(tmp_path), "--json").stdout)["strategy"])
    want = {"mode": "data_parallel", "checkpointing": "full", "loss_impl": "chunked"}
    want["sharding"] = TABLE[tool].sharding("data_parallel", "zero3")
    assert {k: getattr(s, k) for k in want} == want


def test_nothing_the_tool_expresses_fits_writes_the_plan_and_names_the_constraint(tmp_path):
    # 2M tokens of Llama-3-8B over 8 H100s fit only with seqpar's TiledMLP, which TRL lacks
    args = ["-s", "2M", "-m", "llama-3-8b", *H100x8, "--mode", "zigzag_ring_attn", "--tiled-mlp", "--checkpointing", "offload"]
    r = run("advise", *args, "--sharding", "fsdp", "-o", tmp_path / "p.json", "--emit", "trl")
    assert r.exit_code == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --emit trl: nothing trl expresses fits: the smallest footprint, zigzag_ring_attn sp=8")
    plan = tmp_path / "p.json"
    assert "GiB margin >" in last and " a process can allocate on h100-sxm; wrote " in last
    assert last.endswith(f"wrote {plan} only, no trl files (seqpar launch {plan} runs the plan)")
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]
    assert LaunchPlan.load(tmp_path / "p.json").strategy.tiled_mlp


def test_a_plan_that_does_not_fit_is_written_with_the_emission(tmp_path):
    r = run("advise", "-s", "4M", "-m", "llama-3-8b", *H100x8, "-o", tmp_path / "p.json", "--emit", "deepspeed")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert any(x.startswith("error: no strategy fits: ") for x in lines)
    assert lines[-1].startswith("error: --emit deepspeed: nothing deepspeed expresses fits: the smallest footprint, ")
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def _tool_files(folder) -> list:
    """The emitted files `seqpar check` takes (the DeepSpeed JSON an accelerate YAML names is read through it)."""
    return sorted(p for p in folder.iterdir() if p.name.count(".") == 2 and not p.name.endswith(".ds_config.json"))


def test_a_tool_s_layer_split_is_sized_for_the_tool_s_runtime():
    """A tool whose script splits checkpointing by layer (DeepSpeed) runs a tiled MLP with the model's norms whole: the
    split the search offers it is sized so (layer_split_variant's runtime), so it fits as the tool runs it and keeps as
    many layers as that allows; sized for seqpar's runtime (its norms tiled) it would keep more than fit."""
    from seqpar.advisor.cluster import cluster_from_flags
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.search import evaluate, layer_split_variant
    from seqpar.plan.specs import Strategy, Workload
    from seqpar.profiles import get_model

    c, cl = load_coefficients(), cluster_from_flags("h100", 8)
    w = Workload(model=get_model("llama-3.1-8b"), seq_len=196608, optimizer="adamw")
    s = Strategy.over("ulysses_attn", 8, 8, checkpointing="full", sharding="zero2", loss_impl="chunked", tiled_mlp=True)
    from seqpar.emit.capabilities import TABLE

    tool = TABLE["deepspeed"].runtime()
    ours, theirs = layer_split_variant(w, cl, s, c), layer_split_variant(w, cl, s, c, runtime=tool)
    assert evaluate(w, cl, theirs, c, **tool).fits and not evaluate(w, cl, ours, c, **tool).fits
    assert theirs.checkpoint_layers > ours.checkpoint_layers  # more layers recomputed: the whole norms' moment
    one_fewer = theirs.model_copy(update={"checkpoint_layers": theirs.checkpoint_layers - 1})
    assert not evaluate(w, cl, one_fewer, c, **tool).fits
