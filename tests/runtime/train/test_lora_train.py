"""LoRA plans through the trainer on real gloo ranks: every engine (DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3) against the
data_parallel DDP run of the same adapters, step by step, and the adapter each run exports.

The plans train the tiny model's adapters (rank 4 on all seven linear layers, dropout 0) for 8 steps on a learnable
token file; each sequence-parallel or sharded run reads the same windows per step as the reference (seqpar_testing.train's
layouts), so its losses and gradient norms must equal the reference's within seqpar_testing.train's per-step fp32
tolerance, and the adapter its final checkpoint exports (peft's layout, gathered from DDP, FSDP2's DTensors or
DeepSpeed's fp32 masters) must hold the reference's values (relative 1e-4: eight steps of AdamW on round-off), and so
must the merged model each writes with --merge-lora (the whole weights gathered from each engine). Also
the runs' checkpoints: only the adapters and their moments are saved; and the refusals: the plan rules' for LoRA,
seqpar launch's for --merge-lora without adapters or without a final checkpoint, and for a missing extra.

Default set: the reference, zigzag FSDP2, dist_flash ZeRO-3 with the chunked loss, usp with a 4-bit base and offloaded
checkpoints (one spawn). Slow set: zigzag DDP, ulysses ZeRO-2, and hybrid sp 2 x dp 2 layouts on 4 ranks.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from seqpar.plan.specs import LoraSpec

from seqpar_testing import run_ranks
from seqpar_testing.train import RTOL_PER_STEP, learnable_tokens, make_plan, train_cases

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="the lora extra (peft) is not installed")
HAS_DS = importlib.util.find_spec("deepspeed") is not None
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
STEPS = 8
LORA = LoraSpec(rank=4, alpha=8)


def _plan(w, mode="data_parallel", sp=1, base="bf16", **kw):
    return make_plan(w, mode, sp, steps=STEPS, lora=LORA.model_copy(update={"base_dtype": base}), **kw)


def two_rank_cases(part: str) -> list:
    """The default set: FSDP2, ZeRO-3 and a 4-bit base (each with its reference); the slow set: DDP and ZeRO-2."""
    w = 2
    cases = {"ref": _plan(w)}
    if part == "sample":
        cases["zigzag_fsdp"] = _plan(w, "zigzag_ring_attn", w, mbs=w, sharding="fsdp")
        if HAS_DS:
            cases["dist_flash_zero3_chunked"] = _plan(w, "dist_flash_attn", w, ga=w, sharding="zero3", loss_impl="chunked")
        if HAS_BNB:  # a 4-bit base computes another model: its own reference
            cases["nf4_ref"] = _plan(w, base="nf4")
            cases["nf4_usp_offload"] = _plan(w, "usp_attn", w, ulysses=2, mbs=w, base="nf4", checkpointing="offload")
    else:
        cases["zigzag_ddp"] = _plan(w, "zigzag_ring_attn", w, mbs=w)
        if HAS_DS:
            cases["ulysses_zero2_full"] = _plan(w, "ulysses_attn", w, mbs=w, sharding="zero2", checkpointing="full")
    return list(cases.items())


def _adapter(folder: Path, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / name / "checkpoints" / f"step-{STEPS:06d}" / "adapter" / "adapter_model.safetensors")


def _merged(folder: Path, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / name / "checkpoints" / f"step-{STEPS:06d}" / "model" / "model.safetensors")


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def compare(results: dict, folder: Path) -> None:
    """Every run's losses and gradient norms against its reference's (``ref``, or ``nf4_ref`` for a 4-bit base; step i
    within i x RTOL_PER_STEP), and the adapter it exported."""
    rtol = RTOL_PER_STEP * np.arange(1, STEPS + 1)
    for name, got in results.items():
        ref = "nf4_ref" if name.startswith("nf4") else "ref"
        want, ref_adapter = results[ref], _adapter(folder, ref)
        assert [r["step"] for r in want] == list(range(1, STEPS + 1))
        assert want[-1]["loss"] < want[0]["loss"] - 0.05, want  # the adapters learned: equality would prove little else
        assert len(ref_adapter) == 2 * 7 * 2 and all(k.startswith("base_model.model.model.layers.") for k in ref_adapter)
        for key in ("loss", "grad_norm"):
            a, b = np.array([r[key] for r in got]), np.array([r[key] for r in want])
            bad = np.abs(a - b) > rtol * np.abs(b)
            assert not bad.any(), f"{name}: {key} differs at steps {list(np.flatnonzero(bad) + 1)}: {a[bad]} vs {b[bad]}"
        mine = _adapter(folder, name)
        assert sorted(mine) == sorted(ref_adapter), name
        for k, v in ref_adapter.items():
            np.testing.assert_allclose(
                mine[k].numpy(), v.numpy(), rtol=1e-4, atol=1e-4 * float(v.abs().max()), err_msg=f"{name} {k}"
            )
        shards = sorted((folder / name / "checkpoints" / f"step-{STEPS:06d}" / "state").glob("*.safetensors"))
        keys = {k for f in shards for k in _keys(f)}
        assert not shards or (keys and all("lora_" in k for k in keys)), (name, sorted(keys)[:4])  # no base weight
        counted = LORA.adapter_params(make_plan(2).workload.model)  # the plan's count; the log line says peft's
        assert f": {counted:,} adapter parameters train, the base is frozen" in (folder / name / "train.log").read_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("part", ["sample", pytest.param("rest", marks=pytest.mark.slow)])
def test_lora_in_every_engine_matches_data_parallel_and_exports_the_same_adapter(tmp_path, part):
    data = learnable_tokens(tmp_path / "tokens.npy")
    cases = two_rank_cases(part)
    results = run_ranks(train_cases, 2, cases, str(tmp_path), data, ("--merge-lora",), timeout=280)[0]
    assert sorted(results) == sorted(name for name, _ in cases)
    compare(results, tmp_path)
    merged = {name: _merged(tmp_path, name) for name in results}  # gathered from each engine, merged on rank 0
    for name, weights in merged.items():
        ref = merged["nf4_ref" if name.startswith("nf4") else "ref"]
        assert sorted(weights) == sorted(ref), name
        for k, v in ref.items():
            np.testing.assert_allclose(
                weights[k].numpy(), v.numpy(), rtol=1e-4, atol=1e-4 * float(v.abs().max()), err_msg=f"{name} {k}"
            )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_hybrid_sp_dp_on_4_ranks(tmp_path):
    data = learnable_tokens(tmp_path / "tokens.npy")
    cases = [("ref", _plan(4)), ("hybrid_fsdp", _plan(4, "zigzag_ring_attn", 2, ga=2, sharding="fsdp"))]
    if HAS_BNB:
        cases += [("nf4_ref", _plan(4, base="nf4")), ("nf4_hybrid", _plan(4, "usp_attn", 2, ulysses=2, ga=2, base="nf4"))]
    compare(run_ranks(train_cases, 4, cases, str(tmp_path), data, timeout=280)[0], tmp_path)


def test_plans_refuse_what_lora_cannot_run():
    """One line each, naming the value, the rule and a fix."""
    nf4 = LORA.model_copy(update={"base_dtype": "nf4"})
    for sharding in ("fsdp", "zero2", "zero3"):
        with pytest.raises(
            ValueError, match=f"base_dtype nf4 keeps the 4-bit base whole .*sharding {sharding} .*use sharding ddp"
        ):
            make_plan(2, "zigzag_ring_attn", 2, sharding=sharding, lora=nf4)
    dropout = LORA.model_copy(update={"dropout": 0.1})
    with pytest.raises(ValueError, match="tiled_mlp with lora dropout 0.1 on gate_proj up_proj down_proj"):
        make_plan(2, tiled_mlp=True, lora=dropout)
    make_plan(2, tiled_mlp=True, lora=dropout.model_copy(update={"target_modules": ["q_proj", "v_proj"]}))  # no MLP: fine


@pytest.mark.parametrize("hide, extra", [("peft", "lora"), ("bitsandbytes", "qlora")])
def test_a_lora_plan_without_its_extra_is_one_line_naming_it(tmp_path, hide, extra):
    """seqpar launch checks before any rank starts: exit 1 (the install lacks it), one line with the install command."""
    import re
    import subprocess
    import sys

    _plan(2, base="nf4" if extra == "qlora" else "bf16").write(tmp_path / "lora.json")
    code = f"import sys; sys.modules[{hide!r}] = None\nfrom seqpar.cli import app\napp(sys.argv[1:], prog_name='seqpar')"
    args = ["launch", "lora.json", "--force", "--steps", "1"]
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert re.fullmatch(rf"error: .* needs {hide}, which is not installed: pip install .*\[{extra}\].*", lines[0]), lines[0]
    assert not (tmp_path / "runs" / "lora" / "checkpoints").exists()


def test_merge_lora_is_refused_where_there_is_nothing_to_merge(tmp_path):
    from seqpar_testing.cli import one_error_line, run

    make_plan(2).write(tmp_path / "full.json")
    _plan(2).write(tmp_path / "lora.json")
    r = run("launch", tmp_path / "full.json", "--dry-run", "--merge-lora")
    assert r.exit_code == 2 and "this plan trains every parameter (no workload.lora" in one_error_line(r)
    r = run("launch", tmp_path / "lora.json", "--dry-run", "--merge-lora", "--no-final-checkpoint")
    assert r.exit_code == 2 and "which --no-final-checkpoint skips; drop one" in one_error_line(r)
    r = run("launch", tmp_path / "lora.json", "--dry-run", "--merge-lora", "--output", tmp_path / "o")
    assert r.exit_code == 0, r.stderr
    from seqpar.runtime.train.loop import parser

    cmd = next(ln for ln in r.stdout.splitlines() if "seqpar.runtime.train" in ln).split()
    assert parser().parse_args(cmd[cmd.index("seqpar.runtime.train") + 1 :]).merge_lora  # the job carries it to the ranks


def test_checkpoint_sizes_count_the_adapters_alone():
    """What seqpar launch's free-space check counts for a LoRA plan: adapters and AdamW moments in fp32 (12 bytes per
    adapter parameter); the export is the adapter (4 bytes each), plus the whole model in the plan's dtype when merged."""
    from seqpar.runtime.checkpoint.storage import sizes

    plan = _plan(2)
    a, n = LORA.adapter_params(plan.workload.model), plan.workload.model.num_params
    assert a == 8192  # rank 4 x (in + out) of the tiny model's seven linears, 2 layers (peft counts the same: the log)
    assert (sizes(plan).checkpoint, sizes(plan).export) == (12 * a, 4 * a)
    assert sizes(plan, merge=True).export == 4 * a + 4 * n  # fp32 plan
