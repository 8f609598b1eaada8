"""The launch plan: workload, cluster, strategy, prediction, rationale, the job it runs and its training settings, and how
it is read (validated, one line on any problem) and written (atomically).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Literal, Optional

from pydantic import Field, ValidationError, field_validator, model_validator

from seqpar.plan.base import SCHEMA_VERSION, SEED_MAX, Frozen, Mode
from seqpar.plan.env import _ENV_NAME, ALLOWED_ENV_TEXT, env_refusals, env_value_problem
from seqpar.plan.errors import SeqparError
from seqpar.plan.files import first_error, read_json_object, write_atomic
from seqpar.plan.options import KEEP_LAST
from seqpar.plan.rules import plan_problems
from seqpar.plan.specs import ClusterSpec, Strategy, Workload
from seqpar.plan.units import INT64_MAX


class Prediction(Frozen):
    peak_memory_gib: float = Field(
        ge=0,
        description="Predicted peak allocated by PyTorch's caching allocator per GPU (torch.cuda.max_memory_allocated), GiB.",
    )
    reserved_memory_gib: float = Field(
        ge=0, description="Predicted peak reserved (allocated + allocator slack) plus CUDA context and NCCL buffers, GiB."
    )
    capacity_gib: float = Field(
        ge=0, description="What one process can allocate on the target GPU in all (NVML's total less the driver's reserve), GiB."
    )
    memory_breakdown_gib: dict[str, float] = Field(description="Terms at the peak phase, GiB; they sum to peak_memory_gib.")
    peak_phase: str = Field(
        default="", description="The phase of the step where the peak occurs (forward, loss, backward, optimizer)."
    )
    host_memory_gib: float = Field(
        default=0.0, ge=0, description="Host RAM per node needed for offloaded state and checkpoints, GiB."
    )
    tokens_per_s: float = Field(ge=0, description="Predicted training throughput of the whole cluster, tokens/s.")
    step_time_s: float = Field(ge=0, description="Predicted time of one optimizer step, s (a warm step).")
    first_step_s: Optional[float] = Field(
        default=None,
        ge=0,
        description="Predicted time of the first step, s: a warm step plus its one-off costs (kernel selection, allocator "
        "growth, page-locking the offload's pinned host blocks). None in plans written before it was predicted.",
    )
    step_time_breakdown_s: dict[str, float] = Field(description="compute / exposed communication / offload / optimizer, s.")
    mfu: float = Field(ge=0, description="Model FLOPs utilisation against the datasheet bf16 peak (no recompute counted).")
    required_memory_gib: float = Field(
        default=0.0,
        ge=0,
        description="What the OOM gate asks to fit besides the margin: the peak plus the CUDA context, NCCL's buffers and "
        "the allocator's floor (not the cache it gives back before failing), GiB.",
    )
    memory_margin_gib: float = Field(
        default=0.0,
        ge=0,
        description="The OOM gate's margin over the peak: the worst measured under-prediction on runs like this plan, GiB.",
    )
    memory_margin_basis: str = Field(default="", description="Where the margin comes from (the measured runs it was taken from).")
    oom_risk: bool = Field(
        description="True when reserved memory plus the margin exceeds what a process can allocate (or host RAM is exceeded)."
    )
    coefficients_version: str = Field(default="", description="Version of the fitted coefficients used.")


class Alternative(Frozen):
    strategy: Strategy = Field(description="A strategy the advisor considered.")
    prediction: Optional[Prediction] = Field(default=None, description="Its prediction, when it was valid.")
    rejected_because: str = Field(description="Why it lost (invalid, risks OOM, slower by x%).")


class Rationale(Frozen):
    policy: Literal["rules", "cost", "pinned"] = Field(
        description="rules: the guide's decision tree; cost: the cost-model search; pinned: flags fixed everything."
    )
    rule_path: list[str] = Field(
        default_factory=list, description="The guide's rules followed, in order, ending with its choice."
    )
    rules_choice: Optional[Mode] = Field(default=None, description="The mode the guide's tree picks.")
    reasons: list[str] = Field(default_factory=list, description="Why this strategy, in words, with numbers.")
    alternatives: list[Alternative] = Field(default_factory=list, description="What else was considered and why it lost.")
    cluster_note: str = Field(default="", description="Where the cluster description came from (probe, flags, default).")


class TrainingSpec(Frozen):
    steps: int = Field(default=1000, ge=1, description="Optimizer steps.")
    learning_rate: float = Field(default=2e-5, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "cosine"] = Field(default="constant", description="After warmup.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, ge=0, description="Max gradient norm, 0 = off.")
    seed: int = Field(
        default=0,
        ge=0,
        le=SEED_MAX,
        description="Random seed, 0 to 2**32 - 1 (the range Python's, NumPy's and torch's generators all accept).",
    )
    checkpoint_every: Optional[int] = Field(
        default=None,
        ge=0,
        description="Save every K steps; 0 = only at the end; None = about hourly, from the predicted (else the first "
        "measured) step time.",
    )
    rope_theta: Optional[float] = Field(
        default=None, gt=0, description="Override of the model's RoPE base (EasyContext raises it per stage)."
    )
    keep_last: Optional[int] = Field(
        default=None,
        ge=0,
        description=f"Checkpoints kept, newest first; 0 = all; None = seqpar's default ({KEEP_LAST}). "
        "seqpar launch --keep-last overrides it.",
    )


class LaunchSpec(Frozen):
    launcher: Literal["torchrun", "accelerate", "python"] = Field(default="torchrun", description="What starts the processes.")
    command: list[str] = Field(
        default_factory=list,
        description="The command `seqpar launch` runs on each node (argv; a staged plan: its first stage's). 'python' is the "
        "interpreter seqpar runs under; on several nodes $NODE_RANK and $MASTER_ADDR are each node's to fill in.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables set for the job (they override seqpar launch's); names outside the allow-list "
        "(schema.plan_env_allowed: NCCL_*, TORCH_NCCL_*, CUDA_*, allocator and thread settings, seqpar's process-group "
        "timeout and pinned budget) need `seqpar launch --allow-env NAME`; seqpar's internal SEQPAR_* settings are refused.",
    )

    @field_validator("env")
    @classmethod
    def _env_syntax(cls, env: dict[str, str]) -> dict[str, str]:
        for k, v in env.items():
            if not _ENV_NAME.fullmatch(k):
                raise ValueError(
                    f"environment variable name {k!r} is not a name (letters, digits and _, not starting with a digit; "
                    f"no '=', NUL or spaces); fix or remove it"
                )
            if "\0" in v:
                raise ValueError(f"environment variable {k} holds a NUL character, which no environment can carry; remove it")
            problem = env_value_problem(k, v)
            if problem:
                raise ValueError(problem)
        return env


class Stage(Frozen):
    seq_len: int = Field(ge=1, description="Tokens per sequence in this stage.")
    rope_theta: float = Field(gt=0, description="RoPE base for this stage (EasyContext raises it with the length).")
    steps: int = Field(ge=1, description="Optimizer steps of this stage.")
    strategy: Strategy = Field(description="How this stage is split (planned for its own seq_len).")
    prediction: Optional[Prediction] = Field(
        default=None, description="The cost model's prediction for this stage (None under rules)."
    )


class LaunchPlan(Frozen):
    schema_version: int = Field(default=SCHEMA_VERSION, description="Version of this format; a newer one is refused.")
    created_by: str = Field(default="", description="Tool and version that wrote the plan.")
    created_at: str = Field(default="", description="ISO-8601 UTC time of writing.")
    workload: Workload = Field(description="What is trained.")
    cluster: ClusterSpec = Field(description="Where it is trained.")
    strategy: Strategy = Field(description="How it is split.")
    prediction: Optional[Prediction] = Field(
        default=None, description="The cost model's prediction (None under the rules-only policy)."
    )
    rationale: Rationale = Field(description="Why this strategy.")
    launch: LaunchSpec = Field(default_factory=LaunchSpec, description="How to start it.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="The training loop's settings.")
    stages: list[Stage] = Field(
        default_factory=list,
        description="Progressive recipe (seqpar advise --recipe): stages run in order, each starting from the previous one's final checkpoint; empty = one run.",
    )

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v > SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {v} is newer than this seqpar understands ({SCHEMA_VERSION}); upgrade seqpar to read it"
            )
        if v < 1:
            raise ValueError(f"schema_version {v} is not a valid version (expected {SCHEMA_VERSION})")
        return v

    @model_validator(mode="after")
    def _fits_cluster(self) -> LaunchPlan:
        problems = plan_problems(self.workload, self.cluster, self.strategy)
        for i, st in enumerate(self.stages):
            stage_workload = self.workload.model_copy(update={"seq_len": st.seq_len})
            problems += [f"stage {i}: {p}" for p in plan_problems(stage_workload, self.cluster, st.strategy)]
        if problems:
            raise ValueError(problems[0])
        return self

    # ----- files

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    def write(self, path: str | Path) -> Path:
        """Write atomically: a temporary file in the same folder, then rename."""
        return write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path, allow_env: Iterable[str] = ()) -> LaunchPlan:
        """Read and validate a plan file; SeqparError with one line on any problem. ``allow_env``: names its launch.env
        may set beyond the allow-list (``seqpar launch --allow-env``)."""
        p = Path(path)
        data = read_json_object(
            p,
            "plan file",
            "plan",
            missing_fix=f"write one with `seqpar advise ... -o {p}`",
            invalid_fix="regenerate it with `seqpar advise -o`",
            finite=True,  # a plan holds finite numbers only: NaN and Infinity are not JSON, and never a plan's
            int_max=INT64_MAX,
        )
        ver = data.get("schema_version", SCHEMA_VERSION)
        if isinstance(ver, int) and ver > SCHEMA_VERSION:
            raise SeqparError(
                f"plan file {str(p)!r} has schema_version {ver}, newer than this seqpar understands ({SCHEMA_VERSION}); upgrade seqpar"
            )
        try:
            plan = cls.model_validate(data)
        except ValidationError as e:
            raise SeqparError(f"plan file {str(p)!r} is invalid: {first_error(e)}") from None
        refused = env_refusals(plan.launch.env, allow_env)
        if refused:
            flags = " ".join(f"--allow-env {k}" for k in refused)
            raise SeqparError(
                f"plan file {str(p)!r} sets launch.env {', '.join(refused)}, which a plan may not set (it could make the job "
                f"run code from elsewhere; a plan may set {ALLOWED_ENV_TEXT}); remove it, or if you trust the plan run "
                f"`seqpar launch {p} {flags}`"
            )
        return plan
