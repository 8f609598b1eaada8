"""seqpar eval's ranks against plain transformers on one process: held-out loss, perplexity, loss by position and the
needle sweep, for every mode on 2 and 4 gloo ranks, in float32 (the CPU eval dtype) and float64.

Each rank body calls seqpar.runtime.eval.run.run in-process once per case (one spawn per world size). The reference is the
same seeded model run by transformers on the whole sequence in this process: per-token cross-entropy of every window,
summed per window and per position bucket, and for the needle the argmax and log-probability of every answer token. The
3 windows are shared out unevenly over the data-parallel groups, so a token counted twice or dropped would show. Every
degree is compared with the same reference, so the numbers are also the same for every sp degree.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from seqpar.runtime.eval.needle import QUESTION

from seqpar_testing import run_ranks, tolerances, world_ids
from seqpar_testing.hf import char_model
from seqpar_testing.train import learnable_tokens, make_plan

LENGTHS, WINDOWS, BUCKETS = (32, 64), 3, 4  # float64 runs evaluate the last length only (CI time)
NEEDLE_LENGTHS, TEXT_LENGTHS, DEPTHS, SAMPLES = (64, 96), (320,), (0.0, 0.5, 1.0), 1
NEEDLE_MODE = {2: "zigzag_ring_attn", 4: "usp_attn"}  # ring, and Ulysses inside a ring


def cases(w: int) -> list[tuple[str, object]]:
    """Every mode over all W ranks, data_parallel over W groups, and a hybrid sp x dp on 4 ranks."""
    out = [
        ("data_parallel", make_plan(w)),
        ("zigzag_ring_attn", make_plan(w, "zigzag_ring_attn", w)),
        ("dist_flash_attn", make_plan(w, "dist_flash_attn", w)),
        ("ulysses_attn", make_plan(w, "ulysses_attn", w)),
        ("usp_attn", make_plan(w, "usp_attn", w, ulysses=2)),
    ]
    if w == 4:
        out.append(("zigzag_sp2_dp2", make_plan(w, "zigzag_ring_attn", 2)))
    return out


def eval_cases(rank, world, cases, tmp, data, model_dir) -> dict:
    """Rank body: perplexity in float32 and float64 for every case, the needle sweep (token ids and text) on one."""
    import torch.distributed as dist

    from seqpar.runtime.eval.run import parser, run

    out = {}
    for name, plan in cases:
        plan_file = Path(tmp) / f"{name}.json"
        if rank == 0:
            plan.write(plan_file)
        dist.barrier()
        base = ["--plan", str(plan_file), "--output", str(Path(tmp) / name), "--data", data]
        base += ["--windows", str(WINDOWS), "--buckets", str(BUCKETS), "--seq-len"]
        for dtype, lengths in ((torch.float32, LENGTHS), (torch.float64, LENGTHS[-1:])):
            out[(name, "ppl", dtype)] = run(parser().parse_args(base + [",".join(map(str, lengths))]), dtype=dtype)
        if name == NEEDLE_MODE[world]:
            needle = ["--plan", str(plan_file), "--output", str(Path(tmp) / name), "--task", "needle"]
            needle += ["--depths", ",".join(map(str, DEPTHS)), "--samples", str(SAMPLES), "--seq-len"]
            out[(name, "needle")] = run(parser().parse_args(needle + [",".join(map(str, NEEDLE_LENGTHS))]), dtype=torch.float64)
            text = needle + [",".join(map(str, TEXT_LENGTHS)), "--model-path", model_dir]
            out[(name, "needle_text")] = run(parser().parse_args(text), dtype=torch.float64)
        dist.barrier()
    return out


# --------------------------------------------------------------------------------------------- references


def reference_model(dtype, model_path=None):
    from seqpar.runtime.hf.model import build_model

    plan = make_plan(1)
    m = build_model(plan.workload.model, model_path=model_path, seed=plan.training.seed, rope_theta=None, dtype=dtype)
    return m.to(dtype).eval()


@torch.no_grad()
def reference_perplexity(model, data_file: str, L: int) -> dict:
    """Per-token cross-entropy of the first WINDOWS windows by plain transformers, summed per window and per bucket."""
    from seqpar.runtime.data.windows import open_data

    d = open_data(data_file, seq_len=L, vocab_size=model.config.vocab_size)
    edges = [L * b // BUCKETS for b in range(BUCKETS + 1)]
    windows, buckets = [], np.zeros(BUCKETS)
    for k in range(WINDOWS):
        w = torch.from_numpy(d.window(k))[None]  # (1, L+1)
        logits = model(input_ids=w[:, :-1]).logits[0]  # (L, V)
        ce = F.cross_entropy(logits, w[0, 1:], reduction="none").double().numpy()  # (L,)
        windows.append(ce.mean())
        buckets += [ce[edges[b] : edges[b + 1]].sum() for b in range(BUCKETS)]
    loss = float(np.mean(windows))
    return {"loss": loss, "window_losses": windows, "bucket_losses": buckets / (WINDOWS * np.diff(edges))}


@torch.no_grad()
def reference_needle(model, prompts) -> list[dict]:
    """The answer tokens' argmax and summed log-probability, one prompt at a time on the whole sequence."""
    out = []
    for p in prompts:
        logp = torch.log_softmax(model(input_ids=torch.from_numpy(p.ids)[None]).logits[0], -1)  # (L, V)
        rows = torch.arange(p.seq_len - len(p.answer) - 1, p.seq_len - 1)  # the positions that predict the answer
        ans = torch.from_numpy(p.answer)
        out.append({"predicted_ids": logp[rows].argmax(-1).tolist(), "log_likelihood": float(logp[rows, ans].sum())})
    return out


# --------------------------------------------------------------------------------------------- the test


@pytest.mark.parametrize("world", [2, 4], ids=world_ids([2, 4]))
def test_eval_equals_plain_transformers_in_every_mode(tmp_path, world):
    from seqpar.runtime.eval.needle import PREFIX, build_prompts

    data = learnable_tokens(tmp_path / "heldout.npy")
    model_dir = char_model(tmp_path / "char-model")
    cs = cases(world)
    results = run_ranks(eval_cases, world, cs, str(tmp_path), data, model_dir, timeout=280)[0]

    for dtype in (torch.float32, torch.float64):
        tol = tolerances(dtype)
        model = reference_model(dtype)
        refs = {L: reference_perplexity(model, data, L) for L in LENGTHS}
        for name, _ in cs:
            rep = results[(name, "ppl", dtype)]
            assert [r["seq_len"] for r in rep["lengths"]] == list(LENGTHS if dtype == torch.float32 else LENGTHS[-1:])
            for row in rep["lengths"]:
                ref, L, msg = refs[row["seq_len"]], row["seq_len"], f"{name} {dtype} L={row['seq_len']}"
                assert row["windows"] == WINDOWS and row["tokens"] == WINDOWS * L, msg
                torch.testing.assert_close(row["loss"], ref["loss"], **tol, msg=msg)
                torch.testing.assert_close(row["perplexity"], math.exp(ref["loss"]), **tol, msg=msg)
                torch.testing.assert_close(row["window_losses"], [float(x) for x in ref["window_losses"]], **tol, msg=msg)
                got = [b["loss"] for b in row["buckets"]]
                torch.testing.assert_close(got, ref["bucket_losses"].tolist(), **tol, msg=msg)
                # the buckets partition the positions: their sums add back to the total exactly (float64 sums)
                assert [b["start"] for b in row["buckets"]] == [L * b // BUCKETS for b in range(BUCKETS)], msg
                assert sum(b["tokens"] for b in row["buckets"]) == row["tokens"], msg
                assert sum(b["loss_sum"] for b in row["buckets"]) == pytest.approx(row["loss"] * row["tokens"], rel=1e-12)

    # the needle sweep: scores equal a single-process run of the same prompts (float64, so argmaxes cannot tie)
    model = reference_model(torch.float64)
    vocab = model.config.vocab_size
    prompts, _ = build_prompts(list(NEEDLE_LENGTHS), list(DEPTHS), SAMPLES, None, None, vocab)
    text_model = reference_model(torch.float64, model_dir)
    text_prompts, tok = build_prompts(list(TEXT_LENGTHS), list(DEPTHS), SAMPLES, model_dir, None, 128)
    name = NEEDLE_MODE[world]
    for kind, mdl, ps, lengths in (
        ("needle", model, prompts, NEEDLE_LENGTHS),
        ("needle_text", text_model, text_prompts, TEXT_LENGTHS),
    ):
        want = reference_needle(mdl, ps)
        rep = results[(name, kind)]
        cells = [c for row in rep["lengths"] for c in row["cells"]]
        assert len(cells) == len(ps) == len(want), kind
        for c, p, w in zip(cells, ps, want):
            msg = f"{name} {kind} L={p.seq_len} depth={p.depth} sample={p.sample}"
            assert (c["seq_len"], c["depth"], c["sample"]) == (p.seq_len, p.depth, p.sample), msg
            assert c["predicted_ids"] == w["predicted_ids"], msg
            assert c["exact_match"] == (w["predicted_ids"] == p.answer.tolist()), msg
            torch.testing.assert_close(c["log_likelihood"], w["log_likelihood"], **tolerances(torch.float64), msg=msg)
        g = rep["grid"]  # the heatmap's data: rows depths, columns lengths, each the mean over samples
        assert g["lengths"] == list(lengths) and g["depths"] == list(DEPTHS)
        for i, d in enumerate(DEPTHS):
            for j, L in enumerate(lengths):
                mine = [c for c in cells if (c["depth"], c["seq_len"]) == (d, L)]
                assert g["exact_match"][i][j] == sum(c["exact_match"] for c in mine) / len(mine)
                assert g["log_likelihood"][i][j] == pytest.approx(sum(c["log_likelihood"] for c in mine) / len(mine))
    # text prompts: EasyContext's wording, the needle inside the haystack at its depth, the answer last
    for p in text_prompts:
        text = tok.decode(p.ids.tolist())
        needle = f"\nThe special magic number is: {p.number}.\n"
        assert len(p.ids) == p.seq_len and len(p.number) == 7
        assert text.startswith("<s>This is a very long story book: <book>") and text.endswith(f"magic number is: {p.number}")
        assert text.count(needle) == 1 and tok.decode(p.ids[p.needle_at : p.needle_at + len(needle)].tolist()) == needle
        start = 1 + len(PREFIX)  # BOS and the prefix, a token per character
        hay = p.seq_len - start - len(needle) - len(QUESTION) - len(" " + p.number)
        at, want_at = p.needle_at - start, int(hay * p.depth)
        # at the depth, or moved forward to just after the next sentence end (EasyContext's rule)
        assert at == want_at or (at > want_at and tok.decode(p.ids[p.needle_at - 1 : p.needle_at].tolist()) == "."), (at, want_at)
