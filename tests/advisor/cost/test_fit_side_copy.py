"""bench/fit_side_copy.py, the fit of the cost model's side_copy_overlap: it recovers a known overlap from rows whose
tokens/s the model itself predicts at that overlap, and the shipped coefficient is what it fits to the committed H100 rows."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import fit_side_copy as fsc  # noqa: E402

from seqpar.advisor.cost.coefficients import load_coefficients  # noqa: E402
from seqpar.advisor.search import evaluate  # noqa: E402
from seqpar.plan.launch_plan import LaunchPlan  # noqa: E402

ROWS = ROOT / "bench" / "results" / "h100_kept_matmuls_32k_paced.json"  # the runtime as shipped: spread, paced


def _rows() -> list[dict]:
    return json.loads(ROWS.read_text())


@pytest.mark.parametrize("truth", [0.55, 0.93])
def test_the_fit_recovers_the_overlap_that_made_the_rows(truth):
    c = dataclasses.replace(load_coefficients(), side_copy_overlap=truth)
    rows = copy.deepcopy(_rows())
    for r in rows:
        if r.get("report"):
            plan = LaunchPlan.model_validate(r["report"]["plan"])
            r["tokens_per_s"] = evaluate(plan.workload, plan.cluster, plan.strategy, c).tokens_per_s * 1.07  # any GPU factor
    best, table = fsc.fit(rows)
    assert best == pytest.approx(truth, abs=0.011)
    assert set(table) == {"same10", "same17", "advised"}  # every row with host-kept layers, the reference left out
    assert all(own == pytest.approx(truth, abs=0.011) for _, _, _, own, _ in table.values())


def test_the_shipped_overlap_is_the_fit_of_the_committed_rows():
    best, _ = fsc.fit(_rows())
    assert load_coefficients().side_copy_overlap == pytest.approx(best, abs=1e-9)


def test_a_missing_reference_row_exits_2(capsys):
    assert fsc.main([str(ROWS), "--reference", "nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "--reference" in err and len(err.strip().splitlines()) == 1
