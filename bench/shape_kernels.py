"""Kernel rates by shape on one GPU: the two shape terms of the cost model checked directly, outside any model.

The cost model (seqpar/advisor/cost/throughput.py) prices attention at the measured 128-wide-head rate times
d / (d + d0) / (128 / (128 + d0)), and matmuls at the 8192-wide GEMM rate times h / (h + h0) / (8192 / (8192 + h0)); both
d0 and h0 were fitted to whole training steps (bench/accuracy.py). This bench times the kernels themselves:
- causal attention forward + backward (seqpar.runtime.parallel.kernels, the backend training uses) with 32 heads of 64 and of
  128, at 16K and 64K tokens: the head-width ratio the fit implies is (64 / (64 + d0)) / (128 / (128 + d0));
- the decoder layer's GEMMs (q/k/v/o projections and the three MLP matrices, forward: t x h @ h x n) of each model shape
  at t = 16384 tokens, against the 8192^3 GEMM: the width efficiency the fit implies for each h.
FLOPs: attention 3.5 x 2 x S^2 x H x D (causal, forward + backward); GEMM 2 x m x n x k.

    source bench/h200_env.sh && python3 bench/shape_kernels.py --out $OUT/shape_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import time_block  # noqa: E402  (bench/attention.py: median fwd+bwd seconds of one block)

from seqpar.profiles import get_model  # noqa: E402
from seqpar.runtime.parallel import kernels

SHAPES = ("llama-3.2-1b", "llama-2-7b", "llama-3.1-8b", "llama-2-13b")


def gemm_tflops(m: int, k: int, n: int, reps: int = 20) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * m * n * k * reps / (start.elapsed_time(end) / 1e3) / 1e12


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="shape_kernels.json")
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    backend = kernels.select_backend(torch.device("cuda"), torch.bfloat16)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["backend"] = backend
    rows = []
    for S in (16384, 65536):
        for d in (64, 128):
            sec = time_block(S, S, True, 32, d, backend)
            rows.append(
                {"seq_len": S, "heads": 32, "head_dim": d, "seconds": sec, "tflops": 3.5 * 2 * S * S * 32 * d / sec / 1e12}
            )
            print(json.dumps(rows[-1]), flush=True)
    res["attention"] = rows
    gemms = [{"shape": "8192^3", "h": 8192, "tflops": gemm_tflops(8192, 8192, 8192)}]
    for name in SHAPES:
        m = get_model(name)
        h, i, a, kv, d = m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim
        t = args.tokens
        parts = [(h, a * d), (h, kv * d), (h, kv * d), (a * d, h), (h, i), (h, i), (i, h)]  # q k v o gate up down
        flops = sum(2 * t * k * n for k, n in parts)
        secs = sum(2 * t * k * n / (gemm_tflops(t, k, n) * 1e12) for k, n in parts)
        gemms.append({"shape": name, "h": h, "tokens": t, "tflops": flops / secs / 1e12})
        print(json.dumps(gemms[-1]), flush=True)
    res["gemm"] = gemms
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
