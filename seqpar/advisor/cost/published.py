"""Published multi-GPU long-context training runs, kept as data with their citations: the schema and its loader.

``seqpar/profiles/published_runs.json`` holds rows quoted from papers, vendor and project benchmarks and public reports:
each with its source (a ``sources`` entry, where in it: table, figure, comment), the hardware, model and engine as the
source states them, the configuration the cost model is pinned to (``config``; ``mapping`` says where that differs from
what the source ran), what was measured and how, and what the source leaves unstated. ``rankings`` name rows a source
compares (modes, degrees, features) so that the cost model's order can be checked against the published one.

Rules the loader enforces (a row that breaks one is a broken data file, refused with one line naming the row):
* numbers are those the source prints; a derived figure (tokens/s from an iteration time) says how in ``derivation``,
  and one read off a plot says so in ``read_off_plot``;
* a row of a source marked ``fitted_on`` was used to fit the coefficients: it is shown, never counted as ground truth;
* a row the targets apply to (``fully_stated`` and ``representable``) that misses them carries ``miss``: the engine
  semantics that explain it, with their source (never a per-row factor).
What the cost model predicts for each row, and the comparison: published_predict.py. Pure Python: no torch.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, ValidationError, model_validator

from seqpar.plan.base import Checkpointing, DType, Frozen, FusedOps, LossImpl, Mode, Optimizer, Sharding
from seqpar.plan.errors import SeqparError
from seqpar.plan.files import first_error, read_json_object
from seqpar.plan.specs import ModelSpec

PUBLISHED_RUNS_PATH = Path(__file__).resolve().parents[2] / "profiles" / "published_runs.json"
MemoryKind = Literal["allocated", "torch_reserved", "device_used", "unstated"]


class Source(Frozen):
    id: str = Field(description="Key the rows cite.")
    title: str = Field(description="Title as published.")
    url: str = Field(description="Where it is published (a commit-pinned URL for repository files).")
    publisher: str = Field(description="Who published it (authors or organisation).")
    date: str = Field(description="Publication or commit date, YYYY-MM-DD.")
    group: str = Field(
        description="Independence group: sources of one team or one shared experiment share it, so that 'independent "
        "sources' counts groups, not documents."
    )
    fitted_on: bool = Field(default=False, description="Its rows were used to fit the coefficients: shown, not ground truth.")
    notes: str = Field(default="", description="What the source is, and caveats that apply to all its rows.")


class GpuOverride(Frozen):
    memory_gib: Optional[float] = Field(default=None, gt=0, description="Device memory in GiB when the board differs.")
    hbm_bandwidth_gb_s: Optional[float] = Field(default=None, gt=0, description="HBM bandwidth, GB/s.")
    bf16_tflops: Optional[float] = Field(default=None, gt=0, description="Dense bf16 peak, TFLOP/s.")
    source: str = Field(description="Where the overriding figures come from.")


class Hardware(Frozen):
    gpu: str = Field(description="seqpar GPU profile (seqpar/profiles/gpus.json) the row is priced on.")
    gpus_per_node: int = Field(ge=1, description="GPUs per node.")
    nodes: int = Field(default=1, ge=1, description="Nodes.")
    host_ram_gib: Optional[float] = Field(default=None, gt=0, description="Host RAM per node, GiB; None when unstated.")
    gpu_override: Optional[GpuOverride] = Field(default=None, description="Board figures that differ from the profile.")
    as_stated: str = Field(description="GPU, count, nodes and interconnect in the source's words.")


class ModelRef(Frozen):
    profile: Optional[str] = Field(default=None, description="seqpar model profile name (seqpar/profiles/models.json).")
    shape: Optional[ModelSpec] = Field(default=None, description="The shape, when no profile has it (cite its config.json).")
    as_stated: str = Field(description="The model in the source's words.")

    @model_validator(mode="after")
    def _one(self) -> ModelRef:
        if (self.profile is None) == (self.shape is None):
            raise ValueError("give exactly one of profile and shape")
        return self


class RunConfig(Frozen):
    """The configuration the cost model is pinned to: seqpar's names for what the source ran."""

    mode: Mode = Field(description="seqpar mode.")
    sp_degree: int = Field(default=1, ge=1, description="Sequence-parallel degree.")
    ulysses_degree: Optional[int] = Field(default=None, ge=1, description="usp_attn's Ulysses degree.")
    seq_len: int = Field(ge=1, description="Tokens per sequence.")
    micro_batch_size: int = Field(default=1, ge=1, description="Sequences per rank per forward.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    checkpointing: Checkpointing = Field(description="none | full | offload | selective.")
    sharding: Sharding = Field(description="ddp | zero2 | zero3 | zero3_offload | fsdp.")
    optimizer: Optimizer = Field(default="adamw", description="adamw (mixed precision) | adamw-bf16 | none.")
    dtype: DType = Field(default="bf16", description="Model dtype.")
    loss_impl: LossImpl = Field(description="hf (whole fp32 logits) | chunked (no whole logits: Liger's fused loss too).")
    fused_ops: FusedOps = Field(default="none", description="none | liger.")
    tiled_mlp: bool = Field(default=False, description="ALST's TiledMLP.")
    attention_kernel: Optional[Literal["cudnn", "flash"]] = Field(
        default=None,
        description="The attention kernel the source names (flash = FlashAttention-2); None = unstated, priced with the "
        "cost model's default for the GPU.",
    )


class Measured(Frozen):
    tokens_per_s: Optional[float] = Field(default=None, gt=0, description="Whole-cluster tokens per second.")
    derivation: str = Field(default="", description="How tokens_per_s follows from what is printed, when it is derived.")
    peak_memory_gib: Optional[float] = Field(default=None, gt=0, description="Per-GPU memory, GiB.")
    memory_kind: MemoryKind = Field(
        default="unstated",
        description="allocated (torch max_memory_allocated), torch_reserved (max_memory_reserved), device_used (NVML / "
        "nvidia-smi: adds the CUDA context and NCCL) or unstated.",
    )
    oom: Optional[bool] = Field(default=None, description="True: ran out of memory; False: trained; None: not reported.")
    longest: bool = Field(default=False, description="seq_len is the longest the source could train with this configuration.")
    read_off_plot: bool = Field(default=False, description="A number was read off a plot, not printed.")
    as_published: str = Field(description="The printed figures, verbatim units.")
    how: str = Field(default="", description="How the source measured (which steps, which counter).")

    @model_validator(mode="after")
    def _something(self) -> Measured:
        if self.tokens_per_s is None and self.peak_memory_gib is None and self.oom is None:
            raise ValueError("a row needs tokens_per_s, peak_memory_gib or oom")
        if self.tokens_per_s is not None and not self.derivation:
            raise ValueError("say how tokens_per_s follows from the source (derivation)")
        return self


class PublishedRun(Frozen):
    id: str = Field(description="Row key.")
    source: str = Field(description="A sources[].id.")
    where: str = Field(description="Table, figure, section or line in the source.")
    hardware: Hardware
    model: ModelRef
    engine: str = Field(description="Framework and versions, as stated.")
    config_as_stated: str = Field(description="Mode, degrees, sharding, checkpointing, batch, kernels in the source's words.")
    config: RunConfig
    mapping: str = Field(default="", description="Where the pinned config differs from what the source ran, and by how much.")
    measured: Measured
    unstated: list[str] = Field(default_factory=list, description="What the source leaves unstated.")
    fully_stated: bool = Field(description="The configuration is stated well enough for the targets to apply.")
    representable: bool = Field(default=True, description="seqpar's vocabulary holds the configuration.")
    not_representable: str = Field(default="", description="What it lacks, when representable is false.")
    miss: str = Field(default="", description="Why a targeted row misses: the engine semantics and their source.")

    @model_validator(mode="after")
    def _why(self) -> PublishedRun:
        if not self.representable and not self.not_representable:
            raise ValueError("say what seqpar lacks (not_representable)")
        return self

    @property
    def gpus(self) -> int:
        return self.hardware.gpus_per_node * self.hardware.nodes


class Ranking(Frozen):
    id: str = Field(description="Key.")
    source: str = Field(description="A sources[].id.")
    where: str = Field(description="Table or section comparing them.")
    quantity: Literal["tokens_per_s", "max_seq_len"] = Field(
        description="tokens_per_s: the rows' measured throughput; max_seq_len: each row's seq_len is the longest its "
        "configuration trained (measured.longest), against the cost model's longest fitting length."
    )
    rows: list[str] = Field(min_length=2, description="Row ids compared.")
    note: str = Field(default="", description="What the comparison shows.")


class PublishedRuns(Frozen):
    schema_version: int = Field(alias="schema", description="Version of this file's layout.")
    about: str = Field(description="What the file is.")
    sources: list[Source]
    rows: list[PublishedRun]
    rankings: list[Ranking] = Field(default_factory=list)

    @model_validator(mode="after")
    def _references(self) -> PublishedRuns:
        src = {s.id for s in self.sources}
        ids = [r.id for r in self.rows]
        if len(set(ids)) != len(ids) or len(src) != len(self.sources):
            raise ValueError("row and source ids must be unique")
        for r in self.rows:
            if r.source not in src:
                raise ValueError(f"row {r.id}: source {r.source!r} is not in sources")
        for k in self.rankings:
            missing = [i for i in k.rows if i not in ids]
            if k.source not in src or missing:
                raise ValueError(f"ranking {k.id}: unknown source or rows {missing}")
            if k.quantity == "max_seq_len" and not all(self.row(i).measured.longest for i in k.rows):
                raise ValueError(f"ranking {k.id}: max_seq_len compares rows whose seq_len is the longest (measured.longest)")
        return self

    def source_of(self, row: PublishedRun) -> Source:
        return next(s for s in self.sources if s.id == row.source)

    def row(self, row_id: str) -> PublishedRun:
        return next(r for r in self.rows if r.id == row_id)

    def ground_truth(self) -> list[PublishedRun]:
        """Multi-GPU rows of sources not fitted on: the published ground truth."""
        return [r for r in self.rows if r.gpus > 1 and not self.source_of(r).fitted_on]

    def is_target(self, row: PublishedRun) -> bool:
        """Whether the targets apply: ground truth (multi-GPU, not fitted on), fully stated and representable."""
        return row.gpus > 1 and not self.source_of(row).fitted_on and row.fully_stated and row.representable

    def targeted(self) -> list[PublishedRun]:
        return [r for r in self.rows if self.is_target(r)]


def model_of(row: PublishedRun) -> ModelSpec:
    if row.model.shape is not None:
        return row.model.shape
    from seqpar.profiles import get_model

    return get_model(row.model.profile)


def load_published_runs(path: Optional[Path] = None) -> PublishedRuns:
    """The published rows (the shipped file, read once, unless ``path``); SeqparError naming the file and the first
    problem otherwise."""
    if path is None:
        return _shipped()
    return _parse(Path(path))


@lru_cache(maxsize=1)
def _shipped() -> PublishedRuns:
    return _parse(PUBLISHED_RUNS_PATH)


def _parse(path: Path) -> PublishedRuns:
    fix = "fix the file (schema: seqpar/advisor/cost/published.py)"
    data = read_json_object(path, "published runs file", "published runs", missing_fix=fix, invalid_fix=fix, finite=True)
    try:
        return PublishedRuns.model_validate(data)
    except ValidationError as e:
        raise SeqparError(f"published runs file {str(path)!r}: {first_error(e)}; {fix}") from None


__all__ = [
    "GpuOverride",
    "Hardware",
    "Measured",
    "ModelRef",
    "PublishedRun",
    "PublishedRuns",
    "Ranking",
    "RunConfig",
    "Source",
    "load_published_runs",
    "model_of",
]
