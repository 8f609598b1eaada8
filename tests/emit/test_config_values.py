"""`seqpar check CONFIG...` validates every value it reads from a tool's config: a count that is NaN, infinite, negative,
zero, a fraction, a boolean, text or beyond 2**63 - 1, and a ZeRO stage outside 0-3, exit 2 with one line naming the
file and the key. Before, check read micro-batch NaN as "not set" and said "fits", read a DeepSpeed stage of -1 as a
partial verdict, and exited 3 on an accelerate zero_stage of .inf.

The cases are generated: every numeric key each tool's reader maps (seqpar.emit.<tool>.read) times every hostile value,
minus the values the tool itself gives a meaning (stage 0, accelerate's num_processes -1, DeepSpeed's "auto"). The files
themselves are bounded too: size, YAML aliases spelled out (a "billion laughs"), integers of thousands of digits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from seqpar.cli import app
from seqpar.plan.files import MAX_JSON_BYTES

from seqpar_testing.cli import runner

H100x8 = ["--gpu", "h100", "--gpus", "8", "--seq-len", "64k"]
LLAMA = "meta-llama/Meta-Llama-3-8B"
BASES = {  # (file name, a config each tool runs, the numeric keys its reader maps)
    "trl": ("sft.yaml", {"model_name_or_path": LLAMA, "max_length": 8192}, ["max_length", "per_device_train_batch_size", "gradient_accumulation_steps"]),
    "axolotl": (
        "axolotl.yaml",
        {"base_model": LLAMA, "sequence_len": 8192, "micro_batch_size": 1},
        ["sequence_len", "micro_batch_size", "gradient_accumulation_steps", "context_parallel_size", "sequence_parallel_degree", "tensor_parallel_size", "deepspeed.zero_optimization.stage"],
    ),
    "arctic": (
        "arctic.yaml",
        {"model": {"name_or_path": LLAMA}, "data": {"max_length": 8192}},
        ["data.max_length", "micro_batch_size", "gradient_accumulation_steps", "sequence_parallel_size", "deepspeed.train_micro_batch_size_per_gpu"],
    ),
    "deepspeed": (
        "ds.json",
        {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1},
        ["zero_optimization.stage", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "sequence_parallel_size"],
    ),
    "accelerate": (
        "accelerate.yaml",
        {"distributed_type": "DEEPSPEED", "num_processes": 8, "deepspeed_config": {"zero_stage": 2}},
        ["num_processes", "num_machines", "deepspeed_config.zero_stage", "parallelism_config.parallelism_config_sp_size"],
    ),
}  # fmt: skip
HOSTILE = {"NaN": math.nan, "inf": math.inf, "-inf": -math.inf, "-1": -1, "0": 0, "2.5": 2.5, "true": True}
HOSTILE |= {"text": "lots", "2**63": 2**63}
MEANT = {("stage", "0"), ("zero_stage", "0"), ("num_processes", "-1")}  # values the tool gives a meaning


def write(tmp_path: Path, name: str, data) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return p


def with_value(data: dict, dotted: str, value) -> dict:
    out = json.loads(json.dumps(data))
    d = out
    *head, last = dotted.split(".")
    for k in head:
        d = d.setdefault(k, {})
    d[last] = value
    return out


def check(*args):
    return runner.invoke(app, ["check", *map(str, args)])


def one_line(r) -> str:
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("cluster:")]
    assert r.exit_code == 2 and len(err) == 1 and err[0].startswith("error: "), (r.exit_code, r.output[-2000:])
    assert "Traceback" not in r.output
    return err[0]


# the default set takes every third value of each key (rotating, so every value meets every tool); -m slow the rest
CASES = [
    pytest.param(tool, key, shown, marks=() if (i + j) % 3 == 0 else pytest.mark.slow)
    for i, (tool, key) in enumerate((t, k) for t, (_, _, keys) in BASES.items() for k in keys)
    for j, shown in enumerate(HOSTILE)
    if (key.split(".")[-1], shown) not in MEANT
]


@pytest.mark.parametrize("tool, key, shown", CASES)
def test_a_hostile_value_exits_2_naming_the_key(tmp_path, tool, key, shown):
    name, base, _ = BASES[tool]
    # a JSON file gets NaN and Infinity as json.dumps writes them: the non-standard literals Python's json reads
    msg = one_line(check(write(tmp_path, name, with_value(base, key, HOSTILE[shown])), *H100x8))
    assert name in msg and key.split(".")[-1] in msg, msg


MEANT_VALUES = [
    ("deepspeed", "zero_optimization.stage", 0),
    ("accelerate", "deepspeed_config.zero_stage", 0),
    ("accelerate", "num_processes", -1),
    ("deepspeed", "train_micro_batch_size_per_gpu", "auto"),
    ("deepspeed", "gradient_accumulation_steps", "auto"),
    ("trl", "max_length", 4096),
]


@pytest.mark.parametrize("tool, key, value", MEANT_VALUES)
def test_what_the_tools_give_a_meaning_is_read(tmp_path, tool, key, value):
    name, base, _ = BASES[tool]
    r = check(write(tmp_path, name, with_value(base, key, value)), *H100x8, "--json")
    assert r.exit_code in (0, 1), r.output
    got = json.loads(r.stdout)
    if key.endswith("stage"):
        assert got["strategy"]["sharding"] == "ddp"
    if key == "max_length":
        assert got["workload"]["seq_len"] == 4096


def test_a_5000_digit_integer_in_yaml_exits_2(tmp_path):
    p = tmp_path / "axolotl.yaml"
    p.write_text(f"base_model: {LLAMA}\nsequence_len: {'9' * 5000}\n")  # PyYAML's int() raised a bare ValueError: exit 3
    assert "holds an integer of over 4300 digits" in one_line(check(p, *H100x8))


def test_a_5000_digit_integer_in_deepspeed_json_exits_2(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": ' + "9" * 5000 + "}")
    assert "holds an integer of 5000 digits" in one_line(check(p, *H100x8))


def _laughs(levels: int) -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, needle",
    [
        (f"base_model: {LLAMA}\nsequence_len: 8192\n" + _laughs(9) + "adapter: *l8\n", "spells out over"),  # 10**9 values
        (f"model_name_or_path: {LLAMA}\n" + _laughs(9) + "gradient_checkpointing_kwargs: {offload: *l8}\n", "spells out over"),
        (f"base_model: {LLAMA}\nloop: &a [*a]\n", "spells out endlessly many values"),  # an alias inside its own anchor
    ],
)
def test_yaml_aliases_that_spell_out_too_much_exit_2(tmp_path, text, needle):
    p = tmp_path / "c.yaml"
    p.write_text(text)  # printing the adapter's value (the partial verdict names it) spelled out 10**9 strings: a hang
    assert needle in one_line(check(p, *H100x8))


def test_aliases_a_config_uses_are_read(tmp_path):
    p = tmp_path / "axolotl.yaml"
    p.write_text(f"base_model: {LLAMA}\nsequence_len: &len 8192\neval_sequence_len: *len\nmicro_batch_size: 1\n")
    r = check(p, *H100x8, "--json")
    assert r.exit_code in (0, 1) and json.loads(r.stdout)["workload"]["seq_len"] == 8192, r.output


@pytest.mark.parametrize("name", ["big.yaml", "big.json"])
def test_a_config_past_the_size_bound_is_refused_before_it_is_read(tmp_path, name):
    p = tmp_path / name
    with open(p, "w") as f:
        f.write('{"base_model": "x", "pad": "' if name.endswith(".json") else "base_model: x\npad: ")
        f.write("x" * (MAX_JSON_BYTES + 1))
        f.write('"}' if name.endswith(".json") else "\n")
    msg = one_line(check(p, *H100x8))  # a .json file that cannot be read is judged as a plan, the likelier
    assert f"more than the {MAX_JSON_BYTES:,} a {'plan file' if name.endswith('.json') else 'config'} can hold" in msg
