"""`seqpar verify` against modes broken on purpose: it passes correct plans and fails each breakage.

Correct plans (several modes and engines, 2 and 4 gloo ranks; on 4 ranks the cases 2 ranks cover are in the slow set,
``pytest -m slow``, which CI runs) must pass within fp32's tolerance (1e-5 x W). Each breakage is a real failure reported in the
field, made in the ranks with unittest.mock: a ring step dropped from zigzag's forward, one rank's positions shifted by
one (RoPE sees the wrong place), the attention override skipped (the model runs its own attention on its shard alone, as
after a transformers upgrade that bypasses the interface). verify must fail each time, naming what differs. The CLI test runs the
real job (torchrun) and checks the exit codes and --json.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path
from unittest import mock

import pytest
from typer.testing import CliRunner

from seqpar.cli import app

from seqpar_testing.train import make_plan

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _drop_last_ring_step():
    """zigzag's forward without its last ring step's block (sp = W): the kernels merge it into nothing."""
    import seqpar.runtime.parallel.zigzag_ring_attn as zz

    real = zz.kernels

    class Kernels:
        def __init__(self):
            self.merges = 0

        def __getattr__(self, name):
            return getattr(real, name)

        def merge(self, out, lse, bo, bl):  # called once per ring step
            import torch.distributed as dist

            self.merges += 1
            return (out, lse) if self.merges % dist.get_world_size() == 0 else real.merge(out, lse, bo, bl)

    return mock.patch.object(zz, "kernels", Kernels())


def _shift_positions_on_rank_1():
    import seqpar.runtime.parallel.inputs as inputs

    real = inputs.prepare_inputs

    def shifted(input_ids, mode, rank, world_size, **kw):
        out = real(input_ids, mode, rank, world_size, **kw)
        if rank == 1:
            out["position_ids"] = out["position_ids"] + 1
        return out

    return mock.patch.object(inputs, "prepare_inputs", shifted)


def _skip_attention_override():
    import seqpar.runtime.hf.apply as hf

    return mock.patch.object(hf, "apply", lambda model, *a, **kw: model)


BREAKAGES = {
    "none": contextlib.nullcontext,
    "drop_ring_step": _drop_last_ring_step,
    "shift_positions": _shift_positions_on_rank_1,
    "skip_override": _skip_attention_override,
}


def _verify_cases(rank, world, tmp, cases):
    import torch.distributed as dist

    from seqpar.plan.errors import SeqparError
    from seqpar.plan.job_options import VerifyOptions
    from seqpar.runtime.train.verify import verify_ranks

    results = {}
    for name, plan, breakage in cases:
        plan_file = Path(tmp) / f"{name}.json"
        if rank == 0:
            plan.write(plan_file)
        dist.barrier()
        with BREAKAGES[breakage]():
            try:
                results[name] = verify_ranks(VerifyOptions(plan=str(plan_file), output=str(Path(tmp) / name)))
            except SeqparError as e:  # every rank checks the gathered positions: the same refusal everywhere, no hang
                results[name] = {"refused": str(e)}
    return results if rank == 0 else None


def _zero(sharding: str) -> str:
    return sharding if HAS_DEEPSPEED else "fsdp"


SEQ = 128


def verify_cases(w: int) -> list:
    """(name, plan, breakage): correct plans over the modes and engines, then each breakage."""
    return [
        ("zigzag", make_plan(w, "zigzag_ring_attn", w, seq_len=SEQ), "none"),
        ("ulysses_fsdp_chunked", make_plan(w, "ulysses_attn", w, seq_len=SEQ, sharding="fsdp", loss_impl="chunked"), "none"),
        ("usp_zero3", make_plan(w, "usp_attn", w, ulysses=2, seq_len=SEQ, sharding=_zero("zero3")), "none"),
        ("dist_flash_ckpt", make_plan(w, "dist_flash_attn", w, seq_len=SEQ, checkpointing="full"), "none"),
        ("hybrid", make_plan(w, "zigzag_ring_attn", 2, seq_len=SEQ), "none"),
        ("zigzag_shifted", make_plan(w, "zigzag_ring_attn", w, seq_len=SEQ), "shift_positions"),
        ("ulysses_no_override", make_plan(w, "ulysses_attn", w, seq_len=SEQ), "skip_override"),
        ("zigzag_dropped", make_plan(w, "zigzag_ring_attn", w, seq_len=SEQ), "drop_ring_step"),
    ]


# W=2 runs every case. On 4 ranks: the hybrid layout 2 ranks cannot have (zigzag sp 2 x dp 2) and a ring of 4 missing a
# step; the other cases on 4 ranks (usp ulysses 2 x ring 2 on ZeRO-3, FSDP2, the other breakages) are the slow set.
FOUR_RANKS = ["hybrid", "zigzag_dropped"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "w, names",
    [
        pytest.param(2, None, id="W2"),
        pytest.param(4, FOUR_RANKS, id="W4"),
        pytest.param(4, [n for n, _, _ in verify_cases(4) if n not in FOUR_RANKS], id="W4-more", marks=pytest.mark.slow),
    ],
)
def test_verify_passes_correct_plans_and_fails_broken_modes(tmp_path, w, names, deepspeed_ops):  # usp_zero3 runs DeepSpeed
    from seqpar_testing import run_ranks

    seq = SEQ
    cases = [c for c in verify_cases(w) if names is None or c[0] in names]
    results = run_ranks(_verify_cases, w, str(tmp_path), cases, timeout=560)[0]
    for name, _, breakage in cases:
        r = results[name]
        if "refused" in r:  # shifted positions break the document rules before any comparison: caught as well, earlier
            assert breakage == "shift_positions" and "position_ids go from" in r["refused"], (name, r)
            continue
        assert r["world_size"] == w and r["dtype"] == "fp32" and r["tolerance"] == pytest.approx(1e-5 * w), name
        assert r["seq_len"] == seq // r["sp_degree"] // (m := _mult(r)) * m, name  # the default length
        if breakage == "none":
            assert r["ok"], f"{name}: {r['mismatch']}"
            assert r["loss"]["rel_diff"] < 1e-6 and r["grads"]["params"] > 0
        else:
            assert not r["ok"], f"{name} ({breakage}) passed: {r}"
            assert "differs by" in r["mismatch"] and "tolerance" in r["mismatch"], r["mismatch"]
            assert r["grads"]["max_rel_diff"] > 100 * r["tolerance"], r  # far outside, not at the edge


def _mult(r: dict) -> int:
    from seqpar.plan.modes import split_multiple

    return split_multiple(r["mode"], r["sp_degree"], 2 if r["mode"] == "usp_attn" else None)


# --------------------------------------------------------------------------------------------- the command


def test_verify_command_runs_the_job_and_exits_by_the_verdict(tmp_path, monkeypatch):
    plan_file = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2, seq_len=128).write(plan_file)
    runner = CliRunner()
    r = runner.invoke(app, ["verify", str(plan_file), "--output", str(tmp_path / "o"), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res[0]["ok"] and res[0]["seq_len"] == 64 and res[0]["mode"] == "zigzag_ring_attn"
    assert "seq_len 64 (128 / sp_degree 2)" in r.stderr

    bad = runner.invoke(app, ["verify", str(plan_file), "--seq-len", "66", "--output", str(tmp_path / "o")])
    assert bad.exit_code == 2 and "seq_len 66 is not divisible by" in bad.stderr, bad.output

    # a mismatch: exit 1 with the first one on one line (the job's verdict file, as a broken mode leaves it)
    from seqpar.runtime.train import verify

    failing = {**res[0], "ok": False, "mismatch": "gradient of model.layers.0.mlp.up_proj.weight differs by 3.1e-02"}
    monkeypatch.setattr(verify, "run_verify", lambda *a, **k: [failing])
    r = runner.invoke(app, ["verify", str(plan_file), "--output", str(tmp_path / "o")])
    assert r.exit_code == 1 and "MISMATCH" in r.stderr and "up_proj.weight differs by 3.1e-02" in r.stderr, r.output


def test_launch_verify_gates_training(tmp_path, monkeypatch):
    """--verify runs the check before the job: a mismatch ends the launch with exit 1 and nothing trained."""
    from seqpar.runtime.launch import run as launch
    from seqpar.runtime.train import verify

    plan_file = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2, seq_len=128).write(plan_file)
    seen = []
    monkeypatch.setattr(verify, "run_verify", lambda plan, path, opts, **k: seen.append(opts) or [_FAILED])
    monkeypatch.setattr(launch, "run_job", lambda job: pytest.fail("training started after a failed verify"))
    r = CliRunner().invoke(app, ["launch", str(plan_file), "--verify", "--output", str(tmp_path / "o")])
    assert r.exit_code == 1 and "MISMATCH" in r.stderr, r.output
    assert seen[0].train.output == str(tmp_path / "o")  # verify writes under the run's output (<output>/verify)


_FAILED = {
    "ok": False,
    "mismatch": "loss 5.55 vs reference 5.54 differs by 1.0e-03 (relative; tolerance 2.0e-05 = 1e-05 x W=2 (fp32))",
    "mode": "zigzag_ring_attn",
    "sp_degree": 2,
    "dp_degree": 1,
    "sharding": "ddp",
    "seq_len": 64,
    "dtype": "fp32",
    "world_size": 2,
    "tolerance": 2e-5,
    "tolerance_rule": "1e-05 x W=2 (fp32)",
    "loss": {"plan": 5.55, "reference": 5.54, "rel_diff": 1e-3},
    "grad_norm": {"plan": 1.6, "reference": 1.6, "rel_diff": 0.0},
    "grads": {"params": 21, "max_rel_diff": 1.0, "worst": "model.layers.0.self_attn.q_proj.weight"},
}
