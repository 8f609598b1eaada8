"""Training checkpoints: written atomically, read back to continue a run exactly.

Layout under ``<output>/checkpoints/``::

    step-000010/model/            save_pretrained folder (config.json + model.safetensors): loadable by transformers
    step-000010/optimizer.pt      full (unsharded) optimizer state keyed by parameter names (torch.distributed.checkpoint's
                                  get_optimizer_state_dict), so DDP and FSDP2 runs read it the same way
    step-000010/scheduler.pt      LR scheduler state
    step-000010/rng-<rank>.pt     python / numpy / torch (/ CUDA) generator states of every rank
    step-000010/trainer_state.json  step, data position, topology; written last
    latest                        name of the newest complete checkpoint

Every rank writes into a hidden ``.step-000010.tmp`` folder; after a barrier rank 0 renames it into place and then
updates ``latest``. A crash mid-write leaves a hidden temporary folder that readers ignore, and the previous checkpoint intact.
Multi-node runs need ``--output`` on a file system every node sees.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from seqpar.errors import SeqparError
from seqpar.schema import write_atomic

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save(root: Path, step: int, *, wrapped, hf_model, optimizer, scheduler, state: dict, rank: int) -> Path:
    """Collective: every rank calls it. Returns the final folder."""
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by an earlier crash
        tmp.mkdir(parents=True)
    _barrier()
    ds = _deepspeed(wrapped)
    if ds is not None:  # DeepSpeed keeps its own sharded optimizer state: its checkpoint format, written by every rank
        ds.save(wrapped, tmp / "deepspeed")
        model_sd, optim_sd = ds.full_weights(wrapped), None
    else:
        model_sd = get_model_state_dict(wrapped, options=FULL)  # collective under FSDP2; keys relative to the loss module
        optim_sd = get_optimizer_state_dict(wrapped, optimizer, options=FULL) if optimizer is not None else None
    if rank == 0:
        weights = {k.removeprefix("model."): v for k, v in model_sd.items()}
        hf_model.save_pretrained(tmp / "model", state_dict=weights)
        if ds is None:
            torch.save(optim_sd, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict() if scheduler is not None else None, tmp / "scheduler.pt")
    torch.save(_rng_state(), tmp / f"rng-{rank}.pt")
    _fault("checkpoint", step, rank)
    _barrier()
    if rank == 0:
        write_atomic(tmp / "trainer_state.json", json.dumps(state, indent=2) + "\n")
        if final.exists():  # the same step saved again (a resumed run finishing where it started)
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomic(root / "latest", final.name + "\n")
    _barrier()
    return final


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if (cand / "trainer_state.json").is_file():
            return cand
    done = sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").is_file())
    return done[-1] if done else None


def resume_point(root: Path, resume: bool, expect: dict, log) -> tuple[Path | None, int]:
    """(checkpoint to continue from, its step) for --resume, after checking it matches ``expect``; (None, 0) otherwise."""
    folder = latest(root) if resume else None
    if folder is not None:
        state = read_state(folder)
        check_compatible(state, expect, folder)
        log.info("resuming from %s (step %d)", folder, state["step"])
        return folder, state["step"]
    if resume:
        log.info("--resume: no checkpoint in %s yet, starting at step 0", root)
    return None, 0


def init_weights(init: str | None) -> str | None:
    """--init-from: a save_pretrained folder as given, or a previous stage's output folder: its newest checkpoint's model."""
    if init and (Path(init) / "checkpoints").is_dir():
        last = latest(Path(init) / "checkpoints")
        if last is None:
            raise SeqparError(f"--init-from {init!r} holds no finished checkpoint; run that stage first")
        return str(last / "model")
    return init


def read_state(folder: Path) -> dict:
    return json.loads((folder / "trainer_state.json").read_text())


def load_training_state(folder: Path, *, wrapped, optimizer, scheduler, rank: int) -> None:
    """Optimizer, scheduler and this rank's RNG states (the model weights were loaded before wrapping)."""
    ds = _deepspeed(wrapped)
    if ds is not None:
        ds.load(wrapped, folder / "deepspeed")  # model, fp32 master, optimizer (the scheduler: scheduler.pt below)
    elif optimizer is not None:
        osd = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False)
        set_optimizer_state_dict(wrapped, optimizer, osd, options=StateDictOptions(full_state_dict=True))
    if scheduler is not None and (folder / "scheduler.pt").is_file():
        scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
    rng = folder / f"rng-{rank}.pt"
    if not rng.is_file():
        raise SeqparError(
            f"checkpoint {str(folder)!r} has no RNG state for rank {rank}; resume with the world size that wrote it"
        )
    _set_rng_state(torch.load(rng, weights_only=False))


def check_compatible(state: dict, expect: dict, folder: Path) -> None:
    """The data position means the same only with the same topology and batch shape."""
    for key, want in expect.items():
        if state.get(key) != want:
            raise SeqparError(
                f"checkpoint {str(folder)!r} was written with {key} = {state.get(key)}, this run has {want}; "
                f"resume with the plan that wrote it, or start a new --output"
            )


def _deepspeed(wrapped):
    """seqpar.runtime.deepspeed when ``wrapped`` is a DeepSpeed engine, else None (deepspeed is optional)."""
    from seqpar.runtime import deepspeed

    return deepspeed if deepspeed.is_engine(wrapped) else None


def _rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def _fault(phase: str, step: int, rank: int) -> None:
    """Test hook: SEQPAR_FAULT_RANK / SEQPAR_FAULT_STEP / SEQPAR_FAULT_PHASE (step | checkpoint) raise on one rank."""
    if os.environ.get("SEQPAR_FAULT_PHASE", "step") != phase:
        return
    if os.environ.get("SEQPAR_FAULT_RANK") == str(rank) and os.environ.get("SEQPAR_FAULT_STEP") == str(step):
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({phase}; SEQPAR_FAULT_* is set)")
