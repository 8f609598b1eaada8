"""The pieces that keep a run folder data: the key that signs checkpoints, what trainer_state.json may hold, and the
pickle-free readers (DeepSpeed's states, RNG states), each against a file forged as a hostile colleague would.

A planted pickle's __reduce__ would create a marker file: it must not exist afterwards, and the reader must refuse the
file with one line (SeqparError). The forgeries of a real trained checkpoint through ``seqpar launch --resume`` are in
test_trust_resume.py.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import stat
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from seqpar.plan.errors import SeqparError
from seqpar.runtime.checkpoint import deepspeed as ds_format
from seqpar.runtime.checkpoint import integrity, resume, rng, trainer_state

from seqpar_testing.hostile import Marker


@pytest.fixture
def own_key(tmp_path, monkeypatch):
    """A key of this test alone (never the user's), read afresh."""
    monkeypatch.setenv(integrity.KEY_ENV, str(tmp_path / "config" / "seqpar" / "run-key"))
    monkeypatch.setattr(integrity, "_KEYS", {})
    return tmp_path / "config" / "seqpar" / "run-key"


# --------------------------------------------------------------------------------------------- the key


def test_the_key_is_made_once_private_and_outside_the_run_folder(own_key, monkeypatch, tmp_path):
    first = integrity.key()
    assert len(first) == 32 and own_key.read_text().strip() == first.hex()
    assert stat.S_IMODE(own_key.stat().st_mode) == 0o600 and stat.S_IMODE(own_key.parent.stat().st_mode) == 0o700
    monkeypatch.setattr(integrity, "_KEYS", {})
    assert integrity.key() == first  # read back, not made again
    state = {"step": 2, "files": {}}
    mac = integrity.sign(state)
    assert integrity.signed_here({**state, "mac": mac}) and not integrity.signed_here({**state, "step": 3, "mac": mac})
    # without the variable: $XDG_CONFIG_HOME/seqpar/run-key
    monkeypatch.delenv(integrity.KEY_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert integrity.key_path() == tmp_path / "xdg" / "seqpar" / "run-key"


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: p.chmod(0o644), r"may be read or written by other users \(mode 0644\).*chmod 600"),
        (lambda p: p.write_text("abc\n"), "does not hold 64 hex digits"),
        (lambda p: (p.unlink(), p.symlink_to(p.with_name("elsewhere"))), "is a symbolic link"),
    ],
    ids=["readable-by-others", "torn", "a-link"],
)
def test_a_key_others_can_use_or_a_torn_key_is_refused(own_key, monkeypatch, damage, match):
    integrity.key()
    damage(own_key)
    monkeypatch.setattr(integrity, "_KEYS", {})
    with pytest.raises(SeqparError, match=match) as e:
        integrity.key()
    assert "\n" not in str(e.value)


def test_a_key_that_cannot_be_made_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(integrity.KEY_ENV, str(tmp_path / "a-file" / "run-key"))
    monkeypatch.setattr(integrity, "_KEYS", {})
    with pytest.raises(SeqparError, match=f"cannot be made or read .*set {integrity.KEY_ENV} to a file of yours"):
        integrity.key()


# --------------------------------------------------------------------------------------------- trainer_state.json


def _state() -> dict:
    from seqpar_testing.train import make_plan

    plan = make_plan(2, "zigzag_ring_attn", 2, mbs=2)
    return {
        "format": trainer_state.FORMAT,
        "step": 4,
        "windows_read": 8,
        "run": resume.run_facts(plan, data="synthetic", data_windows=9, parameters={"w": [2, 3]}, fmt="dcp"),
        "layout": resume.layout_facts(plan),
        "training": resume.training_facts(plan, 8),
        "files": {"rng-0.json": {"bytes": 10, "sha256": "0" * 64}},
        "mac": "f" * 64,
    }


def _set(path: str, value):
    """Set ``group.key`` (a group of trainer_state.json) or a top-level field to ``value``."""
    group, _, key = path.partition(".")

    def change(state: dict) -> None:
        (state[group] if key else state)[key or group] = value

    return change


@pytest.mark.parametrize(
    "change, match",
    [
        (_set("step", -5), "step: Input should be greater than or equal to 0"),
        (_set("step", "4"), "step: Input should be a valid integer"),
        (_set("step", True), "step: Input should be a valid integer"),
        (_set("step", 4.0), "step: Input should be a valid integer"),
        (_set("windows_read", 2**60), "windows_read: Input should be less than or equal to"),
        (_set("training.learning_rate", -0.1), "training.learning_rate: Input should be greater than or equal to 0"),
        (_set("training.learning_rate", float("nan")), "training.learning_rate: Input should be a finite number"),
        (_set("training.lr_schedule", "constant\nimport os"), "training.lr_schedule: Input should be 'constant' or 'cosine'"),
        (_set("layout.sharding", "zero9"), "layout.sharding: Input should be"),
        (_set("layout.mode", "a mode; rm -rf"), "layout.mode: String should match pattern"),
        (_set("layout.world_size", 0), "layout.world_size: Input should be greater than or equal to 1"),
        (_set("layout.extra", 1), "layout.extra: unknown field (seqpar does not write it)"),
        (_set("run.--data", "x" * 5000), "run: '--data' holds 5000 characters, more than the 4096"),
        (_set("run.rope theta", float("inf")), "run: 'rope theta' is not a finite number"),
        (_set("run.parameters", {"w": [-1]}), "run: 'parameters' is not an object of parameter names and shapes"),
        (_set("run.training.seed", {"nested": [1]}), "run: 'training.seed' holds a dict, not a number"),
        (_set("run.data windows", 10**30), "run: 'data windows' is larger than any figure"),
        (_set("files", {"rng-0.json": {"bytes": "10", "sha256": "0" * 64}}), "files.rng-0.json.bytes"),
        (_set("files", {"rng-0.json": {"bytes": 10, "sha256": "not hex"}}), "files.rng-0.json.sha256"),
        (_set("evil", "code"), "evil: unknown field"),
        (_set("format", 2), "format: Input should be 3"),
    ],
)
def test_trainer_state_is_validated_like_a_plan(change, match):
    state = json.loads(json.dumps(_state()))
    assert trainer_state.problem(state) is None
    change(state)
    problem = trainer_state.problem(state)
    assert problem is not None and match in problem and "\n" not in problem, problem


def test_values_from_a_checkpoint_are_escaped_in_messages_and_the_log():
    """A state signed by the user's key still holds what compare prints: escaped, one line."""
    saved = json.loads(json.dumps(_state()))
    now = json.loads(json.dumps(_state()))
    saved["training"]["lr_schedule"] = "cosine\nimport os; os.system('x')\x1b[2J"
    (line,) = resume.compare(saved, now, Path("x"))
    assert line.startswith("lr_schedule cosine\\x0aimport os") and "\n" not in line and "\x1b" not in line
    saved["run"]["--data"] = "synthetic\u202e\nforged"
    with pytest.raises(SeqparError) as e:
        resume.compare(saved, now, Path("x"))
    assert "\n" not in str(e.value) and "\u202e" not in str(e.value) and "\\u202e" in str(e.value)


# --------------------------------------------------------------------------------------------- RNG states


@pytest.mark.parametrize("forge", ["pickle", "wrong-shape", "deep"])
def test_a_forged_rng_state_is_refused_and_runs_nothing(tmp_path, forge):
    marker = tmp_path / "pwned"
    path = tmp_path / "rng-0.json"
    rng.write(tmp_path, 0)
    assert rng.read(tmp_path, path) == json.loads(path.read_text())  # the real one reads back
    if forge == "pickle":
        path.write_bytes(pickle.dumps(Marker(marker)))
    elif forge == "wrong-shape":
        st = json.loads(path.read_text())
        st["numpy"][1] = st["numpy"][1][:10]
        path.write_text(json.dumps(st))
    else:
        path.write_text("[" * 100_000)
    with pytest.raises(SeqparError, match="rng-0.json is not an RNG state seqpar writes") as e:
        rng.read(tmp_path, path)
    assert "\n" not in str(e.value) and not marker.exists()


# --------------------------------------------------------------------------------------------- DeepSpeed's states


def _tree() -> dict:
    """What DeepSpeed's states hold (seqpar.runtime.checkpoint.deepspeed's docstring), DeepSpeed's own classes aside."""
    flat = torch.arange(12, dtype=torch.float32)
    shared = torch.ones(3)
    return {
        "module": OrderedDict([("a.weight", flat[2:8].view(2, 3)), ("b.weight", shared), ("c.weight", shared)]),
        "optimizer": None,
        "param_shapes": [OrderedDict([("a.weight", torch.Size([2, 3]))])],
        "base_optimizer_state": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.zeros(4)}}, "param_groups": []},
        "betas": (0.9, 0.999),
        "scale": float("inf"),
        "nan": float("nan"),
        "flags": [True, False, 0, -3, 1.5, "s"],
        "dtype": torch.bfloat16,
        "bf16": torch.zeros(2, dtype=torch.bfloat16),
        "empty": torch.zeros(0),
    }


def _same(a, b, where="") -> None:
    assert type(a) is type(b), where
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, where


def test_deepspeed_states_round_trip_without_pickle(tmp_path, monkeypatch):
    tree = _tree()
    if importlib.util.find_spec("deepspeed") is not None:  # its classes, rebuilt from the allow-list
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        tree.update(
            stage=ZeroStageEnum.weights,
            scaler=LossScaler(1.0),
            dynamic=DynamicLossScaler(2.0**16, 10, 1.0, 2, True, dtype=torch.float16),
            slices=OrderedDict([("a.weight", fragment_address(numel=6, start=2))]),
        )
    path = tmp_path / "mp_rank_00_model_states.pt"
    ds_format.write(tree, path)
    for name in ("load", "loads", "Unpickler"):  # nothing on the way back may unpickle
        monkeypatch.setattr(pickle, name, lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load"))
    back = ds_format.read(path, map_location=torch.device("cpu"))
    scalers = {k: back.pop(k) for k in ("scaler", "dynamic", "slices", "stage") if k in back}
    for k in scalers:
        tree_value = tree.pop(k)
        assert type(scalers[k]) is type(tree_value) and (
            vars(scalers[k]) == vars(tree_value) if k in ("scaler", "dynamic") else scalers[k] == tree_value
        ), k
    _same(tree, back)


def _forged_tree(path: Path, tree) -> None:
    from safetensors.torch import save_file

    meta = {"format": "pt", ds_format.TREE: json.dumps(tree), "version": ds_format.VERSION}
    save_file({"t0": torch.zeros(1)}, str(path), metadata=meta)


@pytest.mark.parametrize(
    "forge",
    ["torch-pickle", "raw-pickle", "class-not-allowed", "untagged", "deep", "no-tree"],
)
def test_a_forged_deepspeed_state_is_refused_and_runs_nothing(tmp_path, forge):
    """What DeepSpeed's own engine would have unpickled on --resume: refused by the pickle-free engine, one line."""
    marker, path = tmp_path / "pwned", tmp_path / "mp_rank_00_model_states.pt"
    if forge == "torch-pickle":
        torch.save({"module": Marker(marker)}, path)
    elif forge == "raw-pickle":
        path.write_bytes(pickle.dumps(Marker(marker)))
    elif forge == "class-not-allowed":
        _forged_tree(path, {"@": "object", "c": "posix.system", "v": {"@": "dict", "v": []}})
    elif forge == "untagged":
        _forged_tree(path, {"__reduce__": ["os.system", "touch"]})
    elif forge == "deep":
        _forged_tree(path, json.loads("[" * 500 + "]" * 500))
    else:
        from safetensors.torch import save_file

        save_file({"module": torch.zeros(1)}, str(path))
    for fn in (ds_format.check, ds_format.read):
        with pytest.raises(SeqparError, match="is not a DeepSpeed state seqpar wrote") as e:
            fn(path)
        assert "\n" not in str(e.value)
    assert not marker.exists()
    if importlib.util.find_spec("deepspeed") is not None:  # through DeepSpeed's checkpoint-engine interface too
        engine = ds_format._engine_class()()
        with pytest.raises(SeqparError):
            engine.load(str(path), map_location=torch.device("cpu"))
        assert not marker.exists()


# --------------------------------------------------------------------------------------------- the legacy format


def test_an_unsigned_checkpoint_resumes_only_with_the_flag_and_only_pickle_free(tmp_path, own_key):
    """Format 2 (sizes and an unkeyed digest): refused without --accept-foreign-run; with it its safetensors and JSON are
    read; one holding DeepSpeed's pickles is refused even then."""
    folder = tmp_path / "step-000004"
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"x" * 100)
    rng.write(folder, 0)
    state = {k: v for k, v in _state().items() if k not in ("mac", "files")}
    state.update(format=2, files=integrity.listing(folder), digest="0" * 64)
    state["files"] = {r: (folder / r).stat().st_size for r in state["files"]}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(SeqparError, match="is not signed .*--accept-foreign-run"):
        resume.read_state(folder)
    assert resume.read_state(folder, foreign=True)["step"] == 4
    (folder / "deepspeed" / "state").mkdir(parents=True)
    (folder / "deepspeed" / "state" / "mp_rank_00_model_states.pt").write_bytes(pickle.dumps(Marker(tmp_path / "m")))
    state["files"]["deepspeed/state/mp_rank_00_model_states.pt"] = 10
    (folder / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(SeqparError, match="DeepSpeed's states as pickles, which seqpar no longer reads"):
        resume.read_state(folder, foreign=True)
    assert not (tmp_path / "m").exists()
