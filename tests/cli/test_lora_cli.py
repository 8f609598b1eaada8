"""`seqpar advise` / `check` with LoRA: the --lora-* and --qlora flags, their one-line refusals, the answer's line, the
plan's workload, --max-seq-len and the flags' check against the advice."""

from __future__ import annotations

import json

import pytest

from seqpar.advisor.cluster import resolve_cluster
from seqpar.advisor.search import max_seq_len
from seqpar.plan.specs import LORA_ALL_LINEAR, LoraSpec
from seqpar.profiles import get_model

from seqpar_testing.cli import run

H100 = ["-m", "llama-3.1-8b", "--gpu", "h100", "--gpus", "1"]


def refusal(r) -> str:
    """The refusal's one error line (exit 2, no traceback)."""
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    return errors[0]


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--lora-alpha", "16"], "--lora-alpha shapes LoRA adapters, but no --lora-rank turns them on"),
        (["--qlora"], "--qlora shapes LoRA adapters, but no --lora-rank"),
        (["--lora-rank", "8", "--lora-targets", "q_proj,lm_head"], "'lm_head' is not a linear layer of a decoder block"),
        (["--lora-rank", "8", "--lora-targets", "q_proj,q_proj"], "--lora-targets names q_proj twice"),
        (["--lora-rank", "8", "--lora-targets", ","], "names no layer"),
        (["--lora-rank", "5000"], "--lora-rank 5000 is above 4096"),
        (["--lora-rank", "8", "--lora-dropout", "1"], "--lora-dropout 1.0 is not from 0 to below 1"),
        (["--lora-rank", "8", "--lora-alpha", "nan"], "--lora-alpha nan must be a finite number > 0"),
        (["--lora-rank", "8", "--qlora", "--optimizer", "none"], "--optimizer none (forward and backward only) updates nothing"),
    ],
)
def test_bad_lora_flags_are_refused_in_one_line(flags, match):
    for command in ("advise", "check"):
        assert match in refusal(run(command, "-s", "64k", *H100, *flags))


def test_advise_plans_lora_and_says_so():
    r = run("advise", "-s", "64k", *H100, "--lora-rank", "32", "--lora-targets", "all-linear", "--lora-alpha", "64")
    assert r.exit_code == 0, r.output
    assert "LoRA r=32 on all 7 linear layers (bf16 base, alpha 64)" in r.stdout
    j = run("advise", "-s", "64k", *H100, "--lora-rank", "16", "--lora-targets", "v_proj,q_proj", "--qlora", "--json")
    lora = json.loads(j.stdout)["workload"]["lora"]
    assert lora == {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "base_dtype": "nf4"}
    full = json.loads(run("advise", "-s", "64k", *H100, "--json").stdout)
    assert full["workload"]["lora"] is None
    verbose = run("advise", "-s", "64k", *H100, "--lora-rank", "32", "--qlora", "--verbose")
    assert "QLoRA r=32 on all 7 linear layers (4-bit NF4 base, alpha 32)" in verbose.stdout
    assert "83.9M adapter parameters" in verbose.stdout


def test_check_with_lora_flags_predicts_as_advise():
    flags = ["-s", "128k", "-m", "llama-3.1-8b", "--gpu", "h100", "--gpus", "8", "--lora-rank", "32", "--json"]
    plan = json.loads(run("advise", *flags).stdout)
    got = json.loads(run("check", *flags).stdout)
    assert got["prediction"]["peak_memory_gib"] == plan["prediction"]["peak_memory_gib"]
    assert got["strategy"] == plan["strategy"]


def test_max_seq_len_takes_the_lora_flags():
    r = run("advise", "--max-seq-len", *H100, "--host-ram-gib", "125", "--mode", "data_parallel", "--lora-rank", "32", "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["data_parallel"]
    cl, _ = resolve_cluster("h100", 1, None, None, 125)
    n, s = max_seq_len(get_model("llama-3.1-8b"), cl, ["data_parallel"], lora=LoraSpec(rank=32))["data_parallel"]
    assert got["max_seq_len"] == n > 0 and got["strategy"] == s.model_dump()
    full = json.loads(run("advise", "--max-seq-len", *H100, "--host-ram-gib", "125", "--mode", "data_parallel", "--json").stdout)
    assert full["data_parallel"]["max_seq_len"] < n
    assert list(LORA_ALL_LINEAR) == LoraSpec().target_modules  # --lora-targets' default: all-linear
