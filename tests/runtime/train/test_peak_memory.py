"""A rank's run-report memory is its own: not the peak of the launcher that started it.

torchrun starts every rank with fork + exec from the launcher's process (which tokenized the data, so its peak can be
many GiB), and Linux records the forked address space's peak in the new program's getrusage ru_maxrss at exec: a rank
read ru_maxrss and reported the launcher's peak as its own. The test reproduces that start (a parent of known peak
starts the child with subprocess, as torchrun's agent does), then holds the child's reported peak to the child's own
resident memory measured independently (/proc/self/statm's resident pages right after it touched its buffer), and
shows ru_maxrss, the old figure, carries the parent's.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the inheritance is Linux's exec")

MIB = 2**20
PARENT_MIB = 1024  # the launcher's peak: well above what the child itself holds
CHILD_MIB = 200  # the child's own buffer, so its peak is known from below

CHILD = f"""
import json, os, resource
import torch
from seqpar.runtime.train.report import memory_now
buf = bytearray({CHILD_MIB} * 2**20)
for i in range(0, len(buf), 4096):
    buf[i] = 1
resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
mem = memory_now(torch.device("cpu"))
print(json.dumps({{"reported_gib": mem["peak_rss_gib"], "allocated_gib": mem["peak_allocated_gib"],
                  "resident": resident, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def test_a_ranks_peak_is_its_own_not_its_launchers():
    held = bytearray(PARENT_MIB * MIB)  # the launcher's tokenization peak, touched page by page
    for i in range(0, len(held), 4096):
        held[i] = 1
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert parent_peak >= PARENT_MIB * MIB
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=os.environ)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    del held
    reported = got["reported_gib"] * 2**30
    # the reference: the child's resident memory just after its own buffer, which nothing bigger followed
    assert got["resident"] >= CHILD_MIB * MIB
    assert got["resident"] <= reported <= got["resident"] + 64 * MIB, (reported / MIB, got["resident"] / MIB)
    assert reported < parent_peak - 256 * MIB, (reported / MIB, parent_peak / MIB)
    assert got["allocated_gib"] == got["reported_gib"]  # what the run report's peak_memory_gib takes on CPU
    # the old figure: the launcher's peak inherited through exec (the cause, shown so the test keeps meaning it)
    assert got["ru_maxrss"] >= parent_peak - 64 * MIB, (got["ru_maxrss"] / MIB, parent_peak / MIB)
