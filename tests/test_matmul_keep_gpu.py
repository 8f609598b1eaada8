"""kept_saves matmuls on a CUDA GPU, bf16, with Liger's fused kernels (seqpar.runtime.matmul_keep): the streams, the
page-locked host blocks and Liger's in-place RoPE, which the CPU tests cannot reach.

- The same loss and gradients as fully kept layers (kept_saves all) with the layers' matmul outputs kept on the GPU and
  with some of them in host memory (copied out and fetched back one layer ahead on a side stream).
- Without the copy q_proj / k_proj hand Liger's RoPE, the kept outputs would be rotated twice: the gradients come out
  wrong, so the guard is what makes the result exact (a control, not a tolerance).
- What waits on the GPU after the forward shrinks by the model's per-layer bytes (seqpar.advisor.memory
  matmul_bytes_per_token) for each kept layer: by saved - matmul bytes from all to matmuls, by the matmul bytes for each
  layer moved to host memory.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("liger_kernel")

L, S, H, I_ = 4, 8192, 1024, 2816


def _model():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=H,
        intermediate_size=I_,
        num_hidden_layers=L,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=S,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()


def _run(saves: str, host: int, guard: bool = True):
    import seqpar
    from seqpar.runtime import matmul_keep
    from seqpar.runtime.fused import apply_fused_ops

    warnings.filterwarnings("ignore")
    model = _model()
    seqpar.apply(model, "data_parallel", checkpointing="selective", checkpoint_layers=1, kept_saves=saves, kept_host_layers=host)
    apply_fused_ops(model, "liger", "cuda")
    ids = torch.randint(0, 1000, (1, S), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    original = matmul_keep._copy_for_rope
    if not guard:
        matmul_keep._copy_for_rope = lambda layer, module, args, out: out  # noqa: ARG005 (the hooks call it by name)
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
    finally:
        matmul_keep._copy_for_rope = original
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    return loss.detach().float(), grads, held


def _worst(grads, ref):
    return max(float((grads[n] - r).abs().max() / r.abs().max().clamp_min(1e-12)) for n, r in ref.items())


def test_kept_matmuls_match_fully_kept_layers_with_liger():
    from seqpar.advisor.memory import matmul_bytes_per_token, saved_bytes_per_token
    from seqpar.profiles.hf_config import spec_from_config
    from seqpar.runtime.matmul_keep import MatmulKeep

    ref_loss, ref, held_all = _run("all", 0)
    loss, grads, held_mm = _run("matmuls", 0)
    before = MatmulKeep.stats["host"]
    loss_h, grads_h, held_host = _run("matmuls", 2)
    assert MatmulKeep.stats["host"] > before
    for lo, g in ((loss, grads), (loss_h, grads_h)):
        assert torch.equal(lo, ref_loss) or abs(float(lo - ref_loss)) < 1e-3 * abs(float(ref_loss))
        assert _worst(g, ref) < 2e-2, _worst(g, ref)
    _, wrong, _ = _run("matmuls", 0, guard=False)
    assert _worst(wrong, ref) > 0.1, "without the copy before RoPE the kept q and k would be rotated twice"

    spec = spec_from_config(_model().config.to_dict(), "t", "test", "test")
    mm = matmul_bytes_per_token(spec, "bf16") * S
    saved = (saved_bytes_per_token(spec, "bf16", None, "liger") + 2 * H) * S  # + the layer input the fused norm saves
    around = (2 * H + 2 * 8 * 128 + 4 * 8) * S  # input + attention out + lse, kept either way
    kept = L - 1
    assert abs((held_all - held_mm) - kept * (saved - around - mm)) < 0.1 * kept * (saved - around - mm)
    assert abs((held_mm - held_host) - 2 * mm) < 0.1 * 2 * mm
