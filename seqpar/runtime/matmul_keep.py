"""Kept layers that keep only their matmul outputs (the plan's ``kept_saves: matmuls``), on the GPU or in host memory.

A decoder layer that keeps every activation (memory-budget checkpointing's kept layers) holds about 8 tensors of
(tokens, width) for backward, but only the matmul outputs are expensive to make again: the norms, RoPE and the SwiGLU
product are elementwise passes. Op-level selective activation checkpointing (torchtitan's "op" SAC policy)
checkpoints the layer and keeps the outputs of its matmuls, so backward's recomputation runs only the elementwise ops; attention's out + lse are kept as under
``selective`` (seqpar.runtime.selective), so its forward does not run again either. For Llama-2-7B that is 4.7 of the
7.0 GiB a fully kept layer holds at 64K tokens, for the same matmul time saved.

What is kept, per layer: the layer input (the checkpoint's), attention's out + lse, and every ``aten.mm``/``aten.addmm``
output except those of the layer's last linear (the MLP's down projection: nothing in the layer's backward needs its
output, and checkpointing's early stop never recomputes it). The matmuls run inside a forward pre/post hook pair on that
module, which tells the policy to skip them. The mechanism is torch.utils.checkpoint's selective checkpointing (a
TorchDispatchMode pair passed as ``context_fn``: one stores outputs during the forward, one hands them back in the
recomputation); its own pair (``create_selective_checkpoint_contexts``) keeps them on the device, so seqpar has its
own, which can also keep them in host memory. An aten op that writes in place into a kept output during the forward
(the layer's own code scaling a projection, say) drops it: that matmul is recomputed, so the result stays exact; and an
output whose version counter moved anyway is refused in backward.

``host``: the kept matmul outputs wait in page-locked host memory instead (``kept_host_layers``): each is copied out on a
side stream as soon as it is computed, and comes back one layer ahead in backward (the copy starts when the
gradient reaches the next layer's output, i.e. when that layer's backward begins), so the copies overlap compute. The
buffers come from a pool of exact-size page-locked blocks (cudaHostRegister: no power-of-two rounding) that later
steps reuse; a matmul whose block would exceed the pinned budget (seqpar.runtime.offload.pinned_budget, shared with the
checkpoint offload) is recomputed instead: exact, only slower (``MatmulKeep.stats`` counts both).

Liger's RoPE rotates q and k in place, which would rotate a kept q_proj / k_proj output twice (once in forward, once in
the recomputation): in these layers those projections hand RoPE a copy (a forward hook), when the model's RoPE is a
fused one (seqpar.runtime.fused.rotates_in_place).

Exactness: the recomputation is the same forward with the matmul results handed back, so the saved tensors are the
first forward's bit for bit (tests/test_matmul_keep.py compares loss and every gradient with fully kept layers).
"""

from __future__ import annotations

import collections
import math
import weakref
from functools import partial

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

_MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _last_linear(layer: nn.Module) -> nn.Module | None:
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def _copy_for_rope(layer: nn.Module, module, args, out):
    """q_proj / k_proj's output, copied when the model's RoPE rotates it in place (its kept original stays unrotated)."""
    from seqpar.runtime.fused import rotates_in_place

    return out.clone() if torch.is_tensor(out) and out.is_cuda and rotates_in_place(layer) else out


class _Skip:
    """Set while the layer's last linear runs: its matmul output is not kept."""

    __slots__ = ("on",)

    def __init__(self):
        self.on = False


class _Pool:
    """Page-locked host blocks of exact sizes, reused across steps; one per process."""

    def __init__(self):
        self.free: dict[int, list[Tensor]] = collections.defaultdict(list)
        self.registered = 0  # bytes page-locked by this pool (counted in HostOffload.held too)

    def take(self, nbytes: int) -> Tensor | None:
        from seqpar.runtime.offload import HostOffload, pinned_budget

        if self.free[nbytes]:
            return self.free[nbytes].pop()
        if HostOffload.held + nbytes > pinned_budget():
            return None
        buf = torch.empty(nbytes, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(getattr(err, "value", err)) != 0:  # cudaSuccess == 0; fall back to the caching host allocator
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.registered += nbytes
        HostOffload.held += nbytes
        return buf

    def give(self, buf: Tensor) -> None:
        self.free[buf.numel()].append(buf)


_POOL = _Pool()


class _Entry:
    """One kept matmul output: on the GPU (``gpu``) or in a host block (``host``) with the events ordering its copies."""

    __slots__ = ("gpu", "host", "shape", "dtype", "device", "copied", "ready", "buf", "version")

    def __init__(self, t: Tensor, host: bool, side):
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.gpu = self.host = self.copied = self.ready = self.buf = None
        self.version = None
        if not host:
            self.gpu = t.detach()  # shares t's version counter: an in-place op on t shows at take()
            self.version = self.gpu._version
            return
        if t.device.type != "cuda":  # CPU tensors (tests): a plain copy stands for the host block
            self.host = t.detach().clone()
            return
        nbytes = t.numel() * t.element_size()
        self.buf = _POOL.take(nbytes)
        if self.buf is None:
            return  # over the pinned budget: recomputed in backward
        self.host = self.buf.view(t.dtype).view(t.shape)
        main = torch.cuda.current_stream(t.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.host.copy_(t.detach(), non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(side)
        t.record_stream(side)  # its block is not reused before the copy has read it

    @property
    def kept(self) -> bool:
        return self.gpu is not None or self.host is not None

    def drop(self) -> int:
        """Forget the kept output (its matmul is recomputed instead); returns its bytes. A copy out still running only
        delays the block's next use: later copies into it queue behind it on the side stream."""
        self.gpu = self.host = None
        if self.buf is not None:
            _POOL.give(self.buf)
            self.buf = None
        return math.prod(self.shape) * self.dtype.itemsize

    def prefetch(self, side) -> None:
        """Start the copy back on the side stream (backward, one layer ahead)."""
        if self.host is None or self.gpu is not None or self.device.type != "cuda":
            return
        main = torch.cuda.current_stream(self.device)
        gpu = torch.empty(self.shape, dtype=self.dtype, device=self.device)  # allocated in the main stream's order
        side.wait_stream(main)
        with torch.cuda.stream(side):
            gpu.copy_(self.host, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(side)
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
        out, self.gpu, self.host = self.gpu, None, None
        if self.buf is not None:  # later copies into it are queued after this one's read (same side stream, or
            _POOL.give(self.buf)  # the side stream waits for the main stream before each copy out)
            self.buf = None
        return out


class _Forward:
    """One forward of one layer: its kept matmul outputs in call order (None where the matmul is recomputed)."""

    def __init__(self, keeper: MatmulKeep):
        self.keeper = keeper
        self.entries: list[_Entry | None] = []
        self.next = 0  # the recomputation's position in entries
        self.storages: dict[int, tuple[int, StorageWeakRef]] = {}  # storage address -> (entry index, its storage)
        self.prefetched = False

    @property
    def pending(self) -> bool:
        return self.next < len(self.entries)

    def keep(self, out: Tensor) -> None:
        k = self.keeper
        e = _Entry(out, k.host, k.side(out.device) if k.host and out.is_cuda else None)
        nbytes = out.numel() * out.element_size()
        if e.kept:
            storage = out.untyped_storage()
            self.storages[storage.data_ptr()] = (len(self.entries), StorageWeakRef(storage))
        self.entries.append(e if e.kept else None)
        MatmulKeep.stats[("host" if k.host else "gpu") if e.kept else "recomputed"] += nbytes

    def written(self, func, args, kwargs) -> None:
        """An op that writes into a tensor in place: a kept output it writes into is dropped (its matmul is recomputed
        in backward instead), so the recomputation never sees the changed values."""
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else (kwargs or {}).get(a.name)
            if not torch.is_tensor(t):
                continue
            hit = self.storages.get(t.untyped_storage().data_ptr())
            if hit is not None and not hit[1].expired() and self.entries[hit[0]] is not None:
                e = self.entries[hit[0]]
                self.entries[hit[0]] = None
                nbytes = e.drop()
                MatmulKeep.stats["host" if self.keeper.host else "gpu"] -= nbytes
                MatmulKeep.stats["recomputed"] += nbytes

    def take(self) -> _Entry | None:
        e = self.entries[self.next]
        self.entries[self.next] = None
        self.next += 1
        return e

    def prefetch(self) -> None:
        if not self.prefetched:
            self.prefetched = True
            for e in self.entries[self.next :]:
                if e is not None and e.device.type == "cuda":
                    e.prefetch(self.keeper.side(e.device))


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
            self.fwd.keep(out)
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
            if not self.fwd.pending:
                raise RuntimeError(
                    f"{func} recomputed in backward beyond the matmuls the layer's forward kept: the layer's forward "
                    "must run the same matmuls each time (seqpar kept_saves matmuls)"
                )
            e = self.fwd.take()
            if e is not None:
                return e.take()
        return func(*args, **(kwargs or {}))


class MatmulKeep:
    """The checkpoint function of one decoder layer under ``kept_saves: matmuls`` (its ``_gradient_checkpointing_func``).

    ``host``: the kept outputs wait in host memory; ``previous``: the MatmulKeep of the layer before, whose host-kept
    outputs this layer's backward fetches back ahead of time."""

    stats: collections.Counter = collections.Counter()  # bytes kept on the GPU / in host memory / recomputed since import

    def __init__(self, layer: nn.Module, host: bool, previous: MatmulKeep | None = None):
        self.host, self.previous = host, previous
        self.skip = _Skip()
        self.forwards: collections.deque[weakref.ref] = collections.deque()  # forwards awaiting their backward
        self.streams: dict[torch.device, torch.cuda.Stream] = {}  # the side stream, made on the device of the first copy
        self.handles = []  # its hooks on the layer's modules (remove() takes them off)
        last = _last_linear(layer)
        if last is not None:
            self.handles.append(last.register_forward_pre_hook(lambda *_: setattr(self.skip, "on", True)))
            self.handles.append(last.register_forward_hook(lambda *_: setattr(self.skip, "on", False), always_call=True))
        for name in ("q_proj", "k_proj"):  # what RoPE rotates; a fused in-place RoPE gets a copy (module docstring)
            for m in layer.modules():
                proj = getattr(m, name, None)
                if isinstance(proj, nn.Module):
                    self.handles.append(proj.register_forward_hook(partial(_copy_for_rope, layer)))

    def remove(self) -> None:
        """Take this layer's hooks off (seqpar.apply again replaces the layer's checkpoint function)."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def side(self, device: torch.device):
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device=device)
        return self.streams[device]

    def _contexts(self, fwd: _Forward):
        return _Store(fwd), _Replay(fwd)

    def prefetch(self) -> None:
        """Copy back the host-kept outputs of this layer's newest forward that awaits backward."""
        while self.forwards:
            fwd = self.forwards[-1]()
            if fwd is not None and fwd.pending:
                fwd.prefetch()
                return
            self.forwards.pop()

    def __call__(self, function, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        kwargs.pop("use_reentrant", None)
        if not torch.is_grad_enabled() or _in_backward():
            return function(*args, **kwargs)
        fwd = _Forward(self)
        out = checkpoint(function, *args, use_reentrant=False, context_fn=partial(self._contexts, fwd), **kwargs)
        self.forwards.append(weakref.ref(fwd))
        if self.previous is not None and self.previous.host:
            first = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(first) and first.requires_grad:
                prev = self.previous
                first.register_hook(lambda g: (prev.prefetch(), None)[1])
        # the forward's entries live as long as its recomputation may need them: the checkpoint's frame holds the
        # contexts (and so ``fwd``) until backward has run
        return out
