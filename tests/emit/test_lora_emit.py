"""LoRA and QLoRA through the export targets: `seqpar advise --emit` writes each tool's own LoRA keys (TRL's peft and
bitsandbytes arguments, Axolotl's adapter keys, ArcticTraining's model.peft_config; accelerate and DeepSpeed carry the
adapters in the seqpar: block), `seqpar check` reads them back into the workload's lora and predicts what advise
predicted, not a partial verdict; hand-written configs read as their tools (trl 1.16.0, peft 0.21.2) read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from seqpar.plan.specs import LORA_ALL_LINEAR

from seqpar_testing.cli import run

H100x8 = ["-m", "llama-3.1-8b", "--gpu", "h100", "--gpus", "8"]
FILES = {
    "trl": ("sft.yaml", "accelerate.yaml", "ds_config.json"),
    "axolotl": ("axolotl.yaml",),
    "arctic": ("arctic.yaml",),
    "accelerate": ("accelerate.yaml", "ds_config.json"),
    "deepspeed": ("deepspeed.json",),
}


def emitted(tmp_path: Path, tool: str, *flags: str) -> tuple[dict, list[Path]]:
    """The plan `advise --emit tool` wrote (as JSON) and the tool's files."""
    plan = tmp_path / f"{tool}.json"
    r = run("advise", "-s", "64k", *flags, "-o", plan, "--emit", tool, "--json")
    assert r.exit_code == 0, r.output
    files = [tmp_path / f"{tool}.{suffix}" for suffix in FILES[tool]]
    return json.loads(r.stdout), [f for f in files if f.exists()]


def checked(*paths: Path) -> dict:
    r = run("check", *paths, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def keys_of(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("tool", list(FILES))
def test_lora_emitted_and_checked_back(tmp_path, tool):
    flags = [*H100x8, "--lora-rank", "32", "--lora-alpha", "64", "--lora-targets", "q_proj,k_proj,v_proj,o_proj"]
    plan, files = emitted(tmp_path, tool, *flags)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if tool == "trl":
        sft = keys_of(files[0])
        assert {k: sft[k] for k in ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "dtype")} == {
            "use_peft": True,
            "lora_r": 32,
            "lora_alpha": 64,
            "lora_dropout": 0.0,
            "lora_target_modules": targets,
            "dtype": "bfloat16",
        }
        assert "load_in_4bit" not in sft
    elif tool == "axolotl":
        cfg = keys_of(files[0])
        assert {k: cfg[k] for k in ("adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")} == {
            "adapter": "lora",
            "lora_r": 32,
            "lora_alpha": 64,
            "lora_dropout": 0.0,
            "lora_target_modules": targets,
        }
    elif tool == "arctic":
        assert keys_of(files[0])["model"]["peft_config"] == {
            "peft_type": "LORA",
            "r": 32,
            "lora_alpha": 64,
            "lora_dropout": 0.0,
            "target_modules": targets,
        }
    got = checked(*files)
    assert not got["partial"], got["not_understood"]
    assert got["workload"]["lora"] == plan["workload"]["lora"]
    # the prediction of the tool's strategy as --emit made it (recorded in the files' seqpar: block)
    assert got["prediction"]["peak_memory_gib"] == pytest.approx(got["emitted"]["predicted_peak_memory_gib"], abs=1e-3)
    assert got["prediction"]["tokens_per_s"] == pytest.approx(got["emitted"]["predicted_tokens_per_s"], abs=0.1)
    if got["strategy"] == plan["strategy"]:  # the tool runs the plan's own strategy: advise's prediction
        assert got["prediction"]["peak_memory_gib"] == plan["prediction"]["peak_memory_gib"]


@pytest.mark.parametrize("tool", ["trl", "axolotl"])
def test_qlora_emitted_and_checked_back(tmp_path, tool):
    one = ["-m", "llama-3.1-8b", "--gpu", "h100", "--gpus", "1", "--lora-rank", "16", "--qlora"]
    plan, files = emitted(tmp_path, tool, *one)
    cfg = keys_of(files[0] if tool == "axolotl" else next(f for f in files if f.name.endswith("sft.yaml")))
    if tool == "trl":
        assert (cfg["load_in_4bit"], cfg["bnb_4bit_quant_type"], cfg["use_bnb_nested_quant"]) == (True, "nf4", True)
        assert cfg["lora_target_modules"] == "all-linear"
    else:
        assert (cfg["adapter"], cfg["load_in_4bit"], cfg["lora_target_linear"]) == ("qlora", True, True)
    got = checked(*files)
    assert not got["partial"] and got["workload"]["lora"]["base_dtype"] == "nf4"
    # TRL's SFTTrainer keeps a 4-bit base's adapters in bf16: predicted so by --emit and by check alike
    assert got["workload"]["optimizer"] == ("adamw-bf16" if tool == "trl" else "adamw")
    assert got["prediction"]["peak_memory_gib"] == pytest.approx(got["emitted"]["predicted_peak_memory_gib"], abs=1e-3)


def test_arctic_refuses_qlora_before_writing(tmp_path):
    plan = tmp_path / "p.json"
    r = run("advise", "-s", "64k", "-m", "llama-3.1-8b", "--gpu", "h100", "--gpus", "1", "--lora-rank", "16", "--qlora")
    assert r.exit_code == 0
    r = run("advise", "-s", "64k", "-m", "llama-3.1-8b", "--gpu", "h100", "--gpus", "1", "--lora-rank", "16", "--qlora",
            "-o", plan, "--emit", "arctic")  # fmt: skip
    assert r.exit_code == 2 and "ArcticTraining loads its base without 4-bit quantization" in r.stderr.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


TRL = {"model_name_or_path": "meta-llama/Llama-3.1-8B", "max_length": 65536, "per_device_train_batch_size": 1}
TRL |= {"bf16": True, "dtype": "bfloat16", "gradient_checkpointing": True}


def write(tmp_path: Path, name: str, data: dict) -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize(
    "extra,lora,optimizer,partial",
    [
        # TRL's defaults: r 16, alpha 32, dropout 0.05, peft's q_proj v_proj for a Llama
        ({"use_peft": True}, (16, 32.0, 0.05, ["q_proj", "v_proj"], "bf16"), "adamw", []),
        (
            {"use_peft": True, "lora_r": 32, "lora_target_modules": "all-linear", "load_in_4bit": True}
            | {"use_bnb_nested_quant": True},
            (32, 32.0, 0.05, list(LORA_ALL_LINEAR), "nf4"),
            "adamw-bf16",
            [],
        ),
        (
            {"use_peft": True, "load_in_4bit": True, "use_dora": True, "lora_target_modules": ["q_proj", "lm_head"]},
            (16, 32.0, 0.05, ["q_proj"], "nf4"),
            "adamw-bf16",
            [
                "t.yaml: lora_target_modules lm_head (adapters on no decoder linear; predicted without them)",
                "t.yaml: use_dora True (DoRA's magnitude vectors and its per-step weight norms)",
                "t.yaml: use_bnb_nested_quant false (fp32 block scales: 1/21 byte per weight more than the double "
                "quantization predicted)",
            ],
        ),
        (
            {"use_peft": True, "dtype": "float32"},
            (16, 32.0, 0.05, ["q_proj", "v_proj"], "bf16"),
            "adamw",
            ["t.yaml: dtype float32 with use_peft (the frozen base loaded in fp32; predicted in bf16)"],
        ),  # fmt: skip
    ],
)
def test_trl_lora_keys_read(tmp_path, extra, lora, optimizer, partial):
    got = json.loads(run("check", write(tmp_path, "t.yaml", TRL | extra), "--gpu", "h100", "--gpus", "1", "--json").stdout)
    rank, alpha, dropout, targets, base = lora
    assert got["workload"]["lora"] == {
        "rank": rank,
        "alpha": alpha,
        "dropout": dropout,
        "target_modules": targets,
        "base_dtype": base,
    }
    assert got["workload"]["optimizer"] == optimizer
    assert got["not_understood"] == partial and got["partial"] == bool(partial)


def test_axolotl_and_arctic_lora_keys_read(tmp_path):
    ax = {"base_model": "meta-llama/Llama-3.1-8B", "datasets": [{"path": "x", "type": "completion"}]}
    ax |= {"sequence_len": 65536, "gradient_checkpointing": True, "adapter": "qlora", "load_in_4bit": True}
    ax |= {"lora_r": 64, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": ["down_proj", "up_proj"]}
    got = json.loads(run("check", write(tmp_path, "a.yaml", ax), "--gpu", "h100", "--gpus", "1", "--json").stdout)
    assert not got["partial"]
    assert got["workload"]["lora"] == {
        "rank": 64,
        "alpha": 16.0,
        "dropout": 0.0,
        "target_modules": ["up_proj", "down_proj"],
        "base_dtype": "nf4",
    }
    arctic = {
        "type": "sft",
        "model": {"name_or_path": "meta-llama/Llama-3.1-8B", "peft_config": {"peft_type": "LORA", "r": 8}},
        "data": {"sources": ["x"], "max_length": 65536},
    }
    got = json.loads(run("check", write(tmp_path, "c.yaml", arctic), "--gpu", "h100", "--gpus", "1", "--json").stdout)
    assert not got["partial"]
    assert got["workload"]["lora"]["rank"] == 8 and got["workload"]["lora"]["target_modules"] == ["q_proj", "v_proj"]
    bad = arctic | {"model": {"name_or_path": "x", "peft_config": {"peft_type": "LORA", "r": 0}}}
    r = run("check", write(tmp_path, "d.yaml", bad), "--gpu", "h100", "--gpus", "1")
    assert r.exit_code == 2 and "model.peft_config.r 0 is not a whole number >= 1" in r.stderr
