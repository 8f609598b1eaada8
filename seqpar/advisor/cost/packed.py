"""What packed documents (a workload's ``doc_lens``) change in the cost model, and what they do not.

A query attends only to earlier tokens of its own document, so every mode computes, per window, the sum over its
documents of their causal attention instead of one S x S triangle (seqpar.plan.flops counts it: E[sum l^2] / S^2). Three
effects on the time of throughput.py, each 1.0 when ``doc_lens`` is None (one document per window, bit for bit the
dense model):

* ``attention_time_share``: packed / dense attention time of one window. Each document runs at its own kernel rate, as
  seqpar.runtime.parallel.varlen runs them: a document that fills the mode's kernel calls runs on the attention backend's causal
  kernel (cuDNN on Hopper, else flash) at throughput.py's call efficiency eff(call); the documents sharing a call go
  together into one FA2 varlen call at the flash kernel's rate (the runtime's default, as cuDNN builds a new plan for
  every new document length; a document of at least LONG_DOC tokens would run alone at eff(its length), the opt-in
  split). A document is weighted by the expected squares of the pieces the window edges cut it into
  (seqpar.plan.flops.piece_squares) at the rate of its whole length.
* ``imbalance``: the busiest rank over the mean. Ring and dist flash layouts skip the blocks that share no document, so
  the work left is the sum of the documents' pieces each rank holds, and a rank holding the middle of a long document
  does more than one holding many short ones; a step waits for the busiest rank. Measured, not modelled here (the
  runtime's seqpar.runtime.parallel.balance counts it exactly and reorders documents to even it out): busiest / mean per
  mode and window length at W = 8 on the long-tail mix after that reordering (seqpar/profiles/packed_imbalance.json,
  with its source), interpolated in log S between the points and held outside them. ulysses_attn (every rank the whole
  sequence on 1/W of the heads) and data_parallel (whole windows) are balanced whatever the documents. Another mix: the
  tabled excess scaled by how far the mix is from one document per window, (1 - f) / (1 - f_ref) capped at 1, f =
  square_fraction (the mix's, the long-tail mix's at the same S): one document per window is balanced by the layout
  (f = 1 -> 1.0), and where attention matters most (long documents) the long-tail figure is the relevant one. W other
  than 8 and usp with U other than 2 use the same figures (the table has no others).
* ``transfer_share``: ring K,V blocks travel only as far as the farthest rank that uses them and dist flash leaves a
  block that shares no document idle, without a transfer (seqpar.runtime.parallel.zigzag_ring_attn, dist_flash_attn). Two
  positions D tokens apart of a packed stream lie in one document with probability rho(D) = E[(l - D)+] / E[l]; a block
  is needed by a later chunk when a document spans the gap between them (the nearest pair of their chunks). Zigzag: the
  expected reach of each rank's block, E[max hop needed], over the W-1 hops of the plain ring; dist flash: the share of
  off-diagonal blocks that hold work. Forward and backward transfers scale alike.
Memory does not change: flash-style kernels keep O(S) per layer whatever the mask (out, lse, the saved q, k, v), and the
boundaries (cu_seqlens) are a few integers; memory.py's terms hold for packed windows as they are.
Pure Python.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Callable

from seqpar.plan.flops import piece_squares, square_fraction
from seqpar.plan.modes import degrees, describe
from seqpar.plan.specs import DocMix, Strategy

LONG_DOC = 1 << 62  # seqpar.runtime.parallel.varlen.LONG_DOC: documents this long run alone on the causal kernel (default: never)

IMBALANCE_PATH = Path(__file__).resolve().parents[2] / "profiles" / "packed_imbalance.json"


def _measured_imbalance() -> dict[str, tuple[tuple[int, float], ...]]:
    """mode -> ((seq_len, busiest / mean), ...) in seq_len order, from seqpar/profiles/packed_imbalance.json."""
    modes = json.loads(IMBALANCE_PATH.read_text())["modes"]
    return {mode: tuple(sorted((int(s), float(v)) for s, v in points)) for mode, points in modes.items()}


MEASURED_IMBALANCE = _measured_imbalance()


def attention_time_share(mix: DocMix, seq_len: int, call: float, eff: Callable[[float], float], short_rate: float) -> float:
    """Packed / dense attention time of one window of seq_len tokens (module docstring). ``call``: query tokens of one
    kernel call of the mode; ``eff(n)``: the call efficiency; ``short_rate``: the varlen kernel's rate over the backend's."""
    bins, S = mix.histogram, seq_len
    mean = sum(l * p for l, p in bins)
    packed = S / mean * sum(p * piece_squares(l, S) / document_rate(l, call, eff, short_rate) for l, p in bins)
    return packed / (float(S) * S / eff(call))


def document_rate(length: float, call: float, eff: Callable[[float], float], short_rate: float) -> float:
    """Attention rate of a document of ``length`` tokens, relative to the backend's kernel rate: its own causal call
    (cut into the mode's calls when longer) from LONG_DOC tokens on, the shared varlen call below."""
    if length >= call:
        return eff(call)
    return eff(length) if length >= LONG_DOC else short_rate


def _interpolate(points: tuple[tuple[int, float], ...], seq_len: int) -> float:
    """Piecewise linear in log2(seq_len) through the points, held flat outside them."""
    if seq_len <= points[0][0]:
        return points[0][1]
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if seq_len <= s1:
            x = (math.log2(seq_len) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return v0 + x * (v1 - v0)
    return points[-1][1]


@lru_cache(maxsize=1)
def _reference() -> DocMix:
    from seqpar.advisor.doc_lens import lognormal_mix

    return lognormal_mix()  # the long-tail mix of packed_imbalance.json (median 512, sigma 1.6)


def imbalance(s: Strategy, mix: DocMix, seq_len: int) -> float:
    """Busiest rank's attention work over the mean, for packed windows of ``mix`` (module docstring)."""
    ring, _ = degrees(s.mode, s.sp_degree, s.ulysses_degree)
    row = describe(s.mode).packed_imbalance  # the measured row the mode follows (None: documents leave ranks even)
    if row not in MEASURED_IMBALANCE or ring < 2:
        return 1.0
    measured = _interpolate(MEASURED_IMBALANCE[row], seq_len)
    f, f_ref = square_fraction(mix.histogram, seq_len), square_fraction(_reference().histogram, seq_len)
    return 1.0 + (measured - 1.0) * min(1.0, (1.0 - f) / max(1.0 - f_ref, 1e-12))


def _rho(bins: tuple[tuple[float, float], ...], gap: float) -> float:
    """P(two positions ``gap`` tokens apart lie in one document) in a packed stream: E[(l - gap)+] / E[l]."""
    return sum(p * max(l - gap, 0.0) for l, p in bins) / sum(p * l for l, p in bins)


@lru_cache(maxsize=256)
def _share(bins: tuple[tuple[float, float], ...], seq_len: int, layout: str, ranks: int) -> float:
    if layout == "zigzag":  # rank x holds chunks x and 2R-1-x of S/(2R) tokens
        chunk, chunks = seq_len / (2 * ranks), lambda x: (x, 2 * ranks - 1 - x)
    else:  # contiguous: rank x holds chunk x of S/R
        chunk, chunks = seq_len / ranks, lambda x: (x,)
    rho = [_rho(bins, g * chunk + 1) for g in range(2 * ranks)]  # g whole chunks between the two
    need = [
        [max((rho[q - k - 1] for k in chunks(src) for q in chunks(dst) if q > k), default=0.0) for dst in range(ranks)]
        for src in range(ranks)
    ]
    if layout == "zigzag":  # block src goes round the ring as far as its farthest user: E[max hop] ~ sum_i max_{j>=i} P(hop j)
        hops = 0.0
        for src in range(ranks):
            tail = 0.0
            for i in range(ranks - 1, 0, -1):
                tail = max(tail, need[src][(src + i) % ranks])
                hops += tail
        return hops / (ranks * (ranks - 1))
    return sum(need[j][i] for i in range(ranks) for j in range(i)) / (ranks * (ranks - 1) / 2)


def transfer_share(s: Strategy, mix: DocMix, seq_len: int) -> float:
    """Share of the mode's K,V (ring) or block (dist flash) transfers that packed windows of ``mix`` still need."""
    ring, _ = degrees(s.mode, s.sp_degree, s.ulysses_degree)
    if ring < 2:
        return 1.0
    layout = "zigzag" if "zigzag" in describe(s.mode).layout else "contiguous"
    return _share(tuple(tuple(b) for b in mix.histogram), seq_len, layout, ring)


__all__ = ["LONG_DOC", "MEASURED_IMBALANCE", "attention_time_share", "document_rate", "imbalance", "transfer_share"]
