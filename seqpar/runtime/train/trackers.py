"""Experiment trackers for ``--report-to``: TensorBoard and Weights & Biases through accelerate's tracker classes.

accelerate (``accelerate.tracking``) already wraps both the way its users know them: ``TensorBoardTracker`` writes
``<logging_dir>/<project>`` with torch's SummaryWriter, ``WandBTracker`` calls ``wandb.init(project=..., **kwargs)``;
``store_init_configuration`` records the run's config (TensorBoard's hparams, W&B's run config). seqpar only decides
what they are given, on rank 0 (the only rank that logs):

- project: ``--project`` (default "seqpar"); run name: ``--run-name`` (default: the output folder's name);
- a run id made once per output folder and kept in ``<output>/tracker_run.json`` beside ``checkpoints/``: a run
  continued with ``--resume`` reads it back, so W&B continues the same run (``id=``, ``resume="allow"``) and TensorBoard
  keeps writing the same folder. A resumed run repeats the steps after its checkpoint: TensorBoard's ``purge_step``
  (SummaryWriter) hides the earlier events of those steps, so each step appears once. W&B drops a step at or below one it
  already holds (its steps only go up), so the repeated steps keep the values of the first attempt there;
- the config: the plan's mode, degrees, engine, checkpointing, shapes and its predictions (peak GiB, tokens/s, step
  time, MFU), flat (TensorBoard's hparams take only numbers, strings and booleans).

``parse`` is torch-free (``seqpar launch`` checks ``--report-to`` before any process starts); ``open_trackers`` imports
accelerate.
"""

from __future__ import annotations

import json
import secrets
import string
from pathlib import Path

from seqpar.plan.errors import SeqparError
from seqpar.plan.extras import require
from seqpar.plan.safe import printable

# --report-to name -> the module it needs (accelerate's TensorBoardTracker writes with torch.utils.tensorboard, which
# needs the tensorboard package); the extra "track" installs both.
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}
DEFAULT_PROJECT = "seqpar"
RUN_FILE = "tracker_run.json"  # in the output folder, beside checkpoints/
_ID_CHARS = string.ascii_lowercase + string.digits  # what W&B accepts in a run id


def parse(text: str) -> list[str]:
    """``--report-to`` (a comma list) as tracker names; SeqparError (one line) for a name seqpar does not know,
    MissingExtra (one line naming the install) for one whose package is not installed. Torch-free."""
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    accepted = ", ".join(TRACKERS)
    for name in names:
        if name not in TRACKERS:
            raise SeqparError(
                f"--report-to {name!r} is not a tracker seqpar logs to; give a comma list of {accepted} (e.g. --report-to "
                f"tensorboard), or leave it out (metrics.jsonl is always written)"
            )
        # a missing package is the install's gap, not bad input: MissingExtra, exit 1 (the README's exit-code table)
        require(TRACKERS[name], f"--report-to {name}")
    if names:
        require("accelerate", "--report-to (accelerate's trackers)")
    return names


def new_run_id() -> str:
    """16 random lowercase letters and digits (W&B's id alphabet; ~82 bits)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(16))


def run_identity(out: Path, *, resumed: bool, project: str | None, run_name: str | None) -> dict:
    """{"project", "run_name", "run_id"} of this run, written to ``<out>/tracker_run.json`` (atomically). A resumed run
    reads the id (and, unless given again, the project and name) back; a fresh one gets a new id."""
    from seqpar.runtime.train.run_files import read_file, write_file

    path = out / RUN_FILE
    saved: dict = {}
    held = read_file(path, "tracker run file", limit=_RUN_FILE_LIMIT) if resumed else None
    if held is not None:
        shown = printable(str(path))
        try:
            saved = json.loads(held.decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8 or JSON, a 5000-digit number, nesting past the parser's depth
            raise SeqparError(
                f"{shown!r} is not JSON; restore it, or delete it to log the resumed run as a new tracker run"
            ) from None
        if not isinstance(saved, dict) or not _is_run_id(saved.get("run_id")):
            raise SeqparError(f"{shown!r} holds no run_id; restore it, or delete it to log the resumed run as a new run")
        for key in ("project", "run_name"):  # they name folders and runs: text of one line, as the flags take
            if saved.get(key) is not None and not _is_name(saved[key]):
                raise SeqparError(
                    f"{shown!r} holds a {key} that is not a name ({printable(saved[key], 60)!r}); restore it, or "
                    f"delete it to log the resumed run as a new run"
                )
    ident = {
        "project": project or saved.get("project") or DEFAULT_PROJECT,
        "run_name": run_name or saved.get("run_name") or out.resolve().name,
        "run_id": saved.get("run_id") or new_run_id(),
    }
    write_file(path, json.dumps(ident, indent=2) + "\n", "tracker run file")
    return ident


_RUN_FILE_LIMIT = 1 << 16  # bytes: three short strings


def _is_run_id(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 64 and all(c in _ID_CHARS for c in value)


def _is_name(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 256 and printable(value, 256) == value


def plan_config(plan, extra: dict | None = None) -> dict:
    """The plan and its predictions as flat scalars (TensorBoard's hparams and W&B's config take them as they are)."""
    s, w, c, t = plan.strategy, plan.workload, plan.cluster, plan.training
    cfg = {
        "mode": s.mode,
        "sp_degree": s.sp_degree,
        "dp_degree": s.dp_degree,
        "ulysses_degree": s.ulysses_degree,
        "ring_degree": s.ring_degree,
        "sharding": s.sharding,
        "checkpointing": s.checkpointing,
        "loss_impl": s.loss_impl,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "model": w.model.name,
        "seq_len": w.seq_len,
        "micro_batch_size": w.micro_batch_size,
        "dtype": w.dtype,
        "gpu": c.gpu.name,
        "world_size": c.world_size,
        "learning_rate": t.learning_rate,
        "seed": t.seed,
    }
    p = plan.prediction
    if p is not None:
        for key in ("peak_memory_gib", "reserved_memory_gib", "host_memory_gib", "tokens_per_s", "step_time_s", "mfu"):
            cfg[f"predicted_{key}"] = getattr(p, key)
        cfg["predicted_oom_risk"] = p.oom_risk
    return {**cfg, **(extra or {})}


def open_trackers(names: list[str], out: Path, ident: dict, *, resume_step: int, config: dict) -> list:
    """accelerate's trackers for ``names``, started, with ``config`` stored. Call on rank 0 only."""
    from accelerate import PartialState
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    from seqpar.runtime.train.run_files import check_folder

    # The trackers write under the output folder: a link planted there would aim their files anywhere.
    for name, folder in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if name in names:
            check_folder(out / folder, f"{name} folder", library_links=name == "wandb")
    # The trackers log through accelerate's logger, which needs accelerate's process state: PartialState adopts the
    # process group the trainer made (it makes none while one exists; a DeepSpeed run's Accelerator made it already).
    PartialState()
    kwargs = {
        # events of steps after the checkpoint (a run that went on before it stopped) are hidden: they run again
        "tensorboard": {"logging_dir": str(out / "tensorboard"), "purge_step": resume_step + 1 if resume_step else None},
        "wandb": {"name": ident["run_name"], "id": ident["run_id"], "resume": "allow", "dir": str(out)},
    }
    trackers = []
    for name in names:
        tracker = LOGGER_TYPE_TO_CLASS[name](ident["project"], **kwargs[name])
        tracker.main_process_only = False  # called on rank 0 only (the trainer's rank 0; accelerate's may differ)
        if hasattr(tracker, "start"):  # newer accelerate starts a tracker here (lazily); older versions in __init__
            tracker.start()
        tracker.store_init_configuration(config)
        trackers.append(tracker)
    return trackers


__all__ = ["DEFAULT_PROJECT", "RUN_FILE", "TRACKERS", "new_run_id", "open_trackers", "parse", "plan_config", "run_identity"]
