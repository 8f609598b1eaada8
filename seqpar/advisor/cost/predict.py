"""One configuration in, one prediction out: the cost model's entry point.

``predict(workload, cluster, strategy)`` combines the memory model (memory.py: peak allocated bytes per GPU over the phases
of a step) and the throughput model (throughput.py: step time split into compute / exposed communication / offload /
optimizer) into a ``seqpar.plan.launch_plan.Prediction``, with the coefficients of coefficients.py (the shipped ones unless
``coeffs`` names another set). Pure Python: no torch, no numpy.
"""

from __future__ import annotations

from typing import Optional

from seqpar.advisor.cost.coefficients import Coefficients, load_coefficients
from seqpar.advisor.cost.memory import estimate_memory
from seqpar.advisor.cost.throughput import estimate_time, first_step_extra_s
from seqpar.plan.launch_plan import Prediction
from seqpar.plan.specs import ClusterSpec, Strategy, Workload
from seqpar.plan.units import GIB


def predict(
    workload: Workload,
    cluster: ClusterSpec,
    strategy: Strategy,
    coeffs: Optional[Coefficients] = None,
    loss_path: str = "seqpar",
    attention_cut: bool = True,
    norms_tiled: bool = True,
) -> Prediction:
    """Peak memory, OOM verdict and throughput of one configuration on one cluster; ``loss_path`` "trl": the loss TRL's
    SFTTrainer runs (memory.estimate_memory); ``attention_cut`` False: a measured run from before the runtime cut the
    attention backward over KV heads; ``norms_tiled`` False: a tiled MLP whose runtime leaves the model's own norms whole
    (another tool's, or a run from before seqpar tiled them)."""
    c = coeffs or load_coefficients()
    mem = estimate_memory(
        workload, cluster, strategy, c, loss_path=loss_path, attention_cut=attention_cut, norms_tiled=norms_tiled
    )
    tim = estimate_time(workload, cluster, strategy, c, norms_tiled)
    return Prediction(
        peak_memory_gib=round(mem.peak_bytes / GIB, 3),
        reserved_memory_gib=round(mem.reserved_bytes / GIB, 3),
        capacity_gib=round(mem.capacity_bytes / GIB, 3),
        memory_breakdown_gib={k: round(v / GIB, 3) for k, v in mem.breakdown.items()},
        peak_phase=mem.peak_phase,
        host_memory_gib=round(mem.host_bytes / GIB, 3),
        tokens_per_s=round(tim.tokens_per_s, 1),
        step_time_s=round(tim.step_time_s, 4),
        first_step_s=round(tim.step_time_s + first_step_extra_s(workload, cluster, strategy, c), 4),
        step_time_breakdown_s={k: round(v, 4) for k, v in tim.breakdown_s.items()},
        mfu=round(tim.mfu, 4),
        required_memory_gib=round(mem.required_bytes / GIB, 3),
        memory_margin_gib=round(mem.margin_bytes / GIB, 3),
        memory_margin_basis=mem.margin_basis,
        oom_risk=not mem.fits,
        coefficients_version=f"{c.version} ({c.factors_note(cluster)})",
    )
