"""A 4-bit (QLoRA) base built layer by layer (seqpar.runtime.hf.quantized_build) against the path it replaces: the whole
model built in the plan's dtype, then quantized (seqpar.runtime.hf.lora.quantize_base).

From a save_pretrained folder sharded into several safetensors files (and from an ``--init-from`` checkpoint), the
layer-by-layer build holds bit for bit the same NF4 bytes and quantization statistics as the reference path, and the
model with the runtime's adapters gives the same loss and adapter gradients, bit for bit. Random weights: the same seed
gives the same bits, another seed other bits, each layer its own draw, with transformers' init statistics (normal with
config.initializer_range for linear layers and embeddings, ones for norms; transformers 5.25,
modeling_utils.py PreTrainedModel._init_weights). A folder that does not fit is one line. Host memory, in a fresh
process: the layer-by-layer build's peak stays near the 4-bit model plus one layer, far under the model's bf16 size,
which the reference path's peak reaches. And ``seqpar launch`` trains a 4-bit plan from a folder on 2 CPU ranks.
bitsandbytes' CPU backend quantizes here (bitsandbytes 0.50); every test is skipped where it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqpar.plan.errors import SeqparError
from seqpar.plan.specs import LoraSpec
from seqpar.runtime.hf.model import build_model

from seqpar_testing.hf import batch
from seqpar_testing.hostile import one_line
from seqpar_testing.train import learnable_tokens, make_plan, read_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None or importlib.util.find_spec("peft") is None,
    reason="the qlora extra (bitsandbytes, peft) is not installed",
)
SPEC = make_plan(1).workload.model  # the tiny Llama of the trainer's tests: 2 layers, hidden 64
LORA = LoraSpec(rank=4, alpha=8, dropout=0.0, base_dtype="nf4")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny model (fp32, seed 1) written by save_pretrained in several shards with their index."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    build_model(SPEC, model_path=None, seed=1, rope_theta=None).save_pretrained(out, max_shard_size="40KB")
    assert len(list(out.glob("model-*.safetensors"))) >= 4 and (out / "model.safetensors.index.json").is_file()
    return out


def _streamed(dtype, **kw):
    return build_model(SPEC, seed=1, rope_theta=None, dtype=dtype, quantize_4bit=True, compute_dtype=dtype, **kw)


def _whole_then_quantized(dtype, **kw):
    from seqpar.runtime.hf.lora import quantize_base

    model = build_model(SPEC, seed=1, rope_theta=None, dtype=dtype, **kw)
    assert quantize_base(model, compute_dtype=dtype) == 7 * SPEC.num_layers
    return model


def _bits(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model: its state dict (the NF4 bytes, bitsandbytes' packed statistics) and each 4-bit
    weight's quantization state unpacked (absmax, code, nested absmax and offset)."""
    out = dict(model.state_dict())
    for name, module in model.named_modules():
        if type(module).__name__ == "Linear4bit":
            for k, v in module.weight.quant_state.as_dict(packed=False).items():
                out[f"{name}.quant_state.{k}"] = v if torch.is_tensor(v) else torch.tensor(hash(str(v)))
    return out


def _assert_same_bits(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, different[:5]


def _loss_and_adapter_grads(model, dtype):
    """The runtime's adapters (seed 0; lora_B drawn so every lora_A gradient is non-zero), one forward and backward."""
    from seqpar.runtime.hf.lora import apply_lora

    apply_lora(model, LORA, seed=0, compute_dtype=dtype)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.train()
    ids, labels = batch()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_sharded_folder_built_layer_by_layer_is_bitwise_the_whole_model_quantized(folder, dtype):
    streamed = _streamed(dtype, model_path=str(folder), match_plan=True)
    whole = _whole_then_quantized(dtype, model_path=str(folder))
    q = streamed.model.layers[1].mlp.down_proj
    assert type(q).__name__ == "Linear4bit" and q.weight.dtype == torch.uint8  # 4-bit as built, before any adapter
    assert streamed.model.embed_tokens.weight.dtype == dtype and streamed.lm_head.weight.dtype == dtype
    _assert_same_bits(_bits(streamed), _bits(whole))
    assert torch.equal(streamed.model.rotary_emb.inv_freq, whole.model.rotary_emb.inv_freq)  # no file holds it
    loss, grads = _loss_and_adapter_grads(streamed, dtype)
    ref_loss, ref_grads = _loss_and_adapter_grads(whole, dtype)  # apply_lora quantizes nothing more in the first
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert sorted(grads) == sorted(ref_grads) and len(grads) == 2 * 7 * SPEC.num_layers
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_an_init_from_checkpoint_built_layer_by_layer_is_bitwise_the_whole_model_quantized(folder, tmp_path):
    """--init-from over random weights: every tensor from the checkpoint, as load_weights fills the whole model."""
    build_model(SPEC, model_path=None, seed=7, rope_theta=None).save_pretrained(tmp_path / "ckpt")
    kw = dict(model_path=None, init_from=str(tmp_path / "ckpt"))
    _assert_same_bits(_bits(_streamed(torch.bfloat16, **kw)), _bits(_whole_then_quantized(torch.bfloat16, **kw)))
    kw["model_path"] = str(folder)  # and over a model folder: the checkpoint's values, not the folder's
    _assert_same_bits(_bits(_streamed(torch.bfloat16, **kw)), _bits(_whole_then_quantized(torch.bfloat16, **kw)))


def test_random_weights_are_seeded_per_layer_with_transformers_init():
    spec = SPEC.model_copy(update={"hidden_size": 256, "intermediate_size": 512, "tie_word_embeddings": True})
    build = lambda seed: build_model(spec, model_path=None, seed=seed, rope_theta=None, quantize_4bit=True)  # noqa: E731
    a, b, other = build(3), build(3), build(4)
    _assert_same_bits(_bits(a), _bits(b))
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, other.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(a.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, a.model.layers[1].mlp.up_proj.weight)  # own draws
    assert torch.get_rng_state().equal(torch.manual_seed(4).get_state())  # left as the build seeded it

    from seqpar.runtime.checkpoint.adapter import dequantized
    from seqpar.runtime.hf.model import config_from_spec

    std = config_from_spec(spec).initializer_range
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied again, never allocated alone
    torch.testing.assert_close(a.model.embed_tokens.weight.std().item(), std, rtol=0.02, atol=0)
    for name, module in a.named_modules():
        if type(module).__name__ == "Linear4bit":  # NF4 rounds each value to 16 levels: the spread moves a few %
            torch.testing.assert_close(dequantized(module).std().item(), std, rtol=0.06, atol=0, msg=name)
        elif "RMSNorm" in type(module).__name__:
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
    plain = build_model(spec, model_path=None, seed=3, rope_theta=None)  # transformers' RoPE buffer, as from_config
    assert torch.equal(a.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)


def test_a_folder_that_does_not_fit_is_one_line(folder, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    shard = next(f for f in sorted(bad.glob("model-*.safetensors")) if "model.layers.1.mlp.up_proj.weight" in load_file(f))
    state = load_file(shard)
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:-1]
    save_file(state, shard, {"format": "pt"})
    with pytest.raises(SeqparError) as e:
        _streamed(torch.float32, model_path=str(bad))
    line = one_line(e)
    assert "model.layers.1.mlp.up_proj.weight has shape [127, 64], the model's has [128, 64]" in line, line
    assert line.startswith(f"--model-path '{bad}' does not fit the model") and "save_pretrained" in line, line

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = build_model(SPEC, model_path=None, seed=1, rope_theta=None).state_dict()
    save_file({**state, "extra.weight": torch.zeros(2)}, ckpt / "model.safetensors", {"format": "pt"})
    with pytest.raises(SeqparError) as e:
        _streamed(torch.float32, model_path=None, init_from=str(ckpt))
    line = one_line(e)
    assert line.startswith(
        f"checkpoint '{ckpt}' does not fit the model: it holds 1 tensors the model does not have (e.g. extra.weight)"
    ), line
    assert line.endswith("resume with the plan that wrote it"), line


MEMORY = r"""
import json, sys, torch
from seqpar.runtime.hf.lora import quantize_base
from seqpar.runtime.hf.model import build_model
from seqpar_testing.train import make_plan

streamed = sys.argv[1] == "streamed"
spec = make_plan(1).workload.model.model_copy(update=dict(
    num_layers=24, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, vocab_size=1024))

def peak():
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM"))

quantize_base(build_model(spec.model_copy(update=dict(num_layers=1, hidden_size=64, intermediate_size=128,
    head_dim=4)), model_path=None, seed=0, rope_theta=None))  # the lazy imports (Llama's modeling, bitsandbytes' ops)
open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
before = peak()
model = build_model(spec, model_path=None, seed=0, rope_theta=None, dtype=torch.bfloat16, quantize_4bit=streamed)
grown = peak() - before
kept = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
kept += sum(v.nbytes for m in model.modules() if type(m).__name__ == "Linear4bit"
            for v in m.weight.quant_state.as_dict(packed=True).values() if torch.is_tensor(v))
meta = build_model(spec, model_path=None, seed=0, rope_theta=None, dtype=torch.bfloat16, meta=True)
layer = sum(p.nbytes for p in meta.model.layers[0].parameters())
linear = max(p.numel() for p in meta.model.layers[0].parameters())
bf16 = sum(p.nbytes for p in meta.parameters())
print(json.dumps(dict(grown=grown, kept=kept, layer=layer, linear=linear, bf16=bf16)))
"""


def test_the_layer_by_layer_build_never_holds_the_bf16_model_in_host_memory():
    """Peak RSS growth of one build in a fresh process (Linux: VmHWM, reset through /proc/self/clear_refs): 24 layers of
    hidden 512 in bf16 (about 180 MB). The layer-by-layer build stays within what it keeps (the 4-bit layers, the bf16
    embeddings and head) plus one bf16 layer plus bitsandbytes' CPU quantization temporaries of one linear layer (its
    default kernel: an fp32 copy, the scaled copy, int32 codes, uint8 codes, about 14 bytes a value; bitsandbytes 0.50,
    backends/default/ops.py), far below the bf16 model; the whole-model path holds at least the bf16 model (its peak
    comes as it is built, before quantize_base runs, so it stops there). glibc is told to return every block over
    64 KiB to the system when freed (MALLOC_MMAP_THRESHOLD_): the peak is then what the build holds, not what glibc's
    heap keeps of freed temporaries."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs")
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=f"{root}{os.pathsep}{root / 'tests'}")
    procs = {
        kind: subprocess.Popen([sys.executable, "-c", MEMORY, kind], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for kind in ("streamed", "whole")
    }
    got = {}
    for kind, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
        got[kind] = json.loads(out.decode().strip().splitlines()[-1])
    s, w = got["streamed"], got["whole"]
    assert s["kept"] < 0.3 * s["bf16"]  # the steady state: NF4 layers (4.1 bits a value with statistics)
    assert s["grown"] < s["kept"] + s["layer"] + 16 * s["linear"] + (16 << 20), s
    assert s["grown"] < 0.5 * s["bf16"], s
    assert w["grown"] >= s["bf16"], w


@pytest.mark.timeout(300)
def test_seqpar_launch_trains_a_4bit_plan_from_a_sharded_folder_on_2_ranks(folder, tmp_path):
    """The CLI path end to end: torchrun, 2 gloo CPU ranks, each building its own 4-bit base from the folder; the
    adapters learn and are exported."""
    plan = make_plan(2, steps=8, lora=LORA)
    plan.write(tmp_path / "plan.json")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "seqpar.cli", "launch", str(tmp_path / "plan.json"), "--model-path", str(folder)]
    cmd += ["--data", learnable_tokens(tmp_path / "tokens.npy"), "--output", str(out), "--force"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.05, metrics
    log = (out / "train.log").read_text()
    assert "adapter parameters train, the base is frozen" in log
    assert (out / "checkpoints" / "step-000008" / "adapter" / "adapter_model.safetensors").is_file()
