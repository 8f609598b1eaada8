"""`--report-to tensorboard,wandb` through accelerate's trackers (seqpar.runtime.train.trackers), read back with the trackers' own
readers.

The end-to-end test runs `seqpar launch` on 2 gloo ranks with both trackers (W&B offline, WANDB_MODE=offline); in the
slow set, the first launch has rank 0 raise before step 4 (SEQPAR_FAULT_* hook) after a checkpoint at step 2 and steps
1-3 logged, the second continues it with `--resume`. TensorBoard's events (EventAccumulator) must hold steps 1..6 once each (the resumed
run repeats step 3; SummaryWriter's purge_step hides the first attempt's), with the losses of metrics.jsonl, and the
hparams must hold the plan's mode and predicted figures. W&B's offline run folders (one per launch, only rank 0's) must
carry one run id, the one kept in tracker_run.json. Refusals: an unknown or missing tracker is one line, exit 2, before
anything runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.runtime.train import trackers

from seqpar_testing.train import make_plan, read_metrics

runner = CliRunner()


def _plan(tmp_path: Path) -> Path:
    """The 2-rank zigzag plan with the advisor's prediction for it (what the trackers' config must carry)."""
    from seqpar.advisor.cost.predict import predict

    plan = make_plan(2, "zigzag_ring_attn", 2, steps=6, checkpoint_every=2)
    plan = plan.model_copy(update={"prediction": predict(plan.workload, plan.cluster, plan.strategy)})
    path = tmp_path / "plan.json"
    plan.write(path)
    return path


# --------------------------------------------------------------------------------------------- refusals (exit 2, one line)


@pytest.mark.parametrize(
    "report_to, hidden, code, match",
    [
        (
            "tensorboard,mlflow",
            None,
            2,  # bad input
            "--report-to 'mlflow' is not a tracker seqpar logs to; give a comma list of tensorboard, wandb",
        ),
        # a missing package is the install's gap: exit 1, as the README's exit-code table says for optional dependencies
        ("wandb", "wandb", 1, "--report-to wandb needs wandb, which is not installed: pip install -e "),
        ("tensorboard", "tensorboard", 1, "--report-to tensorboard needs tensorboard, which is not installed: pip install -e "),
    ],
)
def test_an_unknown_or_missing_tracker_is_one_line_and_its_exit_code(tmp_path, monkeypatch, report_to, hidden, code, match):
    if hidden:  # importlib finds no module whose sys.modules entry is None: what a machine without it sees
        monkeypatch.setitem(sys.modules, hidden, None)
    out = tmp_path / "out"
    r = runner.invoke(app, ["launch", str(_plan(tmp_path)), "--output", str(out), "--report-to", report_to])
    assert r.exit_code == code, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], r.stderr
    if hidden:
        assert lines[0].rstrip("'").endswith("[track]"), lines[0]  # the extra that installs it
    assert not out.exists()  # refused before anything was written


def test_the_run_id_is_made_once_and_read_back_on_resume(tmp_path):
    first = trackers.run_identity(tmp_path, resumed=False, project=None, run_name=None)
    assert first["project"] == "seqpar" and first["run_name"] == tmp_path.name and len(first["run_id"]) == 16
    assert json.loads((tmp_path / trackers.RUN_FILE).read_text()) == first
    again = trackers.run_identity(tmp_path, resumed=True, project=None, run_name=None)
    assert again == first
    renamed = trackers.run_identity(tmp_path, resumed=True, project="p2", run_name="r2")
    assert renamed == {"project": "p2", "run_name": "r2", "run_id": first["run_id"]}
    fresh = trackers.run_identity(tmp_path, resumed=False, project=None, run_name=None)
    assert fresh["run_id"] != first["run_id"]  # a new run in the same folder is a new tracker run
    (tmp_path / trackers.RUN_FILE).write_text("{torn")
    with pytest.raises(Exception, match="is not JSON; restore it, or delete it"):
        trackers.run_identity(tmp_path, resumed=True, project=None, run_name=None)


# --------------------------------------------------------------------------------------------- a launch, a failure, a resume


def _scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir))
    ea.Reload()  # every event file of the folder, in order; a SessionLog START at purge_step drops later steps before it
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def _hparams(run_dir: Path) -> list[dict]:
    """Each hparams record written under ``run_dir`` (torch's add_hparams writes them in a sub-folder per call)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    found = []
    for f in sorted(run_dir.glob("*/events.out.tfevents.*")):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name != "hparams":
                    continue
                data = plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
                if data.HasField("session_start_info"):
                    hp = data.session_start_info.hparams
                    found.append({k: getattr(x, x.WhichOneof("kind")) for k, x in hp.items()})
    return found


@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["one-launch", "crash-and-resume"])
def test_tensorboard_and_wandb_continue_one_run_across_resume(tmp_path, resume):
    """One launch logs its steps, config and run id to both trackers; with ``resume`` (the slow set) a launch that fails
    before step 4 and its --resume continue that one run."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    plan_file, out = _plan(tmp_path), tmp_path / "job"
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    cmd = [
        sys.executable,
        "-m",
        "seqpar.cli",
        "launch",
        str(plan_file),
        "--output",
        str(out),
        "--report-to",
        "tensorboard,wandb",
    ]
    launches = 2 if resume else 1
    if resume:
        fault = dict(env, SEQPAR_FAULT_RANK="0", SEQPAR_FAULT_STEP="4")  # raises before step 4: steps 1-3 logged
        r = subprocess.run(cmd, env=fault, capture_output=True, text=True, timeout=240)
        assert r.returncode == 1 and "rank 0 failed" in r.stderr, r.stderr[-3000:]
        ident = json.loads((out / trackers.RUN_FILE).read_text())
        assert ident["project"] == "seqpar" and ident["run_name"] == "job"
    r = subprocess.run(cmd + (["--resume"] if resume else []), env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    if not resume:
        ident = json.loads((out / trackers.RUN_FILE).read_text())
        assert ident["project"] == "seqpar" and ident["run_name"] == "job"
    assert json.loads((out / trackers.RUN_FILE).read_text()) == ident

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 7))
    tb = out / "tensorboard" / "seqpar"  # accelerate's layout: <logging_dir>/<project>
    assert len(list(tb.glob("events.out.tfevents.*"))) == launches  # one writer per launch: rank 0's
    for key in ("loss", "grad_norm", "lr"):
        got = _scalars(tb, key)
        assert [s for s, _ in got] == list(range(1, 7)), f"{key}: steps {[s for s, _ in got]}"
        # TensorBoard keeps float32 scalars
        np.testing.assert_array_equal([v for _, v in got], np.float32([m[key] for m in metrics]), err_msg=key)

    plan = json.loads(plan_file.read_text())
    hp = _hparams(tb)
    assert len(hp) == launches  # the config of each launch
    for h in hp:
        assert h["mode"] == "zigzag_ring_attn" and h["sp_degree"] == 2 and h["checkpointing"] == "none"
        assert h["run_id"] == ident["run_id"]
        for key in ("peak_memory_gib", "tokens_per_s", "step_time_s"):
            assert h[f"predicted_{key}"] == pytest.approx(plan["prediction"][key]), key

    # W&B offline: one run folder per launch (rank 0 only), named by the run id, which both launches share
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == launches, runs
    for run in runs:
        assert run.name.endswith(f"-{ident['run_id']}") and (run / f"run-{ident['run_id']}.wandb").is_file()
