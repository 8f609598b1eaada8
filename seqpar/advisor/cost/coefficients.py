"""The cost model's fitted and physical coefficients, and where they are loaded from.

``seqpar/profiles/coefficients.json`` (versioned; each value's source is in its ``sources``, refitted by fit.py and
``seqpar calibrate``) is read once and cached; ``SEQPAR_COEFFICIENTS`` or a path names another file. memory.py,
throughput.py, predict.py and fit.py all take a ``Coefficients``; this module imports none of them. Pure Python.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional

from seqpar.plan.errors import SeqparError
from seqpar.plan.files import read_json_object
from seqpar.plan.specs import ClusterSpec

COEFFICIENTS_PATH = Path(__file__).resolve().parents[2] / "profiles" / "coefficients.json"


@dataclass(frozen=True)
class Coefficients:
    """The cost model's few numbers; see coefficients.json for the source of each."""

    version: str
    linear_time_factor: float = 1.0  # measured / ideal time of the matmul part (launch gaps ride on it; norms, RoPE and SwiGLU
    # are throughput.elementwise_time, a fixed HBM-bandwidth term)
    attn_time_factor: float = 1.0  # measured / ideal time of the attention kernels
    attn_block_tokens: float = 2048.0  # n0 in eff(n) = eff_max * n / (n + n0), n = query length of one kernel call
    matmul_width_h0: float = 0.0  # h0 in the matmul efficiency h / (h + h0), h = hidden size (GEMM inner dimension)
    attn_head_dim_d0: float = 0.0  # d0 in the attention kernel efficiency d / (d + d0), d = head_dim (normalised at 128)
    elementwise_efficiency: float = 1.0  # achieved / datasheet HBM bandwidth of the norm, RoPE and SwiGLU kernels
    ring_overlap: float = 0.9  # share of a ring step's transfer hidden under that step's attention compute
    grad_comm_overlap: float = 0.8  # share of gradient all-reduce / ZeRO traffic hidden under backward
    comm_bandwidth_efficiency: float = 0.75  # NCCL bus bandwidth / datasheet link bandwidth
    offload_bandwidth_gb_s: float = 12.0  # effective host<->device bandwidth per GPU for offloaded states / checkpoints
    pinned_copy_gb_s: float = 55.0  # checkpointed layer inputs to and from pinned host memory, per direction
    side_copy_overlap: float = 0.93  # share of the host-kept matmul outputs' side-stream copies hidden under compute
    first_step_s: float = 0.76  # the first step's one-off costs beyond a warm step, without offload
    pinned_alloc_gib_s: float = 5.0  # page-locking the offload's pinned host blocks during the first step
    pinned_register_gib_s: float = 8.5  # page-locking the host-kept matmul outputs' blocks (touched, then cudaHostRegister)
    pageable_bandwidth_gb_s: float = 2.5  # checkpointed layer inputs beyond the pinned budget: synchronous pageable copies
    cpu_adam_gparams_per_s: float = 8.0  # CPU Adam throughput per node, 1e9 parameters per second
    allocator_reserve_fraction: float = 0.05  # the caching allocator's reserved - allocated at the peak, share of the peak,
    allocator_reserve_cap_gib: float = 4.0  # at most this (expandable segments: the gap does not grow with the peak)
    allocator_reserve_gib: float = 0.5
    cuda_context_gib: float = 0.55
    nccl_buffer_gib_per_group: float = 0.25
    driver_reserve_gib: float = 0.6  # NVML's total less what CUDA can reach, for a GPU without a measured or probed figure
    memory_margin_floor: float = 0.01  # the least margin over the predicted peak (seqpar.advisor.cost.margin)
    loss_chunk_tokens: int = 4096
    host_ram_usable_fraction: float = 0.9
    host_process_gib: float = 14.5  # host RSS of one CUDA training process before any offload (libraries, CUDA's host state)
    kernel_tflops: dict = field(default_factory=dict, hash=False, compare=False)
    time_factors: dict = field(default_factory=dict, hash=False, compare=False)  # GPU profile -> its fitted factors
    min_cudnn_capability: float = 9.0
    fitted: tuple[str, ...] = ()

    _VALUE_FIELDS = (
        "linear_time_factor",
        "attn_time_factor",
        "attn_block_tokens",
        "matmul_width_h0",
        "attn_head_dim_d0",
        "elementwise_efficiency",
        "ring_overlap",
        "grad_comm_overlap",
        "comm_bandwidth_efficiency",
        "offload_bandwidth_gb_s",
        "pinned_copy_gb_s",
        "side_copy_overlap",
        "pageable_bandwidth_gb_s",
        "first_step_s",
        "pinned_alloc_gib_s",
        "pinned_register_gib_s",
        "cpu_adam_gparams_per_s",
        "allocator_reserve_fraction",
        "allocator_reserve_cap_gib",
        "allocator_reserve_gib",
        "cuda_context_gib",
        "nccl_buffer_gib_per_group",
        "driver_reserve_gib",
        "memory_margin_floor",
        "loss_chunk_tokens",
        "host_ram_usable_fraction",
        "host_process_gib",
    )

    def with_values(self, **values: float) -> Coefficients:
        return replace(self, **values)

    def allocator_slack(self, peak: float) -> float:
        """Bytes the caching allocator reserves beyond the allocated peak: a share of it, capped, plus a constant."""
        return (
            min(peak * self.allocator_reserve_fraction, self.allocator_reserve_cap_gib * 2**30)
            + self.allocator_reserve_gib * 2**30
        )

    def values(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self._VALUE_FIELDS}

    # ---- time factors: the GPU's own (fitted on its rows) when it has them, else the global fit over all rows

    def factors(self, cluster: ClusterSpec) -> tuple[float, float]:
        """(linear_time_factor, attn_time_factor) for this GPU profile."""
        row = self.time_factors.get(cluster.gpu.name)
        if row:
            return float(row["linear_time_factor"]), float(row["attn_time_factor"])
        return self.linear_time_factor, self.attn_time_factor

    def factors_note(self, cluster: ClusterSpec) -> str:
        name = cluster.gpu.name
        return f"{name} factors" if name in self.time_factors else f"global factors, no {name} rows"

    # ---- kernel rates

    def attention_backend(self, cluster: ClusterSpec) -> str:
        cc = cluster.gpu.compute_capability
        return "cudnn" if cc is not None and float(cc) >= self.min_cudnn_capability else "flash"

    def kernel_rate_tflops(self, cluster: ClusterSpec, kernel: str) -> float:
        """Measured rate of ``kernel`` (matmul | cudnn | flash | efficient) on this GPU, else datasheet x default fraction."""
        row = self.kernel_tflops.get(cluster.gpu.name)
        if row and kernel in row:
            return float(row[kernel])
        frac = self.kernel_tflops.get("default_fraction", {}).get(kernel, 0.5)
        return float(frac) * cluster.gpu.bf16_tflops


# What a working cost model's values can be. A file outside these (a negative or zero factor, NaN, an overlap above 1) is
# forged or broken, and would move every prediction silently: it is refused, naming the file and the field.
# Time factors: measured / ideal time; `seqpar calibrate` clamps its fit to fit.BOUNDS (0.5-4), real GPUs land there too.
PLAUSIBLE = {
    "linear_time_factor": (0.1, 10.0),
    "attn_time_factor": (0.1, 10.0),
    "attn_block_tokens": (0.0, 1e6),
    "matmul_width_h0": (0.0, 1e6),
    "attn_head_dim_d0": (0.0, 1e4),
    "elementwise_efficiency": (0.01, 1.0),
    "ring_overlap": (0.0, 1.0),
    "grad_comm_overlap": (0.0, 1.0),
    "side_copy_overlap": (0.0, 1.0),
    "comm_bandwidth_efficiency": (0.01, 1.0),
    "offload_bandwidth_gb_s": (0.1, 1e4),
    "pinned_copy_gb_s": (0.01, 1e4),
    "pageable_bandwidth_gb_s": (0.01, 1e4),
    "first_step_s": (0.0, 3600.0),
    "pinned_alloc_gib_s": (0.01, 1e4),
    "pinned_register_gib_s": (0.01, 1e4),
    "cpu_adam_gparams_per_s": (0.01, 1e4),
    "allocator_reserve_fraction": (0.0, 0.9),
    "allocator_reserve_cap_gib": (0.0, 1024.0),
    "allocator_reserve_gib": (0.0, 1024.0),
    "cuda_context_gib": (0.0, 64.0),
    "nccl_buffer_gib_per_group": (0.0, 64.0),
    "driver_reserve_gib": (0.0, 64.0),
    "memory_margin_floor": (0.0, 1.0),
    "loss_chunk_tokens": (1, 1 << 30),
    "host_ram_usable_fraction": (0.01, 1.0),
    "host_process_gib": (0.0, 1024.0),
    "kernel_tflops": (0.001, 1e5),  # a measured kernel rate, TFLOP/s
    "default_fraction": (0.001, 1.0),  # of the datasheet peak
    "min_cudnn_capability": (0.0, 100.0),
}


def _number(where: str, v, key: str, origin: str) -> float:
    """``v`` as a float when it is a finite number within PLAUSIBLE[key]; SeqparError naming the file and field otherwise."""
    lo, hi = PLAUSIBLE[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi
    if not ok:
        raise SeqparError(
            f"coefficients file {origin}: {where} = {v!r} is not a number within [{lo:g}, {hi:g}]; "
            f"refit it with `seqpar calibrate -o FILE` (or unset SEQPAR_COEFFICIENTS to use the shipped ones)"
        )
    return float(v)


def _table(where: str, v, origin: str) -> dict:
    if not isinstance(v, dict):
        raise SeqparError(
            f"coefficients file {origin}: {where} holds a {type(v).__name__}, not an object; refit it with `seqpar calibrate -o FILE`"
        )
    return v


def coefficients_from_dict(data: dict, origin: str = "'seqpar/profiles/coefficients.json'") -> Coefficients:
    """Coefficients from a coefficients file's JSON, every number checked against PLAUSIBLE (``origin`` names the file)."""
    vals = dict(_table("values", data.get("values", {}), origin))
    # a file calibrated before the margin came from measured errors: its flat headroom has no use any more
    vals.pop("headroom_gib", None)
    known = set(Coefficients._VALUE_FIELDS)
    unknown = set(vals) - known
    if unknown:
        raise SeqparError(f"coefficients file {origin} has unknown values {sorted(unknown)}; known: {sorted(known)}")
    checked = {k: _number(f"values.{k}", v, k, origin) for k, v in vals.items()}
    if "loss_chunk_tokens" in checked:
        if checked["loss_chunk_tokens"] != int(checked["loss_chunk_tokens"]):
            raise SeqparError(f"coefficients file {origin}: values.loss_chunk_tokens must be a whole number of tokens")
        checked["loss_chunk_tokens"] = int(checked["loss_chunk_tokens"])
    kernels = _table("kernel_tflops", data.get("kernel_tflops", {}), origin)
    for gpu, row in kernels.items():
        key = "default_fraction" if gpu == "default_fraction" else "kernel_tflops"
        for k, v in _table(f"kernel_tflops.{gpu}", row, origin).items():
            if k != "source":
                _number(f"kernel_tflops.{gpu}.{k}", v, key, origin)
    factors = {k: v for k, v in _table("time_factors", data.get("time_factors", {}), origin).items() if isinstance(v, dict)}
    for gpu, row in factors.items():
        for k in ("linear_time_factor", "attn_time_factor"):
            _number(f"time_factors.{gpu}.{k}", row.get(k), k, origin)
    backend = _table("attention_backend", data.get("attention_backend", {}), origin)
    return Coefficients(
        version=str(data.get("version", "")),
        kernel_tflops=kernels,
        min_cudnn_capability=_number(
            "attention_backend.min_cudnn_capability", backend.get("min_cudnn_capability", 9.0), "min_cudnn_capability", origin
        ),
        fitted=tuple(data.get("fitted", ())),
        time_factors=factors,
        **checked,
    )


def load_coefficients(path: Optional[str | Path] = None) -> Coefficients:
    """Those in ``path`` (a file written by `seqpar calibrate -o`), else in $SEQPAR_COEFFICIENTS, else the shipped ones (cached)."""
    from_env = path is None and bool(os.environ.get("SEQPAR_COEFFICIENTS"))
    path = path or os.environ.get("SEQPAR_COEFFICIENTS") or None
    if path is None:
        return _shipped()
    p = Path(path)
    origin = f"{str(p)!r}" + (" (SEQPAR_COEFFICIENTS)" if from_env else "")
    fix = "write one with `seqpar calibrate -o FILE`" + (" or unset SEQPAR_COEFFICIENTS" if from_env else "")
    data = read_json_object(p, "coefficients file", "coefficients", missing_fix=fix, invalid_fix=fix)
    return coefficients_from_dict(data, origin)


@lru_cache(maxsize=1)
def _shipped() -> Coefficients:
    return coefficients_from_dict(json.loads(COEFFICIENTS_PATH.read_text()))
