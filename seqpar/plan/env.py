"""The job's environment a plan may set (``launch.env``): an allow-list, so a shared plan cannot make the job run code
from elsewhere (a plugin, a library path); anything else needs ``seqpar launch --allow-env NAME``.
"""

from __future__ import annotations

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
)
PLAN_ENV_PREFIXES = ("SEQPAR_", "NCCL_", "TORCH_NCCL_", "CUDA_")
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


ALLOWED_ENV_TEXT = f"{', '.join(p + '*' for p in PLAN_ENV_PREFIXES)} (no *PLUGIN/FILE/PATH/DIR/LIB*), {', '.join(PLAN_ENV_NAMES)}"
