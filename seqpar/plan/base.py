"""The plan's literal vocabulary and its frozen base model: the names a plan may hold, stated once.

Every model of the plan is a ``Frozen``: immutable, ``extra="forbid"``, no Infinity/NaN (JSON cannot write them back), no
lone surrogates. Field names carry their unit (seqpar.plan.units).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from seqpar.plan.modes import MODES
from seqpar.plan.options import CHECKPOINTING, KEPT_SAVES

SCHEMA_VERSION = 1
SEED_MAX = 2**32 - 1

Mode = Literal[MODES]  # the names of seqpar.plan.modes.MODES_TABLE
Checkpointing = Literal[CHECKPOINTING]  # seqpar.plan.options: the runtime reads the same names
KeptSaves = Literal[KEPT_SAVES]
Sharding = Literal["ddp", "zero2", "zero3", "zero3_offload", "fsdp"]
LossImpl = Literal["hf", "chunked"]
FusedOps = Literal["none", "liger"]
Optimizer = Literal["adamw", "adamw-bf16", "none"]
DType = Literal["bf16", "fp16", "fp32"]
LinkKind = Literal["nvlink3", "nvlink4", "pcie4", "pcie5", "ib_hdr", "ib_ndr", "ethernet", "loopback"]
Accelerator = Literal["cuda", "cpu"]
Architecture = Literal["llama", "mistral", "qwen2", "qwen3"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_SURROGATE = re.compile("[\ud800-\udfff]")


class Frozen(BaseModel):
    # No Infinity/NaN anywhere: JSON cannot write them back (a plan must round-trip) and no quantity here is unbounded.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _text(cls, v):
        """No lone surrogates (how Python holds bytes of a file name that are not UTF-8): they cannot be written out."""
        if isinstance(v, str) and _SURROGATE.search(v):
            raise ValueError(f"{v!r} holds bytes that are not UTF-8 text (a lone surrogate); use a UTF-8 name or path")
        return v
