"""DeepSpeed ZeRO-2, ZeRO-3 and ZeRO-3 with CPU offload on real gloo CPU ranks, against DDP and FSDP2 of the same plan.

DeepSpeed's CPU accelerator runs its collectives over gloo, so the zero* plans the advisor prints run here as they run on
GPUs (through accelerate); nothing stands in for them. Each mode's plan trains 10 steps with an engine and with DDP:
losses and gradient norms must agree within fp32's 1e-4 (relative, the trainer tests' tolerance; the CPU Adam of
zero3_offload rounds differently from torch's AdamW at ~1e-6). The plans spread the features over the modes: gradient
accumulation, a cosine LR schedule, clipping below the gradient norm (DeepSpeed clips and reports its own pre-clip norm),
the chunked loss with ZeRO-3 (the head gathered for it), full recompute, a hybrid sp x dp layout. Then DeepSpeed's own
checkpoint (in the 2-rank matrix's spawn): a crash after the step-3 checkpoint, --resume, and the steps after it equal
the uninterrupted run exactly; the save_pretrained export loads in plain transformers with the weights DeepSpeed's
checkpoint holds (zero_to_fp32). Last, the same through ``seqpar launch`` (accelerate launch on CPU ranks).

The default set samples the matrices (SAMPLE): each zero* engine once on 2 ranks, on the mode whose features meet it,
one hybrid sp x dp layout with ZeRO-3 on 4 ranks, and one ZeRO stage's crash, resume and export. The slow set
(``pytest -m slow``, which CI runs) holds the rest: every mode with every engine, FSDP2 included, on 2 and 4 ranks, and
the other stages' crash, resume and export.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from seqpar_testing.train import learnable_tokens, make_plan, read_metrics, train_cases

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="the deepspeed extra is not installed (CI installs it: .ci/run)"
)

SHARDINGS = ["ddp", "fsdp", "zero2", "zero3", "zero3_offload"]
STEPS = 10


def _with(plan, **training):
    return plan.model_copy(update={"training": plan.training.model_copy(update=training)})


def mode_plans(w: int, steps: int = STEPS) -> dict:
    """One plan per mode (given the sharding), each exercising other features beside the engine."""
    return {
        "data_parallel": lambda sh: _with(make_plan(w, ga=2, sharding=sh, steps=steps), lr_schedule="cosine", weight_decay=0.1),
        "zigzag_ring_attn": lambda sh: make_plan(w, "zigzag_ring_attn", 2, ga=2, sharding=sh, steps=steps),  # W=4: sp 2 x dp 2
        "dist_flash_attn": lambda sh: _with(make_plan(w, "dist_flash_attn", w, ga=2, sharding=sh, steps=steps), grad_clip=0.5),
        "ulysses_attn": lambda sh: _with(
            make_plan(w, "ulysses_attn", w, mbs=2, loss_impl="chunked", sharding=sh, steps=steps), weight_decay=0.1
        ),
        "usp_attn": lambda sh: make_plan(w, "usp_attn", w, ulysses=2, mbs=2, checkpointing="full", sharding=sh, steps=steps),
    }


def _check_matrix(results: dict, cases: list, folder: Path) -> None:
    """Every zero* and FSDP2 run against its mode's DDP run: the same steps, losses, gradient norms and LRs."""
    plans = dict(cases)
    for mode in dict.fromkeys(name.rsplit("-", 1)[0] for name in plans):
        ddp = results[f"{mode}-ddp"]
        assert [r["step"] for r in ddp] == list(range(1, STEPS + 1))
        assert ddp[-1]["loss"] < ddp[0]["loss"] - 0.3, mode  # it learned: equality would prove little otherwise
        clip = plans[f"{mode}-ddp"].training.grad_clip
        assert max(r["grad_norm"] for r in ddp) > clip, mode  # clipping acted
        for sh in [sh for sh in SHARDINGS[1:] if f"{mode}-{sh}" in plans]:
            got = results[f"{mode}-{sh}"]
            for key in ("loss", "grad_norm", "lr"):
                np.testing.assert_allclose(
                    [r[key] for r in got], [r[key] for r in ddp], rtol=1e-4, err_msg=f"{mode} {sh} vs ddp: {key}"
                )
        if f"{mode}-zero3_offload" in plans:
            engine = json.loads((folder / f"{mode}-zero3_offload" / "run_report.json").read_text())["engine"]
            assert engine == "deepspeed-zero3-offload"


# (mode, engine) pairs: the default set's sample, and the slow set's rest of every mode x engine. On 2 ranks each zero*
# engine meets the features it handles apart: ZeRO-2's partitioned gradients under accumulation and a cosine schedule
# (data_parallel), ZeRO-3's gathered head under the chunked loss (ulysses_attn), ZeRO-3 offload's CPU Adam under
# clipping (dist_flash_attn). On 4 ranks, ZeRO-3 over a hybrid sp 2 x dp 2 layout (zigzag_ring_attn).
EVERY = [(m, sh) for m in mode_plans(2) for sh in SHARDINGS[1:]]
SAMPLE = {
    2: [("data_parallel", "zero2"), ("ulysses_attn", "zero3"), ("dist_flash_attn", "zero3_offload")],
    4: [("zigzag_ring_attn", "zero3")],
}
PAIRS = {
    (w, part): SAMPLE[w] if part == "sample" else [p for p in EVERY if p not in SAMPLE[w]]
    for w in (2, 4)
    for part in ("sample", "rest")
}
CRASH_STAGES = {"sample": ["zero3_offload"], "rest": ["zero2", "zero3"]}
PARTS = ["sample", pytest.param("rest", marks=pytest.mark.slow)]


def matrix_cases(w: int, pairs: list) -> list:
    """(name, plan) for each (mode, engine) pair, each mode's DDP run (its reference) first."""
    plans = mode_plans(w)
    modes = dict.fromkeys(m for m, _ in pairs)
    return [(f"{m}-{sh}", plans[m](sh)) for m in modes for sh in ["ddp"] + [sh for mm, sh in pairs if mm == m]]


def crash_plans(stages, w: int = 2) -> list:
    """Per ZeRO stage, a plan checkpointing at step 3 of 6 (for the crash at step 6, --resume and the export)."""
    return [
        (
            sh,
            _with(
                make_plan(w, "zigzag_ring_attn", w, ga=2, loss_impl="chunked", sharding=sh, steps=6, checkpoint_every=3),
                lr_schedule="cosine",
                warmup_steps=1,
                weight_decay=0.1,
            ),
        )
        for sh in stages
    ]


def _two_rank_runs(rank, world, matrix, tmp, data, plans):
    """Every 2-rank run of this file in one spawn: a rank's import of DeepSpeed (and of the torch compiler it pulls in)
    and its first engine cost seconds, paid here once instead of once per test."""
    runs = train_cases(rank, world, matrix, tmp, data)
    return runs, _crash_resume_export(rank, world, str(Path(tmp) / "resume"), plans)


@pytest.fixture(scope="module", params=PARTS)
def two_ranks(request, tmp_path_factory, deepspeed_ops):
    """The 2-rank matrix and crash/resume/export runs of one part (the sample, or the slow set's rest) in one spawn (its
    time the sum of the two tests' budgets); the tests below each assert their part. A run that raises fails both tests
    with a traceback naming it."""
    from seqpar_testing import run_ranks

    tmp = tmp_path_factory.mktemp(f"deepspeed-W2-{request.param}")
    (tmp / "resume").mkdir()
    matrix, plans = matrix_cases(2, PAIRS[2, request.param]), crash_plans(CRASH_STAGES[request.param])
    data = learnable_tokens(tmp / "tokens.npy")
    runs, resumed = run_ranks(_two_rank_runs, 2, matrix, str(tmp), data, plans, timeout=840 + 560)[0]
    return tmp, matrix, runs, resumed, plans


# The module's 2-rank spawn (both tests' runs) sets up in whichever of the two runs first: each has both budgets.
TWO_RANKS_TIMEOUT = 900 + 600


@needs_deepspeed
@pytest.mark.timeout(TWO_RANKS_TIMEOUT)
def test_zero_and_fsdp2_plans_equal_ddp_on_2_ranks(two_ranks):
    tmp, matrix, runs, _, _ = two_ranks
    _check_matrix(runs, matrix, tmp)


@needs_deepspeed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("part", PARTS)
def test_zero_and_fsdp2_plans_equal_ddp_on_4_ranks(tmp_path, part, deepspeed_ops):
    from seqpar_testing import run_ranks

    cases = matrix_cases(4, PAIRS[4, part])
    data = learnable_tokens(tmp_path / "tokens.npy")
    results = run_ranks(train_cases, 4, cases, str(tmp_path), data, timeout=840)[0]
    _check_matrix(results, cases, tmp_path)


# --------------------------------------------------------------------------------------------- checkpoint, resume, export


def _crash_resume_export(rank, world, tmp, plans):
    """Per sharding: a run that crashes on every rank at the start of step 6 (steps 1-5 done, checkpoint at 3), then
    --resume from step 3 to the end; rank 0 returns the metrics of both attempts, and compares the final export with
    DeepSpeed's fp32 consolidation of its own checkpoint (zero_to_fp32)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from seqpar.runtime.checkpoint.deepspeed import consolidated_fp32
    from seqpar.runtime.checkpoint.shards import latest
    from seqpar.runtime.train.loop import parser, run

    out = {}
    for name, plan in plans:
        plan_file, folder = str(Path(tmp) / f"{name}.json"), str(Path(tmp) / name)
        if rank == 0:
            plan.write(plan_file)
        dist.barrier()
        os.environ.update(SEQPAR_FAULT_RANK=str(rank), SEQPAR_FAULT_STEP="6")  # every rank raises before step 6
        try:
            run(parser().parse_args(["--plan", plan_file, "--output", folder]))
            crashed = False
        except RuntimeError:
            crashed = True
        finally:
            os.environ.pop("SEQPAR_FAULT_RANK"), os.environ.pop("SEQPAR_FAULT_STEP")
        first = read_metrics(folder) if rank == 0 else None  # steps 1-5; the resumed run keeps 1-3 and redoes 4-5
        try:
            run(parser().parse_args(["--plan", plan_file, "--output", folder, "--resume"]))
        except Exception as e:  # several ZeRO stages share one spawn: name the one that broke
            raise RuntimeError(f"--resume of {name} failed on rank {rank}") from e
        dist.barrier()
        if rank == 0:
            last = latest(Path(folder) / "checkpoints")
            exported = AutoModelForCausalLM.from_pretrained(last / "model").state_dict()
            ds = consolidated_fp32(last / "deepspeed")  # DeepSpeed's zero_to_fp32 over seqpar's pickle-free states
            # compared here: tensors sent back through the result queue would outlive this process's shared memory
            differ = sorted(k for k, v in ds.items() if not torch.equal(exported[k.removeprefix("model.")], v))
            names = (sorted(k.removeprefix("model.") for k in ds), sorted(exported))
            out[name] = dict(crashed=crashed, first=first, resumed=read_metrics(folder), differ=differ, names=names)
    return out


@needs_deepspeed
@pytest.mark.timeout(TWO_RANKS_TIMEOUT)
def test_deepspeed_checkpoint_resumes_exactly_and_exports_loadable_weights(two_ranks):
    results, plans = two_ranks[3:]
    assert sorted(results) == sorted(name for name, _ in plans)
    for name, r in results.items():
        assert r["crashed"], name
        assert [m["step"] for m in r["first"]] == [1, 2, 3, 4, 5] and [m["step"] for m in r["resumed"]] == list(range(1, 7))
        for key in ("loss", "grad_norm", "lr"):  # loss for loss: steps 4 and 5 after the resume repeat the first attempt's
            assert [m[key] for m in r["resumed"][:5]] == [m[key] for m in r["first"]], f"{name}: {key}"
        ds_names, exported_names = r["names"]
        assert set(ds_names) <= set(exported_names) and "lm_head.weight" in exported_names, name
        assert r["differ"] == [], f"{name}: the export differs from DeepSpeed's checkpoint in {r['differ']}"


# --------------------------------------------------------------------------------------------- through seqpar launch


@needs_deepspeed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("crash", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["to-the-end", "crash-and-resume"])
def test_seqpar_launch_runs_zero3_on_deepspeed_under_accelerate(tmp_path, deepspeed_ops, crash):
    """The CLI path (accelerate launch on CPU ranks) to the end of the plan. With ``crash`` (the slow set; DeepSpeed's
    resume is the in-process test's above): a fault on rank 1 at step 6 ends the job and names the rank first, and
    --resume from the step-4 checkpoint repeats step 5 exactly and finishes."""
    plan = make_plan(2, "ulysses_attn", 2, ga=2, sharding="zero3", loss_impl="chunked", steps=6, checkpoint_every=4)
    plan_file = tmp_path / "plan.json"
    plan.write(plan_file)
    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(plan_file), "--output", str(out), "--data", "synthetic"]
    if crash:
        fault = dict(os.environ, SEQPAR_FAULT_RANK="1", SEQPAR_FAULT_STEP="6")
        r = subprocess.run(cmd, env=fault, capture_output=True, text=True, timeout=240)
        assert r.returncode != 0
        assert "accelerate.commands.launch" in r.stderr and "rank 1" in r.stderr.split("first failure:")[-1], r.stderr[-3000:]
        first = read_metrics(out)
        assert [m["step"] for m in first] == [1, 2, 3, 4, 5]
    r = subprocess.run(cmd + (["--resume"] if crash else []), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = read_metrics(out)
    assert [m["step"] for m in got] == list(range(1, 7))
    if crash:
        assert [(m["loss"], m["grad_norm"], m["lr"]) for m in got[:5]] == [(m["loss"], m["grad_norm"], m["lr"]) for m in first]
    else:
        assert "accelerate.commands.launch" in r.stderr, r.stderr[-3000:]
    report = json.loads((out / "run_report.json").read_text())
    assert report["engine"] == "deepspeed-zero3"
    host = report["measured"]["host_memory_gib"]  # the plan's host_memory_gib is per node: both ranks' peak RSS
    assert host == pytest.approx(sum(r["peak_rss_gib"] for r in report["per_rank"])) and host > 0.2
    assert json.loads((out / "deepspeed.json").read_text())["bf16"]["enabled"] is False  # CPU ranks compute in fp32


# --------------------------------------------------------------------------------------------- no substitution, rendezvous


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_several_nodes_need_the_rendezvous_endpoint_for_every_engine(tmp_path, sharding):
    from seqpar.plan.errors import SeqparError
    from seqpar.plan.jobspec import LaunchOptions, build_job

    plan = make_plan(2, "zigzag_ring_attn", 2, sharding=sharding)
    with pytest.raises(SeqparError, match=r"^a job on 2 nodes needs --rdzv-endpoint HOST:PORT, the same on every node"):
        build_job(plan, Path("p.json"), LaunchOptions(nnodes=2, node_rank=1), output=tmp_path)
    with pytest.raises(SeqparError, match=r"--rdzv-endpoint 'node0' is not HOST:PORT"):
        build_job(plan, Path("p.json"), LaunchOptions(nnodes=2, node_rank=1, rdzv_endpoint="node0"), output=tmp_path)
    job = build_job(plan, Path("p.json"), LaunchOptions(nnodes=2, node_rank=1, rdzv_endpoint="node0:29400"), output=tmp_path)
    assert job.launcher == ("accelerate" if sharding.startswith("zero") else "torchrun")
    if job.launcher == "torchrun":
        assert "--rdzv-endpoint node0:29400" in " ".join(job.argv)
        return
    acc = json.loads(job.configs["accelerate.yaml"])  # JSON is YAML
    assert (acc["main_process_ip"], acc["main_process_port"], acc["machine_rank"], acc["num_machines"]) == ("node0", 29400, 1, 2)
    assert acc["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"  # torchrun's c10d, not pdsh over ssh
    assert acc["rdzv_backend"] == "c10d" and "127.0.0.1" not in job.configs["accelerate.yaml"]
    one = json.loads(build_job(plan, Path("p.json"), LaunchOptions(), output=tmp_path).configs["accelerate.yaml"])
    assert one["main_process_port"] == 0 and "main_process_ip" not in one  # one node: a free local port


def test_zero_plans_run_deepspeed_or_are_refused_never_fsdp2(tmp_path, monkeypatch):
    import importlib.util as iu

    from typer.testing import CliRunner

    from seqpar.cli import app
    from seqpar.plan.errors import SeqparError
    from seqpar.plan.launch_plan import LaunchPlan
    from seqpar.runtime.train import engine

    plan = make_plan(2, "zigzag_ring_attn", 2, sharding="zero3")
    with pytest.raises(SeqparError, match="runs on DeepSpeed"):
        engine.wrap(None, plan, None)  # the FSDP2/DDP wrapper takes no zero* plan, on any device
    plan_file = tmp_path / "plan.json"
    plan.write(plan_file)
    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    r = CliRunner().invoke(app, ["launch", str(plan_file), "--output", str(tmp_path / "o")])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output  # a missing extra: one line naming it (seqpar.plan.extras), exit 1
    assert "sharding 'zero3' (DeepSpeed through accelerate" in lines[0] and "needs deepspeed, which is not installed" in lines[0]
    # the recipe that installs it, offline too: its ops build on first use and its setup imports torch
    assert "DS_BUILD_OPS=0 pip install --no-build-isolation" in lines[0] and "source archive" in lines[0], lines[0]
    assert not (tmp_path / "o").exists()
    data = json.loads(plan.model_dump_json())
    data["workload"]["optimizer"] = "none"
    with pytest.raises(ValueError, match="sharding zero3 runs DeepSpeed's AdamW"):  # CPU plans too, as on CUDA
        LaunchPlan.model_validate(data)
