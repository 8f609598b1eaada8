"""`seqpar advise --emit axolotl|arctic` loaded by the tools' own validators, in environments of their own: Axolotl 0.19
pins transformers 5.16 and ArcticTraining 0.8 needs transformers < 5, so neither installs beside seqpar's runtime.
Skipped unless SEQPAR_AXOLOTL_PYTHON / SEQPAR_ARCTIC_PYTHON name such an interpreter, e.g.

    python3 -m venv /tmp/axo && /tmp/axo/bin/pip install torch==2.13.0 && /tmp/axo/bin/pip install --no-deps axolotl==0.19.0 \\
        && /tmp/axo/bin/pip install transformers==5.16.1 accelerate==1.13.0 trl==1.9.0 peft==0.20.0 datasets \\
           pydantic==2.12.5 addict fire PyYAML requests colorama packaging==26.0 einops pillow
    python3 -m venv /tmp/arctic && /tmp/arctic/bin/pip install torch==2.13.0 arctic-training==0.8.0
    SEQPAR_AXOLOTL_PYTHON=/tmp/axo/bin/python SEQPAR_ARCTIC_PYTHON=/tmp/arctic/bin/python pytest tests/emit/test_interop_tools.py
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from typer.testing import CliRunner

from seqpar.cli import app

H100x8 = ["--gpu", "h100", "--gpus", "8"]
PLANS = {  # name -> advise flags; each fits, and each exercises other keys
    "dp-zero3-liger": ["--seq-len", "32k", "--mode", "data_parallel", "--checkpointing", "full", "--sharding", "zero3", "--loss-impl", "chunked", "--fused-ops", "liger"],
    "ulysses-offload-fsdp": ["--seq-len", "256k", "--mode", "ulysses_attn", "--checkpointing", "offload", "--sharding", "fsdp"],
    "ring-selective-zero2": ["--seq-len", "128k", "--mode", "zigzag_ring_attn", "--checkpointing", "selective", "--sharding", "zero2", "--loss-impl", "chunked"],
    "dp-tiled-fsdp": ["--seq-len", "16k", "--mode", "data_parallel", "--checkpointing", "full", "--sharding", "fsdp", "--tiled-mlp", "--fused-ops", "liger"],
    "ring-offload-zero3-offload": ["--seq-len", "256k", "--mode", "zigzag_ring_attn", "--checkpointing", "offload", "--sharding", "zero3_offload"],
}  # fmt: skip

AXOLOTL = """
import json, sys, types, yaml
sys.modules.setdefault("ring_flash_attn", types.ModuleType("ring_flash_attn"))  # it imports flash_attn (CUDA) at import
from axolotl.utils.config import prepare_plugins, validate_config
from axolotl.utils.dict import DictDefault
out = {}
for f in sys.argv[1:]:
    cfg = DictDefault(yaml.safe_load(open(f)))
    prepare_plugins(cfg)  # registers the Liger plugin, whose keys are then validated
    v = validate_config(cfg)
    out[f] = [v.context_parallel_size, str(v.activation_offloading), bool(v.selective_checkpointing), bool(v.tiled_mlp)]
print(json.dumps(out))
"""
ARCTIC = """
import json, os, socket, sys, yaml
from pathlib import Path
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
from arctic_training.config.trainer import get_config
out = {}
for f in sys.argv[1:]:
    d = yaml.safe_load(Path(f).read_text())
    d["model"]["attn_implementation"] = "sdpa"  # flash_attention_2 needs the flash_attn package (CUDA) at validation
    p = Path(f + ".sdpa.yaml"); p.write_text(yaml.safe_dump(d))
    c = get_config(p)
    out[f] = [c.sequence_parallel_size, c.activation_checkpoint_cpu_offload, c.tiled_mlp_compute, c.data.max_length,
              [c.scheduler.type, c.scheduler.name, c.scheduler.warmup_ratio]]
print(json.dumps(out))
"""


def _emit(tmp_path, tool: str, model: str) -> dict[str, list]:
    runner, files = CliRunner(), {}
    for name, flags in PLANS.items():
        r = runner.invoke(
            app, ["advise", *flags, "--model", model, *H100x8, "-o", str(tmp_path / f"{name}.json"), "--emit", tool, "--json"]
        )
        assert r.exit_code == 0, r.output
        strategy = json.loads((tmp_path / f"{name}.json").read_text())["strategy"]
        files[str(tmp_path / f"{name}.{tool}.yaml")] = [strategy, r.stderr]
    return files


def _run(python: str, code: str, files, cwd) -> dict:
    res = subprocess.run([python, "-c", code, *files], capture_output=True, text=True, timeout=1400, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.environ.get("SEQPAR_AXOLOTL_PYTHON"), reason="set SEQPAR_AXOLOTL_PYTHON to an axolotl 0.19 venv")
def test_axolotl_validates_every_emitted_config(tmp_path):
    files = _emit(tmp_path, "axolotl", "llama-3-8b")
    got = _run(os.environ["SEQPAR_AXOLOTL_PYTHON"], AXOLOTL, list(files), tmp_path)
    for f, (cp, offload, selective, tiled) in got.items():
        emitted = yaml_of(f)
        assert cp == emitted.get("context_parallel_size", 1) and tiled == bool(emitted.get("tiled_mlp"))  # axolotl: None -> 1
        assert selective == bool(emitted.get("selective_checkpointing")) and (offload == "hidden_states") == (
            "activation_offloading" in emitted
        )


@pytest.mark.skipif(not os.environ.get("SEQPAR_ARCTIC_PYTHON"), reason="set SEQPAR_ARCTIC_PYTHON to an arctic-training 0.8 venv")
@pytest.mark.timeout(1500)  # get_config starts DeepSpeed for every file (minutes on a loaded CPU)
def test_arctic_validates_every_emitted_config(tmp_path):
    import transformers

    transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256
    ).save_pretrained(tmp_path / "tiny-llama")
    files = _emit(tmp_path, "arctic", str(tmp_path / "tiny-llama"))  # validation reads the model's config.json
    got = _run(os.environ["SEQPAR_ARCTIC_PYTHON"], ARCTIC, list(files), tmp_path)
    for f, (sp, offload, tiled, max_length, sched) in got.items():
        strategy = files[f][0]
        want = yaml_of(f)["scheduler"]  # the plan's schedule, not ArcticTraining's default (linear, warmup_ratio 0.1)
        assert sched == [want["type"], want["name"], want["warmup_ratio"]]
        assert sp == strategy["sp_degree"] or yaml_of(f)["sequence_parallel_size"] == sp
        assert (offload, tiled, max_length) == (
            yaml_of(f)["activation_checkpoint_cpu_offload"],
            yaml_of(f)["tiled_mlp_compute"],
            yaml_of(f)["data"]["max_length"],
        )


def yaml_of(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)
