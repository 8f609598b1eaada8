"""Packed documents through seqpar.apply-ed transformers models on 4 real gloo ranks, against each document run alone.

Llama (MHA), Mistral (GQA), Qwen2 (GQA, qkv bias), Qwen3 (q/k norm), every mode (usp_attn with U = 2): a (2, 32) batch
packing documents of 7, 1, 12, 3 and 9 tokens with transformers' packed position ids (restarting at 0) and a masked
prompt, through seqpar.prepare_inputs and the model called exactly as for one document per row. The loss and every
parameter's gradient (summed over the ranks) equal plain transformers running each document on its own (token-weighted
mean of the cross-entropy), in float32. On zigzag_ring_attn / usp_attn also: boundaries passed as cu_seq_lens_q,
rows with different boundaries, full and selective checkpointing, kept_saves matmuls, balance=True, and the trainer's
LossModule. The
same-input guard names the ranks whose batch differs, on every rank; bad packed inputs raise one line.
"""

from __future__ import annotations

import copy
import warnings

import torch

from seqpar.plan.modes import names

from seqpar_testing import run_ranks
from seqpar_testing.hf import (
    LENGTHS,
    OTHER,
    S,
    compare_loss_and_grads,
    families,
    group_grads,
    make_model,
    packed_batch,
    per_document_reference,
)


def _case(rank, W, base, ref, mode, variant, rows, failures, counts):
    import seqpar
    from seqpar.runtime.train.engine import LossModule

    uly = 2 if mode == "usp_attn" else None
    ids, labels, pos = packed_batch(rows)
    model = copy.deepcopy(base)
    if variant == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant == "kept_matmuls":  # layer 0 selective, layer 1 keeping its matmul outputs (seqpar.runtime.memory.matmul_keep)
        seqpar.apply(model, mode, ulysses_degree=uly, checkpointing="selective", checkpoint_layers=1, kept_saves="matmuls")
    else:
        seqpar.apply(model, mode, ulysses_degree=uly, checkpointing="selective" if variant == "selective" else None)
    part = seqpar.prepare_inputs(
        ids, mode, rank, W, labels=labels, position_ids=pos, ulysses_degree=uly, balance=variant == "balanced"
    )
    assert "cu_seqlens" in part
    if variant == "loss_module":
        loss = LossModule(model, "full", None)(part["input_ids"], part["position_ids"], part["labels"], part["cu_seqlens"])
    else:
        extra = {"cu_seq_lens_q": part["cu_seqlens"]} if variant == "cu_kwarg" else {}
        logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"], **extra).logits
        loss = seqpar.loss(logits, part["labels"])
    loss.backward()
    compare_loss_and_grads(failures, f"W={W} {mode}/{variant}", loss.detach(), ref[0], group_grads(model), ref[1])
    counts.append(f"{mode}/{variant}")


def ranks_main(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    failures, done = [], []
    same, differ = (LENGTHS, LENGTHS), (LENGTHS, OTHER)
    for family in families():
        base = make_model(family)
        base.train()
        ids, labels, _ = packed_batch(same)
        ref = per_document_reference(base, ids, labels, same)
        for mode in names():
            _case(rank, world_size, base, ref, mode, "plain", same, failures, done)
        if family == "llama":  # the paths below do not depend on the model
            for mode in ("zigzag_ring_attn", "usp_attn"):
                for variant in ("cu_kwarg", "checkpointed", "selective", "kept_matmuls", "balanced", "loss_module"):
                    _case(rank, world_size, base, ref, mode, variant, same, failures, done)
            ids, labels, _ = packed_batch(differ)
            ref_rows = per_document_reference(base, ids, labels, differ)
            for mode in ("zigzag_ring_attn", "dist_flash_attn"):
                _case(rank, world_size, base, ref_rows, mode, "rows", differ, failures, done)
    return {"failures": failures, "cases": done, "errors": _refusals(rank, world_size)}


def _refusals(rank: int, world_size: int) -> list[str]:
    import seqpar

    from seqpar_testing import error_messages

    ids, labels, pos = packed_batch()
    mine = ids.clone()
    if rank in (1, 3):
        mine[0, 5] += 1  # a per-rank sampler: these ranks load another batch
    bad_pos = pos.clone()
    bad_pos[0, 9] = 5  # neither the next position nor a restart at 0
    silent = labels.clone()
    silent[1] = -100
    kw = dict(mode="zigzag_ring_attn", rank=rank, world_size=world_size)
    return error_messages(
        [
            lambda: seqpar.prepare_inputs(mine, labels=labels, position_ids=pos, check_group=None, **kw) and None,
            lambda: seqpar.prepare_inputs(mine, labels=labels, position_ids=pos, check_group=torch.distributed.group.WORLD, **kw),
            lambda: seqpar.prepare_inputs(ids, labels=labels, position_ids=bad_pos, **kw),
            lambda: seqpar.prepare_inputs(ids, labels=silent, position_ids=pos, **kw),
            lambda: seqpar.prepare_inputs(ids, position_ids=pos, cu_seqlens=torch.tensor([0, 16, S]), **kw),
        ]
    )


def test_packed_documents_through_transformers_match_each_document_alone():
    results = run_ranks(ranks_main, 4, timeout=300)
    for r, res in enumerate(results):
        assert res["failures"] == [], f"rank {r}:\n" + "\n".join(res["failures"][:20])
    n_modes = len(names())
    assert len(results[0]["cases"]) == len(families()) * n_modes + 2 * 6 + 2
    msgs = [res["errors"] for res in results]
    assert all(m == msgs[0] for m in msgs), msgs  # the same line on every rank
    fine, guard, positions, silent, disagree = msgs[0]
    assert fine == "no error"
    assert guard.startswith("ranks [1, 3] of the sequence-parallel group hold a batch (input_ids, labels, position_ids) other")
    assert "seed its sampler with the data-parallel rank" in guard
    assert "position_ids go from 0 to 5 at index 9 (row 0)" in positions
    assert "row 1 of the batch scores no token" in silent
    assert "position_ids restart at other places than cu_seqlens says" in disagree
