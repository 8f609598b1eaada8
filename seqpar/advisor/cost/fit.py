"""Fit the cost model's few coefficients to measurements, and say how well it predicts them (residuals, leave-one-out).

Measurements (seqpar.advisor.cost.measurements reads and checks them) are data in the repo (seqpar/profiles/measurements/)
and the run reports ``seqpar calibrate`` is given.

The fit: step time is linear in the fitted factors once the rest is held fixed,
  T = linear_time_factor * T_linear(h0) + attn_time_factor * T_attn(n0) + cpu_work / cpu_adam_rate + T_rest,
(T_rest: the parts no factor scales: elementwise HBM traffic of norms, RoPE and SwiGLU, exposed communication, offload,
the GPU optimizer step; throughput.py's ``parts_s["rest"]``)
so relative least squares (minimise sum((T_pred - T_meas)/T_meas)^2) over those three, and two fixed-point passes for
the overlap terms that depend on the compute time. Two shape terms are searched on grids around that least squares,
one coordinate at a time until none moves (three passes at most): the matmul width saturation h0 (matmul_width_h0) and
the share of HBM bandwidth the elementwise kernels reach (elementwise_efficiency). Held at their measured values unless
a grid is passed: the attention call saturation n0 (attn_block_tokens, an outer grid) and the attention head-width
saturation d0 (attn_head_dim_d0, searched with the others): both are kernel measurements (their sources in
coefficients.json), and the rows have one model of each narrow shape to tell them from everything else that model
does differently. The two time factors are fitted once on all rows (the global fallback) and again per GPU profile on
that GPU's rows (``time_factors``): one GPU's engine overheads (e.g. ZeRO-3 offload's) do not carry over to another.
The shape terms are shared by all GPUs, and each is searched only when the rows can tell it from the factors: h0 when
they span two model widths, d0 two head widths, the elementwise efficiency both fused (Liger) and unfused layers,
whose elementwise bytes differ ~5x at the same matmul work. A coefficient no row informs (e.g. CPU Adam without ZeRO-3
offload rows) keeps its value. The leave-one-out errors refit the factors and h0 without the row; the elementwise
efficiency stays at the full fit's value (searching both per row would take minutes). Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Optional

from seqpar.advisor.cost.coefficients import COEFFICIENTS_PATH, Coefficients, load_coefficients
from seqpar.advisor.cost.measurements import Measurement, load_measurements
from seqpar.advisor.cost.predict import predict
from seqpar.advisor.cost.throughput import estimate_time
from seqpar.plan.errors import SeqparError
from seqpar.plan.files import write_atomic

# n0 is held at its hardware-derived value (coefficients.json) unless a grid is passed: five rows cannot pin four numbers.
N0_GRID = (0.0, 512.0, 1024.0, 2048.0, 3072.0, 4096.0, 6144.0, 8192.0)
BOUNDS = {"linear_time_factor": (0.5, 4.0), "attn_time_factor": (0.5, 4.0), "cpu_adam_gparams_per_s": (0.2, 50.0)}
# h0 of the matmul width efficiency h / (h + h0): a grid, informed only by rows of models of different widths.
H0_GRID = (0.0, 256.0, 512.0, 768.0, 1024.0, 1536.0, 2048.0, 3072.0, 4096.0, 6144.0, 8192.0)
# d0 of the attention head-width efficiency d / (d + d0): informed only by rows of different head widths.
D0_GRID = (0.0, 16.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0)
# achieved / datasheet HBM bandwidth of the norm, RoPE and SwiGLU kernels: informed by fused and unfused rows together.
EW_GRID = (1.0, 0.85, 0.75, 0.67, 0.6, 0.5, 0.4, 0.33)
FITTED = ("linear_time_factor", "attn_time_factor")  # cpu_adam_gparams_per_s joins when asked (needs many offload rows)


@dataclass(frozen=True)
class FitResult:
    coefficients: Coefficients
    rows: list[dict]  # label, measured, predicted, residual (relative), loo (relative error when left out)
    max_abs_residual: float
    max_abs_loo: float


# --------------------------------------------------------------------------------------------- the fit


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for the small normal equations."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-30:
            raise ZeroDivisionError("singular")
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _measured_step(r: Measurement) -> float:
    w, s = r.workload, r.strategy
    return w.seq_len * w.micro_batch_size * s.dp_degree * s.gradient_accumulation_steps / r.tokens_per_s


def _fit_factors(rows: list[Measurement], c: Coefficients, fitted: tuple[str, ...] = FITTED) -> Coefficients:
    """Relative least squares for the time factors at fixed n0; two passes so the overlap terms follow the compute."""
    for _ in range(3):
        cols, ys = [], []
        for r in rows:
            parts = estimate_time(r.workload, r.cluster, r.strategy, c, r.norms_tiled).parts_s
            y = _measured_step(r)
            cpu_work = parts["cpu_adam"] * c.cpu_adam_gparams_per_s  # seconds x Gparam/s = Gparams
            cols.append((parts["linear_ideal"] / y, parts["attn_ideal"] / y, cpu_work / y))
            ys.append((y - parts["rest"]) / y)
        names = ["linear_time_factor", "attn_time_factor", "cpu_adam_gparams_per_s"]
        for j, name in enumerate(names):  # a coefficient held fixed moves its column to the known side
            if name not in fitted:
                ys = [y - col[j] * ((1.0 / c.cpu_adam_gparams_per_s) if j == 2 else getattr(c, name)) for col, y in zip(cols, ys)]
        active = [j for j in range(3) if names[j] in fitted and any(abs(col[j]) > 0 for col in cols)]
        if len(rows) < len(active):
            return c
        ata = [[sum(col[i] * col[j] for col in cols) for j in active] for i in active]
        aty = [sum(col[i] * y for col, y in zip(cols, ys)) for i in active]
        try:
            x = _solve(ata, aty)
        except ZeroDivisionError:
            return c
        new = {}
        for j, v in zip(active, x):
            name = names[j]
            if name == "cpu_adam_gparams_per_s":
                v = 1.0 / v if v > 0 else BOUNDS[name][1]
            lo, hi = BOUNDS[name]
            new[name] = min(max(v, lo), hi)
        c = c.with_values(**new)
    return c


def _rel_errors(rows: list[Measurement], c: Coefficients) -> list[float]:
    return [estimate_time(r.workload, r.cluster, r.strategy, c, r.norms_tiled).tokens_per_s / r.tokens_per_s - 1 for r in rows]


def _timed(rows: list[Measurement]) -> list[Measurement]:
    return [r for r in rows if r.tokens_per_s and r.cluster.accelerator == "cuda"]  # CPU smoke runs say nothing about GPUs


def _fit_per_gpu(timed: list[Measurement], c: Coefficients, fitted: tuple[str, ...]) -> Coefficients:
    """Global factors on all rows (the fallback), then each GPU profile with enough rows gets its own factors."""
    c = _fit_factors(timed, c.with_values(time_factors={}), fitted)
    own = {}
    for gpu in sorted({r.cluster.gpu.name for r in timed}):
        rows = [r for r in timed if r.cluster.gpu.name == gpu]
        if len(rows) < 2:  # two factors need two rows; one row would only move them to fit it exactly
            continue
        g = _fit_factors(rows, c, fitted)
        own[gpu] = {"linear_time_factor": g.linear_time_factor, "attn_time_factor": g.attn_time_factor}
    return c.with_values(time_factors=own)


def shape_grids(
    timed: list[Measurement],
    h0_grid: Optional[Iterable[float]] = H0_GRID,
    d0_grid: Optional[Iterable[float]] = None,
    ew_grid: Optional[Iterable[float]] = EW_GRID,
) -> dict[str, tuple[float, ...]]:
    """The shape terms these rows can tell from the time factors, with their grids (module docstring)."""
    grids = {}
    if h0_grid is not None and len({r.workload.model.hidden_size for r in timed}) > 1:
        grids["matmul_width_h0"] = tuple(h0_grid)
    if d0_grid is not None and len({r.workload.model.head_dim for r in timed}) > 1:
        grids["attn_head_dim_d0"] = tuple(d0_grid)
    if ew_grid is not None and len({r.strategy.fused_ops for r in timed}) > 1:
        grids["elementwise_efficiency"] = tuple(ew_grid)
    return grids


def _search(timed: list[Measurement], start: Coefficients, grids: dict, fitted: tuple[str, ...]) -> tuple[Coefficients, float]:
    """Coordinate search over the grids (each term in turn, the others held), the factors refitted at every point."""
    cache: dict[tuple, tuple[Coefficients, float]] = {}

    def score(point: dict) -> tuple[Coefficients, float]:
        key = tuple(sorted(point.items()))
        if key not in cache:
            c = _fit_per_gpu(timed, start.with_values(**point), fitted)
            cache[key] = (c, sum(e * e for e in _rel_errors(timed, c)))
        return cache[key]

    point = {name: getattr(start, name) for name in grids}
    best, best_err = score(point)
    for _ in range(3):
        moved = False
        for name, grid in grids.items():
            for v in grid:
                c, err = score({**point, name: v})
                if err < best_err - 1e-12:
                    best, best_err, point, moved = c, err, {**point, name: v}, True
        if not moved:
            break
    return best, best_err


def fit(
    rows: list[Measurement],
    base: Optional[Coefficients] = None,
    n0_grid: Optional[Iterable[float]] = None,
    fitted: tuple[str, ...] = FITTED,
    h0_grid: Optional[Iterable[float]] = H0_GRID,
    d0_grid: Optional[Iterable[float]] = None,
    ew_grid: Optional[Iterable[float]] = EW_GRID,
) -> Coefficients:
    """Best coefficients for the rows with a measured tokens/s: per-GPU factors by least squares, the shape terms
    (h0, the elementwise efficiency, and d0 when its grid is given) by coordinate search on their grids, n0 on its grid
    when one is given."""
    base = base or load_coefficients()
    n0_grid = (base.attn_block_tokens,) if n0_grid is None else n0_grid
    timed = _timed(rows)
    if not timed:
        return base
    grids = shape_grids(timed, h0_grid, d0_grid, ew_grid)
    best, best_err = base, float("inf")
    for n0 in n0_grid:
        c, err = _search(timed, base.with_values(attn_block_tokens=n0), grids, fitted)
        if err < best_err - 1e-12:
            best, best_err = c, err
    return best


def evaluate(
    rows: list[Measurement], base: Optional[Coefficients] = None, h0_grid: Optional[Iterable[float]] = H0_GRID
) -> FitResult:
    """Fit on all rows, then each row's residual and its leave-one-out error (refit without it, predict it)."""
    c = fit(rows, base, h0_grid=h0_grid)
    timed = _timed(rows)
    loo_base = (base or load_coefficients()).with_values(elementwise_efficiency=c.elementwise_efficiency)
    out = []
    for r in rows:
        p = predict(r.workload, r.cluster, r.strategy, c, **r.as_ran)
        e: dict = {
            "label": r.label,
            "source": r.source,
            "measured_tokens_per_s": r.tokens_per_s,
            "predicted_tokens_per_s": p.tokens_per_s,
            "tokens_residual": (p.tokens_per_s / r.tokens_per_s - 1) if r.tokens_per_s else None,
            "measured_peak_gib": r.peak_memory_gib,
            "predicted_peak_gib": p.peak_memory_gib,
            "memory_residual": (p.peak_memory_gib / r.peak_memory_gib - 1) if r.peak_memory_gib else None,
            "measured_oom": r.oom,
            "predicted_oom": p.oom_risk,
            "loo_tokens_error": None,
        }
        if r in timed and len(timed) > 2:
            # the factors and h0 refitted without the row; the elementwise efficiency held (module docstring)
            loo_c = fit([q for q in timed if q is not r], loo_base, h0_grid=h0_grid, ew_grid=None)
            e["loo_tokens_error"] = (
                estimate_time(r.workload, r.cluster, r.strategy, loo_c, r.norms_tiled).tokens_per_s / r.tokens_per_s - 1
            )
        out.append(e)
    res = [abs(e["tokens_residual"]) for e in out if e["tokens_residual"] is not None]
    loo = [abs(e["loo_tokens_error"]) for e in out if e["loo_tokens_error"] is not None]
    return FitResult(c, out, max(res, default=0.0), max(loo, default=0.0))


def coefficients_json(c: Coefficients, result: Optional[FitResult] = None, sources: Iterable[str] = ()) -> dict:
    """The coefficients file for ``c``: the shipped file's text with new values, a new version and the fit's report."""
    data = json.loads(COEFFICIENTS_PATH.read_text())
    data["schema"] = 2  # 2: per-GPU time_factors and matmul_width_h0 (attn_head_dim_d0, elementwise_efficiency: new values)
    data["values"] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.values().items()}
    data["time_factors"] = {gpu: {k: round(v, 6) for k, v in f.items()} for gpu, f in sorted(c.time_factors.items())}
    data["fitted"] = [*FITTED, "matmul_width_h0", "elementwise_efficiency", "time_factors"]
    stamp = datetime.now(timezone.utc)
    data["version"] = stamp.strftime("%Y-%m-%d.%H%M%S")
    if result is not None:
        data["fit"] = {
            "fitted_at": stamp.isoformat(timespec="seconds"),
            "sources": sorted(set(sources)),
            "max_abs_residual": round(result.max_abs_residual, 4),
            "max_abs_loo": round(result.max_abs_loo, 4),
            "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in e.items()} for e in result.rows],
        }
    return data


def run_reports(paths: Iterable[str | Path]) -> list[Path]:
    """The files ``seqpar calibrate`` reads: a file as given; a folder (seqpar launch's --output) as its run_report.json,
    or its stages' (stage-*/run_report.json, a recipe's run). SeqparError for a folder that holds neither."""
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            out.append(p)
            continue
        found = [p / "run_report.json"] if (p / "run_report.json").is_file() else sorted(p.glob("stage-*/run_report.json"))
        if not found:
            raise SeqparError(
                f"folder {str(p)!r} holds no run_report.json (seqpar launch writes one into its --output folder when a run "
                f"ends); pass a run's folder or its run_report.json"
            )
        out += found
    return out


def calibrate(report_paths: Iterable[str | Path], out: Optional[str | Path] = None, include_shipped: bool = True) -> FitResult:
    """Refit from run reports (plus the shipped measurements); write the coefficients file to ``out`` when given."""
    rows = (load_measurements() if include_shipped else []) + load_measurements(list(report_paths))
    result = evaluate(rows)
    if out is not None:
        write_atomic(out, json.dumps(coefficients_json(result.coefficients, result, (r.source for r in rows)), indent=2) + "\n")
    return result
