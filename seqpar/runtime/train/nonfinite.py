"""The step's numbers checked before its update: the global gradient norm, and what a non-finite loss or norm does.

Every rank holds the same all-reduced loss and the same global norm (DDP's averaged gradients; FSDP2's norm over the
full DTensor), so every rank reaches the same verdict at the same step without another collective. Default: stop before
the update (TrainingStopped: one line naming the step, exit 1), so the weights and every checkpoint stay finite and
``latest`` stays the last good one; ``--skip-nonfinite``: drop that step's update and go on (the LR schedule still
advances: it is a function of the step). DeepSpeed applies its update inside its backward, so there the run stops after it,
with no checkpoint of it written.
"""

from __future__ import annotations

import math
from pathlib import Path


def grad_norm(wrapped, clip: float) -> float:
    """The global gradient norm, clipping the gradients to ``clip`` when it is > 0."""
    import torch

    params = [p for p in wrapped.parameters() if p.grad is not None]
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2


def problems(loss: float, norm: float | None) -> list[str]:
    """'loss nan', 'grad norm inf', ...: the non-finite figures of a step (empty when it is sound)."""
    return [f"{k} {v}" for k, v in (("loss", loss), ("grad norm", norm)) if v is not None and not math.isfinite(v)]


def message(step: int, bad: list[str], root: Path, *, applied: bool) -> str:
    from seqpar.runtime.checkpoint.resume import latest

    last = latest(root)
    kept = f"latest stays {last.name}" if last is not None else "no checkpoint was written yet"
    update = "was applied by DeepSpeed, and no checkpoint of it written" if applied else "was not applied"
    return (
        f"non-finite {' and '.join(bad)} at step {step}: training stopped, the step's update {update}; {kept}; "
        f"lower training.learning_rate or check the data, or pass --skip-nonfinite to skip such steps"
    )
