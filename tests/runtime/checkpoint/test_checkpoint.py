"""Checkpoint facts without training: sizes against hand counts, the interval, the free-space refusal of `seqpar launch`,
torn, edited and foreign checkpoints refused with one line, a torn metrics line, the new launch flags, and no unpickling.

The multi-rank runs (resharding, crash consistency, non-finite losses, host memory) are in test_resume.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.plan.errors import SeqparError
from seqpar.plan.job_options import TrainOptions
from seqpar.plan.jobspec import LaunchOptions, build_job
from seqpar.plan.units import GIB
from seqpar.profiles import get_model
from seqpar.runtime.checkpoint import resume, storage

from seqpar_testing.train import make_plan

runner = CliRunner()
N_7B = get_model("llama-2-7b").num_params


def _gpu_plan(sharding="ddp", optimizer="adamw", dtype="bf16", every=None, step_time=None):
    """A one-H100 Llama-2-7B plan (fields of the CPU plan, so no advisor run)."""
    from seqpar.plan.launch_plan import LaunchPlan
    from seqpar.profiles import get_gpu

    data = json.loads(make_plan(1).model_dump_json())
    data["cluster"].update(accelerator="cuda", gpus_per_node=1, gpu=json.loads(get_gpu("h100").model_dump_json()))
    data["strategy"]["sharding"] = sharding
    data["workload"].update(model=json.loads(get_model("llama-2-7b").model_dump_json()), dtype=dtype, optimizer=optimizer)
    data["training"]["checkpoint_every"] = every
    if step_time is not None:
        data["prediction"] = {
            "peak_memory_gib": 1,
            "reserved_memory_gib": 1,
            "capacity_gib": 80,
            "memory_breakdown_gib": {},
            "tokens_per_s": 1,
            "step_time_s": step_time,
            "step_time_breakdown_s": {},
            "mfu": 0.1,
            "oom_risk": False,
        }
    return LaunchPlan.model_validate(data)


# --------------------------------------------------------------------------------------------- sizes and interval


@pytest.mark.parametrize(
    "sharding, optimizer, dtype, per_param, export",
    [
        ("ddp", "adamw", "bf16", 12, 2),  # fp32 master 4 + AdamW moments 8; export bf16
        ("fsdp", "adamw", "fp32", 12, 4),
        ("ddp", "adamw-bf16", "bf16", 6, 2),  # bf16 weights 2 + bf16 moments 4
        ("zero3", "adamw", "bf16", 14, 2),  # DeepSpeed keeps its 16-bit weights too
        ("ddp", "none", "bf16", 2, 2),
    ],
)
def test_checkpoint_and_export_sizes_are_parameters_times_bytes(sharding, optimizer, dtype, per_param, export):
    sz = storage.sizes(_gpu_plan(sharding, optimizer, dtype))
    assert sz.checkpoint == N_7B * per_param and sz.export == N_7B * export
    assert 6.7e9 < N_7B < 6.8e9  # Llama-2-7B: 81 GB per AdamW checkpoint, what filled the 64 GiB disk


def test_cpu_plans_checkpoint_fp32_weights_and_moments():
    sz = storage.sizes(make_plan(2))
    assert sz.checkpoint == get_model("tiny").num_params * 12 and sz.export == get_model("tiny").num_params * 4


def test_interval_defaults_to_about_hourly_from_the_predicted_step_time():
    assert storage.interval(_gpu_plan(step_time=2.0), None) == (
        1800,
        "every 1800 steps: about hourly at the predicted 2 s per step",
    )
    assert storage.interval(_gpu_plan(step_time=2.0, every=0), None)[0] == 0  # explicit 0: only the final one
    assert storage.interval(_gpu_plan(step_time=2.0, every=0), storage.AUTO)[0] == 1800  # --checkpoint-every auto
    assert storage.interval(_gpu_plan(step_time=2.0), 50)[0] == 50
    assert storage.interval(_gpu_plan(), None)[0] is None  # no prediction: decided from the measured steps
    assert storage.interval(_gpu_plan(step_time=7200.0), None)[0] == 1


@pytest.mark.parametrize(
    "start, steps, every, final, writes",
    [(0, 10, 4, True, 3), (0, 8, 4, True, 2), (0, 8, 4, False, 1), (4, 8, 4, True, 1), (0, 3, 0, True, 1), (0, 3, 0, False, 0)],
)
def test_saves_counts_interval_and_final_checkpoints(start, steps, every, final, writes):
    assert storage.saves(start, steps, every, final) == writes


def test_needed_counts_keep_last_plus_the_one_being_written():
    sz = storage.Sizes(checkpoint=10, export=3, why="")
    assert storage.needed(sz, writes=5, keep_last=2, existing=0, final=True) == 3 * 10 + 3
    assert storage.needed(sz, writes=5, keep_last=0, existing=1, final=False) == 5 * 10
    assert storage.needed(sz, writes=1, keep_last=2, existing=2, final=True) == 10 + 3  # resumed: one more at once
    assert storage.needed(sz, writes=0, keep_last=2, existing=0, final=False) == 0


def test_launch_refuses_a_run_whose_checkpoint_cannot_fit(tmp_path, monkeypatch):
    """The H200 story: Llama-2-7B DDP AdamW onto a 64 GiB disk: exit 2 before training, both sizes, the fixes."""
    plan = tmp_path / "plan.json"
    _gpu_plan(step_time=30.0).write(plan)  # 30 s per step: checkpoints every 120 steps, none but the final one in 3
    monkeypatch.setattr(storage, "free_bytes", lambda path: 64 * GIB)
    out = tmp_path / "out"
    r = runner.invoke(app, ["launch", str(plan), "--steps", "3", "--output", str(out), "--force"])
    assert r.exit_code == 2, r.output
    line = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(line) == 1 and not out.exists()
    assert re.search(r"has 64\.0 GiB free.*need 87\.9 GiB: one checkpoint is 75\.3 GiB .*the final export 12\.6 GiB", line[0])
    assert "another --output" in line[0] and "--no-final-checkpoint" in line[0]
    assert "--keep-last 1" not in line[0] and "--checkpoint-every 0" not in line[0]  # they would not fit
    # --no-final-checkpoint (3 steps, interval about hourly: no other checkpoint) needs nothing at --output
    opts = TrainOptions(steps=3, final_checkpoint=False)
    assert storage.launch_problem(_gpu_plan(step_time=30.0), out, opts) == (None, 0)
    # keep-last 1 fits where 2 do not: 3 checkpoints at once + export = 238 GiB, 2 + export = 163 GiB <= 170
    monkeypatch.setattr(storage, "free_bytes", lambda path: 170 * GIB)
    msg, _ = storage.launch_problem(_gpu_plan(step_time=1000.0), out, TrainOptions(steps=20))
    assert "--keep-last 1" in msg


def test_a_full_disk_is_recognised_through_wrappers():
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    wrapped = CheckpointException("save", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    assert storage.is_disk_full(wrapped)
    try:
        try:
            raise OSError(errno.EDQUOT, "quota")
        except OSError as e:
            raise RuntimeError("while saving") from e
    except RuntimeError as e:
        assert storage.is_disk_full(e)
    assert not storage.is_disk_full(OSError(errno.EACCES, "denied"))


# --------------------------------------------------------------------------------------------- torn, edited, foreign


def _checkpoint(root: Path, plan, step: int = 4, seed_plan=None) -> Path:
    """A committed checkpoint folder with the facts of ``plan`` and one shard file (no training needed)."""
    from seqpar.runtime.checkpoint.shards import commit

    tmp = root / f".step-{step:06d}.tmp"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"x" * 100)
    facts = {
        "run": resume.run_facts(plan, data="synthetic", data_windows=2**31 - 1, parameters={"w": [2, 3]}, fmt="dcp"),
        "layout": resume.layout_facts(plan),
        "training": resume.training_facts(plan, plan.training.steps),
    }
    return commit(root, tmp, {"step": step, "windows_read": step * 2, **facts})


@pytest.mark.parametrize(
    "damage, match",
    [
        ("missing", "is incomplete: state/shard-00001-model-00001-of-00001.safetensors is missing"),
        ("truncated", "has 10 bytes, not the 100 written"),
        ("edited", "is signed with another key than yours"),  # an edit breaks the MAC (test_trust_*.py: the rest)
        ("old_format", "has format 1, this seqpar reads format 3"),
        ("not_json", "has no readable trainer_state.json"),
        ("renamed", "holds the state of step 4, not of its folder's step"),
    ],
)
def test_a_torn_or_edited_checkpoint_is_refused_with_one_line(tmp_path, damage, match):
    folder = _checkpoint(tmp_path / "checkpoints", make_plan(2, "zigzag_ring_attn", 2, mbs=2))
    shard = folder / "state" / "shard-00001-model-00001-of-00001.safetensors"
    ts = folder / "trainer_state.json"
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(b"x" * 10)
    elif damage == "edited":
        ts.write_text(ts.read_text().replace('"windows_read": 8', '"windows_read": 2'))
    elif damage == "old_format":
        ts.write_text(json.dumps({"step": 4, "world_size": 2}))
    elif damage == "not_json":
        ts.write_text('{"step": 4, "files"')
    elif damage == "renamed":
        folder = folder.rename(folder.with_name("step-000008"))
    with pytest.raises(SeqparError, match=re.escape(match)) as e:
        resume.read_state(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(seed=4), "training.seed = 3, this run has 4"),
        (dict(mbs=4), "windows per step (micro_batch_size x gradient_accumulation_steps x dp_degree) = 2, this run has 4"),
        (dict(seq_len=128), "workload.seq_len = 64, this run has 128"),
        (dict(model="small"), "workload.model.num_layers"),
    ],
)
def test_resume_refuses_what_changes_the_data_or_the_model_naming_the_field(tmp_path, change, field):
    """Through `seqpar launch --resume`: exit 2 and one line before any process starts."""
    from seqpar.plan.launch_plan import LaunchPlan

    base = make_plan(2, "zigzag_ring_attn", 2, mbs=2, steps=8)
    _checkpoint(tmp_path / "out" / "checkpoints", base)
    data = json.loads(
        make_plan(
            2, "zigzag_ring_attn", 2, mbs=change.get("mbs", 2), steps=8, seq_len=change.get("seq_len", 64)
        ).model_dump_json()
    )
    data["training"]["seed"] = change.get("seed", 3)
    if "model" in change:
        data["workload"]["model"].update(num_layers=4, name="other")
    plan = tmp_path / "plan.json"
    LaunchPlan.model_validate(data).write(plan)
    r = runner.invoke(app, ["launch", str(plan), "--output", str(tmp_path / "out"), "--resume", "--force"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and field in lines[0] and "changes the data or the model" in lines[0], lines


def test_what_may_change_on_resume_is_reported():
    a = make_plan(2, "zigzag_ring_attn", 2, mbs=2, steps=8, sharding="fsdp")
    b = make_plan(2, "data_parallel", 1, mbs=1, steps=12, lr=1e-3)
    facts = {
        id(p): {
            "run": resume.run_facts(p, data="d", data_windows=9, parameters={"w": [1]}, fmt="dcp"),
            "layout": resume.layout_facts(p),
            "training": resume.training_facts(p, p.training.steps),
        }
        for p in (a, b)
    }
    changes = resume.compare(facts[id(a)], facts[id(b)], Path("x"))
    assert changes == [
        "mode zigzag_ring_attn -> data_parallel",
        "sp_degree 2 -> 1",
        "dp_degree 1 -> 2",
        "micro_batch_size 2 -> 1",
        "sharding fsdp -> ddp",
        "steps 8 -> 12",
        "learning_rate 0.01 -> 0.001",
    ]
    facts[id(b)]["run"]["parameters"] = {"w": [2]}
    with pytest.raises(SeqparError, match=r"parameter 'w' has shape \[1\] there and \[2\] here"):
        resume.compare(facts[id(a)], facts[id(b)], Path("x"))


def test_metrics_with_a_torn_last_line_keep_the_whole_records(tmp_path, caplog):
    import logging

    from seqpar.runtime.train.report import _records

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [rec["step"] for _, rec in _records(p, logging.getLogger("t"))] == [1, 2]
    p.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(SeqparError, match="metrics.jsonl' line 2 is not a step record"):
        _records(p, logging.getLogger("t"))


# --------------------------------------------------------------------------------------------- flags and code


def test_launch_passes_the_checkpoint_flags_to_the_trainer(tmp_path):
    plan = make_plan(2, "zigzag_ring_attn", 2)
    opts = LaunchOptions(TrainOptions(checkpoint_every="auto", keep_last=3, final_checkpoint=False, skip_nonfinite=True))
    argv = build_job(plan, tmp_path / "p.json", opts, output=tmp_path / "o").argv
    i = argv.index("--checkpoint-every")
    assert argv[i + 1] == "auto" and argv[argv.index("--keep-last") + 1] == "3"
    assert "--no-final-checkpoint" in argv and "--skip-nonfinite" in argv
    assert "--keep-last" not in build_job(plan, tmp_path / "p.json", LaunchOptions(), output=tmp_path / "o").argv
    plan_file = tmp_path / "plan.json"
    plan.write(plan_file)
    r = runner.invoke(app, ["launch", str(plan_file), "--checkpoint-every", "often", "--dry-run"])
    assert r.exit_code == 2 and "--checkpoint-every 'often' is not a number of steps" in r.stderr


def test_no_checkpoint_is_ever_unpickled():
    """Checkpoints are safetensors and JSON: nothing in the package unpickles (torch.load without weights_only, pickle)."""
    root = Path(__file__).resolve().parents[3] / "seqpar"
    pattern = re.compile(r"weights_only\s*=\s*False|pickle\.loads?\(|torch\.load\(")
    hits = [
        f"{p.relative_to(root)}:{n}"
        for p in root.rglob("*.py")
        for n, ln in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(ln)
    ]
    assert hits == []
