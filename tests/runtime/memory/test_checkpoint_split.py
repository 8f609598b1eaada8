"""The checkpointing split (seqpar.apply's checkpoint_layers and offload_layers) on a real 4-layer transformers Llama.

- Exact: for checkpoint_layers in {0, 1, L-1, L} under full, selective and offload (and offload_layers below
  checkpoint_layers), the loss and every parameter gradient equal the un-checkpointed model's, on one process and over
  two gloo ranks in zigzag_ring_attn.
- The memory it saves: the bytes saved for backward during forward (saved_tensors_hooks, unique storages, parameters
  left out) shrink strictly as checkpoint_layers grows; a layer past checkpoint_layers saves exactly what a layer of the
  un-checkpointed model saves, and under selective its attention keeps no (out, lse) entry (nothing recomputes it).
- Offload: offload_layers=k sends exactly k layer inputs, one (B, S, hidden) tensor per layer, through HostOffload (on
  CPU HostOffload keeps CPU tensors where they are, so its hooks are counted, not its bytes).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from seqpar_testing import run_ranks
from seqpar_testing.hf import compare_loss_and_grads, group_grads, param_grads
from seqpar_testing.memory import HIDDEN, B, L, S, batch, make_model, reference, saved_bytes
from seqpar_testing.train import compare_runs, learnable_tokens, make_plan, train_cases

CASES = [(p, k, None) for p in ("full", "selective", "offload") for k in (0, 1, L - 1, L)] + [
    ("offload", L - 1, 0),
    ("offload", L - 1, 1),
    ("offload", L, 2),
]


def _expected_layout(model, policy: str, k: int, off: int | None) -> None:
    """The layers' flags and checkpoint functions say what the split asked for."""
    from seqpar.runtime.memory.activation_checkpoint import _offloaded_checkpoint

    offloaded = (k if off is None else off) if policy == "offload" else 0
    for i, layer in enumerate(model.model.layers):
        assert layer.gradient_checkpointing == (i < k), (policy, k, off, i)
        func = layer._gradient_checkpointing_func
        assert (getattr(func, "func", func) is _offloaded_checkpoint) == (i < offloaded), (policy, k, off, i)


def test_split_is_exact_on_one_process():
    import seqpar

    warnings.filterwarnings("ignore")
    ids, labels = batch()
    base, ref_loss, ref_grads = reference()
    failures = []
    for policy, k, off in CASES:
        model = copy.deepcopy(base)
        seqpar.apply(model, "data_parallel", checkpointing=policy, checkpoint_layers=k, offload_layers=off)
        _expected_layout(model, policy, k, off)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        compare_loss_and_grads(failures, f"{policy} k={k} off={off}", loss.detach(), ref_loss, param_grads(model), ref_grads)
    assert failures == [], "\n".join(failures[:10])


def _ranks_main(rank: int, world_size: int) -> list[str]:
    import seqpar
    from seqpar.runtime.memory import selective

    warnings.filterwarnings("ignore")
    ids, labels = batch()
    base, ref_loss, ref_grads = reference()
    part = seqpar.prepare_inputs(ids, "zigzag_ring_attn", rank, world_size, labels=labels)
    failures = []
    for policy, k, off in CASES:
        model = copy.deepcopy(base)
        seqpar.apply(model, "zigzag_ring_attn", checkpointing=policy, checkpoint_layers=k, offload_layers=off)
        loss = seqpar.loss(model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits, part["labels"])
        loss.backward()
        compare_loss_and_grads(
            failures, f"rank {rank} {policy} k={k} off={off}", loss.detach(), ref_loss, group_grads(model), ref_grads
        )
        if selective.pending():
            failures.append(f"rank {rank} {policy} k={k}: {selective.pending()} kept entries left after backward")
    return failures


def test_split_is_exact_over_two_ranks_in_zigzag_ring_attn():
    for failures in run_ranks(_ranks_main, 2, timeout=180):
        assert failures == [], "\n".join(failures[:10])


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_bytes_saved_shrink_as_more_layers_are_checkpointed(policy):
    import seqpar
    from seqpar.runtime.memory import selective

    warnings.filterwarnings("ignore")
    ids, _ = batch()
    base = make_model()
    plain = copy.deepcopy(base)
    seqpar.apply(plain, "data_parallel", checkpointing="none")
    unckpt, unckpt_total, loss = saved_bytes(plain, ids)
    loss.backward()
    layer_input = B * S * HIDDEN * 4  # (B, S, hidden) fp32
    assert all(unckpt[i] > 4 * layer_input for i in range(L)), unckpt
    totals = []
    for k in range(L + 1):
        model = copy.deepcopy(base)
        seqpar.apply(model, "data_parallel", checkpointing=policy, checkpoint_layers=k)
        saved, total, loss = saved_bytes(model, ids)
        totals.append(total)
        for i in range(k, L):  # past checkpoint_layers: what the un-checkpointed model's layer saves, to the byte
            assert saved[i] == unckpt[i], (policy, k, i, saved, unckpt)
        for i in range(k):  # checkpointed: its input alone (torch's checkpoint keeps it), the rest is recomputed
            assert saved[i] == layer_input, (policy, k, i, saved)
        if policy == "selective":  # out + lse kept only where a recomputation will take them
            kept = [selective.pending(layer.self_attn) for layer in model.model.layers]
            assert kept == [1] * k + [0] * (L - k), (k, kept)
        loss.backward()
        assert selective.pending() == 0
    assert all(a > b for a, b in zip(totals, totals[1:])), totals  # strictly fewer bytes per more checkpointed layer
    assert totals[0] == unckpt_total, (totals, unckpt_total)


def test_the_memory_model_counts_what_a_layer_saves():
    """The advisor's bytes per token of an un-checkpointed decoder layer (seqpar.advisor.cost.memory.saved_bytes_per_token,
    fp32 on CPU: p = residual = 4) against what the real layer under seqpar.apply saves for backward, byte for byte. The
    model leaves out two terms too small to matter at long lengths, added here: each RMSNorm's fp32 rstd per token, and
    RoPE's cos and sin (S x d fp32 each, shared by the batch)."""
    import seqpar
    from seqpar.advisor.cost.memory import saved_bytes_per_token
    from seqpar.profiles.hf_config import spec_from_config

    warnings.filterwarnings("ignore")
    ids, _ = batch()
    model = make_model()
    seqpar.apply(model, "data_parallel", checkpointing="none")
    saved, _, _ = saved_bytes(model, ids)
    spec = spec_from_config(model.config.to_dict(), "tiny", "the test's config", "test")  # as `--model DIR` reads it
    small = B * S * 2 * 4 + 2 * S * spec.head_dim * 4  # rstd of the two norms; cos and sin
    predicted = saved_bytes_per_token(spec, "fp32", residual=4) * B * S + small
    assert [saved[i] for i in range(L)] == [predicted] * L


@pytest.mark.parametrize("k,off", [(L, None), (L, 0), (L, 1), (L - 1, 2), (2, 2), (0, 0)])
def test_offload_layers_send_exactly_that_many_inputs_through_host_offload(monkeypatch, k, off):
    import seqpar
    from seqpar.runtime.memory import offload

    warnings.filterwarnings("ignore")
    entered, packed = [], []

    class Counting(offload.HostOffload):
        def __init__(self, budget=None):
            super().__init__(budget)
            real = self.pack_hook

            def pack(t):
                packed.append(tuple(t.shape))
                return real(t)

            self.pack_hook = pack

        def __enter__(self):
            entered.append(1)
            return super().__enter__()

    monkeypatch.setattr(offload, "HostOffload", Counting)  # _offloaded_checkpoint looks it up at call time
    ids, _ = batch()
    model = make_model()
    seqpar.apply(model, "data_parallel", checkpointing="offload", checkpoint_layers=k, offload_layers=off)
    model(input_ids=ids, labels=ids).loss.backward()
    n = k if off is None else off
    assert len(entered) == n
    assert packed == [(B, S, HIDDEN)] * n  # each layer's input, nothing else


def test_split_refusals_name_the_value_and_the_fix():
    import seqpar
    from seqpar.plan.errors import SeqparError

    with pytest.raises(SeqparError, match=r"checkpoint_layers 5 is more than the 4 decoder layers of LlamaForCausalLM"):
        seqpar.apply(make_model(), "data_parallel", checkpointing="full", checkpoint_layers=5)
    with pytest.raises(SeqparError, match=r"offload_layers 1 .* but checkpointing is full; remove offload_layers"):
        seqpar.apply(make_model(), "data_parallel", checkpointing="full", offload_layers=1)
    with pytest.raises(SeqparError, match=r"offload_layers 3 is more than the 2 checkpointed layers \(checkpoint_layers 2\)"):
        seqpar.apply(make_model(), "data_parallel", checkpointing="offload", checkpoint_layers=2, offload_layers=3)
    with pytest.raises(SeqparError, match=r"checkpoint_layers 2 picks the layers .* but checkpointing is none"):
        seqpar.apply(make_model(), "data_parallel", checkpointing="none", checkpoint_layers=2)
    with pytest.raises(SeqparError, match=r"but checkpointing is None \(the model's own setting\); pass checkpointing="):
        seqpar.apply(make_model(), "data_parallel", checkpoint_layers=2)


def test_a_model_without_decoder_layers_is_refused():
    from seqpar.plan.errors import SeqparError
    from seqpar.runtime.memory.activation_checkpoint import apply_checkpointing

    with pytest.raises(SeqparError, match=r"Linear: checkpoint_layers/offload_layers split the decoder layers, but 0"):
        apply_checkpointing(torch.nn.Linear(2, 2), "full", checkpoint_layers=1)


def _train_and_spy(rank: int, world: int, cases: list, tmp: str, data: str) -> dict:
    """test_train's rank body, recording the split each run hands to apply_checkpointing and the layers' flags after it."""
    from seqpar.runtime.hf import apply as hf

    seen, real = [], hf.apply_checkpointing

    def spy(model, name, checkpoint_layers=None, offload_layers=None, kept_saves="all", kept_host_layers=0, **kw):
        out = real(model, name, checkpoint_layers, offload_layers, kept_saves, kept_host_layers, **kw)
        flags = [layer.gradient_checkpointing for layer in model.model.layers]
        seen.append((name, checkpoint_layers, offload_layers, kept_saves, kept_host_layers, flags))
        return out

    hf.apply_checkpointing = spy
    return {"metrics": train_cases(rank, world, cases, tmp, data), "applied": seen}


def test_the_trainer_runs_the_plans_split_and_records_it(tmp_path):
    """seqpar's trainer on 2 gloo ranks (the tiny profile: 2 layers), 20 steps: a plan's split (and kept_saves matmuls)
    trains to the losses and gradient norms of the un-checkpointed data_parallel run; train.log states the split and
    run_report.json records it."""
    import json
    from pathlib import Path

    w = 2
    split = {
        "offload_split": ("offload", {"checkpoint_layers": 1, "offload_layers": 1}),
        "selective_split": ("selective", {"checkpoint_layers": 1}),
        "matmuls_split": ("selective", {"checkpoint_layers": 1, "kept_saves": "matmuls"}),
    }
    # the kept_saves matmuls case under FSDP2, Ulysses and two accumulated micro-batches: parameters gathered by hooks,
    # an all-to-all around attention, two forwards' kept outputs in turn
    other = {"matmuls_split": {"mode": "ulysses_attn", "mbs": 1, "ga": 2, "sharding": "fsdp"}}
    cases = [("ref", make_plan(w))]
    for name, (policy, fields) in split.items():
        o = other.get(name, {})
        plan = make_plan(
            w,
            o.get("mode", "zigzag_ring_attn"),
            w,
            mbs=o.get("mbs", w),
            ga=o.get("ga", 1),
            sharding=o.get("sharding", "ddp"),
            checkpointing=policy,
        )
        cases.append((name, plan.model_validate({**plan.model_dump(), "strategy": {**plan.strategy.model_dump(), **fields}})))
    data = learnable_tokens(tmp_path / "tokens.npy")
    got = run_ranks(_train_and_spy, w, cases, str(tmp_path), data, timeout=170)[0]
    compare_runs(got["metrics"])
    assert got["applied"] == [
        ("none", None, None, "all", 0, [False, False]),
        ("offload", 1, 1, "all", 0, [True, False]),
        ("selective", 1, None, "all", 0, [True, False]),
        ("selective", 1, None, "matmuls", 0, [True, True]),  # the kept layer runs under its MatmulKeep
    ]
    lines = {
        "offload_split": "checkpointing=offload (layer 0: input in host memory; layer 1: not checkpointed)",
        "selective_split": "checkpointing=selective (layer 0: checkpointed; layer 1: not checkpointed)",
        "matmuls_split": "checkpointing=selective (layer 0: checkpointed; layer 1: matmul outputs kept)",
    }
    for name, (_, fields) in split.items():
        assert lines[name] in (tmp_path / name / "train.log").read_text(), name
        report = json.loads(Path(tmp_path / name / "run_report.json").read_text())
        strategy = report["plan"]["strategy"]
        if name == "matmuls_split":  # the one kept layer's matmul outputs, per step (rank 0's micro-batches), as counted
            from seqpar.advisor.cost.memory import matmul_bytes_per_token
            from seqpar.plan.launch_plan import LaunchPlan

            plan = LaunchPlan.model_validate(report["plan"])
            w, s = plan.workload, plan.strategy
            local = w.micro_batch_size * w.seq_len / s.sp_degree * s.gradient_accumulation_steps
            expected = matmul_bytes_per_token(w.model, "fp32") * local
            assert report["kept_matmuls"] == {"gpu_bytes": expected, "host_bytes": 0.0, "recomputed_bytes": 0.0}
        else:
            assert "kept_matmuls" not in report
        assert {k: strategy[k] for k in ("checkpoint_layers", "offload_layers")} == {
            "checkpoint_layers": 1,
            "offload_layers": fields.get("offload_layers"),
        }


def test_the_trainer_integration_reads_the_split_from_a_plan():
    from seqpar.runtime.hf.trainer import SeqparArguments

    plan = make_plan(2, "zigzag_ring_attn", 2, mbs=2, checkpointing="offload")
    plan = plan.model_validate({**plan.model_dump(), "strategy": {**plan.strategy.model_dump(), "checkpoint_layers": 2}})
    args = SeqparArguments.from_plan(plan)
    assert (args.checkpointing, args.checkpoint_layers, args.offload_layers) == ("offload", 2, None)
    plan = make_plan(2, "zigzag_ring_attn", 2, mbs=2, checkpointing="selective")
    strategy = {**plan.strategy.model_dump(), "checkpoint_layers": 1, "kept_saves": "matmuls"}
    args = SeqparArguments.from_plan(plan.model_validate({**plan.model_dump(), "strategy": strategy}))
    assert (args.checkpointing, args.checkpoint_layers, args.kept_saves, args.kept_host_layers) == ("selective", 1, "matmuls", 0)
