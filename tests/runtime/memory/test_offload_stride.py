"""offload_stride (seqpar.apply's and the plan's): under checkpointing offload only one offloaded layer input in k waits
in host memory, backward rebuilds the others (seqpar.runtime.memory.strided_offload.StridedOffload), on real transformers Llamas.

- Exact, float64 on one process: the loss and every parameter gradient with stride 2, 3 and 6 (and offload_layers 5,
  where the last group is cut, and checkpoint_layers below the layers) equal the un-checkpointed model's to float64
  round-off; so do two accumulated micro-batches, two forwards whose graphs are alive together, and a second step
  after an optimizer update and a no-grad forward. Under LoRA with adapter dropout, the same seed gives stride 1's
  (and the un-checkpointed model's) loss and gradients: the rebuilt layers draw the original forward's masks.
- What it saves: the derived layers' inputs are freed when the forward ends (weak references), the heads' kept (on CPU
  HostOffload keeps a CPU tensor as it is; the derived layers' recipe drops it on any device); exactly ceil(H/k) inputs
  go through the host copy; backward runs exactly H - ceil(H/k) more layer forwards than stride 1 (each derived layer's
  group below it once more), and holds at most k - 1 rebuilt inputs at once.
- Over two gloo ranks in zigzag_ring_attn (seqpar.apply), stride 2 and 3 equal stride 1 bit for bit; the trainer on two
  ranks (FSDP2 or DeepSpeed ZeRO-3, Ulysses, two accumulated micro-batches) trains to stride 1's losses and gradient
  norms, rebuilds every derived input (none falls back to the host) and logs the stride.
- Refusals: a stride without checkpointing offload, or above the offloaded layers, is one SeqparError line.
- On a CUDA GPU (skipped without one): bf16, and fp32 under autocast with LoRA dropout; no layer input stays on the
  device, the pinned host copies divide by k, and the loss and gradients equal stride 1's bit for bit.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import json
import math
import warnings
import weakref

import pytest
import torch

from seqpar_testing import run_ranks, tolerances
from seqpar_testing.hf import param_grads
from seqpar_testing.memory import make_model as tiny_llama
from seqpar_testing.train import compare_runs, learnable_tokens, make_plan

L6, B, S = 6, 2, 32
HAS_PEFT = importlib.util.find_spec("peft") is not None


def make_model(layers: int = L6, dtype=torch.float64):
    """A tiny seeded random-weight Llama with ``layers`` decoder layers (enough for groups of 2 and 3 with a cut one)."""
    return tiny_llama(layers, dtype)


def batch(seed: int = 1):
    """(input_ids, labels) of shape (B, S), a prompt masked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (B, S), generator=g)  # (B, S)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def apply(model, **split):
    import seqpar

    warnings.filterwarnings("ignore")
    return seqpar.apply(model, "data_parallel", **split)


def assert_same(case: str, loss, grads: dict, ref_loss, ref_grads: dict) -> None:
    tol = tolerances(torch.float64)
    torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"{case} loss: {m}")
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, **tol, msg=lambda m, n=name: f"{case} grad {n}: {m}")


def step(model, batches, together: bool = False):
    """Forward and backward over the micro-batches (accumulated: each backward in turn, or ``together``: every forward
    first, one backward of the sum); returns (the summed loss, every parameter's gradient)."""
    model.zero_grad(set_to_none=True)
    losses = []
    for ids, labels in batches:
        losses.append(model(input_ids=ids, labels=labels).loss)
        if not together:
            losses[-1].backward()
    if together:
        sum(losses).backward()
    return sum(x.detach() for x in losses), param_grads(model)


def _expected_layout(model, stride: int, host: int) -> None:
    from seqpar.runtime.memory.strided_offload import StridedOffload

    for i, layer in enumerate(model.model.layers):
        func = layer._gradient_checkpointing_func
        assert isinstance(func, StridedOffload) == (i < host), (stride, host, i, func)
        if i < host:
            assert func.head == (i % stride == 0) and func.chain is model.model.layers[0]._gradient_checkpointing_func.chain


# (offload_stride, offload_layers, checkpoint_layers): groups of 2 and 3, one group of all six, a group cut by
# offload_layers, GPU-checkpointed and kept layers above the offloaded ones
CASES = [(2, None, None), (3, None, None), (6, None, None), (2, 5, None), (3, 5, None), (2, 3, 5), (3, 4, 4)]


@pytest.mark.parametrize("stride,off,ck", CASES, ids=[f"k{k}-off{o}-ck{c}" for k, o, c in CASES])
def test_stride_is_exact_against_the_unchecked_model(stride, off, ck):
    from seqpar.plan.options import layer_split

    base = make_model()
    ref = step(copy.deepcopy(base), [batch()])
    model = apply(copy.deepcopy(base), checkpointing="offload", offload_layers=off, checkpoint_layers=ck, offload_stride=stride)
    _expected_layout(model, stride, layer_split("offload", L6, ck, off, offload_stride=stride).host)
    assert_same(f"stride {stride}", *step(model, [batch()]), *ref)


def test_micro_batches_steps_and_no_grad_forwards_stay_exact():
    """Two accumulated micro-batches; two forwards alive together (their records must not mix); an AdamW step, a
    no-grad forward (records nothing) and a second step: each equals the un-checkpointed model's."""
    from seqpar.runtime.memory.strided_offload import StridedOffload

    base = make_model()
    plain = copy.deepcopy(base)
    strided = apply(copy.deepcopy(base), checkpointing="offload", offload_stride=2)
    mbs = [batch(1), batch(2)]
    assert_same("accumulated", *step(strided, mbs), *step(plain, mbs))
    assert_same("together", *step(strided, mbs, together=True), *step(plain, mbs, together=True))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, strided)]
    for opt in opts:
        opt.step()
    before = dict(StridedOffload.stats)
    with torch.no_grad():
        torch.testing.assert_close(strided(input_ids=mbs[0][0]).logits, plain(input_ids=mbs[0][0]).logits, rtol=0, atol=0)
    assert dict(StridedOffload.stats) == before
    assert_same("second step", *step(strided, [batch(3)]), *step(plain, [batch(3)]))


@pytest.mark.parametrize("edit", ["new tensor", "in place"])
def test_an_input_that_is_not_the_layer_befores_output_goes_to_the_host(edit):
    """Layer 1's output changed after its checkpoint returns (a new tensor, or the same one changed in place), before
    layer 2 takes it: layer 2's input is not what rebuilding it from layer 1 would give, so it is offloaded as a head's
    is (a fallback), and the loss and gradients still equal the un-checkpointed model's with the same change. (The
    change wraps the checkpoint function: a forward hook runs inside the checkpoint where transformers checkpoints the
    layer's __call__, and is run again with it.)"""
    from seqpar.runtime.memory.strided_offload import StridedOffload

    def change(out):
        return out.mul_(1.5) if edit == "in place" else out * 1.5  # in place: the output's version counter moves

    base = make_model()
    plain = copy.deepcopy(base)
    plain.model.layers[1].register_forward_hook(lambda m, a, out: change(out))
    strided = apply(copy.deepcopy(base), checkpointing="offload", offload_stride=3)
    layer = strided.model.layers[1]
    func = layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = lambda function, *args, **kw: change(func(function, *args, **kw))
    StridedOffload.stats.clear()
    assert_same(edit, *step(strided, [batch()]), *step(plain, [batch()]))
    # layers 0 and 3 are heads; 2 falls back; 1, 4 and 5 are rebuilt
    assert dict(StridedOffload.stats) == {"host": 3, "fallback": 1, "recomputed": 3, "forwards": 3}


@pytest.mark.skipif(not HAS_PEFT, reason="the lora extra (peft) is not installed")
def test_lora_dropout_draws_the_original_masks():
    """Adapter dropout 0.3, no tiled MLP: with one seed before the forward, strides 2 and 3 give stride 1's loss and
    gradients (and the un-checkpointed model's): the layers run again under their forward's RNG state."""
    from seqpar.plan.specs import LoraSpec
    from seqpar.runtime.hf.lora import apply_lora

    spec = LoraSpec(rank=4, alpha=8, dropout=0.3, target_modules=["q_proj", "v_proj", "down_proj"])
    base = make_model()
    apply_lora(base, spec, seed=0, compute_dtype=torch.float64, adapter_dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # lora_B drawn: peft's zeros would leave every lora_A gradient zero
        for name, p in base.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    base.train()

    def seeded(model):
        torch.manual_seed(7)
        loss, grads = step(model, [batch()])
        return loss, {n: g for n, g in grads.items() if "lora_" in n}

    ref = seeded(copy.deepcopy(base))
    stride1 = seeded(apply(copy.deepcopy(base), checkpointing="offload"))
    assert_same("stride 1", *stride1, *ref)
    torch.manual_seed(8)  # a different draw really changes the loss: the masks matter
    assert not torch.equal(step(copy.deepcopy(base), [batch()])[0], ref[0])
    for stride in (2, 3):
        got = seeded(apply(copy.deepcopy(base), checkpointing="offload", offload_stride=stride))
        assert_same(f"stride {stride}", *got, *stride1)


@pytest.mark.parametrize("stride,off", [(2, None), (3, None), (4, 5), (3, 5)])
def test_derived_inputs_are_not_kept_and_cost_one_forward_each(monkeypatch, stride, off):
    from seqpar.runtime.memory import strided_offload as offload

    host = L6 if off is None else off
    heads = math.ceil(host / stride)
    base = make_model()
    ids, labels = batch()
    to_host, copied = offload.to_host, []
    monkeypatch.setattr(offload, "to_host", lambda t, budget: copied.append(tuple(t.shape)) or to_host(t, budget))
    real, most = offload._Pass.input_of, [0]

    def input_of(self, index):  # the rebuilt inputs held at once: the cache and the one handed to the layer's backward
        x = real(self, index)
        most[0] = max(most[0], len(self.cache) + 1)
        return x

    monkeypatch.setattr(offload._Pass, "input_of", input_of)

    def run(k: int) -> tuple[list, list[int]]:
        """One forward and backward at stride k: whether each layer's input was still alive after the forward, and how
        often each layer's MLP ran."""
        model = apply(copy.deepcopy(base), checkpointing="offload", offload_layers=off, offload_stride=k)
        inputs, calls = [], [0] * L6
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda m, a: inputs.append(weakref.ref(a[0])))
            layer.mlp.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
        loss = model(input_ids=ids, labels=labels).loss
        gc.collect()
        alive = [r() is not None for r in inputs]
        loss.backward()
        return alive, calls

    alive1, calls1 = run(1)
    copied.clear()
    alive, calls = run(stride)
    derived = [i < host and i % stride != 0 for i in range(L6)]
    assert alive1 == [True] * L6  # stride 1: every input kept (on CPU the host copy is the tensor itself)
    assert alive == [not d for d in derived], alive
    assert copied == [(B, S, 32)] * heads  # only the heads' inputs went through the host copy
    # a group of g layers runs its first g - 1 again, once each, to rebuild the inputs above them
    last_of_group = [i == host - 1 or (i + 1) % stride == 0 for i in range(L6)]
    extra = [int(i < host and not last_of_group[i]) for i in range(L6)]
    assert [a - b for a, b in zip(calls, calls1)] == extra, (calls, calls1)
    assert sum(extra) == host - heads
    assert most[0] == min(stride, host) - 1  # up to k - 1 rebuilt layer inputs at once


def test_refusals_are_one_line():
    from seqpar.plan.errors import SeqparError

    cases = [
        (dict(checkpointing="full", offload_stride=2), r"offload_stride 2 spaces the layer inputs .* checkpointing is full"),
        (dict(checkpointing="none", offload_stride=2), r"offload_stride 2 .* but checkpointing is none; remove offload_stride"),
        (dict(offload_stride=2), r"offload_stride=2, .* but checkpointing is None \(the model's own setting\)"),
        (dict(checkpointing="offload", offload_layers=3, offload_stride=4), r"offload_stride 4 is more than the 3 offloaded"),
        (dict(checkpointing="offload", offload_stride=0), r"offload_stride 0 is not a whole number >= 1"),
    ]
    for kwargs, match in cases:
        with pytest.raises(SeqparError, match=match) as e:
            apply(make_model(dtype=torch.float32), **kwargs)
        assert "\n" not in str(e.value), str(e.value)


def _ranks_main(rank: int, world_size: int) -> list[str]:
    """Each stride's loss and summed gradients against stride 1's, in zigzag_ring_attn on this rank's shard."""
    import seqpar

    from seqpar_testing.hf import group_grads

    warnings.filterwarnings("ignore")
    ids, labels = batch()
    part = seqpar.prepare_inputs(ids, "zigzag_ring_attn", rank, world_size, labels=labels)
    base = make_model(layers=4, dtype=torch.float32)
    got = {}
    for stride in (1, 2, 3):
        model = seqpar.apply(copy.deepcopy(base), "zigzag_ring_attn", checkpointing="offload", offload_stride=stride)
        loss = seqpar.loss(model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits, part["labels"])
        loss.backward()
        got[stride] = (loss.detach(), group_grads(model))
    failures = []
    for stride in (2, 3):
        for name, (a, b) in {
            "loss": (got[stride][0], got[1][0]),
            **{n: (g, got[1][1][n]) for n, g in got[stride][1].items()},
        }.items():
            if not torch.equal(a, b):
                failures.append(f"rank {rank} stride {stride} {name}: max |diff| {float((a - b).abs().max())}")
    return failures


def test_stride_over_two_ranks_in_zigzag_ring_attn_equals_stride_1():
    for failures in run_ranks(_ranks_main, 2, timeout=120):
        assert failures == [], "\n".join(failures[:10])


def _strided_plan(stride: int, sharding: str):
    plan = make_plan(2, "ulysses_attn", 2, mbs=1, ga=2, sharding=sharding, checkpointing="offload")
    strategy = {**plan.strategy.model_dump(), "offload_stride": stride}
    return plan.model_validate({**plan.model_dump(), "strategy": strategy})


def _train(rank: int, world: int, cases: list, tmp: str, data: str) -> dict:
    from seqpar.runtime.memory.strided_offload import StridedOffload

    from seqpar_testing.train import train_cases

    metrics = train_cases(rank, world, cases, tmp, data)
    return {"metrics": metrics, "stats": dict(StridedOffload.stats)}


HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.parametrize(
    "sharding",
    ["fsdp", pytest.param("zero3", marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="the deepspeed extra is not installed"))],
)
def test_the_trainer_runs_the_plans_stride(tmp_path, request, sharding):
    """seqpar's trainer on 2 gloo ranks (the tiny profile: 2 layers, so layer 0 a head and layer 1 derived) under FSDP2
    or DeepSpeed ZeRO-3 (parameters gathered by module hooks, which the rebuilt layer's forward runs outside of; both
    hand the next layer a view of the output), Ulysses and two accumulated micro-batches, 20 steps: stride 2 trains to
    stride 1's losses and gradient norms, leaves layer 1's input to a recipe every time, and train.log states it."""
    from seqpar.runtime.hf.trainer import SeqparArguments

    if sharding == "zero3":
        request.getfixturevalue("deepspeed_ops")  # DeepSpeed's CPU ops built once, before the ranks' timeout
    assert SeqparArguments.from_plan(_strided_plan(2, sharding)).offload_stride == 2
    data = learnable_tokens(tmp_path / "tokens.npy")
    cases = [("ref", _strided_plan(1, sharding)), ("stride2", _strided_plan(2, sharding))]
    got = run_ranks(_train, 2, cases, str(tmp_path), data, timeout=170)[0]
    compare_runs(got["metrics"])
    # 20 steps x 2 micro-batches: layer 1's input left to a recipe and rebuilt each time, by one forward of layer 0
    assert (got["stats"]["recomputed"], got["stats"]["forwards"], got["stats"].get("fallback", 0)) == (40, 40, 0)
    log = (tmp_path / "stride2" / "train.log").read_text()
    report = json.loads((tmp_path / "stride2" / "run_report.json").read_text())
    # per step (2 micro-batches): layer 0's input to the host, layer 1's rebuilt by one forward of layer 0, each twice
    assert report["strided_offload"] == {"host": 2.0, "fallback": 0.0, "recomputed": 2.0, "forwards": 2.0}
    assert "offload_stride per step: 2 layer inputs to host memory, 2 rebuilt in backward by 2 layer forwards" in log
    assert "checkpointing=offload (layers 0-1: input of 1 in 2 in host memory (1), the others recomputed)" in log


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_step(model, ids, autocast: bool):
    """One forward and backward on the GPU: (loss, gradients (on the CPU), bytes the forward left allocated, backward's
    peak above them, pinned bytes copied to the host)."""
    from seqpar.runtime.memory.offload import HostOffload

    model.zero_grad(set_to_none=True)
    pinned = HostOffload.stats["pinned"]
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    peak = torch.cuda.max_memory_allocated() - after
    return loss.detach().float().cpu(), grads, after - start, peak, HostOffload.stats["pinned"] - pinned


def _worst(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b)


@needs_cuda
@pytest.mark.parametrize("lora", [False, True], ids=["bf16", "lora-dropout-autocast"])
def test_on_the_gpu_only_the_heads_inputs_leave_and_nothing_else_stays(lora):
    """An 8-layer Llama on the GPU (hidden 512, 4096 tokens), every layer offloaded, in bf16, or in fp32 under bf16
    autocast with LoRA dropout (CUDA RNG and autocast state restored in the rebuild). After the forward, strides 2 and 4
    hold no more GPU memory than stride 1 (no layer input stays on the device: the heads' went to pinned host memory,
    the others' are gone; full checkpointing, which keeps them, holds at least 7 more); the pinned copies are ceil(8/k)
    layer inputs, backward's peak grows by at most k layer inputs, and the loss and gradients equal stride 1's bit for
    bit (seen on one H100 with torch 2.11 and transformers 5.17)."""
    import transformers

    from seqpar.plan.specs import LoraSpec
    from seqpar.runtime.hf.lora import apply_lora

    layers, hidden, tokens = 8, 512, 4096
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=tokens,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to("cuda", torch.float32 if lora else torch.bfloat16).train()
    if lora:
        apply_lora(base, LoraSpec(rank=8, alpha=16, dropout=0.3), seed=0, compute_dtype=torch.float32)
        with torch.no_grad():
            for name, p in base.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    ids = torch.randint(0, 4096, (1, tokens), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    input_bytes = tokens * hidden * (4 if lora else 2)  # a decoder layer's input (1, S, hidden): fp32 under autocast

    def run(checkpointing: str, stride: int = 1):
        # the exact attention kernel: cuDNN's backward is not deterministic, and the comparison below is bit for bit
        model = apply(copy.deepcopy(base), checkpointing=checkpointing, offload_stride=stride, backend="exact")
        torch.manual_seed(3)
        out = _gpu_step(model, ids, lora)
        del model
        return out

    run("offload")  # warm-up: the first step allocates cuBLAS's workspace (32 MiB on Hopper), counted as allocated
    ref = run("offload")
    again = run("offload")
    full = run("full")
    noise = max(_worst(again[1], ref[1]), float((again[0] - ref[0]).abs()))  # 0 with the exact kernel
    strided = {k: run("offload", k) for k in (2, 4)}
    for k, (loss, grads, after, peak, pinned) in strided.items():
        print(f"stride {k} against 1: after forward {after - ref[2]:+d} B, backward peak {peak - ref[3]:+d} B, pinned {pinned} B")
    # the measurement sees layer inputs: full checkpointing keeps them on the GPU (at least 7 of the 8 more than offload:
    # the first layer's input is the embedding's output)
    assert full[2] - ref[2] >= (layers - 1) * input_bytes, (full[2], ref[2])
    assert ref[4] == layers * input_bytes, ref[4]
    for k, (loss, grads, after, peak, pinned) in strided.items():
        assert after <= ref[2], (k, after, ref[2])
        assert pinned == math.ceil(layers / k) * input_bytes, (k, pinned)
        assert peak - ref[3] <= k * input_bytes, (k, peak, ref[3])
        assert torch.equal(loss, ref[0]) and all(torch.equal(grads[n], g) for n, g in ref[1].items()), (k, noise)
