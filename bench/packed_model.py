"""One GPU, packed documents: stock transformers, stock + Liger and seqpar on the same packed window and model shape.

The window is ``--seq`` tokens of the long-tail document mix (bench/packed_kernels.long_tail_lengths: log-normal, median
512, sigma 1.6), packed the way transformers' DataCollatorWithFlattening packs it: position ids restart at 0 at each
document and the first label of each document is -100 (no token predicts across a boundary). Variants:
- ``stock``: LlamaForCausalLM, attention as transformers picks for packed position ids without flash-attn (sdpa with its
  per-document mask), gradient checkpointing, its own loss on full logits.
- ``liger``: the same with Liger-Kernel's RoPE, RMSNorm, SwiGLU and fused linear cross-entropy.
- ``seqpar``: seqpar.apply(model, "data_parallel", checkpointing="selective") on the same model with Liger's RoPE, RMSNorm
  and SwiGLU (seqpar's fused_ops liger), packed inputs through seqpar.prepare_inputs and the chunked loss; attention per
  document (cuDNN per long document, FA2 varlen for the short ones). ``seqpar-full`` and ``seqpar-offload``: the same with
  that checkpointing (full recomputes every layer as the stock variants do; offload also sends layer inputs to the host).
With ``--fresh-windows`` every step packs a new window of the mix (new document lengths, as training sees them; the
loss reported is the last window's). Every variant reports the loss of the same window (they must agree: the same function), the median step time of
``--steps`` after ``--warmup``, and peak allocated memory. Each variant runs in its own subprocess (an OOM stays there).

    PYTHONPATH=. python3 bench/packed_model.py --shape llama-2-7b --seq 64k --out $OUT/packed_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def window(seq: int, vocab: int, seed: int = 0):
    import torch
    from packed_kernels import long_tail_lengths

    lens = long_tail_lengths(seq, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]  # (1, S): restarting at each document
    labels = ids.clone()
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    labels[0, starts] = -100  # DataCollatorWithFlattening: a document's first label is not predicted from the previous one
    return ids, pos, labels, lens


def build(spec_name: str):
    import torch
    from single_gpu import hf_config, shape_spec
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(shape_spec(spec_name))
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model


def run(variant: str, spec_name: str, seq: int, steps: int, warmup: int, fresh: bool = False) -> dict:
    import torch

    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    model = build(spec_name)
    # --fresh-windows: step i packs window i of the mix (new document lengths every step, as in training); else window 0
    windows = [
        [t.cuda() for t in window(seq, model.config.vocab_size, seed=i if fresh else 0)[:3]] for i in range(warmup + steps)
    ]
    lens = window(seq, model.config.vocab_size)[3]
    model.train()
    if variant.startswith("seqpar"):
        import seqpar
        from seqpar.runtime.memory.fused import apply_fused_ops

        # seqpar-full / seqpar-offload: the same with that checkpointing (the speed plan keeps attention: selective)
        seqpar.apply(model, "data_parallel", checkpointing=variant.partition("-")[2] or "selective")
        apply_fused_ops(model, "liger", "cuda")

        def step(ids, pos, labels):
            batch = seqpar.prepare_inputs(ids, "data_parallel", 0, 1, labels=labels, position_ids=pos)
            docs = {"cu_seq_lens_q": batch["cu_seqlens"], "cu_seq_lens_k": batch["cu_seqlens"]}
            hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **docs).last_hidden_state
            return seqpar.loss_from_hidden(hidden, model.lm_head.weight, batch["labels"])
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def step(ids, pos, labels):
            return model(input_ids=ids, position_ids=pos, labels=labels).loss

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = step(*windows[i])
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    return {
        "loss": float(loss),
        "step_times_s": times,
        "step_time_s": t,
        "tokens_per_s": seq / t,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "reserved_memory_gib": torch.cuda.max_memory_reserved() / 2**30,
        "documents": len(lens),
        "longest_document": max(lens),
        "attn_implementation": model.config._attn_implementation,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--seq", default="64k")
    ap.add_argument("--variants", default="stock,liger,seqpar")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "packed_model.json"))
    ap.add_argument("--worker", default=None)
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--fresh-windows", action="store_true", help="a new window of the mix every step (new lengths)")
    a = ap.parse_args()
    seq = int(float(a.seq.rstrip("kK")) * 1024) if a.seq[-1] in "kK" else int(a.seq)
    if a.worker:
        row = {"variant": a.worker, "model": a.shape, "seq_len": seq, "optimizer": "none"}
        try:
            row.update(run(a.worker, a.shape, seq, a.steps, a.warmup, a.fresh_windows), ok=True)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            row.update(ok=False, oom="out of memory" in msg.lower(), error=msg[-600:])
        print("RESULT " + json.dumps(row), flush=True)
        return
    rows = []
    for v in a.variants.split(","):
        # seqpar runs with the allocator setting its launcher sets; the baselines with the default users get
        env = {k: x for k, x in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        if v.startswith("seqpar"):
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            v,
            "--shape",
            a.shape,
            "--seq",
            a.seq,
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
        ] + (["--fresh-windows"] if a.fresh_windows else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
            out = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            rows.append(out[0] if out else {"variant": v, "ok": False, "error": (proc.stdout + proc.stderr)[-1500:]})
        except subprocess.TimeoutExpired:
            rows.append({"variant": v, "ok": False, "error": f"timed out after {a.timeout} s"})
        print(
            json.dumps({k: rows[-1].get(k) for k in ("variant", "ok", "loss", "tokens_per_s", "peak_memory_gib", "error")}),
            flush=True,
        )
    Path(a.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
