"""A trained checkpoint forged as a hostile colleague would, then ``seqpar launch --resume``: every forgery is refused with
exit 2 and one line before any process starts, and no planted pickle runs (its marker file never appears); a folder
signed with another user's key is refused without ``--accept-foreign-run`` and resumes with it, exactly.

One tiny 2-rank DDP run (3 steps, a checkpoint after each) is shared by every case (a copy each); the forgeries go
through the launcher in this process (CliRunner), so each costs no rank. The DeepSpeed forgery trains a ZeRO run of its
own and is in the slow set; its reader's refusals are in test_trust_files.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from seqpar.plan.errors import SeqparError
from seqpar.runtime.checkpoint import integrity, resume

from seqpar_testing.cli import one_error_line, run
from seqpar_testing.hostile import Marker
from seqpar_testing.train import make_plan, read_metrics

STEP = "step-000002"
SHARD = "state/shard-00001-model-00001-of-00001.safetensors"


def _launch(plan: Path, out: Path, *extra: str, key: Path | None = None, timeout: float = 240):
    env = dict(os.environ, **({integrity.KEY_ENV: str(key)} if key else {}))
    cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(plan), "--output", str(out), "--data", "synthetic", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(plan file, run folder): 3 steps on 2 gloo ranks, checkpoints after steps 2 and 3 (--keep-last 2)."""
    tmp = tmp_path_factory.mktemp("trained")
    plan = tmp / "plan.json"
    make_plan(2, steps=3, checkpoint_every=1).write(plan)
    r = _launch(plan, tmp / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    return plan, tmp / "run"


def _copy(trained, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run as it stood after step 2: step 3's checkpoint gone, ``latest`` naming step 2."""
    plan, src = trained
    out = tmp_path / "run"
    shutil.copytree(src, out, symlinks=True)
    shutil.rmtree(out / "checkpoints" / "step-000003")
    (out / "checkpoints" / "latest").write_text(f"{STEP}\n")
    return plan, out / "checkpoints" / STEP


def _state(folder: Path) -> dict:
    return json.loads((folder / "trainer_state.json").read_text())


def _write(folder: Path, state: dict, *, key: bytes | None = None) -> None:
    """Re-sign ``state``: with ``key`` as a forger would (the algorithm read off the code, a key of their own), else with
    the user's own key (what only someone holding it can do)."""
    if key is None:
        state["mac"] = integrity.sign(state)
    else:
        body = json.dumps({k: v for k, v in state.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
        state["mac"] = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    (folder / "trainer_state.json").write_text(json.dumps(state, indent=2))


def _relist(folder: Path, state: dict, *names: str) -> dict:
    for rel in names:
        state["files"][rel] = integrity.digest(folder / rel)
    return state


FORGER = secrets.token_bytes(32)


def _same_size(folder, marker):  # one tensor's bytes changed, the file's size kept, nothing re-signed
    p = folder / SHARD
    data = bytearray(p.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    p.write_bytes(bytes(data))


def _pickle_in_shard(folder, marker, key=FORGER):
    (folder / SHARD).write_bytes(pickle.dumps(Marker(marker)))
    _write(folder, _relist(folder, _state(folder), SHARD), key=key)


def _metadata_pickle(folder, marker, listed=False):
    """torch.distributed.checkpoint's FileSystemReader would unpickle state/.metadata."""
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(Marker(marker)))
    if listed:
        _write(folder, _relist(folder, _state(folder), "state/.metadata"), key=FORGER)


def _step(value, key=FORGER):
    def forge(folder, marker):
        state = _state(folder)
        state["step"] = value
        _write(folder, state, key=key)

    return forge


def _field(group, name, value):
    def forge(folder, marker):
        state = _state(folder)
        state[group][name] = value
        _write(folder, state, key=None)

    return forge


def _unsigned(folder, marker):
    state = _state(folder)
    del state["mac"]
    (folder / "trainer_state.json").write_text(json.dumps(state))


def _raw_state(text):
    def forge(folder, marker):
        (folder / "trainer_state.json").write_text(text)

    return forge


def _lists_outside(folder, marker):
    state = _state(folder)
    state["files"]["../../../../etc/hostname"] = {"bytes": 1, "sha256": "0" * 64}
    _write(folder, state, key=None)


def _latest(name):
    def forge(folder, marker):
        outside = folder.parents[2] / "outside" / STEP
        shutil.copytree(folder, outside)  # a whole, signed checkpoint, outside the output folder
        (folder.parent / "latest").write_text((name or str(outside)) + "\n")

    return forge


def _link(rel):
    """Make ``rel`` (relative to the checkpoints folder) a symbolic link to a copy of what it was, outside."""

    def forge(folder, marker):
        p = folder.parent / rel
        outside = folder.parents[2] / "outside" / p.name
        outside.parent.mkdir(exist_ok=True)
        shutil.move(str(p), str(outside))
        p.symlink_to(outside)

    return forge


CASES = {
    # content
    "shard-bytes-overwritten-same-size": (_same_size, (), f"{SHARD} was changed after it was written (its SHA-256"),
    "pickle-in-a-shard-re-signed": (_pickle_in_shard, (), "is signed with another key than yours"),
    "metadata-pickle-planted": (_metadata_pickle, (), "holds 'state/.metadata', which its trainer_state.json does not"),
    "metadata-pickle-listed-flag": (
        lambda f, m: _metadata_pickle(f, m, listed=True),
        ("--accept-foreign-run",),
        "lists 'state/.metadata', not a file seqpar writes",
    ),
    "manifest-names-a-file-outside": (_lists_outside, (), "not a file seqpar writes in a checkpoint"),
    # trainer_state.json
    "step-minus-5-re-signed": (_step(-5), (), "is signed with another key than yours"),
    "step-minus-5-re-signed-flag": (_step(-5), ("--accept-foreign-run",), "step: Input should be greater than or equal"),
    "step-minus-5-own-key": (_step(-5, key=None), (), "step: Input should be greater than or equal to 0"),
    "step-a-string": (_field("training", "steps", "3"), (), "training.steps: Input should be a valid integer"),
    "world-size-a-bool": (_field("layout", "world_size", True), (), "layout.world_size: Input should be a valid integer"),
    "schedule-with-code": (
        _field("training", "lr_schedule", "constant\nimport os; os.system('touch x')"),
        (),
        "training.lr_schedule: Input should be 'constant' or 'cosine'",
    ),
    "unsigned": (_unsigned, (), "is not signed"),
    "not-json": (_raw_state('{"step": 2, "fi'), (), "has no readable trainer_state.json (JSONDecodeError)"),
    "deep-json": (_raw_state("[" * 100_000), (), "has no readable trainer_state.json (RecursionError)"),
    "huge-integer": (_raw_state('{"step": ' + "9" * 5001 + "}"), (), "has no readable trainer_state.json (ValueError)"),
    # latest and links
    "latest-outside-relative": (_latest("../../outside/" + STEP), (), "not a checkpoint folder beside it"),
    "latest-outside-absolute": (_latest(None), (), "not a checkpoint folder beside it"),
    "latest-a-link": (_link("latest"), (), "holds a symbolic link"),
    "step-folder-a-link": (_link(STEP), (), "holds a symbolic link"),
    "trainer-state-a-link": (_link(f"{STEP}/trainer_state.json"), (), "holds a symbolic link"),
    "shard-a-link": (_link(f"{STEP}/{SHARD}"), (), "holds a symbolic link"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_a_forged_checkpoint_is_refused_with_one_line_and_runs_nothing(trained, tmp_path, case):
    forge, flags, match = CASES[case]
    plan, folder = _copy(trained, tmp_path)
    marker = tmp_path / "pwned"
    forge(folder, marker)
    r = run("launch", plan, "--output", folder.parents[1], "--resume", "--steps", 3, "--data", "synthetic", "--force", *flags)
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert match in line, line
    assert not marker.exists() and not (folder.parent / "step-000003").exists()


@pytest.mark.timeout(300)
def test_a_folder_from_another_key_resumes_only_with_the_flag_and_exactly(trained, tmp_path, monkeypatch):
    """Another user's copy of the run: refused without the flag (exit 2, one line, nothing written); with it, step 3
    trains as the uninterrupted run's did, and its checkpoint is signed with that user's key."""
    plan, folder = _copy(trained, tmp_path)
    out, other = folder.parents[1], tmp_path / "other-user" / "run-key"
    r = _launch(plan, out, "--resume", "--steps", "3", key=other)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "is signed with another key than yours" in lines[0], r.stderr
    assert "--accept-foreign-run" in lines[0] and not (folder.parent / "step-000003").exists()
    r = _launch(plan, out, "--resume", "--steps", "3", "--accept-foreign-run", key=other)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = read_metrics(out), read_metrics(trained[1])
    for key in ("step", "loss", "grad_norm", "lr"):  # step 3 repeated exactly from the foreign checkpoint
        assert [m[key] for m in got] == [m[key] for m in want], key
    new = folder.parent / "step-000003"
    with pytest.raises(SeqparError, match="is signed with another key"):  # this user's key did not sign it
        resume.read_state(new)
    monkeypatch.setenv(integrity.KEY_ENV, str(other))  # the other user's did
    monkeypatch.setattr(integrity, "_KEYS", {})
    assert resume.read_state(new)["step"] == 3


# --------------------------------------------------------------------------------------------- DeepSpeed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pickle_in_a_deepspeed_state_runs_nothing_even_signed(tmp_path, deepspeed_ops):
    """The issue's case: mp_rank_00_model_states.pt replaced by a pickle that runs a command, the manifest re-signed
    (here with the user's own key: the worst case, accepted as signed). The ranks refuse it with one line and exit 2;
    the untouched copy resumes."""
    pytest.importorskip("deepspeed")
    plan = tmp_path / "plan.json"
    make_plan(2, sharding="zero2", steps=2, checkpoint_every=1).write(plan)
    out = tmp_path / "run"
    r = _launch(plan, out, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    forged = tmp_path / "forged"
    shutil.copytree(out, forged)
    folder = forged / "checkpoints" / STEP
    rel = "deepspeed/state/mp_rank_00_model_states.pt"
    import torch

    marker = tmp_path / "pwned"
    torch.save({"module": Marker(marker)}, folder / rel)
    _write(folder, _relist(folder, _state(folder), rel))
    r = _launch(plan, forged, "--resume", "--steps", "3", timeout=400)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint file") and "is not a DeepSpeed state seqpar wrote" in last, last
    assert not marker.exists()
    r = _launch(plan, out, "--resume", "--steps", "3", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
