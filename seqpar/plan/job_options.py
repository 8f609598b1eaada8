"""What a job's ranks read from their command line, declared once: the trainer's options (with the data's), the verify
job's, the eval job's, and what seqpar launch adds around them (where the nodes meet).

Each option is one field (seqpar.plan.flags.option: flag, help, default, type). seqpar launch, verify and eval build
their typer options from these fields (seqpar.cli.params), seqpar.plan.jobspec writes a job's argv with
``flags.to_argv``, and each rank parses it back with ``flags.OptionsParser``; an options class names the module that
reads it (``MODULE``). A new trainer option is a field of ``TrainOptions`` (seqpar launch offers it and passes it on)
and the code in seqpar.runtime.train that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from seqpar.plan.errors import SeqparError
from seqpar.plan.flags import option
from seqpar.plan.options import KEEP_LAST
from seqpar.plan.units import parse_seq_len

LONG_DOCUMENTS = ("split", "truncate", "error")  # what becomes of a document longer than the window
STREAM = "stream (--no-doc-boundaries), windows shuffled"
AUTO = "auto"  # --checkpoint-every auto: about hourly, from the measured step time
NEEDLE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DATA, CHECKPOINTS, TRACKING, NODES = "Data", "Checkpoints", "Tracking", "Nodes"  # the groups of the options' --help


def default_output(plan_path: str | Path) -> Path:
    """Where a run of the plan file writes unless told: runs/<the plan file's name>."""
    return Path("runs") / Path(plan_path).stem


def parse_checkpoint_every(text: str) -> int | str:
    """--checkpoint-every N|auto (advise, launch and the trainer): a number of steps >= 0, or "auto"."""
    if text == AUTO:
        return text
    if not text.isdigit():
        raise SeqparError(f"--checkpoint-every {text!r} is not a number of steps >= 0 or 'auto'; e.g. --checkpoint-every 500")
    return int(text)


def parse_depths(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SeqparError(f"--depths {text!r} must be a comma list of fractions in [0, 1], e.g. 0,0.25,0.5,0.75,1") from None


def parse_lengths(text: str) -> tuple[int, ...]:
    """'64k,128k' -> (65536, 131072): seqpar.plan.units.parse_seq_len of each."""
    return tuple(parse_seq_len(x) for x in text.split(",") if x.strip())


def _allow_env():
    """--allow-env: the trainer and the verify job load the plan with it, and the launcher sets the job's environment."""
    return option(
        (),
        "--allow-env",
        metavar="NAME",
        help="Let the plan's launch.env set NAME beyond the allow-list (names starting NCCL_, TORCH_NCCL_ or CUDA_, "
        "allocator and thread settings, seqpar's SEQPAR_PG_TIMEOUT_S and SEQPAR_PINNED_BUDGET_GIB); only for plans you trust: PYTHONPATH, LD_PRELOAD or PATH make the job "
        "run other code.",
    )


_TRUST_HELP = (
    "Run the Python code a model or tokenizer folder asks for (auto_map in config.json or tokenizer_config.json); only "
    "for folders you trust. Without it such a folder is refused."
)


def _comma_list(values) -> str:
    return ",".join(str(int(v)) if float(v).is_integer() else repr(float(v)) for v in values)


# --------------------------------------------------------------------------------------------- the trainer


@dataclass(frozen=True)
class DataOptions:
    """How ``--data`` becomes windows (seqpar.runtime.data.windows): the trainer's, which seqpar launch checks the data with."""

    doc_boundaries: bool = option(
        True,
        "--no-doc-boundaries",
        panel=DATA,
        help="Concatenate documents into windows that attend across them (the older stream).",
    )
    tokenizer: str | None = option(
        None, "--tokenizer", panel=DATA, help="Local tokenizer folder for text data (default: --model-path's)."
    )
    long_documents: str = option(
        "split",
        "--long-documents",
        choices=LONG_DOCUMENTS,
        panel=DATA,
        help="A document longer than seq_len: split (into window-sized pieces), truncate, error.",
    )
    cache: str | None = option(
        None, "--data-cache", panel=DATA, help="Folder of the tokenized-data cache (default ~/.cache/seqpar/data)."
    )
    procs: int | None = option(None, "--data-procs", min=1, panel=DATA, help="Tokenizer processes (default: the cores).")
    # Here, beside --tokenizer, because the launcher loads the tokenizer with the data options; the trainer reads it for
    # the model folder too.
    trust_remote_code: bool = option(False, "--trust-remote-code", help=_TRUST_HELP)

    @property
    def packing(self) -> str:
        """What a checkpoint records (resume refuses a change: it changes the windows)."""
        return f"documents, long ones: {self.long_documents}" if self.doc_boundaries else STREAM


@dataclass(frozen=True)
class TrainOptions:
    """The trainer's options (``python -m seqpar.runtime.train`` on every rank): what to train on, for how long and where
    to write; everything else is the plan's. seqpar launch offers them all but plan and init_from, which it sets per job
    (a staged plan's stage starts from the previous one's export), and async_checkpoint. The field order is the order
    of the flags in a job's command (plans record it)."""

    MODULE: ClassVar[str] = "seqpar.runtime.train"

    data: str = option(
        "synthetic",
        "--data",
        always=True,
        panel=DATA,
        help='synthetic, a .jsonl of {"text"} or {"messages"} rows, a .bin/.npy token file, or a datasets folder.',
    )
    output: str | None = option(
        None,
        "--output",
        aliases=("--output-dir",),
        help="Checkpoints, run report, metrics and log go here (default runs/PLAN, PLAN the plan file's name).",
    )
    steps: int | None = option(
        None,
        "--steps",
        min=1,
        aliases=("--max-steps",),
        help="Optimizer steps (default: the plan's; per stage for staged plans).",
    )
    model_path: str | None = option(
        None,
        "--model-path",
        aliases=("--model",),
        help="Hugging Face model folder or Hub id (owner/name, from the HF cache or downloaded; HF_TOKEN for gated "
        "repos, HF_HUB_OFFLINE=1: cache only). Default: the plan's model, random weights.",
    )
    resume: bool = option(False, "--resume", panel=CHECKPOINTS, help="Continue from the newest checkpoint in --output.")
    accept_foreign_run: bool = option(
        False,
        "--accept-foreign-run",
        panel=CHECKPOINTS,
        help="--resume or --init-from a run folder signed with another user's or machine's key (or by an older seqpar): "
        "only if you trust where it came from. Its files are still checked against their digests and read as "
        "safetensors and JSON only.",
    )
    init_from: str | None = option(
        None, "--init-from", help="A save_pretrained folder to start the weights from (a recipe's previous stage)."
    )
    report_to: str = option(
        "",
        "--report-to",
        panel=TRACKING,
        help="tensorboard,wandb: also log metrics there (accelerate's trackers; the run id survives --resume).",
    )
    checkpoint_every: int | str | None = option(
        None,
        "--checkpoint-every",
        aliases=("--save-steps",),
        metavar="N|auto",
        parse=parse_checkpoint_every,
        panel=CHECKPOINTS,
        help="Steps between checkpoints: 0 = only the final one, auto = about hourly (default: the plan's).",
    )
    keep_last: int | None = option(
        None,
        "--keep-last",
        aliases=("--save-total-limit",),
        min=0,
        panel=CHECKPOINTS,
        help=f"Checkpoints kept, newest first; 0 = all (default: the plan's training.keep_last, else {KEEP_LAST}).",
    )
    final_checkpoint: bool = option(
        True,
        "--no-final-checkpoint",
        panel=CHECKPOINTS,
        help="No checkpoint or export after the last step (benchmarks).",
    )
    merge_lora: bool = option(
        False,
        "--merge-lora",
        panel=CHECKPOINTS,
        help="LoRA plans: the final export holds the merged model (model/, for AutoModelForCausalLM) beside the adapter "
        "(adapter/, for peft's PeftModel.from_pretrained).",
    )
    skip_nonfinite: bool = option(
        False, "--skip-nonfinite", help="Skip the update of a step with a non-finite loss or gradient norm instead of stopping."
    )
    allow_env: tuple[str, ...] = _allow_env()
    data_options: DataOptions = field(default_factory=DataOptions)
    project: str | None = option(None, "--project", panel=TRACKING, help="Tracker project (default: seqpar).")
    run_name: str | None = option(
        None, "--run-name", panel=TRACKING, help="Tracker run name (default: the output folder's name)."
    )
    log_every: int = option(
        10, "--log-every", min=1, panel=TRACKING, help="A log line every N steps when there is no progress bar."
    )
    fsdp_cpu_offload: bool = option(
        False,
        "--fsdp-cpu-offload",
        help="FSDP2 plans on GPUs: keep parameters and optimizer state in host RAM (slower; not in the plan's prediction).",
    )
    profile_step: int | None = option(
        None,
        "--profile-step",
        min=1,
        metavar="N",
        help="Run step N under torch.profiler: a Chrome trace and a summary (kernel busy time, idle gaps, exposed host "
        "copies, allocator retries) per rank in the output's profile folder; that step stays out of the measured speed.",
    )
    async_checkpoint: str = option(
        "auto",
        "--async-checkpoint",
        choices=("auto", "on", "off"),
        panel=CHECKPOINTS,
        help="Write interval checkpoints on a thread (auto: on CUDA).",
    )
    plan: str = option("", "--plan", required=True, help="The launch plan (seqpar advise -o).")

    def __post_init__(self) -> None:
        if self.output is None and self.plan:  # a rank's output: the launcher's default for the same plan
            object.__setattr__(self, "output", str(default_output(self.plan)))


# --------------------------------------------------------------------------------------------- verify and eval jobs


@dataclass(frozen=True)
class VerifyOptions:
    """The verify job's options (seqpar.runtime.train.verify on every rank): the plan's step against its sp = 1 reference."""

    MODULE: ClassVar[str] = "seqpar.runtime.train.verify"

    data: str = option("synthetic", "--data", always=True, help="As for `seqpar launch`: synthetic or a token/text file.")
    output: str = option("", "--output", required=True, help="Folder for both runs' logs and verify.json.")
    model_path: str | None = option(
        None, "--model-path", aliases=("--model",), help="Local Hugging Face model folder (default: random weights)."
    )
    allow_env: tuple[str, ...] = _allow_env()  # the job loads the plan as the trainer does
    seq_len: int | None = option(
        None, "--seq-len", parse=parse_seq_len, help="Length to check at (default: seq_len / sp_degree)."
    )
    plan: str = option("", "--plan", required=True, help="The launch plan (seqpar advise -o).")


@dataclass(frozen=True)
class EvalJobOptions:
    """The eval job's options (seqpar.runtime.eval on every rank); seqpar eval sets the lengths, the prediction, the plan
    and the output."""

    MODULE: ClassVar[str] = "seqpar.runtime.eval"

    windows: int = option(4, "--windows", min=1, help="Windows per length, shared out over the data-parallel groups.")
    buckets: int = option(16, "--buckets", min=1, help="Position buckets per length (the loss by position).")
    depths: tuple[float, ...] = option(
        NEEDLE_DEPTHS, "--depths", parse=parse_depths, show=_comma_list, help="Needle depths, fractions of the haystack."
    )
    samples: int = option(1, "--samples", min=1, help="Needles (7-digit numbers) per (length, depth).")
    task: str = option("perplexity", "--task", choices=("perplexity", "needle"), help="perplexity or needle.")
    seq_len: tuple[int, ...] = option(
        (), "--seq-len", parse=parse_lengths, show=_comma_list, help="Lengths, a comma list (64k,128k); default the plan's."
    )
    prediction: str | None = option(None, "--prediction", help="The advisor's prediction per length (JSON, seqpar eval's).")
    model_path: str | None = option(
        None,
        "--model-path",
        aliases=("--model",),
        help="Local model folder: transformers' save_pretrained, or seqpar launch's run / checkpoint (its model/). "
        "Default: the plan's model with random weights.",
    )
    tokenizer: str | None = option(None, "--tokenizer", help="Local tokenizer folder (default: --model-path's).")
    score: str = option(
        "trained",
        "--score",
        choices=("trained", "all"),
        help="Which tokens the held-out loss counts: trained (what training scores: a chat's assistant tokens, every "
        "token of text) or all.",
    )
    trust_remote_code: bool = option(False, "--trust-remote-code", help=_TRUST_HELP)
    data: str | None = option(
        None,
        "--data",
        help="Held-out data, the needle's haystack: a .jsonl text file, .bin/.npy tokens, a datasets folder, or "
        "synthetic. Default: synthetic tokens; for the needle seqpar's filler text (random ids without a tokenizer).",
    )
    plan: str = option("", "--plan", required=True, help="The launch plan (seqpar advise -o).")
    output: str = option("runs/eval", "--output", aliases=("--output-dir",), always=True, help="Folder for the report.")


# --------------------------------------------------------------------------------------------- the launcher


@dataclass(frozen=True)
class LaunchOptions:
    """seqpar launch's options: the ranks' own (``train``; ``verify`` set: the verify job's instead) and where the job's
    nodes meet. The node options stay with the launcher; jobspec writes the ranks' argv."""

    train: TrainOptions = field(default_factory=TrainOptions)
    nnodes: int | None = option(
        None, "--nnodes", min=1, aliases=("--nodes",), panel=NODES, help="Nodes of the job (default: the plan's)."
    )
    # an int, or in a plan's recorded command "$NODE_RANK" for each node's shell to fill in
    node_rank: int | str = option(0, "--node-rank", min=0, panel=NODES, help="This node's rank (multi-node).")
    rdzv_endpoint: str | None = option(
        None, "--rdzv-endpoint", panel=NODES, help="HOST:PORT of the c10d rendezvous, the same on every node."
    )
    verify: VerifyOptions | None = None

    def ranks(self, plan_file: Path, output: Path, init_from: str | None = None) -> TrainOptions | VerifyOptions:
        """What every rank of one job reads: the trainer's (or the verify job's) options for that job's plan and output."""
        if self.verify is not None:
            return replace(self.verify, plan=str(plan_file), output=str(output))
        return replace(self.train, plan=str(plan_file), output=str(output), init_from=init_from)


__all__ = [
    "AUTO",
    "DataOptions",
    "EvalJobOptions",
    "LONG_DOCUMENTS",
    "LaunchOptions",
    "NEEDLE_DEPTHS",
    "STREAM",
    "TrainOptions",
    "VerifyOptions",
    "default_output",
    "parse_checkpoint_every",
    "parse_depths",
    "parse_lengths",
]
