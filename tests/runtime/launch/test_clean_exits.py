"""Clean exits: a process that finished its work exits 0, never "terminate called without an active exception".

gloo's worker thread frees a finished collective's tensors itself, a moment after the caller's wait returned; a tensor
Python no longer holds then needs the GIL, and an interpreter already tearing down aborts the thread inside C++
(seqpar.runtime.launch.stopping). ``settle`` hands the GIL over while the interpreter is whole:

- on 2 gloo ranks, after each of 10 all-reduces whose tensor Python dropped at once, ``settle`` leaves no worker holding
  it (the storage's only owner is the test's own reference);
- the slow set runs bench/clean_exits.py twice per path (the README loop, ``with_seqpar`` on DeepSpeed with TRL's
  SFTTrainer, ``with_seqpar`` on gloo): every run exits 0 and no rank prints "terminate called". BENCHMARKS.md has the
  50-run counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from seqpar_testing import run_ranks

ROOT = Path(__file__).resolve().parents[3]


def _held_after_settle(rank: int, world: int) -> list[int]:
    """Owners of each all-reduced tensor's storage once ``settle`` returned, besides the tensor itself (dropped)."""
    import torch
    import torch.distributed as dist

    from seqpar.runtime.launch.stopping import settle

    owners = []
    for _ in range(10):
        t = torch.ones(1000)
        storage = t.untyped_storage()
        dist.all_reduce(t)
        del t  # the worker may still hold the finished work, and with it the tensor
        settle()
        owners.append(torch._C._storage_Use_Count(storage._cdata))  # 1: only `storage` is left
    return owners


def test_settle_leaves_no_finished_collective_to_gloos_workers():
    for rank, owners in enumerate(run_ranks(_held_after_settle, 2, timeout=120)):
        assert owners == [1] * 10, f"rank {rank}: a gloo worker still held a finished all-reduce's tensor: {owners}"


@pytest.mark.slow
def test_every_path_exits_cleanly(tmp_path):
    out = tmp_path / "clean_exits.json"
    cmd = [sys.executable, str(ROOT / "bench" / "clean_exits.py"), "--runs", "2", "--out", str(out), "--work", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())["paths"]
    assert sorted(res) == ["readme", "trl_ds", "with_seqpar"]
    for path, r in res.items():
        assert r["runs"] == 2 and r["unclean"] == 0, f"{path}: {r['failures']}"
