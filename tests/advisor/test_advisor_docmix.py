"""Packed documents in the cost model (seqpar.plan.flops, seqpar.advisor.cost.packed, doc_lens) and in the plan (schema.DocMix).

References: a seeded simulation of the data path's packing (documents concatenated and cut into windows) for the
expected sum of squares; the runtime's own block plans (seqpar.runtime.parallel.blocks: which ring / dist flash transfers a
window still needs) for the transfer share; the H200 measurements in bench/results for the kernel rates and the
busiest-rank imbalance; and the dense model, which every packed prediction must reduce to as documents grow.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from seqpar.advisor.cluster import resolve_cluster
from seqpar.advisor.cost import packed
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.predict import predict
from seqpar.advisor.cost.throughput import call_efficiency, estimate_time
from seqpar.advisor.doc_lens import lognormal_mix, mix_from_counts
from seqpar.plan.flops import attention_fwd_flops, model_flops_per_sequence, square_fraction
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.specs import DocMix, Strategy, Workload
from seqpar.profiles import get_model

ROOT = Path(__file__).resolve().parents[2]
MODES = [("data_parallel", 1, None), ("zigzag_ring_attn", 8, None), ("dist_flash_attn", 8, None)]
MODES += [("ulysses_attn", 8, None), ("usp_attn", 8, 2)]
MIXED = mix_from_counts([(300, 5), (3000, 3), (20000, 1)], "test mix")  # one length longer than the 8K-16K windows below


@pytest.fixture(scope="module")
def h200x8():
    return resolve_cluster("h200", 8, 1, None, None)[0]


def stream_windows(mix: DocMix, S: int, n: int, seed: int = 0) -> list[list[int]]:
    """Document pieces of n windows: documents drawn from the mix, concatenated, cut every S tokens (seqpar.runtime.data.windows)."""
    rng = random.Random(seed)
    lengths, shares = [l for l, _ in mix.histogram], [p for _, p in mix.histogram]
    out, cur, room = [], [], S
    while len(out) < n:
        left = max(1, round(rng.choices(lengths, shares)[0]))
        while left:
            take = min(left, room)
            cur.append(take)
            left, room = left - take, room - take
            if room == 0:
                out.append(cur)
                cur, room = [], S
    return out


# --------------------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("mix", [MIXED, lognormal_mix(mean=2048)], ids=["three-lengths", "long-tail"])
def test_square_fraction_is_the_expectation_over_packed_windows(mix):
    S = 8192
    windows = stream_windows(mix, S, 4000)
    simulated = sum(sum(l * l for l in w) for w in windows) / len(windows) / S**2
    assert square_fraction(mix.histogram, S) == pytest.approx(simulated, rel=0.04)


@pytest.mark.parametrize("k", [1, 2, 8, 64])
def test_a_window_of_k_equal_documents_costs_about_one_kth(k):
    m, S = get_model("llama-2-7b"), 65536
    mix = mix_from_counts([(S // k, 1)], "equal")
    ratio = attention_fwd_flops(m, S, mix) / attention_fwd_flops(m, S)
    # S/k-token documents at a random offset: a window cuts one of them in two, (1/k)(1 - 1/(3k)) (seqpar.plan.flops)
    assert ratio == pytest.approx((1 - 1 / (3 * k)) / k, rel=1e-12)
    assert abs(ratio * k - 1) <= 1 / (3 * k) + 1e-12
    assert model_flops_per_sequence(m, S, mix) == pytest.approx(
        model_flops_per_sequence(m, S) - 3.5 * attention_fwd_flops(m, S) * (1 - ratio), rel=1e-12
    )


def test_documents_much_longer_than_the_window_cost_the_dense_attention():
    m, S = get_model("llama-2-7b"), 32768
    mix = mix_from_counts([(1000 * S, 1)], "books")
    assert attention_fwd_flops(m, S, mix) == pytest.approx(attention_fwd_flops(m, S), rel=1e-3)
    assert attention_fwd_flops(m, S, None) == 2.0 * S * S * 32 * 128 * 32  # unchanged without a mix


# --------------------------------------------------------------------------------------------- time


def test_per_document_kernel_rates_match_the_h200_packed_measurement():
    """bench/packed_kernels.py timed one long-tail window per length on one H200 (all documents in one FA2 varlen call,
    as seqpar.runtime.parallel.varlen runs them by default): the model's rate on the same documents within 10% of the measured."""
    torch = pytest.importorskip("torch")  # the bench's seeded lengths come from torch's generator
    del torch
    sys.path.insert(0, str(ROOT / "bench"))
    from packed_kernels import long_tail_lengths

    c, cl = load_coefficients(), resolve_cluster("h200", 1, 1, None, None)[0]
    rate = c.kernel_rate_tflops(cl, c.attention_backend(cl))
    short = c.kernel_rate_tflops(cl, "flash") / rate
    measured = json.loads((ROOT / "bench/results/h200_packed_kernels.json").read_text())["time"]
    for row in measured:
        S = row["S"]
        lens = long_tail_lengths(S, seed=S)  # the bench's window of this length
        assert len(lens) == row["docs"] and max(lens) == row["longest"]
        time = sum(l * l / (rate * packed.document_rate(l, S, lambda n: call_efficiency(n, c), short)) for l in lens)
        model_tflops = sum(l * l for l in lens) / time
        assert model_tflops == pytest.approx(row["varlen_flash"]["tflops"], rel=0.10), S


@pytest.mark.parametrize("mix", [lognormal_mix(), lognormal_mix(mean=8192), MIXED], ids=["long-tail", "mean-8k", "three"])
@pytest.mark.parametrize("mode", ["zigzag_ring_attn", "dist_flash_attn"])
def test_transfer_share_matches_the_runtime_block_plans(mix, mode):
    """The share of transfers a packed window still needs, against seqpar.runtime.parallel.blocks on simulated windows: zigzag
    blocks travel to their farthest user (ring_need's reach), dist flash moves only blocks that hold work."""
    pytest.importorskip("torch")
    from seqpar.runtime.parallel import blocks
    from seqpar.runtime.parallel.documents import Documents

    S, W = 16384, 8
    got = []
    for lens in stream_windows(mix, S, 400, seed=1):
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        docs = Documents(S, ((None, tuple(bounds)),))
        if mode == "zigzag_ring_attn":
            segs = [blocks.zigzag_segments(r, W, S) for r in range(W)]
            got.append(sum(blocks.ring_need(segs, docs)[1]) / (W * (W - 1)))
        else:
            segs = [blocks.contiguous_segments(r, W, S) for r in range(W)]
            used = sum(blocks.need(segs[i], segs[j], docs) for i in range(W) for j in range(i))
            got.append(used / (W * (W - 1) / 2))
    model = packed.transfer_share(Strategy.over(mode, W, W), mix, S)
    assert model == pytest.approx(sum(got) / len(got), abs=0.04)


def test_imbalance_is_the_measured_one_on_the_mix_it_was_measured_on():
    rows = json.loads((ROOT / "bench/results/packed_balance.json").read_text())["summary"]
    ref = lognormal_mix()  # median 512, sigma 1.6: bench/packed_kernels.py long_tail_lengths
    checked = 0
    for row in rows:
        u = 2 if row["mode"] == "usp_attn" else None
        s = Strategy.over(row["mode"], 8, 8, u)
        assert packed.imbalance(s, ref, row["seq_len"]) == pytest.approx(row["after_mean"], abs=0.0015), row
        checked += 1
    assert checked == 12
    for mode, sp, u in MODES:  # whole windows, the head split, and one document per window are balanced
        s = Strategy.over(mode, sp, 8, u)
        if mode in ("data_parallel", "ulysses_attn"):
            assert packed.imbalance(s, ref, 131072) == 1.0
        assert packed.imbalance(s, mix_from_counts([(10**9, 1)], "books"), 131072) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("mode,sp,u", MODES)
def test_packed_predictions_reduce_to_dense_as_documents_grow(h200x8, mode, sp, u):
    m, S = get_model("llama-2-7b"), 131072
    s = Strategy.over(mode, sp, 8, u, sharding="zero3", checkpointing="full")
    dense = predict(Workload(model=m, seq_len=S), h200x8, s)
    assert predict(Workload(model=m, seq_len=S, doc_lens=None), h200x8, s) == dense
    books = predict(Workload(model=m, seq_len=S, doc_lens=mix_from_counts([(10**6 * S, 1)], "books")), h200x8, s)
    assert books.tokens_per_s == pytest.approx(dense.tokens_per_s, rel=1e-3)
    assert books.mfu == pytest.approx(dense.mfu, rel=1e-3)
    assert books.peak_memory_gib == dense.peak_memory_gib


@pytest.mark.parametrize("mode,sp,u", MODES)
def test_packed_predictions_are_faster_at_long_sequences_and_keep_memory(h200x8, mode, sp, u):
    m, S = get_model("llama-2-7b"), 524288 if sp > 1 else 65536
    s = Strategy.over(mode, sp, 8, u, sharding="zero3", checkpointing="full")
    c = load_coefficients()
    w0, w1 = Workload(model=m, seq_len=S), Workload(model=m, seq_len=S, doc_lens=lognormal_mix(mean=2048))
    dense, packed_ = predict(w0, h200x8, s), predict(w1, h200x8, s)
    assert packed_.step_time_s < 0.7 * dense.step_time_s  # attention-bound: most of the step was attention
    assert packed_.peak_memory_gib == dense.peak_memory_gib and packed_.memory_breakdown_gib == dense.memory_breakdown_gib
    t = estimate_time(w1, h200x8, s, c)  # MFU counts the documents' FLOPs (seqpar.plan.flops), as measured MFU does
    flops = s.dp_degree * model_flops_per_sequence(m, S, w1.doc_lens)
    assert t.mfu == pytest.approx(flops / t.step_time_s / (8 * h200x8.gpu.bf16_tflops * 1e12), rel=1e-12)


# --------------------------------------------------------------------------------------------- the plan field


def test_lognormal_mix_has_the_asked_mean_and_the_bench_shape():
    for mean in (100, 2048, 65536):
        mix = lognormal_mix(mean=mean)
        assert mix.mean_tokens == pytest.approx(mean, rel=1e-4) and mix.documents is None
        assert mix.histogram[0][0] >= 16 and "sigma 1.6" in mix.source
    ref = lognormal_mix()  # median 512 -> mean 512 e^(1.6^2 / 2), plus what the 16-token floor adds (below 1%)
    assert ref.mean_tokens == pytest.approx(512 * math.exp(1.28), rel=0.01)
    assert lognormal_mix(mean=8).histogram == [(8.0, 1.0)]


def _plan(tmp_path, mix):
    from seqpar.advisor.advise import advise
    from seqpar.advisor.request import AdviseRequest

    req = AdviseRequest(model=get_model("tiny"), seq_len=256, cluster=resolve_cluster(None, None, None, "cpu:2", None)[0])
    plan = advise(req.model_copy(update={"doc_lens": mix}))
    path = plan.write(tmp_path / "plan.json")
    return plan, path


def test_plan_round_trips_the_mix_and_old_plans_load_unchanged(tmp_path):
    mix = mix_from_counts([(16, 3), (100, 2), (1000, 1)], "lens.txt")
    plan, path = _plan(tmp_path, mix)
    loaded = LaunchPlan.load(path)
    assert loaded == plan and loaded.workload.doc_lens.histogram == mix.histogram
    assert loaded.workload.doc_lens.sum_sq_fraction == square_fraction(mix.histogram, 256) < 1
    old = json.loads(path.read_text())
    del old["workload"]["doc_lens"]  # a plan written before the field existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    legacy = LaunchPlan.load(tmp_path / "old.json")
    assert legacy.workload.doc_lens is None
    assert legacy.workload == plan.workload.model_copy(update={"doc_lens": None})


def test_sum_sq_fraction_is_derived_and_a_broken_histogram_is_refused(tmp_path):
    from seqpar.plan.errors import SeqparError

    _, path = _plan(tmp_path, mix_from_counts([(16, 3), (100, 2)], "lens.txt"))
    data = json.loads(path.read_text())
    data["workload"]["doc_lens"]["sum_sq_fraction"] = 0.9  # hand-edited: restated from the histogram on load
    (tmp_path / "edited.json").write_text(json.dumps(data))
    assert LaunchPlan.load(tmp_path / "edited.json").workload.doc_lens.sum_sq_fraction == pytest.approx(
        square_fraction([(16, 0.6), (100, 0.4)], 256), rel=1e-9
    )
    data["workload"]["doc_lens"]["histogram"][0][1] = 0.5  # shares now sum to 0.9
    (tmp_path / "broken.json").write_text(json.dumps(data))
    with pytest.raises(SeqparError, match=r"workload.doc_lens: histogram shares must be positive and sum to 1"):
        LaunchPlan.load(tmp_path / "broken.json")
