"""NCCL's bus bandwidth by link, operation and message size: the communication terms' rate (throughput.py).

``seqpar/profiles/nccl_tests.json`` keeps published nccl-tests results and NCCL maintainers' figures as rows with their
sources, and per link kind and operation a curve read from them: time(S) = latency + S / (peak_fraction x link
bandwidth), so the effective rate S / time(S) rises with the message size towards peak_fraction of the datasheet
bandwidth (a ring step of a few MB runs well below it, a 1 GB bucket near it). A link or operation without a curve
falls back to the flat ``comm_bandwidth_efficiency`` of the coefficients. Bytes are what one rank sends in one call (a
ring step's K,V block, one all-to-all's tensor, one bucket), bandwidths per GPU and direction. Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

NCCL_TESTS_PATH = Path(__file__).resolve().parents[2] / "profiles" / "nccl_tests.json"
OPS = ("sendrecv", "all_gather", "reduce_scatter", "alltoall", "all_reduce")


@dataclass(frozen=True)
class Curve:
    peak_fraction: float  # busbw at large messages / datasheet link bandwidth
    latency_s: float  # per call


@lru_cache(maxsize=1)
def curves() -> dict[tuple[str, str], Curve]:
    """(link kind, operation) -> its curve, from the shipped data file (read once)."""
    data = json.loads(NCCL_TESTS_PATH.read_text())
    return {
        (link, op): Curve(float(c["peak_fraction"]), float(c["latency_us"]) * 1e-6)
        for link, by_op in data["curves"].items()
        for op, c in by_op.items()
    }


def curve(link: str, op: str) -> Optional[Curve]:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    return curves().get((link, op))


def bus_bandwidth(link: str, link_gb_s: float, op: str, message_bytes: float, flat_efficiency: float) -> float:
    """Bytes/s one rank's ``op`` of ``message_bytes`` reaches over ``link`` (datasheet ``link_gb_s`` per direction):
    the curve's S / time(S), or ``flat_efficiency`` x the link where no curve is kept for it."""
    peak = link_gb_s * 1e9
    c = curve(link, op)
    if c is None:
        return peak * flat_efficiency
    rate = peak * c.peak_fraction
    if message_bytes <= 0:
        return rate
    return message_bytes / (c.latency_s + message_bytes / rate)
