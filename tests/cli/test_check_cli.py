"""CLI of the cost model: `seqpar check` exit codes 0/1/2, --json output, advise --max-seq-len, calibrate, explain --plot."""

import json

import pytest
from typer.testing import CliRunner

from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.measurements import load_measurements
from seqpar.cli import app

PIN_64K = [
    "--seq-len",
    "64k",
    "--gpu",
    "h200",
    "--gpus",
    "1",
    "--mode",
    "data_parallel",
    "--checkpointing",
    "full",
    "--sharding",
    "ddp",
    "--optimizer",
    "none",
    "--loss-impl",
    "hf",
]


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def run(runner, args):
    return runner.invoke(app, args, catch_exceptions=False)


def test_check_flags_exit_codes(runner):
    ok = run(runner, ["check", *PIN_64K, "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert data["fits"] and data["prediction"]["peak_memory_gib"] > 50 and data["strategy"]["mode"] == "data_parallel"
    big = [a if a != "64k" else "256k" for a in PIN_64K]
    oom = run(runner, ["check", *big, "--json"])
    assert oom.exit_code == 1
    d = json.loads(oom.stdout)
    assert not d["fits"] and d["fix"] and d["prediction"]["reserved_memory_gib"] > d["prediction"]["capacity_gib"]
    text = run(runner, ["check", *big])
    assert text.exit_code == 1 and "cheapest fix" in text.stderr and "biggest terms" in text.stderr
    bad = run(runner, ["check", "--seq-len", "100001", "--gpu", "h200", "--gpus", "8", "--mode", "zigzag_ring_attn"])
    assert bad.exit_code == 2 and "nearest valid" in bad.stderr


def test_check_plan_file_and_other_cluster(runner, tmp_path):
    plan = tmp_path / "plan.json"
    r = run(runner, ["advise", "--seq-len", "128k", "--gpu", "a100", "--gpus", "8", "-o", str(plan), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["prediction"]["tokens_per_s"] > 0
    assert run(runner, ["check", str(plan)]).exit_code == 0
    smaller = run(runner, ["check", str(plan), "--gpu", "a100-40g", "--json"])  # same plan on 40 GB boards
    assert smaller.exit_code in (0, 1) and json.loads(smaller.stdout)["prediction"]["capacity_gib"] == pytest.approx(
        40.0 - load_coefficients().driver_reserve_gib  # NVML's 40 GiB less the driver's reserve (no measured one)
    )
    (tmp_path / "broken.json").write_text("{not json")
    assert run(runner, ["check", str(tmp_path / "broken.json")]).exit_code == 2


def test_advise_max_seq_len_json(runner):
    r = run(runner, ["advise", "--max-seq-len", "--gpu", "h200", "--gpus", "8", "--sharding", "zero3", "--json"])
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert set(data) == {"data_parallel", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"}
    assert data["zigzag_ring_attn"]["max_seq_len"] > data["data_parallel"]["max_seq_len"] > 0
    assert run(runner, ["advise", "--gpu", "h200"]).exit_code == 2  # neither --seq-len nor --max-seq-len


def test_calibrate_command(runner, tmp_path):
    plan = tmp_path / "plan.json"
    assert run(runner, ["advise", "--seq-len", "128k", "--gpu", "h200", "--gpus", "8", "-o", str(plan)]).exit_code == 0
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"plan": json.loads(plan.read_text()), "tokens_per_s": 25000.0, "peak_memory_gib": 60.0}))
    out = tmp_path / "coef.json"
    r = run(runner, ["calibrate", str(report), "-o", str(out), "--json"])
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    written = json.loads(out.read_text())
    assert len(data["rows"]) == len(load_measurements()) + 1 and written["values"] == pytest.approx(data["coefficients"])
    assert set(written["time_factors"]) == set(data["time_factors"]) >= {"h200"}
    for gpu, f in data["time_factors"].items():
        assert written["time_factors"][gpu] == pytest.approx(f, rel=1e-5)
    assert run(runner, ["calibrate", str(tmp_path / "nope.json")]).exit_code == 2


def test_explain_tables_and_plot(runner, tmp_path):
    plan = tmp_path / "plan.json"
    assert run(runner, ["advise", "--seq-len", "512k", "-o", str(plan)]).exit_code == 0
    r = run(runner, ["explain", str(plan), "--plot", str(tmp_path / "mem.png")])
    assert r.exit_code == 0
    assert "peak phase" in r.stdout and "Alternatives, the best of each kind" in r.stdout and "Step time" in r.stdout
    assert (tmp_path / "mem.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_never_proposes_deepspeed_for_an_optimizer_it_cannot_run():
    """zero* runs DeepSpeed's AdamW with an fp32 master; plans refuse it with optimizer none / adamw-bf16 on CUDA."""
    from seqpar.advisor.cluster import cluster_from_flags
    from seqpar.advisor.gate import check, variants
    from seqpar.advisor.request import AdviseRequest
    from seqpar.plan.specs import Strategy
    from seqpar.profiles import get_model

    for optimizer, allowed in (("none", False), ("adamw-bf16", False), ("adamw", True)):
        req = AdviseRequest(
            seq_len=262144,
            model=get_model("llama-2-7b"),
            cluster=cluster_from_flags("h200", 1),
            mode="data_parallel",
            checkpointing="full",
            sharding="ddp",
            optimizer=optimizer,
            loss_impl="hf",
        )
        res = check(req)
        pinned = Strategy(mode="data_parallel", checkpointing="full", sharding="ddp", loss_impl="hf")
        labels = [label for label, _ in variants(pinned, req)]
        assert any(lab.startswith("sharding zero") for lab in labels) == allowed, (optimizer, labels)
        if not allowed and res.fix_strategy is not None:
            assert not res.fix_strategy.sharding.startswith("zero"), res.fix
