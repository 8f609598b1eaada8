"""LoRA / QLoRA in the cost model (seqpar.advisor.cost.lora): adapter counts against peft's own, NF4 bytes against
bitsandbytes' layout, model states and FLOPs by hand on a tiny shape, saved tensors against what torch saves for a
transformers Llama under peft, and what the trade-offs become on an H100."""

import pytest

from seqpar.advisor.cluster import cluster_from_flags, resolve_cluster
from seqpar.advisor.cost import lora as lc
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.memory import estimate_memory, saved_bytes_per_token
from seqpar.advisor.cost.throughput import estimate_time, linear_flops_per_token
from seqpar.advisor.search import max_seq_len
from seqpar.plan.flops import layer_matmul_params, matmul_params, model_flops_per_sequence
from seqpar.plan.lora import adapter_params, adapter_params_per_layer, lora_text
from seqpar.plan.specs import LORA_ALL_LINEAR, LoraSpec, Strategy, Workload
from seqpar.plan.units import GIB
from seqpar.profiles import get_model

from seqpar_testing.advisor import TINY

C = load_coefficients()
ALL = LoraSpec(rank=8)
QV = LoraSpec(rank=8, target_modules=["q_proj", "v_proj"])
DDP = Strategy(mode="data_parallel", sharding="ddp")


def regime(spec=ALL, s=DDP, dtype="bf16", optimizer="adamw", accelerator="cuda", model=TINY):
    return lc.regime(Workload(model=model, seq_len=1024, dtype=dtype, optimizer=optimizer, lora=spec), s, accelerator)


# --------------------------------------------------------------------------------------------- sizes


def test_adapter_params_by_hand():
    # r (in + out): q 8 (64 + 64), k and v 8 (64 + 32), o 8 (64 + 64), gate and up 8 (64 + 128), down 8 (128 + 64)
    per_layer = 8 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert adapter_params_per_layer(TINY, ALL) == per_layer == 8192
    assert adapter_params(TINY, ALL) == 2 * per_layer
    assert adapter_params(TINY, QV) == 2 * 8 * (128 + 96)
    assert lora_text(ALL) == "LoRA r=8 on all 7 linear layers (bf16 base, alpha 32)"
    qlora = LoraSpec(rank=16, alpha=16, dropout=0.05, target_modules=["v_proj", "q_proj"], base_dtype="nf4")
    assert lora_text(qlora) == "QLoRA r=16 on q_proj v_proj (4-bit NF4 base, alpha 16, dropout 0.05)"


@pytest.mark.parametrize("targets", [list(LORA_ALL_LINEAR), ["q_proj", "v_proj"], ["o_proj", "down_proj", "k_proj"]])
@pytest.mark.parametrize("rank", [1, 8])
def test_adapter_params_match_peft(targets, rank):
    """peft's own count on a transformers Llama of TINY's shapes (peft 0.21.2 get_nb_trainable_parameters)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.hidden_size,
        intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_attention_heads,
        num_key_value_heads=TINY.num_key_value_heads,
        head_dim=TINY.head_dim,
    )
    model = transformers.LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == TINY.num_params
    target = "all-linear" if targets == list(LORA_ALL_LINEAR) else targets  # peft's word for all of them
    pm = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=target))
    trainable, total = pm.get_nb_trainable_parameters()
    spec = LoraSpec(rank=rank, target_modules=targets)
    assert trainable == adapter_params(TINY, spec)
    assert total == TINY.num_params + adapter_params(TINY, spec)


def test_nf4_bytes_by_hand():
    """bitsandbytes 0.50.2 functional.quantize_4bit(blocksize=64, compress_statistics=True, quant_type="nf4"): 4-bit codes
    two per byte, a uint8 absmax per block of 64, an fp32 absmax per 256 of those (quantize_blockwise(blocksize=256)),
    and per matrix the fp32 offset, the 256-entry fp32 code (quantize_blockwise copies it) and the 16-entry NF4 code."""
    n = 256 * 192  # 768 blocks of 64 -> 3 blocks of 256 absmax values
    assert lc.nf4_bytes(n) == n / 2 + 768 + 3 * 4 + 4 + 1024 + 64 == 26448
    # the QLoRA paper's 0.127 bits per weight of constants (8/64 + 32/(64*256)) on top of 4 bits, for a large matrix
    big = 4096 * 14336
    assert (lc.nf4_bytes(big) - lc.NF4_PER_MATRIX) / big == pytest.approx(0.5 + (8 / 64 + 32 / (64 * 256)) / 8)


@pytest.mark.parametrize("shape", [(256, 192), (64, 1000), (1000, 333)])
def test_nf4_bytes_match_bitsandbytes(shape):
    """The bytes bitsandbytes' quantize_4bit keeps for one weight matrix, counted tensor by tensor."""
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(*shape, dtype=torch.bfloat16)
    packed, st = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    parts = [packed, st.absmax, st.code, st.offset, st.state2.absmax, st.state2.code]
    assert sum(t.numel() * t.element_size() for t in parts) == lc.nf4_bytes(w.numel())


# --------------------------------------------------------------------------------------------- regime and states


@pytest.mark.parametrize(
    "sharding,optimizer,accelerator,expected",
    [
        # (adapter, grad, optim bytes per adapter parameter, the adapters cast their input)
        ("ddp", "adamw", "cuda", (4, 4, 8, True)),  # fp32 adapters (peft's default) under autocast
        ("fsdp", "adamw", "cuda", (4, 4, 8, False)),  # FSDP2 computes the gathered adapters in bf16
        ("zero2", "adamw", "cuda", (2, 2, 12, False)),  # DeepSpeed bf16 + fp32 master and moments
        ("ddp", "adamw-bf16", "cuda", (2, 2, 4, False)),
        ("ddp", "none", "cuda", (2, 2, 0, False)),
        ("ddp", "adamw", "cpu", (4, 4, 8, False)),  # fp32 throughout on gloo ranks
    ],
)
def test_regime_follows_the_sharding(sharding, optimizer, accelerator, expected):
    lo = regime(s=Strategy(mode="data_parallel", sharding=sharding), optimizer=optimizer, accelerator=accelerator)
    assert (lo.adapter, lo.grad, lo.optim, lo.copies) == expected
    assert lo.base == (4 if accelerator == "cpu" else 2) and lo.mask == (1 if accelerator == "cuda" else 4)
    assert regime(spec=None) is None


def test_model_states_by_hand():
    """A frozen bf16 base: no gradients, no optimizer state, no master; the adapters' states sharded as ZeRO shards a
    full fine-tuning's; ZeRO-3 shards the base too and gathers two layers (base + adapters, bf16)."""
    a, psi = adapter_params(TINY, ALL), TINY.num_params
    lo = regime()
    assert lc.model_states(TINY, lo, "ddp", 4) == {
        "weights": 2 * psi,
        "adapter_weights": 4 * a,
        "gradients": 4 * a,
        "optimizer_states": 8 * a,
    }
    z2 = regime(s=Strategy(mode="data_parallel", sharding="zero2"))
    assert lc.model_states(TINY, z2, "zero2", 4) == {
        "weights": 2 * psi,
        "adapter_weights": 2 * a,
        "gradients": 2 * a / 4,
        "optimizer_states": 12 * a / 4,
    }
    z3 = lc.model_states(TINY, z2, "zero3", 4)
    assert z3 == pytest.approx(
        {
            "weights": 2 * psi / 4,
            "adapter_weights": 2 * a / 4,
            "gradients": 2 * a / 4,
            "optimizer_states": 12 * a / 4,
            "gathered_params": 2 * (TINY.layer_params + adapter_params_per_layer(TINY, ALL)) * 2,
        }
    )


def test_nf4_base_by_hand():
    """QLoRA: each decoder linear in NF4, the embedding, LM head and norms in bf16."""
    lo = regime(spec=LoraSpec(rank=8, base_dtype="nf4"))
    shapes = [64 * 64, 64 * 32, 64 * 32, 64 * 64, 64 * 128, 64 * 128, 128 * 64]
    layer = sum(lc.nf4_bytes(n) for n in shapes) + 2 * 64 * 2  # + the two norms' weights in bf16
    assert lc.base_layer_bytes(TINY, lo) == layer
    assert lc.base_bytes(TINY, lo) == 2 * layer + (2 * 256 * 64 + 64) * 2  # + embedding, LM head, final norm
    assert lc.dequant_buffer_bytes(TINY, lo) == 64 * 128 * 2  # the largest matrix (h x I) in bf16
    assert lc.dequant_buffer_bytes(TINY, regime()) == 0


# --------------------------------------------------------------------------------------------- activations


def test_saved_bytes_by_hand():
    """The frozen block: norms' fp32 inputs 2*4h = 512, attention q, out 2*2*64 + k, v 2*2*32 + lse 16 = 400, SwiGLU gate,
    silu, up 3*2*128 = 768; the adapters: DDP's fp32 adapters under autocast keep their own bf16 copy of each input
    (q, k, v, o, gate, up: 64 each, down 128) and a rank-8 intermediate each."""
    frozen = 512 + 400 + 768
    copies = 2 * (6 * 64 + 128) + 7 * 2 * 8
    assert lc.saved_bytes_per_token(TINY, regime()) == frozen + copies
    # bf16 adapters share the base's tensors: the q/k/v input, the gate/up input and the SwiGLU product once each
    shared = 2 * (64 + 64 + 128) + 7 * 2 * 8
    assert lc.saved_bytes_per_token(TINY, regime(s=Strategy(mode="data_parallel", sharding="fsdp"))) == frozen + shared
    # dropout: every adapter its own dropped copy and a one-byte mask (CUDA's native_dropout)
    drop = regime(spec=LoraSpec(rank=8, dropout=0.1), s=Strategy(mode="data_parallel", sharding="fsdp"))
    assert lc.saved_bytes_per_token(TINY, drop) == frozen + (2 + 1) * (6 * 64 + 128) + 7 * 2 * 8
    # a tiled MLP keeps its input alone (the post-attention norm's output), nothing of its adapters
    assert lc.saved_bytes_per_token(TINY, regime(), tiled_mlp=True) == 512 + 400 + 2 * 64 + 2 * 4 * 64 + 4 * 2 * 8
    # the memory model's entry point delegates
    assert saved_bytes_per_token(TINY, "bf16", adapters=regime()) == frozen + copies


def test_forward_transient_by_hand():
    """The widest targeted input (down_proj's, I = 128) cast to fp32 beside its bf16 copy: (4 + 2) x 128 per token; a
    tiled MLP leaves attention's widest (64); bf16 adapters without dropout hold nothing more."""
    assert lc.forward_transient_bytes(TINY, regime()) == 6 * 128
    assert lc.forward_transient_bytes(TINY, regime(), tiled_mlp=True) == 6 * 64
    assert lc.forward_transient_bytes(TINY, regime(s=Strategy(mode="data_parallel", sharding="fsdp"))) == 0


def _layer_saved_slope(torch, model, autocast: bool) -> float:
    """Bytes per token the second decoder layer saves for backward (the difference between two lengths, so what does
    not grow with the sequence drops out), parameters left out."""

    def at(seq: int) -> int:
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen, where = {}, [None]

        def pack(t):
            st = t.untyped_storage()
            if where[0] == 1 and st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
            return t

        hooks = []
        for i, layer in enumerate(model.model.layers):
            hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
            hooks.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, None)))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(input_ids=ids, labels=ids)
        for h in hooks:
            h.remove()
        return sum(seen.values())

    return (at(256) - at(128)) / 128


@pytest.mark.parametrize("regime_name", ["cpu", "ddp"])
@pytest.mark.parametrize("targets", [list(LORA_ALL_LINEAR), ["q_proj", "v_proj"], ["o_proj", "down_proj"]])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_bytes_match_torch_under_peft(regime_name, targets, dropout):
    """What a transformers Llama (sdpa) saves for backward with peft's LoRA on a frozen base, minus what the full model
    saves, against the same difference in the model (RoPE's cos/sin and the norms' rstd, in neither, cancel). cpu: fp32
    throughout (seqpar's gloo ranks); ddp: a bf16 base with peft's fp32 adapters under autocast (CPU autocast stands in
    for CUDA's; its dropout mask is fp32 where CUDA keeps a bool, so the model is told 4 bytes)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    dtype = torch.float32 if regime_name == "cpu" else torch.bfloat16

    def model():
        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).to(dtype).train()

    full = _layer_saved_slope(torch, model(), False)
    lora_model = peft.get_peft_model(model(), peft.LoraConfig(r=8, target_modules=targets, lora_dropout=dropout))
    got = _layer_saved_slope(torch, lora_model.base_model.model, regime_name == "ddp")
    spec = LoraSpec(rank=8, target_modules=targets, dropout=dropout)
    lo = regime(
        spec=spec, dtype="fp32" if regime_name == "cpu" else "bf16", accelerator="cpu" if regime_name == "cpu" else "cuda"
    )
    if regime_name == "ddp":
        lo = lc.Lora(**{**lo.__dict__, "mask": 4})
    dtype_name = "fp32" if regime_name == "cpu" else "bf16"
    assert got - full == lc.saved_bytes_per_token(TINY, lo) - saved_bytes_per_token(TINY, dtype_name)


# --------------------------------------------------------------------------------------------- time


def test_linear_flops_by_hand():
    """The frozen base: 2 N forward + 2 N for its inputs' gradients (no weight gradients), 2 N_layer per recomputed
    layer; the adapters 6 per parameter and 2 more per recomputed one; the chunked loss's recomputed logits."""
    n, nl, a = matmul_params(TINY), layer_matmul_params(TINY), adapter_params_per_layer(TINY, ALL)
    lo = regime()
    got = lc.linear_flops_per_token(TINY, lo, "chunked", False, 2, n, nl)
    assert got == 4 * n + 2 * 2 * nl + 6 * 2 * a + 2 * 2 * a + 2 * 256 * 64
    full = linear_flops_per_token(TINY, "full", "chunked")
    assert full - got == 2 * n - 6 * 2 * a - 2 * 2 * a  # the base's weight gradients, less the adapters' work
    # MFU counts the same model FLOPs, recomputation left out
    assert model_flops_per_sequence(TINY, 100, lora=ALL) == pytest.approx(
        (4 * n + 6 * 2 * a) * 100 + 3.5 * 2 * 100 * 100 * 4 * 16 * 2
    )


def test_elementwise_bytes_by_hand():
    """Per targeted linear and forward: 5 p per output (scaled adapter output added to the base's), with copies the
    input's casts to fp32 and back, 2 (2 + 4) per input element."""
    outs, ins = 64 + 32 + 32 + 64 + 128 + 128 + 64, 6 * 64 + 128
    assert lc.elementwise_bytes_per_token(TINY, regime()) == 10 * outs + 12 * ins
    assert lc.elementwise_bytes_per_token(TINY, regime(s=Strategy(mode="data_parallel", sharding="fsdp"))) == 10 * outs


# --------------------------------------------------------------------------------------------- on an H100


M8 = get_model("llama-3.1-8b")


def test_frozen_base_on_one_h100():
    """Llama-3.1-8B at 64K on one H100: LoRA's model states are the bf16 base plus the adapters' 16 bytes per parameter
    (fp32 weights, gradients and two moments), not a full fine-tuning's 16 bytes per parameter of the whole model."""
    cl = cluster_from_flags("h100", 1)
    s = Strategy(mode="data_parallel", checkpointing="full", sharding="ddp", loss_impl="chunked")
    w = Workload(model=M8, seq_len=65536, lora=LoraSpec(rank=32))
    a = adapter_params(M8, w.lora)
    assert a == 83_886_080  # peft's count for Llama-3.1-8B, r 32, all linear layers (32 x 32 x 81920)
    mem = estimate_memory(w, cl, s, C)
    terms = mem.phase_terms["backward"]
    assert terms["weights"] == M8.num_params * 2
    assert terms["optimizer_states"] == 8 * a and terms["adapter_weights"] == 4 * a
    assert mem.phase_terms["optimizer"]["gradients"] == 4 * a
    full = estimate_memory(w.model_copy(update={"lora": None}), cl, s, C)
    assert full.phases["optimizer"] - mem.phases["optimizer"] > 100 * GIB  # 16 B/param of 8B against 2 B/param + adapters
    qlora = estimate_memory(w.model_copy(update={"lora": LoraSpec(rank=32, base_dtype="nf4")}), cl, s, C)
    assert mem.phase_terms["backward"]["weights"] - qlora.phase_terms["backward"]["weights"] == pytest.approx(
        M8.num_layers * sum((2 - 0.5) * i * o for i, o in lc.linear_shapes(M8).values()), rel=0.02
    )
    t_lora, t_full = estimate_time(w, cl, s, C), estimate_time(w.model_copy(update={"lora": None}), cl, s, C)
    assert t_lora.parts_s["linear_ideal"] < t_full.parts_s["linear_ideal"]  # no weight-gradient matmuls for the base
    assert "dequantize" not in t_lora.breakdown_s
    t_qlora = estimate_time(w.model_copy(update={"lora": LoraSpec(rank=32, base_dtype="nf4")}), cl, s, C)
    # every 4-bit weight read and written in bf16 in the forward, the recompute and the backward
    moved = 3 * M8.num_layers * lc.dequant_bytes_per_layer(M8, regime(spec=LoraSpec(rank=32, base_dtype="nf4"), model=M8))
    assert t_qlora.breakdown_s["dequantize"] == pytest.approx(
        moved / (cl.gpu.hbm_bandwidth_gb_s * 1e9 * C.elementwise_efficiency)
    )


def test_max_seq_len_llama31_8b_lora_one_h100():
    """Llama-3.1-8B, LoRA r=32 on all linear layers, bf16 base, one 80 GB H100 with a 125 GiB host: the longest
    trainable sequence the cost model finds (what `seqpar advise --max-seq-len` reports) is the longest that fits, one
    1024-token step more does not, and what stops it is the GPU in the recomputed layer's backward (its saved tensors and
    gradients at the full length), with the host RAM holding the offloaded layer inputs, most of it. Whatever the
    length, LoRA's states leave far more than a full fine-tuning's 16 bytes per parameter."""
    cl, _ = resolve_cluster("h100", 1, None, None, 125)
    spec = LoraSpec(rank=32)
    n, s = max_seq_len(M8, cl, ["data_parallel"], lora=spec)["data_parallel"]
    assert n >= 256 * 1024 and s.checkpointing == "offload" and s.tiled_mlp and s.loss_impl == "chunked"
    at = estimate_memory(Workload(model=M8, seq_len=n, lora=spec), cl, s, C)
    beyond = estimate_memory(Workload(model=M8, seq_len=n + 1024, lora=spec), cl, s, C)
    assert at.fits and not beyond.fits and beyond.peak_phase == "backward"
    assert "h100-sxm" in beyond.reason and not beyond.reason.startswith("host RAM")  # the GPU stops it, not the host
    assert {"layer_recompute", "gradient_flow"} <= set(beyond.breakdown)
    assert at.host_bytes > 0.75 * at.host_capacity_bytes  # the offloaded inputs fill most of the host
    full = max_seq_len(M8, cl, ["data_parallel"])["data_parallel"][0]
    assert full < n / 2


def test_max_seq_len_llama70b_qlora_one_h100():
    """A Llama-3.3-70B shape (Llama-3.1-70B's), QLoRA r=32 on all linear layers, one 80 GB H100: the 4-bit base fits
    and leaves room for a long sequence; a bf16 base does not fit at all."""
    m = get_model("llama-3.1-70b")
    cl, _ = resolve_cluster("h100", 1, None, None, 125)
    n, s = max_seq_len(m, cl, ["data_parallel"], lora=LoraSpec(rank=32, base_dtype="nf4"))["data_parallel"]
    assert n >= 64 * 1024 and s.sharding == "ddp"
    assert max_seq_len(m, cl, ["data_parallel"], lora=LoraSpec(rank=32))["data_parallel"][0] == 0
