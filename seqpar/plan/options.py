"""Names and defaults of plan options that the schema, the advisor and the runtime all read, stated once and dependency-free.

The schema builds its ``Literal`` types from these tuples; the runtime maps each name to what applies it
(``seqpar.runtime.memory.activation_checkpoint.POLICIES`` for checkpointing). Modes have their own table (seqpar.plan.modes). The
training checkpoints' defaults (how many are kept, the interval) are here too: the trainer applies them and
``seqpar explain`` states them, from the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

CHECKPOINTING: tuple[str, ...] = ("none", "full", "offload", "selective")

# What the layers past checkpoint_layers keep for backward (the plan's kept_saves): all = every activation, nothing
# recomputed; matmuls = the matmul outputs and attention's out + lse, the elementwise ops recomputed
# (seqpar.runtime.memory.matmul_keep).
KEPT_SAVES: tuple[str, ...] = ("all", "matmuls")


# Share of the host's physical RAM the offloaded checkpoints may hold page-locked (split between the node's ranks):
# seqpar.runtime.memory.offload pins within it, the time model prices what lies beyond it as pageable copies.
PINNED_FRACTION = 0.4


def pinned_block(nbytes: float) -> int:
    """Bytes PyTorch's caching host allocator takes for a pinned tensor of ``nbytes``: the next power of two."""
    return 1 << max(int(nbytes) - 1, 0).bit_length()


@dataclass(frozen=True)
class LayerSplit:
    """How a plan's decoder layers divide between what backward needs of them, first layer first:
    ``host`` checkpointed layers whose input waits in host memory (offload), then ``gpu`` checkpointed layers whose input
    (and, under selective, attention's out + lse) stays on the GPU, then ``kept`` layers that keep every activation and
    are not recomputed (memory-budget checkpointing; Megatron's recompute_num_layers with the block method and its
    cpu_offloading_num_layers). ``matmuls``: the kept layers keep only their matmul outputs and attention's out + lse
    (kept_saves matmuls), ``kept_host`` of them in host memory, spread evenly over the kept layers (``host_kept``).
    ``stride`` (offload_stride): of the ``host`` layers only every ``stride``-th input waits in host memory
    (``host_inputs``); backward recomputes the others' (``recomputed_inputs``)."""

    host: int
    gpu: int
    kept: int
    matmuls: bool = False
    kept_host: int = 0
    stride: int = 1  # offload_stride: of the ``host`` layers, one in every ``stride`` sends its input to host memory

    @property
    def host_inputs(self) -> int:
        """Layer inputs waiting in host memory: the first offloaded layer's and every ``stride``-th after it."""
        return -(-self.host // self.stride)

    @property
    def recomputed_inputs(self) -> int:
        """Offloaded layers whose input backward recomputes from the nearest host-held one below (one more forward each)."""
        return self.host - self.host_inputs

    @property
    def rebuilt_groups(self) -> int:
        """Host-held inputs with layers above them in their group whose input backward rebuilds from it: each is
        copied back twice (for the rebuild, then for its own layer's backward); 0 without a stride."""
        if self.stride == 1:
            return 0
        return sum(1 for j in range(0, self.host, self.stride) if j + 1 < self.host)

    @property
    def recomputed(self) -> int:
        """Layer forwards backward runs again: each checkpointed layer's, and once more each layer's whose input it
        recomputes (offload_stride)."""
        return self.checkpointed + self.recomputed_inputs

    @property
    def kept_gpu(self) -> int:
        return self.kept - self.kept_host

    @property
    def checkpointed(self) -> int:
        return self.host + self.gpu

    @property
    def host_kept(self) -> tuple[int, ...]:
        """The layers (0 = the first decoder layer) whose kept matmul outputs wait in host memory: spread evenly over
        the kept layers, the first kept layer first, so that each one's copies (out in forward, back one layer ahead in
        backward) run under the compute of the GPU-kept layers between them, and the top kept layer stays on the GPU
        while any does (backward starts there, with nothing below it fetched yet). Copying a layer's matmul outputs out
        over PCIe takes about as long as that layer's forward: back to back, the copies out would fall behind the
        forward and hold its GPU memory longer."""
        k, n = self.kept, self.kept_host
        return tuple(self.checkpointed + j * k // n for j in range(n)) if n else ()


@lru_cache(maxsize=4096)  # pure, and the advisor's search asks it ~14,000 times for a few hundred distinct splits
def layer_split(
    checkpointing: str,
    num_layers: int,
    checkpoint_layers: int | None = None,
    offload_layers: int | None = None,
    kept_saves: str = "all",
    kept_host_layers: int = 0,
    offload_stride: int = 1,
) -> LayerSplit:
    """The split a plan's ``checkpointing``, ``checkpoint_layers`` (None = all), ``offload_layers`` (None = all the
    checkpointed ones, offload only), ``kept_saves``, ``kept_host_layers`` and ``offload_stride`` describe for a model of ``num_layers``
    decoder layers. Assumes a valid plan (seqpar.plan.rules.plan_problems refuses the rest); counts are clipped to the model
    so a plan for a deeper model stays safe."""
    if checkpointing == "none":
        return LayerSplit(0, 0, num_layers)
    ck = num_layers if checkpoint_layers is None else min(checkpoint_layers, num_layers)
    host = 0
    if checkpointing == "offload":
        host = ck if offload_layers is None else min(offload_layers, ck)
    kept = num_layers - ck
    matmuls = kept_saves == "matmuls" and kept > 0
    kept_host = min(kept_host_layers or 0, kept) if matmuls else 0
    return LayerSplit(host, ck - host, kept, matmuls, kept_host, max(offload_stride or 1, 1) if host else 1)


# Training checkpoints kept by default (--keep-last): the newest and the one before it, so a damaged newest still
# leaves one to resume from. The CLI's help and the trainer read it.
KEEP_LAST = 2

# The default checkpoint interval (training.checkpoint_every None): about an hour of training between checkpoints, so a
# failure loses at most about an hour; from the predicted step time (seqpar explain shows it), else the measured one.
HOURLY_S = 3600.0


def hourly(step_time_s: float) -> int:
    """Steps between checkpoints for about an hour at ``step_time_s`` per step (at least 1)."""
    return max(1, round(HOURLY_S / step_time_s)) if step_time_s > 0 else 1


def interval(every: int | str | None, step_time_s: float | None, steps: int | None = None) -> tuple[int | None, str]:
    """(steps between checkpoints, why) for ``training.checkpoint_every`` (or --checkpoint-every) ``every``: an int K
    (0 = only at the end), or None / "auto" = about hourly at ``step_time_s`` (the predicted step time); None steps
    when there is none yet (the trainer then decides from the first measured steps). ``steps``: the run's steps, so
    that an interval past them reads as what it means (only the final checkpoint)."""
    if isinstance(every, int):
        if every == 0:
            return every, "only at the end (checkpoint_every 0)"
        if steps is not None and every >= steps:
            return every, f"only at the end (every {every} steps, and the run has {steps})"
        return every, f"every {every} steps"
    if step_time_s:
        n = hourly(step_time_s)
        if steps is not None and n >= steps:
            return n, (
                f"only at the end: {steps} steps at the predicted {step_time_s:.3g} s per step take less than the hour "
                "between checkpoints"
            )
        return n, f"every {n} steps: about hourly at the predicted {step_time_s:.3g} s per step"
    return None, "about hourly, from the measured step time (the plan has no predicted step time)"


def kept(override: int | None, planned: int | None) -> int:
    """Checkpoints kept: --keep-last when given, else the plan's training.keep_last, else KEEP_LAST (0 = all)."""
    return override if override is not None else planned if planned is not None else KEEP_LAST


__all__ = [
    "CHECKPOINTING",
    "HOURLY_S",
    "KEEP_LAST",
    "PINNED_FRACTION",
    "LayerSplit",
    "pinned_block",
    "hourly",
    "interval",
    "kept",
    "layer_split",
]
