"""The job's environment a plan may set (``launch.env``): an allow-list, so a shared plan cannot make the job run code
from elsewhere (a plugin, a library path); anything else needs ``seqpar launch --allow-env NAME``. seqpar's own settings
are named one by one, each value checked (``env_value_problem``); its internal ones (test hooks, its own files) a plan
never sets.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

# A plan is a file people download and share, and launch.env reaches the environment of torchrun and every rank: PYTHONPATH
# (a sitecustomize.py), LD_PRELOAD or PATH there would run code from elsewhere. So a plan may set only what seqpar itself
# sets and the settings of the libraries the job runs that change how, not what, code runs; any other name needs
# `seqpar launch --allow-env NAME`.
PLAN_ENV_NAMES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "TOKENIZERS_PARALLELISM",
    "GLOO_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
    "SEQPAR_PG_TIMEOUT_S",
    "SEQPAR_PINNED_BUDGET_GIB",
    "SEQPAR_DEBUG",
)
PLAN_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_")
# seqpar's other SEQPAR_* names are its internals: the fault-injection test hooks (SEQPAR_FAULT_*), the data cache's
# folder, the coefficients file, the interpreters of the interop tests. A plan setting one would inject a failure, point
# a read or a write at a file of its choosing or run another Python; not even --allow-env lets it.
SEQPAR_PREFIX = "SEQPAR_"
PG_TIMEOUT_MAX_S = 7 * 86400  # a week: past any checkpoint's write; far below what datetime.timedelta overflows at
# ...except names that point at a file or a library: NCCL_NET_PLUGIN / NCCL_TUNER_PLUGIN load a shared library,
# NCCL_DEBUG_FILE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE write wherever they name.
PLAN_ENV_REFUSED_PARTS = ("PLUGIN", "FILE", "PATH", "DIR", "LIB")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def plan_env_allowed(name: str) -> bool:
    """May a plan's launch.env set ``name`` without ``--allow-env``?"""
    if name in PLAN_ENV_NAMES:
        return True
    return name.startswith(PLAN_ENV_PREFIXES) and not any(part in name for part in PLAN_ENV_REFUSED_PARTS)


def env_refusals(env: dict[str, str], allow: Iterable[str] = ()) -> list[str]:
    """The names in ``env`` a plan may not set (neither on the allow-list nor in ``allow``), in order."""
    extra = set(allow)
    return [k for k in env if not plan_env_allowed(k) and k not in extra]


def env_value_problem(name: str, value: str) -> str | None:
    """One line saying why a plan's ``launch.env`` may not set ``name`` to ``value`` (seqpar's own names: an internal
    one at all, a number that is none), else None."""
    if name.startswith(SEQPAR_PREFIX) and name not in PLAN_ENV_NAMES:
        return (
            f"{name} is one of seqpar's internal settings (test hooks, its own files), which no plan may set; remove it "
            f"(of seqpar's, a plan may set {', '.join(n for n in PLAN_ENV_NAMES if n.startswith(SEQPAR_PREFIX))})"
        )
    if name == "SEQPAR_PG_TIMEOUT_S":
        return _number_problem(name, value, "seconds", low=0, high=PG_TIMEOUT_MAX_S, example="600")
    if name == "SEQPAR_PINNED_BUDGET_GIB":
        return _number_problem(name, value, "GiB per process", low=None, high=None, example="40")
    return None


def _number_problem(name: str, value: str, unit: str, *, low: float | None, high: float | None, example: str) -> str | None:
    """``value`` must be a finite number of ``unit``: above ``low`` (else at least 0), at most ``high``."""
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    above = x >= 0 if low is None else x > low
    if math.isfinite(x) and above and (high is None or x <= high):
        return None
    rule = (">= 0" if low is None else f"> {low:g}") + (f" and <= {high:g}" if high is not None else "")
    return f"{name} is {value[:40]!r}, not a number of {unit} {rule}; give e.g. {name}={example}"


ALLOWED_ENV_TEXT = f"{', '.join(p + '*' for p in PLAN_ENV_PREFIXES)} (no *PLUGIN/FILE/PATH/DIR/LIB*), {', '.join(PLAN_ENV_NAMES)}"
