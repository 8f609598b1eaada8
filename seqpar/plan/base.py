"""The plan's literal vocabulary and its frozen base model: the names a plan may hold, stated once.

Every model of the plan is a ``Frozen``: immutable, ``extra="forbid"``, no Infinity/NaN (JSON cannot write them back), no
lone surrogates. Field names carry their unit (seqpar.plan.units).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError, core_schema

from seqpar.plan.modes import is_registered, names
from seqpar.plan.options import CHECKPOINTING, KEPT_SAVES

SCHEMA_VERSION = 1
SEED_MAX = 2**32 - 1


class _RegisteredMode:
    """A registered mode's name (seqpar.plan.modes): checked against the registry when a plan is built, so a mode registered
    after import is a valid ``strategy.mode``; the JSON schema lists the names registered when it is written."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return core_schema.no_info_after_validator_function(_registered_mode, core_schema.str_schema())

    @classmethod
    def __get_pydantic_json_schema__(cls, schema, handler):
        return {"enum": list(names()), "type": "string"}


def _registered_mode(value: str) -> str:
    if not is_registered(value):
        *rest, last = (repr(n) for n in names())
        expected = f"{', '.join(rest)} or {last}" if rest else last
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return value


Mode = Annotated[str, _RegisteredMode]  # the names registered in seqpar.plan.modes
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
