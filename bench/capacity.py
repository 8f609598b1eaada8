"""What torch can allocate on one GPU, against what NVML reports: the capacity the OOM gate must use.

NVML's total (``nvmlDeviceGetMemoryInfo``, version 1) counts memory the driver keeps for itself; version 2 reports that
share as ``reserved``. torch sees ``total - reserved`` (``torch.cuda.mem_get_info``), and a process then loses its CUDA
context, cuBLAS's workspace (allocated through the caching allocator) and, with a process group, NCCL's buffers. This
measures each step, then allocates until the allocator refuses (expandable segments, as ``seqpar launch`` sets them),
so the last figure is the most one process's tensors can ever hold.

    PYTHONPATH=. python3 bench/capacity.py --out $OUT/capacity.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

GIB = 2**30


def nvml_memory(index: int = 0) -> dict:
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        out = {"name": pynvml.nvmlDeviceGetName(h), "v1_total": v1.total, "v1_free": v1.free, "v1_used": v1.used}
        try:
            v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            out.update(v2_total=v2.total, v2_reserved=v2.reserved, v2_free=v2.free, v2_used=v2.used)
        except pynvml.NVMLError as e:  # an older driver: version 1 only
            out["v2_error"] = str(e)
        return out
    finally:
        pynvml.nvmlShutdown()


def measure(nccl: bool) -> dict:
    """In this process: the memory each layer of a training process takes before its first tensor."""
    import torch

    row = {"nvml_before": nvml_memory()}
    free0, total = torch.cuda.mem_get_info()  # creates the context
    row.update(torch_total=total, props_total=torch.cuda.get_device_properties(0).total_memory, free_after_context=free0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()  # cuBLAS handle + workspace
    free1, _ = torch.cuda.mem_get_info()
    row.update(free_after_cublas=free1, allocated_after_cublas=torch.cuda.memory_allocated())
    row["reserved_after_cublas"] = torch.cuda.memory_reserved()
    del a
    if nccl:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        free2, _ = torch.cuda.mem_get_info()
        row["free_after_nccl"] = free2
        del t
    torch.cuda.empty_cache()
    row["free_before_fill"], _ = torch.cuda.mem_get_info()
    row["allocated_before_fill"] = torch.cuda.memory_allocated()
    # fill: 1 GiB blocks, then 64 MiB, then 2 MiB, until the allocator refuses
    held = []
    for block in (GIB, 64 << 20, 2 << 20):
        while True:
            try:
                held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    row["max_allocated"] = torch.cuda.max_memory_allocated()
    row["max_reserved"] = torch.cuda.max_memory_reserved()
    row["free_at_fill"], _ = torch.cuda.mem_get_info()
    row["nvml_at_fill"] = nvml_memory()
    del held
    if nccl:
        import torch.distributed as dist

        dist.destroy_process_group()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["plain", "nccl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(measure(args.worker == "nccl")), flush=True)
        return
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    rows = {}
    for kind in ("plain", "nccl"):
        proc = subprocess.run([sys.executable, __file__, "--worker", kind], capture_output=True, text=True, env=env)
        got = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        rows[kind] = got[0] if got else {"error": (proc.stdout + proc.stderr)[-2000:]}
    for kind, r in rows.items():
        if "error" in r:
            print(kind, r["error"])
            continue
        n = r["nvml_before"]
        print(
            f"{kind}: NVML total {n['v1_total'] / GIB:.3f} GiB, reserved {n.get('v2_reserved', 0) / GIB:.3f}; torch total "
            f"{r['torch_total'] / GIB:.3f}; context {(r['torch_total'] - r['free_after_context']) / GIB:.3f}; after cuBLAS "
            f"{(r['torch_total'] - r['free_after_cublas']) / GIB:.3f}; max allocated {r['max_allocated'] / GIB:.3f} GiB"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
