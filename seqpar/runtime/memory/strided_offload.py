"""Checkpoint offload under ``offload_stride`` k > 1: of the offloaded layers, only every k-th (the first, then every k-th:
the "heads") sends its input to host memory; the layers between ("derived") keep no input at all. A derived layer's
checkpoint saves a recipe in place of its input (saved_tensors_hooks: pack returns it when the input is exactly the
output of the layer before as recorded in this forward, or a view of all of it); in backward, when its recomputation
asks for the input, the recipe runs the layers between the nearest head below and it forward again under no_grad, each
with the RNG and autocast state of its original forward (what reentrant torch.utils.checkpoint restores with
preserve_rng_state), so dropout masks and every value are the original forward's bit for bit. The inputs made on the way
wait on the device until their own layer's backward takes them: each layer of a group of k runs at most once more (k - 1
more layer forwards per group), and at most k - 1 layer inputs of the group are on the device at once (a checkpoint
nested in a checkpoint, the recursion of Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"). Host memory
for the inputs divides by k. Every rank runs the same recomputation at the same point of backward (a derived layer's
unpack), so the collectives a sequence-parallel layer runs inside its forward stay in step. An input that is not the
layer before's output (another module between the layers, a forward that skips a layer) is offloaded as a head's is:
exact, only without the saving. Under FSDP2 a layer run again is unsharded around that forward (its parameters are
resharded after its own forward); under DeepSpeed ZeRO-3 its submodules' hooks gather theirs, as in any recomputation.
Each forward's records belong to that forward's graph (the recipes and the heads' host copies hold them): a new forward
starts new records at the first layer, a forward without grad records nothing, and the records go when the graph goes.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from seqpar.runtime.memory.offload import HostOffload, from_host, pinned_budget, to_host


class OffloadChain:
    """What the offloaded layers of one model share under offload_stride > 1: the records of the forward in progress
    (held weakly: that forward's graph owns them)."""

    def __init__(self, stride: int):
        self.stride = stride
        self._current: Callable[[], _Pass | None] = lambda: None

    def begin(self) -> _Pass:
        """New records: the first offloaded layer starts each forward (a micro-batch, a step)."""
        run = _Pass()
        self._current = weakref.ref(run)
        return run

    def current(self) -> _Pass | None:
        return self._current()


class StridedOffload:
    """The checkpoint function (``_gradient_checkpointing_func``) of offloaded decoder layer ``index`` under
    offload_stride > 1: reentrant torch.utils.checkpoint, its input to host memory (a head: ``index`` a multiple of the
    stride) or left to a recipe (a derived layer); see the module docstring. ``pinned_budget_gib``: as
    seqpar.runtime.memory.activation_checkpoint's offload (None = ``pinned_budget``'s default)."""

    # since import: layer inputs sent to host memory ("host"; "fallback" of them: derived layers whose input was not
    # the layer before's output), left to a recipe ("recomputed"), and the layer forwards run to rebuild them ("forwards")
    stats: collections.Counter = collections.Counter()

    def __init__(self, chain: OffloadChain, index: int, pinned_budget_gib: float | None = None):
        self.chain, self.index, self.pinned_budget_gib = chain, index, pinned_budget_gib

    @property
    def head(self) -> bool:
        return self.index % self.chain.stride == 0

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        kwargs.pop("use_reentrant", None)
        budget = pinned_budget(self.pinned_budget_gib)
        if not torch.is_grad_enabled():  # no backward: nothing saved, nothing to record
            with HostOffload(budget):
                return checkpoint(function, *args, use_reentrant=True, **kwargs)
        run = self.chain.begin() if self.index == 0 else self.chain.current()
        x = args[0] if args and isinstance(args[0], Tensor) else None
        # a link of the chain: the hidden state is the only tensor argument (transformers' layers pass the rest by name)
        rec = None
        if run is not None and x is not None and not any(isinstance(a, Tensor) for a in args[1:]):
            rec = _Record(function, args, kwargs.get("preserve_rng_state", True))
        derived = rec is not None and not self.head and run.continues(self.index, x)

        def pack(t: Tensor) -> Any:
            if t is x and derived:
                StridedOffload.stats["recomputed"] += 1
                rec.derived = True
                return _Recipe(run, self.index)
            packed = to_host(t, budget)
            if t is x and rec is not None:
                StridedOffload.stats["host"] += 1
                if not self.head:
                    StridedOffload.stats["fallback"] += 1
                held = _Held(run, packed)
                rec.held = weakref.ref(held)
                return held
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = checkpoint(function, *args, use_reentrant=True, **kwargs)
        # torch keeps the pack hook beside each tensor it packed, until backward: its closure must not keep the input
        x = None
        if run is not None:
            run.add(self.index, rec, out)
        return out


class _Record:
    """One offloaded layer's call in a forward: what running it again needs (its function, the arguments after the
    hidden state, the RNG and autocast state reentrant checkpointing records), where its input waits (``held``: a head's
    host copy; ``derived``: rebuilt from the layer before) and what it returned (``out``: a weak reference to its storage, its
    place there and its version then)."""

    def __init__(self, function: Callable, args: tuple, preserve_rng_state: bool):
        from torch.utils.checkpoint import _get_autocast_kwargs, _get_device_module, _infer_device_type, get_device_states

        self.function, self.rest = function, args[1:]
        self.device_type = _infer_device_type(*args)
        self.device_autocast, self.cpu_autocast = _get_autocast_kwargs(self.device_type)
        self.cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self.devices: list[int] = []
        self.device_rng: list[Tensor] = []
        if preserve_rng_state and getattr(_get_device_module(self.device_type), "_initialized", False):
            self.devices, self.device_rng = get_device_states(*args)
        self.held: Callable[[], _Held | None] | None = None  # a weak reference to the head's saved host copy
        self.derived = False  # its input left to a recipe: the previous record's output
        self.out: tuple[StorageWeakRef, tuple, int] | None = None  # the output's storage, geometry and version

    def returned(self, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) and out else out
        if isinstance(hidden, Tensor):
            self.out = (StorageWeakRef(hidden.untyped_storage()), _geometry(hidden), hidden._version)

    def produced(self, x: Tensor) -> bool:
        """Whether ``x`` is this call's output, unchanged: the same elements of the same storage, its version counter
        where it was (the output itself, or a view of all of it: FSDP2's and DeepSpeed ZeRO-3's module hooks hand the
        next layer such a view, and may drop the output object itself)."""
        if self.out is None:
            return False
        storage, geometry, version = self.out
        return (
            not storage.expired()
            and x._version == version
            and StorageWeakRef(x.untyped_storage()) == storage
            and _geometry(x) == geometry
        )

    def run(self, x: Tensor) -> Tensor:
        """The layer's output for input ``x`` again, as its forward made it: no grad, its RNG and autocast state."""
        from torch.utils.checkpoint import set_device_states

        preserve = self.cpu_rng is not None
        with torch.random.fork_rng(devices=self.devices, enabled=preserve, device_type=self.device_type):
            if preserve:
                torch.set_rng_state(self.cpu_rng)
                if self.devices:
                    set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            device_autocast = (
                torch.amp.autocast(self.device_type, **self.device_autocast)
                if self.device_autocast is not None
                else contextlib.nullcontext()
            )
            with torch.no_grad(), device_autocast, torch.amp.autocast("cpu", **self.cpu_autocast):
                with _unsharded(_layer_of(self.function)):
                    out = self.function(x, *self.rest)
        StridedOffload.stats["forwards"] += 1
        return out[0] if isinstance(out, tuple) else out


class _Pass:
    """One forward's records, by layer index, and the inputs its backward has rebuilt ahead of their layer's."""

    def __init__(self) -> None:
        self.records: dict[int, _Record] = {}
        self.last: int | None = None  # the index of the latest call; None after a call that cannot be a link
        self.cache: dict[int, Tensor] = {}

    def continues(self, index: int, x: Tensor) -> bool:
        """Whether ``x``, the input of layer ``index``, is the output of the call just before, of layer index - 1."""
        prev = self.records.get(index - 1)
        return self.last == index - 1 and prev is not None and prev.produced(x)

    def add(self, index: int, rec: _Record | None, out: Any) -> None:
        if rec is None:
            self.last = None
            return
        rec.returned(out)
        self.records[index], self.last = rec, index

    def input_of(self, index: int) -> Tensor:
        """Layer ``index``'s input, for its backward: rebuilt by running the layers from the nearest input below that is
        at hand (one rebuilt earlier, or a head's host copy) up to it; the inputs made on the way are kept for their own
        layer's backward, which takes them (each layer runs again at most once)."""
        if index in self.cache:
            return self.cache.pop(index)
        start = index - 1
        while start not in self.cache and self.records[start].derived:
            start -= 1
        if start in self.cache:
            x = self.cache[start]
        else:
            held = self.records[start].held() if self.records[start].held is not None else None
            if held is None:
                raise RuntimeError(
                    f"offload_stride: layer {index}'s input is rebuilt from layer {start}'s, which is no longer held "
                    "(its backward has run already); backward must run the layers last to first"
                )
            x = from_host(held.packed)
        for i in range(start, index):
            x = self.records[i].run(x)
            if i + 1 < index:
                self.cache[i + 1] = x
        return x


class _Recipe:
    """What a derived layer's checkpoint saves in place of its input: the forward's records and the layer's index."""

    __slots__ = ("run", "index")

    def __init__(self, run: _Pass, index: int):
        self.run, self.index = run, index


class _Held:
    """What a head's checkpoint saves: its input's host copy (``to_host``), and the forward's records, kept while the
    graph holds this."""

    __slots__ = ("run", "packed", "__weakref__")

    def __init__(self, run: _Pass, packed: Any):
        self.run, self.packed = run, packed


def _geometry(t: Tensor) -> tuple:
    return (t.storage_offset(), t.size(), t.stride(), t.dtype, t.device)


def _unpack(packed: Any) -> Tensor:
    if isinstance(packed, _Recipe):
        return packed.run.input_of(packed.index)
    return from_host(packed.packed if isinstance(packed, _Held) else packed)


def _layer_of(function: Callable) -> nn.Module | None:
    """The module a transformers layer checkpoint runs: partial(forward, layer, **kwargs) (5.x) or a partial of the
    layer's bound __call__ (4.x)."""
    if isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], nn.Module):
            return function.args[0]
        function = function.func
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


@contextlib.contextmanager
def _unsharded(layer: nn.Module | None):
    """An FSDP2 layer's parameters all-gathered for a forward its hooks do not see (then sharded again, as its own
    forward leaves them); anything else as it is."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed
        FSDPModule = None
    if FSDPModule is None or not isinstance(layer, FSDPModule):
        yield
        return
    layer.unshard()
    try:
        yield
    finally:
        layer.reshard()
