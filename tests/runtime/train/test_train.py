"""The trainer against a reference: every mode, 2 and 4 gloo ranks (on 4, the layouts 2 ranks cannot have; the other modes
in the slow set), 20 steps, equal to the data_parallel run.

The reference is data_parallel over the same W ranks (dp = W, one window per rank per step); each sequence-parallel run
uses sp = W and a micro-batch of W windows (or W accumulation steps), so it reads the same W windows per step (data.py's
window order) and must reach the same losses and gradient norms (fp32; step i within i x 2e-5 relative: compare_runs).
The gradient norm is compared too because AdamW is blind to a constant gradient scale: a wrong sum-vs-mean over the
sequence-parallel group shows only there.
Hybrid runs (sp x dp), FSDP2, the chunked loss and gradient checkpointing are covered in the same spawns (DeepSpeed's
zero* engines: test_deepspeed.py). The plans, the rank body and the comparison live in seqpar_testing.train.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from seqpar_testing import run_ranks
from seqpar_testing.train import compare_runs, learnable_tokens, make_plan, train_cases

# --------------------------------------------------------------------------------------------- the mode matrix

MODES = ["zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"]


def two_rank_cases() -> list:
    """Every mode on 2 ranks against data_parallel ("ref"), then FSDP2, the chunked loss and each checkpointing."""
    w = 2
    cases = [("ref", make_plan(w))]
    cases += [(m, make_plan(w, m, w, ulysses=2 if m == "usp_attn" else 1, mbs=w)) for m in MODES]
    cases += [
        ("fsdp_zigzag", make_plan(w, "zigzag_ring_attn", w, mbs=w, sharding="fsdp")),
        ("chunked_ckpt", make_plan(w, "zigzag_ring_attn", w, ga=w, loss_impl="chunked", checkpointing="full")),
        ("offload_ckpt", make_plan(w, "ulysses_attn", w, mbs=w, checkpointing="offload")),  # layer inputs in host RAM
        ("selective_ckpt", make_plan(w, "usp_attn", w, ulysses=2, ga=w, checkpointing="selective")),  # kept attention out
    ]
    return cases


# The default set tiles the case that meets the most features (dist_flash_attn, offloaded checkpoints, FSDP2); the other
# checkpointings are the slow set (tiling is exact under each of them in float64: tests/runtime/memory/test_tiled_mlp.py).
TILED_SAMPLE = ["tiled_dist_flash_offload_fsdp"]


def tiled_cases(part: str = "sample") -> list:
    """tiled_mlp on 2 ranks: 128 local tokens of a 64-wide model make 2 tiles per MLP call (ALST's ceil(t/h) rule);
    ``part``: the default set's sample, or the rest."""
    w, seq = 2, 256
    cases = [
        ("tiled_dp", make_plan(w, seq_len=seq, tiled_mlp=True)),
        (
            "tiled_zigzag_selective",
            make_plan(w, "zigzag_ring_attn", w, mbs=w, seq_len=seq, checkpointing="selective", tiled_mlp=True),
        ),
        (
            "tiled_dist_flash_offload_fsdp",
            make_plan(w, "dist_flash_attn", w, ga=w, seq_len=seq, checkpointing="offload", sharding="fsdp", tiled_mlp=True),
        ),
        (
            "tiled_ulysses_full_chunked",
            make_plan(w, "ulysses_attn", w, mbs=w, seq_len=seq, checkpointing="full", loss_impl="chunked", tiled_mlp=True),
        ),
    ]
    return [("ref", make_plan(w, seq_len=seq))] + [(n, p) for n, p in cases if (n in TILED_SAMPLE) == (part == "sample")]


def _two_rank_runs(rank, world, tmp, data):
    """Both 2-rank matrices in one spawn (a rank's start costs seconds of imports), each in a folder of its own."""
    return tuple(train_cases(rank, world, cases(), str(Path(tmp) / name), data) for name, cases in _TWO_RANKS.items())


_TWO_RANKS = {"modes": two_rank_cases, "tiled": tiled_cases}

# The module's 2-rank spawn (both tests' runs) sets up in whichever of the two runs first: each has both budgets.
TWO_RANKS_TIMEOUT = 300 + 300


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("train-W2")
    for name in _TWO_RANKS:
        (tmp / name).mkdir()
    data = learnable_tokens(tmp / "tokens.npy")
    return {**dict(zip(_TWO_RANKS, run_ranks(_two_rank_runs, 2, str(tmp), data, timeout=170 + 170)[0])), "folder": tmp}


@pytest.mark.timeout(TWO_RANKS_TIMEOUT)
def test_every_mode_matches_data_parallel_on_2_ranks(two_ranks):
    assert sorted(two_ranks["modes"]) == sorted(name for name, _ in two_rank_cases())
    compare_runs(two_ranks["modes"])


# On 4 ranks the default set runs the layouts 2 ranks cannot have (usp ulysses 2 x ring 2, zigzag sp 2 x dp 2); the other
# modes at sp 4 (the same code as at sp 2, with more ranks in the ring or the all-to-all) are the slow set.
FOUR_RANKS = ["usp_attn", "hybrid"]


@pytest.mark.parametrize("part", ["sample", pytest.param("rest", marks=pytest.mark.slow)])
def test_every_mode_matches_data_parallel_on_4_ranks(tmp_path, part):
    w = 4
    cases = [(m, make_plan(w, m, w, ulysses=2 if m == "usp_attn" else 1, mbs=w)) for m in MODES]
    cases.append(("hybrid", make_plan(w, "zigzag_ring_attn", 2, ga=2)))  # sp 2 x dp 2: sum over sp, mean over dp
    cases = [("ref", make_plan(w))] + [(n, p) for n, p in cases if (n in FOUR_RANKS) == (part == "sample")]
    data = learnable_tokens(tmp_path / "tokens.npy")
    results = run_ranks(train_cases, w, cases, str(tmp_path), data, timeout=170)[0]
    compare_runs(results)


@pytest.mark.timeout(TWO_RANKS_TIMEOUT)
@pytest.mark.parametrize("part", ["sample", pytest.param("rest", marks=pytest.mark.slow)])
def test_tiled_mlp_matches_data_parallel_in_every_checkpointing(request, tmp_path, part):
    """tiled_mlp on 2 ranks (tiled_cases), in every checkpointing, against data_parallel without tiling."""
    if part == "sample":
        runs = request.getfixturevalue("two_ranks")
        results, folder = runs["tiled"], runs["folder"] / "tiled"  # in the module's 2-rank spawn
    else:
        data = learnable_tokens(tmp_path / "tokens.npy")
        results, folder = run_ranks(train_cases, 2, tiled_cases(part), str(tmp_path), data, timeout=340)[0], tmp_path
    assert sorted(results) == sorted(name for name, _ in tiled_cases(part))
    compare_runs(results)
    # the model's own RMSNorms ran in tiles with the MLP (seqpar.runtime.memory.tiled_mlp.tile_norms), and the run
    # reports say so, which is how the memory model prices them (seqpar.advisor.cost.measurements)
    for name, _ in tiled_cases(part):
        log = (folder / name / "train.log").read_text()
        assert "5 RMSNorms tiled alike" in log and name != "ref" or "tiled MLP: off" in log, name
        report = json.loads((folder / name / "run_report.json").read_text())
        assert report["norms_tiled"] is (name != "ref"), name


# --------------------------------------------------------------------------------------------- data


def test_token_files_pack_into_windows(tmp_path):
    from seqpar.runtime.data.windows import open_data

    tokens = np.arange(100, dtype=np.uint16) % 50
    tokens.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens.astype(np.uint32))
    for name in ("t.bin", "t.npy"):
        d = open_data(str(tmp_path / name), seq_len=9, vocab_size=50)
        assert d.num_windows == 10
        b = d.batch(1, 0, 1, grad_accum=1, dp_degree=2, micro_batch=2)  # windows 6 and 7
        np.testing.assert_array_equal(b.numpy(), np.stack([tokens[60:70], tokens[70:80]]).astype(np.int64))
    syn = open_data("synthetic", seq_len=9, vocab_size=50, seed=1)
    np.testing.assert_array_equal(syn.window(5), open_data("synthetic", seq_len=9, vocab_size=50, seed=1).window(5))
    assert not np.array_equal(syn.window(5), syn.window(6))


@pytest.mark.parametrize(
    "kind, match",
    [
        ("missing", "does not exist"),
        ("short", "shorter than one window of seq_len \\+ 1 = 65"),
        ("vocab", "outside the model's vocabulary of 256"),
        ("text", "needs a tokenizer"),
        ("datasets", "needs the datasets package|save_to_disk"),
        ("suffix", "unknown type"),
    ],
)
def test_bad_data_is_one_clear_error(tmp_path, kind, match):
    from seqpar.plan.errors import SeqparError
    from seqpar.runtime.data.windows import open_data

    p = tmp_path / "d"
    if kind == "short":
        p = tmp_path / "d.npy"
        np.save(p, np.arange(10, dtype=np.uint16))
    elif kind == "vocab":
        p = tmp_path / "d.npy"
        np.save(p, np.full(200, 999, dtype=np.uint16))
    elif kind == "text":
        p = tmp_path / "d.jsonl"
        p.write_text('{"text": "hello"}\n')
    elif kind == "datasets":
        p.mkdir()
        (p / "dataset_info.json").write_text("{}")
        (p / "state.json").write_text("{}")
    elif kind == "suffix":
        p = tmp_path / "d.csv"
        p.write_text("1,2,3")
    with pytest.raises(SeqparError, match=match):
        d = open_data(str(p), seq_len=64, vocab_size=256)
        d.window(0)


def test_jsonl_text_is_tokenized_with_a_local_tokenizer_and_packed(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from seqpar.runtime.data.windows import open_data

    vocab = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "d.jsonl").write_text('{"text": "a b c"}\n\n{"text": "c c"}\n{"text": "b x"}\n')
    d = open_data(str(tmp_path / "d.jsonl"), seq_len=3, vocab_size=5, tokenizer_path=str(tmp_path / "tok"))
    # Documents end with EOS and are packed back to back: a b c <eos> | c c <eos> b | (x <eos> dropped: not a full window)
    assert d.num_windows == 2
    np.testing.assert_array_equal(d.window(0), [1, 2, 3, 0])
    np.testing.assert_array_equal(d.window(1), [3, 3, 0, 2])
