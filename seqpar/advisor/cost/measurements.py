"""Measurements the cost model is fitted to, read and checked: what no run can have measured is refused, naming the file.

``*.csv`` rows (one configuration and its measured tokens/s, peak allocated GiB, OOM flag; the columns are CSV_REQUIRED and
CSV_OPTIONAL) and ``*.json`` run reports as ``seqpar launch`` writes them: the plan under ``plan`` and the measured
``tokens_per_s`` / ``peak_memory_gib`` (the plan's Prediction field names) at the top level or under ``measured``;
``oom: true`` marks a run that ran out of memory. The shipped ones are in seqpar/profiles/measurements/.
A measured quantity is a finite positive number, and a plausible one: tokens/s above 100% of the datasheet peak (model
FLOPs as seqpar.plan.flops counts them) or more memory allocated than the GPU has is a broken or forged file, which would move
every prediction once fitted. Pure Python.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from pydantic import ValidationError

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.plan.display import tags
from seqpar.plan.errors import SeqparError
from seqpar.plan.files import first_error
from seqpar.plan.flops import model_flops_per_sequence
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.rules import split_tag
from seqpar.plan.specs import ClusterSpec, Strategy, Workload
from seqpar.profiles import get_model

MEASUREMENTS_DIR = Path(__file__).resolve().parents[2] / "profiles" / "measurements"


@dataclass(frozen=True)
class Measurement:
    label: str
    source: str
    workload: Workload
    cluster: ClusterSpec
    strategy: Strategy
    tokens_per_s: Optional[float]
    peak_memory_gib: Optional[float]
    oom: bool
    # an out-of-memory run: what it had allocated plus the block it could not get (its error message), a lower bound
    # of the peak it needed; the OOM gate's margin takes the model's error on it (seqpar.advisor.cost.margin)
    oom_needed_gib: Optional[float] = None
    # whether the run's cuDNN attention backward was cut over KV heads (seqpar.plan.attention_calls): run reports
    # written before the runtime cut it say nothing, and are priced with one call
    attention_backward_cut: bool = True
    # whether the run's own RMSNorms ran in tiles under its tiled MLP (seqpar.runtime.memory.tiled_mlp.tile_norms):
    # run reports written before say nothing, and rows of other tools never did; priced with the untiled norms then
    norms_tiled: bool = False

    @property
    def as_ran(self) -> dict:
        """The runtime the run had, as estimate_memory and predict take it: its attention backward cut or not, its
        norms tiled or not."""
        return {"attention_cut": self.attention_backward_cut, "norms_tiled": self.norms_tiled}


# The columns of a measurement CSV: the configuration (required unless defaulted), then what was measured.
CSV_REQUIRED = ("model", "gpu", "gpus_per_node", "mode", "seq_len", "checkpointing", "sharding", "optimizer", "loss_impl")
CSV_OPTIONAL = (
    "source",
    "nodes",
    "sp_degree",
    "ulysses_degree",
    "micro_batch_size",
    "dtype",
    "tokens_per_s",
    "peak_memory_gib",
    "oom",
)


def _measured(v, field: str, where: str) -> Optional[float]:
    """A measured quantity: None (not measured) or a finite positive number; SeqparError naming the file and field otherwise."""
    if isinstance(v, str):
        v = v.strip()
        if not v:
            return None
        try:
            v = float(v)
        except ValueError:
            raise SeqparError(f"{where}: {field} {v!r} is not a number; write the measured value or leave it empty") from None
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SeqparError(f"{where}: {field} {v!r} is not a finite positive number; write the measured value or leave it out")
    return float(v)


def _plausible(m: Measurement, where: str) -> Measurement:
    """Refuse what no run can measure: above 100% MFU of the datasheet peak, or more memory allocated than the GPU has."""
    w, c = m.workload, m.cluster
    if m.tokens_per_s is not None:
        flops = m.tokens_per_s * model_flops_per_sequence(w.model, w.seq_len) / w.seq_len
        peak = c.world_size * c.gpu.bf16_tflops * 1e12
        if flops > peak:
            raise SeqparError(
                f"{where}: tokens_per_s {m.tokens_per_s:g} would be {flops / peak:.0%} of the {c.world_size} x {c.gpu.name} "
                f"datasheet peak ({c.gpu.bf16_tflops:g} TFLOP/s each); a real run stays below 100%: check the file"
            )
    if m.peak_memory_gib is not None and c.accelerator == "cuda" and m.peak_memory_gib > c.gpu.memory_gib:
        raise SeqparError(
            f"{where}: peak_memory_gib {m.peak_memory_gib:g} is more than the {c.gpu.memory_gib:g} GiB a {c.gpu.name} has; "
            f"check the file"
        )
    return m


def _row(d: dict, source: str, where: str = "") -> Measurement:
    def num(k, cast=float):
        v = (d.get(k) or "").strip() if isinstance(d.get(k), str) else d.get(k)
        return cast(v) if v not in (None, "") else None

    sp, u = num("sp_degree", int) or 1, num("ulysses_degree", int) or 1
    world = num("gpus_per_node", int) * (num("nodes", int) or 1)
    mode = d["mode"]
    strategy = Strategy.over(
        mode, sp, world, u, checkpointing=d["checkpointing"], sharding=d["sharding"], loss_impl=d["loss_impl"]
    )
    workload = Workload(
        model=get_model(d["model"]),
        seq_len=num("seq_len", int),
        micro_batch_size=num("micro_batch_size", int) or 1,
        dtype=d.get("dtype") or "bf16",
        optimizer=d["optimizer"],
    )
    cluster = cluster_from_flags(d["gpu"], num("gpus_per_node", int), num("nodes", int) or 1)
    oom = str(d.get("oom", "")).strip().lower() in ("1", "true", "yes")
    label = f"{mode} {d['seq_len']} x{world} {d['gpu']}"
    where = where or source
    tps, mem = (
        _measured(d.get("tokens_per_s"), "tokens_per_s", where),
        _measured(d.get("peak_memory_gib"), "peak_memory_gib", where),
    )
    return Measurement(label, source, workload, cluster, strategy, tps, mem, oom)


def _csv_rows(f: Path) -> list[Measurement]:
    """The rows of a measurement CSV; SeqparError naming the file (and row) for anything that is not one."""
    try:
        text = f.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SeqparError(
            f"measurement file {str(f)!r} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 CSV"
        ) from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    reader = csv.DictReader(lines)
    header = reader.fieldnames or []
    missing = [c for c in CSV_REQUIRED if c not in header]
    unknown = [c for c in header if c not in CSV_REQUIRED + CSV_OPTIONAL]
    if missing or unknown:
        raise SeqparError(
            f"measurement file {str(f)!r} has the header {','.join(header) or '(none)'}: "
            + (f"missing {', '.join(missing)}" if missing else f"unknown columns {', '.join(unknown)}")
            + f"; the columns are {','.join(CSV_REQUIRED + CSV_OPTIONAL)}"
        )
    out = []
    for i, d in enumerate(reader, start=1):
        where = f"measurement file {str(f)!r} row {i}"
        if None in d or any(d[c] in (None, "") for c in CSV_REQUIRED):
            raise SeqparError(
                f"{where} has {'more' if None in d else 'fewer'} fields than the header ({', '.join(CSV_REQUIRED)} are required)"
            )
        try:
            m = _row(d, f.name, where)
        except SeqparError as e:
            msg = str(e)
            raise SeqparError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        except ValidationError as e:
            raise SeqparError(f"{where}: {first_error(e)}") from None
        except (ValueError, TypeError) as e:
            raise SeqparError(f"{where}: {e}") from None
        out.append(_plausible(m, where))
    return out


def row_from_report(report: dict, source: str) -> Measurement:
    """A `seqpar launch` run report -> a Measurement (its plan + the measured fields)."""
    if not isinstance(report, dict):
        raise SeqparError(f"run report {source!r} holds a {type(report).__name__}, not a run report object")
    if "plan" not in report:
        raise SeqparError(f"run report {source!r} has no 'plan'; pass the JSON that `seqpar launch` wrote")
    try:
        plan = LaunchPlan.model_validate(report["plan"])
    except ValidationError as e:
        raise SeqparError(f"run report {source!r}: its plan is invalid: {first_error(e)}") from None
    meas = report.get("measured", report)
    if not isinstance(meas, dict):
        raise SeqparError(f"run report {source!r}: 'measured' holds a {type(meas).__name__}, not an object")
    where = f"run report {source!r}"
    tps, mem = (
        _measured(meas.get("tokens_per_s"), "tokens_per_s", where),
        _measured(meas.get("peak_memory_gib"), "peak_memory_gib", where),
    )
    oom = meas.get("oom", report.get("oom", False))
    if not isinstance(oom, bool):
        raise SeqparError(f"{where}: oom {oom!r} must be true or false")
    if tps is None and mem is None and not oom:
        raise SeqparError(f"run report {source!r} has neither tokens_per_s nor peak_memory_gib nor oom; nothing to fit")
    if meas.get("warm_steps") == 0:  # one step: its time includes the first step's one-off costs; memory only
        tps = None
    s = plan.strategy
    label = (
        f"{s.mode} {plan.workload.seq_len} x{plan.cluster.world_size} {plan.cluster.gpu.name} {plan.workload.model.name} "
        f"ckpt={s.checkpointing}{split_tag(s)}"
        + "".join(f" {t}" for t in tags(s, "label"))
        + (f" {s.sharding}" if s.sharding != "ddp" else "")
    )
    needed = _measured(meas.get("oom_needed_gib"), "oom_needed_gib", where) if oom else None
    cut, tiled_norms = report.get("attention_backward_cut", False), report.get("norms_tiled", False)
    for key, v in (("attention_backward_cut", cut), ("norms_tiled", tiled_norms)):
        if not isinstance(v, bool):
            raise SeqparError(f"{where}: {key} {v!r} must be true or false")
    row = Measurement(label, source, plan.workload, plan.cluster, s, tps, mem, oom, needed, cut, tiled_norms)
    return _plausible(row, where)


def load_measurements(paths: Optional[Iterable[str | Path]] = None) -> list[Measurement]:
    """Rows from the given files, or from every file in seqpar/profiles/measurements/."""
    files = (
        [Path(p) for p in paths]
        if paths is not None
        else sorted(MEASUREMENTS_DIR.glob("*.csv")) + sorted(MEASUREMENTS_DIR.glob("*.json"))
    )
    out: list[Measurement] = []
    for f in files:
        if not f.is_file():
            raise SeqparError(f"measurement file {str(f)!r} does not exist; pass run reports written by `seqpar launch`")
        if f.suffix == ".csv":
            out += _csv_rows(f)
        else:
            try:
                data = json.loads(f.read_bytes().decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SeqparError(f"run report {str(f)!r} is not valid JSON ({e})") from None
            except RecursionError:
                raise SeqparError(f"run report {str(f)!r} nests too deeply to be a run report") from None
            out += [row_from_report(r, f.name) for r in (data if isinstance(data, list) else [data])]
    return out
