"""What each training tool runs, in one table every emitter reads (``seqpar advise --emit TOOL``, ``seqpar check``).

A tool's row (``Caps``) names the modes the tool runs itself and what it calls each (the key that turns it on), the
sharding it runs each of them on, and the nearest value it has for each of the plan's other choices (checkpointing,
the loss, the fused kernels, TiledMLP), with the reasons it lacks the others. Which of a tool's modes it runs for each
plan mode is the mode's own registered description (seqpar.plan.modes ``exports``), so a new mode states its export
support where it is declared. Whatever a row lacks is ``Unsupported`` (a SeqparError: one line, exit 2), never a
KeyError or a config written for something the tool does not run.

Facts (read in the released wheels; accelerate 1.16.0, TRL 1.16.0, axolotl 0.19.0, arctic-training 0.8.0):
- accelerate's ParallelismConfig: ``sp_size`` is DeepSpeed's Ulysses/ALST (needs distributed_type DEEPSPEED),
  ``cp_size`` torch's context parallelism (ring attention with head-tail load balancing, FSDP2 and SDPA only); the two
  are mutually exclusive, so USP has no equivalent; nothing runs LightSeq's dist_flash_attn schedule. TRL's SFTTrainer
  takes its parallelism from accelerate.
- Axolotl's ``context_parallel_size`` is ring attention through ring-flash-attn (``ring_attn_func`` batch_ring or
  varlen_llama3; zigzag variants are commented out of its enum); it has no Ulysses.
- ArcticTraining's ``sequence_parallel_size`` is DeepSpeed Ulysses (ALST); it runs DeepSpeed ZeRO only, has no ring
  attention and no selective checkpointing. A DeepSpeed JSON's ``sequence_parallel_size`` is the same Ulysses.
- None of them splits the decoder layers between checkpointing policies (the plan's checkpoint_layers, offload_layers):
  accelerate's FSDP checkpointing wraps every layer, transformers' checkpointing (TRL, Axolotl, ArcticTraining) has
  ``every_n_layers`` (every n-th layer, not the first k) and one offload switch for all of them. The nearest is the
  policy on every layer (and every checkpointed input offloaded): less GPU memory than the plan, more recomputation.
- TRL >= 1.15 computes the SFT loss through a fused LM head, chunk by chunk ("without materializing the full logits"):
  seqpar's ``chunked``; it has no switch back to full logits. TRL 1.16's SFTTrainer warns that ``use_liger_kernel`` is
  deprecated (FutureWarning, removal in 2.0; trl/trainer/sft_trainer.py): the row has no Liger kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import describe
from seqpar.plan.specs import Strategy

ALL_SHARDINGS = ("ddp", "zero2", "zero3", "zero3_offload", "fsdp")
DEEPSPEED_ONLY = {"ddp": "zero2", "zero2": "zero2", "zero3": "zero3", "zero3_offload": "zero3_offload", "fsdp": "zero3"}
FSDP_ONLY = dict.fromkeys(ALL_SHARDINGS, "fsdp")
SAME_SHARDING = {s: s for s in ALL_SHARDINGS}
ZERO = {"ddp": "ddp", "zero2": "zero2", "zero3": "zero3", "zero3_offload": "zero3_offload", "fsdp": "zero3"}
OPTIONS = ("checkpointing", "loss_impl", "fused_ops", "tiled_mlp")  # plan choices a row maps value by value


class Unsupported(SeqparError):
    """A plan choice the tool's row does not run and maps to nothing it runs."""


@dataclass(frozen=True)
class Caps:
    """How one tool expresses a plan's choices: plan value -> the tool's nearest value (itself when it has it)."""

    tool: str
    runs: dict[str, str]  # the modes the tool runs itself -> the key that turns each on ("" where no key is needed)
    shardings: dict[str, dict[str, str]]  # mode it runs -> {plan sharding -> tool sharding}
    checkpointing: dict[str, str] = field(default_factory=lambda: {c: c for c in ("none", "full", "offload", "selective")})
    loss_impl: dict[str, str] = field(default_factory=lambda: {"hf": "hf", "chunked": "chunked"})
    fused_ops: dict[str, str] = field(default_factory=lambda: {"none": "none", "liger": "liger"})
    tiled_mlp: dict[bool, bool] = field(default_factory=lambda: {False: False, True: True})
    why: dict[str, str] = field(default_factory=dict)  # "field value" -> why the tool lacks it (a clause)
    approx: dict[str, str] = field(default_factory=dict)  # mode it runs -> how the tool runs it, when not seqpar's kernel
    adjust: Callable[[Strategy], tuple[Strategy, list[str]]] | None = None  # rules across choices (e.g. FSDP's policies)
    layer_split: bool = False  # the tool runs checkpoint_layers / offload_layers (none of today's tools does)
    # on CPU ranks: "ranks" (any job of several processes), "mode <m>", "checkpointing <c>" or "sharding <s>" -> why
    # the tool's release cannot run it there
    cpu: dict[str, str] = field(default_factory=dict)

    def runtime(self) -> dict:
        """How the cost model prices what this tool runs (estimate_memory's, predict's and the search's evaluate's
        keywords): a tiled MLP there leaves the model's own norms whole (seqpar's runtime tiles them too), and TRL's
        SFTTrainer runs its own loss (its fused LM head)."""
        return {"norms_tiled": False, "loss_path": "trl" if self.tool == "trl" else "seqpar"}

    def modes_for(self, mode: str) -> tuple[str, ...]:
        """The modes this tool runs for the plan's ``mode``, nearest first (the mode's description says which)."""
        runs = describe(mode).exports.get(self.tool, ())
        if not runs:
            raise Unsupported(
                f"{self.tool} runs no equivalent of mode {mode} (its registered description has no {self.tool} export "
                f"row); use seqpar launch, or another --emit target"
            )
        for m in runs:
            self.native(m)
        return runs

    def native(self, mode: str) -> str:
        """The key that turns on a mode the tool runs ("" where none is needed); Unsupported for one it does not run."""
        if mode not in self.runs or mode not in self.shardings:
            raise Unsupported(
                f"{self.tool} does not run mode {mode} (its capability row runs {', '.join(self.runs)}); use seqpar "
                "launch, or another --emit target"
            )
        return self.runs[mode]

    def mode_named(self, key: str) -> str:
        """The mode a key of the tool's config turns on (reading a config back)."""
        return next(m for m, k in self.runs.items() if k == key)

    def sharding(self, mode: str, sharding: str) -> str:
        """The sharding the tool runs ``mode`` on for the plan's ``sharding``."""
        self.native(mode)
        row = self.shardings[mode]
        if sharding not in row:
            raise Unsupported(f"{self.tool}'s capability row has no sharding {sharding} for {mode}; use seqpar launch")
        return row[sharding]

    def option(self, name: str, value):
        """The tool's nearest value for the plan's option ``name`` = ``value`` (checkpointing, loss_impl, fused_ops,
        tiled_mlp)."""
        row = getattr(self, name)
        if value not in row:
            raise Unsupported(f"{self.tool}'s capability row has no {name} {value}; use seqpar launch, or another --emit target")
        return row[value]


def fsdp_checkpointing(s: Strategy) -> tuple[Strategy, list[str]]:
    """Under FSDP accelerate applies checkpointing itself (fsdp_activation_checkpointing[_offload]): no selective policy."""
    if s.sharding == "fsdp" and s.checkpointing == "selective":
        note = "accelerate's FSDP2 checkpointing has no selective policy; emitted checkpointing full instead"
        return s.model_copy(update={"checkpointing": "full"}), [note]
    return s, []


# On CPU ranks (accelerate 1.16 commands/launch.py, utils/launch.py, state.py; DeepSpeed 0.19.8; run by
# tests/emit/test_tool_runs.py): distributed_type MULTI_CPU goes to the simple launcher, one process (several need
# mpirun); the DeepSpeed and FSDP launchers start every rank through torchrun but pass no use_cpu on, so a script's
# Accelerator() counts one process on each. The HF Trainer (TRL) builds its accelerator from use_cpu itself: DeepSpeed's
# ZeRO then runs on the ranks as emitted, FSDP falls back to DDP (state.py picks FSDP for the GPU kinds of
# distributed_type only), and ParallelismConfig refuses cp_size on MULTI_CPU.
ONE_PROCESS = (
    "accelerate launch starts one process for distributed_type MULTI_CPU (its simple launcher; several CPU processes "
    "need mpirun), so the job's {world} ranks would train as one; train on CPU ranks with seqpar launch"
)
CPU_LAUNCH = (
    "accelerate launch runs no job of several CPU ranks: distributed_type MULTI_CPU starts one process (several need "
    "mpirun), and its DeepSpeed and FSDP launchers start the {world} ranks without the config's use_cpu, so each rank's "
    "Accelerator() counts one process (FSDP then neither shards nor averages gradients, and cp_size is refused); train "
    "on CPU ranks with seqpar launch"
)
TRL_CPU = {
    "mode zigzag_ring_attn": "accelerate's ParallelismConfig refuses cp_size there (only FSDP2, Multi{{Device}} or "
    "DeepSpeed, got MULTI_CPU); train on CPU ranks with seqpar launch",
    "mode ulysses_attn": "DeepSpeed's UlyssesSPDataLoaderAdapter all-gathers every batch over the sequence group and "
    "gloo refuses rows of unequal lengths (ProcessGroupGloo::allgather: invalid tensor size); train on CPU ranks with "
    "seqpar launch",
    "checkpointing offload": "transformers' checkpoint offload keeps the checkpointed inputs in pinned host memory, "
    "which needs an accelerator (pin_memory=True requires a CUDA or other accelerator backend); train on CPU ranks with "
    "seqpar launch",
    "sharding ddp": ONE_PROCESS,
    "sharding fsdp": "accelerate runs FSDP on GPUs only, so its {world} CPU ranks train as DDP, without FSDP's sharding "
    "or checkpointing; emit --sharding zero2 or zero3 (DeepSpeed's ZeRO runs there), or train with seqpar launch",
}
ULYSSES_ALST = "Ulysses runs as DeepSpeed's ALST (the same all-to-alls): predicted as seqpar's ulysses_attn"
ACCELERATE_WHY = {
    "mode dist_flash_attn": "no tool runs LightSeq's dist_flash_attn schedule; its nearest is ring attention (accelerate's torch context parallelism)",
    "mode usp_attn->ulysses_attn": "accelerate cannot combine Ulysses and ring (its sp_size and cp_size are mutually exclusive)",
    "mode usp_attn->zigzag_ring_attn": "accelerate cannot combine Ulysses and ring, and the heads do not split for Ulysses alone",
    "sharding ->fsdp": "accelerate runs torch context parallelism on FSDP2 only",
    "sharding ->zero2": "accelerate runs DeepSpeed's Ulysses on ZeRO only (stage 2 nearest DDP's replicas)",
    "sharding ->zero3": "accelerate runs DeepSpeed's Ulysses on ZeRO only (stage 3 nearest FSDP)",
}
ACCELERATE_APPROX = {
    "zigzag_ring_attn": "ring attention runs as torch context parallelism (head-tail balanced like zigzag, SDPA kernels, "
    "cp_comm_strategy alltoall): predicted as seqpar's zigzag_ring_attn",
    "ulysses_attn": ULYSSES_ALST,
}
# accelerate's ParallelismConfig axis per mode: sp_size (DeepSpeed's Ulysses), cp_size (torch context parallelism)
ACCELERATE_RUNS = {"data_parallel": "", "ulysses_attn": "sp_size", "zigzag_ring_attn": "cp_size"}
ACCELERATE_SHARDINGS = {"data_parallel": SAME_SHARDING, "ulysses_attn": DEEPSPEED_ONLY, "zigzag_ring_attn": FSDP_ONLY}
TRL_LIGER = (
    "TRL 1.16 deprecates use_liger_kernel (removed in 2.0), and its replacement, model_init_kwargs use_kernels, loads "
    "Hub kernels (Liger's RMSNorm, on CUDA), not Liger's SwiGLU and RoPE"
)
AXOLOTL_RING = (
    "ring attention runs through ring-flash-attn's batch_ring (axolotl accepts no zigzag variant): the same K/V rotation "
    "over contiguous chunks, less even causal work; predicted as seqpar's zigzag_ring_attn"
)

TABLE: dict[str, Caps] = {
    "accelerate": Caps(
        "accelerate",
        runs=ACCELERATE_RUNS,
        shardings=ACCELERATE_SHARDINGS,
        why=ACCELERATE_WHY,
        approx=ACCELERATE_APPROX,
        adjust=fsdp_checkpointing,
        cpu={"ranks": CPU_LAUNCH},
    ),
    "trl": Caps(
        "trl",
        runs=ACCELERATE_RUNS,  # SFTTrainer runs accelerate's parallelism
        shardings=ACCELERATE_SHARDINGS,
        loss_impl={"hf": "chunked", "chunked": "chunked"},
        fused_ops={"none": "none", "liger": "none"},
        tiled_mlp={False: False, True: False},
        why={
            **ACCELERATE_WHY,
            "loss_impl hf": "TRL >= 1.15 computes the SFT loss through a fused LM head a chunk at a time (no full-logits switch)",
            "fused_ops liger": TRL_LIGER,
            "tiled_mlp True": "TRL, transformers and accelerate have no TiledMLP",
        },
        approx=ACCELERATE_APPROX,
        adjust=fsdp_checkpointing,
        cpu=TRL_CPU,
    ),
    "axolotl": Caps(
        "axolotl",
        runs={"data_parallel": "", "zigzag_ring_attn": "context_parallel_size"},
        shardings={"data_parallel": SAME_SHARDING, "zigzag_ring_attn": SAME_SHARDING},
        why={
            "mode ulysses_attn": "axolotl has no Ulysses (its context parallelism is ring attention only)",
            "mode dist_flash_attn": "no tool runs LightSeq's dist_flash_attn schedule; its nearest in axolotl is ring attention",
            "mode usp_attn": "axolotl has no Ulysses half for usp_attn: ring attention over all its ranks",
        },
        approx={"zigzag_ring_attn": AXOLOTL_RING},
        cpu={
            # axolotl 0.19's train command launches with accelerate, whose process count it takes from the GPUs it sees
            "ranks": "axolotl train starts one process where it sees no GPU (accelerate launch with num_processes 0: "
            "its simple launcher), so the job's {world} ranks would train as one; train on CPU ranks with seqpar launch",
            "mode zigzag_ring_attn": "axolotl's context parallelism runs ring-flash-attn's flash-attn kernels, which need "
            "CUDA GPUs (the config says attn_implementation flash_attention_2, which axolotl's validator requires for "
            "context_parallel_size > 1); train on CPU ranks with seqpar launch",
        },
    ),
    "arctic": Caps(
        "arctic",
        runs={"data_parallel": "", "ulysses_attn": "sequence_parallel_size"},
        shardings={"data_parallel": DEEPSPEED_ONLY, "ulysses_attn": DEEPSPEED_ONLY},
        checkpointing={"none": "none", "full": "full", "offload": "offload", "selective": "full"},
        loss_impl={"hf": "chunked", "chunked": "chunked"},
        why={
            "mode zigzag_ring_attn": "ArcticTraining has no ring attention (its sequence parallelism is DeepSpeed Ulysses)",
            "mode dist_flash_attn": "no tool runs LightSeq's dist_flash_attn schedule; ArcticTraining's nearest is Ulysses",
            "mode usp_attn": "ArcticTraining has no ring half for usp_attn: Ulysses over all its ranks",
            "sharding ddp": "ArcticTraining runs DeepSpeed ZeRO only (stage 2 nearest DDP's replicas)",
            "sharding fsdp": "ArcticTraining runs DeepSpeed ZeRO only (stage 3 nearest FSDP)",
            "checkpointing selective": "ArcticTraining has no selective checkpointing",
            "loss_impl hf": "ArcticTraining computes the loss a tile of logits at a time (no full-logits switch)",
        },
        approx={"ulysses_attn": ULYSSES_ALST},
    ),
    "deepspeed": Caps(
        "deepspeed",
        runs={"data_parallel": "", "ulysses_attn": "sequence_parallel_size"},
        shardings={"data_parallel": ZERO, "ulysses_attn": {**ZERO, "ddp": "zero2"}},
        why={
            "mode zigzag_ring_attn": "DeepSpeed's sequence parallelism is Ulysses only",
            "mode dist_flash_attn": "DeepSpeed's sequence parallelism is Ulysses only",
            "mode usp_attn": "DeepSpeed's sequence parallelism is Ulysses only (no ring half)",
            "sharding fsdp": "DeepSpeed has no FSDP (ZeRO stage 3 is its full sharding)",
            "sharding ddp->zero2": "DeepSpeed's Ulysses runs on ZeRO stages >= 1 (stage 2 nearest DDP's replicas)",
        },
        approx={"ulysses_attn": ULYSSES_ALST},
        layer_split=True,  # checkpointing is the script's (seqpar.apply's checkpoint_layers / offload_layers can split it)
    ),
}


def caps(tool: str) -> Caps:
    """A tool's row; SeqparError naming the tools for an unknown one."""
    if tool not in TABLE:
        raise SeqparError(f"--emit {tool!r} is not a tool seqpar writes for; use one of {', '.join(TABLE)}")
    return TABLE[tool]


def cannot_run(caps: Caps, s: Strategy, accelerator: str, world_size: int) -> list[str]:
    """Why the tool cannot run ``s`` on a cluster of ``world_size`` ``accelerator`` ranks as written, one sentence each
    ([] where it runs; on CUDA nothing is known to stop it). What ``--emit`` and ``check`` say instead of "fits"."""
    if accelerator == "cuda":
        return []
    keys = [f"mode {s.mode}", f"checkpointing {s.checkpointing}", "ranks", f"sharding {s.sharding}"]
    keys = [k for k in keys if k in caps.cpu and (world_size > 1 or k.startswith("mode"))]
    # the first is where the run stops (a refused mode before the engine it would have run on)
    return [f"{caps.tool} cannot run this on CPU ranks: " + caps.cpu[k].format(world=world_size) for k in keys[:1]]


def deepspeed_ulysses(s: Strategy) -> bool:
    """Whether ``s`` runs as DeepSpeed's sequence parallelism (its JSON then carries the Ulysses keys)."""
    return bool(TABLE["deepspeed"].runs.get(s.mode))


__all__ = [
    "ALL_SHARDINGS",
    "Caps",
    "DEEPSPEED_ONLY",
    "FSDP_ONLY",
    "OPTIONS",
    "SAME_SHARDING",
    "TABLE",
    "Unsupported",
    "ZERO",
    "cannot_run",
    "caps",
    "deepspeed_ulysses",
    "fsdp_checkpointing",
]
