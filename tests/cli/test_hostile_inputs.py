"""The exit-code contract on inputs forged as a hostile colleague would: every case below exits 2 with one line on stderr
naming the file or flag and what is wrong, and no traceback. Each case exited 3 ("internal error") with a traceback-class
message, or was accepted (a plan whose launch.env injected a fault, a 400-digit --steps handed to the ranks), before the
bounds in seqpar.plan.files, seqpar.plan.env and seqpar.cli.base.

The command-line cases are generated: every whole-number option of every command, found by walking the typer app, is
given a 400-digit value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import typer

from seqpar.cli import app
from seqpar.plan.files import MAX_JSON_BYTES, MAX_JSON_DEPTH

from seqpar_testing.cli import runner
from seqpar_testing.train import make_plan

HUGE = "9" * 400  # typer reads it (Python refuses only past 4300 digits), and torch, NumPy and the cost model cannot hold it
PLAN_COMMANDS = (["check"], ["explain"], ["launch", "--dry-run", "--output", "{out}"])


def refused(r, *needles: str) -> str:
    """The one line a refusal prints; asserts exit 2, nothing else on stderr, no traceback, nothing on stdout."""
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("seq_len ", "cluster: "))]
    assert r.exit_code == 2 and len(err) == 1 and err[0].startswith("error: "), (r.exit_code, r.stderr[-2000:])
    assert "Traceback" not in r.output and r.stdout == ""
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def plan_text(edit=None) -> str:
    """The tiny plan's JSON; ``edit(data)`` may set a value to "@RAW@", which the raw JSON text ``edit.raw`` replaces
    (what json.dumps cannot write: a 5001-digit integer, a bare NaN)."""
    data = json.loads(make_plan(2, "zigzag_ring_attn", 2).model_dump_json())
    if edit is not None:
        edit(data)
    text = json.dumps(data)
    return text.replace('"@RAW@"', edit.raw) if edit is not None and hasattr(edit, "raw") else text


def setting(path: str, value, raw: str | None = None):
    def edit(d):
        *head, last = path.split(".")
        for k in head:
            d = d[k]
        d[last] = "@RAW@" if raw is not None else value

    if raw is not None:
        edit.raw = raw
    return edit


def nested(depth: int):
    def edit(d):
        d["launch"]["env"] = {}
        inner: dict = {}
        d["rationale"]["extra"] = inner
        for _ in range(depth):
            inner["x"] = {}
            inner = inner["x"]

    return edit


PLAN_CASES = {
    "5001-digit integer": (setting("training.steps", None, "9" * 5001), "holds an integer of 5001 digits"),
    "400-digit integer": (setting("training.steps", None, HUGE), "holds an integer of 400 digits"),
    "integer past 2**63 - 1": (setting("training.seed", 2**63), "training.seed is 9223372036854775808, more than"),
    "NaN": (setting("training.learning_rate", None, "NaN"), "training.learning_rate is NaN, not a finite number"),
    "Infinity": (setting("cluster.host_ram_gib", None, "Infinity"), "cluster.host_ram_gib is Infinity"),
    "-Infinity": (setting("training.weight_decay", None, "-Infinity"), "training.weight_decay is -Infinity"),
    "1e999": (setting("training.steps", None, "1e999"), "training.steps is Infinity"),
    "lone surrogate": (setting("workload.model.name", None, '"tiny\\ud800"'), "workload.model.name holds a lone surrogate"),
    "lone surrogate in a key": (setting("launch.env", None, '{"A\\udfff": "1"}'), "a key of launch.env holds a lone"),
    "65 levels deep": (nested(MAX_JSON_DEPTH + 1), f"nests more than {MAX_JSON_DEPTH} levels deep"),
    "fault injection in launch.env": (
        setting("launch.env", {"SEQPAR_FAULT_RANK": "all", "SEQPAR_FAULT_STEP": "1"}),
        "SEQPAR_FAULT_RANK is one of seqpar's internal settings",
    ),
    "data cache in launch.env": (setting("launch.env", {"SEQPAR_DATA_CACHE": "/tmp/x"}), "SEQPAR_DATA_CACHE is one of"),
    "coefficients in launch.env": (setting("launch.env", {"SEQPAR_COEFFICIENTS": "/tmp/c.json"}), "SEQPAR_COEFFICIENTS"),
    "an interpreter in launch.env": (setting("launch.env", {"SEQPAR_AXOLOTL_PYTHON": "/tmp/py"}), "SEQPAR_AXOLOTL_PYTHON"),
    "an unparsable timeout": (setting("launch.env", {"SEQPAR_PG_TIMEOUT_S": "soon"}), "SEQPAR_PG_TIMEOUT_S is 'soon', not"),
    "an infinite timeout": (setting("launch.env", {"SEQPAR_PG_TIMEOUT_S": "inf"}), "not a number of seconds > 0"),
    "a zero timeout": (setting("launch.env", {"SEQPAR_PG_TIMEOUT_S": "0"}), "not a number of seconds > 0"),
    "a negative pinned budget": (setting("launch.env", {"SEQPAR_PINNED_BUDGET_GIB": "-1"}), "not a number of GiB"),
}


@pytest.mark.parametrize("command", PLAN_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_a_hostile_plan_exits_2_with_one_line(tmp_path, case, command):
    edit, needle = PLAN_CASES[case]
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text(edit))
    out = tmp_path / "out"
    argv = [a.format(out=out) for a in command]
    refused(invoke(*argv[:1], plan, *argv[1:]), needle)
    assert not out.exists()


def test_nesting_deeper_than_the_parser_exits_2(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text('{"workload": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(invoke("explain", plan), "nests too deeply to be a plan")


def test_internal_knobs_are_refused_even_when_allowed(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text(setting("launch.env", {"SEQPAR_FAULT_STEP": "1"})))
    r = invoke("launch", plan, "--output", tmp_path / "out", "--dry-run", "--allow-env", "SEQPAR_FAULT_STEP")
    refused(r, "SEQPAR_FAULT_STEP is one of seqpar's internal settings")
    plan.write_text(plan_text(setting("launch.env", {"SEQPAR_PG_TIMEOUT_S": "30", "SEQPAR_DEBUG": "1"})))
    r = invoke("launch", plan, "--output", tmp_path / "out", "--dry-run")  # seqpar's own settings a plan may make
    assert r.exit_code == 0 and "export SEQPAR_PG_TIMEOUT_S=30" in r.stdout, r.output


@pytest.mark.skipif(sys.platform != "linux", reason="FIFOs as on Linux")
def test_a_fifo_as_the_plan_is_refused_at_once(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    t0 = time.monotonic()
    refused(invoke("explain", fifo), "is a FIFO, not a file")
    assert time.monotonic() - t0 < 10


@pytest.mark.skipif(sys.platform != "linux", reason="the peak is read from /proc/self/status")
def test_a_150_mb_plan_is_refused_by_its_size_before_it_is_read(tmp_path):
    """`explain` on a 150 MB plan grew past 7.8 GB; the size is checked before a byte is parsed."""
    plan = tmp_path / "plan.json"
    head, tail = plan_text().split('"created_by": ""', 1)
    with open(plan, "w") as f:  # valid JSON, written a megabyte at a time
        f.write(head + '"created_by": "')
        for _ in range(150):
            f.write("x" * (1 << 20))
        f.write('"' + tail)
    assert plan.stat().st_size > 150 << 20
    # the child reports its own peak (VmHWM belongs to the memory it runs in after exec; rusage's maxrss would count
    # the forked test process's too)
    peak = "import atexit, sys; atexit.register(lambda: sys.stderr.write([x for x in open('/proc/self/status') if x.startswith('VmHWM')][0]))"
    run = "import runpy, sys; sys.argv = ['seqpar', 'explain', sys.argv[1]]; runpy.run_module('seqpar.cli', run_name='__main__')"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", f"{peak}\n{run}", str(plan)], capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    err, hwm = r.stderr.strip().splitlines()[:-1], r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert f"more than the {MAX_JSON_BYTES:,} a plan file can hold" in err[0]
    kib = int(hwm.split()[1])
    assert seconds < 30 and kib < 400 * 1024, (seconds, kib)


# --------------------------------------------------------------------------------------------- integer options


def _integer_options():
    """(command words, flag, needs a plan argument) for every whole-number option of every command."""
    out = []

    def walk(cmd, words):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*words, name])
            return
        args = [p for p in cmd.params if not p.opts[0].startswith("-")]
        for p in cmd.params:
            desc = getattr(p, "type_descriptor", None)
            kind = desc.annotation if desc is not None else getattr(getattr(p, "type", None), "name", None)
            if kind in (int, "integer") and p.opts[0].startswith("--"):
                out.append((words, p.opts[0], any(a.required for a in args)))

    walk(typer.main.get_command(app), [])
    return out


INTEGER_OPTIONS = _integer_options()


def test_the_generator_finds_the_integer_options():
    flags = {(" ".join(w), f) for w, f, _ in INTEGER_OPTIONS}
    assert {("launch", "--steps"), ("advise", "--sp-degree"), ("check", "--gpus"), ("eval needle", "--samples")} <= flags
    assert len(flags) >= 30


@pytest.mark.parametrize("words, flag, needs_plan", INTEGER_OPTIONS, ids=lambda x: x if isinstance(x, str) else None)
def test_a_400_digit_integer_option_exits_2_naming_the_flag(tmp_path, words, flag, needs_plan):
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text())
    r = invoke(*words, *([plan] if needs_plan else []), flag, HUGE)
    refused(r, f"error: {flag} 999999999999... (400 digits) is more than 9223372036854775807")


TINY = ["--model", "tiny", "--cluster", "cpu:2"]
TEXT_CASES = {  # options typer hands over as text, parsed by seqpar; files of numbers a flag names
    "--seq-len of 400 digits": (["advise", *TINY, "-s", HUGE], "sequence length 999999999999... has 400 digits"),
    "--seq-len of 5000 digits": (["check", *TINY, "-s", "9" * 5000], "sequence length 999999999999... has 5000 digits"),
    "--checkpoint-every of 5000 digits": (
        ["advise", *TINY, "-s", "256", "--checkpoint-every", "9" * 5000],
        "--checkpoint-every 999999999999... holds a number of 5000 digits",
    ),
    "--checkpoint-every past 2**63 - 1": (
        ["launch", "{plan}", "--output", "{out}", "--dry-run", "--checkpoint-every", "9" * 26],
        "--checkpoint-every 99999999999999999999999999 is more than 9223372036854775807",
    ),
    "--doc-lens with a 5000-digit length": (["advise", *TINY, "-s", "256", "--doc-lens", "{lens}"], "not valid JSON"),
    "--data with a 5000-digit number": (["advise", *TINY, "-s", "256", "--data", "{rows}"], "line 1 is not a JSON object"),
}


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_a_number_too_long_in_a_text_option_or_its_file_exits_2(tmp_path, case):
    argv, needle = TEXT_CASES[case]
    files = {
        "plan": tmp_path / "plan.json",
        "out": tmp_path / "out",
        "lens": tmp_path / "lens.json",
        "rows": tmp_path / "d.jsonl",
    }
    files["plan"].write_text(plan_text())
    files["lens"].write_text("[" + "9" * 5000 + "]")  # json.loads raised the int() limit's bare ValueError: exit 3
    files["rows"].write_text('{"text": "a", "n": ' + "9" * 5000 + "}\n")
    refused(invoke(*[a.format(**files) for a in argv]), needle)
    assert not files["out"].exists()


def test_a_5000_digit_integer_option_is_a_usage_error_not_a_traceback(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text())
    r = invoke("launch", plan, "--output", tmp_path / "out", "--dry-run", "--steps", "9" * 5000)
    assert r.exit_code == 2 and "Traceback" not in r.output and "--steps" in r.output  # typer's own usage error
