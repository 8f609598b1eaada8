"""A model or tokenizer folder (``--model-path``, ``--tokenizer``) is data: no custom code without ``--trust-remote-code``,
weights only from safetensors, a torn or incomplete safetensors file one line, and to train, the plan's shape.

Hostile folders are forged here as a colleague could hand them over: Python beside an ``auto_map`` that would create a
marker file when imported, a ``pytorch_model.bin`` pickle whose ``__reduce__`` would create one, safetensors files
cut, overwritten or with a forged header, tensors left out, a config of another shape. Each is loaded the way the
ranks load it (seqpar.runtime.hf.model.build_model, rank 0 and the meta-device ranks) and must be one line
(SeqparError, exit 2 on a rank) with the marker absent; `seqpar eval` refuses them before any rank starts.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqpar.plan.errors import SeqparError
from seqpar.runtime.hf.model import build_model

from seqpar_testing.cli import one_error_line, run
from seqpar_testing.data import make_tokenizer
from seqpar_testing.hostile import Marker, one_line
from seqpar_testing.train import make_plan

PLAN = make_plan(1)
SPEC = PLAN.workload.model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The plan's tiny model, written by save_pretrained (config.json, model.safetensors)."""
    folder = tmp_path_factory.mktemp("model") / "tiny"
    build_model(SPEC, model_path=None, seed=1, rope_theta=None).save_pretrained(folder)
    return folder


def _copy(saved: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    return folder


def _load(folder: Path, **kw):
    return build_model(SPEC, model_path=str(folder), seed=1, rope_theta=None, match_plan=True, **kw)


# --------------------------------------------------------------------------------------------- custom code


@pytest.mark.parametrize("meta", [False, True], ids=["rank0", "meta-rank"])
def test_a_model_folder_asking_for_custom_code_is_refused(saved, tmp_path, meta):
    folder = _copy(saved, tmp_path)
    marker = tmp_path / "ran-custom-code"
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "hook.HookConfig", "AutoModelForCausalLM": "hook.HookModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "hook.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    with pytest.raises(SeqparError) as e:
        _load(folder, meta=meta)
    line = one_line(e)
    assert "config.json asks for custom code" in line and "--trust-remote-code" in line, line
    assert not marker.exists()


def test_a_tokenizer_folder_asking_for_custom_code_is_refused(tmp_path):
    from seqpar.runtime.data.text import load_tokenizer

    folder = Path(make_tokenizer(tmp_path / "tok"))
    marker = tmp_path / "ran-custom-code"
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["hook.HookTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "hook.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    with pytest.raises(SeqparError) as e:
        load_tokenizer(str(folder), "data file 'x.jsonl'")
    line = one_line(e)
    assert "tokenizer_config.json asks for custom code" in line and "--trust-remote-code" in line, line
    assert not marker.exists()
    # the flag is the user's explicit word: the refusal is lifted (transformers then decides what to import)
    from seqpar.runtime.data.hf_folder import refuse_remote_code

    refuse_remote_code(folder, "tokenizer folder", trust_remote_code=True)


def test_every_from_pretrained_in_seqpar_says_trust_remote_code():
    """No call leaves transformers to ask "[y/N]" on a rank's terminal: each passes trust_remote_code explicitly."""
    import re

    root = Path(__file__).resolve().parents[3] / "seqpar"
    calls = []
    for f in root.rglob("*.py"):
        text = f.read_text()
        for m in re.finditer(r"\b(Auto\w+)\.from_(pretrained|config)\(", text):
            depth, i = 1, m.end()
            while depth:  # the call's arguments, to its closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            calls.append((f.relative_to(root.parent), m.group(0), "trust_remote_code" in text[m.end() : i]))
    assert len(calls) >= 5, calls
    assert all(ok for *_, ok in calls), [c for c in calls if not c[2]]


# --------------------------------------------------------------------------------------------- weights


def test_pickled_weights_are_refused_unread(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Marker(marker)))
    for meta in (False, True):
        with pytest.raises(SeqparError) as e:
            _load(folder, meta=meta)
        line = one_line(e)
        assert "pytorch_model.bin" in line and "pickle" in line and "convert" in line, line
    assert not marker.exists()


def _header(folder: Path) -> tuple[dict, bytes]:
    raw = (folder / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _with_header(folder: Path, header: dict | bytes, body: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + body)


def _bad_safetensors(kind: str, folder: Path) -> None:
    """One way a safetensors file can be torn or forged."""
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    header, body = _header(folder)
    first = next(k for k in header if k != "__metadata__")
    if kind == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "not-safetensors":
        path.write_bytes(b"PK\x03\x04 a zip, or a pickle, or anything")
    elif kind == "header-length-huge":
        path.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    elif kind == "header-not-json":
        _with_header(folder, b"{" * 64, body)
    elif kind == "header-5001-digits":
        _with_header(folder, json.dumps(header).replace('"data_offsets": [0', '"data_offsets": [' + "9" * 5001, 1).encode(), body)
    elif kind == "offsets-past-the-end":
        header[first]["data_offsets"][1] += 10**9
        _with_header(folder, header, body)
    elif kind == "unknown-dtype":
        header[first]["dtype"] = "PICKLE"
        _with_header(folder, header, body)
    elif kind == "shape-of-another-size":
        header[first]["shape"] = [3, 3]
        _with_header(folder, header, body)
    else:
        raise ValueError(kind)


BAD = [
    "truncated",
    "empty",
    "not-safetensors",
    "header-length-huge",
    "header-not-json",
    "header-5001-digits",
    "offsets-past-the-end",
    "unknown-dtype",
    "shape-of-another-size",
]


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("meta", [False, True], ids=["rank0", "meta-rank"])
def test_a_bad_safetensors_file_isone_line(saved, tmp_path, kind, meta):
    folder = _copy(saved, tmp_path)
    _bad_safetensors(kind, folder)
    with pytest.raises(SeqparError) as e:
        _load(folder, meta=meta)
    assert "model.safetensors" in one_line(e)


def test_weights_a_model_needs_that_the_folder_lacks_are_refused(saved, tmp_path):
    """A folder missing a layer's tensors would train with them random: refused on every rank alike."""
    from safetensors.torch import load_file, save_file

    folder = _copy(saved, tmp_path)
    state = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in state.items() if ".layers.1." not in k}, folder / "model.safetensors", {"format": "pt"})
    for meta in (False, True):
        with pytest.raises(SeqparError) as e:
            _load(folder, meta=meta)
        line = one_line(e)
        assert "lack 9 of the model's tensors" in line and "model.layers.1." in line, line


def test_an_index_naming_a_file_elsewhere_is_refused(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    header, _ = _header(folder)
    names = [k for k in header if k != "__metadata__"]
    index = {"metadata": {}, "weight_map": {k: "../../elsewhere/model.safetensors" for k in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SeqparError) as e:
        _load(folder)
    assert "not a .safetensors file beside it" in one_line(e)


def test_a_sound_folder_loads_its_own_weights(saved):
    model = _load(saved)
    from safetensors.torch import load_file

    for name, tensor in load_file(saved / "model.safetensors").items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------- the plan's shape


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_hidden_layers", SPEC.num_layers + 2),  # the case: more layers than the plan trains
        ("hidden_size", SPEC.hidden_size * 2),
        ("num_attention_heads", SPEC.num_attention_heads * 2),
        ("num_key_value_heads", 1),
        ("intermediate_size", SPEC.intermediate_size + 8),
        ("vocab_size", SPEC.vocab_size + 1),
    ],
)
def test_a_model_folder_of_another_shape_than_the_plan_is_refused(saved, tmp_path, field, value):
    folder = _copy(saved, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    want = cfg[field]
    cfg[field] = value
    if field == "hidden_size":
        cfg["head_dim"] = value // cfg["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SeqparError) as e:
        _load(folder, meta=True)
    line = one_line(e)
    assert f"config.json has {field} {value}" in line and f"{want}" in line, line
    # eval reads the folder's own shape: no refusal for the shape alone, but never a layer from random values
    if field == "num_hidden_layers":
        with pytest.raises(SeqparError, match="lack 18 of the model's tensors"):
            build_model(SPEC, model_path=str(folder), seed=1, rope_theta=None, meta=True)
    else:
        build_model(SPEC, model_path=str(folder), seed=1, rope_theta=None, meta=True)


# --------------------------------------------------------------------------------------------- the commands


def test_seqpar_eval_refuses_such_folders_before_any_rank_starts(saved, tmp_path):
    """One line, exit 2, no "[y/N]" prompt (stdin is closed), nothing unpickled or imported."""
    plan = tmp_path / "plan.json"
    PLAN.write(plan)
    custom, pickled = _copy(saved, tmp_path / "a"), _copy(saved, tmp_path / "b")
    cfg = json.loads((custom / "config.json").read_text())
    (custom / "config.json").write_text(json.dumps(cfg | {"auto_map": {"AutoModelForCausalLM": "hook.HookModel"}}))
    marker = tmp_path / "unpickled"
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(Marker(marker)))
    for folder, words in ((custom, "--trust-remote-code"), (pickled, "pytorch_model.bin")):
        r = run("eval", plan, "--model-path", folder, "--output", tmp_path / "eval", "--force")
        assert r.exit_code == 2, r.output
        assert words in one_error_line(r)
    assert not marker.exists() and not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_seqpar_launch_refuses_a_torn_safetensors_with_one_line_exit_2(saved, tmp_path):
    """The ranks refuse it (the same line on each); the launch exits 2 with that line last, no traceback."""
    folder = _copy(saved, tmp_path)
    _bad_safetensors("truncated", folder)
    plan = tmp_path / "plan.json"
    make_plan(1, steps=2).write(plan)
    cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(plan), "--model-path", str(folder)]
    cmd += ["--output", str(tmp_path / "run"), "--force"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "model.safetensors" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
