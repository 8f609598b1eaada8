"""A sixth mode added with one module (toy_allgather_mode.py: its runtime functions and its registration) and nothing
else edited: the advisor plans it and predicts its memory and speed, `seqpar advise --emit` says no tool runs it, and
2 gloo ranks run it exactly against one process computing full attention in float64 (out, lse, dq, dk, dv).

The module registers on import; the ranks import it through their function, and the fixture takes the mode out of the
registry afterwards, so no other test sees a sixth mode.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from reference import reference
from seqpar_testing import run_ranks, tolerances

MODE = "allgather_kv"


@pytest.fixture
def toy():
    import toy_allgather_mode

    from seqpar.plan import modes

    modes.register(toy_allgather_mode.DESCRIPTION)  # again, when an earlier test took it out (the import registers once)
    yield toy_allgather_mode
    modes.unregister(MODE)


def _advise(*args):
    from seqpar.cli import app

    return CliRunner().invoke(app, ["advise", *map(str, args)])


@pytest.mark.parametrize(
    "cluster",
    [("--cluster", "cpu:2", "-m", "tiny", "-s", "1k"), ("--gpu", "h100", "--gpus", "8", "-s", "128k")],
    ids=["cpu2", "h100x8"],
)
def test_the_advisor_plans_and_predicts_the_new_mode(toy, cluster):
    r = _advise(*cluster, "--mode", MODE, "--json")
    assert r.exit_code == 0, r.stderr
    plan = json.loads(r.stdout)
    s, pred = plan["strategy"], plan["prediction"]
    assert s["mode"] == MODE and s["sp_degree"] > 1 and s["ulysses_degree"] == s["ring_degree"] == 1
    assert pred["tokens_per_s"] > 0 and 0 < pred["peak_memory_gib"] <= pred["reserved_memory_gib"]
    assert plan["rationale"]["policy"] in ("cost", "pinned")

    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.memory import mode_buffers
    from seqpar.advisor.cost.throughput import estimate_time, imbalance
    from seqpar.plan.launch_plan import LaunchPlan

    p = LaunchPlan.model_validate(plan)  # the plan validates its registered mode like a built-in one
    w, st = p.workload, p.strategy
    P, t = st.sp_degree, w.seq_len // st.sp_degree
    fwd, bwd = mode_buffers(w.model, w.dtype, st, t)  # the cost shape "all_gather_kv": the whole sequence's K and V
    kv_bytes = 2 * w.model.num_key_value_heads * w.model.head_dim * {"bf16": 2, "fp32": 4}[w.dtype]
    assert fwd == P * t * kv_bytes and bwd == 2 * fwd
    assert imbalance(st) == (2 * P - 1) / P  # contiguous causal work: the last rank does the most
    assert estimate_time(w, p.cluster, st, load_coefficients()).breakdown_s["exposed_comm"] > 0


def test_its_balance_counts_contiguous_causal_work(toy):
    from seqpar.runtime.parallel.balance import rank_work

    assert rank_work([8], MODE, 2) == [10.0, 26.0]  # one document of 8: queries 0-3 see 10 pairs, queries 4-7 see 26
    assert rank_work([4, 4], MODE, 2) == [10.0, 10.0]  # two documents, one per rank


def test_the_new_mode_is_a_candidate_of_the_search_and_can_be_pinned_by_rules(toy):
    r = _advise("--cluster", "cpu:2", "-m", "tiny", "-s", "1k", "--json", "--policy", "rules", "--mode", MODE)
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["strategy"]["mode"] == MODE
    from seqpar.advisor.cluster import cpu_cluster
    from seqpar.advisor.request import AdviseRequest
    from seqpar.advisor.search import enumerate_strategies
    from seqpar.profiles import get_model

    req = AdviseRequest(model=get_model("tiny"), seq_len=1024, cluster=cpu_cluster(2))
    valid, _ = enumerate_strategies(req, req.workload())
    assert MODE in {s.mode for s in valid}


@pytest.mark.parametrize("tool", ["accelerate", "deepspeed"])
def test_emit_says_no_tool_runs_it(toy, tool, tmp_path):
    r = _advise("--cluster", "cpu:2", "-m", "tiny", "-s", "1k", "--mode", MODE, "-o", tmp_path / "plan.json", "--emit", tool)
    assert r.exit_code == 1, r.stderr
    assert f"{tool} runs no equivalent of mode {MODE}" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "plan.json"]  # the plan (seqpar launch runs it), no tool file


def _cases(rank, W):
    import toy_allgather_mode  # registers the mode in this rank

    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    mode = toy_allgather_mode.DESCRIPTION.name
    done = []
    for hq, hkv in ((4, 4), (4, 2)):
        for dtype in (torch.float64, torch.float32):
            for causal in (True, False) if dtype == torch.float64 else (True,):
                S = W * 5  # chunks of 5 tokens
                g = torch.Generator().manual_seed(100 * hkv + causal)
                q = torch.randn(2, S, hq, 8, generator=g, dtype=dtype)  # (B, S, Hq, D), the same on every rank
                k = torch.randn(2, S, hkv, 8, generator=g, dtype=dtype)  # (B, S, Hkv, D)
                v = torch.randn(2, S, hkv, 8, generator=g, dtype=dtype)
                dout = torch.randn(2, S, hq, 8, generator=g, dtype=dtype)
                ref = reference(q, k, v, dout, causal, 0.35)
                lq, lk, lv = (shard(t, mode, rank, W).clone().requires_grad_() for t in (q, k, v))
                out, lse = attention(lq, lk, lv, mode, causal=causal, softmax_scale=0.35)
                out.backward(shard(dout, mode, rank, W))
                for name, a, r, dim in zip(
                    ("out", "lse", "dq", "dk", "dv"), (out, lse, lq.grad, lk.grad, lv.grad), ref, (1, 2, 1, 1, 1)
                ):
                    expected = shard(r, mode, rank, W, dim=dim)
                    assert a.shape == expected.shape, (name, a.shape, expected.shape)
                    torch.testing.assert_close(
                        a.double(), expected, **tolerances(dtype), msg=lambda m: f"{name} {hq}/{hkv} {dtype} causal={causal}: {m}"
                    )
                assert out.dtype == dtype
                done.append((hq, hkv, str(dtype), causal))
    return done


def test_two_gloo_ranks_run_it_exactly(toy):
    results = run_ranks(_cases, 2, timeout=90)
    assert results[0] == results[1] and len(results[0]) == 2 * 3
