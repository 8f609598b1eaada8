"""torchrun's ``@record`` on the trainer's entry point (seqpar.runtime.train.train): a rank that raises writes its error
file (the path torchrun gives it in TORCHELASTIC_ERROR_FILE) with the exception and its traceback, and ``seqpar launch``
names the failing rank and its error.

The failure is the trainer's documented test hook (SEQPAR_FAULT_RANK / SEQPAR_FAULT_STEP, seqpar.runtime.checkpoint.fault):
rank 1 raises a RuntimeError before step 2, after the process group, the model and the first step are up. torchrun keeps
each rank's error file in its log folder (a ``torchelastic_*`` folder under TMPDIR when no --log-dir is given), so the
launch runs with TMPDIR in the test's folder and the file is read back from there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_train import make_plan


def test_a_failing_rank_writes_its_traceback_and_the_launch_names_it(tmp_path):
    plan_file, out, tmp = tmp_path / "plan.json", tmp_path / "job", tmp_path / "tmp"
    make_plan(2, "zigzag_ring_attn", 2, steps=3).write(plan_file)
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), SEQPAR_FAULT_RANK="1", SEQPAR_FAULT_STEP="2")
    cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(plan_file), "--output", str(out), "--data", "synthetic"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stderr[-3000:]
    message = "RuntimeError: injected fault on rank 1 at step 2"
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("seqpar launch: the job failed with exit status 1; first failure: rank 1 failed"), last
    assert message in last, last

    # <log dir>/<run>/attempt_0/<local rank>/error.json; rank 0 may have one too: its wait for rank 1 broke ("closed by
    # peer"), a consequence the launcher names after rank 1
    files = {f.parent.name: f for f in tmp.glob("torchelastic_*/*/attempt_0/*/error.json")}
    assert "1" in files, sorted(tmp.rglob("*"))
    err = json.loads(files["1"].read_text())["message"]
    assert err["message"].startswith(message)
    stack = err["extraInfo"]["py_callstack"]
    assert stack.startswith("Traceback (most recent call last):")
    # the frames from the entry point down to the raise
    for frame in (
        'seqpar/runtime/train.py", line',
        "in train\n",
        "in run\n",
        'seqpar/runtime/checkpoint.py", line',
        "in fault\n",
    ):
        assert frame in stack, (frame, stack)
    assert stack.rstrip().endswith(message + " (step; SEQPAR_FAULT_* is set)"), stack[-300:]
    if "0" in files:
        assert message not in files["0"].read_text()
        assert json.loads(Path(out, "failed-rank0.json").read_text())["kind"] == "peer"
