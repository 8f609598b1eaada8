"""kept_saves matmuls (seqpar.runtime.memory.matmul_keep) on a real 4-layer transformers Llama, on CPU.

- Exact: under full, selective and offload, with 1 or 3 checkpointed layers and 0, 1 or all kept layers' matmul outputs
  in "host" memory (on CPU a plain copy), the loss and every gradient equal the un-checkpointed model's; over two gloo
  ranks in zigzag_ring_attn too.
- Nothing but elementwise ops is recomputed: backward runs exactly as many matmuls as with fully kept layers (the
  checkpointed layers' recomputed matmuls aside), and attention keeps its out + lse in those layers.
- What is kept: per kept layer, exactly the outputs of q, k, v, o, gate and up projections (not down's), the size the
  advisor's memory model counts (seqpar.advisor.cost.memory.matmul_bytes_per_token); the checkpoint saves only the layer input.
- Host blocks: backwards run oldest first (several micro-batches pending) fetch their own forward's outputs; the pool
  unpins idle blocks of earlier sizes when a new token count would pass the pinned budget (cudaHostRegister recorded).
- Refusals: kept_saves matmuls without kept layers, kept_host_layers without matmuls or beyond the kept layers.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqpar.plan.options import layer_split

from seqpar_testing import run_ranks
from seqpar_testing.hf import compare_loss_and_grads, group_grads, param_grads
from seqpar_testing.memory import HIDDEN, B, L, S, batch, make_model, reference, saved_bytes
from seqpar_testing.train import make_plan

# (policy, checkpointed layers, host-kept layers); the last case keeps every layer, two of them on the host, spread (0, 2)
CASES = [(p, k, h) for p in ("full", "selective", "offload") for k in (1, L - 1) for h in (0, 1, L - k)] + [("full", 0, 2)]
_MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in _MM
        return func(*args, **(kwargs or {}))


def _apply(model, mode, policy, k, host, saves="matmuls"):
    import seqpar

    kw = {"offload_layers": 0} if policy == "offload" else {}
    return seqpar.apply(model, mode, checkpointing=policy, checkpoint_layers=k, kept_saves=saves, kept_host_layers=host, **kw)


def test_kept_matmuls_are_exact_on_one_process():
    from seqpar.runtime.memory import selective
    from seqpar.runtime.memory.matmul_keep import MatmulKeep

    warnings.filterwarnings("ignore")
    ids, labels = batch()
    base, ref_loss, ref_grads = reference()
    failures = []
    for policy, k, host in CASES:
        model = _apply(copy.deepcopy(base), "data_parallel", policy, k, host)
        on_host = layer_split(policy, L, k, 0 if policy == "offload" else None, "matmuls", host).host_kept
        assert len(on_host) == host and (k > 0 or on_host == (0, 2))  # k = 0: spread, not the bottom two
        for i, layer in enumerate(model.model.layers):
            f = layer._gradient_checkpointing_func
            assert isinstance(f, MatmulKeep) == (i >= k) and layer.gradient_checkpointing, (policy, k, host, i)
            assert not isinstance(f, MatmulKeep) or f.host == (i in on_host), (policy, k, host, i)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        compare_loss_and_grads(failures, f"{policy} k={k} host={host}", loss.detach(), ref_loss, param_grads(model), ref_grads)
        if selective.pending():
            failures.append(f"{policy} k={k} host={host}: {selective.pending()} kept attention entries left")
    assert failures == [], "\n".join(failures[:10])


def _ranks_main(rank: int, world_size: int) -> list[str]:
    import seqpar

    warnings.filterwarnings("ignore")
    ids, labels = batch()
    base, ref_loss, ref_grads = reference()
    part = seqpar.prepare_inputs(ids, "zigzag_ring_attn", rank, world_size, labels=labels)
    failures = []
    for policy, k, host in (("selective", 1, 1), ("full", 2, 0)):
        model = _apply(copy.deepcopy(base), "zigzag_ring_attn", policy, k, host)
        loss = seqpar.loss(model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits, part["labels"])
        loss.backward()
        compare_loss_and_grads(
            failures, f"rank {rank} {policy} k={k} host={host}", loss.detach(), ref_loss, group_grads(model), ref_grads
        )
    return failures


def test_kept_matmuls_are_exact_over_two_ranks_in_zigzag_ring_attn():
    for failures in run_ranks(_ranks_main, 2, timeout=180):
        assert failures == [], "\n".join(failures[:10])


@pytest.mark.parametrize("host", [0, 2])
def test_backward_recomputes_no_kept_matmul(host):
    """Backward's matmul count: fully kept layers = kept matmuls (only the elementwise ops run again); every layer
    checkpointed = that plus 6 recomputed projections per layer (down's output is never needed: early stop)."""
    warnings.filterwarnings("ignore")
    ids, labels = batch()
    base = make_model()
    counts = {}
    for name, saves, k in (("all", "all", 1), ("matmuls", "matmuls", 1), ("checkpointed", "all", L)):
        model = _apply(copy.deepcopy(base), "data_parallel", "selective", k, host if saves == "matmuls" else 0, saves)
        loss = model(input_ids=ids, labels=labels).loss
        with _CountMatmuls() as mode:
            loss.backward()
        counts[name] = mode.n
    assert counts["matmuls"] == counts["all"], counts
    assert counts["checkpointed"] == counts["all"] + 6 * (L - 1), counts


def test_kept_bytes_are_the_projections_the_memory_model_counts():
    from seqpar.advisor.cost.memory import matmul_bytes_per_token
    from seqpar.profiles.hf_config import spec_from_config
    from seqpar.runtime.memory import selective
    from seqpar.runtime.memory.matmul_keep import MatmulKeep

    warnings.filterwarnings("ignore")
    ids, _ = batch()
    for host in (0, 1):
        model = _apply(make_model(), "data_parallel", "selective", 1, host)
        before = MatmulKeep.stats.copy()
        saved, _, loss = saved_bytes(model, ids)
        kept = {k: MatmulKeep.stats[k] - before[k] for k in ("gpu", "host", "recomputed")}
        spec = spec_from_config(model.config.to_dict(), "tiny", "the test's config", "test")
        per_layer = matmul_bytes_per_token(spec, "fp32") * B * S
        assert kept == {"gpu": (L - 1 - host) * per_layer, "host": host * per_layer, "recomputed": 0}, (kept, per_layer)
        layer_input = B * S * HIDDEN * 4
        assert all(saved[i] == layer_input for i in range(L)), saved  # the checkpoint saves the layer input alone
        assert [selective.pending(layer.self_attn) for layer in model.model.layers] == [1] * L
        loss.backward()
        assert selective.pending() == 0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"checkpointing": "selective", "kept_saves": "matmuls"}, "there are none"),
        ({"checkpointing": "selective", "checkpoint_layers": L, "kept_saves": "matmuls"}, "there are none"),
        ({"checkpointing": "selective", "checkpoint_layers": 1, "kept_host_layers": 1}, "kept_saves is all"),
        ({"checkpointing": "full", "checkpoint_layers": 1, "kept_saves": "matmuls", "kept_host_layers": 4}, "at most 3"),
        ({"checkpointing": "full", "checkpoint_layers": 1, "kept_saves": "some"}, "unknown"),
        ({"kept_saves": "matmuls"}, "checkpointing is None"),
    ],
)
def test_refusals(kwargs, words):
    import seqpar
    from seqpar.plan.errors import SeqparError

    with pytest.raises(SeqparError, match=words):
        seqpar.apply(make_model(), "data_parallel", **kwargs)


@pytest.mark.parametrize("host", [0, 1])
def test_an_output_changed_in_place_is_recomputed_not_kept(host):
    """The model's own code scaling q_proj's output in place (an aten op) after it was kept: kept, it would come back
    scaled twice in the recomputation. That entry is dropped and its matmul recomputed: the gradients stay exact."""
    from seqpar.runtime.memory.matmul_keep import MatmulKeep

    warnings.filterwarnings("ignore")
    ids, labels = batch()
    base = make_model()

    def scale(m, a, out):
        return out.mul_(0.5)

    base.model.layers[2].self_attn.q_proj.register_forward_hook(scale)
    ref = copy.deepcopy(base)
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    model = _apply(copy.deepcopy(base), "data_parallel", "selective", 1, host)
    before = MatmulKeep.stats["recomputed"]
    loss = model(input_ids=ids, labels=labels).loss
    dropped = MatmulKeep.stats["recomputed"] - before
    loss.backward()
    failures = []
    compare_loss_and_grads(failures, f"host={host}", loss.detach(), ref_loss.detach(), param_grads(model), param_grads(ref))
    assert failures == [], failures
    assert dropped == B * S * HIDDEN * 4  # that one (B, S, hidden) fp32 output, and no other


def test_applying_again_takes_the_earlier_hooks_off():
    """seqpar.apply a second time (kept_saves all now): the layers lose the matmul keeps' hooks and keep everything."""
    warnings.filterwarnings("ignore")
    model = _apply(make_model(), "data_parallel", "selective", 1, 0)
    hooks = lambda m: sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in m.model.layers.modules())  # noqa: E731
    assert hooks(model) == (L - 1) * 4  # down_proj's pre/post pair, q_proj's and k_proj's copy hooks
    _apply(model, "data_parallel", "selective", 1, 0, saves="all")
    assert hooks(model) == 0


def test_a_second_backward_recomputes_the_matmuls():
    """backward(retain_graph=True) twice: the second recomputation finds the kept outputs taken and runs the matmuls
    again, so the gradients are twice the reference's, as without checkpointing."""
    warnings.filterwarnings("ignore")
    ids, labels = batch()
    base, ref_loss, ref_grads = reference()
    model = _apply(copy.deepcopy(base), "data_parallel", "selective", 1, 1)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward(retain_graph=True)
    loss.backward()
    failures = []
    compare_loss_and_grads(
        failures, "twice", loss.detach(), ref_loss, param_grads(model), {n: 2 * g for n, g in ref_grads.items()}
    )
    assert failures == [], failures


def test_a_kept_output_changed_after_the_forward_is_refused():
    """An in-place change of a GPU-kept output between the forward and its backward (outside the layer, where no mode
    sees it) moves its version counter: the recomputation refuses it instead of using the changed values."""
    warnings.filterwarnings("ignore")
    ids, labels = batch()
    model = _apply(make_model(), "data_parallel", "selective", 1, 0)
    loss = model(input_ids=ids, labels=labels).loss
    keeper = model.model.layers[1]._gradient_checkpointing_func
    kept = keeper.forwards[-1]().entries[0].gpu
    kept.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place after the forward kept it"):
        loss.backward()


def test_a_recomputation_that_runs_other_matmuls_is_refused():
    """Entries are handed back by position and checked: a recomputation whose matmul at some position differs from the
    forward's (here the forward's record of the first one altered) fails loudly instead of mixing outputs up."""
    warnings.filterwarnings("ignore")
    ids, labels = batch()
    model = _apply(make_model(), "data_parallel", "selective", 1, 0)
    loss = model(input_ids=ids, labels=labels).loss
    fwd = model.model.layers[3]._gradient_checkpointing_func.forwards[-1]()
    fwd.ops[0] = (fwd.ops[0][0], (1, 1))  # as if the forward's first matmul had another shape
    with pytest.raises(RuntimeError, match="must run the same matmuls"):
        loss.backward()


def test_the_stated_pinned_budget_reaches_the_offload_and_every_kept_layer(monkeypatch):
    """seqpar.apply's pinned_budget_gib (what the trainer passes from the plan's ClusterSpec.stated_pinned_gib_per_rank)
    is the budget of the offloaded layer inputs and of each kept layer's host blocks; SeqparArguments.from_plan carries
    the plan's per-rank share. (That it bounds the page-locked blocks: tests/runtime/memory/test_matmul_keep_gpu.py.)"""
    import functools

    import seqpar
    from seqpar.runtime.hf.trainer import SeqparArguments
    from seqpar.runtime.memory.activation_checkpoint import _offloaded_checkpoint
    from seqpar.runtime.memory.matmul_keep import MatmulKeep
    from seqpar.runtime.memory.offload import pinned_budget

    base, _, _ = reference()
    model = seqpar.apply(
        copy.deepcopy(base),
        "data_parallel",
        checkpointing="offload",
        checkpoint_layers=2,
        offload_layers=1,
        kept_saves="matmuls",
        kept_host_layers=1,
        pinned_budget_gib=0.75,
    )
    funcs = [layer._gradient_checkpointing_func for layer in model.model.layers]
    assert isinstance(funcs[0], functools.partial) and funcs[0].func is _offloaded_checkpoint
    assert funcs[0].keywords == {"pinned_budget_gib": 0.75}
    assert [f.pinned_budget_gib for f in funcs[2:]] == [0.75] * (L - 2) and all(isinstance(f, MatmulKeep) for f in funcs[2:])
    monkeypatch.setenv("SEQPAR_PINNED_BUDGET_GIB", "3")
    assert pinned_budget(0.75) == int(0.75 * 2**30) and pinned_budget() == 3 * 2**30  # stated > environment > default

    plan = make_plan(2, "zigzag_ring_attn", 2, checkpointing="offload")
    assert SeqparArguments.from_plan(plan).pinned_budget_gib is None  # unstated: the runtime's default
    stated = plan.model_validate({**plan.model_dump(), "cluster": {**plan.cluster.model_dump(), "pinned_host_gib": 3.0}})
    assert SeqparArguments.from_plan(stated).pinned_budget_gib == 1.5  # the node's 3 GiB over its 2 ranks


def test_backwards_run_oldest_first_fetch_their_own_forwards_outputs():
    """Two micro-batches' forwards, then their backwards oldest first (a user's loop): the gradient reaching a layer's
    output starts copying back the outputs of the layer below from the same forward, not the newest pending one (which
    would hold the other micro-batch's outputs on the GPU until its own backward). Exact either way; the gradients are
    the reference's, twice."""
    warnings.filterwarnings("ignore")
    ids, labels = batch()
    base, ref_loss, ref_grads = reference()
    model = _apply(copy.deepcopy(base), "data_parallel", "selective", 1, 2)  # layers 1, 2 in host memory, 3 on the GPU
    keepers = [layer._gradient_checkpointing_func for layer in model.model.layers[1:]]
    assert [k.host for k in keepers] == [True, True, False]
    losses, forwards = [], []
    for _ in range(2):
        losses.append(model(input_ids=ids, labels=labels).loss)
        forwards.append([k.forwards[-1]() for k in keepers])  # strong references: read after their backward
    assert not any(f.prefetched for fs in forwards for f in fs)
    losses[0].backward()
    # the backward of layers 2 and 3 started the copies of layers 1 and 2 (the top kept layer has none above it)
    assert [f.prefetched for f in forwards[0]] == [True, True, False]
    assert [f.prefetched for f in forwards[1]] == [False, False, False]
    assert not any(f.pending for f in forwards[0]) and all(f.pending for f in forwards[1][:2])
    losses[1].backward()
    assert [f.prefetched for f in forwards[1]] == [True, True, False]
    failures = []
    compare_loss_and_grads(
        failures, "two", losses[1].detach(), ref_loss, param_grads(model), {n: 2 * g for n, g in ref_grads.items()}
    )
    assert failures == [], failures


def test_the_pool_unpins_idle_blocks_of_old_sizes_for_a_new_token_count(monkeypatch):
    """Host blocks are kept by exact size. With a token count that changes between steps (padding-free batches,
    packing, a short last batch), the idle blocks of earlier sizes are unpinned when a new size would pass the budget,
    so every step that fits the budget keeps all its outputs; a step that needs more than the budget is still refused
    the excess, and the pinned bytes never pass it. cudaHostRegister needs a GPU: here the two calls are recorded."""
    import torch.cuda._pin_memory_utils as pin_utils

    from seqpar.runtime.memory import matmul_keep, offload
    from seqpar.runtime.memory.offload import HostOffload

    pinned: dict[int, int] = {}
    monkeypatch.setattr(pin_utils, "pin_memory", lambda ptr, n: pinned.__setitem__(ptr, n))
    monkeypatch.setattr(pin_utils, "unpin_memory", lambda ptr: pinned.pop(ptr))
    pool = matmul_keep._Pool()
    monkeypatch.setattr(matmul_keep, "_POOL", pool)
    monkeypatch.setattr(HostOffload, "held", 0)
    widths = (64, 32, 32, 64, 176, 176)  # q, k, v, o, gate, up of one layer (bf16: 2 bytes each)
    budget_gib = 2 * sum(widths) * 2 * 1100 / 2**30  # two layers' outputs at 1,100 tokens
    for tokens, layers in [(1000, 2), (1100, 2), (900, 2), (1050, 2), (1000, 3), (1000, 1)]:
        sizes = [tokens * w * 2 for w in widths] * layers
        blocks = [pool.take(n, budget_gib) for n in sizes]
        refused = sum(n for n, b in zip(sizes, blocks) if b is None)
        need = sum(sizes) - int(budget_gib * 2**30)
        assert refused == 0 if need <= 0 else 0 < refused <= need + max(sizes), (tokens, layers, refused, need)
        assert HostOffload.held <= budget_gib * 2**30
        assert (
            HostOffload.held
            == sum(pinned.values())
            == sum(b.numel() for blocks in pool.free.values() for b in blocks) + sum(b.numel() for b in blocks if b is not None)
        )
        assert all(pinned[b.data_ptr()] == b.numel() for b in blocks if b is not None)
        for b in blocks:
            if b is not None:
                pool.give(b)
    # the checkpoint offload shares the budget: it asks the pool for its idle blocks before falling back to pageable
    assert matmul_keep._reclaim in offload.RECLAIMERS
    held = HostOffload.held
    assert matmul_keep._reclaim(held) == held and HostOffload.held == 0 and pinned == {}


def test_each_host_kept_forward_waits_for_the_previous_ones_copies_out(monkeypatch):
    """Pacing: once a host-kept layer's forward is queued, the host waits until the previous host-kept layer's last copy
    out has run (and never for its own, nor in GPU-kept layers), so the output blocks waiting for their copies stay
    within about two layers. The copies' CUDA events need a GPU: here each forward's last copy out is an event double
    that records its synchronize(); everything else is the real model's forward (4 layers: 0, 2 host-kept, spread)."""
    from seqpar.runtime.memory import matmul_keep

    class Event:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            waited.append(self.name)

    waited, made = [], []
    real = matmul_keep._pace

    def pace(fwd):
        layer = keepers.index(fwd.keeper)
        made.append(layer)
        fwd.last_out = ("cuda:0", Event(f"copies of layer {layer}, pass {len(made)}"))  # what a CUDA forward records
        real(fwd)

    warnings.filterwarnings("ignore")
    ids, labels = batch()
    model = _apply(make_model(), "data_parallel", "full", 0, 2)
    keepers = [layer._gradient_checkpointing_func for layer in model.model.layers]
    assert [k.host for k in keepers] == [True, False, True, False]
    monkeypatch.setattr(matmul_keep, "_LAST_OUT", {})
    monkeypatch.setattr(matmul_keep, "_pace", pace)
    for _ in range(2):  # two forwards, each followed by its backward (the second waits on the first's last layer)
        model(input_ids=ids, labels=labels).loss.backward()
    assert made == [0, 2, 0, 2]
    assert waited == ["copies of layer 0, pass 1", "copies of layer 2, pass 2", "copies of layer 0, pass 3"]
