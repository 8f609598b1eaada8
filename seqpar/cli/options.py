"""The options `seqpar advise` and `seqpar check` share, declared once, and the one function that makes them a request.

``RequestFlags`` holds the workload, cluster and pin options: each field's ``Annotated`` typer.Option is its declaration
(flag, help, help panel). ``with_request_flags`` gives a command those options before its own (typer reads the signature
it builds) and hands them to the command as one ``flags: RequestFlags``; ``advise_request(flags, seq_len)`` resolves the
cluster and builds the AdviseRequest. A new pin is one field here and one in AdviseRequest.
Importing this module must not import torch (nor the advisor: commands import it when they run).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Optional, get_args, get_type_hints

import typer

from seqpar.plan.base import Checkpointing, FusedOps, KeptSaves, LossImpl, Mode, Optimizer, Sharding
from seqpar.plan.job_options import parse_checkpoint_every
from seqpar.plan.launch_plan import TrainingSpec
from seqpar.plan.modes import names as mode_names
from seqpar.plan.options import KEEP_LAST
from seqpar.plan.specs import LORA_ALL_LINEAR

if TYPE_CHECKING:
    from seqpar.advisor.request import AdviseRequest
    from seqpar.plan.specs import LoraSpec

WORKLOAD, CLUSTER, PINS, OUTPUT = "Workload", "Cluster", "Pins (default: the advisor chooses)", "Output"
LORA = "LoRA (default: full fine-tuning)"


@dataclass(frozen=True)
class RequestFlags:
    """What the user asks about: the workload, the cluster (flags, else the probe, else the default) and the pinned choices."""

    seq_len: Annotated[
        Optional[str],
        typer.Option(
            "--seq-len",
            "-s",
            rich_help_panel=WORKLOAD,
            help="Tokens per sequence: 131072, 128k, 512K, 1M (k = 1024, M = 1024^2).",
        ),
    ] = None
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            "--model-path",
            rich_help_panel=WORKLOAD,
            help="Profile name (seqpar profiles list), Hub id, or a local config.json / folder.",
        ),
    ] = "llama-2-7b"
    optimizer: Annotated[Optimizer, typer.Option("--optimizer", rich_help_panel=WORKLOAD, help="Optimizer of the workload.")] = (
        "adamw"
    )
    micro_batch: Annotated[
        int,
        typer.Option(
            "--micro-batch",
            "--per-device-train-batch-size",
            min=1,
            rich_help_panel=WORKLOAD,
            help="Sequences per data-parallel rank per forward pass.",
        ),
    ] = 1
    tokens_per_step: Annotated[
        Optional[int],
        typer.Option(
            "--tokens-per-step", min=1, rich_help_panel=WORKLOAD, help="Tokens per optimizer step (sets gradient accumulation)."
        ),
    ] = None
    # the Hugging Face Trainer's spelling, answered: seqpar's step is set in tokens, since dp is the search's choice
    gradient_accumulation_steps: Annotated[Optional[int], typer.Option("--gradient-accumulation-steps", min=1, hidden=True)] = (
        None
    )
    # packed documents: the length mix (seqpar.advisor.doc_lens says what each source assumes); none = one document per window
    doc_lens: Annotated[
        Optional[str],
        typer.Option(
            "--doc-lens",
            metavar="FILE",
            rich_help_panel=WORKLOAD,
            help="Packed documents' lengths in tokens: one integer per line, a JSON list, or a `length,count` CSV.",
        ),
    ] = None
    mean_doc_len: Annotated[
        Optional[int],
        typer.Option(
            "--mean-doc-len",
            rich_help_panel=WORKLOAD,
            help="Packed documents of this mean length: the long-tail mix (log-normal, sigma 1.6, >= 16 tokens).",
        ),
    ] = None
    data: Annotated[
        Optional[str],
        typer.Option(
            "--data",
            metavar="FILE",
            rich_help_panel=WORKLOAD,
            help="Packed documents' lengths from a sample of the data: .jsonl (characters/4) or .bin/.npy (with --eos-id).",
        ),
    ] = None
    eos_id: Annotated[
        Optional[int],
        typer.Option("--eos-id", rich_help_panel=WORKLOAD, help="The token id ending each document of a --data .bin/.npy."),
    ] = None
    lora_rank: Annotated[
        Optional[int],
        typer.Option(
            "--lora-rank",
            min=1,
            rich_help_panel=LORA,
            help="Train LoRA adapters of this rank (peft's r) on a frozen base instead of every weight.",
        ),
    ] = None
    lora_alpha: Annotated[
        Optional[float],
        typer.Option("--lora-alpha", rich_help_panel=LORA, help="LoRA alpha: the update is scaled by alpha / rank (default 32)."),
    ] = None
    lora_dropout: Annotated[
        Optional[float],
        typer.Option("--lora-dropout", rich_help_panel=LORA, help="Dropout on each adapter's input, 0 to < 1 (default 0)."),
    ] = None
    lora_targets: Annotated[
        Optional[str],
        typer.Option(
            "--lora-targets",
            metavar="NAMES",
            rich_help_panel=LORA,
            help="Comma list of the linear layers that get adapters, e.g. q_proj,v_proj; default all-linear: "
            + " ".join(LORA_ALL_LINEAR)
            + ".",
        ),
    ] = None
    qlora: Annotated[
        bool,
        typer.Option(
            "--qlora",
            rich_help_panel=LORA,
            help="QLoRA: the frozen base's linear layers in 4-bit NF4 (bitsandbytes, double quantization).",
        ),
    ] = False
    gpu: Annotated[
        Optional[str],
        typer.Option("--gpu", rich_help_panel=CLUSTER, help="GPU profile of the declared cluster, e.g. a100, h100, h200."),
    ] = None
    gpus: Annotated[
        Optional[int], typer.Option("--gpus", min=1, rich_help_panel=CLUSTER, help="GPUs per node of the declared cluster.")
    ] = None
    nodes: Annotated[
        Optional[int], typer.Option("--nodes", "--nnodes", min=1, rich_help_panel=CLUSTER, help="Nodes of the declared cluster.")
    ] = None
    cluster: Annotated[
        Optional[str],
        typer.Option("--cluster", rich_help_panel=CLUSTER, help="cpu:N for N gloo CPU ranks (instead of --gpu/--gpus/--nodes)."),
    ] = None
    host_ram_gib: Annotated[
        Optional[float],
        typer.Option(
            "--host-ram-gib", min=1, rich_help_panel=CLUSTER, help="Host RAM per node, GiB (default: 2x the node's GPU memory)."
        ),
    ] = None
    pinned_host_gib: Annotated[
        Optional[float],
        typer.Option(
            "--pinned-host-gib",
            rich_help_panel=CLUSTER,
            help="Host RAM per node, GiB, that seqpar may page-lock for offloaded layers and kept matmul outputs "
            "(default: 40% of the host RAM).",
        ),
    ] = None
    mode: Annotated[
        Optional[Mode],  # a registered mode (seqpar.plan.modes), checked when the command runs
        typer.Option(
            "--mode", metavar="MODE", rich_help_panel=PINS, help=f"The sequence-parallel mode. One of: {', '.join(mode_names())}."
        ),
    ] = None
    sp_degree: Annotated[
        Optional[int], typer.Option("--sp-degree", min=1, rich_help_panel=PINS, help="The sequence-parallel degree.")
    ] = None
    ulysses_degree: Annotated[
        Optional[int],
        typer.Option("--ulysses-degree", min=1, rich_help_panel=PINS, help="The Ulysses degree (usp_attn)."),
    ] = None
    checkpointing: Annotated[
        Optional[Checkpointing],
        typer.Option("--checkpointing", rich_help_panel=PINS, help="Activation checkpointing."),
    ] = None
    checkpoint_layers: Annotated[
        Optional[int],
        typer.Option(
            "--recompute-layers",
            min=0,
            rich_help_panel=PINS,
            help="Layers recomputed in backward, from the first (default: as few as memory allows).",
        ),
    ] = None
    offload_layers: Annotated[
        Optional[int],
        typer.Option(
            "--offload-layers",
            min=0,
            rich_help_panel=PINS,
            help="With checkpointing offload: layers whose input goes to host RAM (default: as few as fit).",
        ),
    ] = None
    offload_stride: Annotated[
        Optional[int],
        typer.Option(
            "--offload-stride",
            min=1,
            rich_help_panel=PINS,
            help="With checkpointing offload: one offloaded layer input in K goes to host RAM, backward recomputes the "
            "others (one more forward of those layers; default 1, more only where the host's RAM needs it).",
        ),
    ] = None
    kept_saves: Annotated[
        Optional[KeptSaves],
        typer.Option(
            "--kept-saves",
            rich_help_panel=PINS,
            help="What the layers past the recomputed ones keep: all (default) or matmuls (matmul outputs and "
            "attention's out + lse: about 2/3 of the memory).",
        ),
    ] = None
    kept_host_layers: Annotated[
        Optional[int],
        typer.Option(
            "--kept-host-layers",
            min=0,
            rich_help_panel=PINS,
            help="With --kept-saves matmuls: at most this many kept layers hold them in pinned host memory; the "
            "fastest count wins (default 0).",
        ),
    ] = None
    sharding: Annotated[Optional[Sharding], typer.Option("--sharding", rich_help_panel=PINS, help="Model-state sharding.")] = None
    loss_impl: Annotated[
        Optional[LossImpl], typer.Option("--loss-impl", rich_help_panel=PINS, help="The loss implementation.")
    ] = None
    fused_ops: Annotated[
        Optional[FusedOps],
        typer.Option(
            "--fused-ops",
            rich_help_panel=PINS,
            help="liger: Liger-Kernel's fused RMSNorm, RoPE and SwiGLU (CUDA; pip install liger-kernel); default none.",
        ),
    ] = None
    tiled_mlp: Annotated[
        Optional[bool],
        typer.Option(
            "--tiled-mlp/--no-tiled-mlp",
            rich_help_panel=PINS,
            help="Each MLP a tile of the sequence at a time: less memory, one more MLP forward (default: both tried).",
        ),
    ] = None

    def __post_init__(self) -> None:
        """What typer's types let through and no request can mean: an empty name, an infinite or NaN amount of RAM."""
        import math

        from seqpar.plan.errors import SeqparError

        for flag, v in (("--gpu", self.gpu), ("--model", self.model), ("--cluster", self.cluster)):
            if v is not None and not v.strip():
                raise SeqparError(
                    f"{flag} is empty; name one (e.g. {'--gpu h100' if flag == '--gpu' else flag + ' ...'}) or leave the flag out"
                )
        if self.host_ram_gib is not None and not math.isfinite(self.host_ram_gib):
            raise SeqparError(f"--host-ram-gib {self.host_ram_gib} is not a finite amount of RAM; give GiB per node, e.g. 1024")

    def lora_spec(self) -> Optional[LoraSpec]:
        """The LoRA the flags ask for (None: full fine-tuning); SeqparError naming the flag for a value no adapter takes,
        or a LoRA flag without --lora-rank."""
        import math

        from seqpar.plan.errors import SeqparError
        from seqpar.plan.specs import LoraSpec

        given = [
            f
            for f, v in (
                ("--lora-alpha", self.lora_alpha),
                ("--lora-dropout", self.lora_dropout),
                ("--lora-targets", self.lora_targets),
                ("--qlora", self.qlora or None),
            )
            if v is not None
        ]
        if self.lora_rank is None:
            if given:
                raise SeqparError(
                    f"{given[0]} shapes LoRA adapters, but no --lora-rank turns them on; add --lora-rank (e.g. "
                    f"--lora-rank 32), or drop {given[0]}"
                )
            return None
        most = LoraSpec.model_fields["rank"].metadata[-1].le
        if self.lora_rank > most:
            raise SeqparError(f"--lora-rank {self.lora_rank} is above {most}; give a rank from 1 to {most} (e.g. 32)")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise SeqparError(f"--lora-alpha {self.lora_alpha} must be a finite number > 0; e.g. --lora-alpha {self.lora_rank}")
        if self.lora_dropout is not None and not (0 <= self.lora_dropout < 1):
            raise SeqparError(f"--lora-dropout {self.lora_dropout} is not from 0 to below 1; e.g. --lora-dropout 0.05")
        kw: dict = {"rank": self.lora_rank, "base_dtype": "nf4" if self.qlora else "bf16"}
        if self.lora_alpha is not None:
            kw["alpha"] = self.lora_alpha
        if self.lora_dropout is not None:
            kw["dropout"] = self.lora_dropout
        if self.lora_targets is not None:
            kw["target_modules"] = lora_targets(self.lora_targets)
        return LoraSpec(**kw)

    def pins(self) -> dict:
        """The pinned choices (the fields in the Pins panel), by name: AdviseRequest's names for them."""
        hints = get_type_hints(RequestFlags, include_extras=True)
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if get_args(hints[f.name])[1].rich_help_panel == PINS
        }


def with_request_flags(command):
    """Add RequestFlags' options to ``command`` (before its own); the command receives them as ``flags``."""
    return with_dataclass_flags(command, RequestFlags, "flags")


def with_dataclass_flags(command, cls, name: str):
    """Add the options of the dataclass ``cls`` (its fields' typer annotations) to ``command`` before its own; the command
    receives them as one ``cls`` instance in its parameter ``name``."""
    fields = dataclasses.fields(cls)
    hints = get_type_hints(cls, include_extras=True)
    shared = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name]) for f in fields
    ]
    own = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(command).parameters.values() if p.name != name
    ]  # typer passes every parameter by name; the shared panels come first in --help

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        value = cls(**{f.name: kwargs.pop(f.name) for f in fields})
        return command(*args, **{name: value}, **kwargs)

    wrapper.__signature__ = inspect.Signature(shared + own)
    return wrapper


def advise_request(flags: RequestFlags, seq_len: int, policy: str = "cost", note=print) -> tuple[AdviseRequest, str]:
    """The request the flags describe for seq_len tokens, and where its cluster came from (``note`` says it on stderr)."""
    from seqpar.advisor.cluster import resolve_cluster
    from seqpar.advisor.request import AdviseRequest
    from seqpar.profiles import get_model

    if flags.gradient_accumulation_steps is not None:
        from seqpar.plan.errors import SeqparError

        ga = flags.gradient_accumulation_steps
        raise SeqparError(
            f"--gradient-accumulation-steps {ga}: seqpar sets accumulation from --tokens-per-step, since the "
            "data-parallel degree is the search's choice (tokens per step = micro-batch x seq_len x dp x accumulation); "
            f"give --tokens-per-step {ga} x {flags.micro_batch} x {seq_len} x the dp you want, e.g. --tokens-per-step "
            f"{ga * flags.micro_batch * seq_len} at dp 1"
        )
    lora = flags.lora_spec()  # refused before the model and the cluster are looked up
    model = get_model(flags.model)
    mix = request_doc_mix(flags, seq_len if flags.seq_len is not None else None, model.vocab_size)
    if mix is not None:
        note(f"documents: {mix.source}; attention {100 * mix.at(seq_len).sum_sq_fraction:.2g}% of one document per window")
    cl, cluster_note = resolve_cluster(
        flags.gpu, flags.gpus, flags.nodes, flags.cluster, flags.host_ram_gib, pinned_host=flags.pinned_host_gib
    )
    note(f"cluster: {cluster_note}")
    req = AdviseRequest(
        model=model,
        seq_len=seq_len,
        cluster=cl,
        micro_batch_size=flags.micro_batch,
        tokens_per_step=flags.tokens_per_step,
        dtype="fp32" if cl.accelerator == "cpu" else "bf16",
        optimizer=flags.optimizer,
        lora=lora,
        doc_lens=mix,
        policy=policy,
        **flags.pins(),
    )
    return req, cluster_note


# --------------------------------------------------------------------------------------------- training settings (advise)

TRAINING = "Training (default: the plan's defaults)"
_T = TrainingSpec.model_fields  # the defaults the help states are the schema's
LrSchedule = _T["lr_schedule"].annotation


@dataclass(frozen=True)
class TrainingFlags:
    """`seqpar advise`'s training settings: what plan.training holds (steps, schedule, RoPE base, checkpoints)."""

    steps: Annotated[
        Optional[int],
        typer.Option(
            "--steps", "--max-steps", min=1, rich_help_panel=TRAINING, help=f"Optimizer steps (default {_T['steps'].default})."
        ),
    ] = None
    lr: Annotated[
        Optional[float],
        typer.Option(
            "--lr",
            "--learning-rate",
            rich_help_panel=TRAINING,
            help=f"Peak learning rate (default {_T['learning_rate'].default:g}).",
        ),
    ] = None
    warmup: Annotated[
        Optional[int],
        typer.Option("--warmup", "--warmup-steps", min=0, rich_help_panel=TRAINING, help="Linear warmup steps (default 0)."),
    ] = None
    lr_schedule: Annotated[
        Optional[LrSchedule],
        typer.Option("--lr-schedule", rich_help_panel=TRAINING, help="After warmup: constant (default) or cosine."),
    ] = None
    weight_decay: Annotated[
        Optional[float],
        typer.Option("--weight-decay", min=0, rich_help_panel=TRAINING, help="AdamW weight decay (default 0)."),
    ] = None
    rope_theta: Annotated[
        Optional[float],
        typer.Option(
            "--rope-theta",
            rich_help_panel=TRAINING,
            help="RoPE base to train with (default: the model's); raise it to train past max_position_embeddings.",
        ),
    ] = None
    checkpoint_every: Annotated[
        Optional[str],
        typer.Option(
            "--checkpoint-every",
            "--save-steps",
            metavar="N|auto",
            rich_help_panel=TRAINING,
            help="Steps between checkpoints; 0 = only the final one; auto (default) = about hourly from the predicted step time.",
        ),
    ] = None
    keep_last: Annotated[
        Optional[int],
        typer.Option(
            "--keep-last",
            "--save-total-limit",
            min=0,
            rich_help_panel=TRAINING,
            help=f"Checkpoints kept, newest first; 0 = all (default {KEEP_LAST}).",
        ),
    ] = None
    seed: Annotated[
        Optional[int],
        typer.Option(
            "--seed",
            min=0,
            rich_help_panel=TRAINING,
            help=f"Seed of the weights, data order and dropout (default {_T['seed'].default}).",
        ),
    ] = None

    def overrides(self) -> dict:
        """The given settings under TrainingSpec's names; SeqparError naming the flag for a value no run can use."""
        import math

        from seqpar.plan.errors import SeqparError

        for flag, v, low in (
            ("--lr", self.lr, "> 0"),
            ("--weight-decay", self.weight_decay, ">= 0"),
            ("--rope-theta", self.rope_theta, "> 0"),
        ):
            if v is not None and (not math.isfinite(v) or v < 0 or (v == 0 and low == "> 0")):
                raise SeqparError(
                    f"{flag} {v} must be a finite number {low}; e.g. {flag} {'2e-5' if flag == '--lr' else '0.1' if flag == '--weight-decay' else '1e6'}"
                )
        from seqpar.cli.params import read_text

        every = self.checkpoint_every
        every = None if every is None else read_text("--checkpoint-every", every, parse_checkpoint_every)
        given = {
            "steps": self.steps,
            "learning_rate": self.lr,
            "warmup_steps": self.warmup,
            "lr_schedule": self.lr_schedule,
            "weight_decay": self.weight_decay,
            "rope_theta": self.rope_theta,
            "keep_last": self.keep_last,
            "seed": self.seed,
        }
        out = {k: v for k, v in given.items() if v is not None}
        if self.checkpoint_every is not None:
            out["checkpoint_every"] = None if every == "auto" else every
        return out


def with_training_flags(command):
    """Add TrainingFlags' options to ``command`` (before its own); the command receives them as ``training``."""
    return with_dataclass_flags(command, TrainingFlags, "training")


def lora_targets(text: str) -> list[str]:
    """--lora-targets' comma list as LoraSpec.target_modules: all-linear (peft's word) for all seven; SeqparError with
    one line for an empty list, a name twice or a name that is no linear layer of a decoder block."""
    from seqpar.plan.errors import SeqparError

    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["all-linear"]:
        return list(LORA_ALL_LINEAR)
    if not names:
        raise SeqparError(f"--lora-targets {text!r} names no layer; give e.g. --lora-targets q_proj,v_proj, or all-linear")
    for x in names:
        if x not in LORA_ALL_LINEAR:
            raise SeqparError(
                f"--lora-targets: {x!r} is not a linear layer of a decoder block; use a comma list of "
                f"{','.join(LORA_ALL_LINEAR)}, or all-linear"
            )
    twice = next((x for x in names if names.count(x) > 1), None)
    if twice:
        raise SeqparError(f"--lora-targets names {twice} twice; list each layer once")
    return sorted(names, key=LORA_ALL_LINEAR.index)


def request_doc_mix(flags: RequestFlags, seq_len: int | None, vocab_size: int):
    """The packed documents' mix the flags describe, or None (one document per window); ``seq_len``: the user's window."""
    from seqpar.advisor.doc_lens import doc_mix

    return doc_mix(flags.doc_lens, flags.mean_doc_len, flags.data, flags.eos_id, seq_len, vocab_size)


__all__ = [
    "CLUSTER",
    "LORA",
    "OUTPUT",
    "PINS",
    "RequestFlags",
    "TRAINING",
    "TrainingFlags",
    "WORKLOAD",
    "advise_request",
    "lora_targets",
    "request_doc_mix",
    "with_request_flags",
    "with_training_flags",
]
