"""seqpar eval --model-path on a run folder: the latest checkpoint's export, and `latest` read as data (never followed
out of the folder, never through a link)."""

import pytest

from seqpar.cli.eval_work import resolve_model_path
from seqpar.plan.errors import SeqparError


def _run(tmp_path, latest: str = "step-000004"):
    model = tmp_path / "run" / "checkpoints" / "step-000004" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text(latest + "\n")
    return tmp_path / "run"


def test_a_run_folder_resolves_to_its_latest_export(tmp_path):
    run = _run(tmp_path)
    assert resolve_model_path(str(run)) == str(run / "checkpoints" / "step-000004" / "model")


@pytest.mark.parametrize("name", ["../../elsewhere", "/etc", "step-000004/../../..", "a\nb"])
def test_latest_naming_a_folder_outside_is_refused(tmp_path, name):
    run = _run(tmp_path, latest=name)
    outside = tmp_path / "elsewhere" / "model"
    outside.mkdir(parents=True)
    (outside / "config.json").write_text("{}")
    with pytest.raises(SeqparError, match="not a checkpoint folder beside it") as e:
        resolve_model_path(str(run))
    assert "\n" not in str(e.value)


def test_latest_as_a_link_is_refused(tmp_path):
    run = _run(tmp_path)
    latest = run / "checkpoints" / "latest"
    latest.unlink()
    (tmp_path / "name").write_text("step-000004")
    latest.symlink_to(tmp_path / "name")
    with pytest.raises(SeqparError, match="symbolic link"):
        resolve_model_path(str(run))
