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
  DeepSpeed's, the world size too), and every parameter's shape.
* ``layout``: how it is split (world size, degrees, mode, micro-batch, accumulation, sharding). Any change is applied
  (the checkpoint is resharded on load) and reported: with the same windows per step a step reads the same windows and
  computes the same loss, up to the order of floating-point sums.
* ``training``: steps and the optimizer's schedule (learning rate, schedule, warmup, weight decay, clipping). Changes
  are applied from the new plan at the checkpoint's step (the LR schedule is a function of the step) and reported.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from seqpar.plan.errors import SeqparError
from seqpar.plan.jobspec import uses_deepspeed
from seqpar.plan.launch_plan import LaunchPlan

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
FORMAT = 2  # trainer_state.json's format: 1 = whole-model torch.save files (pickles); 2 = seqpar.runtime.checkpoint.shards's
WINDOWS_PER_STEP = "windows per step (micro_batch_size x gradient_accumulation_steps x dp_degree)"


def windows_per_step(plan: LaunchPlan) -> int:
    s = plan.strategy
    return plan.workload.micro_batch_size * s.gradient_accumulation_steps * s.dp_degree


def run_facts(plan: LaunchPlan, *, data: str, data_windows: int, parameters: dict, fmt: str, packing: str = "") -> dict:
    """The ``run`` group: ``parameters`` maps each parameter name to its global shape; ``fmt`` is 'dcp' or 'deepspeed';
    ``packing``: how the data becomes windows (seqpar.runtime.data.windows.packing_fact)."""
    w, t = plan.workload, plan.training
    return {
        "training.seed": t.seed,
        "--data": data,
        "data windows": data_windows,
        "data packing": packing,
        "workload.seq_len": w.seq_len,
        WINDOWS_PER_STEP: windows_per_step(plan),
        **{f"workload.model.{k}": getattr(w.model, k) for k in _MODEL_FIELDS},
        "rope theta": t.rope_theta if t.rope_theta is not None else w.model.rope_theta,
        "workload.dtype": w.dtype,
        "workload.optimizer": w.optimizer,
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


def facts(plan: LaunchPlan, steps: int, *, data: str, data_windows: int, packing: str, model, deepspeed: bool) -> dict:
    """The three groups for trainer_state.json; ``model`` is the transformers model (meta-device ones too: shapes only)."""
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    return {
        "run": run_facts(
            plan,
            data=data,
            data_windows=data_windows,
            packing=packing,
            parameters=shapes,
            fmt="deepspeed" if deepspeed else "dcp",
        ),
        "layout": layout_facts(plan),
        "training": training_facts(plan, steps),
    }


def compare(saved: dict, now: dict, folder: Path) -> list[str]:
    """Refuse a changed ``run`` fact (SeqparError naming it); return the applied changes of layout and training."""
    for key, want in now["run"].items():
        got = saved["run"].get(key, _packing_before(saved["run"]) if key == "data packing" else None)
        if key == "parameters":
            _compare_parameters(got or {}, want, folder)
        elif got != want:
            raise SeqparError(
                f"checkpoint {str(folder)!r} was written with {key} = {got!r}, this run has {want!r}, which changes "
                f"the data or the model; resume with the plan and flags that wrote it, or start a new --output"
            )
    changes = []
    for group in ("layout", "training"):
        for key, want in now[group].items():
            got = saved[group].get(key)
            if got != want:
                changes.append(f"{key} {got} -> {want}")
    return changes


def _packing_before(run: dict) -> str:
    """A checkpoint written before the packing was recorded read its data as one stream, windows in file order (no
    run now reads that order: resuming one on file data is refused; synthetic data has no packing)."""
    return "" if run.get("--data") == "synthetic" else "stream, windows in file order (seqpar before packed documents)"


def launch_check(plan: LaunchPlan, output: Path, data: str, steps: int | None, packing: str = "") -> list[str]:
    """``seqpar launch --resume``: the newest checkpoint in ``output`` checked (read_state) and compared with ``plan``
    (compare), less what only the ranks know (parameter shapes, the data's size); returns the changes to apply."""
    folder = latest(output / "checkpoints")
    if folder is None:
        return []
    saved = read_state(folder)
    fmt = "deepspeed" if uses_deepspeed(plan) else "dcp"
    run = run_facts(plan, data=data, data_windows=0, packing=packing, parameters={}, fmt=fmt)
    for key in ("parameters", "data windows"):
        del run[key]
    now = {"run": run, "layout": layout_facts(plan), "training": training_facts(plan, steps or plan.training.steps)}
    return compare(saved, now, folder)


def _compare_parameters(got: dict, want: dict, folder: Path) -> None:
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            raise SeqparError(
                f"checkpoint {str(folder)!r} does not fit this model: parameter {name!r} has shape {got.get(name)} there "
                f"and {want.get(name)} here; resume with the model (--model-path) that wrote it, or start a new --output"
            )


# --------------------------------------------------------------------------------------------- finding and checking


def complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").is_file())


def latest(root: Path) -> Path | None:
    """The newest committed checkpoint folder (``latest``'s, else the newest with a trainer_state.json), or None."""
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if (cand / "trainer_state.json").is_file():
            return cand
    done = complete(root)
    return done[-1] if done else None


def read_state(folder: Path) -> dict:
    """trainer_state.json after checking the checkpoint is whole and as written; SeqparError with one line otherwise."""
    name = str(folder)
    fix = "resume from another checkpoint (edit `latest`), or start a new --output"
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SeqparError(f"checkpoint {name!r} has no readable trainer_state.json ({type(e).__name__}); {fix}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        fmt = state.get("format", 1) if isinstance(state, dict) else "?"
        raise SeqparError(f"checkpoint {name!r} has format {fmt}, this seqpar reads format {FORMAT}; {fix}")
    if state.get("digest") != digest({k: v for k, v in state.items() if k != "digest"}):
        raise SeqparError(f"checkpoint {name!r}: trainer_state.json was changed after it was written (its digest differs); {fix}")
    if folder.name != f"step-{state['step']:06d}":
        raise SeqparError(f"checkpoint {name!r} holds the state of step {state['step']}, not of its folder's step; {fix}")
    for rel, size in state["files"].items():
        p = folder / rel
        have = p.stat().st_size if p.is_file() else None
        if have != size:
            what = "is missing" if have is None else f"has {have} bytes, not the {size} written"
            raise SeqparError(f"checkpoint {name!r} is incomplete: {rel} {what}; {fix}")
    return state


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def digest(state: dict) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


__all__ = [
    "FORMAT",
    "WINDOWS_PER_STEP",
    "compare",
    "complete",
    "digest",
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
