"""kept_saves matmuls on a CUDA GPU, bf16, with Liger's fused kernels (seqpar.runtime.memory.matmul_keep): the streams, the
page-locked host blocks and Liger's in-place RoPE, which the CPU tests cannot reach.

- Two accumulated micro-batches, each a forward and a backward, twice (host blocks reused from the pool the second
  time), with the side stream held back by a sleep queued before every copy (so a copy that is not waited for would be
  read too early): the gradients equal those of fully kept layers (kept_saves all), with the matmul outputs kept on the
  GPU and with some in host memory. Equal means within twice the gap between two runs of kept_saves all (cuDNN's
  attention backward need not be deterministic), and at least 1e-2 of each gradient's largest entry (~2.5 bf16 ulps);
  the control below misses by far more.
- Without the copy q_proj / k_proj hand an in-place RoPE, the kept outputs would be rotated twice: the gradients come
  out wrong, so the guard is what makes the result exact (a control, not a tolerance). Liger applied by seqpar and by
  Liger's own patch are both recognised.
- A forward that never reaches backward gives its host blocks back: the pinned bytes do not grow.
- A stated pinned budget (seqpar.apply's pinned_budget_gib, a plan's pinned_host_gib per rank) bounds the host blocks:
  the outputs beyond it are recomputed, and the gradients are still those of fully kept layers.
- A token count that changes between steps keeps all its outputs in host memory within the same budget (the idle
  blocks of the earlier sizes are unpinned for the new ones).
- What waits on the GPU after the forward shrinks by the model's per-layer bytes (seqpar.advisor.cost.memory
  matmul_bytes_per_token) for each kept layer: from all to matmuls, and for each layer moved to host memory.
"""

from __future__ import annotations

import collections
import gc
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("liger_kernel")

# The model (Llama, 4 layers, hidden 1024, GQA 8/4 heads, 8K tokens, bf16 on CUDA) is bench/layer_saves.py's, which lists
# each layer's saved tensors for the byte count below.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from layer_saves import HEADS, H, L, S  # noqa: E402
from layer_saves import model as _model  # noqa: E402


def _slow_side(monkeypatch):
    """Every copy's side stream first sleeps ~1 ms: a consumer that does not wait for a copy reads it unfinished."""
    from seqpar.runtime.memory import matmul_keep

    real = matmul_keep._side

    def side(device):
        s = real(device)
        with torch.cuda.stream(s):
            torch.cuda._sleep(2_000_000)
        return s

    monkeypatch.setattr(matmul_keep, "_side", side)


def _run(saves: str, host: int, *, fused: str = "seqpar", guard: bool = True, monkeypatch=None, budget=None):
    """Two optimizer-free steps of two accumulated micro-batches; the gradients after them and the bytes the first
    forward left on the GPU."""
    import seqpar
    from seqpar.runtime.memory import matmul_keep
    from seqpar.runtime.memory.fused import apply_fused_ops

    warnings.filterwarnings("ignore")
    # The previous run's model holds reference cycles (its hooks): free it now, or the collector may free it during
    # this run's first forward and make the bytes that forward leaves look smaller than they are.
    gc.collect()
    model = _model()
    seqpar.apply(
        model,
        "data_parallel",
        checkpointing="selective",
        checkpoint_layers=1,
        kept_saves=saves,
        kept_host_layers=host,
        pinned_budget_gib=budget,
    )
    if fused == "seqpar":
        apply_fused_ops(model, "liger", "cuda")
    if not guard:
        monkeypatch.setattr(matmul_keep, "_copy_for_rope", lambda keeper, out: out)
    g = torch.Generator("cuda").manual_seed(1)
    batches = [torch.randint(0, 1000, (1, S), device="cuda", generator=g) for _ in range(2)]
    held = None
    for _step in range(2):
        model.zero_grad(set_to_none=True)
        for ids in batches:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = model(input_ids=ids, labels=ids).loss / len(batches)
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - before if held is None else held
            loss.backward()
    torch.cuda.synchronize()
    return {n: p.grad.float() for n, p in model.named_parameters()}, held


def _gap(grads, ref) -> float:
    return max(float((grads[n] - r).abs().max() / r.abs().max().clamp_min(1e-12)) for n, r in ref.items())


def _tolerance(floor: float) -> float:
    """Twice the gap between two runs of one plan (cuDNN's attention backward need not be deterministic), and at
    least ~2.5 bf16 ulps of the largest entry."""
    return max(2 * floor, 1e-2)


def _restore_rope(monkeypatch):
    """apply_fused_ops leaves seqpar's dispatcher as the modeling module's RoPE: the plain one now, and whatever was
    there back at teardown."""
    import transformers.models.llama.modeling_llama as modeling

    rope = modeling.apply_rotary_pos_emb
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", getattr(rope, "_seqpar_plain", rope))


@pytest.fixture
def own_pool(monkeypatch):
    """A pool of the test's own and a pinned count from zero; at teardown its blocks are unregistered (a block freed
    while registered leaves its address range registered, and a later block there fails with
    cudaErrorHostMemoryAlreadyRegistered) and the module's pool and count come back."""
    from seqpar.runtime.memory import matmul_keep
    from seqpar.runtime.memory.offload import HostOffload

    pool = matmul_keep._Pool()
    monkeypatch.setattr(matmul_keep, "_POOL", pool)
    monkeypatch.setattr(HostOffload, "held", 0)
    yield pool
    gc.collect()
    torch.cuda.synchronize()
    pool.reclaim(sum(n * len(blocks) for n, blocks in pool.free.items()))
    assert not any(pool.free.values())


def test_kept_matmuls_match_fully_kept_layers_with_liger(monkeypatch):
    from seqpar.advisor.cost.memory import matmul_bytes_per_token, saved_bytes_per_token
    from seqpar.profiles.hf_config import spec_from_config
    from seqpar.runtime.memory.matmul_keep import MatmulKeep

    _restore_rope(monkeypatch)
    _slow_side(monkeypatch)
    ref, _ = _run("all", 0)  # the first forward in the process also allocates cuBLAS's workspace: not counted below
    again, held_all = _run("all", 0)
    tol = _tolerance(_gap(again, ref))
    grads, held_mm = _run("matmuls", 0)
    before = MatmulKeep.stats["host"]
    grads_h, held_host = _run("matmuls", 2)
    assert MatmulKeep.stats["host"] > before
    assert _gap(grads, ref) <= tol, (_gap(grads, ref), tol)
    assert _gap(grads_h, ref) <= tol, (_gap(grads_h, ref), tol)
    wrong, _ = _run("matmuls", 0, guard=False, monkeypatch=monkeypatch)
    assert _gap(wrong, ref) > 0.05 + tol, "without the copy before RoPE the kept q and k are rotated twice"

    spec = spec_from_config(_model().config.to_dict(), "t", "test", "test")
    mm = matmul_bytes_per_token(spec, "bf16") * S
    saved = (saved_bytes_per_token(spec, "bf16", None, "liger") + 2 * H) * S  # + the layer input the fused norm saves
    around = (2 * H + 2 * H + 4 * HEADS) * S  # input + attention out + lse, kept either way
    kept = L - 1
    assert abs((held_all - held_mm) - kept * (saved - around - mm)) < 0.1 * kept * (saved - around - mm)
    assert abs((held_mm - held_host) - 2 * mm) < 0.1 * 2 * mm


def test_liger_applied_by_its_own_patch_is_recognised(monkeypatch):
    """transformers' use_liger_kernel and Liger's apply_liger_kernel_to_llama rebind the modeling module's RoPE to
    Liger's in-place one; the layers keeping matmul outputs still hand it a copy."""
    import transformers.models.llama.modeling_llama as modeling
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    from seqpar.runtime.memory.fused import rope_in_place

    _restore_rope(monkeypatch)  # the plain RoPE now, whatever an earlier test left; put back at teardown
    assert not rope_in_place(modeling)
    apply_liger_kernel_to_llama(rope=True, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=False)
    assert rope_in_place(modeling)
    ref, _ = _run("all", 0, fused="liger's own")
    grads, _ = _run("matmuls", 0, fused="liger's own")
    again, _ = _run("all", 0, fused="liger's own")
    assert _gap(grads, ref) <= _tolerance(_gap(again, ref))


def test_a_forward_without_backward_gives_its_host_blocks_back():
    import seqpar
    from seqpar.runtime.memory.offload import HostOffload

    warnings.filterwarnings("ignore")
    # The previous run's model holds reference cycles (its hooks): free it now, or the collector may free it during
    # this run's first forward and make the bytes that forward leaves look smaller than they are.
    gc.collect()
    model = _model()
    seqpar.apply(model, "data_parallel", checkpointing="selective", checkpoint_layers=1, kept_saves="matmuls", kept_host_layers=3)
    ids = torch.randint(0, 1000, (1, S), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss  # no backward
    held = HostOffload.held
    del loss
    gc.collect()
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    assert HostOffload.held == held  # the forgotten forward's blocks served the next steps


def test_a_stated_pinned_budget_bounds_the_host_blocks(monkeypatch, own_pool):
    from seqpar.advisor.cost.memory import matmul_bytes_per_token
    from seqpar.profiles.hf_config import spec_from_config
    from seqpar.runtime.memory.matmul_keep import MatmulKeep
    from seqpar.runtime.memory.offload import HostOffload

    _restore_rope(monkeypatch)
    # a pool of its own (own_pool): blocks earlier tests left in the pool would be reused without asking the budget
    spec = spec_from_config(_model().config.to_dict(), "t", "test", "test")
    layer = matmul_bytes_per_token(spec, "bf16") * S  # one layer's kept matmul outputs
    budget = 1.5 * layer / 2**30
    ref, _ = _run("all", 0)
    again, _ = _run("all", 0)
    before = dict(MatmulKeep.stats)
    grads, _ = _run("matmuls", L - 1, budget=budget)
    host = MatmulKeep.stats["host"] - before.get("host", 0)
    recomputed = MatmulKeep.stats["recomputed"] - before.get("recomputed", 0)
    forwards = 4  # two steps of two micro-batches
    assert layer <= host / forwards <= 1.5 * layer  # one layer's outputs and part of the next's, per forward
    assert recomputed / forwards >= (L - 1) * layer - 1.5 * layer  # the rest run their matmuls again
    assert 0 < HostOffload.held <= budget * 2**30
    assert _gap(grads, ref) <= _tolerance(_gap(again, ref))


def test_a_new_token_count_keeps_its_outputs_within_the_same_budget(monkeypatch, own_pool):
    """Steps of 8K, 7K and 7.5K tokens under a budget of 2.2 layers' outputs at 8K, two layers in host memory: each
    step keeps all of its outputs in host memory (the idle blocks of the earlier sizes are unpinned for the new ones),
    none is recomputed, and the pinned bytes stay within the budget."""
    import seqpar
    from seqpar.advisor.cost.memory import matmul_bytes_per_token
    from seqpar.profiles.hf_config import spec_from_config
    from seqpar.runtime.memory.matmul_keep import MatmulKeep
    from seqpar.runtime.memory.offload import HostOffload

    _restore_rope(monkeypatch)
    warnings.filterwarnings("ignore")
    model = _model()
    per_token = matmul_bytes_per_token(spec_from_config(model.config.to_dict(), "t", "test", "test"), "bf16")
    budget = 2.2 * per_token * S / 2**30
    seqpar.apply(
        model,
        "data_parallel",
        checkpointing="selective",
        checkpoint_layers=1,
        kept_saves="matmuls",
        kept_host_layers=2,
        pinned_budget_gib=budget,
    )
    for n in (S, S - 1024, S - 512):
        before = collections.Counter(MatmulKeep.stats)
        ids = torch.randint(0, 1000, (1, n), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        assert MatmulKeep.stats["recomputed"] == before["recomputed"], n
        assert MatmulKeep.stats["host"] - before["host"] == 2 * per_token * n, n
        assert 0 < HostOffload.held <= budget * 2**30
