"""The CLI through typer's CliRunner: exit codes (0 ok, 1 known failure, 2 bad input, 3 internal error), --json is only JSON, every bad input
(one line, exit 2, nothing written), help with examples, and no torch import on the advisor path."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.rules import advise_by_rules
from seqpar.cli import app
from seqpar.plan.base import SCHEMA_VERSION
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.profiles import get_model

from seqpar_testing.cli import run

runner = CliRunner()
A100X8 = ["--gpu", "a100", "--gpus", "8"]


def test_advise_json_matches_rules_exactly():
    r = run("advise", "--seq-len", "512k", *A100X8, "--policy", "rules", "--json")
    assert r.exit_code == 0, r.stderr
    plan = LaunchPlan.model_validate_json(r.stdout)  # stdout is the plan and nothing else
    ref = advise_by_rules(
        AdviseRequest(model=get_model("llama-2-7b"), seq_len=524288, cluster=cluster_from_flags("a100", 8), policy="rules")
    )
    assert plan.strategy == ref.strategy and plan.rationale.rule_path == ref.rationale.rule_path
    assert plan.rationale.cluster_note == "declared: 1 node(s) x 8 a100-80g-sxm"
    assert "seq_len 524288 (512K)" in r.stderr.splitlines()[0]


@pytest.mark.parametrize("cluster", [["--cluster", "cpu:2"], ["--gpu", "a100", "--gpus", "8"]])
def test_the_plan_records_what_seqpar_launch_runs(tmp_path, cluster):
    """One builder (seqpar.plan.jobspec): the plan's command and env are launch's (torchrun on CPU, accelerate for ZeRO on CUDA)."""
    out = tmp_path / "plan.json"
    r = run("advise", "-s", "256" if cluster[1] == "cpu:2" else "128k", "-m", "tiny", *cluster, "--policy", "rules", "-o", out)
    assert r.exit_code == 0, r.stderr
    plan = LaunchPlan.load(out)
    r = run("launch", out, "--dry-run")
    assert r.exit_code == 0, r.stderr
    cmd = [ln for ln in r.stdout.splitlines() if "seqpar.runtime.train" in ln]
    assert plan.launch.command[0] == "python" and cmd == [shlex.join([sys.executable, *plan.launch.command[1:]])]
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("export ")] == [
        f"export {k}={shlex.quote(v)}" for k, v in plan.launch.env.items()
    ]
    assert ("accelerate.commands.launch" in cmd[0]) == (plan.cluster.accelerator == "cuda")


def test_advise_default_cluster_on_this_machine():
    r = run("advise", "--seq-len", "512k", "--json")
    assert r.exit_code == 0, r.stderr
    plan = LaunchPlan.model_validate_json(r.stdout)
    note = plan.rationale.cluster_note
    assert note in r.stderr and note.split(":")[0] in ("default", "probed")
    if note.startswith("default"):  # no GPU here: EasyContext's 8x A100-80G SXM
        assert (plan.cluster.world_size, plan.cluster.gpu.name, plan.cluster.source) == (8, "a100-80g-sxm", "default")


def test_advise_human_output_and_write(tmp_path):
    out = tmp_path / "plan.json"
    r = run("advise", "-s", "256", "-m", "tiny", "--cluster", "cpu:2", "--policy", "rules", "-o", out)
    assert r.exit_code == 0, r.stderr
    assert "data_parallel" in r.stdout and f"wrote {out}" in r.stderr
    plan = LaunchPlan.load(out)
    assert plan.cluster.accelerator == "cpu" and plan.workload.dtype == "fp32" and plan.launch.command[-1] == str(out)
    r = run("explain", out)
    assert r.exit_code == 0 and "data_parallel" in r.stdout and "seq_len < 64K: yes -> data_parallel" in r.stdout
    r = run("explain", out, "--json")
    assert r.exit_code == 0 and LaunchPlan.model_validate_json(r.stdout) == plan


def test_advise_pins_reach_the_plan():
    r = run(
        "advise",
        "-s",
        "128k",
        *A100X8,
        "--policy",
        "rules",
        "--mode",
        "zigzag_ring_attn",
        "--sp-degree",
        "4",
        "--checkpointing",
        "offload",
        "--sharding",
        "fsdp",
        "--loss-impl",
        "chunked",
        "--optimizer",
        "adamw-bf16",
        "--micro-batch",
        "2",
        "--json",
    )
    assert r.exit_code == 0, r.stderr
    p = LaunchPlan.model_validate_json(r.stdout)
    s = p.strategy
    assert (s.mode, s.sp_degree, s.dp_degree, s.checkpointing, s.sharding, s.loss_impl) == (
        "zigzag_ring_attn",
        4,
        2,
        "offload",
        "fsdp",
        "chunked",
    )
    assert (p.workload.optimizer, p.workload.micro_batch_size, p.rationale.policy) == ("adamw-bf16", 2, "pinned")


def test_policy_cost_predicts():
    r = run("advise", "-s", "512k", *A100X8, "--policy", "cost", "--json")
    assert r.exit_code == 0, r.stderr
    p = LaunchPlan.model_validate_json(r.stdout)
    assert p.rationale.policy in ("cost", "pinned") and p.prediction is not None


@pytest.mark.parametrize(
    "args,message",
    [
        (["advise", "-s", "512k", "--gpu", "a101", "--gpus", "8"], "unknown GPU 'a101'; did you mean"),
        (["advise", "-s", "512k", "--model", "lama-2-7b"], "unknown model 'lama-2-7b'; did you mean llama-2-7b"),
        (["advise", "-s", "12x"], "sequence length '12x' is not a number"),
        (["advise", "-s", "0"], "must be positive"),
        (["advise", "--seq-len=-4k"], "is not a number"),
        (
            ["advise", "-s", "128k", "--gpu", "h100", "--gpus", "6", "--policy", "rules"],
            "seq_len 131072 cannot be split over 6 ranks",
        ),
        (["advise", "-s", "128k", "--model", "./missing/config.json"], "model config './missing/config.json' does not exist"),
        (["advise", "-s", "128k", "--cluster", "cpu:zero"], "is not a whole number"),
        (["advise", "-s", "128k", "--cluster", "cpu:2", "--gpu", "h100"], "cannot be combined"),
        (
            ["advise", "-s", "512k", *A100X8, "--mode", "ulysses_attn", "--model", "qwen2.5-0.5b", "--policy", "rules"],
            "pinned --mode ulysses_attn",
        ),
        (["explain", "missing.json"], "plan file 'missing.json' does not exist"),
        (["profiles", "show", "h1000"], "unknown profile 'h1000'; did you mean"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "plan.json"
    r = run(*args, *(["-o", out] if args[0] == "advise" else []))
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert message in lines[-1] and lines[-1].startswith("error: ")
    assert r.stdout == "" and not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args,message",
    [
        (["advise", "-s", "512k", "--gpus", "0"], "--gpus"),
        (["advise", "-s", "512k", "--gpus", "eight"], "--gpus"),
        (["advise", "-s", "512k", "--micro-batch", "-1"], "--micro-batch"),
        (["advise", "-s", "512k", "--mode", "ring"], "--mode"),
        (["advise"], "--seq-len"),
        (["frobnicate"], "No such command"),
    ],
)
def test_usage_errors_exit_2(tmp_path, args, message):
    r = run(*args, "-o", tmp_path / "plan.json") if args[0] == "advise" and len(args) > 1 else run(*args)
    assert r.exit_code == 2 and message in r.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content,message",
    [
        ("{", "is not valid JSON"),
        (
            lambda d: d.update(schema_version=SCHEMA_VERSION + 1),
            f"schema_version {SCHEMA_VERSION + 1}, newer than this seqpar understands",
        ),
        (lambda d: d["strategy"].update(sp_degree=5), "is invalid"),
    ],
)
def test_explain_refuses_bad_plans(tmp_path, content, message):
    good = run("advise", "-s", "512k", *A100X8, "--policy", "rules", "--json").stdout
    f = tmp_path / "plan.json"
    if callable(content):
        data = json.loads(good)
        content(data)
        content = json.dumps(data)
    f.write_text(content)
    r = run("explain", f)
    assert r.exit_code == 2 and message in r.stderr and r.stdout == ""


def test_malformed_model_config_exits_2(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    r = run("advise", "-s", "128k", "--model", tmp_path, "-o", tmp_path / "plan.json")
    assert r.exit_code == 2 and "lacks num_hidden_layers" in r.stderr and not (tmp_path / "plan.json").exists()


def test_output_under_a_file_exits_2_and_writes_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run("advise", "-s", "512k", *A100X8, "--policy", "rules", "-o", blocker / "plan.json")  # a file where a folder must be
    assert r.exit_code == 2 and "cannot write" in r.stderr and r.stdout == ""
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_internal_error_exits_3_and_says_how_to_see_the_traceback(monkeypatch):
    def broken(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr("seqpar.advisor.gate.check", broken)
    r = run("check", "--seq-len", "64k", "--gpu", "h200", "--gpus", "1")
    assert r.exit_code == 3 and r.stdout == ""
    assert r.stderr.splitlines()[-1] == (
        "internal error: ZeroDivisionError: division by zero (a bug in seqpar; run with SEQPAR_DEBUG=1 to see the traceback)"
    )


def test_schema_profiles_probe_json():
    r = run("schema")
    assert r.exit_code == 0 and json.loads(r.stdout) == LaunchPlan.model_json_schema()
    r = run("profiles", "list", "--json")
    data = json.loads(r.stdout)
    assert (
        r.exit_code == 0
        and {"h200", "a100-80g-sxm"} <= {g["name"] for g in data["gpus"]}
        and "tiny" in {m["name"] for m in data["models"]}
    )
    r = run("profiles", "show", "h100", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["name"] == "h100-sxm"
    r = run("profiles", "show", "llama-3-8b")
    assert r.exit_code == 0 and "500000" in r.stdout
    r = run("probe", "--json")
    assert r.exit_code == 0 and isinstance(json.loads(r.stdout)["probe"]["nvml_available"], bool)
    r = run("probe")
    assert r.exit_code == 0 and "advise would use" in r.stdout


@pytest.mark.parametrize("cmd", [["advise"], ["explain"], ["schema"], ["probe"], ["profiles", "list"], ["profiles", "show"]])
def test_help_has_examples(cmd):
    r = run(*cmd, "--help")
    assert r.exit_code == 0 and "Examples" in r.stdout and "seqpar " + cmd[0] in r.stdout


@pytest.mark.parametrize(
    "cmd,own", [("advise", ["--policy", "--max-seq-len", "--recipe", "--output", "--json"]), ("check", ["--json", "PLAN.json"])]
)
def test_advise_and_check_list_the_shared_options_in_panels(cmd, own):
    """One declaration (seqpar.cli.options.RequestFlags) gives both commands every workload, cluster and pin option."""
    import dataclasses
    import typing

    from seqpar.cli.options import RequestFlags

    r = runner.invoke(app, [cmd, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    options = [typing.get_args(h)[1] for h in typing.get_type_hints(RequestFlags, include_extras=True).values()]
    assert len(options) == len(dataclasses.fields(RequestFlags)) == 34
    # in Annotated, typer.Option's first argument is the flag; a hidden one (a spelling answered with seqpar's) is not shown
    flags = [o.default for o in options if not o.hidden]
    assert len(flags) == 33
    for flag in flags + own:
        assert flag.split("/")[0] in r.stdout, flag
    for panel in ("Workload", "LoRA", "Cluster", "Pins", "Output"):
        assert f"─ {panel}" in r.stdout, panel


def test_advisor_and_cli_never_import_torch():
    code = (
        "import seqpar.advisor.rules, seqpar.advisor.probe, seqpar.cli, sys; "
        "from typer.testing import CliRunner; r = CliRunner().invoke(seqpar.cli.app, ['advise', '--seq-len', '512k', '--json']); "
        "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
