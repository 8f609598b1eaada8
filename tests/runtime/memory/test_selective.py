"""Selective checkpointing (seqpar.runtime.memory.selective) on a tiny Llama over real gloo ranks, against plain transformers.

Every mode, W in {2, 4}: with ``apply(..., checkpointing="selective")`` the loss and every parameter's gradient (summed over the
ranks) equal plain transformers on one process, over two accumulated micro-batches and with checkpointing switched off
afterwards; attention's forward kernel (seqpar.runtime.parallel.kernels.attn_forward) runs exactly as often as without
checkpointing, half as often as under full checkpointing; no kept entry outlives its backward. One spawn per W; the
mode-independent cases (checkpointing off, two forwards awaiting one backward) run on usp_attn only.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from seqpar_testing import run_ranks, world_ids
from seqpar_testing.hf import available_modes, batch, compare_loss_and_grads, group_grads, make_model, param_grads

MICRO = 2  # accumulated micro-batches (the same batch twice: the gradient doubles)


def _group_grads(model) -> dict:
    """The group's gradient over the MICRO accumulated micro-batches of the same batch, per micro-batch."""
    return {n: g / MICRO for n, g in group_grads(model).items()}


def ranks_main(rank: int, world_size: int, modes: list[str]) -> dict:
    import seqpar
    from seqpar.runtime.memory import selective
    from seqpar.runtime.parallel import kernels

    warnings.filterwarnings("ignore")
    calls = {"n": 0}
    real_forward = kernels.attn_forward

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real_forward(*args, **kwargs)

    kernels.attn_forward = counting  # the modes and the local Function look it up on the module at call time
    ids, labels = batch()
    base = make_model("llama")
    base.train()
    ref = base(input_ids=ids, labels=labels)
    ref.loss.backward()
    ref_loss, ref_grads = ref.loss.detach(), param_grads(base)
    failures, counts = [], {}
    for mode in modes:
        uly = 2 if mode == "usp_attn" else None
        part = seqpar.prepare_inputs(ids, mode, rank, world_size, labels=labels, ulysses_degree=uly)
        inputs = dict(input_ids=part["input_ids"], position_ids=part["position_ids"])
        labels_ = ["plain", "full", "selective"]
        if mode == "usp_attn":  # these do not depend on the mode: one (the one with both all-to-alls and a ring) suffices
            labels_ += ["selective_off", "selective_summed"]
        for label in labels_:
            model = copy.deepcopy(base)
            if label == "full":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            seqpar.apply(model, mode, ulysses_degree=uly, checkpointing="selective" if label.startswith("selective") else None)
            if label == "selective_off":  # the kept path without checkpointing: nothing to recompute, nothing left over
                model.gradient_checkpointing_disable()
            calls["n"] = 0
            if label == "selective_summed":  # both micro-batches' forwards await backward at once: entries must pair up
                losses = [seqpar.loss(model(**inputs).logits, part["labels"]) for _ in range(MICRO)]
                sum(losses).backward()
                loss = losses[-1]
            else:
                for _ in range(MICRO):
                    loss = seqpar.loss(model(**inputs).logits, part["labels"])
                    loss.backward()
            counts[f"{mode}/{label}"] = calls["n"]
            if selective.pending():
                failures.append(f"W={world_size} {mode}/{label}: {selective.pending()} kept entries left after backward")
            compare_loss_and_grads(
                failures, f"W={world_size} {mode}/{label}", loss.detach(), ref_loss, _group_grads(model), ref_grads
            )
    return {"failures": failures, "counts": counts}


@pytest.mark.parametrize("world_size", [2, 4], ids=world_ids([2, 4]))
def test_selective_is_exact_and_runs_attention_forward_once(world_size):
    modes = available_modes()
    assert len(modes) == 5, modes
    results = run_ranks(ranks_main, world_size, modes, timeout=120)
    for r, res in enumerate(results):
        assert res["failures"] == [], f"rank {r}:\n" + "\n".join(res["failures"][:20])
    for res in results:
        for mode in modes:
            plain = res["counts"][f"{mode}/plain"]  # kernel calls of one forward per layer and micro-batch
            assert plain > 0, mode
            assert res["counts"][f"{mode}/full"] == 2 * plain, (mode, res["counts"])  # recomputation reruns attention
            for label in ("selective", "selective_off", "selective_summed"):
                assert res["counts"].get(f"{mode}/{label}", plain) == plain, (mode, label, res["counts"])


def test_deprecated_keep_attention_and_offload_exclude_each_other():
    import seqpar
    from seqpar.plan.errors import SeqparError

    with pytest.warns(DeprecationWarning), pytest.raises(SeqparError, match="exclude each other"):
        seqpar.apply(make_model("llama"), "data_parallel", keep_attention=True, offload_checkpoints=True)


def _nan_on_one_rank(rank: int, world_size: int) -> list[str]:
    """Two forwards awaiting one backward, with q NaN on rank 1 only: its fingerprint cannot match there, so the ranks
    must agree to recompute together (a rank recomputing alone would send ring messages its peer never receives)."""
    import seqpar
    from seqpar.runtime.memory import selective

    warnings.filterwarnings("ignore")
    ids, labels = batch()
    model = make_model("llama")
    model.train()
    mode = "zigzag_ring_attn"
    part = seqpar.prepare_inputs(ids, mode, rank, world_size, labels=labels)
    seqpar.apply(model, mode, checkpointing="selective")
    if rank == 1:
        with torch.no_grad():
            model.get_input_embeddings().weight[int(part["input_ids"][0, 0])] = float("nan")
    paths, real = [], selective._take

    def take(module, q, group=None):
        kept = real(module, q, group)
        paths.append("hit" if kept is not None else "miss")
        return kept

    selective._take = take
    inputs = dict(input_ids=part["input_ids"], position_ids=part["position_ids"])
    sum(seqpar.loss(model(**inputs).logits, part["labels"]) for _ in range(2)).backward()
    return paths


def test_ranks_agree_on_the_kept_path_when_one_ranks_q_is_nan():
    paths = run_ranks(_nan_on_one_rank, 2, timeout=60)
    assert paths[0] == paths[1] and "miss" in paths[0]  # same path on both ranks, and the NaN layer recomputed
