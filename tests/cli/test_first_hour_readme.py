"""The README's commands, exercised as written: every shell line of its ```bash blocks runs (each block in a fresh folder,
in order) unless it is named below with what it needs that this machine lacks; every `seqpar ...` it shows (code spans
too) uses options the command has; the CI example's checks run on a plan; and the Python training-loop example runs on
two gloo ranks, with only what a CPU needs changed, without a deprecation warning from transformers."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from seqpar.cli import app
from seqpar.plan.launch_plan import LaunchPlan

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BIN = str(Path(sys.executable).parent)

# Lines not run here, each with what it needs. A README line in neither this table nor run fails the test.
NOT_HERE = {
    "pip install -e .": "installs seqpar: the test runs inside that install",
    "pip install -e '.[runtime]'": "installs the runtime extra: the test runs inside that install",
    "bash .ci/run": "the test suite itself (CI runs it)",
    "seqpar eval plan.json --model-path runs/plan --data heldout.npy --seq-len 32k,64k,128k": "a trained run and held-out data",
    "seqpar eval needle plan.json --model-path ./Llama-2-7B-512K --lengths 64k,128k,256k,512k": "a downloaded 7B model and GPUs",
    "seqpar eval plan.json --model-path ./weights --tokenizer ./tok --data chats.jsonl": (
        "a model folder, a tokenizer and chats (tests/runtime/eval/test_eval_tokenizer.py runs it)"
    ),
    "seqpar launch plan.json --data chats.jsonl --model-path ./Qwen2.5-0.5B-Instruct": "a downloaded chat model (tests/runtime/data/test_data_train.py trains chats)",
    "seqpar launch plan.json --data corpus.jsonl --tokenizer ./tok --long-documents error": "a corpus and a tokenizer folder",
    "seqpar verify plan.json": "a plan of this machine's GPUs (tests/runtime/train/test_verify.py runs verify on CPU plans)",
    "seqpar launch plan.json --verify ...": "elided arguments",
    "seqpar check plan.axolotl.yaml --gpu h100 --gpus 8": "a file of `seqpar advise --emit` (tests/emit/test_interop_check.py)",
    "seqpar check plan.sft.yaml plan.accelerate.yaml --gpu h200": "files of `seqpar advise --emit` (tests/emit/test_interop_check.py)",
    "seqpar check ds_config.json --gpu h100 --gpus 8 --seq-len 128k --model Qwen/Qwen2.5-7B-Instruct --checkpointing full": (
        "a DeepSpeed config and the Hub (tests/emit/test_interop_check.py, tests/profiles/test_model_ids.py)"
    ),
}


def blocks(lang: str) -> list[list[str]]:
    """The README's ```lang blocks, as lists of command lines (comments dropped)."""
    out = []
    for body in re.findall(rf"```{lang}\n(.*?)```", README, re.S):
        lines = [re.sub(r"\s+#.*$", "", ln).strip() for ln in body.splitlines()]
        out.append([ln for ln in lines if ln and not ln.startswith("#")])
    return out


def shell(line: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_shell_commands_run_as_written(tmp_path):
    """Each block in a fresh folder, except that a block repeating lines of an earlier one (the quick start's CPU run,
    again in "Train with seqpar") continues in that block's folder: each distinct command runs once."""
    ran: dict[str, Path] = {}  # command -> the folder it ran in
    stderr: dict[str, str] = {}
    for i, block in enumerate(blocks("bash")):
        commands = []
        for line in block:
            parts = [p.strip() for p in line.split("&&")]
            todo = [p for p in parts if p not in NOT_HERE]
            unknown = [p for p in todo if not p.startswith("seqpar ")]
            assert not unknown, f"README line the test neither runs nor names in NOT_HERE: {unknown}"
            if todo:
                commands.append((line, " && ".join(todo)))
        here = next((ran[c] for _, c in commands if c in ran), tmp_path / f"block{i}")
        here.mkdir(exist_ok=True)
        for line, cmd in commands:
            if cmd in ran:
                continue
            p = shell(cmd, here)
            assert p.returncode == 0, f"README: {line}\n{p.stderr[-3000:]}"
            ran[cmd], stderr[cmd] = here, p.stderr
    first = next(ran[c] for c in ran if "--mode zigzag_ring_attn" in c)
    plan = LaunchPlan.load(first / "plan.json")
    assert plan.strategy.mode == "zigzag_ring_attn" and plan.strategy.sp_degree == 2  # the first run shows sequence parallelism
    # what the README says the first run prints: the predicted bill first, then the measured tokens/s beside the
    # predicted, and the folder of the exported model last
    launch = next(c for c in ran if c.startswith("seqpar launch") and ran[c] == first)
    lines = [ln for ln in stderr[launch].splitlines() if ln.startswith("seqpar launch: ")]
    steps = int(re.search(r"--steps (\d+)", launch).group(1))
    assert lines[0].startswith(f"seqpar launch: predicted {steps} steps x ") and "rank-hours on 2 CPU ranks" in lines[0]
    report = json.loads((first / "runs" / "plan" / "run_report.json").read_text())
    m, pr = report["measured"]["tokens_per_s"], report["predicted"]["tokens_per_s"]
    done = f"seqpar launch: done, {steps} steps; tokens/s {m:,.0f} measured, {pr:,.0f} predicted ({m / pr - 1:+.0%})"
    assert lines[-2].startswith(done), lines
    model = Path("runs", "plan", "checkpoints", f"step-{steps:06d}", "model")
    assert lines[-1] == f"seqpar launch: model exported to {model} (transformers' from_pretrained reads it)", lines
    assert (first / model / "config.json").is_file()
    assert f"exported model (`{model}`" in README  # the quick start names the folder the launch prints
    assert any(r.startswith("seqpar calibrate") for r in ran) and any(r.startswith("seqpar explain") for r in ran)
    assert len(ran) >= 7
    # "LoRA and QLoRA": its launch names the adapter, and its Python (load_lora.py) loads the adapter with peft and the
    # merged model with transformers where the launch ran
    lora = next(c for c in ran if c.startswith("seqpar launch lora.json"))
    assert "LoRA adapter exported to runs/lora/checkpoints/step-000005/adapter" in stderr[lora]
    (load,) = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "load_lora.py" in b]
    p = subprocess.run([sys.executable, "-c", load], cwd=ran[lora], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"README load_lora.py:\n{p.stderr[-3000:]}"


def test_readme_ci_example_checks_a_plan(tmp_path):
    (yaml,) = [b for b in blocks("yaml") if any("seqpar check" in ln for ln in b)]
    runs = [ln.split("run:", 1)[1].strip() for ln in yaml if "run:" in ln]
    assert [r for r in runs if not r.startswith("seqpar ")] == ["pip install -e ."]
    assert shell("seqpar advise --seq-len 64k --gpu h100 --gpus 8 -o plan.json", tmp_path).returncode == 0
    for r in runs[1:]:
        p = shell(r, tmp_path)
        assert p.returncode in (0, 1), f"{r}: {p.stderr}"  # 0 fits, 1 risks OOM: the gate's verdicts


def _options() -> dict[tuple[str, ...], set[str]]:
    out = {}

    def walk(group, path):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                walk(cmd, (*path, name))
            else:
                out[(*path, name)] = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}  # every command's

    walk(typer.main.get_command(app), ())
    return out


def test_every_option_the_readme_shows_exists():
    options = _options()
    shown = [ln for b in blocks("bash") for ln in b] + re.findall(r"`(seqpar [^`]+)`", README)
    shown += [ln.split("run:", 1)[1] for b in blocks("yaml") for ln in b if "run: seqpar" in ln]
    checked = 0
    for text in shown:
        for cmd in text.split("&&"):
            words = shlex.split(cmd.replace("\\|", "|"))
            if not words or words[0] != "seqpar" or len(words) < 2 or words[1] not in {p[0] for p in options}:
                continue
            path = (words[1],)
            if words[1] in ("profiles", "eval"):
                sub = words[2] if len(words) > 2 and (words[1], words[2]) in options else "perplexity"
                path = (words[1], sub)
            flags = [w.split("=")[0] for w in words if w.startswith("--")]
            missing = [f for f in flags if f not in options[path]]
            assert not missing, f"README shows `{cmd.strip()}`: seqpar {' '.join(path)} has no {missing}"
            checked += 1
    advise_table = README.split("`seqpar advise` options:")[1].split("\n\n")[1]
    for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", advise_table):
        assert flag in options[("advise",)], f"README's advise options table names {flag}"
    assert checked > 30


# --------------------------------------------------------------------------------------------- the Python example

CPU = [  # (as written for GPUs, what a CPU run needs instead)
    ('dist.init_process_group("nccl")', 'dist.init_process_group("gloo")'),
    ('torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))', "pass"),
    (".cuda()", ""),
    ('"Qwen/Qwen2.5-0.5B"', "MODEL"),
    ("(1, 32768)", "(1, 64)"),
    ("range(10)", "range(2)"),
]


def test_readme_training_loop_runs_without_deprecated_calls(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    (example,) = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "train_sp.py" in b]
    for gpu, cpu in CPU:
        assert gpu in example, f"the README example changed ({gpu!r} is gone): update this test's CPU substitutions"
        example = example.replace(gpu, cpu)
    model = tmp_path / "model"
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    LlamaForCausalLM(LlamaConfig(**cfg, num_key_value_heads=2, max_position_embeddings=256)).save_pretrained(model)
    script = tmp_path / "train_sp.py"
    script.write_text(f"MODEL = {str(model)!r}\n" + example)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [ln.split() for ln in p.stdout.splitlines() if re.fullmatch(r"\d+ \d+\.\d+", ln.strip())]
    assert [int(s) for s, _ in losses] == [0, 1]
    said = [ln for ln in p.stderr.splitlines() if re.search(r"deprecat", ln, re.I)]
    assert not said, "the README example calls what transformers deprecates:\n" + "\n".join(said)


@pytest.mark.parametrize("name", ["torch_dtype=", "gradient_checkpointing_enable"])
def test_readme_python_has_no_deprecated_transformers_names(name):
    assert name not in "".join(re.findall(r"```python\n(.*?)```", README, re.S))
