"""Round trip without flags: every file set `seqpar advise --emit TOOL` writes carries what its prediction assumed (the
tool's own keys, and a seqpar: block for the rest), so `seqpar check <the files>` with no flags predicts the same peak
memory and tokens/s (within 0.1%) and assumes nothing. A user's own config (no block) gets one "assumed:" line per
value check filled in. use_cpu makes the ranks CPU ranks, judged as `seqpar advise --cluster cpu:N` judges them.

The references: the emission's own prediction (seqpar.emit.emit, unrounded), and the cost model on the strategy the
files say. The tools' loaders reading past the block: accelerate's and TRL's parsers in test_interop.py (which refuse
unknown keys and never see comments), DeepSpeed's config here (deepspeed 0.19.8 ``runtime/config.py``: DeepSpeedConfig
reads the keys it knows and refuses only the removed ones, so the top-level "seqpar" key passes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seqpar.advisor.cost.predict import predict
from seqpar.emit import emit
from seqpar.emit.capabilities import TABLE
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.specs import Strategy

from seqpar_testing.cli import run

H100x8 = ["--gpu", "h100", "--gpus", "8"]
PINNED = {"mode": "ulysses_attn", "sp_degree": 4, "checkpointing": "selective", "sharding": "zero3", "loss_impl": "chunked"}
PLANS = {  # name: (advise flags, the pins among them)
    "cost": (["-s", "128k", "-m", "qwen2.5-7b", *H100x8], {}),
    "ulysses": (
        [
            "-s",
            "256k",
            "-m",
            "llama-3-8b",
            *H100x8,
            *[x for k, v in PINNED.items() for x in (f"--{k.replace('_', '-')}", str(v))],
        ],
        PINNED,
    ),
    "cpu": (["-s", "1k", "-m", "tiny", "--cluster", "cpu:2"], {}),
}


def files_of(folder: Path) -> list[Path]:
    """The emitted files `seqpar check` takes (an accelerate YAML names its DeepSpeed JSON itself)."""
    return sorted(p for p in folder.iterdir() if p.name.count(".") == 2 and not p.name.endswith(".ds_config.json"))


def emitted(tmp_path: Path, plan_name: str, tool: str):
    """(the emission, the files) for the plan: `seqpar advise -o` (the CLI, with --emit), and the same emission through
    seqpar.emit.emit for its unrounded prediction; the CLI's files are the emission's."""
    args, pins = PLANS[plan_name]
    r = run("advise", *args, "-o", tmp_path / "plan.json", "--emit", tool, "--json")
    assert r.exit_code == 0, r.stderr
    em = emit(LaunchPlan.load(tmp_path / "plan.json"), tool, tmp_path / "plan.json", pins=pins)
    assert {p: p.read_text() for p in em.files} == em.files
    return em, files_of(tmp_path)


def check_json(*args) -> dict:
    r = run("check", *args, "--json")
    assert r.exit_code in (0, 1), r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("tool", list(TABLE))
def test_check_with_no_flags_reproduces_the_emitted_prediction(tool, plan_name, tmp_path):
    em, files = emitted(tmp_path, plan_name, tool)
    got = check_json(*files)
    p = got["prediction"]
    assert p["peak_memory_gib"] == pytest.approx(em.prediction.peak_memory_gib, rel=1e-3)
    assert p["tokens_per_s"] == pytest.approx(em.prediction.tokens_per_s, rel=1e-3)
    assert Strategy.model_validate(got["strategy"]) == em.strategy
    assert got["defaults"] == [] and not got["partial"]  # nothing assumed, nothing given
    assert got["emitted"] == {
        "predicted_peak_memory_gib": em.prediction.peak_memory_gib,
        "predicted_tokens_per_s": round(em.prediction.tokens_per_s, 1),
    }
    if plan_name == "ulysses":  # every pin kept as the tool's nearest value (axolotl: ring attention; arctic: full)
        caps = TABLE[tool]
        mode = caps.modes_for(PINNED["mode"])[0]
        want = {"mode": mode, "sp_degree": 4, "sharding": caps.sharding(mode, PINNED["sharding"])}
        want |= {k: caps.option(k, PINNED[k]) for k in ("checkpointing", "loss_impl")}
        assert {k: got["strategy"][k] for k in PINNED} == want


@pytest.mark.parametrize("tool", ["accelerate", "deepspeed"])
def test_the_block_holds_only_what_the_tools_keys_do_not_say(tool, tmp_path):
    em, files = emitted(tmp_path, "cost", tool)
    text = files[0].read_text()
    block = json.loads(text)["seqpar"] if tool == "deepspeed" else _yaml_block(text)
    assert block["gpu"] == "h100-sxm" and block["model"] == "qwen2.5-7b" and block["seq_len"] == 131072
    said_by_the_tool = {"sp_degree", "sharding", "mode"}  # ParallelismConfig / sequence_parallel_size, ZeRO stage
    assert not said_by_the_tool & set(block)
    if tool == "deepspeed":
        assert block["checkpoint_layers"] == em.strategy.checkpoint_layers  # the script's split, picked by memory


def test_deepspeed_reads_a_json_with_the_seqpar_key(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    em, files = emitted(tmp_path, "cost", "deepspeed")
    data = json.loads(files[0].read_text())
    assert "seqpar" in data
    cfg = DeepSpeedConfig(data)  # no process group: it takes a world of one, as its own unit tests do
    assert cfg.zero_optimization_stage == data["zero_optimization"]["stage"]


def test_a_users_own_config_lists_each_assumption(tmp_path):
    emitted(tmp_path, "cost", "accelerate")
    own = tmp_path / "own.yaml"  # the same keys without the block: a config the user wrote
    own.write_text("".join(x for x in (tmp_path / "plan.accelerate.yaml").read_text().splitlines(True) if x[0] != "#"))
    got = check_json(own, "--seq-len", "128k")
    names = [x.split(" ")[1] for x in got["defaults"]]
    assert names == ["model", "seq_len", "checkpointing", "loss_impl", "fused_ops", "tiled_mlp", "GPU", "host"]
    assert got["defaults"][1] == "given: seq_len 131072 (--seq-len)"
    gpu = next(x for x in got["defaults"] if x.startswith("assumed: GPU "))
    assert "(no seqpar: block and no --gpu; " in gpu
    assert got["defaults"][2] == "assumed: checkpointing none (a plain transformers script's default; no seqpar: block)"
    r = run("check", own, "--seq-len", "128k")  # the text: one line per assumption
    text = r.stdout + r.stderr
    # the allocator line is said of every CUDA job, whatever its files hold: not one of the file's values
    allocator = "assumed: the job runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    lines = [x for x in text.splitlines() if x.startswith(("assumed: ", "given: ")) and not x.startswith(allocator)]
    assert lines == got["defaults"]
    assert any(x.startswith(allocator) for x in text.splitlines())


def test_a_flag_replaces_the_blocks_value_and_says_so(tmp_path):
    emitted(tmp_path, "cost", "accelerate")
    got = check_json(tmp_path / "plan.accelerate.yaml", "--gpu", "a100", "--checkpointing", "full")
    assert got["cluster"]["gpu"] == "a100-80g-sxm" and got["strategy"]["checkpointing"] == "full"
    assert "given: checkpointing full (--checkpointing; the seqpar: block says selective)" in got["defaults"]


@pytest.mark.parametrize(
    "line,message",
    [
        ("#   seq_len: -5", "seqpar: block seq_len: Input should be greater than or equal to 1; fix or delete the key"),
        ("#   gpu: 7", "seqpar: block gpu: Input should be a valid string; fix or delete the key"),
        ("#   colour: 3", "seqpar: block colour: not a value seqpar assumes; fix or delete the key"),
        ("#   seq_len: [", "its seqpar: block is not YAML"),
    ],
)
def test_a_bad_block_exits_2_naming_the_key(tmp_path, line, message):
    emitted(tmp_path, "cost", "accelerate")
    p = tmp_path / "plan.accelerate.yaml"
    lines = p.read_text().splitlines()  # the line in place of the block's line of its key, else first in the block
    key = line.split(":")[0]
    at = next((i for i, x in enumerate(lines) if x.startswith(key + ":")), None)
    at, drop = (at, 1) if at is not None else (next(i for i, x in enumerate(lines) if x.startswith("# seqpar:")) + 1, 0)
    p.write_text("\n".join(lines[:at] + [line] + lines[at + drop :]) + "\n")
    r = run("check", p)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


# --------------------------------------------------------------------------------------------- CPU ranks


def test_use_cpu_is_judged_as_cpu_ranks_without_the_block(tmp_path):
    """The issue's `seqpar check plan.sft.yaml plan.accelerate.yaml` with use_cpu: true judged 2 A100s; the files as a
    user would have them (no block) are 2 gloo CPU ranks, predicted as advise --cluster cpu:2 predicts that strategy."""
    em, files = emitted(tmp_path, "cpu", "trl")
    for f in files:  # the block out: what the tool's keys say is enough here
        f.write_text("".join(x for x in f.read_text().splitlines(True) if x[0] != "#"))
    got = check_json(*files)
    assert (got["cluster"]["accelerator"], got["cluster"]["gpu"], got["cluster"]["gpus_per_node"]) == ("cpu", "cpu", 2)
    plan = LaunchPlan.load(tmp_path / "plan.json")
    s = Strategy.model_validate(got["strategy"])
    assert s == em.strategy
    want = predict(plan.workload, plan.cluster, s)  # the plan's CPU cluster: this machine's RAM
    assert got["prediction"]["tokens_per_s"] == pytest.approx(want.tokens_per_s, rel=1e-3)
    assert got["prediction"]["tokens_per_s"] == pytest.approx(em.prediction.tokens_per_s, rel=1e-3)
    # the CPU plan shards with FSDP, which accelerate runs on GPUs only (seqpar.emit.capabilities, run by test_tool_runs)
    assert got["cannot_run"] and "accelerate runs FSDP on GPUs only" in got["cannot_run"][0]


@pytest.mark.parametrize("key", ["use_cpu: true", "distributed_type: MULTI_CPU"])
def test_an_accelerate_config_on_cpu_is_cpu_ranks(tmp_path, key):
    cfg = tmp_path / "acc.yaml"
    cfg.write_text(f"compute_environment: LOCAL_MACHINE\n{key}\nnum_processes: 2\nmixed_precision: 'no'\n")
    got = check_json(cfg, "--seq-len", "1k", "-m", "tiny")
    assert (got["cluster"]["accelerator"], got["cluster"]["gpus_per_node"]) == ("cpu", 2)
    assert got["workload"]["dtype"] == "fp32"
    r = run("check", cfg, "--seq-len", "1k", "-m", "tiny", "--gpu", "h100")
    assert (
        r.exit_code == 2 and "acc.yaml runs on CPU ranks (use_cpu true or distributed_type MULTI_CPU), but --gpu h100" in r.stderr
    )


def _yaml_block(text: str) -> dict:
    from seqpar.emit.assumed import block_of_yaml

    return block_of_yaml(text)


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_the_command_sets_the_allocator_the_prediction_assumes(plan_name, tmp_path):
    """The OOM gate counts what a job needs with the caching allocator's expandable segments (it hands its cache back
    before it fails): the emitted command sets them on GPUs, as seqpar launch does; CPU ranks have no such allocator."""
    from seqpar.emit import ALLOC_ENV

    em, _ = emitted(tmp_path, plan_name, "trl")
    on_gpu = LaunchPlan.load(tmp_path / "plan.json").cluster.accelerator == "cuda"
    assert em.command.startswith(f"{ALLOC_ENV} ") is on_gpu
