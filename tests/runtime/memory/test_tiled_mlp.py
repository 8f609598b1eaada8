"""tiled_mlp (seqpar.runtime.memory.tiled_mlp) against plain transformers, and the fused_ops refusals that CPU can check.

Reference: the same model untiled (float64: loss and every gradient to 1e-12 relative); memory: the bytes autograd saves
during forward, counted by saved-tensor hooks, must lose the MLP intermediates (4 x intermediate_size per token)."""

from __future__ import annotations

import copy

import pytest
import torch

from seqpar.plan.errors import SeqparError
from seqpar.runtime.hf.apply import apply
from seqpar.runtime.memory.tiled_mlp import tile_mlp, tile_tokens

from seqpar_testing.memory import allocation_peak

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 2, inter: int = 176):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        use_cache=False,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).double()


def _enable(model, checkpointing: str):
    apply(model, "data_parallel", checkpointing=checkpointing)
    model.train()
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tile_rule_is_alst_ceil_t_over_h():
    assert tile_tokens(65536, 4096) == 4096
    assert tile_tokens(100, 64) == 50  # 2 tiles
    assert tile_tokens(10, 64) == 10  # 1 tile
    assert tile_tokens(65537, 4096) == 3856  # 17 tiles of at most 3856 tokens


@pytest.mark.parametrize("checkpointing", ["none", "full", "offload", "selective"])
@pytest.mark.parametrize("tile", [1, 7, None, 1000])
def test_tiled_equals_untiled_in_float64(checkpointing, tile):
    ref = _llama()
    tiled = copy.deepcopy(ref)
    _enable(ref, checkpointing)
    _enable(tiled, checkpointing)
    assert tile_mlp(tiled, tile=tile) == 2
    ids, want_loss = _agree(ref, tiled, tile, rtol=1e-10, atol=1e-14)
    # a second step reuses the patched modules and still agrees
    torch.testing.assert_close(_loss_and_grads(tiled, ids)[0], want_loss, rtol=1e-12, atol=0)


def _agree(ref, tiled, tile, rtol: float, atol: float):
    """One step of both on the same batch: the loss to 1e-12 relative, every gradient to ``rtol`` / ``atol``; returns
    the batch and the loss. One-token tiles run one tile per token, each a Python-level step of forward, recompute and
    backward: 10 tokens a row make as many tiles as tokens just as 50 would, at a fifth of the time; the other tiles see
    50 (7 leaves a remainder)."""
    seq = 10 if tile == 1 else 50
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    want_loss, want = _loss_and_grads(ref, ids)
    got_loss, got = _loss_and_grads(tiled, ids)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=0)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=rtol, atol=atol, msg=name)
    return ids, want_loss


def _saved_bytes(model, ids, once: bool = False) -> int:
    """Bytes of the tensors autograd saves during forward, parameters excluded (they exist anyway); ``once``: a tensor
    several nodes save (the input of q, k and v's adapters) counted once, as memory holds it."""
    params = {p.data_ptr() for p in model.parameters()}
    total, seen = 0, set()

    def pack(t):
        nonlocal total
        key = (t.data_ptr(), t.numel(), t.dtype)
        if t.data_ptr() not in params and not (once and key in seen):
            total += t.numel() * t.element_size()
            seen.add(key)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # outside the hooks: the tiles' recomputation in backward is not what forward keeps
    return total


def test_tiling_drops_the_mlp_intermediates_from_what_forward_saves():
    inter, tokens = 512, 2 * 64
    ref = _enable(_llama(inter=inter), "none")
    tiled = _enable(copy.deepcopy(ref), "none")
    tile_mlp(tiled, tile=16)
    ids = torch.randint(0, 128, (2, 64))
    untiled_b, tiled_b = _saved_bytes(ref, ids), _saved_bytes(tiled, ids)
    intermediates = 2 * 4 * inter * tokens * 8  # 2 layers x (gate, up, act(gate), product) x tokens, float64
    assert untiled_b - tiled_b >= 0.95 * intermediates, (untiled_b, tiled_b, intermediates)


def test_tiled_under_autocast_matches_untiled_and_keeps_fp32_grads():
    ref = _llama().float()
    tiled = copy.deepcopy(ref)
    _enable(ref, "full")
    _enable(tiled, "full")
    tile_mlp(tiled, tile=8)
    ids = torch.randint(0, 128, (1, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, want = _loss_and_grads(ref, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_loss, got = _loss_and_grads(tiled, ids)
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-2, atol=0)
    for name, g in want.items():
        assert got[name].dtype == torch.float32, name
        rel = (got[name] - g).norm() / g.norm()
        assert rel < 3e-2, (name, float(rel))


def test_mixture_of_experts_blocks_are_refused():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    with pytest.raises(SeqparError, match="mixture-of-experts.*set tiled_mlp false"):
        tile_mlp(Qwen2MoeForCausalLM(cfg))


def test_fused_ops_refusals_are_one_clear_line():
    from seqpar.runtime.memory.fused import apply_fused_ops

    model = _llama()
    assert "none" in apply_fused_ops(model, "none", "cpu")
    with pytest.raises(SeqparError, match="fused_ops liger runs Triton kernels on CUDA.*cpu.*set fused_ops none"):
        apply_fused_ops(model, "liger", "cpu")
    with pytest.raises(SeqparError, match="fused_ops 'triton' is unknown"):
        apply_fused_ops(model, "triton", "cuda")


def test_plans_refuse_liger_off_cuda_and_tiling_under_zero3():
    from pydantic import ValidationError

    from seqpar.advisor.cluster import cpu_cluster
    from seqpar.plan.launch_plan import LaunchPlan, Rationale
    from seqpar.plan.specs import Strategy, Workload
    from seqpar.profiles import get_model

    def plan(**strategy):
        return LaunchPlan(
            workload=Workload(model=get_model("tiny"), seq_len=64, dtype="fp32"),
            cluster=cpu_cluster(1),
            strategy=Strategy(mode="data_parallel", **strategy),
            rationale=Rationale(policy="pinned"),
        )

    assert plan(tiled_mlp=True).strategy.tiled_mlp
    with pytest.raises(ValidationError, match="fused_ops liger runs Triton kernels on CUDA GPUs.*accelerator is cpu"):
        plan(fused_ops="liger")
    with pytest.raises(ValidationError, match="tiled_mlp with sharding zero3.*use sharding fsdp or ddp"):
        plan(tiled_mlp=True, sharding="zero3")


def test_a_tiled_model_is_freed_without_the_cycle_collector():
    import gc
    import weakref

    gc.disable()
    try:
        model = _llama()
        tile_mlp(model)
        ids = torch.randint(0, 128, (1, 70))
        model(input_ids=ids, labels=ids).loss.backward()
        weight = weakref.ref(model.model.layers[0].mlp.gate_proj.weight)
        del model
        assert weight() is None  # its GPU memory would otherwise stay allocated until gc ran
    finally:
        gc.enable()


def test_reentrant_offload_forward_runs_in_tiles_too():
    """checkpointing offload (reentrant) runs the forward under no_grad: the MLP must still see one tile at a time."""
    model = _enable(_llama(), "offload")
    tile_mlp(model, tile=8)
    seen = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    ids = torch.randint(0, 128, (1, 30))
    model(input_ids=ids, labels=ids).loss.backward()
    assert seen and max(seen) <= 8, seen


def test_a_copied_tiled_model_is_independent_and_pickles():
    import io

    model = _llama()
    tile_mlp(model, tile=7)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 30))
    want = _loss_and_grads(model, ids)
    del model
    got = _loss_and_grads(twin, ids)  # the copy's own MLPs receive the gradients, with the original gone
    torch.testing.assert_close(got[0], want[0])
    assert all(g is not None for g in got[1].values())
    buf = io.BytesIO()
    torch.save(twin, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    torch.testing.assert_close(_loss_and_grads(back, ids)[0], want[0])


def test_an_instance_level_forward_patch_runs_inside_the_tiles():
    """Liger binds its SwiGLU forward on the instance; tiling must keep it (here a doubled MLP as the stand-in patch)."""
    import types

    def doubled(self, x):
        return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    ref, tiled = _llama(), None
    tiled = copy.deepcopy(ref)
    for m in (ref, tiled):
        for layer in m.model.layers:
            layer.mlp.forward = types.MethodType(doubled, layer.mlp)
    tile_mlp(tiled, tile=5)
    ids = torch.randint(0, 128, (1, 23))
    (want_loss, want), (got_loss, got) = _loss_and_grads(ref, ids), _loss_and_grads(tiled, ids)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=0)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-14, msg=name)


def test_dropout_inside_the_mlp_is_refused_while_training():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64)
    model = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.1, **cfg)).train()
    with pytest.raises(SeqparError, match="new dropout masks.*p=0.1.*set the MLP's dropout to 0"):
        tile_mlp(model)
    assert tile_mlp(GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, **cfg)).train()) == 1


def test_liger_patch_stays_on_the_instance_and_on_cuda(monkeypatch):
    """Liger's per-model patch rebinds names of transformers' modeling module for every later model. Liger needs Triton
    on a GPU, so a stand-in with the same entry points and the same global rebinding checks seqpar's scoping on CPU."""
    import sys
    import types

    from transformers.models.llama import modeling_llama

    from seqpar.runtime.memory.fused import apply_fused_ops

    plain_rope, plain_norm = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", plain_rope)  # undone after the test
    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", plain_norm)
    calls = []

    def fake_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls.append(q.device.type)
        return plain_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    def apply_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=None):
        modeling_llama.apply_rotary_pos_emb = fake_rope
        modeling_llama.LlamaRMSNorm = type("FakeLigerRMSNorm", (plain_norm,), {})
        norm = model.model.norm
        norm.forward = types.MethodType(type(norm).forward, norm)  # an instance-level rebinding, as Liger's

    def apply_to_instance(model, **kwargs):
        apply_to_llama(model=model, **kwargs)

    pkg, tr, mp = (
        types.ModuleType(n) for n in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.monkey_patch")
    )
    tr._apply_liger_kernel_to_instance, mp.MODEL_TYPE_TO_APPLY_LIGER_FN = apply_to_instance, {"llama": apply_to_llama}
    for name, mod in (("liger_kernel", pkg), ("liger_kernel.transformers", tr), ("liger_kernel.transformers.monkey_patch", mp)):
        monkeypatch.setitem(sys.modules, name, mod)

    model = _llama()
    reference = copy.deepcopy(model)
    line = apply_fused_ops(model, "liger", "cuda")
    assert line == "fused ops: liger (llama: rms_norm, rope, swiglu)"
    assert modeling_llama.LlamaRMSNorm is plain_norm  # later models get transformers' own class
    assert "forward" in vars(model.model.norm)  # the instance keeps its patch
    ids = torch.randint(0, 128, (1, 20))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss)
    assert calls == []  # CPU tensors never reach the CUDA-only kernel
    assert modeling_llama.apply_rotary_pos_emb._seqpar_plain is plain_rope
    apply_fused_ops(copy.deepcopy(reference), "liger", "cuda")  # a second model: still one dispatcher over the plain one
    assert modeling_llama.apply_rotary_pos_emb._seqpar_plain is plain_rope


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
@pytest.mark.parametrize("tile", [1, 7, None])
def test_tiled_norms_equal_untiled_in_float64(checkpointing, tile):
    """tile_norms (with tile_mlp, as the runtime applies them): every decoder norm and the final one run in tiles; loss
    and every gradient equal the untiled model's (float64 weights; the norm's own fp32 upcast runs per tile the same)."""
    from seqpar.runtime.memory.tiled_mlp import norm_modules, tile_norms

    ref = _llama()
    tiled = copy.deepcopy(ref)
    _enable(ref, checkpointing)
    _enable(tiled, checkpointing)
    tile_mlp(tiled, tile=tile)
    assert tile_norms(tiled, tile=tile) == 2 * 2 + 1 == len(norm_modules(tiled))
    _agree(ref, tiled, tile, rtol=1e-6, atol=1e-12)  # fp32 inside the norm: its weight's sums reorder


def test_tiled_norms_under_lora_train_the_adapters_alike():
    """A frozen base with peft's adapters (the norms' weights frozen too): tiled norms give the untiled loss and adapter
    gradients."""
    pytest.importorskip("peft")
    from seqpar.plan.specs import LoraSpec
    from seqpar.runtime.hf.lora import apply_lora
    from seqpar.runtime.memory.tiled_mlp import tile_norms

    ref = _llama().float()
    tiled = copy.deepcopy(ref)
    ref, tiled = (apply_lora(m, LoraSpec(rank=4), seed=0) for m in (ref, tiled))
    tile_mlp(tiled, tile=8)
    assert tile_norms(tiled, tile=8) == 5
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    ref.train(), tiled.train()
    (want_loss, want), (got_loss, got) = (_trained_grads(m, ids) for m in (ref, tiled))
    assert got and all("lora_" in n for n in got)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("stride", [1, 2])
def test_a_tiled_mlp_over_a_4bit_base_trains_the_adapters_alike(stride):
    """QLoRA: the MLP's linear layers are bitsandbytes' Linear4bit, whose frozen weight (Params4bit) carries its
    quantization state beside its data. The tiled backward must hand that weight to the tile's recomputation as it is
    (a detached copy has no quant_state: "ValueError: quant_state is required", what a 70B QLoRA plan with a tiled MLP
    hit on an H100). Tiled, with checkpoint offload and its stride, the loss and adapter gradients are the untiled,
    uncheckpointed model's (bitsandbytes' CPU backend; float32)."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from seqpar.plan.specs import LoraSpec
    from seqpar.runtime.hf.lora import apply_lora

    base = _llama(layers=4).float()
    ref, tiled = copy.deepcopy(base), copy.deepcopy(base)
    for m in (ref, tiled):  # in place, as the trainer does: the adapters in the model, seqpar.apply on the model
        apply_lora(m, LoraSpec(rank=4, base_dtype="nf4"), seed=0)
        torch.manual_seed(5)  # B away from peft's zeros, alike in both: every adapter then has a gradient to compare
        for n, p in m.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
    assert sum(type(m).__name__ == "Linear4bit" for m in tiled.modules()) == 4 * 7
    apply(tiled, "data_parallel", checkpointing="offload", offload_stride=stride)
    assert tile_mlp(tiled, tile=8) == 4
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    ref.train(), tiled.train()
    (want_loss, want), (got_loss, got) = (_trained_grads(m, ids) for m in (ref, tiled))
    assert got.keys() == want.keys() and len(got) == 4 * 7 * 2
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for name, g in want.items():
        scale = float(g.abs().max())  # fp32 sums over tiles in another order: round-off against the largest entry
        assert scale > 0, name
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}")


def _trained_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tiled_norm_saves_its_input_and_holds_one_tile_of_temporaries(dtype):
    """What the memory model gives a tiled norm (seqpar.advisor.cost.memory): forward saves its input alone (r bytes
    per element, not the fp32 copy and the product the weight takes); backward allocates dX and one tile's five fp32
    temporaries (NORM_BACKWARD_BYTES per element of the tile) with the tile's recomputed output and gradients (at most 3
    r more), replayed allocation by allocation under the profiler."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from seqpar.advisor.cost.memory import NORM_BACKWARD_BYTES
    from seqpar.runtime.memory.tiled_mlp import tile_norms

    t, h, tile = 2048, 256, 256
    r = torch.empty((), dtype=dtype).element_size()

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"hidden_size": h})()
            self.norm = LlamaRMSNorm(h).to(dtype)

    m = Holder()
    assert tile_norms(m, tile=tile) == 1
    x = torch.randn(1, t, h, dtype=dtype, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        y = m.norm(x)
    assert sum(s.numel() * s.element_size() for s in saved if s.dim() == 3) == r * t * h  # its input alone
    grad = torch.randn_like(y)
    peak, _ = allocation_peak(lambda: y.backward(grad))
    assert r * t * h + NORM_BACKWARD_BYTES * tile * h < peak <= 1.01 * (r * t * h + (NORM_BACKWARD_BYTES + 3 * r) * tile * h)
    untiled = LlamaRMSNorm(h).to(dtype)
    y = untiled(x)
    whole, _ = allocation_peak(lambda: y.backward(grad))
    assert whole > NORM_BACKWARD_BYTES * t * h > 2.5 * peak  # the whole sequence's temporaries at once


def test_a_lora_model_saves_what_the_cost_model_counts_tiled_or_not():
    """A bf16 Llama with peft's bf16 adapters (no dropout) and no checkpointing: what autograd saves during forward
    (saved-tensor hooks, parameters excluded, each tensor once) drops from the untiled MLP to the tiled one by what the
    cost model's LoRA block counts (seqpar.advisor.cost.lora.saved_bytes_per_token: the tiled MLP keeps its input, the
    post-attention norm's output, which the frozen base saves nowhere else), and again with the norms tiled (each keeps
    its input instead of its fp32 copy and rstd, the final norm too) by the model's count but for what it over- and
    under-counts."""
    pytest.importorskip("peft")
    from seqpar.advisor.cost import lora as lc
    from seqpar.plan.specs import LoraSpec, ModelSpec, Strategy, Workload
    from seqpar.runtime.hf.lora import apply_lora
    from seqpar.runtime.memory.tiled_mlp import tile_norms

    inter, layers, b, s = 176, 2, 2, 64
    spec = ModelSpec(
        name="t", num_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=inter, vocab_size=128,
    )  # fmt: skip
    lora = LoraSpec(rank=4)
    lo = lc.regime(Workload(model=spec, seq_len=s, optimizer="adamw-bf16", lora=lora), Strategy(mode="data_parallel"))
    assert (lo.compute, lo.copies) == (2, False)  # bf16 adapters sharing the base's tensors
    models = []
    for tiles in ("none", "mlp", "mlp+norms"):
        m = _enable(_llama(layers, inter).to(torch.bfloat16), "none")
        if tiles != "none":
            tile_mlp(m, tile=16)
        if tiles == "mlp+norms":
            tile_norms(m, tile=16)
        models.append(apply_lora(m, lora, seed=0, adapter_dtype=torch.bfloat16))
    ids = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(3))
    plain, tiled, norms = (_saved_bytes(m, ids, once=True) / (b * s) for m in models)
    # what a layer that is not recomputed keeps (here every layer): its saved tensors, and with the norms tiled the
    # layer input the input norm keeps (counted where it is kept: kept_bytes_per_token's policy none)
    from seqpar.advisor.cost.memory import kept_bytes_per_token

    per_layer = {
        k: kept_bytes_per_token(
            spec, "bf16", Strategy(mode="data_parallel", tiled_mlp=k != "none"), 2, "none", lo, tiled_norms=k == "mlp+norms"
        )
        for k in ("none", "mlp", "mlp+norms")
    }
    assert per_layer["mlp+norms"] == lc.saved_bytes_per_token(spec, lo, tiled_mlp=True, tiled_norms=True) + 2 * 64
    assert plain - tiled == pytest.approx(layers * (per_layer["none"] - per_layer["mlp"]))
    # every norm saves its fp32 copy and rstd whole, its bf16 input tiled; but layer 0's input norm saves nothing either
    # way (under a frozen base its input needs no gradient), and the final norm saves too
    saving = 2 * layers
    assert tiled - norms == pytest.approx(saving * ((4 - 2) * 64 + 4))
    model = layers * (per_layer["mlp"] - per_layer["mlp+norms"]) + (4 - 2) * 64  # every layer's two and the final one
    # the model's drop against the measured one: it counts layer 0's input norm too (one norm's fp32 copy against its
    # input, over), and not the per-token fp32 rstd of the others (4 bytes each, under)
    assert model - (tiled - norms) == pytest.approx((4 - 2) * 64 - saving * 4)
