"""Kept layers that keep only their matmul outputs (the plan's ``kept_saves: matmuls``), on the GPU or in host memory.

A decoder layer that keeps every activation (memory-budget checkpointing's kept layers) holds about 8 tensors of
(tokens, width) for backward, but only the matmul outputs are expensive to make again: the norms, RoPE and the SwiGLU
product are elementwise passes. Op-level selective activation checkpointing (torchtitan's "op" SAC policy)
checkpoints the layer and keeps the outputs of its matmuls, so backward's recomputation runs only the elementwise ops; attention's out + lse are kept as under
``selective`` (seqpar.runtime.memory.selective), so its forward does not run again either. For Llama-2-7B at 64K tokens (bf16,
Liger) a fully kept layer holds 8.0 GiB, one that keeps its matmul outputs 5.7 (its input, attention's out + lse, and
4.7 of matmul outputs), for the same matmul time saved.

What is kept, per layer: the layer input (the checkpoint's), attention's out + lse, and every ``aten.mm``/``aten.addmm``
output except those of the MLP's down projection (``mlp.down_proj``, else the layer's last nn.Linear: nothing in the
layer's backward needs its output, and checkpointing's early stop never recomputes it). A forward pre/post hook pair on
that module tells the modes to skip its matmuls. The recomputation checks each matmul it is handed against the
forward's call at the same position (op and shape). The mechanism is torch.utils.checkpoint's selective checkpointing (a
TorchDispatchMode pair passed as ``context_fn``: one stores outputs during the forward, one hands them back in the
recomputation); its own pair (``create_selective_checkpoint_contexts``) keeps them on the device, so seqpar has its
own, which can also keep them in host memory. An aten op that writes in place into a kept output during the forward
(the layer's own code scaling a projection, say) drops it: that matmul is recomputed, so the result stays exact; and a
GPU-kept output whose version counter moved after the forward (an in-place change outside it) is refused in backward.
That counter is the mm output's: the (B, S, n) tensor nn.Linear returns for a 3-D input is an ``_unsafe_view`` with a
counter of its own, so a change made through it after the forward (a hook that keeps the projection's output and
edits it later) is not seen; changes during the forward are, by storage, whatever view made them.

``host``: the kept matmul outputs wait in page-locked host memory instead (``kept_host_layers``): each is copied out on a
side stream (one per device, shared by all layers) as soon as it is computed, and comes back one layer ahead in
backward (the copy starts when the gradient reaches the next layer's output, i.e. when that layer's backward begins),
so the copies overlap compute; the host is paced to the copies out (``_pace``: after a host-kept layer's forward is
queued, it waits for the previous host-kept layer's copies), so the blocks awaiting their copies never pile up until
the caching allocator flushes its cache. Which layers are host-kept is the plan's (seqpar.plan.options.LayerSplit.host_kept:
spread over the kept layers). The buffers come from a pool of exact-size page-locked blocks (cudaHostRegister, through
torch's own helper: no power-of-two rounding) that later steps reuse; a block goes back to the pool when its output is
taken, dropped, or forgotten (a forward that never reaches backward); idle blocks of other sizes are unpinned when
a new size would pass the budget (a token count that changes between steps). A matmul whose block would exceed the pinned
budget (seqpar.runtime.memory.offload.pinned_budget, shared with the checkpoint offload) is recomputed instead: exact, only
slower (``MatmulKeep.stats`` counts both).

Liger's RoPE rotates q and k in place, which would rotate a kept q_proj / k_proj output twice (once in forward, once in
the recomputation): in these layers those projections hand RoPE a copy (a forward hook) whenever the RoPE the layer's
modeling module calls is not its own (seqpar.runtime.memory.fused.rope_in_place: Liger applied by seqpar, by Liger's own
patch or by transformers' use_liger_kernel). The modeling module is read when the layer is set up, before FSDP2 gives
the layer a class of its own.

Exactness: the recomputation is the same forward with the matmul results handed back, so the saved tensors are the
first forward's bit for bit (tests/runtime/memory/test_matmul_keep.py compares loss and every gradient with fully kept layers).
"""

from __future__ import annotations

import collections
import math
import sys
import weakref
from functools import partial

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from seqpar.plan.errors import SeqparError
from seqpar.runtime.memory import offload
from seqpar.runtime.memory.selective import _in_backward

_MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
_SIDE: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device, shared by every layer's copies


def _side(device: torch.device):
    """The side stream of ``device``: every copy to or from a host block runs on it, so a block reused by a later copy
    is ordered after the earlier ones (and after the main stream's work, which each copy out waits for)."""
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    return _SIDE[device]


def _mm_shape(func, args) -> tuple[int, int]:
    a, b = (args[0], args[1]) if func is torch.ops.aten.mm.default else (args[1], args[2])
    return a.shape[0], b.shape[1]


def _detach(t: Tensor) -> Tensor:
    """t.detach() sharing t's version counter (below autograd a plain detach would not: torch's SAC helper does the same)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _skipped(layer: nn.Module) -> nn.Module | None:
    """The module whose matmuls are not kept: the MLP's down projection (mlp.down_proj, a PEFT wrapper around it
    included), else the layer's last nn.Linear in module order."""
    down = getattr(getattr(layer, "mlp", None), "down_proj", None)
    if isinstance(down, nn.Module):
        return down
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def _copy_for_rope(keeper: MatmulKeep, out):
    """q_proj / k_proj's output, copied when the model's RoPE rotates it in place (its kept original stays unrotated);
    only where a backward will follow (no_grad and eval forwards keep nothing)."""
    from seqpar.runtime.memory.fused import rope_in_place

    if torch.is_tensor(out) and out.is_cuda and torch.is_grad_enabled() and rope_in_place(keeper.modeling):
        return out.clone()
    return out


class _Skip:
    """Set while the layer's down projection runs: its matmul outputs are not kept."""

    __slots__ = ("on",)

    def __init__(self):
        self.on = False


class _Pool:
    """Page-locked host blocks of exact sizes (cudaHostRegister, through torch's own helper), reused across steps; one
    per process. Their bytes count in HostOffload.held, the budget the checkpoint offload also pins within."""

    def __init__(self):
        self.free: dict[int, list[Tensor]] = collections.defaultdict(list)

    def take(self, nbytes: int, budget_gib: float | None) -> Tensor | None:
        from torch.cuda._pin_memory_utils import pin_memory

        HostOffload = offload.HostOffload
        if self.free[nbytes]:
            return self.free[nbytes].pop()
        budget = offload.pinned_budget(budget_gib)
        if HostOffload.held + nbytes > budget:
            self.reclaim(HostOffload.held + nbytes - budget)
            if HostOffload.held + nbytes > budget:
                return None
        # torch's threads fault the pages in first: cudaHostRegister of untouched pages faults them in on one thread,
        # about 3x slower (BENCHMARKS.md, "Host copies of kept matmul outputs, profiled")
        buf = torch.empty(nbytes, dtype=torch.uint8).zero_()
        try:
            pin_memory(buf.data_ptr(), nbytes)
        except RuntimeError as e:
            raise SeqparError(
                f"page-locking a {nbytes / 2**30:.2f} GiB host block for kept matmul outputs failed ({e}); lower "
                "kept_host_layers or the pinned budget (the plan's pinned_host_gib, SEQPAR_PINNED_BUDGET_GIB), or check the locked-memory limit (ulimit -l)"
            ) from None
        HostOffload.held += nbytes
        return buf

    def give(self, buf: Tensor) -> None:
        self.free[buf.numel()].append(buf)

    def reclaim(self, need: int) -> int:
        """Unpin idle blocks, largest first, until ``need`` bytes of the pinned budget are free again or none is idle;
        returns the bytes given back. Blocks are kept by exact size, so without this a token count that changes between
        steps (padding-free batches, packing, an epoch's short last batch) would leave the old sizes' blocks holding the
        budget for good, and every later keep (and the checkpoint offload, which shares the budget) would be refused.
        A copy into or out of an idle block may still be queued (a dropped entry's copy out on the side stream, a
        take's copy back on the main stream): the devices that ran such copies finish them first."""
        from torch.cuda._pin_memory_utils import unpin_memory

        idle = sorted((n for n, blocks in self.free.items() for _ in blocks), reverse=True)
        if not idle or need <= 0:
            return 0
        for device in list(_SIDE):
            torch.cuda.synchronize(device)
        freed = 0
        for n in idle:
            if freed >= need:
                break
            buf = self.free[n].pop()
            unpin_memory(buf.data_ptr())
            offload.HostOffload.held -= n
            freed += n
        return freed


_POOL = _Pool()


def _reclaim(need: int) -> int:
    return _POOL.reclaim(need)  # the pool of the moment (tests give the module a pool of their own)


offload.RECLAIMERS.append(_reclaim)  # the checkpoint offload shares the budget: it may ask for the idle blocks too


class _Entry:
    """One kept matmul output: on the GPU (``gpu``) or in a host block (``host``) with the events ordering its copies.
    ``op`` and ``shape`` let the recomputation check it is handed the output of the same call."""

    __slots__ = ("gpu", "host", "op", "shape", "dtype", "device", "copied", "ready", "version", "release", "__weakref__")

    def __init__(self, func, t: Tensor, host: bool, budget_gib: float | None = None):
        self.op, self.shape, self.dtype, self.device = func, tuple(t.shape), t.dtype, t.device
        self.gpu = self.host = self.copied = self.ready = self.version = self.release = None
        if not host:
            self.gpu = _detach(t)  # shares t's version counter: an in-place change after the forward shows at take()
            self.version = self.gpu._version
            return
        if t.device.type != "cuda":  # CPU tensors (tests): a plain copy stands for the host block
            self.host = t.detach().clone()
            return
        buf = _POOL.take(t.numel() * t.element_size(), budget_gib)
        if buf is None:
            return  # over the pinned budget: recomputed in backward
        # the block goes back to the pool once this entry is taken, dropped or forgotten (a forward without backward)
        self.release = weakref.finalize(self, _POOL.give, buf)
        self.host = buf.view(t.dtype).view(t.shape)
        side = _side(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            self.host.copy_(t.detach(), non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(side)
        t.record_stream(side)  # its block is not reused before the copy has read it

    @property
    def kept(self) -> bool:
        return self.gpu is not None or self.host is not None

    def _free(self) -> None:
        self.gpu = self.host = None
        if self.release is not None:
            self.release()

    def drop(self) -> int:
        """Forget the kept output (its matmul is recomputed instead); returns its bytes. A copy out still running only
        delays the block's next use: later copies into it queue behind it on the side stream."""
        self._free()
        return math.prod(self.shape) * self.dtype.itemsize

    def prefetch(self) -> None:
        """Start the copy back on the side stream (backward, one layer ahead)."""
        if self.host is None or self.gpu is not None or self.device.type != "cuda":
            return
        main, side = torch.cuda.current_stream(self.device), _side(self.device)
        gpu = torch.empty(self.shape, dtype=self.dtype, device=self.device)  # allocated in the main stream's order
        side.wait_stream(main)
        with torch.cuda.stream(side):
            gpu.copy_(self.host, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(side)
        gpu.record_stream(side)  # freed untaken (a forward without backward): not reused before the copy is done
        self.gpu = gpu

    def take(self) -> Tensor:
        """The kept output on the GPU, for the recomputation (waits for its copy back; copies it now if none started)."""
        if self.host is not None and self.device.type == "cuda":
            main = torch.cuda.current_stream(self.device)
            if self.gpu is None:
                main.wait_event(self.copied)
                self.gpu = self.host.to(self.device, non_blocking=True)
            else:
                main.wait_event(self.ready)
        elif self.host is not None:
            self.gpu = self.host
        elif self.version is not None and self.gpu._version != self.version:
            raise RuntimeError(
                "a kept matmul output was modified in place after the forward kept it, so the recomputation would "
                "see the modified values; use kept_saves all for this model (seqpar kept_saves matmuls)"
            )
        out = self.gpu
        self._free()  # the host block: later copies into it queue behind this one's (the side stream, or the main
        return out  # stream that each copy out waits for)


class _Forward:
    """One forward of one layer: its kept matmul outputs in call order (None where the matmul is recomputed)."""

    def __init__(self, keeper: MatmulKeep):
        self.keeper = keeper
        self.ops: list = []  # every eligible matmul's op, kept or not, in call order
        self.entries: list[_Entry | None] = []
        self.next = 0  # the recomputation's position
        self.storages: dict[int, tuple[int, StorageWeakRef]] = {}  # storage address -> (entry index, its storage)
        self.prefetched = False
        self.last_out = None  # (device, event) of its newest copy out to host memory (CUDA), for _pace

    @property
    def pending(self) -> bool:
        return self.next < len(self.entries)

    def keep(self, func, out: Tensor) -> None:
        host = self.keeper.host
        e = _Entry(func, out, host, self.keeper.pinned_budget_gib)
        if e.kept:
            storage = out.untyped_storage()
            self.storages[storage.data_ptr()] = (len(self.entries), StorageWeakRef(storage))
        self.ops.append((func, tuple(out.shape)))
        self.entries.append(e if e.kept else None)
        if e.copied is not None:
            self.last_out = (e.device, e.copied)
        MatmulKeep.stats[("host" if host else "gpu") if e.kept else "recomputed"] += out.numel() * out.element_size()

    def written(self, func, args, kwargs) -> None:
        """An op that writes into a tensor in place: a kept output it writes into is dropped (its matmul is recomputed
        in backward instead), so the recomputation never sees the changed values."""
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else (kwargs or {}).get(a.name)
            if not torch.is_tensor(t):
                continue
            hit = self.storages.get(t.untyped_storage().data_ptr())
            if hit is not None and not hit[1].expired() and self.entries[hit[0]] is not None:
                e, self.entries[hit[0]] = self.entries[hit[0]], None
                nbytes = e.drop()
                MatmulKeep.stats["host" if self.keeper.host else "gpu"] -= nbytes
                MatmulKeep.stats["recomputed"] += nbytes

    def take(self, func, args) -> _Entry | None:
        """The entry of this recomputed matmul, checked against the forward's call at the same position."""
        if not self.pending:
            raise RuntimeError(
                f"{func} recomputed in backward beyond the matmuls the layer's forward kept: the layer's forward "
                "must run the same matmuls each time (seqpar kept_saves matmuls)"
            )
        if self.ops[self.next] != (func, _mm_shape(func, args)):
            raise RuntimeError(
                f"the recomputation's matmul {self.next} is {func} -> {_mm_shape(func, args)}, but the forward's was "
                f"{self.ops[self.next][0]} -> {self.ops[self.next][1]}: the layer's forward must run the same matmuls "
                "each time (seqpar kept_saves matmuls)"
            )
        e, self.entries[self.next] = self.entries[self.next], None
        self.next += 1
        return e

    def prefetch(self) -> None:
        if not self.prefetched:
            self.prefetched = True
            for e in self.entries[self.next :]:
                if e is not None:
                    e.prefetch()


class _Store(TorchDispatchMode):
    """The first forward: keep each eligible matmul's output (on the GPU, or copied to host memory)."""

    def __init__(self, fwd: _Forward):
        super().__init__()
        self.fwd = fwd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.fwd.storages and func._schema.is_mutable:
            self.fwd.written(func, args, kwargs)
        out = func(*args, **(kwargs or {}))
        if func in _MM and not self.fwd.keeper.skip.on and torch.is_tensor(out):
            self.fwd.keep(func, out)
        return out


class _Replay(TorchDispatchMode):
    """The recomputation in backward: hand the kept outputs back in the same order, run everything else."""

    def __init__(self, fwd: _Forward):
        super().__init__()
        self.fwd = fwd

    def __enter__(self):
        # each recomputation walks the kept outputs from the start: a second backward (retain_graph) finds them
        # taken (None) and runs the matmuls again
        self.fwd.next = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MM and not self.fwd.keeper.skip.on:
            e = self.fwd.take(func, args)
            if e is not None:
                return e.take()
        return func(*args, **(kwargs or {}))


_LAST_OUT: dict[torch.device, torch.cuda.Event] = {}  # per device: the newest copy out of the host-kept forward before


def _pace(fwd: _Forward) -> None:
    """Keep the host within one host-kept layer of its copies out: once a host-kept layer's forward is queued, wait
    until the previous host-kept layer's copies out have run.

    Each copy out reads its matmul output after the GPU has made it, and the output's block goes back to the caching
    allocator only when the copy has run (record_stream). The host queues kernels far ahead of the GPU (a layer's
    forward is queued in milliseconds and runs for 50-100 ms at 32K-64K tokens), so unpaced, the blocks of every output
    queued but not yet copied stay out of reach: at the edge of GPU memory the allocator then frees its whole cache,
    which waits for every pending copy, the host blocked and then the GPU idle while the queue refills (profiled in
    BENCHMARKS.md, "Host copies of kept matmul outputs, profiled"). Paced, at most about two host-kept layers' outputs are pending, and the GPU still has a layer's work queued while
    the host waits."""
    if fwd.last_out is None:
        return
    device, event = fwd.last_out
    previous = _LAST_OUT.get(device)
    _LAST_OUT[device] = event
    if previous is not None:
        previous.synchronize()


def _prefetch(ref: weakref.ref) -> None:
    """Start copying back the host-kept outputs of the forward ``ref`` names, if its backward has not run yet."""
    fwd = ref()
    if fwd is not None and fwd.pending:
        fwd.prefetch()


class MatmulKeep:
    """The checkpoint function of one decoder layer under ``kept_saves: matmuls`` (its ``_gradient_checkpointing_func``).

    ``host``: the kept outputs wait in host memory; ``previous``: the MatmulKeep of the layer before, whose host-kept
    outputs this layer's backward fetches back ahead of time; ``pinned_budget_gib``: the process's page-locked budget
    (seqpar.runtime.memory.offload.pinned_budget; None = its default)."""

    stats: collections.Counter = collections.Counter()  # bytes kept on the GPU / in host memory / recomputed since import

    def __init__(self, layer: nn.Module, host: bool, previous: MatmulKeep | None = None, pinned_budget_gib: float | None = None):
        self.host, self.previous, self.pinned_budget_gib = host, previous, pinned_budget_gib
        self.skip = _Skip()
        self.forwards: collections.deque[weakref.ref] = collections.deque()  # forwards awaiting their backward
        # the modeling module whose RoPE the layer calls: read now, while the layer still has its own class (FSDP2
        # swaps it for a generated one)
        self.modeling = sys.modules.get(type(layer).__module__)
        self.handles = []  # its hooks on the layer's modules (remove() takes them off)
        down = _skipped(layer)
        if down is not None:
            self.handles.append(down.register_forward_pre_hook(lambda *_: setattr(self.skip, "on", True)))
            self.handles.append(down.register_forward_hook(lambda *_: setattr(self.skip, "on", False), always_call=True))
        for name in ("q_proj", "k_proj"):  # what RoPE rotates; an in-place RoPE gets a copy (module docstring)
            for m in layer.modules():
                proj = getattr(m, name, None)
                if isinstance(proj, nn.Module):
                    self.handles.append(proj.register_forward_hook(lambda m, a, out: _copy_for_rope(self, out)))

    def remove(self) -> None:
        """Take this layer's hooks off (seqpar.apply again replaces the layer's checkpoint function)."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def _contexts(self, fwd: _Forward):
        return _Store(fwd), _Replay(fwd)

    def __call__(self, function, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        kwargs.pop("use_reentrant", None)
        if not torch.is_grad_enabled() or _in_backward():
            return function(*args, **kwargs)
        fwd = _Forward(self)
        out = checkpoint(function, *args, use_reentrant=False, context_fn=partial(self._contexts, fwd), **kwargs)
        if self.host:
            _pace(fwd)
        while self.forwards and self.forwards[0]() is None:  # forwards whose backward has run
            self.forwards.popleft()
        self.forwards.append(weakref.ref(fwd))
        if self.previous is not None and self.previous.host and self.previous.forwards:
            first = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(first) and first.requires_grad:
                # the layer below ran just before this layer in the same model forward: its newest forward is the one
                # this output's gradient leads back to, whichever of several pending forwards (micro-batches whose
                # backwards run oldest first) that gradient belongs to
                below = self.previous.forwards[-1]
                first.register_hook(lambda g: (_prefetch(below), None)[1])
        # the forward's entries live as long as its recomputation may need them: the checkpoint's frame holds the
        # contexts (and so ``fwd``) until backward has run
        return out
