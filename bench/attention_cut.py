"""The cuDNN attention backward cut over KV heads (seqpar.plan.attention_calls) against one call: time and the memory
it allocates for itself, Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head_dim 128), causal, batch 1.

    PYTHONPATH=. python3 bench/attention_cut.py --out results.json      (one Hopper GPU)

Each length: the backward alone (forward done once), median of 5 after 2 warm-up calls, as one call and as the cut
the runtime picks; the extra memory is the allocator's peak beyond the inputs and the returned gradients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from seqpar.plan import attention_calls
from seqpar.runtime.parallel import kernels

HQ, HKV, D = 32, 8, 128


def measure(tokens: int, budget: float) -> dict:
    attention_calls.WORKSPACE_BUDGET = budget
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, tokens, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, tokens, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    scale = D**-0.5
    out, lse = kernels.attn_forward(q, k, v, causal=True, softmax_scale=scale, backend="cudnn")
    times = []
    for i in range(7):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        grads = kernels.attn_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale, backend="cudnn")
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        extra = torch.cuda.max_memory_allocated() - base - sum(x.numel() * x.element_size() for x in grads)
        del grads
    calls = attention_calls.backward_calls(tokens, tokens, HQ, HKV, D)
    flops = 2.5 * 2 * tokens * tokens * HQ * D  # the causal backward: 2.5x the forward's 2 S^2 a d (seqpar.plan.flops)
    s = statistics.median(times)
    return {"tokens": tokens, "calls": calls, "backward_s": s, "tflops": flops / s / 1e12, "extra_gib": extra / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,16384,32768,65536,131072")
    ap.add_argument("--out", default="attention_cut.json")
    args = ap.parse_args()
    shipped = attention_calls.WORKSPACE_BUDGET
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        one, cut = measure(n, float("inf")), measure(n, shipped)
        rows.append({"one_call": one, "cut": cut})
        print(
            f"{n:>7} tokens: one call {one['backward_s'] * 1e3:8.1f} ms {one['extra_gib']:.2f} GiB | "
            f"{cut['calls']} calls {cut['backward_s'] * 1e3:8.1f} ms {cut['extra_gib']:.2f} GiB "
            f"({cut['backward_s'] / one['backward_s'] - 1:+.1%} time)",
            flush=True,
        )
    attention_calls.WORKSPACE_BUDGET = shipped
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
