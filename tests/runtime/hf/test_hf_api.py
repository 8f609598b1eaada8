"""One-process tests of the transformers integration: inputs and layouts, EasyContext compatibility, the loss paths and
every refusal. The multi-rank equality with plain transformers is tests/runtime/hf/test_hf.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import seqpar
from seqpar.plan.errors import SeqparError
from seqpar.runtime.hf import apply as hf
from seqpar.runtime.hf import easycontext

from seqpar_testing import case_id, world_ids
from seqpar_testing.hf import make_model

warnings.filterwarnings("ignore", category=FutureWarning)


# ------------------------------------------------------------------ EasyContext's documented layouts, written independently


def easycontext_local(x, algo, rank, world):
    """EasyContext's slicing: zigzag keeps chunks r and 2W-1-r of 2W; dist_flash and ulysses keep contiguous chunk r."""
    n = x.shape[1]
    if algo == "data_parallel":
        return x
    if algo == "zigzag_ring_attn":
        c = n // (2 * world)
        return torch.cat([x[:, rank * c : (rank + 1) * c], x[:, (2 * world - 1 - rank) * c : (2 * world - rank) * c]], 1)
    c = n // world
    return x[:, rank * c : (rank + 1) * c]


@pytest.mark.parametrize("world", [2, 4], ids=world_ids([2, 4]))
@pytest.mark.parametrize("algo", ["data_parallel", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn"])
def test_prepare_seq_parallel_inputs_matches_easycontext(algo, world):
    ids = torch.arange(100, 164)[None]  # (1, 64): EasyContext's micro-batch 1
    pos = torch.arange(64)[None]
    tgt = torch.arange(101, 165)[None]  # already shifted, as EasyContext's train.py builds it
    for rank in range(world):
        got = seqpar.prepare_seq_parallel_inputs(algo, ids, pos, tgt, rank, world, "cpu")
        assert set(got) == {"local_input_ids", "local_position_ids", "local_target_ids"}
        for key, full in (("local_input_ids", ids), ("local_position_ids", pos), ("local_target_ids", tgt)):
            assert torch.equal(got[key], easycontext_local(full, algo, rank, world)), (key, rank)
    assert seqpar.prepare_seq_parallel_inputs(algo, ids, pos, None, 0, world, "cpu")["local_target_ids"] is None


def test_prepare_seq_parallel_inputs_refuses_what_easycontext_would_drop():
    ids = torch.arange(30)[None]
    with pytest.raises(SeqparError, match=r"nearest valid: 28 or 32"):
        seqpar.prepare_seq_parallel_inputs("ulysses_attn", ids, ids, ids, 0, 4, "cpu")


# ------------------------------------------------------------------ prepare_inputs


PREPARE = [
    ("zigzag_ring_attn", 4, None),
    ("dist_flash_attn", 2, None),
    ("ulysses_attn", 4, None),
    ("usp_attn", 4, 2),
    ("data_parallel", 2, None),
]


@pytest.mark.parametrize("mode,world,uly", PREPARE, ids=[case_id(*c) for c in PREPARE])
def test_prepare_inputs_shifts_over_the_whole_sequence_then_splits(mode, world, uly):
    from seqpar.runtime.parallel.layout import unshard

    ids = torch.arange(2 * 32).view(2, 32)  # (B=2, S=32)
    parts = [seqpar.prepare_inputs(ids, mode, r, world, ulysses_degree=uly) for r in range(world)]
    whole = {k: unshard([p[k] for p in parts], mode, ulysses_degree=uly) for k in ("input_ids", "position_ids", "labels")}
    assert torch.equal(whole["input_ids"], ids)
    assert torch.equal(whole["position_ids"], torch.arange(32).expand(2, 32))  # global positions, every row
    expected = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)  # the successor of each token; -100 at the end
    assert torch.equal(whole["labels"], expected)


def test_prepare_inputs_keeps_given_labels_and_positions():
    ids = torch.arange(16)[None]
    labels = ids.clone()
    labels[0, :4] = -100
    got = seqpar.prepare_inputs(ids, "zigzag_ring_attn", 0, 2, labels=labels, position_ids=torch.arange(100, 116))
    assert got["labels"].tolist() == [[-100, -100, -100, 4, 13, 14, 15, -100]]  # chunks 0 and 3 of 4, shifted first
    assert got["position_ids"].tolist() == [[100, 101, 102, 103, 112, 113, 114, 115]]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(input_ids=torch.zeros(1, 30, dtype=torch.long), mode="zigzag_ring_attn", rank=0, world_size=4),
            r"seq_len 30 .*zigzag_ring_attn.*nearest valid: 24 or 32",
        ),
        (
            dict(input_ids=torch.zeros(1, 30, dtype=torch.long), mode="usp_attn", rank=0, world_size=4, ulysses_degree=2),
            r"nearest valid: 24 or 32",
        ),
        (
            dict(input_ids=torch.zeros(32, dtype=torch.long), mode="zigzag_ring_attn", rank=0, world_size=2),
            r"input_ids \(32,\) must be a \(batch, seq_len\)",
        ),
        (dict(input_ids=torch.zeros(1, 32, dtype=torch.long), mode="ring", rank=0, world_size=2), r"mode 'ring' is unknown"),
        (
            dict(input_ids=torch.zeros(1, 32, dtype=torch.long), mode="zigzag_ring_attn", rank=2, world_size=2),
            r"rank 2 is outside 0..1",
        ),
        (
            dict(
                input_ids=torch.zeros(1, 8, dtype=torch.long),
                mode="zigzag_ring_attn",
                rank=0,
                world_size=2,
                position_ids=torch.tensor([0, 1, 2, 3, 5, 6, 7, 8]),
            ),
            r"position_ids go from 3 to 5 at index 4 \(row 0\); packed documents need positions that increase by 1 or restart",
        ),
    ],
    ids=[
        "zigzag_ring_attn-W4-seq30",
        "usp_attn-W4-U2-seq30",
        "1d_input_ids",
        "unknown_mode",
        "rank_outside_world",
        "positions_neither_contiguous_nor_restarting",
    ],
)
def test_prepare_inputs_refusals(kwargs, match):
    with pytest.raises(SeqparError, match=match):
        seqpar.prepare_inputs(**kwargs)


# ------------------------------------------------------------------ loss paths on one process


def test_loss_paths_equal_transformers_loss_and_grads():
    model = make_model("qwen2")
    ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :6] = -100
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    part = seqpar.prepare_inputs(ids, "data_parallel", 0, 1, labels=labels)
    for how in ("full", "chunked", "hidden"):
        model.zero_grad(set_to_none=True)
        if how == "hidden":
            hidden = model.model(input_ids=part["input_ids"]).last_hidden_state
            loss = seqpar.loss_from_hidden(hidden, model.lm_head.weight, part["labels"], chunk_size=7)
        else:
            loss = seqpar.loss(
                model(input_ids=part["input_ids"]).logits, part["labels"], chunk_size=5 if how == "chunked" else None
            )
        loss.backward()
        torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-5 * float(ref_grads[n].abs().max()))


def test_loss_from_hidden_bf16_matches_full_logits():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 40, 16, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(50, 16, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (1, 40), generator=g)
    ref = torch.nn.functional.cross_entropy((hidden @ weight.t()).float().view(-1, 50), labels.view(-1))
    ref.backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got = seqpar.loss_from_hidden(hidden, weight, labels, chunk_size=16)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1.6e-2, atol=1e-3)  # bf16: one rounding of the result
    torch.testing.assert_close(weight.grad, ref_w, rtol=1.6e-2, atol=1e-3)


# ------------------------------------------------------------------ apply: names, switching, refusals


def test_implementation_names_avoid_flash():
    assert set(hf.implementations()) == {"data_parallel", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"}
    assert all("flash" not in name for name in hf.implementations().values())


def test_apply_switches_the_model_and_refuses_padding_and_masks():
    model = seqpar.apply(make_model("llama"), "data_parallel")
    assert model.config._attn_implementation == "seqpar_local"
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(5))
    ones = torch.ones(2, 16, dtype=torch.long)
    plain = make_model("llama")(input_ids=ids).logits
    torch.testing.assert_close(model(input_ids=ids, attention_mask=ones).logits, plain, rtol=1e-5, atol=1e-5)
    padded = ones.clone()
    padded[1, -3:] = 0
    with pytest.raises(SeqparError, match=r"LlamaForCausalLM \(llama\): an attention_mask with padding"):
        model(input_ids=ids, attention_mask=padded)
    bias = torch.zeros(2, 1, 16, 16)
    with pytest.raises(SeqparError, match=r"LlamaForCausalLM .*4D mask/bias"):
        model(input_ids=ids, attention_mask=bias)


def test_apply_refuses_a_sliding_window_shorter_than_the_sequence():
    model = make_model("mistral")
    model.config.sliding_window = 8
    seqpar.apply(model, "data_parallel")
    with pytest.raises(
        SeqparError,
        match=r"MistralForCausalLM \(mistral\): sliding window attention \(window 8 < "
        r"sequence length 16\).*config.sliding_window = None",
    ):
        model(input_ids=torch.zeros(1, 16, dtype=torch.long))


def test_apply_refuses_soft_capping_and_models_outside_the_interface():
    gemma = transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    with pytest.raises(SeqparError, match=r"Gemma2ForCausalLM \(gemma2\): attention logit soft-capping"):
        seqpar.apply(transformers.Gemma2ForCausalLM(gemma), "zigzag_ring_attn")
    bloom = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)
    with pytest.raises(SeqparError, match=r"BloomForCausalLM \(bloom\): attention that does not go through"):
        seqpar.apply(transformers.BloomForCausalLM(bloom), "zigzag_ring_attn")
    with pytest.raises(SeqparError, match=r"mode 'ring' is unknown"):
        seqpar.apply(make_model("llama"), "ring")


def test_offload_checkpointing_moves_layer_inputs_through_the_offload_hook(monkeypatch):
    from seqpar.runtime.memory import offload

    packed = []
    real = offload.HostOffload.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        pack = self.pack_hook
        self.pack_hook = lambda t: packed.append(tuple(t.shape)) or pack(t)

    monkeypatch.setattr(offload.HostOffload, "__init__", spy)
    model = seqpar.apply(make_model("llama"), "data_parallel", checkpointing="offload")
    model.train()
    model(input_ids=torch.zeros(2, 16, dtype=torch.long)).logits.sum().backward()
    # each layer's input hidden states (B, S, hidden) went through the offload hook (4.x before 4.52 also passes the
    # mask and position ids positionally: those are offloaded too)
    assert packed.count((2, 16, 32)) == 2, packed


def _checkpointing(model) -> tuple:
    """(checkpointing on, use_reentrant or "offload", attention keeps out + lse) as the model's first layer sees them."""
    from seqpar.runtime.memory.activation_checkpoint import _offloaded_checkpoint, is_checkpointing

    layer, on = model.model.layers[0], is_checkpointing(model)
    func = getattr(layer, "_gradient_checkpointing_func", None)
    offload = getattr(func, "func", None) is _offloaded_checkpoint  # its partial carries the pinned budget
    how = None if not on else "offload" if offload else func.keywords["use_reentrant"]
    return on, how, layer.self_attn._seqpar_ctx.keep_attention


CHECKPOINTING = {  # policy -> what the model is left with
    None: (False, None, False),  # the model's own setting, untouched
    "none": (False, None, False),
    "full": (True, False, False),
    "offload": (True, "offload", False),
    "selective": (True, False, True),
}


@pytest.mark.parametrize("policy", list(CHECKPOINTING), ids=str)
def test_checkpointing_is_one_knob(policy):
    assert _checkpointing(seqpar.apply(make_model("llama"), "data_parallel", checkpointing=policy)) == CHECKPOINTING[policy]


def test_checkpointing_none_switches_the_models_own_off():
    model = seqpar.apply(make_model("llama"), "data_parallel", checkpointing="full")
    assert _checkpointing(seqpar.apply(model, "data_parallel"))[0] is True  # None: left as it is
    assert _checkpointing(seqpar.apply(model, "data_parallel", checkpointing="none"))[0] is False


@pytest.mark.parametrize(
    "old,policy",
    [
        (dict(offload_checkpoints=True), "offload"),
        (dict(keep_attention=True), "selective"),
        (dict(keep_attention=False, offload_checkpoints=False), None),
    ],
    ids=["offload_checkpoints", "keep_attention", "both_false"],
)
def test_deprecated_checkpointing_flags_warn_and_mean_the_policy(old, policy):
    with pytest.warns(DeprecationWarning, match=r"is deprecated; pass checkpointing="):
        model = seqpar.apply(make_model("llama"), "data_parallel", **old)
    assert _checkpointing(model) == CHECKPOINTING[policy]


def test_bad_checkpointing_is_one_clear_error():
    with pytest.raises(SeqparError, match=r"checkpointing 'sometimes' is unknown; use one of none, full, offload, selective"):
        seqpar.apply(make_model("llama"), "data_parallel", checkpointing="sometimes")
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(SeqparError, match=r"checkpointing='full' contradicts keep_attention=True"),
    ):
        seqpar.apply(make_model("llama"), "data_parallel", checkpointing="full", keep_attention=True)


def test_pinned_budget_rounds_like_the_caching_host_allocator():
    from seqpar.plan.options import pinned_block as _rounded
    from seqpar.runtime.memory.offload import pinned_budget

    assert _rounded(3 * 2**30) == 4 * 2**30 and _rounded(2**30) == 2**30 and _rounded(1) == 1
    assert pinned_budget() > 0


def test_lazy_api_names_each_function_in_its_home_module():
    names = {
        "apply",
        "prepare_inputs",
        "loss",
        "loss_from_hidden",
        "prepare_seq_parallel_inputs",
        "apply_seq_parallel_monkey_patch",
        "with_seqpar",
        "SeqparArguments",
    }
    assert set(seqpar._RUNTIME_API) == names
    for name, module in seqpar._RUNTIME_API.items():
        fn = getattr(seqpar, name)
        assert callable(fn) and fn.__module__ == module, (name, fn.__module__, module)


# ------------------------------------------------------------------ EasyContext's monkey patch by family name


def test_monkey_patch_by_family_name_reaches_models_loaded_afterwards(tmp_path):
    make_model("llama").save_pretrained(tmp_path)
    try:
        assert seqpar.apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama") is None
        fresh = transformers.LlamaForCausalLM(make_model("llama").config)
        assert fresh.config._attn_implementation == "seqpar_zigzag_ring"
        # EasyContext's train.py asks for flash_attention_2; it must not send transformers to the hub for a kernel
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flash_attention_2")
        assert loaded.config._attn_implementation == "seqpar_zigzag_ring"
        assert loaded.model.layers[0].self_attn._seqpar_ctx.mode == "zigzag_ring_attn"
        assert transformers.MistralForCausalLM(make_model("mistral").config).config._attn_implementation == "sdpa"
    finally:
        easycontext._PATCHED_MODE.clear()
    assert transformers.LlamaForCausalLM(make_model("llama").config).config._attn_implementation == "sdpa"
    model = make_model("qwen2")
    assert seqpar.apply_seq_parallel_monkey_patch("ulysses_attn", model) is model
    assert model.config._attn_implementation == "seqpar_ulysses"
    with pytest.raises(SeqparError, match=r"model 'qwen' is not one of EasyContext's names"):
        seqpar.apply_seq_parallel_monkey_patch("zigzag_ring_attn", "qwen")
