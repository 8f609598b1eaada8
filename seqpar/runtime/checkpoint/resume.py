"""What a checkpoint records about the run that wrote it, what ``--resume`` may change, and finding and checking a
checkpoint before it is used (torch-free: ``seqpar launch --resume`` runs the same checks before any process starts).

A checkpoint holds weights and optimizer state keyed by parameter name (global shapes, any sharding) and the data
position as a number of windows read, so it is free of the mode, the degrees, the world size and the engine. Three
groups of facts go into trainer_state.json:

* ``run``: what decides the data and the model. Resuming with any of them changed would train another model on other
  data than the checkpoint's, so each is refused with one line naming the field: the seed, the data source, its size
  and how it is packed into windows, seq_len, the windows per optimizer step (micro_batch_size x
  gradient_accumulation_steps x dp_degree: the windows of step k are the k-th block of that many, data.py's order),
  the model's shape, the RoPE base, the dtype, the optimizer, the checkpoint format (DeepSpeed's or torch's; for
  DeepSpeed's, the world size too), and every parameter's shape. Under LoRA also the adapters' settings and, since
  its checkpoints hold the adapters alone and the frozen base is read again from where the run read it, that base: a
  digest of its weight files' sizes and of samples of their bytes (the header and three 64 KiB reads per file: cheap
  at any size, and any other checkpoint of the same shape differs in them), or the seed for random weights.
* ``layout``: how it is split (world size, degrees, mode, micro-batch, accumulation, sharding). Any change is applied
  (the checkpoint is resharded on load) and reported: with the same windows per step a step reads the same windows and
  computes the same loss, up to the order of floating-point sums.
* ``training``: steps and the optimizer's schedule (learning rate, schedule, warmup, weight decay, clipping). Changes
  are applied from the new plan at the checkpoint's step (the LR schedule is a function of the step) and reported.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from seqpar.plan.errors import SeqparError
from seqpar.plan.jobspec import uses_deepspeed
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.safe import inside, links_in, printable, read_bytes, refuse_links
from seqpar.runtime.checkpoint import integrity, trainer_state
from seqpar.runtime.checkpoint.trainer_state import FORMAT

# ModelSpec fields that shape the network (name and source only say where the figures came from)
_MODEL_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
)
STATE_LIMIT = 64 << 20  # bytes of a trainer_state.json: its parameter shapes and file list, with room to spare
WINDOWS_PER_STEP = "windows per step (micro_batch_size x gradient_accumulation_steps x dp_degree)"


def windows_per_step(plan: LaunchPlan) -> int:
    s = plan.strategy
    return plan.workload.micro_batch_size * s.gradient_accumulation_steps * s.dp_degree


DATA_DIGEST = "data sha256"  # the run fact of the data's content
LORA_BASE = "lora base weights"  # the run fact of a LoRA run's frozen base (base_fact)
_SAMPLE = 64 << 10  # bytes of each sample base_fact reads


def base_fact(path: str | None) -> str:
    """What a LoRA run's frozen base is: 'random weights (training.seed)', or a SHA-256 over the sizes, names and
    sampled bytes (start, middle, end) of the safetensors files of the folder its weights came from."""
    if not path:
        return "random weights (training.seed)"
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return printable(str(path), 200)
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                fh.seek(offset)
                h.update(fh.read(_SAMPLE))
    return "sampled sha256 " + h.hexdigest()


def run_facts(
    plan: LaunchPlan,
    *,
    data: str,
    data_windows: int,
    parameters: dict,
    fmt: str,
    packing: str = "",
    data_sha256: str = "",
    base: str | None = None,
) -> dict:
    """The ``run`` group: ``parameters`` maps each parameter name to its global shape; ``fmt`` is 'dcp' or 'deepspeed';
    ``packing``: how the data becomes windows (seqpar.runtime.data.windows.packing_fact); ``base``: under LoRA, the
    folder the frozen base's weights came from (None: random weights)."""
    w, t = plan.workload, plan.training
    lora = json.dumps(w.lora.model_dump(mode="json"), sort_keys=True) if w.lora is not None else None
    return {
        "training.seed": t.seed,
        "--data": data,
        "data windows": data_windows,
        "data packing": packing,
        **({DATA_DIGEST: data_sha256} if data_sha256 else {}),  # the data's content (windows.digest_fact)
        "workload.seq_len": w.seq_len,
        WINDOWS_PER_STEP: windows_per_step(plan),
        **{f"workload.model.{k}": getattr(w.model, k) for k in _MODEL_FIELDS},
        "rope theta": t.rope_theta if t.rope_theta is not None else w.model.rope_theta,
        "workload.dtype": w.dtype,
        "workload.optimizer": w.optimizer,
        "workload.lora": lora,  # null for full fine-tuning (and in checkpoints from before LoRA: the same)
        **({LORA_BASE: base_fact(base)} if lora is not None else {}),
        "checkpoint format": fmt,
        "parameters": parameters,
        # DeepSpeed's ZeRO checkpoint holds one partition per rank and is not resharded here
        **(
            {"world_size (DeepSpeed checkpoints keep one partition per rank)": plan.strategy.world_size}
            if fmt == "deepspeed"
            else {}
        ),
    }


def layout_facts(plan: LaunchPlan) -> dict:
    s = plan.strategy
    return {
        "world_size": s.world_size,
        "mode": s.mode,
        "sp_degree": s.sp_degree,
        "dp_degree": s.dp_degree,
        "ulysses_degree": s.ulysses_degree,
        "micro_batch_size": plan.workload.micro_batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "sharding": s.sharding,
    }


def training_facts(plan: LaunchPlan, steps: int) -> dict:
    t = plan.training
    return {
        "steps": steps,
        "learning_rate": t.learning_rate,
        "lr_schedule": t.lr_schedule,
        "warmup_steps": t.warmup_steps,
        "weight_decay": t.weight_decay,
        "grad_clip": t.grad_clip,
    }


def facts(
    plan: LaunchPlan,
    steps: int,
    *,
    data: str,
    data_windows: int,
    packing: str,
    model,
    deepspeed: bool,
    data_sha256: str = "",
    base: str | None = None,
) -> dict:
    """The three groups for trainer_state.json; ``model`` is the transformers model (meta-device ones too: shapes only);
    ``base``: the folder its weights came from (--init-from or --model-path; None: random)."""
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    return {
        "run": run_facts(
            plan,
            data=data,
            data_windows=data_windows,
            packing=packing,
            data_sha256=data_sha256,
            parameters=shapes,
            fmt="deepspeed" if deepspeed else "dcp",
            base=base,
        ),
        "layout": layout_facts(plan),
        "training": training_facts(plan, steps),
    }


def compare(saved: dict, now: dict, folder: Path) -> list[str]:
    """Refuse a changed ``run`` fact (SeqparError naming it); return the applied changes of layout and training."""
    for key, want in now["run"].items():
        if key == DATA_DIGEST and key not in saved["run"]:  # a checkpoint from before the digest was recorded
            continue
        got = saved["run"].get(key, _packing_before(saved["run"]) if key == "data packing" else None)
        if key == "parameters":
            _compare_parameters(got or {}, want, folder)
        elif key == LORA_BASE and got != want:
            raise SeqparError(
                f"checkpoint {str(folder)!r} holds LoRA adapters trained on another base model ({printable(got, 80)}; "
                f"this run's is {printable(want, 80)}), and its checkpoints hold the adapters alone; resume with the "
                "--model-path (or --init-from) that wrote it, or start a new --output"
            )
        elif got != want:
            raise SeqparError(
                f"checkpoint {str(folder)!r} was written with {key} = {printable(repr(got))}, this run has "
                f"{printable(repr(want))}, which changes the data or the model; resume with the plan and flags that wrote "
                f"it, or start a new --output"
            )
    changes = []
    for group in ("layout", "training"):
        for key, want in now[group].items():
            got = saved[group].get(key)
            if got != want:  # values from the file: escaped, they go to the log
                changes.append(f"{key} {printable(got)} -> {printable(want)}")
    return changes


def _packing_before(run: dict) -> str:
    """A checkpoint written before the packing was recorded read its data as one stream, windows in file order (no
    run now reads that order: resuming one on file data is refused; synthetic data has no packing)."""
    return "" if run.get("--data") == "synthetic" else "stream, windows in file order (seqpar before packed documents)"


def launch_check(
    plan: LaunchPlan, output: Path, data: str, steps: int | None, packing: str = "", *, foreign: bool = False
) -> list[str]:
    """``seqpar launch --resume``: the newest checkpoint in ``output`` checked (read_state, every file's digest too) and
    compared with ``plan`` (compare), less what only the ranks know (parameter shapes, the data's size); returns the
    changes to apply. ``foreign``: --accept-foreign-run."""
    folder = latest(output / "checkpoints")
    if folder is None:
        return []
    saved = read_state(folder, foreign=foreign)
    problem = integrity.content_problem(str(folder), folder, saved["files"], sorted(saved["files"]), _FIX)
    if problem:
        raise SeqparError(problem)
    fmt = "deepspeed" if uses_deepspeed(plan) else "dcp"
    run = run_facts(plan, data=data, data_windows=0, packing=packing, parameters={}, fmt=fmt)
    for key in ("parameters", "data windows", LORA_BASE):  # the base: the ranks know where it is read from
        run.pop(key, None)
    now = {"run": run, "layout": layout_facts(plan), "training": training_facts(plan, steps or plan.training.steps)}
    return compare(saved, now, folder)


def _compare_parameters(got: dict, want: dict, folder: Path) -> None:
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            raise SeqparError(
                f"checkpoint {str(folder)!r} does not fit this model: parameter {printable(repr(name))} has shape "
                f"{printable(got.get(name))} there and {want.get(name)} here; resume with the model (--model-path) that "
                f"wrote it, or start a new --output"
            )


# --------------------------------------------------------------------------------------------- finding and checking


def complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").is_file())


_FIX = "resume from another checkpoint (edit `latest`), or start a new --output"
_NAME = re.compile(r"step-\d{6,12}")


def latest(root: Path) -> Path | None:
    """The newest committed checkpoint folder (``latest``'s, else the newest with a trainer_state.json), or None.
    ``latest`` is data from whoever wrote the folder: read without following a link, and it must name a step folder
    in ``root``; a link anywhere under ``root`` is refused (one line)."""
    if not root.exists() and not root.is_symlink():
        return None
    # seqpar's own hidden folders (.step-N.tmp being written, .step-N.deleting being pruned) are never read and are
    # removed without following links (shards.clean at start, the saver on a failed write): a link there, e.g. the
    # disk-full test's /dev/full, is not one to refuse while another rank is removing it
    found = [p for p in links_in(root) if not p.relative_to(root).parts[0].startswith(".step-")]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise SeqparError(
            f"checkpoints folder {printable(str(root))!r} holds a symbolic link, {printable(str(found[0]))!r}{more}; "
            "seqpar never follows links in a run folder (one could point a write or a read at any file you own): "
            "remove it or use another --output"
        )
    pointer = root / "latest"
    if pointer.exists():
        name = read_bytes(pointer, what="checkpoints/latest", limit=4096).decode("utf-8", "replace").strip()
        if not _NAME.fullmatch(name) or not inside(root, root / name):
            raise SeqparError(
                f"{printable(str(pointer))!r} names {printable(name, 80)!r}, not a checkpoint folder beside it "
                f"(step-NNNNNN); write the name of one of the step-* folders there into it, or start a new --output"
            )
        if (root / name / "trainer_state.json").is_file():
            return root / name
    done = complete(root)
    return done[-1] if done else None


def read_state(folder: Path, *, foreign: bool = False) -> dict:
    """trainer_state.json after checking the checkpoint is whole, as written, signed with this user's key (or, with
    ``foreign`` (--accept-foreign-run), by anyone) and of the types and ranges seqpar writes; SeqparError with one line
    otherwise. The files' contents are checked by their readers (launch_check, shards.load) before they are read."""
    name = printable(str(folder))
    refuse_links(folder, "checkpoint")
    try:
        state = json.loads(read_bytes(folder / "trainer_state.json", what="trainer_state.json", limit=STATE_LIMIT))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON, or a 5000-digit number
        raise SeqparError(f"checkpoint {name!r} has no readable trainer_state.json ({type(e).__name__}); {_FIX}") from None
    fmt = state.get("format", 1) if isinstance(state, dict) else "?"
    if fmt == 2:  # written before checkpoints were signed
        if not foreign:
            raise SeqparError(integrity.foreign_line(name, state))
        return _legacy(folder, name, state)
    if fmt != FORMAT:
        raise SeqparError(f"checkpoint {name!r} has format {printable(fmt, 20)}, this seqpar reads format {FORMAT}; {_FIX}")
    if not foreign and not integrity.signed_here(state):
        raise SeqparError(integrity.foreign_line(name, state))
    problem = trainer_state.problem(state)
    if problem:
        raise SeqparError(f"checkpoint {name!r}: trainer_state.json holds what seqpar never writes ({problem}); {_FIX}")
    if folder.name != f"step-{state['step']:06d}":
        raise SeqparError(f"checkpoint {name!r} holds the state of step {state['step']}, not of its folder's step; {_FIX}")
    integrity.check_names(name, folder, state["files"], _FIX)
    integrity.check_sizes(name, folder, state["files"], _FIX)
    return state


def _legacy(folder: Path, name: str, state: dict) -> dict:
    """Format 2 (before signing), accepted with --accept-foreign-run: its shards are safetensors and its RNG states
    JSON, so it is read as it is (sizes checked; it lists no digests); its DeepSpeed states are pickles: refused."""
    files = state.get("files")
    if not isinstance(files, dict) or not all(type(v) is int and v >= 0 for v in files.values()):
        raise SeqparError(f"checkpoint {name!r}: trainer_state.json holds what seqpar never writes (files); {_FIX}")
    if any(str(rel).startswith("deepspeed/") for rel in files):
        raise SeqparError(
            f"checkpoint {name!r} was written before seqpar signed checkpoints, with DeepSpeed's states as pickles, "
            f"which seqpar no longer reads (a pickle can run code); {_FIX}"
        )
    rest = {k: v for k, v in state.items() if k not in ("digest", "files")}
    problem = trainer_state.problem({**rest, "format": FORMAT, "mac": "0" * 64, "files": {}})
    if problem:
        raise SeqparError(f"checkpoint {name!r}: trainer_state.json holds what seqpar never writes ({problem}); {_FIX}")
    if folder.name != f"step-{state['step']:06d}":
        raise SeqparError(f"checkpoint {name!r} holds the state of step {state['step']}, not of its folder's step; {_FIX}")
    integrity.check_names(name, folder, files, _FIX)
    integrity.check_sizes(name, folder, files, _FIX)
    return {**rest, "format": 2, "files": {}}  # no digests to check the contents against


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


__all__ = [
    "FORMAT",
    "WINDOWS_PER_STEP",
    "compare",
    "complete",
    "facts",
    "latest",
    "launch_check",
    "read_state",
    "step_dir",
    "layout_facts",
    "run_facts",
    "training_facts",
    "windows_per_step",
]
