"""Units shared by every layer, defined once (dependency-free, so the runtime and the advisor both import it).

The schema's field names carry their unit: ``_gib`` = GiB = 2**30 bytes, ``_gb_s`` = 10**9 bytes per second per
direction, ``_tflops`` = 10**12 FLOP/s, ``_s`` = seconds.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable

from seqpar.plan.errors import SeqparError

GIB = 2**30  # bytes in a GiB (what torch.cuda.max_memory_allocated / 2**30 and NVML's MiB / 1024 report)
INT64_MAX = 2**63 - 1  # what torch and NumPy hold: the most a count, size or id seqpar takes can be
# Digits of the longest whole number seqpar reads from a file or a flag (a config.json's largest, tokenizers'
# model_max_length 1e30, has 31): Python refuses to convert past 4300 with a bare ValueError, and the cost model's floats
# overflow long before.
MAX_INT_DIGITS = 40


_SEQ_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_seq_len(text: str | int) -> int:
    """'131072', '128k', '512K', '1M' (k = 1024, M = 1024**2) -> a positive int; SeqparError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SEQ_RE.match(str(text))
        if not m:
            raise SeqparError(f"sequence length {text!r} is not a number; write it as 131072, 128k or 1M (k = 1024, M = 1048576)")
        if len(m.group(1)) > MAX_INT_DIGITS:
            raise SeqparError(
                f"sequence length {m.group(1)[:12]}... has {len(m.group(1))} digits, more than any sequence; write it as "
                "131072, 128k or 1M (k = 1024, M = 1048576)"
            )
        # Fraction, not float: 9007199254740993 must stay itself (a float rounds it to ...992)
        num, suffix = Fraction(m.group(1)), m.group(2).lower()
        scaled = num * {"": 1, "k": 1024, "m": 1024**2}[suffix]
        if scaled.denominator != 1:
            raise SeqparError(f"sequence length {text!r} is not a whole number of tokens ({float(scaled)}); use e.g. 128k")
        value = int(scaled)
    if value <= 0:
        raise SeqparError(f"sequence length {text!r} must be positive; use e.g. 128k")
    return value


def format_tokens(n: int) -> str:
    """131072 -> '128K', 1048576 -> '1M', 100000 -> '100000'."""
    if n % (1024**2) == 0:
        return f"{n // 1024**2}M"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


__all__ = ["GIB", "INT64_MAX", "MAX_INT_DIGITS", "format_tokens", "parse_seq_len"]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending, found up to its square root (a world of 10^8 ranks has a few dozen; a
    loop over every number up to it would run for minutes)."""
    low, high = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            low.append(d)
            if d * d != n:
                high.append(n // d)
        d += 1
    return low + high[::-1]


def longest(unit: int, limit: int, fits: Callable[[int], bool]) -> int:
    """The longest length, a multiple of ``unit``, for which ``fits(length)`` holds (0 when none does); ``fits`` must
    hold up to some length and fail beyond it. Doubled from ``unit`` while at most ``limit``, then bisected (so the
    answer stays below twice ``limit``): about 2 log2(limit / unit) calls."""
    lo, hi = 0, 1
    while hi * unit <= limit and fits(hi * unit):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * unit) else (lo, mid)
    return lo * unit
