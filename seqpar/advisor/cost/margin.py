"""The OOM gate's margin: how far the memory model has been wrong on measured runs like the plan, not a flat figure.

Every measured run the cost model knows (seqpar.advisor.cost.measurements: the shipped run reports and tables, the
same rows `seqpar calibrate` fits) is predicted again with the current coefficients; a run that ran out of memory
counts with what it needed at least (allocated plus the block it could not get), its error with the floor added, as
the peak it would have reached lies above that. A plan's margin is the worst
under-prediction (measured peak above the predicted one, as a share of the prediction) among the rows that keep memory
the way the plan does, by the features that decide which terms dominate (sharding, checkpointing, tiled MLP, optimizer
states), widened one feature at a time until at least MIN_ROWS rows match; never below the coefficients'
``memory_margin_floor``. The gate then asks ``required + margin * peak <= capacity`` (seqpar.advisor.cost.memory:
required is the peak plus the CUDA context, NCCL's buffers and the allocator's floor).

Pure Python; the rows are read and predicted once per set of coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from seqpar.advisor.cost.coefficients import Coefficients
from seqpar.plan.specs import Strategy, Workload

MIN_ROWS = 3  # fewer matching rows than this say too little about an error: widen the match


@dataclass(frozen=True)
class Row:
    features: tuple
    error: float  # measured / predicted peak allocated - 1 (positive: the model under-predicted)
    label: str


@dataclass(frozen=True)
class Margin:
    fraction: float  # of the predicted peak allocated
    rows: int  # measured runs it was taken from
    basis: str  # in words, for the plan and explain


def features(w: Workload, s: Strategy) -> tuple:
    """What decides which memory terms dominate, most telling first (the match is widened from the end)."""
    ckpt = s.checkpointing
    states = "lora" if getattr(w, "lora", None) is not None else ("none" if w.optimizer == "none" else "adam")
    sharding = "ddp" if s.sharding == "ddp" else ("fsdp" if s.sharding == "fsdp" else "zero")
    return (sharding, ckpt, bool(s.tiled_mlp), states)


_WORDS = ("sharding {}", "checkpointing {}", "tiled MLP {}", "optimizer states {}")


def _describe(key: tuple) -> str:
    return ", ".join(f.format({True: "on", False: "off"}.get(v, v)) for f, v in zip(_WORDS, key)) or "any configuration"


@lru_cache(maxsize=4)
def _rows(c: Coefficients, estimate) -> tuple[Row, ...]:
    """The measured rows with the model's error on each; ``estimate``: the memory model's estimate_memory, handed in
    by the memory model itself (which applies the margin), so neither module imports the other."""
    from seqpar.advisor.cost.measurements import load_measurements

    out = []
    for r in load_measurements():
        # a run that trained: its measured peak; one that ran out of memory: what it needed at least
        peak = r.oom_needed_gib if r.oom else r.peak_memory_gib
        if peak is None or r.cluster.accelerator != "cuda":
            continue
        pred = estimate(r.workload, r.cluster, r.strategy, c, margin=False, **r.as_ran)
        pred = pred.peak_bytes / 2**30
        if pred > 0:
            # what an out-of-memory run needed is a lower bound: its error counts with the floor on top
            error = peak / pred - 1.0 + (c.memory_margin_floor if r.oom else 0.0)
            out.append(Row(features(r.workload, r.strategy), error, r.label + (" (ran out of memory)" if r.oom else "")))
    return tuple(out)


def memory_margin(w: Workload, s: Strategy, c: Coefficients, estimate) -> Margin:
    """The margin for this plan: the worst measured under-prediction among runs like it (see the module's docstring);
    ``estimate``: seqpar.advisor.cost.memory.estimate_memory."""
    rows, key = _rows(c, estimate), features(w, s)
    for n in range(len(key), -1, -1):
        like = [r for r in rows if r.features[:n] == key[:n]]
        if len(like) >= MIN_ROWS or n == 0:
            break
    if not like:
        return Margin(c.memory_margin_floor, 0, f"no measured runs: the floor of {c.memory_margin_floor:.0%}")
    worst = max(like, key=lambda r: r.error)
    frac = max(worst.error, c.memory_margin_floor)
    what = _describe(key[:n])
    if worst.error >= c.memory_margin_floor:
        basis = (
            f"the worst under-prediction of {len(like)} measured runs like this plan ({what}): {worst.error:.1%} ({worst.label})"
        )
    else:
        basis = (
            f"{len(like)} measured runs like this plan ({what}) were all within {c.memory_margin_floor:.0%} "
            f"under their prediction: the floor of {c.memory_margin_floor:.0%}"
        )
    return Margin(frac, len(like), basis)
