"""`seqpar launch`: refusals before anything runs, the generated commands, and real torchrun jobs that fail and resume.

The end-to-end part starts `seqpar launch` twice on 2 gloo ranks: the first run checkpoints at step 4 and has rank 1 raise
at step 6 (SEQPAR_FAULT_* hook): every process must exit non-zero within 60 s and the output must name rank 1, and
torchrun's ``@record`` on the trainer must have written rank 1's error file with its traceback (one launch serves both
tests: a module fixture). The second
run (`--resume`) continues from step 4; the 8 steps of metrics must equal an uninterrupted in-process run of the same plan.
That in-process run also checks that a crash while a checkpoint is being written leaves the previous one in place, and that
an FSDP2 run (sharded optimizer state) resumed from its step-4 checkpoint repeats steps 5-8 exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.plan.job_options import TrainOptions
from seqpar.plan.jobspec import LaunchOptions, build_job, deepspeed_config, jobs_for
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.specs import ClusterSpec
from seqpar.runtime.launch.run import check_machine

from seqpar_testing.cli import one_error_line
from seqpar_testing.train import make_plan, read_metrics

runner = CliRunner()


def _gpu_plan(tmp_path: Path, gpus: int = 8, sharding: str = "fsdp") -> Path:
    """A plan for one node of ``gpus`` H100s (built from the CPU plan's fields, so no advisor run is needed)."""
    from seqpar.profiles import get_gpu

    data = json.loads(make_plan(2, "zigzag_ring_attn", 2).model_dump_json())
    data["cluster"].update(accelerator="cuda", gpus_per_node=gpus, gpu=json.loads(get_gpu("h100").model_dump_json()))
    data["strategy"].update(sp_degree=gpus, sharding=sharding)
    data["workload"]["dtype"] = "bf16"
    p = tmp_path / "gpu_plan.json"
    p.write_text(json.dumps(data))
    return p


# --------------------------------------------------------------------------------------------- refusals (exit 2, nothing written)


@pytest.mark.parametrize(
    "case, match",
    [
        ("malformed", "is not valid JSON"),
        ("missing_data", "does not exist"),
        ("short_data", "shorter than one window"),
        ("eight_gpus", "does not match this machine: the plan needs 8 x h100"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, case, match):
    plan = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2).write(plan)
    data, extra = "synthetic", []
    if case == "malformed":
        plan.write_text('{"workload": ')
    elif case == "missing_data":
        data = str(tmp_path / "nope.npy")
    elif case == "short_data":
        data = str(tmp_path / "short.npy")
        np.save(data, np.arange(20, dtype=np.uint16))  # fewer than seq_len + 1 = 65 tokens
        extra = ["--no-doc-boundaries"]  # the stream needs one whole window (packed documents get filler)
    elif case == "eight_gpus":
        plan = _gpu_plan(tmp_path)
    out = tmp_path / "out"
    r = runner.invoke(app, ["launch", str(plan), "--data", data, "--output", str(out), "--steps", "2", *extra])
    assert r.exit_code == 2, r.output
    assert match in one_error_line(r)
    assert not out.exists()


def test_output_with_checkpoints_needs_resume(tmp_path):
    plan = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2).write(plan)
    (tmp_path / "out" / "checkpoints" / "step-000001").mkdir(parents=True)
    r = runner.invoke(app, ["launch", str(plan), "--output", str(tmp_path / "out")])
    assert r.exit_code == 2 and "pass --resume" in one_error_line(r)


def test_machine_check():
    cpu4 = make_plan(4, "zigzag_ring_attn", 4).cluster
    assert check_machine(cpu4, gpu_names=[], gpu_profile=None, cpu_count=2, nnodes=1) == []  # oversubscribed gloo is fine
    cpu64 = make_plan(64).cluster
    assert "more than 4 x the 2 cores" in check_machine(cpu64, gpu_names=[], gpu_profile=None, cpu_count=2, nnodes=1)[0]
    gpu = ClusterSpec.model_validate({**cpu4.model_dump(), "accelerator": "cuda", "gpus_per_node": 8})
    name = gpu.gpu.name
    assert check_machine(gpu, gpu_names=["X"] * 8, gpu_profile=name, cpu_count=64, nnodes=1) == []
    diffs = check_machine(gpu, gpu_names=["NVIDIA L4"] * 4, gpu_profile="l4", cpu_count=64, nnodes=2)
    assert len(diffs) == 3 and "1 node(s)" in diffs[0] and "has 4" in diffs[1] and "l4" in diffs[2]


# --------------------------------------------------------------------------------------------- commands


def test_dry_run_prints_the_torchrun_command_and_runs_nothing(tmp_path):
    plan = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2).write(plan)
    r = runner.invoke(app, ["launch", str(plan), "--dry-run", "--output", str(tmp_path / "o"), "--steps", "3"])
    assert r.exit_code == 0, r.output
    cmd = [ln for ln in r.stdout.splitlines() if "torch.distributed.run" in ln]
    assert len(cmd) == 1
    assert "--nproc-per-node 2 --max-restarts 0 --standalone -m seqpar.runtime.train" in cmd[0]
    assert f"--plan {plan}" in cmd[0] and "--steps 3" in cmd[0]
    assert "export SEQPAR_PG_TIMEOUT_S=60" in r.stdout
    assert not (tmp_path / "o").exists()


def test_multi_node_and_deepspeed_commands(tmp_path):
    plan = make_plan(2, "zigzag_ring_attn", 2)
    job = build_job(plan, Path("p.json"), LaunchOptions(nnodes=1, node_rank=0, rdzv_endpoint="node0:29400"), output=tmp_path)
    argv = " ".join(job.argv)
    assert "--node-rank 0 --rdzv-backend c10d --rdzv-endpoint node0:29400" in argv and "--standalone" not in argv
    gplan = _gpu_plan(tmp_path, sharding="zero3_offload")
    r = runner.invoke(app, ["launch", str(gplan), "--dry-run", "--output", str(tmp_path / "ds")])
    assert r.exit_code == 0, r.output
    assert "accelerate.commands.launch --config_file" in r.stdout
    ds = deepspeed_config(LaunchPlan.load(gplan))
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["bf16"]["enabled"] is True
    assert '"stage": 3' in r.stdout
    if importlib.util.find_spec("deepspeed") is None:  # not installed here: refused with the reason
        r = runner.invoke(app, ["launch", str(gplan), "--force", "--output", str(tmp_path / "ds")])
        line = one_error_line(r)  # a missing optional dependency: exit 1 naming the extra (seqpar.plan.extras)
        assert r.exit_code == 1 and "needs deepspeed, which is not installed: pip install" in line and "[deepspeed]" in line


def test_staged_plan_makes_one_job_per_stage(tmp_path):
    from seqpar.plan.launch_plan import Stage

    base = make_plan(2, "zigzag_ring_attn", 2)
    stages = [
        Stage(seq_len=32, rope_theta=1e4, steps=2, strategy=make_plan(2).strategy),
        Stage(seq_len=64, rope_theta=1e5, steps=3, strategy=base.strategy),
    ]
    plan = LaunchPlan.model_validate({**base.model_dump(), "stages": [s.model_dump() for s in stages]})
    jobs = jobs_for(plan, tmp_path / "p.json", LaunchOptions(TrainOptions(output=str(tmp_path / "o"))))
    assert [sp.workload.seq_len for _, sp in jobs] == [32, 64]
    assert [sp.training.rope_theta for _, sp in jobs] == [1e4, 1e5]
    assert "--init-from" not in jobs[0][0].argv
    assert jobs[1][0].argv[jobs[1][0].argv.index("--init-from") + 1] == str(tmp_path / "o" / "stage-0")


# --------------------------------------------------------------------------------------------- real jobs


def _reference_and_torn_checkpoint(rank, world, plan_file, out):
    """Uninterrupted run; then a crash inside the step-8 checkpoint write (both ranks) must keep step-4 as the latest."""
    import torch.distributed as dist

    from seqpar.runtime.checkpoint.resume import latest
    from seqpar.runtime.train.loop import parser, run

    run(parser().parse_args(["--plan", plan_file, "--output", out]))
    dist.barrier()
    torn = out + "-torn"
    os.environ.update(SEQPAR_FAULT_PHASE="checkpoint", SEQPAR_FAULT_RANK=str(rank), SEQPAR_FAULT_STEP="8")
    try:
        run(parser().parse_args(["--plan", plan_file, "--output", torn]))
        raised = False
    except RuntimeError:
        raised = True
    finally:
        for k in ("SEQPAR_FAULT_PHASE", "SEQPAR_FAULT_RANK", "SEQPAR_FAULT_STEP"):
            os.environ.pop(k)
    torn_result = raised, str(latest(Path(torn) / "checkpoints")), sorted(p.name for p in (Path(torn) / "checkpoints").iterdir())

    # FSDP2 (sharded optimizer state): drop the step-8 checkpoint of a finished run, resume from step 4, compare.
    fsdp_plan, full, cut = plan_file.replace(".json", "-fsdp.json"), out + "-fsdp", out + "-fsdp-cut"
    run(parser().parse_args(["--plan", fsdp_plan, "--output", full]))
    if rank == 0:
        shutil.copytree(full, cut)
        shutil.rmtree(Path(cut) / "checkpoints" / "step-000008")
        (Path(cut) / "checkpoints" / "latest").write_text("step-000004\n")
    dist.barrier()
    run(parser().parse_args(["--plan", fsdp_plan, "--output", cut, "--resume"]))
    return torn_result, (read_metrics(full), read_metrics(cut)) if rank == 0 else None


@pytest.fixture(scope="module")
def failed_job(tmp_path_factory):
    """`seqpar launch` of the 8-step plan with rank 1 raising before step 6 (SEQPAR_FAULT_* hook), TMPDIR in the test's
    folder so torchrun's per-rank error files can be read back; what it left, read before anything resumes it."""
    tmp = tmp_path_factory.mktemp("failed_job")
    plan_file, out, tmpdir = tmp / "plan.json", tmp / "job", tmp / "tmp"
    make_plan(2, "zigzag_ring_attn", 2, steps=8, checkpoint_every=4).write(plan_file)
    tmpdir.mkdir()
    env = dict(os.environ, TMPDIR=str(tmpdir), SEQPAR_FAULT_RANK="1", SEQPAR_FAULT_STEP="6")
    cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(plan_file), "--output", str(out), "--data", "synthetic"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    # <log dir>/<run>/attempt_0/<local rank>/error.json
    errors = {f.parent.name: f.read_text() for f in tmpdir.glob("torchelastic_*/*/attempt_0/*/error.json")}
    peer = out / "failed-rank0.json"
    return dict(
        tmp=tmp,
        plan=plan_file,
        out=out,
        cmd=cmd,
        run=r,
        elapsed=elapsed,
        errors=errors,
        tree=sorted(str(p) for p in tmpdir.rglob("*")),
        rank0_record=json.loads(peer.read_text()) if peer.is_file() else None,
        step4=(out / "checkpoints" / "step-000004" / "trainer_state.json").is_file(),
    )


def test_fault_names_the_rank_and_resume_continues_exactly(failed_job):
    from seqpar_testing import run_ranks

    tmp_path, plan_file, out, r = failed_job["tmp"], failed_job["plan"], failed_job["out"], failed_job["run"]
    ref = tmp_path / "ref"
    make_plan(2, "zigzag_ring_attn", 2, steps=8, checkpoint_every=4, sharding="fsdp").write(tmp_path / "plan-fsdp.json")
    results = run_ranks(_reference_and_torn_checkpoint, 2, str(plan_file), str(ref), timeout=150)
    for (raised, last, names), _ in results:
        assert raised
        assert last.endswith("step-000004") and ".step-000008.tmp" in names and "step-000008" not in names
    full, resumed = results[0][1]
    assert [m["step"] for m in resumed] == list(range(1, 9))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in resumed], [m[key] for m in full], rtol=1e-6, err_msg=f"fsdp resume {key}")

    assert r.returncode != 0
    assert failed_job["elapsed"] < 60 + 30  # 60 s to stop after the fault, plus process start-up on a busy machine
    assert "seqpar launch: the job failed" in r.stderr and "rank 1" in r.stderr.split("first failure:")[1], r.stderr[-2000:]
    assert failed_job["step4"]

    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQPAR_FAULT_")}
    r = subprocess.run(failed_job["cmd"] + ["--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = read_metrics(out), read_metrics(ref)
    assert [m["step"] for m in got] == list(range(1, 9))
    for key in ("loss", "grad_norm", "lr"):
        np.testing.assert_allclose([m[key] for m in got], [m[key] for m in want], rtol=1e-6, err_msg=key)
    report = json.loads((out / "run_report.json").read_text())
    assert report["plan"]["strategy"]["mode"] == "zigzag_ring_attn"
    assert set(report["measured"]) >= {"tokens_per_s", "peak_memory_gib", "mfu", "step_time_s"}
    assert len(report["per_rank"]) == 2 and report["measured"]["tokens_per_s"] > 0


def test_a_failing_rank_writes_its_traceback_and_the_launch_names_it(failed_job):
    """torchrun's ``@record`` on the trainer's entry point (seqpar.runtime.train.loop.train): the rank that raises writes its
    error file (the path torchrun gives it in TORCHELASTIC_ERROR_FILE, kept in its log folder: a ``torchelastic_*`` folder
    under TMPDIR) with the exception and its traceback, and ``seqpar launch`` names the failing rank and its error."""
    r = failed_job["run"]
    assert r.returncode == 1, r.stderr[-3000:]
    message = "RuntimeError: injected fault on rank 1 at step 6"
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("seqpar launch: the job failed with exit status 1; first failure: rank 1 failed"), last
    assert message in last, last

    files = failed_job["errors"]  # rank 0 may have one too: its wait for rank 1 broke ("closed by peer"), a consequence
    assert "1" in files, failed_job["tree"]  # the launcher names after rank 1
    err = json.loads(files["1"])["message"]
    assert err["message"].startswith(message)
    stack = err["extraInfo"]["py_callstack"]
    assert stack.startswith("Traceback (most recent call last):")
    # the frames from the entry point down to the raise
    for frame in (
        'seqpar/runtime/train/loop.py", line',
        "in train\n",
        "in run\n",
        'seqpar/runtime/checkpoint/shards.py", line',
        "in fault\n",
    ):
        assert frame in stack, (frame, stack)
    assert stack.rstrip().endswith(message + " (step; SEQPAR_FAULT_* is set)"), stack[-300:]
    if "0" in files:
        assert message not in files["0"]
        assert failed_job["rank0_record"]["kind"] == "peer"


def test_every_option_seqpar_launch_offers_reaches_the_trainer_typed(tmp_path):
    """Each trainer option is declared once (TrainOptions): seqpar launch offers it, the job's command carries it and the
    trainer's parser reads it back with its type. Every offered option is set off its default here, so a new one is
    covered without editing this test."""
    import typer

    from seqpar.plan.flags import options
    from seqpar.runtime.train.loop import parser as train_parser

    plan = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2, sharding="fsdp").write(plan)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    params = typer.main.get_command(app).commands["launch"].params
    offered = {opt for p in params for opt in p.opts}
    special = {"--data": None, "--model-path": str(tmp_path / "model"), "--output": str(tmp_path / "o"), "--report-to": None}
    special["--merge-lora"] = None  # LoRA plans only (refused here): tests/runtime/train/test_lora_train.py carries it
    if importlib.util.find_spec("tensorboard") is not None:
        special["--report-to"] = "tensorboard"
    argv, expected = [], {}
    for o in options(TrainOptions):
        f = o.flag
        if f.name not in offered:
            assert f.name in ("--plan", "--init-from", "--async-checkpoint"), f"seqpar launch does not offer {f.name}"
            continue
        if f.name in special:
            text = special[f.name]
        elif o.kind is bool:
            text = ""
        else:
            text = {"--checkpoint-every": "7"}.get(f.name) or (f.choices[-1] if f.choices else None)
            text = text or (str((o.default or f.min or 0) + 3) if o.kind is int else f"x-{o.path[-1]}")
        if text is None:
            continue
        argv += [f.name] + ([text] if text else [])
        expected[o.path] = not o.default if o.kind is bool else (o.read(text),) if o.repeated else o.read(text)
    r = runner.invoke(app, ["launch", str(plan), "--dry-run", *argv])
    assert r.exit_code == 0, r.output
    cmd = next(ln for ln in r.stdout.splitlines() if "seqpar.runtime.train" in ln).split()
    got = train_parser().parse_args(cmd[cmd.index("seqpar.runtime.train") + 1 :])
    assert isinstance(got, TrainOptions) and got.plan == str(plan)
    for path, want in expected.items():
        value = got
        for name in path:
            value = getattr(value, name)
        assert value == want and type(value) is type(want), (path, value, want)
    assert isinstance(got.profile_step, int) and got.data_options.procs == 4  # typed, never a raw string


def test_a_verify_job_gets_the_verify_options_only(tmp_path):
    """`seqpar launch --verify` with training flags: the verify ranks get their own options (VerifyOptions), never the
    trainer's, which their parser would refuse."""
    from seqpar.plan.job_options import VerifyOptions
    from seqpar.runtime.train.verify import parser as verify_parser

    train = TrainOptions(skip_nonfinite=True, final_checkpoint=False, keep_last=1, allow_env=("FOO",))
    opts = LaunchOptions(train, verify=VerifyOptions(seq_len=16, allow_env=("FOO",)))
    job = build_job(make_plan(2, "zigzag_ring_attn", 2), tmp_path / "p.json", opts, output=tmp_path / "v")
    argv = job.argv[job.argv.index("seqpar.runtime.train.verify") + 1 :]
    out, plan = str(tmp_path / "v"), str(tmp_path / "p.json")
    assert argv == ["--data", "synthetic", "--output", out, "--allow-env", "FOO", "--seq-len", "16", "--plan", plan]
    assert verify_parser().parse_args(argv) == VerifyOptions(seq_len=16, allow_env=("FOO",), output=out, plan=plan)
