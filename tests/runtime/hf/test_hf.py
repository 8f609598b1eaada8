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

from seqpar_testing import run_ranks, world_ids
from seqpar_testing.hf import available_modes, batch, compare_loss_and_grads, families, group_grads, make_model, param_grads


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
        ref_loss, ref_grads = ref.loss.detach(), param_grads(base)
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
                compare_loss_and_grads(
                    failures, f"W={world_size} {family}/{mode}/{label}", loss.detach(), ref_loss, grads, ref_grads
                )
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
