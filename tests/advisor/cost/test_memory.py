"""Memory model: exact model-state bytes per ZeRO stage, saved-tensor bytes, loss terms, ordering properties (hand-computed)."""

import pytest

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.memory import estimate_memory, kept_bytes_per_token, model_states, precision, saved_bytes_per_token
from seqpar.advisor.cost.predict import predict
from seqpar.plan.specs import Strategy, Workload
from seqpar.plan.units import GIB
from seqpar.profiles import get_model

from seqpar_testing.advisor import TINY
from seqpar_testing.memory import allocation_peak

C = load_coefficients()


def test_tiny_param_count_by_hand():
    # attention: q 64*64 + k,v 2*64*32 + o 64*64 = 12288; SwiGLU 3*64*128 = 24576; two norms 128 -> 36992 per layer
    assert TINY.layer_params == 36992
    assert TINY.num_params == 2 * 36992 + 2 * 256 * 64 + 64 == 106816


PSI = 106816


@pytest.mark.parametrize(
    "sharding,optimizer,expected",
    [
        # ZeRO paper (Rajbhandari et al. 2020): plain 16 Psi, ZeRO-2 2Psi + 14Psi/N, ZeRO-3 16Psi/N (+ two gathered layers)
        ("ddp", "adamw", {"weights": 2 * PSI, "gradients": 2 * PSI, "optimizer_states": 12 * PSI}),
        ("zero2", "adamw", {"weights": 2 * PSI, "gradients": 2 * PSI / 4, "optimizer_states": 12 * PSI / 4}),
        (
            "zero3",
            "adamw",
            {
                "weights": 2 * PSI / 4,
                "gradients": 2 * PSI / 4,
                "optimizer_states": 12 * PSI / 4,
                "gathered_params": 2 * 36992 * 2,
            },
        ),
        (
            "fsdp",
            "adamw-bf16",
            {"weights": 2 * PSI / 4, "gradients": 2 * PSI / 4, "optimizer_states": 4 * PSI / 4, "gathered_params": 2 * 36992 * 2},
        ),
        ("zero3_offload", "adamw", {"weights": 0, "gradients": 0, "optimizer_states": 0, "gathered_params": 2 * 36992 * 2}),
        ("ddp", "none", {"weights": 2 * PSI, "gradients": 2 * PSI, "optimizer_states": 0}),
    ],
)
def test_model_states_per_zero_stage(sharding, optimizer, expected):
    assert model_states(TINY, sharding, optimizer, "bf16", 4) == pytest.approx(expected)


def test_zero_totals_match_paper():
    s2 = model_states(TINY, "zero2", "adamw", "bf16", 8)
    assert sum(s2.values()) == pytest.approx(2 * PSI + 14 * PSI / 8)
    s3 = model_states(TINY, "zero3", "adamw", "bf16", 8)
    assert s3["weights"] + s3["gradients"] + s3["optimizer_states"] == pytest.approx(16 * PSI / 8)


def test_saved_bytes_per_token_by_hand():
    # norms 2*(4+2*2)*64 = 1024; attention q, out 2*2*4*16 + k, v 2*2*2*16 + lse 4*4 = 256 + 128 + 16; SwiGLU 4*2*128 = 1024
    assert saved_bytes_per_token(TINY, "bf16") == 1024 + 256 + 128 + 16 + 1024
    assert kept_bytes_per_token(TINY, "bf16", Strategy(mode="data_parallel", checkpointing="full")) == 2 * 64
    # selective (LightSeq): the layer input + attention's output (a*d = 64 values, bf16) + its fp32 lse (4 heads)
    assert (
        kept_bytes_per_token(TINY, "bf16", Strategy(mode="data_parallel", checkpointing="selective")) == 2 * 64 + 2 * 64 + 4 * 4
    )
    assert (
        kept_bytes_per_token(TINY, "bf16", Strategy(mode="data_parallel", checkpointing="selective"), residual=4)
        == 4 * 64 + 2 * 64 + 16
    )
    # autocast over fp32 parameters: fp32 residual stream; each norm saves 4h + 4h + 4h + the bf16 cast 2h
    assert saved_bytes_per_token(TINY, "bf16", residual=4) == 2 * (4 + 8 + 2) * 64 + 256 + 128 + 16 + 1024
    assert kept_bytes_per_token(TINY, "bf16", Strategy(mode="data_parallel", checkpointing="full"), residual=4) == 4 * 64
    assert kept_bytes_per_token(TINY, "bf16", Strategy(mode="data_parallel", checkpointing="offload")) == 0


def test_llama7b_h200_64k_loss_phase_terms():
    """The anchor configuration: Llama-2-7B, 64K, one H200, full checkpointing, DDP, optimizer none, hf loss.

    With optimizer none seqpar.runtime keeps bf16 parameters (engine.compute_dtype: nothing to update, so no fp32
    master), so the peak is in the loss: bf16 weights, bf16 layer inputs, the fp32 logits' backward."""
    m, cl = get_model("llama-2-7b"), cluster_from_flags("h200", 1)
    p = predict(
        Workload(model=m, seq_len=65536, optimizer="none"),
        cl,
        Strategy(mode="data_parallel", checkpointing="full", sharding="ddp", loss_impl="hf"),
    )
    b = p.memory_breakdown_gib
    assert p.peak_phase == "loss"
    assert b["checkpointed_activations"] == pytest.approx(32 * 65536 * 4096 * 2 / GIB)  # 16 GiB of bf16 layer inputs
    assert b.get("autocast_weight_cache", 0.0) == 0.0  # no autocast: the weights already are bf16
    # no autocast, so the loss's backward is the peak: saved log_softmax output + incoming fp32 grad + result (12 B)
    assert b["loss_fp32_logits"] == pytest.approx(65536 * 32000 * 12 / GIB, abs=1e-3)
    assert b["gradients"] == pytest.approx(32000 * 4096 * 2 / GIB, abs=1e-3)  # the head's bf16 gradient appears first
    assert b["weights"] == pytest.approx(m.num_params * 2 / GIB, abs=1e-3)
    assert sum(b.values()) == pytest.approx(p.peak_memory_gib, abs=0.01)
    assert not p.oom_risk and p.reserved_memory_gib > p.peak_memory_gib


def test_precision_regimes_follow_the_runtime():
    m = get_model("llama-2-7b")
    w = Workload(model=m, seq_len=4096)
    assert precision(w, Strategy(mode="data_parallel", sharding="ddp")).regime.startswith("fp32 parameters, autocast")
    assert precision(w, Strategy(mode="data_parallel", sharding="fsdp")).residual == 2
    assert precision(w.model_copy(update={"optimizer": "adamw-bf16"}), Strategy(mode="data_parallel")).weight == 2
    assert precision(w, Strategy(mode="data_parallel"), accelerator="cpu").compute == 4
    none = precision(w.model_copy(update={"optimizer": "none"}), Strategy(mode="data_parallel", sharding="ddp"))
    assert (none.weight, none.grad, none.optim, none.residual, none.autocast_cache) == (2, 2, 0, 2, False)
    # DDP + adamw under autocast: 4 + 4 + 8 = 16 bytes per parameter, the same total as the ZeRO paper's 2 + 2 + 12
    st = model_states(m, "ddp", "adamw", "bf16", 1, precision(w, Strategy(mode="data_parallel", sharding="ddp")))
    assert st == {"weights": 4 * m.num_params, "gradients": 4 * m.num_params, "optimizer_states": 8 * m.num_params}


def test_chunked_loss_is_smaller_than_hf():
    m, cl = get_model("llama-3.2-1b"), cluster_from_flags("h200", 1)
    w = Workload(model=m, seq_len=131072, optimizer="none")
    hf = estimate_memory(w, cl, Strategy(mode="data_parallel", loss_impl="hf"), C)
    ch = estimate_memory(w, cl, Strategy(mode="data_parallel", loss_impl="chunked"), C)
    assert ch.peak_bytes < hf.peak_bytes - 100 * GIB  # 128K x 128K vocab in fp32 alone is > 60 GB


MODES = [
    ("data_parallel", 1, 1),
    ("zigzag_ring_attn", 8, 1),
    ("dist_flash_attn", 8, 1),
    ("ulysses_attn", 8, 1),
    ("usp_attn", 8, 4),
]


@pytest.mark.parametrize("mode,sp,u", MODES)
@pytest.mark.parametrize("ck", ["none", "full", "selective", "offload"])
def test_memory_never_decreases_with_seq_len(mode, sp, u, ck):
    m, cl = get_model("llama-2-7b"), cluster_from_flags("a100", 8)
    s = Strategy(
        mode=mode,
        sp_degree=sp,
        dp_degree=8 // sp,
        ulysses_degree=u if mode == "usp_attn" else 1,
        ring_degree=sp // u if mode == "usp_attn" else 1,
        checkpointing=ck,
        sharding="zero3",
    )
    peaks = [estimate_memory(Workload(model=m, seq_len=n), cl, s, C).peak_bytes for n in (4096, 16384, 65536, 262144, 1048576)]
    assert peaks == sorted(peaks)


@pytest.mark.parametrize("mode", ["zigzag_ring_attn", "ulysses_attn", "dist_flash_attn"])
@pytest.mark.parametrize("ck", ["none", "full"])
def test_more_sp_degree_never_raises_memory(mode, ck):
    m, cl = get_model("llama-2-7b"), cluster_from_flags("a100", 8)
    w = Workload(model=m, seq_len=131072)
    peaks = []
    for sp in (2, 4, 8):
        s = Strategy(mode=mode, sp_degree=sp, dp_degree=8 // sp, checkpointing=ck, sharding="zero3")
        e = estimate_memory(w, cl, s, C)
        states = sum(v for k, v in model_states(m, "zero3", "adamw", "bf16", 8).items())
        peaks.append((e.peak_bytes, e.peak_bytes - states))
    assert [p for p, _ in peaks] == sorted([p for p, _ in peaks], reverse=True)
    assert [a for _, a in peaks] == sorted([a for _, a in peaks], reverse=True)


def test_host_ram_for_offload():
    m, cl = get_model("llama-2-7b"), cluster_from_flags("a100", 8, host_ram_gib=64)
    e = estimate_memory(
        Workload(model=m, seq_len=65536), cl, Strategy(mode="zigzag_ring_attn", sp_degree=8, sharding="zero3_offload"), C
    )
    # 8 CUDA processes, then bf16 params, fp32 grads and Adam on the host
    assert e.host_bytes == pytest.approx(8 * C.host_process_gib * GIB + m.num_params * (2 + 4 + 12))
    assert not e.fits and "host RAM" in e.reason


def test_host_ram_against_measured_rss_of_h200_runs():
    """The H200 run reports carry each rank's peak host RSS: the model may over-predict (the 1B's process is smaller than the
    7B's) but must not under-predict by more than 5%, and it is tight where host RAM bounds the length (7B, 384K, offload:
    96 GiB of layer inputs)."""
    import json

    from seqpar.advisor.cost.measurements import MEASUREMENTS_DIR, row_from_report

    seen = 0
    for f in sorted(MEASUREMENTS_DIR.glob("h200_*.json")):
        rep = json.loads(f.read_text())
        r = row_from_report(rep, f.name)
        rss = max(x["peak_rss_gib"] for x in rep["per_rank"]) * GIB
        host = estimate_memory(r.workload, r.cluster, r.strategy, C).host_bytes
        assert host >= 0.95 * rss, (f.name, host / GIB, rss / GIB)
        if "384k" in f.name:
            assert host == pytest.approx(rss, rel=0.05)
        seen += 1
    assert seen >= 20


def test_cpu_clusters_count_no_process_base_on_the_host():
    m = get_model("tiny")
    cl = cluster_from_flags("a100", 2, host_ram_gib=64)
    cpu = cl.model_copy(update={"accelerator": "cpu"})
    w, s = Workload(model=m, seq_len=256), Strategy(mode="data_parallel", sharding="ddp")
    assert estimate_memory(w, cl, s, C).host_bytes == pytest.approx(2 * C.host_process_gib * GIB)
    assert estimate_memory(w, cpu, s, C).host_bytes == 0.0


def test_selective_keeps_attention_output_and_lse_per_layer():
    """Llama-2-7B, 64K, one H200, optimizer none (bf16 everywhere): selective adds 32 layers x 64K tokens x
    (4096 bf16 output values + 32 fp32 lse) = 32 * 65536 * 8320 bytes = 16.25 GiB to the forward peak of full."""
    m, cl = get_model("llama-2-7b"), cluster_from_flags("h200", 1)
    w = Workload(model=m, seq_len=65536, optimizer="none")
    full, sel = (
        estimate_memory(w, cl, Strategy(mode="data_parallel", checkpointing=ck, sharding="ddp"), C)
        for ck in ("full", "selective")
    )
    extra = 32 * 65536 * (2 * 4096 + 4 * 32)
    assert extra == 16.25 * GIB
    assert sel.phases["forward"] - full.phases["forward"] == pytest.approx(extra)
    assert sel.peak_bytes > full.peak_bytes


@pytest.mark.parametrize("dtype_bytes, trains", [(2, True), (2, False), (4, True), (4, False)])
def test_an_unfused_norm_backward_allocates_what_the_model_counts(dtype_bytes, trains):
    """transformers' LlamaRMSNorm run forward, then backward under torch's profiler (allocations and frees replayed in
    time order): at the backward's peak it holds five fp32 tensors of the hidden state's shape beyond its saved tensors
    and the incoming gradient, NORM_BACKWARD_BYTES per element (the moment the memory model gives an unfused norm)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from seqpar.advisor.cost.memory import NORM_BACKWARD_BYTES

    t, h = 512, 256
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    norm = LlamaRMSNorm(h).to(dtype)
    norm.weight.requires_grad_(trains)
    x = torch.randn(1, t, h, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, t, h, dtype=dtype)
    y = norm(x)
    peak, live = allocation_peak(lambda: y.backward(grad))
    assert peak / (t * h) == pytest.approx(NORM_BACKWARD_BYTES, abs=0.05)
    assert sorted(size for size, _ in live if size >= t * h) == [4 * t * h] * 5  # five fp32 hidden-sized tensors


def test_the_norm_moment_prices_a_tiled_layer_above_its_mlp_and_attention():
    """With a tiled MLP the unfused norm's backward is the layer's largest moment where the norms run whole (another
    tool's TiledMLP, or seqpar's runs before it tiled them): the residual stream's gradient and the norm's five fp32
    temporaries. Under Liger it is gone; in seqpar's runtime (its norms tiled) one tile's temporaries are left, below
    attention's moment here."""
    from seqpar.advisor.cost.memory import NORM_BACKWARD_BYTES, attention_backward_workspace, mlp_tile_tokens

    m = get_model("llama-3.2-1b")
    w, cl = Workload(model=m, seq_len=262144, optimizer="adamw"), cluster_from_flags("h100", 1)
    t, h = 262144, m.hidden_size
    s = _dp(checkpointing="selective", tiled_mlp=True)
    whole = estimate_memory(w, cl, s, C, margin=False, norms_tiled=False)
    flow = whole.phase_terms["backward"]["gradient_flow"]
    r = precision(w, s).residual  # fp32 parameters under autocast: 4
    assert flow == pytest.approx(t * (r + NORM_BACKWARD_BYTES) * h)

    p, d = 2, m.head_dim  # attention's backward: dq, dk, dv and cuDNN's workspace
    attn = t * 2 * r * h + t * p * (m.num_attention_heads + 2 * m.num_key_value_heads) * d
    attn += attention_backward_workspace(m, t, cl, C, 1)
    tiled = t * 3 * r * h + mlp_tile_tokens(t, h) * (NORM_BACKWARD_BYTES + 3 * r) * h
    assert tiled < attn < flow
    liger = estimate_memory(w, cl, _dp(checkpointing="selective", tiled_mlp=True, fused_ops="liger"), C, margin=False)
    seqpar = estimate_memory(w, cl, s, C, margin=False)
    assert liger.phase_terms["backward"]["gradient_flow"] == pytest.approx(attn)
    assert seqpar.phase_terms["backward"]["gradient_flow"] == pytest.approx(attn)
    # and what the tiled norms save less, per norm of the rebuilt layer: the fp32 copy (their input instead of the
    # product the weight takes, both r bytes); the input norm's input is the layer input, held by the checkpoint
    rebuilt = whole.phase_terms["backward"]["layer_recompute"] - seqpar.phase_terms["backward"]["layer_recompute"]
    assert rebuilt == pytest.approx(2 * 4 * h * t + r * h * t)


def _dp(**kw) -> Strategy:
    return Strategy(mode="data_parallel", **kw)
