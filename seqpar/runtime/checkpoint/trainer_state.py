"""What trainer_state.json may hold, checked like a plan: types (strict: no "5" for 5, no true for 1), ranges, the names
of a plan's enums, bounded strings, and no field seqpar does not write. A value that passes is safe to compute with
(the step drives the LR schedule and the data position) and, escaped, to print.

The ``run`` group's keys follow the plan (seqpar.runtime.checkpoint.resume.run_facts) and are compared one by one with
this run's, so its values are held to their JSON kinds here (bounded strings, integers, finite numbers, booleans, the
parameter shapes) and to equality there.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from seqpar.plan.base import Sharding
from seqpar.plan.launch_plan import TrainingSpec
from seqpar.plan.safe import printable

FORMAT = 3  # 1: whole-model torch.save files; 2: shards, sizes and an unkeyed digest; 3: sizes, SHA-256s and a MAC
STEP_MAX = 10**12
COUNT_MAX = 2**53  # windows, bytes: exact in a JSON number read as a double elsewhere
TEXT_MAX = 4096  # a path (PATH_MAX) is the longest string a checkpoint records
Text = Annotated[str, StringConstraints(max_length=TEXT_MAX)]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_]{1,64}$")]
Degree = Annotated[int, Field(ge=1, le=2**20)]
Count = Annotated[int, Field(ge=0, le=COUNT_MAX)]
Rate = Annotated[float, Field(ge=0, le=1e6)]
Schedule = TrainingSpec.model_fields["lr_schedule"].annotation  # the plan's names, stated once there


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid", allow_inf_nan=False)


class FileEntry(_Strict):
    bytes: Count = Field(description="The file's size in bytes.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The SHA-256 of its content, hex.")


class Layout(_Strict):
    world_size: Degree = Field(description="Ranks of the run that wrote it.")
    mode: Name = Field(description="Its attention mode (a registered mode's name).")
    sp_degree: Degree = Field(description="Ranks sharing one sequence.")
    dp_degree: Degree = Field(description="Data-parallel replicas.")
    ulysses_degree: Degree = Field(description="usp_attn's all-to-all group size (1 otherwise).")
    micro_batch_size: Degree = Field(description="Windows per rank per micro-batch.")
    gradient_accumulation_steps: Degree = Field(description="Micro-batches per optimizer step.")
    sharding: Sharding = Field(description="Model-state sharding.")


class Training(_Strict):
    steps: Annotated[int, Field(ge=1, le=STEP_MAX)] = Field(description="Steps of the run that wrote it.")
    learning_rate: Rate = Field(description="Peak learning rate.")
    lr_schedule: Schedule = Field(description="After warmup.")
    warmup_steps: Annotated[int, Field(ge=0, le=STEP_MAX)] = Field(description="Linear warmup steps.")
    weight_decay: Rate = Field(description="AdamW weight decay.")
    grad_clip: Optional[Rate] = Field(description="Max gradient norm, 0 = off.")


def _shape(name, sizes) -> bool:
    return (
        isinstance(name, str)
        and len(name) <= TEXT_MAX
        and isinstance(sizes, list)
        and len(sizes) <= 8
        and all(type(n) is int and 0 <= n <= COUNT_MAX for n in sizes)
    )


class TrainerState(_Strict):
    format: Literal[3] = Field(description="trainer_state.json's format.")
    step: Annotated[int, Field(ge=0, le=STEP_MAX)] = Field(description="Optimizer steps done.")
    windows_read: Count = Field(description="Data windows read by those steps.")
    run: dict[Text, Any] = Field(description="What decides the data and the model (seqpar.runtime.checkpoint.resume.run_facts).")
    layout: Layout = Field(description="How the run was split.")
    training: Training = Field(description="Steps and the optimizer's schedule.")
    files: dict[Text, FileEntry] = Field(description="Every other file of the checkpoint: size and SHA-256.")
    mac: str = Field(pattern=r"^[0-9a-f]{64}$", description="HMAC-SHA256 of the rest under the user's run key.")

    @field_validator("run")
    @classmethod
    def _run(cls, run: dict) -> dict:
        for key, value in run.items():
            shown = repr(printable(key, 80))
            if key == "parameters":
                if not isinstance(value, dict) or not all(_shape(k, v) for k, v in value.items()):
                    raise ValueError(f"{shown} is not an object of parameter names and shapes (lists of sizes)")
            elif isinstance(value, str):
                if len(value) > TEXT_MAX:
                    raise ValueError(f"{shown} holds {len(value)} characters, more than the {TEXT_MAX} seqpar writes")
            elif isinstance(value, float):
                if not math.isfinite(value):
                    raise ValueError(f"{shown} is not a finite number")
            elif type(value) is int:
                if abs(value) > COUNT_MAX:
                    raise ValueError(f"{shown} is larger than any figure seqpar records")
            elif value is not None and not isinstance(value, bool):
                raise ValueError(f"{shown} holds a {type(value).__name__}, not a number, string, boolean or null")
        return run


def problem(state: dict) -> str | None:
    """One line naming the first field of ``state`` that trainer_state.json cannot hold, else None."""
    try:
        TrainerState.model_validate(state)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = "unknown field (seqpar does not write it)" if err.get("type") == "extra_forbidden" else err.get("msg", "")
        return printable(f"{loc}: {msg.removeprefix('Value error, ')}", 300)
    return None


__all__ = ["FORMAT", "TrainerState", "problem"]
