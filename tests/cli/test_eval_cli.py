"""`seqpar eval` through typer's CliRunner: refusals before anything starts (one line, exit 2, nothing written), the
longest evaluable length, and two real torchrun jobs on gloo ranks: perplexity on text held-out data with a local model
folder (numbers equal plain transformers; JSON, table and plot), and the needle sweep with its heatmap (the data drawn:
one cell per (length, depth), the report's scores)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from seqpar.cli import app

from seqpar_testing.cli import one_error_line
from seqpar_testing.hf import char_model
from seqpar_testing.train import make_plan

runner = CliRunner()


@pytest.mark.parametrize(
    "case, match",
    [
        ("split", "seq_len 66 is not divisible by 2*sp_degree = 4, which zigzag_ring_attn needs; nearest valid: 64 or 68"),
        ("empty", "is empty (0 bytes)"),
        ("short", "shorter than one window of seq_len + 1 = 129"),
        ("needle", "the needle prompt needs 26 tokens before any haystack (prefix 0, needle 11, question 8, answer 7)"),
        ("depth", "needle depths [1.5] must be fractions of the haystack in [0, 1]"),
        ("model", "is not a local model folder"),
        ("missing", "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, case, match):
    plan = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2).write(plan)
    out = tmp_path / "out"
    args = ["eval", str(plan), "--output", str(out)]
    if case == "split":
        args += ["--seq-len", "64,66"]
    elif case == "empty":
        (tmp_path / "heldout.bin").write_bytes(b"")
        args += ["--data", str(tmp_path / "heldout.bin")]
    elif case == "short":
        np.save(tmp_path / "heldout.npy", np.arange(100, dtype=np.uint16))  # one window of 65, none of 129
        args += ["--data", str(tmp_path / "heldout.npy"), "--seq-len", "64,128"]
    elif case == "needle":
        args = ["eval", "needle", str(plan), "--output", str(out), "--lengths", "16,64"]
    elif case == "depth":
        args = ["eval", "needle", str(plan), "--output", str(out), "--depths", "0,1.5"]
    elif case == "model":
        (tmp_path / "empty-folder").mkdir()
        args += ["--model-path", str(tmp_path / "empty-folder")]
    elif case == "missing":
        args += ["--data", str(tmp_path / "nope.npy")]
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert match in one_error_line(r)
    assert not out.exists()


def test_max_seq_len_is_the_advisors_and_runs_nothing(tmp_path):
    from seqpar.advisor.cost.evaluate import max_eval_seq_len

    plan = make_plan(2, "zigzag_ring_attn", 2)
    plan.write(tmp_path / "plan.json")
    r = runner.invoke(app, ["eval", str(tmp_path / "plan.json"), "--max-seq-len", "--json", "--output", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["max_eval_seq_len"]
    assert got == max_eval_seq_len(plan.workload.model, plan.cluster, plan.strategy, plan.workload.dtype) > 0
    assert got % 1024 == 0 and not (tmp_path / "o").exists()
    r = runner.invoke(app, ["eval", "--help"])
    assert r.exit_code == 0 and "perplexity" in r.stdout and "needle" in r.stdout


def test_eval_job_is_torchrun_of_the_eval_module(tmp_path):
    from seqpar.plan.job_options import EvalJobOptions
    from seqpar.plan.jobspec import eval_job

    job = eval_job(make_plan(2, "zigzag_ring_attn", 2), Path("p.json"), EvalJobOptions(task="needle"), output=tmp_path)
    argv = " ".join(job.argv)
    assert "-m torch.distributed.run --nnodes 1 --nproc-per-node 2 --max-restarts 0 --standalone -m seqpar.runtime.eval" in argv
    assert argv.endswith(f"--task needle --plan p.json --output {tmp_path}") and job.env["SEQPAR_PG_TIMEOUT_S"] == "60"


@torch.no_grad()
def test_perplexity_end_to_end_on_text_data_with_a_model_folder(tmp_path):
    """seqpar eval on 2 gloo ranks (zigzag): .jsonl text tokenized with the folder's tokenizer; the loss of every
    window equals plain transformers on the same windows, and the report, table, prediction and plot are all there."""
    from transformers import AutoModelForCausalLM

    from seqpar.runtime.data.windows import open_data

    model_dir = char_model(tmp_path / "m")
    docs = [{"text": f"Document {i}: the quick brown fox jumps over the lazy dog {i * 7} times."} for i in range(40)]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    plan = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2).write(plan)
    out = tmp_path / "out"
    args = ["eval", str(plan), "--model-path", model_dir, "--data", str(tmp_path / "heldout.jsonl")]
    r = runner.invoke(app, args + ["--seq-len", "64,128", "--windows", "3", "--buckets", "4", "--output", str(out), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)  # stdout is the report and nothing else
    assert report == json.loads((out / "eval.json").read_text())
    assert (out / "loss_by_position.png").stat().st_size > 0 and "predicted (seqpar's cost model" in r.stderr
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for row in report["lengths"]:
        d = open_data(str(tmp_path / "heldout.jsonl"), seq_len=row["seq_len"], vocab_size=128, tokenizer_path=model_dir)
        ce = [
            F.cross_entropy(model(torch.from_numpy(d.window(k))[None, :-1]).logits[0], torch.from_numpy(d.window(k))[1:])
            for k in range(3)
        ]
        torch.testing.assert_close(row["window_losses"], [float(x) for x in ce], rtol=1e-5, atol=1e-5)
        assert row["predicted"]["seq_len"] == row["seq_len"] and row["predicted"]["peak_memory_gib"] > 0
        assert row["measured"]["tokens_per_s"] > 0 and row["measured"]["peak_memory_gib"] > 0
    assert report["max_eval_seq_len"] > 0 and report["strategy"]["mode"] == "zigzag_ring_attn"


def test_needle_end_to_end_and_its_heatmap(tmp_path):
    """seqpar eval needle on 1 rank (token-id prompts, the tiny random model): the report and the heatmap, whose drawn
    matrix has one cell per (depth, length) holding the report's exact-match score."""
    from seqpar.runtime.eval.show import plot_needle_heatmap

    plan = tmp_path / "plan.json"
    make_plan(1).write(plan)
    out = tmp_path / "out"
    r = runner.invoke(app, ["eval", "needle", str(plan), "--lengths", "64,96", "--depths", "0,0.5,1", "--output", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "needle.json").read_text())
    assert (out / "needle_heatmap.png").stat().st_size > 0 and "Needle, exact match" in r.stdout
    g = report["grid"]
    assert g["lengths"] == [64, 96] and g["depths"] == [0.0, 0.5, 1.0]
    drawn = plot_needle_heatmap(report, tmp_path / "again.png")
    assert drawn.shape == (3, 2)
    np.testing.assert_array_equal(drawn, np.asarray(g["exact_match"]))
    for j, row in enumerate(report["lengths"]):
        for c in row["cells"]:
            i = g["depths"].index(c["depth"])
            assert drawn[i, j] == float(c["exact_match"]) and len(c["predicted_ids"]) == len(c["answer_ids"]) == 7
