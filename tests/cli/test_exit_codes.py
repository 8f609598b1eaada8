"""The exit-code contract on hostile and broken inputs: 2 = invalid input (one line naming the file or flag and the field,
nothing written), 1 only for a verdict (`check`: risks OOM), 3 for an internal error. Each case below crashed with a
traceback-class message (exit 1, which a CI gate reads as "risks OOM"), or was accepted and written, before these rules.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.plan.errors import SeqparError
from seqpar.plan.units import parse_seq_len
from seqpar.profiles import get_model

from seqpar_testing.cli import device_node
from seqpar_testing.train import make_plan

runner = CliRunner()
MEASUREMENTS = Path(__file__).resolve().parents[2] / "seqpar" / "profiles" / "measurements"
REPORT = MEASUREMENTS / "h200_llama-3.2-1b_16k_data_parallel.json"
TINY = ["--model", "tiny", "--cluster", "cpu:2", "--seq-len", "256"]


def one_error_line(r, exit_code: int = 2) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("seq_len ", "cluster: "))]
    assert r.exit_code == exit_code and len(lines) == 1 and lines[0].startswith("error: "), (r.exit_code, r.stderr)
    assert r.stdout == ""
    return lines[0]


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


# --------------------------------------------------------------------------------------------- plan files (check)


def _plan(tmp_path: Path, edit) -> Path:
    data = json.loads(make_plan(2, "zigzag_ring_attn", 2).model_dump_json())
    edit(data)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(data))  # allow_nan: Infinity and NaN are written as JSON's non-standard literals
    return f


def _set(path: str, value):
    def edit(d):
        *head, last = path.split(".")
        for k in head:
            d = d[k]
        d[last] = value

    return edit


PLAN_CASES = {
    "seed -1": (_set("training.seed", -1), "training.seed: Input should be greater than or equal to 0"),
    "seed 2**40": (_set("training.seed", 2**40), "training.seed: Input should be less than or equal to 4294967295"),
    "seed 2**70": (_set("training.seed", 2**70), "training.seed is 1180591620717411303424, more than 9223372036854775807"),
    "learning rate Infinity": (_set("training.learning_rate", math.inf), "training.learning_rate is Infinity, not a finite"),
    "grad clip NaN": (_set("training.grad_clip", math.nan), "training.grad_clip is NaN, not a finite number"),
    "host RAM Infinity": (_set("cluster.host_ram_gib", math.inf), "cluster.host_ram_gib is Infinity, not a finite number"),
    "gpt2": (_set("workload.model.architecture", "gpt2"), "architecture: Input should be 'llama', 'mistral'"),
    "lone surrogate": (_set("workload.model.name", "tiny\ud800"), "workload.model.name holds a lone surrogate"),
    "env key with =": (_set("launch.env", {"A=B": "1"}), "environment variable name 'A=B' is not a name"),
    "env key with NUL": (_set("launch.env", {"A\0": "1"}), "environment variable name 'A\\x00' is not a name"),
    "env value with NUL": (_set("launch.env", {"NCCL_DEBUG": "IN\0FO"}), "NCCL_DEBUG holds a NUL character"),
    "PYTHONPATH": (_set("launch.env", {"PYTHONPATH": "/tmp/evil"}), "sets launch.env PYTHONPATH, which a plan may not"),
    "NCCL plugin": (_set("launch.env", {"NCCL_NET_PLUGIN": "/tmp/x.so"}), "sets launch.env NCCL_NET_PLUGIN"),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_check_refuses_a_bad_plan_with_exit_2(tmp_path, case):
    edit, match = PLAN_CASES[case]
    r = invoke("check", _plan(tmp_path, edit))
    assert match in one_error_line(r)


def test_check_refuses_deep_nesting_with_exit_2(tmp_path):
    f = tmp_path / "plan.json"
    f.write_text('{"workload": ' * 100_000 + "1" + "}" * 100_000)  # RecursionError in the JSON parser
    assert "nests too deeply to be a plan" in one_error_line(invoke("check", f))


def test_zero_heads_in_a_model_config_exits_2(tmp_path):
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 0, "intermediate_size": 128, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = invoke("check", "--seq-len", "1k", "--gpu", "h100", "--gpus", "1", "--model", tmp_path / "config.json")
    assert "num_attention_heads 0 must be a positive whole number" in one_error_line(r)


def test_a_model_path_that_is_not_utf8_exits_2(tmp_path):
    folder = os.fsdecode(os.fsencode(tmp_path) + b"/model\xff")  # Python holds the byte as a lone surrogate
    os.mkdir(folder)
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    Path(folder, "config.json").write_text(json.dumps(cfg))
    r = invoke("advise", "--seq-len", "1k", "--gpu", "h100", "--gpus", "1", "--model", folder, "-o", tmp_path / "plan.json")
    assert "holds bytes that are not UTF-8 text" in one_error_line(r) and not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("value", [-1.0, 0.0, "NaN"])
def test_forged_coefficients_exit_2_naming_file_and_field(tmp_path, value):
    data = json.loads((Path(__file__).resolve().parents[2] / "seqpar/profiles/coefficients.json").read_text())
    data["values"]["attn_time_factor"] = float(value)
    f = tmp_path / "coefficients.json"
    f.write_text(json.dumps(data))
    r = invoke("check", "--seq-len", "64k", "--gpu", "h200", "--gpus", "1", env={"SEQPAR_COEFFICIENTS": str(f)})
    msg = one_error_line(r)
    assert f"coefficients file '{f}' (SEQPAR_COEFFICIENTS): values.attn_time_factor = {float(value)!r}" in msg


# --------------------------------------------------------------------------------------------- flags and output paths


def _special(tmp_path: Path, kind: str) -> Path:
    out = tmp_path / "out"
    if kind == "folder":
        out.mkdir()
    elif kind == "fifo":
        os.mkfifo(out)
    elif kind == "device":
        device_node(out)
    else:  # a link to a device: the link would be replaced, never the device
        out.symlink_to(device_node(tmp_path / "null"))
    return out


@pytest.mark.parametrize(
    "kind, match", [("folder", "is a folder"), ("fifo", "is a FIFO"), ("device", "is a device"), ("link to a device", "device")]
)
def test_output_onto_a_non_file_is_refused_and_left_alone(tmp_path, kind, match):
    target = _special(tmp_path, kind)
    before = os.stat(target)
    r = invoke("advise", *TINY, "-o", target)
    assert match in one_error_line(r)
    after = os.stat(target)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)
    assert os.path.islink(target) == (kind == "link to a device")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["null", "out"] if kind == "link to a device" else ["out"])


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--host-ram-gib", "inf"], "--host-ram-gib inf is not a finite amount of RAM"),
        (["--gpu", "", "--gpus", "1"], "--gpu is empty"),
        (["--model", " "], "--model is empty"),
    ],
)
def test_flags_no_request_can_mean_exit_2(tmp_path, flags, match):
    r = invoke("advise", "--seq-len", "1k", *flags, "-o", tmp_path / "plan.json")
    assert match in one_error_line(r) and not (tmp_path / "plan.json").exists()


def test_seq_len_is_parsed_exactly():
    assert parse_seq_len("9007199254740993") == 9007199254740993  # 2**53 + 1: a float makes it ...992
    assert parse_seq_len("9007199254740993k") == 9007199254740993 * 1024
    assert parse_seq_len("1.5k") == 1536 and parse_seq_len("0.5M") == 524288
    with pytest.raises(SeqparError, match="not a whole number of tokens"):
        parse_seq_len("1.0001k")
    r = invoke("advise", "--seq-len", "9007199254740993", "--model", "tiny", "--cluster", "cpu:2", "--json")
    assert r.stderr.splitlines()[0] == "seq_len 9007199254740993 (9007199254740993)"


def test_launch_output_that_is_a_file_exits_2(tmp_path):
    plan = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2).write(plan)
    (tmp_path / "out").write_text("a file")
    r = invoke("launch", plan, "--output", tmp_path / "out", "--steps", "1")
    assert "is a file, not a folder" in one_error_line(r)
    assert (tmp_path / "out").read_text() == "a file"


# --------------------------------------------------------------------------------------------- calibrate


def _report(tmp_path: Path, **measured) -> Path:
    data = json.loads(REPORT.read_text())
    data["measured"].update(measured)
    f = tmp_path / "report.json"
    f.write_text(json.dumps(data))
    return f


@pytest.mark.parametrize(
    "value, match",
    [
        (-12000, "tokens_per_s -12000 is not a finite positive number"),
        (math.inf, "tokens_per_s inf is not a finite positive number"),
        (math.nan, "tokens_per_s nan is not a finite positive number"),
        ("fast", "tokens_per_s 'fast' is not a number"),
        ([1, 2], "tokens_per_s [1, 2] is not a finite positive number"),
        (1e9, "tokens_per_s 1e+09 would be"),  # far above the H200's peak for this model
    ],
)
def test_calibrate_refuses_bad_measurements(tmp_path, value, match):
    f = _report(tmp_path, tokens_per_s=value)
    r = invoke("calibrate", f, "-o", tmp_path / "coefficients.json")
    msg = one_error_line(r)
    assert f"run report '{f.name}'" in msg and match in msg, msg
    assert not (tmp_path / "coefficients.json").exists()


def test_calibrate_refuses_bad_csv_files(tmp_path):
    good = (MEASUREMENTS / "h200_stock_transformers.csv").read_text()
    cases = {
        "latin1.csv": (good.replace("stock transformers", "stock transformers caf\xe9").encode("latin-1"), "is not UTF-8 text"),
        "header.csv": (good.replace("tokens_per_s", "tokens_per_sec").encode(), "unknown columns tokens_per_sec"),
        "inf.csv": (good.replace(",4165,", ",Infinity,").encode(), "row 1: tokens_per_s inf is not a finite positive number"),
    }
    for name, (content, match) in cases.items():
        f = tmp_path / name
        f.write_bytes(content)
        r = invoke("calibrate", f, "-o", tmp_path / "coefficients.json")
        msg = one_error_line(r)
        assert f"measurement file '{f}'" in msg and match in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cases)


def test_calibrate_output_onto_a_folder_exits_2(tmp_path):
    (tmp_path / "out").mkdir()
    shutil.copy(REPORT, tmp_path / "report.json")
    assert "is a folder" in one_error_line(invoke("calibrate", tmp_path / "report.json", "-o", tmp_path / "out"))


def test_shipped_profiles_pass_the_checks():
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.measurements import load_measurements

    assert load_coefficients().attn_time_factor > 0 and len(load_measurements()) > 30
    assert get_model("tiny").architecture == "llama"
