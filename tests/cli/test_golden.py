"""The golden corpus (tests/cli/golden): every request of requests.json, run through the CLI in-process, gives exactly the
recorded exit code, stdout and written files (expected/<name>.json; numbers compared exactly). It pins the advisor's,
checker's and emitters' behaviour across refactors. After an intended change, regenerate with
`PYTHONPATH=. python tests/cli/golden/make.py` and review the diff of tests/cli/golden/expected."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"


def _harness():
    """tests/cli/golden/harness.py (not a package: make.py runs it as a script's neighbour)."""
    name = "seqpar_golden_harness"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GOLDEN / "harness.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


harness = _harness()
REQUESTS = harness.load_requests()


def test_every_request_has_an_expected_record():
    names = {r["name"] for r in REQUESTS}
    recorded = {p.stem for p in harness.EXPECTED_DIR.glob("*.json")}
    assert names == recorded, (
        f"missing: {sorted(names - recorded)}; stale: {sorted(recorded - names)} (run tests/cli/golden/make.py)"
    )


@pytest.mark.parametrize("req", REQUESTS, ids=[r["name"] for r in REQUESTS])
def test_golden(req):
    expected = harness.load_expected(req["name"])
    actual = harness.run_request(req)
    diffs = harness.differences(expected, actual)
    if diffs:
        argv = " ".join(req["argv"])
        pytest.fail(
            f"seqpar {argv}\ndiffers from tests/cli/golden/expected/{req['name']}.json at:\n  "
            + "\n  ".join(diffs)
            + f"\n(stderr is not recorded; rerun it by hand to see the notes; exit code {actual['exit_code']}, expected "
            f"{expected['exit_code']}; {len(json.dumps(actual))} vs {len(json.dumps(expected))} characters)",
            pytrace=False,
        )
