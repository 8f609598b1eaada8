"""What a LoRA run leaves behind, loaded the way its user loads it, and its resume.

Two runs of the trainer on 2 gloo ranks (data_parallel, so rank 0's model is the whole trained model) train the
adapters of a base model folder for 3 steps and write their final checkpoint with ``--merge-lora``: one over a bf16
base, one over a 4-bit NF4 base (QLoRA). Then, in this process, as a user would:

* ``PeftModel.from_pretrained(base, adapter/)`` over ``AutoModelForCausalLM.from_pretrained(base folder)`` (for QLoRA the
  base loaded 4-bit by transformers' own ``BitsAndBytesConfig``: NF4, double quantization) gives the trained model's
  logits (fp32 round-off: relative 1e-5);
* ``AutoModelForCausalLM.from_pretrained(model/)``, the merged model, gives them too (the merge folds B @ A into each
  weight: a different order of fp32 sums, relative 1e-4);
* the checkpoint's trainer_state.json lists the adapter's files with their digests (the trust layer checks them), and
  no file in it is a pickle.

Resume: a LoRA run under FSDP2 (zigzag, sp 2) cut after its step-2 checkpoint and resumed repeats the uninterrupted
steps 3 and 4 exactly (the same layout: relative 1e-6); its checkpoints hold the adapters alone, the frozen base read
again from --model-path; a resume over another base folder of the same shape is refused in one line. The slow set
resumes a DeepSpeed ZeRO-3 LoRA run the same way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from seqpar.plan.specs import LoraSpec

from seqpar_testing import run_ranks
from seqpar_testing.train import cut_run, make_plan, read_metrics

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="the lora extra (peft) is not installed")
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_DS = importlib.util.find_spec("deepspeed") is not None
STEPS = 3
LORA = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])


def base_folder(folder: Path, seed: int = 0) -> str:
    """The tiny model's shape with seeded random weights, written by save_pretrained (the run's --model-path)."""
    from seqpar.runtime.hf.model import build_model

    model = build_model(make_plan(1).workload.model, model_path=None, seed=seed, rope_theta=None)
    model.save_pretrained(folder)
    return str(folder)


def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(7))  # (B, S)


def _train_and_export(rank: int, tmp: str, name: str, plan, base: str) -> torch.Tensor | None:
    """The trainer's own parts (setup, train_step, the Saver's final checkpoint) so the trained model stays in hand;
    rank 0 returns its logits on ids()."""
    import torch.distributed as dist

    from seqpar.runtime.checkpoint.saver import Saver
    from seqpar.runtime.train.loop import parser, setup, train_step

    plan_file = Path(tmp) / f"{name}.json"
    if rank == 0:
        plan.write(plan_file)
    dist.barrier()
    args = ["--plan", str(plan_file), "--output", str(Path(tmp) / name), "--model-path", base, "--merge-lora"]
    r = setup(parser().parse_args(args))
    for step in range(STEPS):
        train_step(r, step)
    Saver(r, every=0, keep_last=0, final=True, async_mode="off").save(STEPS, r.state(STEPS), final=True)
    dist.barrier()
    if rank != 0:
        return None
    with torch.no_grad():  # train mode (dropout is 0): see _logits
        return r.model(input_ids=ids()).logits.detach().clone()  # (B, S, V)


def _resume_run(plan, tmp: str, name: str, base: str, *extra: str, rank: int) -> str | None:
    """The trainer in-process into tmp/name; the one-line refusal it raised, if any."""
    import torch.distributed as dist

    from seqpar.plan.errors import SeqparError
    from seqpar.runtime.train.loop import parser, run

    pf = Path(tmp) / f"{name}.json"
    if rank == 0:
        plan.write(pf)
    dist.barrier()
    try:
        run(parser().parse_args(["--plan", str(pf), "--output", str(Path(tmp) / name), "--model-path", base, *extra]))
    except SeqparError as e:
        return str(e)
    finally:
        dist.barrier()
    return None


def resume_cases(rank: int, tmp: str, plan, base: str, other_base: str, prefix: str) -> dict:
    """Uninterrupted 4 steps with a checkpoint every 2; the copy cut at step 2 resumed; the same over another base."""
    _resume_run(plan, tmp, f"{prefix}full", base, rank=rank)
    cut_run(tmp, f"{prefix}full", f"{prefix}cut", 2, rank)
    cut_run(tmp, f"{prefix}full", f"{prefix}other", 2, rank)
    assert _resume_run(plan, tmp, f"{prefix}cut", base, "--resume", rank=rank) is None
    refused = _resume_run(plan, tmp, f"{prefix}other", other_base, "--resume", rank=rank)
    if rank != 0:
        return {}
    return {
        "full": read_metrics(Path(tmp) / f"{prefix}full"),
        "resumed": read_metrics(Path(tmp) / f"{prefix}cut"),
        "refused": refused,
    }


def ranks_main(rank: int, world: int, tmp: str, bases: dict, part: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    out = {}
    resume_plan = make_plan(world, "zigzag_ring_attn", world, mbs=world, sharding="fsdp", steps=4, checkpoint_every=2, lora=LORA)
    if part == "sample":
        out["bf16"] = _train_and_export(rank, tmp, "bf16", make_plan(world, steps=STEPS, lora=LORA), bases["base"])
        if HAS_BNB:
            nf4 = LORA.model_copy(update={"base_dtype": "nf4"})
            out["nf4"] = _train_and_export(rank, tmp, "nf4", make_plan(world, steps=STEPS, lora=nf4), bases["base"])
        out["resume"] = resume_cases(rank, tmp, resume_plan, bases["base"], bases["other"], "fsdp_")
    elif HAS_DS:
        ds_plan = resume_plan.model_copy(
            update={"strategy": resume_plan.strategy.model_copy(update={"sharding": "zero3", "mode": "ulysses_attn"})}
        )
        out["resume"] = resume_cases(rank, tmp, ds_plan, bases["base"], bases["other"], "zero3_")
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("lora-bases")
    return {"base": base_folder(tmp / "base"), "other": base_folder(tmp / "other", seed=1)}


def _load_base(folder: str, nf4: bool):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if not nf4:
        return AutoModelForCausalLM.from_pretrained(folder)
    q = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
    )
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, device_map="cpu")


def _check_export(tmp: Path, name: str, trained: torch.Tensor, base: str, nf4: bool) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from seqpar.runtime.checkpoint.resume import latest, read_state

    final = latest(tmp / name / "checkpoints")
    assert final is not None and final.name == f"step-{STEPS:06d}"
    adapter, merged = final / "adapter", final / "model"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    files = read_state(final)["files"]  # signed, every file with its size and digest
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "model/config.json"} <= set(files)
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))] or all(
        f.startswith("deepspeed/") for f in files if f.endswith(".pt")
    )
    via_peft = _logits(PeftModel.from_pretrained(_load_base(base, nf4), str(adapter)))
    via_merged = _logits(AutoModelForCausalLM.from_pretrained(str(merged)))
    scale = float(trained.abs().max())
    torch.testing.assert_close(via_peft, trained, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(via_merged, trained, rtol=1e-4, atol=1e-4 * scale)
    assert not torch.allclose(via_peft, _logits(_load_base(base, nf4)), atol=1e-3 * scale)  # the adapters changed it


def _logits(model) -> torch.Tensor:
    """Logits on ids() in train mode (no dropout anywhere here, so the same function as eval): in eval mode on a CPU
    with AVX512-BF16, bitsandbytes repacks a 4-bit weight for its bf16 inference kernel, another computation than
    training's dequantize-and-multiply in the compute dtype."""
    with torch.no_grad():
        return model.train()(input_ids=ids()).logits


def _check_resume(res: dict) -> None:
    full, resumed = res["full"], res["resumed"]  # the cut copy's metrics: steps 1-2 as written, then the resumed 3-4
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] == [r["step"] for r in full]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in resumed[2:]], [r[key] for r in full[2:]], rtol=1e-6, err_msg=key)
    assert res["refused"] is not None and "holds LoRA adapters trained on another base model" in res["refused"]
    assert "resume with the --model-path (or --init-from) that wrote it" in res["refused"], res["refused"]


@pytest.mark.timeout(300)
def test_lora_exports_adapter_and_merged_model_that_load_as_they_are_and_resumes(tmp_path, bases):
    res = run_ranks(ranks_main, 2, str(tmp_path), bases, "sample", timeout=280)[0]
    _check_export(tmp_path, "bf16", res["bf16"], bases["base"], nf4=False)
    if HAS_BNB:
        _check_export(tmp_path, "nf4", res["nf4"], bases["base"], nf4=True)
    _check_resume(res["resume"])
    state = tmp_path / "fsdp_full" / "checkpoints" / "step-000002" / "state"
    from safetensors import safe_open

    for shard in state.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            assert all("lora_" in k for k in f.keys()), list(f.keys())[:3]  # the adapters alone (and their moments)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DS, reason="the deepspeed extra is not installed")
@pytest.mark.timeout(300)
def test_lora_resumes_under_deepspeed_zero3(tmp_path, bases):
    _check_resume(run_ranks(ranks_main, 2, str(tmp_path), bases, "rest", timeout=280)[0]["resume"])


@pytest.mark.skipif(not HAS_BNB, reason="the qlora extra (bitsandbytes) is not installed")
@pytest.mark.parametrize(
    "device, shard_size",
    [
        ("cpu", None),
        ("cpu", 20_000),
        pytest.param("cuda", 20_000, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
    ],
)
def test_a_4bit_merge_streams_shards_equal_to_peft_merge_and_unload(tmp_path, monkeypatch, device, shard_size):
    """--merge-lora of a 4-bit run writes the merged model shard by shard from the live model (a 70B merged in bf16
    outgrows a 125 GiB host when made whole): its tensors equal, bit for bit, what peft's merge_and_unload makes of the
    same weights dequantized (the whole-model path every other base takes; on a GPU the merge's fp32 matmul runs there,
    the whole path's on the host: within one bf16 step); split into many shards it has save_pretrained's index, no
    shard over the size, and loads with AutoModelForCausalLM as it is."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from seqpar.runtime.checkpoint import adapter as export
    from seqpar.runtime.checkpoint.shards import save_model
    from seqpar.runtime.hf.lora import apply_lora
    from seqpar.runtime.hf.model import build_model

    from seqpar_testing.hf import plain_state

    model = build_model(make_plan(1).workload.model, model_path=None, seed=0, rope_theta=None).to(device)
    peft_model = apply_lora(model, LORA.model_copy(update={"base_dtype": "nf4"}), seed=0, device=device)
    assert {p.device.type for p in model.parameters()} == {device}
    torch.manual_seed(5)  # trained-looking adapters: B away from peft's zeros
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    if shard_size:
        monkeypatch.setattr(export, "MERGED_SHARD_SIZE", shard_size)
    out = tmp_path / "model"
    # two DDP ranks' shares into one folder (each holds the whole model): rank 1 writes every other shard and nothing
    # else (with one shard, nothing); rank 0 the rest, the index and the config
    export.save_merged_4bit(out, model, peft_model.active_adapter, torch.bfloat16, rank=1, world=2)
    by_rank1 = sorted(f.name for f in out.iterdir())
    export.save_merged_4bit(out, model, peft_model.active_adapter, torch.bfloat16, rank=0, world=2)

    adapters = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if "lora_" in n}
    whole = export.merged_model(model.config, peft_model.peft_config["default"], {**plain_state(model), **adapters})
    want = {
        k: v.to(torch.bfloat16)
        for k, v in whole.state_dict().items()
        if k != "lm_head.weight" or not whole.config.tie_word_embeddings
    }
    shards = sorted(out.glob("*.safetensors"))
    got = {k: v for f in shards for k, v in load_file(f).items()}
    assert got.keys() == want.keys()
    for k, v in want.items():
        if device == "cpu":
            assert torch.equal(got[k], v), k
        else:
            torch.testing.assert_close(got[k], v, rtol=2**-7, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    save_model(tmp_path / "whole", whole, dict(want), torch.bfloat16)  # the whole-model path's config (it empties the dict)
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "whole" / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    if shard_size:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(shards) > 3 and set(index["weight_map"]) == set(want)
        assert by_rank1 == [f.name for f in shards][1::2]
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
        assert all(f.stat().st_size <= shard_size + 10_000 or len(load_file(f)) == 1 for f in shards)  # + header
    else:
        assert [f.name for f in shards] == ["model.safetensors"] and by_rank1 == []
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.dtype == torch.bfloat16
    for k, v in loaded.state_dict().items():
        if k in want:
            assert torch.equal(v, got[k]), k
