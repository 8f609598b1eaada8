"""Training on packed documents, against each document run alone: every mode on 2 real gloo ranks, and a real launch
that crashes and resumes.

Reference: one process, plain transformers (no seqpar), the same initial weights (the plan's seed), AdamW, schedule and
clipping; each step reads the same 2 windows (data_pack's seeded order) and runs every document of a window on its
own; the loss of a window is its documents' summed cross-entropy over their scored tokens divided by the count
(token-weighted), a step's loss the mean of its 2 windows' (what 2 data-parallel ranks, or 2 accumulation steps,
average). Every mode reads the 2 windows of a step so (data_parallel: one per rank; the others: sp 2, 2 micro-batches)
and must reach the reference's losses and gradient norms (fp32, relative 1e-4, test_train's tolerance). The corpus
mixes text, chats (the assistant's tokens scored), a 1-token document and one longer than the window (split).
The real launch crashes at step 5 and resumes: its 6 steps must equal the uninterrupted trainer's (relative 1e-6); it is
in the slow set (the default set resumes a crashed launch in tests/runtime/launch/test_launch.py and tokenizes a corpus
once for racing ranks in test_data_packed.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from seqpar.runtime.data.pack import window_index
from seqpar.runtime.data.windows import DataOptions, open_training_data

from seqpar_testing.data import make_tokenizer, write_corpus
from seqpar_testing.train import make_plan, read_metrics

STEPS = 4
MODES = ["data_parallel", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"]


def _plan(mode: str, steps: int = STEPS, **kw):
    if mode == "data_parallel":
        return make_plan(2, steps=steps, **kw)  # dp 2: one window per rank per step
    return make_plan(2, mode, 2, ulysses=2 if mode == "usp_attn" else 1, ga=2, steps=steps, **kw)  # sp 2: 2 micro-batches


def _train(rank: int, world: int, tmp: str, corpus: str, tok: str) -> dict:
    import torch.distributed as dist

    from seqpar.runtime.train.loop import parser, run

    out = {}
    for mode in MODES:
        pf = Path(tmp) / f"{mode}.json"
        if rank == 0:
            _plan(mode).write(pf)
        dist.barrier()
        args = ["--plan", str(pf), "--output", str(Path(tmp) / mode), "--data", corpus, "--tokenizer", tok]
        run(parser().parse_args(args + ["--data-cache", str(Path(tmp) / "cache"), "--no-final-checkpoint"]))
        dist.barrier()
        out[mode] = read_metrics(Path(tmp) / mode) if rank == 0 else None
    return out


def per_document_reference(plan, data, steps: int, whole: bool = False) -> list[dict]:
    """The reference's metrics; ``whole``: each window as ONE sequence instead (attention across its documents: the
    mistake the reference must tell apart)."""
    from seqpar.runtime.hf.model import build_model
    from seqpar.runtime.train import engine, nonfinite

    t = plan.training
    model = build_model(plan.workload.model, model_path=None, seed=t.seed, rope_theta=t.rope_theta, dtype=torch.float32)
    model.train()
    opt, out = engine.make_optimizer(model, plan), []
    sched = engine.make_scheduler(opt, plan, steps)
    for step in range(steps):
        total = 0.0
        for k in (2 * step, 2 * step + 1):
            w = {key: torch.from_numpy(v) for key, v in data.window(window_index(k, data.num_windows, t.seed)).items()}
            starts = torch.cat([torch.nonzero(w["position_ids"] == 0).flatten(), torch.tensor([len(w["input_ids"])])])
            starts = starts[[0, -1]] if whole else starts
            loss_sum, count = 0.0, 0
            for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
                target = w["labels"][a + 1 : b]  # position i predicts label i + 1, inside the document only
                if (target != -100).any():
                    logits = model(input_ids=w["input_ids"][None, a:b]).logits[0, :-1]  # (l - 1, V)
                    loss_sum = loss_sum + F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
                    count += int((target != -100).sum())
            loss = loss_sum / count
            (loss / 2).backward()
            total += float(loss.detach()) / 2
        norm = nonfinite.grad_norm(model, t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        out.append({"step": step + 1, "loss": total, "grad_norm": norm})
    return out


def _close(got: list[dict], want: list[dict], what: str, rtol: float = 1e-4) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want], what
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in got], [m[key] for m in want], rtol=rtol, err_msg=f"{what}: {key}")


def test_every_mode_on_packed_documents_equals_each_document_run_alone(tmp_path):
    from seqpar_testing import run_ranks

    tok = make_tokenizer(tmp_path / "tok")
    corpus = str(write_corpus(tmp_path / "d.jsonl"))
    results = run_ranks(_train, 2, str(tmp_path), corpus, tok, timeout=280)[0]
    plan = _plan("data_parallel")
    data = open_training_data(
        corpus, DataOptions(cache=str(tmp_path / "cache")), seq_len=plan.workload.seq_len, vocab_size=256, tokenizer_path=tok
    )
    assert data.corpus.scored is not None and int(data.corpus.lengths.max()) > plan.workload.seq_len  # chats, a split
    want = per_document_reference(plan, data, STEPS)
    # the comparison tells packing from no boundaries: attending across documents moves the first gradient norm by
    # more than 10 x the tolerance (0.28% here; random weights barely look at context, so the loss moves 0.03%)
    across = per_document_reference(plan, data, 1, whole=True)[0]
    assert abs(across["grad_norm"] / want[0]["grad_norm"] - 1) > 10 * 1e-4, (across, want[0])
    for mode in MODES:
        _close(results[mode], want, mode)


# --------------------------------------------------------------------------------------------- a real launch


def _launch(plan_file: Path, out: Path, corpus: str, tok: str, cache: Path, *extra: str, env=None):
    cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(plan_file), "--output", str(out), "--data", corpus]
    cmd += ["--tokenizer", tok, "--data-cache", str(cache), "--no-final-checkpoint", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, **(env or {})})


def _uninterrupted(rank: int, world: int, plan_file: str, out: str, corpus: str, tok: str, cache: str):
    """The reference: the same plan through the trainer in-process on 2 ranks, uninterrupted (as test_launch's)."""
    from seqpar.runtime.train.loop import parser, run

    args = ["--plan", plan_file, "--output", out, "--data", corpus, "--tokenizer", tok, "--data-cache", cache]
    run(parser().parse_args(args + ["--no-final-checkpoint"]))
    return read_metrics(out) if rank == 0 else None


@pytest.mark.slow
def test_a_launch_that_crashes_resumes_with_the_uninterrupted_losses_and_tokenizes_once(tmp_path):
    """The launcher tokenizes before the ranks start (they read its cache); the resumed launch reads the cache."""
    from seqpar_testing import run_ranks

    tok = make_tokenizer(tmp_path / "tok")  # the plan's tiny model, random weights; text through --tokenizer
    corpus, cache = str(write_corpus(tmp_path / "d.jsonl", seed=1)), tmp_path / "cache"
    plan_file = tmp_path / "plan.json"
    _plan("zigzag_ring_attn", steps=6, checkpoint_every=2).write(plan_file)

    fault = {"SEQPAR_FAULT_RANK": "1", "SEQPAR_FAULT_STEP": "5", "SEQPAR_FAULT_PHASE": "step"}
    crashed = _launch(plan_file, tmp_path / "cut", corpus, tok, cache, env=fault)
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    assert "injected fault on rank 1 at step 5" in crashed.stderr
    # the launcher's line; rank 0's own data line says it read the cache
    assert crashed.stderr.count("tokenized into the cache") == 1 and "read from the cache" in crashed.stderr
    resumed = _launch(plan_file, tmp_path / "cut", corpus, tok, cache, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "tokenized" not in resumed.stderr and "read from the cache" in resumed.stderr
    assert "resuming from" in (tmp_path / "cut" / "train.log").read_text()
    full = run_ranks(_uninterrupted, 2, str(plan_file), str(tmp_path / "full"), corpus, tok, str(cache), timeout=280)[0]
    _close(read_metrics(tmp_path / "cut"), full, "crash at step 5 + resume", rtol=1e-6)
