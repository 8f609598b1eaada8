"""Per-rank attention work imbalance of packed windows in every mode's layout, before and after balancing the order.

Windows of the long-tail document mix (bench/packed_kernels.py's long_tail_lengths: log-normal, median 512 tokens,
sigma 1.6) at S = 128K, 512K, 1M over W = 8 ranks. For each window and mode: the busiest rank's useful work over the
mean (seqpar.runtime.parallel.balance.rank_work: exact query-key pairs per rank, times its share of heads) in the packed order,
and after seqpar.runtime.parallel.balance.balanced_order; for the zigzag layouts also a lower bound no order can beat: the
heaviest chunk any placement leaves of the window's longest documents (a chunk of c tokens at offset x of a document
holds c(x + c/2) pairs, so long documents bound the busiest rank whatever the order). ulysses_attn is balanced by
construction (every rank the whole sequence on 1/W of the heads) and data_parallel has nothing to balance in a window.
Pure Python, no GPU: runs anywhere.

    PYTHONPATH=. python3 bench/packed_balance.py            # JSON to $OUT/packed_balance.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packed_kernels import long_tail_lengths  # noqa: E402

from seqpar.runtime.parallel.balance import balanced_order, imbalance, rank_work  # noqa: E402

MODES = (("zigzag_ring_attn", None), ("dist_flash_attn", None), ("usp_attn", 2), ("ulysses_attn", None))


def _pairs(a: int, b: int) -> int:
    """Pairs of document offsets [a, b): each token at offset i sees i + 1 keys."""
    return (b * (b + 1) - a * (a + 1)) // 2


def chunk_bound(lengths: list[int], chunk: int, longest: int = 3) -> int:
    """The least, over placements, heaviest chunk piece of any of the longest documents (a lower bound on a rank)."""
    worst = 0
    for L in sorted(lengths)[-longest:]:
        best = None
        for phi in range(0, chunk, max(1, chunk // 512)):  # offset of the document's start inside its first chunk
            cuts = sorted({0, *range(min(L, chunk - phi), L, chunk), L})
            heaviest = max(_pairs(a, b) for a, b in zip(cuts, cuts[1:]))
            best = heaviest if best is None else min(best, heaviest)
        worst = max(worst, best)
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="131072,524288,1048576")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--windows", type=int, default=8, help="windows (seeds) per length")
    args = ap.parse_args(argv)
    W, rows = args.world_size, []
    for S in (int(x) for x in args.seq.split(",")):
        for seed in range(args.windows):
            lens = long_tail_lengths(S, seed=seed)
            for mode, uly in MODES:
                before = rank_work(lens, mode, W, uly)
                t0 = time.perf_counter()
                order = balanced_order(lens, mode, W, uly)
                seconds = time.perf_counter() - t0
                after = rank_work([lens[i] for i in order], mode, W, uly)
                row = {
                    "seq_len": S,
                    "seed": seed,
                    "mode": mode,
                    "ulysses_degree": uly,
                    "docs": len(lens),
                    "longest": max(lens),
                    "before": imbalance(before),
                    "after": imbalance(after),
                    "search_s": seconds,
                }
                if mode in ("zigzag_ring_attn", "usp_attn"):
                    ring = W // (uly or 1)
                    per_ring_rank = sum(before) / W * (uly or 1)
                    row["bound"] = max(1.0, chunk_bound(lens, S // (2 * ring)) / per_ring_rank)
                rows.append(row)
            print(f"S={S} seed={seed} done", flush=True)
    summary = []
    for S in sorted({r["seq_len"] for r in rows}):
        for mode, uly in MODES:
            rs = [r for r in rows if r["seq_len"] == S and r["mode"] == mode]
            line = {
                "seq_len": S,
                "mode": mode,
                "before_mean": statistics.mean(r["before"] for r in rs),
                "before_max": max(r["before"] for r in rs),
                "after_mean": statistics.mean(r["after"] for r in rs),
                "after_max": max(r["after"] for r in rs),
                "within_1.10": sum(r["after"] <= 1.10 for r in rs),
                "windows": len(rs),
                "search_s_max": max(r["search_s"] for r in rs),
            }
            if "bound" in rs[0]:
                line["bound_mean"] = statistics.mean(r["bound"] for r in rs)
                line["bound_within_1.10"] = sum(r["bound"] <= 1.10 for r in rs)
            summary.append(line)
            print(
                f"S={S:>8} {mode:<17} busiest/mean before {line['before_mean']:.2f} (max {line['before_max']:.2f}) "
                f"after {line['after_mean']:.2f} (max {line['after_max']:.2f}); <=1.10 in {line['within_1.10']}/{len(rs)}"
                + (
                    f"; bound {line['bound_mean']:.2f}, <=1.10 possible in {line['bound_within_1.10']}"
                    if "bound_mean" in line
                    else ""
                )
            )
    result = {"world_size": W, "mix": "long_tail_lengths(median 512, sigma 1.6)", "summary": summary, "windows": rows}
    path = Path(os.environ.get("OUT", "."), "packed_balance.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
