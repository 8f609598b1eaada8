"""seqpar.apply / prepare_inputs / loss on real transformers models over real gloo ranks, against plain transformers.

For Llama (MHA), Mistral (GQA), Qwen2 (GQA, qkv bias) and Qwen3 (q/k norm), tiny random-weight models built from configs:
every available mode, W in {2, 4}, with and without gradient checkpointing, the loss and every parameter's gradient
summed over the ranks equal the same model run by plain transformers (sdpa) on one process over the whole sequence.
Also (on zigzag_ring_attn: they do not depend on the mode): loss_from_hidden, the chunked loss and CPU-offloaded
checkpointing. One spawn per W; every case runs
inside it and failures come back as assert_close messages, so the parent sees all of them at once.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from seqpar.plan.modes import MODES

from seqpar_testing import run_ranks, world_ids

B, S = 2, 32  # batch > 1; S divisible by 2W for W = 4 and by 2*R*U for usp
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def families() -> list[str]:
    """The families this transformers version has (Qwen3 arrived in 4.51; the suite also runs on 4.48)."""
    import transformers

    return [f for f in FAMILIES if f != "qwen3" or hasattr(transformers, "Qwen3ForCausalLM")]


def make_model(family: str):
    """A tiny random-weight causal LM, built from a config (no hub), seeded so every rank builds the same weights."""
    import transformers

    common = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    kinds = {  # (config class, model class, extra config)
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
        # Mistral keeps its default 4096-token sliding window: longer than S, so full causal attention is exact
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
    }
    config_name, model_name, extra = kinds[family]
    config, cls = getattr(transformers, config_name)(**common, **extra), getattr(transformers, model_name)
    torch.manual_seed(0)
    model = cls(config).float()
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # the qkv-bias case is really covered
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (B, S), generator=g)  # (B, S)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt: shards hold different numbers of counted tokens
    labels[1, 20:23] = -100
    return ids, labels


def available_modes() -> list[str]:
    return list(MODES)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def group_grads(model) -> dict[str, torch.Tensor]:
    """The sequence-parallel group's gradient of every parameter: the sum of its ranks' (one all-reduce)."""
    import torch.distributed as dist

    grads = _grads(model)
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    dist.all_reduce(flat)
    return {n: g.view_as(grads[n]) for n, g in zip(grads, flat.split([g.numel() for g in grads.values()]))}


def _compare(failures: list, case: str, loss, ref_loss, grads: dict, ref_grads: dict) -> None:
    try:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        failures.append(f"{case} loss: {e}")
    for name, ref in ref_grads.items():
        try:  # relative error <= 1e-5 of the tensor's scale (elementwise rtol alone fails on entries near zero)
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        except AssertionError as e:
            failures.append(f"{case} grad {name}: {e}")
            return


def _run(model, batch_, group_loss, how: str, chunk: int | None = None):
    import seqpar

    inputs = dict(input_ids=batch_["input_ids"], position_ids=batch_["position_ids"])
    if how == "hidden":
        hidden = model.model(**inputs).last_hidden_state  # (B, S_local, hidden)
        return seqpar.loss_from_hidden(hidden, model.lm_head.weight, batch_["labels"], chunk_size=5)
    logits = model(**inputs).logits  # (B, S_local, V)
    return group_loss(logits, batch_["labels"], chunk_size=chunk)


def ranks_main(rank: int, world_size: int, modes: list[str]) -> dict:
    """Every case on this rank; returns {"failures": [...], "cases": n, "calls": {...}}."""
    import importlib

    import seqpar

    attention_module = importlib.import_module(
        "seqpar.runtime.parallel.attention"
    )  # the module (the package exports the function)

    warnings.filterwarnings("ignore")
    calls = {"n": 0}
    real_attention = attention_module.attention

    def counting(*args, **kwargs):  # proves the model really runs seqpar's attention (data_parallel would pass anyway)
        calls["n"] += 1
        return real_attention(*args, **kwargs)

    attention_module.attention = counting
    ids, labels = batch()
    failures, cases, call_counts = [], 0, {}
    for family in families():
        base = make_model(family)
        base.train()
        ref = base(input_ids=ids, labels=labels)  # plain transformers, whole sequence, one process
        ref.loss.backward()
        ref_loss, ref_grads = ref.loss.detach(), _grads(base)
        base.zero_grad(set_to_none=True)
        for mode in modes:
            uly = 2 if mode == "usp_attn" else None
            variants = [("plain", False, "logits"), ("checkpointed", True, "logits")]
            if family == "llama" and mode == "zigzag_ring_attn":  # these paths do not depend on the mode: one suffices
                variants += [("offloaded", "offload", "logits"), ("hidden", False, "hidden"), ("chunked", False, "chunk")]
            for label, ckpt, how in variants:
                model = copy.deepcopy(base)
                if ckpt is True:
                    model.gradient_checkpointing_enable()
                seqpar.apply(model, mode, ulysses_degree=uly, checkpointing="offload" if ckpt == "offload" else None)
                part = seqpar.prepare_inputs(ids, mode, rank, world_size, labels=labels, ulysses_degree=uly)
                calls["n"] = 0
                loss = _run(model, part, seqpar.loss, how, chunk=7 if how == "chunk" else None)
                loss.backward()
                call_counts[f"{family}/{mode}/{label}"] = calls["n"]
                grads = group_grads(model)
                _compare(failures, f"W={world_size} {family}/{mode}/{label}", loss.detach(), ref_loss, grads, ref_grads)
                cases += 1
    return {"failures": failures, "cases": cases, "calls": call_counts}


@pytest.mark.parametrize("world_size", [2, 4], ids=world_ids([2, 4]))
def test_every_model_mode_and_checkpointing_matches_transformers(world_size):
    modes = available_modes()
    assert {"data_parallel", "zigzag_ring_attn"} <= set(modes), modes
    results = run_ranks(ranks_main, world_size, modes, timeout=180)
    for r, res in enumerate(results):
        assert res["failures"] == [], f"rank {r}:\n" + "\n".join(res["failures"][:20])
    n_layers = 2
    for case, n in results[0]["calls"].items():
        # forward runs each layer's attention once; checkpointing recomputes it in backward
        expected = 2 * n_layers if ("checkpointed" in case or "offloaded" in case) else n_layers
        assert n == expected, (case, n)
    assert results[0]["cases"] == len(modes) * len(families()) * 2 + 3
