"""The cut of cuDNN's attention backward over KV heads (seqpar.plan.attention_calls), the rule the runtime runs and the
memory model prices, against the bytes written out by hand; and measured runs from before the cut priced as one call."""

from __future__ import annotations

import json

import pytest

from seqpar.plan import attention_calls as ac

GIB = 2**30


def by_hand(n, t, a, kv, d):
    """One call of n over t tokens: fp32 softmax sum per query head, fp32 dK, dV at the query heads' width (GQA); once
    cut, bf16 copies of dO, q, out (its query heads) and k, v (its KV heads), and its dq, dk, dv."""
    qh, kh = a // n, kv // n
    work = t * qh * (4 + (8 * d if kh < qh else 0))
    return work if n == 1 else work + 2 * d * t * (3 * qh + 2 * kh) + 2 * d * t * (qh + 2 * kh)


@pytest.mark.parametrize("t", [4096, 16384, 32768, 65536, 163840, 409600])
def test_the_cut_is_the_fewest_calls_within_the_budget(t):
    a, kv, d = 32, 8, 128  # Llama-3.1-8B
    sizes = {n: by_hand(n, t, a, kv, d) for n in (1, 2, 4, 8)}
    for n, b in sizes.items():
        assert ac.call_bytes(n, t, t, a, kv, d) == b
    fitting = [n for n in (1, 2, 4, 8) if sizes[n] <= ac.WORKSPACE_BUDGET]
    want = fitting[0] if fitting else min(sizes, key=sizes.get)
    assert ac.backward_calls(t, t, a, kv, d) == want
    assert ac.backward_bytes(t, t, a, kv, d) == sizes[want] <= sizes[1]


def test_what_the_cut_does_at_the_lengths_that_matter():
    a, kv, d = 32, 8, 128
    assert ac.backward_calls(16384, 16384, a, kv, d) == 1  # 0.5 GiB: no cut, full-size kernels
    assert ac.backward_calls(32768, 32768, a, kv, d) == 4  # two calls would take more than one (1.13 against 1.0 GiB)
    assert ac.backward_calls(409600, 409600, a, kv, d) == 8  # past the budget even cut: the smallest call
    assert ac.backward_bytes(409600, 409600, a, kv, d) < ac.workspace_bytes(409600, 409600, a, kv, d) / 3.5
    assert ac.backward_calls(10**6, 10**6, 32, 32, 128) == 1  # no GQA: only the softmax sum, nothing to cut
    assert ac.backward_calls(10**6, 10**6, 8, 1, 128) == 1  # one KV head: no whole-head cut exists


def test_runs_from_before_the_cut_are_priced_as_one_call(tmp_path):
    """A run report without attention_backward_cut (written before the runtime cut the backward) is a one-call run;
    today's reports say true; anything else is refused with the file named."""
    from seqpar.advisor.cost.measurements import MEASUREMENTS_DIR, load_measurements

    src = sorted(MEASUREMENTS_DIR.glob("h100_llama-3.1-8b_*.json"))[0]
    report = json.loads(src.read_text())
    assert "attention_backward_cut" not in report
    old = tmp_path / "old.json"
    old.write_text(json.dumps(report))
    new = tmp_path / "new.json"
    new.write_text(json.dumps({**report, "attention_backward_cut": True}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**report, "attention_backward_cut": "yes"}))
    assert [r.attention_backward_cut for r in load_measurements([old, new])] == [False, True]
    from seqpar.plan.errors import SeqparError

    with pytest.raises(SeqparError, match="bad.json.*attention_backward_cut 'yes' must be true or false"):
        load_measurements([bad])
