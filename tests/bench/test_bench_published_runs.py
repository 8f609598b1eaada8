"""bench/published_runs.py end to end: the table names every row once with its status, and --json writes each row's
prediction and errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import published_runs as pr  # noqa: E402

from seqpar.advisor.cost.published import load_published_runs  # noqa: E402


def test_table_and_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert pr.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    runs = load_published_runs()
    for r in runs.rows:
        assert text.count(f"| {r.id} |") >= 1, r.id
    assert "21 rows from 4 independent groups" in text
    assert text.count("meets targets") == 5
    rows = json.loads(out.read_text())["rows"]
    assert [r["id"] for r in rows] == [r.id for r in runs.rows]
    miss = {r["id"]: r["failures"] for r in rows if r["targeted"] and r["failures"]}
    assert set(miss) == {
        "alst-t1-baseline-dp8-32k",
        "alst-t4-baseline-dp32-36k",
        "alst-t4-all-sp32-15.5m",
        "ec-issue9-zigzag-512k",
    }
