"""Time DeepSpeed's CPU Adam step and the host passes ZeRO-3's offloaded step adds, per parameter, on this host's CPU.

    OMP_NUM_THREADS=1 python bench/cpu_adam.py            # one thread: what torchrun gives each of several ranks per node
    OMP_NUM_THREADS=1 python bench/cpu_adam.py --params 5e8 --json OUT.json

Prints one JSON line: the kernel's time (DeepSpeedCPUAdam.step on one flat fp32 parameter, moments allocated by a first
step), the in-place gradient scaling and the fp32 -> bf16 copy of stage3.py, each as seconds, Gparam/s and the GB/s their
bytes make (28, 8 and 6 bytes per parameter: seqpar.advisor.cost.deepspeed_memory.CPU_ADAM_HOST_BYTES counts them, plus
the gradient's arrival). Builds DeepSpeed's CPU Adam on first use (TORCH_EXTENSIONS_DIR caches it). CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=2e8, help="parameters in the flat partition (default 2e8)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)

    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    n = int(args.params)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.01)
    opt.step()  # the first step allocates the moments
    kernel = best(opt.step, args.repeat)
    half = torch.empty(n, dtype=torch.bfloat16)
    scale = best(lambda: p.grad.mul_(0.999), args.repeat)
    cast = best(lambda: half.copy_(p.data), args.repeat)
    out = {
        "params": n,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "kernel_s": kernel,
        "kernel_gparams_s": n / kernel / 1e9,
        "kernel_gb_s": 28 * n / kernel / 1e9,
        "scale_gb_s": 8 * n / scale / 1e9,
        "cast_gb_s": 6 * n / cast / 1e9,
        "step_gparams_s": n / (kernel + scale + cast) / 1e9,
    }
    line = json.dumps(out)
    print(line)
    if args.json:
        from seqpar.plan.files import write_atomic

        write_atomic(args.json, line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
