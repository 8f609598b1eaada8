"""`seqpar eval --tokenizer` and `--score`: the flags reach the checks that run before any rank starts and the ranks'
command line; end to end (torchrun on 2 gloo ranks, slow), a folder of weights alone with --tokenizer evaluates chat
data on the assistant's tokens, as the export test's in-process ranks do (tests/runtime/checkpoint/test_export_tokenizer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seqpar.cli import app

from seqpar_testing.chat import VOCAB, byte_tokenizer, write_chats
from seqpar_testing.cli import one_error_line
from seqpar_testing.train import make_plan

runner = CliRunner()


def _plan(tmp: Path) -> Path:
    from seqpar.plan.launch_plan import LaunchPlan

    data = json.loads(make_plan(2, "zigzag_ring_attn", 2).model_dump_json())
    data["workload"]["model"]["vocab_size"] = VOCAB
    LaunchPlan.model_validate(data).write(tmp / "plan.json")
    return tmp / "plan.json"


def test_tokenizer_flag_is_read_before_any_rank_starts(tmp_path):
    """A --tokenizer that is no folder is one line naming it, exit 2, nothing written (the data is tokenized with it)."""
    plan, out = _plan(tmp_path), tmp_path / "out"
    chats = write_chats(tmp_path / "heldout.jsonl", 4)
    r = runner.invoke(app, ["eval", str(plan), "--data", str(chats), "--tokenizer", str(tmp_path / "nope"), "--output", str(out)])
    assert r.exit_code == 2, r.output
    assert f"tokenizer {str(tmp_path / 'nope')!r} is not a folder (no such path)" in one_error_line(r)
    assert not out.exists()
    r = runner.invoke(app, ["eval", str(plan), "--score", "some", "--output", str(out)])
    assert r.exit_code == 2 and "some" in r.output


def test_the_ranks_get_tokenizer_and_score():
    from seqpar.plan.job_options import EvalJobOptions
    from seqpar.plan.jobspec import eval_job

    opts = EvalJobOptions(tokenizer="tok", score="all")
    argv = " ".join(eval_job(make_plan(2, "zigzag_ring_attn", 2), Path("p.json"), opts, output=Path("o")).argv)
    assert "--tokenizer tok" in argv and "--score all" in argv
    assert "--score" not in " ".join(eval_job(make_plan(1), Path("p.json"), EvalJobOptions(), output=Path("o")).argv)


@pytest.mark.slow
def test_eval_with_a_separate_tokenizer_end_to_end(tmp_path):
    """torchrun, 2 ranks, zigzag: weights alone + --tokenizer on held-out chats; the assistant's tokens only by default,
    every token with --score all (the window losses themselves are checked in-process by the export test)."""
    from seqpar.plan.launch_plan import LaunchPlan
    from seqpar.runtime.hf.model import build_model

    plan = _plan(tmp_path)
    build_model(LaunchPlan.load(plan).workload.model, model_path=None, seed=0, rope_theta=None).save_pretrained(tmp_path / "w")
    byte_tokenizer(tmp_path / "tok")
    chats = write_chats(tmp_path / "heldout.jsonl", 8, 5)
    got = {}
    for which in ("trained", "all"):
        out = tmp_path / which
        args = ["eval", str(plan), "--model-path", str(tmp_path / "w"), "--tokenizer", str(tmp_path / "tok")]
        args += ["--data", str(chats), "--seq-len", "64", "--windows", "3", "--score", which, "--output", str(out), "--json"]
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        got[which] = json.loads(r.stdout)["lengths"][0]
        assert got[which]["scored"] == which
    assert 0 < got["trained"]["tokens"] < got["all"]["tokens"] == 3 * 64
