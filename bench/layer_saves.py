"""What each decoder layer leaves on the GPU after its forward, under each kept_saves, on a CUDA GPU (with or without
Liger's fused kernels): the allocated bytes each layer adds (forward hooks), and the tensors autograd saves in it, one
line per storage (shape, dtype, bytes), so a gap between seqpar.advisor.cost.memory's per-layer terms and a measurement can
be traced to a tensor. A checkpointed layer's saves go through the checkpoint's own hooks, not these: for it only the
bytes it adds are listed (under kept_saves matmuls, its input, attention's out + lse and the kept matmul outputs).

    source bench/h200_env.sh && python3 bench/layer_saves.py --out $OUT/layer_saves.json

The model is also tests/runtime/memory/test_matmul_keep_gpu.py's (Llama, 4 layers, hidden 1024, intermediate 2816, 8 heads, 4 KV heads,
8192 tokens, bf16); layer 0 is checkpointed (selective), layers 1-3 kept.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch

L, S, H, I_, HEADS = 4, 8192, 1024, 2816, 8


def model():
    """The 4-layer Llama both this and tests/runtime/memory/test_matmul_keep_gpu.py measure, bf16 on CUDA, seed 0."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=H,
        intermediate_size=I_,
        num_hidden_layers=L,
        num_attention_heads=HEADS,
        num_key_value_heads=4,
        max_position_embeddings=S,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()


def one(saves: str, fused: str) -> dict:
    import seqpar
    from seqpar.runtime.memory.fused import apply_fused_ops

    m = model()
    seqpar.apply(m, "data_parallel", checkpointing="selective", checkpoint_layers=1, kept_saves=saves)
    if fused == "liger":
        apply_fused_ops(m, "liger", "cuda")
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    where, grown, saved, forward = [None], {}, {}, [False]

    # only during the forward: a checkpointed layer's recomputation in backward runs the hooks again (and stops early,
    # before the post hook, once it has what backward needs)
    def pre(mod, args, i):
        if forward[0]:
            torch.cuda.synchronize()
            where[0] = i
            grown[i] = -torch.cuda.memory_allocated()

    def post(mod, args, out, i):
        if forward[0]:
            torch.cuda.synchronize()
            grown[i] += torch.cuda.memory_allocated()
            where[0] = None

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and where[0] is not None:
            saved.setdefault(where[0], {})[st.data_ptr()] = (list(t.shape), str(t.dtype), st.nbytes())
        return t

    hooks = []
    for i, layer in enumerate(m.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda mod, a, i=i: pre(mod, a, i)))
        hooks.append(layer.register_forward_hook(lambda mod, a, o, i=i: post(mod, a, o, i)))
    ids = torch.randint(0, 1000, (1, S), device="cuda")
    for step in range(2):  # the first forward also allocates cuBLAS's workspace: the second is reported
        grown.clear(), saved.clear()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        forward[0] = True
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(input_ids=ids, labels=ids).loss
        forward[0] = False
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        m.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return {
        "kept_saves": saves,
        "fused_ops": fused,
        "held_after_forward": held,
        "grown_per_layer": {str(k): v for k, v in sorted(grown.items())},
        "saved_per_layer": {
            str(k): sorted(v.values(), key=lambda x: -x[2]) for k, v in sorted(saved.items(), key=lambda kv: kv[0])
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="layer_saves.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    for fused in ("liger", "none"):
        for saves in ("all", "matmuls"):
            r = one(saves, fused)
            rows.append(r)
            print(
                fused,
                saves,
                "held",
                r["held_after_forward"],
                "per layer",
                r["grown_per_layer"],
                "per token",
                {k: round(v / S) for k, v in r["grown_per_layer"].items()},
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
