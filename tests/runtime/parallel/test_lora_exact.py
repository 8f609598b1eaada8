"""LoRA and QLoRA (the plan's workload.lora, seqpar.runtime.hf.lora) in every mode on real gloo ranks, against one
process over the whole sequence.

A tiny random-weight Llama gets peft's adapters (rank 4 on all seven linear layers, dropout 0) through the runtime's own
``apply_lora``; lora_B is drawn at random too (peft starts it at zero, which would make every lora_A gradient zero and the
check empty). Every mode (usp_attn with U = 2) runs it on 2 ranks through seqpar.apply, prepare_inputs and seqpar.loss:
the loss and every adapter gradient (summed over the ranks) equal the same model in plain transformers on one process,
with the tolerances of the full fine-tuning tests (seqpar_testing.hf.compare_loss_and_grads: fp32 round-off, 1e-5
relative), and every base parameter has no gradient at all. The same for packed documents (each document alone is the
reference), for each memory feature (full, offloaded and selective checkpointing, kept matmul outputs, tiled MLPs, the
chunked loss through the trainer's LossModule), and for a 4-bit NF4 base (QLoRA): bitsandbytes' CPU backend quantizes
and dequantizes here, so the 4-bit model runs in every mode too, and its loss and adapter gradients equal, bit for bit,
a plain model holding the dequantized weights (the 4-bit path is exact up to the quantization itself).

The default set runs Llama on 2 ranks (one spawn); the slow set adds the other families on 2 ranks and every mode at
sp 4 (usp_attn as ulysses 2 x ring 2, the layout 2 ranks cannot have). The engines (DDP, FSDP2, DeepSpeed ZeRO-2/3) and
the hybrid sp x dp groups are tests/runtime/train/test_lora_train.py's.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch

from seqpar.plan.modes import names

from seqpar_testing import run_ranks
from seqpar_testing.hf import (
    LENGTHS,
    batch,
    compare_loss_and_grads,
    families,
    make_model,
    packed_batch,
    per_document_reference,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="the lora extra (peft) is not installed")
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
ROWS = (LENGTHS, LENGTHS)
FEATURES = ("full", "offload", "selective", "kept_matmuls", "tiled", "chunked")


def lora_model(family: str = "llama", base_dtype: str = "bf16"):
    """make_model's tiny LM with the runtime's adapters; lora_B drawn (seeded) so every adapter gradient is non-zero."""
    from seqpar.plan.specs import LoraSpec
    from seqpar.runtime.hf.lora import apply_lora

    model = make_model(family)
    apply_lora(model, LoraSpec(rank=4, alpha=8, dropout=0.0, base_dtype=base_dtype), seed=0, compute_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.train()
    return model


def adapter_grads(model, reduce: bool) -> dict:
    """Every adapter's gradient (summed over the group when ``reduce``); AssertionError if a base parameter has one."""
    import torch.distributed as dist

    based = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not based, f"frozen base parameters got gradients: {based[:3]}"
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 7 * model.config.num_hidden_layers, sorted(grads)[:4]
    if reduce:
        for g in grads.values():
            dist.all_reduce(g)
    return grads


def reference(base, packed: bool):
    """(loss, adapter gradients) of plain transformers on one process over the whole sequence (or each document)."""
    model = copy.deepcopy(base)
    if packed:
        ids, labels, _ = packed_batch(ROWS)
        loss, _ = per_document_reference(model, ids, labels, ROWS)
    else:
        ids, labels = batch()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        loss = loss.detach()
    return loss, adapter_grads(model, reduce=False)


def _run_case(rank, world, base, mode, feature, packed, ulysses=None):
    """Loss and summed adapter gradients of one case on this rank's shard."""
    import seqpar
    from seqpar.runtime.memory.tiled_mlp import tile_mlp
    from seqpar.runtime.train.engine import LossModule

    model = copy.deepcopy(base)
    ckpt = {"full": "full", "offload": "offload", "selective": "selective"}.get(feature)
    kw = dict(checkpoint_layers=1, kept_saves="matmuls") if feature == "kept_matmuls" else {}
    seqpar.apply(model, mode, ulysses_degree=ulysses, checkpointing="selective" if kw else ckpt, **kw)
    if feature == "tiled":
        tile_mlp(model, tile=5)  # 16 local tokens: 4 tiles, the last one short
    if packed:
        ids, labels, pos = packed_batch(ROWS)
        part = seqpar.prepare_inputs(ids, mode, rank, world, labels=labels, position_ids=pos, ulysses_degree=ulysses)
    else:
        ids, labels = batch()
        part = seqpar.prepare_inputs(ids, mode, rank, world, labels=labels, ulysses_degree=ulysses)
    head = LossModule(model, "chunked" if feature == "chunked" else "hf", None, chunk_size=7)
    loss = head(part["input_ids"], part["position_ids"], part["labels"], part.get("cu_seqlens"))
    loss.backward()
    return loss.detach(), adapter_grads(model, reduce=True)


def _error(loss, ref_loss, grads, ref_grads) -> dict:
    """The largest relative differences seen (for the report): loss, and gradient relative to each tensor's scale."""
    g = max(float((grads[n] - r).abs().max() / r.abs().max()) for n, r in ref_grads.items())
    return {"loss": float((loss - ref_loss).abs() / ref_loss.abs()), "grad": g}


def ranks_main(rank: int, world: int, cases: list[tuple]) -> dict:
    """``cases``: (family, base_dtype, mode, feature, packed, ulysses). Returns the failures and the measured errors."""
    warnings.filterwarnings("ignore")
    failures, errors, bases, refs = [], {}, {}, {}
    for family, base_dtype, mode, feature, packed, ulysses in cases:
        key = (family, base_dtype)
        if key not in bases:
            bases[key] = lora_model(family, base_dtype)
        if (key, packed) not in refs:
            refs[key, packed] = reference(bases[key], packed)
        name = f"W={world} {family}/{base_dtype}/{mode}{'-U' + str(ulysses) if ulysses else ''}/{feature}{'/packed' if packed else ''}"
        loss, grads = _run_case(rank, world, bases[key], mode, feature, packed, ulysses)
        compare_loss_and_grads(failures, name, loss, refs[key, packed][0], grads, refs[key, packed][1])
        errors[name] = _error(loss, *refs[key, packed][:1], grads, refs[key, packed][1])
    if HAS_BNB and any(c[1] == "nf4" for c in cases):
        failures += _nf4_is_its_dequantized_model()
    return {"failures": failures, "errors": errors}


def _nf4_is_its_dequantized_model() -> list[str]:
    """The 4-bit model's loss and adapter gradients against a plain model holding its dequantized weights: equal."""
    from seqpar_testing.hf import plain_state

    quantized = lora_model("llama", "nf4")
    plain = lora_model("llama", "bf16")  # the same adapters (same seed and draws), full-precision linear layers
    missing, unexpected = plain.load_state_dict(plain_state(quantized), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    out = []
    ids, labels = batch()
    got = [m(input_ids=ids, labels=labels).loss for m in (quantized, plain)]
    for m, loss in zip((quantized, plain), got):
        loss.backward()
    if not torch.equal(got[0], got[1]):
        out.append(f"nf4 loss {got[0].item()!r} != its dequantized model's {got[1].item()!r}")
    a, b = adapter_grads(quantized, reduce=False), adapter_grads(plain, reduce=False)
    out += [f"nf4 grad {n} differs from its dequantized model's" for n in a if not torch.equal(a[n], b[n])]
    # and the weights really are 4-bit: bitsandbytes' Linear4bit holding packed NF4 bytes, not the fp32 originals
    q = quantized.model.layers[0].self_attn.q_proj.base_layer
    if type(q).__name__ != "Linear4bit" or q.weight.dtype != torch.uint8:
        out.append(f"nf4 base is {type(q).__name__} {q.weight.dtype}, not bitsandbytes' Linear4bit")
    return out


def two_rank_cases(part: str) -> list[tuple]:
    """The default set: Llama in every mode, whole sequences and packed documents, each memory feature (zigzag and usp,
    whose layouts differ most), and a 4-bit base in every mode. The slow set: the other families in every mode."""
    uly = {m: 2 if m == "usp_attn" else None for m in names()}
    if part == "rest":
        return [(f, "bf16", m, "plain", p, uly[m]) for f in families() if f != "llama" for m in names() for p in (False, True)]
    cases = [("llama", "bf16", m, "plain", p, uly[m]) for m in names() for p in (False, True)]
    cases += [("llama", "bf16", m, f, f == "selective", uly[m]) for m in ("zigzag_ring_attn", "usp_attn") for f in FEATURES]
    if HAS_BNB:
        cases += [("llama", "nf4", m, "plain", m != "data_parallel", uly[m]) for m in names()]
        cases.append(("llama", "nf4", "zigzag_ring_attn", "offload", False, None))
    return cases


def _check(results: list[dict], n: int) -> dict:
    for r, res in enumerate(results):
        assert res["failures"] == [], f"rank {r}:\n" + "\n".join(res["failures"][:20])
    assert len(results[0]["errors"]) == n
    return results[0]["errors"]


@pytest.mark.parametrize("part", ["sample", pytest.param("rest", marks=pytest.mark.slow)])
def test_lora_loss_and_every_adapter_gradient_match_one_process_in_every_mode_on_2_ranks(part):
    cases = two_rank_cases(part)
    errors = _check(run_ranks(ranks_main, 2, cases, timeout=240), len(cases))
    assert {c[2] for c in cases} == set(names())  # every registered mode ran
    worst = max(e["grad"] for e in errors.values())
    assert worst < 1e-5, worst


@pytest.mark.slow
def test_lora_matches_one_process_on_the_4_rank_layouts():
    """usp_attn ulysses 2 x ring 2, every mode at sp 4, packed documents among them."""
    cases = [("llama", "bf16", m, "plain", p, 2 if m == "usp_attn" else None) for m in names() for p in (False, True)]
    if HAS_BNB:
        cases.append(("llama", "nf4", "usp_attn", "plain", True, 2))
    _check(run_ranks(ranks_main, 4, cases, timeout=300), len(cases))


def test_adapters_take_the_parameters_dtype_where_the_plan_keeps_no_fp32_states():
    """optimizer adamw-bf16 or none on a GPU runs without autocast: peft's fp32 adapters would each cast and save an fp32
    copy of their input, which the cost model does not count for those plans; the runtime casts them (adapter_dtype),
    and the adapters' output then stays in the base's dtype through a forward and backward."""
    pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    from seqpar.plan.specs import LoraSpec
    from seqpar.runtime.hf.lora import apply_lora

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    wrapped = apply_lora(model, LoraSpec(rank=4), seed=0, adapter_dtype=torch.bfloat16)
    trained = [p for p in wrapped.parameters() if p.requires_grad]
    assert trained and {p.dtype for p in trained} == {torch.bfloat16}
    assert all(p.dtype == torch.bfloat16 for p in wrapped.parameters())
    ids = torch.randint(0, 64, (1, 8))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in trained)
    default = apply_lora(LlamaForCausalLM(cfg).to(torch.bfloat16), LoraSpec(rank=4), seed=0)
    assert {p.dtype for p in default.parameters() if p.requires_grad} == {torch.float32}  # peft's own default
