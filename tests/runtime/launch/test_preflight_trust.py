"""The launcher refuses what the ranks would refuse, before any of them starts: a model folder of pickled weights or
asking for custom code, and a process-group timeout in the shell that is no number."""

import json

import pytest

from seqpar_testing.cli import run


def _plan(tmp_path):
    out = tmp_path / "p.json"
    assert run("advise", "-s", "64", "-m", "tiny", "--cluster", "cpu:2", "-o", out).exit_code == 0
    return out


def _model(tmp_path, *, weights: str, config: dict | None = None):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    (folder / weights).write_bytes(b"\x80\x04N.")  # a pickle of None: never loaded
    return folder


def _last_error(r) -> str:
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.output
    return errors[0]


def test_a_pickled_model_folder_is_refused_before_any_rank(tmp_path):
    plan, model = _plan(tmp_path), _model(tmp_path, weights="pytorch_model.bin")
    r = run("launch", plan, "--model-path", model, "--output", tmp_path / "o")
    assert "holds its weights as a pickle (pytorch_model.bin)" in _last_error(r)
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_a_folder_asking_for_custom_code_is_refused_before_any_rank(tmp_path):
    cfg = {"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}}
    plan, model = _plan(tmp_path), _model(tmp_path, weights="model.safetensors", config=cfg)
    r = run("launch", plan, "--model-path", model, "--output", tmp_path / "o")
    assert "config.json asks for custom code" in _last_error(r) and "--trust-remote-code" in _last_error(r)


@pytest.mark.parametrize("value", ["abc", "-5", "nan", "1e99"])
def test_a_bad_timeout_in_the_shell_is_one_line(tmp_path, monkeypatch, value):
    plan = _plan(tmp_path)
    monkeypatch.setenv("SEQPAR_PG_TIMEOUT_S", value)
    r = run("launch", plan, "--output", tmp_path / "o")
    assert _last_error(r).startswith("error: the environment's SEQPAR_PG_TIMEOUT_S is ")
