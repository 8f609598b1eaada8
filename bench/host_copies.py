"""Host <-> GPU copy bandwidth of checkpointed layer inputs, the way seqpar.runtime.memory.offload moves them.

Within the pinned budget a layer input goes to a page-locked host tensor (``non_blocking``), beyond it to a fresh
pageable one (a synchronous copy into memory the process touches for the first time); in backward it comes back. This
times both for layer-input sizes of Llama-2-7B at 128K-512K tokens (1-4 GiB, bf16, hidden 4096) and writes GB/s per
direction: the cost model's ``offload_bandwidth_gb_s`` (pinned) and ``pageable_bandwidth_gb_s`` come from here.
``registered``: a plain host tensor page-locked in place (cudaHostRegister), as the kept matmul outputs' pool pins;
``pin_*_gib_s``: how fast fresh host memory is page-locked (once per block, in the first step), by cudaHostAlloc, by
cudaHostRegister of an untouched tensor, and by cudaHostRegister after torch's threads have touched its pages.

    source bench/h200_env.sh && python3 bench/host_copies.py --out $OUT/host_copies.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone

import torch

GIB = 1 << 30


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gib", default="1,2,3,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="host_copies.json")
    args = ap.parse_args()
    rows = []
    for size in (float(x) for x in args.sizes_gib.split(",")):
        n = int(size * GIB) // 2
        dev = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        d2h_pinned = timed(lambda: pinned.copy_(dev, non_blocking=True), args.repeats)
        h2d_pinned = timed(lambda: dev.copy_(pinned, non_blocking=True), args.repeats)
        pinned = None  # free the page-locked block before the registered and pageable copies
        # the way seqpar.runtime.memory.matmul_keep pins: a plain host tensor page-locked in place (cudaHostRegister)
        from torch.cuda._pin_memory_utils import pin_memory, unpin_memory

        # page-locking itself, on fresh memory each time (the first step pays it once per block): a cudaHostAlloc'd
        # block, a plain tensor registered untouched (the kernel faults its pages in inside cudaHostRegister, one
        # thread), and one whose pages torch's threads fault in first (zero_) before it is registered
        pin_s = {}
        for how in ("host_alloc", "register", "touch_register"):
            ts = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                if how == "host_alloc":
                    blk = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
                else:
                    blk = torch.empty(n, dtype=torch.bfloat16)
                    if how == "touch_register":
                        blk.zero_()
                    pin_memory(blk.data_ptr(), n * 2)
                ts.append(time.perf_counter() - t0)
                if how != "host_alloc":
                    unpin_memory(blk.data_ptr())
                blk = None
                getattr(torch._C, "_host_emptyCache", lambda: None)()  # so the next cudaHostAlloc'd block is fresh
            pin_s[how] = ts
        registered = torch.empty(n, dtype=torch.bfloat16)
        pin_memory(registered.data_ptr(), n * 2)
        d2h_registered = timed(lambda: registered.copy_(dev, non_blocking=True), args.repeats)
        h2d_registered = timed(lambda: dev.copy_(registered, non_blocking=True), args.repeats)
        unpin_memory(registered.data_ptr())
        registered = None
        kept = []

        def to_pageable():  # a fresh pageable tensor each time, as HostOffload allocates beyond the budget
            host = torch.empty(n, dtype=torch.bfloat16)
            host.copy_(dev)
            kept.append(host)

        d2h_pageable = timed(to_pageable, args.repeats)
        h2d_pageable = timed(lambda: dev.copy_(kept[-1]), args.repeats)
        kept.clear()
        nbytes = n * 2
        row = {"size_gib": size}
        for name, ts in (
            ("d2h_pinned", d2h_pinned),
            ("h2d_pinned", h2d_pinned),
            ("d2h_registered", d2h_registered),
            ("h2d_registered", h2d_registered),
            ("d2h_pageable_fresh", d2h_pageable),
            ("h2d_pageable", h2d_pageable),
        ):
            row[name + "_gb_s"] = round(nbytes / min(ts) / 1e9, 2)
            row[name + "_median_gb_s"] = round(nbytes / sorted(ts)[len(ts) // 2] / 1e9, 2)
        for how, ts in pin_s.items():
            row[f"pin_{how}_gib_s"] = round(size / min(ts), 2)
            row[f"pin_{how}_median_gib_s"] = round(size / sorted(ts)[len(ts) // 2], 2)
        rows.append(row)
        print(row, flush=True)
        dev = None
        torch.cuda.empty_cache()
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{torch.cuda.get_device_name()} ({platform.node()}), host RAM "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} GiB",
        "torch": torch.__version__,
        "command": "python3 bench/host_copies.py",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
