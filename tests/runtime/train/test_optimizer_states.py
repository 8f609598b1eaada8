"""The trainer's AdamW allocates its moments before the first step (seqpar.runtime.train.engine.allocate_states), and that
changes nothing a run computes: against torch's own lazily initialised AdamW on a real (tiny) transformers model, the
parameters and states after every step are bit for bit the same, and the first step's peak holds the moments."""

from __future__ import annotations

import copy

import torch

from seqpar.runtime.hf.model import build_model
from seqpar.runtime.train import engine

from seqpar_testing.train import make_plan


def _model():
    plan = make_plan(1, steps=4)
    plan = plan.model_copy(update={"training": plan.training.model_copy(update={"weight_decay": 0.1})})  # decay exercised
    t = plan.training
    model = build_model(plan.workload.model, model_path=None, seed=t.seed, rope_theta=t.rope_theta, dtype=torch.float32)
    return plan, model


def _state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def test_states_exist_before_the_first_step_and_the_parameters_are_untouched():
    plan, model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = engine.make_optimizer(model, plan)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(opt.state) == len(params) > 0
    for p in params:
        st = opt.state[p]
        assert float(st["step"]) == 0.0 and p.grad is None
        assert torch.count_nonzero(st["exp_avg"]) == 0 and torch.count_nonzero(st["exp_avg_sq"]) == 0
        assert st["exp_avg"].shape == p.shape and st["exp_avg"].dtype == p.dtype
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # the zero-gradient step at lr 0 moved nothing, weight decay included
    moments = 2 * sum(p.numel() * p.element_size() for p in params)
    assert moments <= _state_bytes(opt) <= moments + 8 * len(params)  # the two moments, plus one step scalar each
    assert [g["lr"] for g in opt.param_groups] == [plan.training.learning_rate]  # lr put back
    engine.allocate_states(opt)  # states exist: nothing happens (a resumed run's loaded states stay)
    assert all(float(opt.state[p]["step"]) == 0.0 for p in params)


def test_training_matches_torch_adamw_bit_for_bit():
    plan, model = _model()
    ref_model = copy.deepcopy(model)
    opt = engine.make_optimizer(model, plan)
    t = plan.training
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay, foreach=False)
    assert t.weight_decay == 0.1
    sched, ref_sched = engine.make_scheduler(opt, plan, 4), engine.make_scheduler(ref_opt, plan, 4)
    ids = torch.randint(0, plan.workload.model.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    for step in range(4):
        for m, o, s in ((model, opt, sched), (ref_model, ref_opt, ref_sched)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), f"step {step + 1}: {n}"
        for p, q in zip(model.parameters(), ref_model.parameters()):
            a, b = opt.state[p], ref_opt.state[q]
            assert float(a["step"]) == float(b["step"]) == step + 1
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert not torch.equal(next(model.parameters()), next(copy.deepcopy(_model()[1]).parameters()))  # it trained


def test_optimizer_none_has_no_states():
    plan, model = _model()
    plan = plan.model_copy(update={"workload": plan.workload.model_copy(update={"optimizer": "none"})})
    assert engine.make_optimizer(model, plan) is None
