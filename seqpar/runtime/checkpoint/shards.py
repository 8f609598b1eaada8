"""Training checkpoints: sharded, resharded on load, committed atomically, checked before use, and never unpickled.

Layout under ``<output>/checkpoints/``::

    step-000010/state/              torch.distributed.checkpoint in safetensors (HuggingFaceStorageWriter with
                                    save_distributed): model and optimizer tensors keyed by parameter name, every rank
                                    writing its own shards with their global offsets, so DDP and FSDP2 runs of any
                                    world size read back the slices they hold (resharding)
    step-000010/deepspeed/          DeepSpeed plans: DeepSpeed's own sharded checkpoint instead of state/
    step-000010/rng-<rank>.json     python / numpy / torch (/ CUDA) generator states, restored on the same world size
                                    (seqpar.runtime.checkpoint.rng)
    step-000010/model/              the final checkpoint only: save_pretrained export in the plan's dtype (bf16 on bf16
                                    plans), what transformers, --init-from and the next stage load
    step-000010/adapter/            LoRA plans, final checkpoint only: the adapter in peft's layout (model/ then holds
                                    the merged model, with --merge-lora: seqpar.runtime.checkpoint.adapter); their
                                    state/ holds the adapters and their optimizer state alone (the frozen base is read
                                    again from where the run read it)
    step-000010/trainer_state.json  written last: step, data position, the facts of seqpar.runtime.checkpoint.resume, every
                                    other file with its size and SHA-256, and an HMAC of all that under the user's key
                                    (seqpar.runtime.checkpoint.integrity)
    latest                          name of the newest complete checkpoint

Crash consistency: every rank writes into a hidden ``.step-000010.tmp``; after a barrier rank 0 writes the manifest,
renames the folder into place, then rewrites ``latest`` (both atomic). A kill at any point leaves the previous
checkpoint complete and ``latest`` naming it; checkpoints beyond ``--keep-last`` are renamed away before they are
deleted, so a half-deleted one is never mistaken for a checkpoint. Nothing is read with pickle: tensors are safetensors,
the rest JSON (DeepSpeed's states too: seqpar.runtime.checkpoint.deepspeed), and torch.distributed.checkpoint reads
through HuggingFaceStorageReader, whose metadata comes from the safetensors headers (FileSystemReader's ``.metadata``
would be a pickle). Every file is checked against its SHA-256 before it is read, the ranks sharing the hashing. A forged
checkpoint can fail to load but cannot run code. Multi-node runs need ``--output`` on a file system every node sees.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from seqpar.plan.errors import SeqparError
from seqpar.plan.files import write_atomic
from seqpar.runtime.checkpoint import integrity, rng
from seqpar.runtime.checkpoint.resume import FORMAT, complete, latest, read_state, step_dir

# --------------------------------------------------------------------------------------------- writing


def write(tmp: Path, *, wrapped, optimizer, rank: int) -> None:
    """Collective: every rank writes its shards of the model and optimizer (or DeepSpeed its checkpoint) and its RNG."""
    ds = _deepspeed(wrapped)
    if ds is not None:  # DeepSpeed keeps its own sharded model/optimizer format, written by every rank
        ds.save(wrapped, tmp / "deepspeed")
    else:
        dcp.save(tensors(wrapped, optimizer), storage_writer=writer(tmp))
    rng.write(tmp, rank)


def writer(tmp: Path) -> HuggingFaceStorageWriter:
    return HuggingFaceStorageWriter(str(tmp / "state"), save_distributed=True)


# The files a tokenizer folder holds one of (transformers' fast, sentencepiece and BPE tokenizers, and the config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def export(
    tmp: Path,
    *,
    wrapped,
    hf_model,
    dtype: torch.dtype,
    rank: int,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
) -> None:
    """Collective: the weights gathered one tensor at a time and saved by rank 0 with save_pretrained, in ``dtype``
    (rank 0 holds one copy of the model in that dtype; the others one tensor at a time), and beside them the tokenizer
    the run trained with (``tokenizer``: the data's --tokenizer or --model-path; its chat template too), so the folder
    loads with AutoTokenizer and AutoModelForCausalLM as it is. A LoRA run exports its adapter instead
    (seqpar.runtime.checkpoint.adapter.export_lora, which the saver calls)."""
    ds = _deepspeed(wrapped)
    sd = ds.full_weights(wrapped) if ds is not None else get_model_state_dict(wrapped)  # keys relative to LossModule
    weights = {}
    for name, t in sd.items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2's DTensor: all-gather this one
        if rank == 0:
            weights[name.removeprefix("model.")] = full.detach().to(device="cpu", dtype=dtype)
    if rank == 0:
        save_model(tmp / "model", hf_model, weights, dtype)
        save_tokenizer(tmp / "model", tokenizer, trust_remote_code)


def save_model(folder: Path, hf_model, weights: dict, dtype: torch.dtype) -> None:
    """``hf_model.save_pretrained`` of ``weights`` into ``folder``, its config.json stating ``dtype``."""
    hf_model.save_pretrained(folder, state_dict=weights)
    state_dtype(folder, dtype)  # save_pretrained records the live parameters' dtype (fp32 masters)


def state_dtype(folder: Path, dtype: torch.dtype) -> None:
    """``folder``'s config.json says ``dtype`` (the weights' dtype as written, a string as transformers writes it)."""
    cfg = folder / "config.json"
    data = json.loads(cfg.read_text())
    data["dtype"] = str(dtype).removeprefix("torch.")
    write_atomic(cfg, json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_tokenizer(folder: Path, path: str | None, trust_remote_code: bool = False) -> bool:
    """The tokenizer of ``path`` (a local folder or a cached Hub id), with its chat template, saved into ``folder``
    (save_pretrained). False when there is none to save: no path, or a local folder without tokenizer files (a model
    trained on token files from a folder of weights only)."""
    if not path:
        return False
    local = Path(path).expanduser()
    if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES):
        return False
    from seqpar.runtime.data.text import load_tokenizer

    tok = load_tokenizer(path, "the run's tokenizer (for the export)", trust_remote_code=trust_remote_code)
    tok.save_pretrained(str(folder))
    return True


def hash_share(tmp: Path, rank: int, world_size: int) -> dict[str, dict]:
    """This rank's share of the digests of ``tmp``'s files (every world_size-th, from ``rank``), for ``commit``."""
    names = integrity.listing(tmp)
    return integrity.digests(tmp, names[rank::world_size])


def commit(root: Path, tmp: Path, state: dict, digests: dict | None = None) -> Path:
    """Rank 0, after every rank finished writing ``tmp``: the manifest (each file's size and SHA-256; ``digests``: those
    the ranks hashed, the rest hashed here) signed with the user's key, rename into place, point ``latest`` at it."""
    final = step_dir(root, state["step"])
    names = integrity.listing(tmp)
    files = {**integrity.digests(tmp, [r for r in names if r not in (digests or {})]), **(digests or {})}
    state = {"format": FORMAT, **state, "files": {r: files[r] for r in names}}
    state["mac"] = integrity.sign(state)
    write_atomic(tmp / "trainer_state.json", json.dumps(state, indent=2) + "\n")
    if final.exists():  # the same step saved again (a resumed run ending where it started)
        _remove(final)
    os.replace(tmp, final)
    write_atomic(root / "latest", final.name + "\n")
    _fsync_dir(root)
    return final


def prune(root: Path, keep_last: int) -> list[str]:
    """Rank 0: delete all but the newest ``keep_last`` complete checkpoints (0 keeps all); returns the names deleted."""
    done = complete(root)
    gone = done[:-keep_last] if keep_last else []
    for p in gone:
        _remove(p)
    return [p.name for p in gone]


def clean(root: Path) -> None:
    """Rank 0 at start: folders left by a crash (unfinished writes, unfinished deletions)."""
    for p in list(root.glob(".step-*.tmp")) + list(root.glob(".step-*.deleting")):
        shutil.rmtree(p, ignore_errors=True)


def _remove(p: Path) -> None:
    gone = p.with_name(f".{p.name}.deleting")  # renamed first: a crash mid-delete leaves no half checkpoint behind
    os.replace(p, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def init_weights(init: str | None, *, foreign: bool = False) -> str | None:
    """--init-from: a save_pretrained folder as given, or a previous stage's output folder: its final export, checked
    as a resume checks a checkpoint (signed with the user's key unless ``foreign``, the export's files as written)."""
    if init and (Path(init) / "checkpoints").is_dir():
        last = latest(Path(init) / "checkpoints")
        if last is None or not (last / "model" / "config.json").is_file():
            raise SeqparError(
                f"--init-from {init!r} holds no final checkpoint with an export (model/); run that stage to its end "
                "(a LoRA run exports its merged model there with --merge-lora)"
            )
        state = read_state(last, foreign=foreign)
        export = sorted(r for r in state["files"] if r.startswith("model/"))
        problem = integrity.content_problem(str(last), last, state["files"], export, "run that stage again")
        if problem:
            raise SeqparError(problem)
        return str(last / "model")
    return init


# --------------------------------------------------------------------------------------------- reading


def load(folder: Path, state: dict, *, wrapped, optimizer, scheduler, rank: int, world_size: int) -> list[str]:
    """Collective: model and optimizer from ``folder`` into the wrapped model (resharded to this run's layout), the LR
    schedule at the checkpoint's step, and this rank's RNG. Returns notes for the log."""
    notes = []
    generators = verify(folder, state, rank, world_size)
    ds = _deepspeed(wrapped)
    if ds is not None:
        ds.load(wrapped, folder / "deepspeed")  # model, fp32 master partitions, optimizer moments
        set_schedule(scheduler, scheduler.optimizer if scheduler is not None else None, state["step"])  # the trainer's
    else:
        sd = tensors(wrapped, optimizer)
        try:
            dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(folder / "state")))
        except CheckpointException as e:  # every rank gets every rank's failures
            first = next(iter(e.failures.values()), e)  # (exception, stack summary)
            why = str(first[0] if isinstance(first, tuple) else first).splitlines()[0]
            raise SeqparError(
                f"checkpoint {str(folder)!r} cannot be read ({why}); resume from another checkpoint (edit `latest`), "
                f"or start a new --output"
            ) from None
        # the frozen parameters are not in a checkpoint (tensors); DCP's load above checked every saved one was found
        set_model_state_dict(wrapped, sd["model"], options=StateDictOptions(strict=not frozen(wrapped)))
        if optimizer is not None:
            # Hyperparameters (lr, weight decay, betas) stay this run's: the checkpoint gives only the state tensors.
            groups = get_optimizer_state_dict(wrapped, optimizer)["param_groups"]
            set_optimizer_state_dict(wrapped, optimizer, {"state": sd["optim"], "param_groups": groups})
        set_schedule(scheduler, optimizer, state["step"])
    if generators is not None:
        rng.restore(generators)
    else:
        notes.append(f"RNG states not restored (world size {state['layout']['world_size']} -> {world_size})")
    return notes


def verify(folder: Path, state: dict, rank: int, world_size: int) -> dict | None:
    """Collective, before any file is read: every file against its SHA-256 (each rank hashing every world_size-th),
    each DeepSpeed state's structure among them, and this rank's RNG state; every rank raises the same line when one
    is wrong, so the job stops as one (exit 2), not on the one rank that read the file. Returns this rank's RNG state
    (None on another world size: not restored)."""
    import torch.distributed as dist

    names = sorted(state["files"])
    share = names[rank::world_size]
    mine, generators = integrity.content_problem(str(folder), folder, state["files"], share, _FIX), None
    try:
        if mine is None:
            for rel in share:
                if rel.startswith("deepspeed/"):
                    from seqpar.runtime.checkpoint.deepspeed import check

                    check(folder / rel)
            path = folder / f"rng-{rank}.json"
            if state["layout"]["world_size"] == world_size and path.is_file():
                generators = rng.read(folder, path)
    except SeqparError as e:
        mine = str(e)
    found = [None] * world_size
    dist.all_gather_object(found, mine)
    first = next((p for p in found if p), None)
    if first:
        raise SeqparError(first)
    return generators


_FIX = "resume from another checkpoint (edit `latest`), or start a new --output"


def set_schedule(scheduler, optimizer, step: int) -> None:
    """Put a LambdaLR (transformers' warmup schedules) at ``step`` of this run's schedule: lr = base_lr * f(step), the
    value the uninterrupted run reaches after ``step`` scheduler steps."""
    if scheduler is None:
        return
    lrs = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": step, "_step_count": step + 1, "_last_lr": lrs})
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def tensors(wrapped, optimizer) -> dict:
    """What DCP saves and loads: tensors only (the optimizer's param_groups come from the plan). A model with frozen
    parameters (LoRA's base) saves only its trainable ones: the frozen ones are rebuilt from where the run read them
    (its model, --init-from, or its seed), and a 4-bit base's quantization statistics are no parameters at all."""
    if frozen(wrapped):  # torch's own option, then bitsandbytes' statistics (buffers of no parameter) left out too
        keep = trainable_names(wrapped)
        sd = get_model_state_dict(wrapped, options=StateDictOptions(ignore_frozen_params=True))
        model = {k: v for k, v in sd.items() if k in keep}
    else:
        model = get_model_state_dict(wrapped)
    sd = {"model": model}
    if optimizer is not None:
        sd["optim"] = get_optimizer_state_dict(wrapped, optimizer)["state"]
    return sd


def frozen(wrapped) -> bool:
    """Whether some parameter of ``wrapped`` is frozen (LoRA's base): its checkpoints then hold the trainable ones."""
    return any(not p.requires_grad for p in wrapped.parameters())


def trainable_names(wrapped) -> set[str]:
    """The names torch.distributed.checkpoint's state dicts give the trainable parameters (DDP's prefix removed)."""
    return {n.removeprefix("module.") for n, p in wrapped.named_parameters() if p.requires_grad}


def _deepspeed(wrapped):
    """seqpar.runtime.checkpoint.deepspeed when ``wrapped`` is a DeepSpeed engine, else None (deepspeed is optional)."""
    from seqpar.runtime.checkpoint import deepspeed

    return deepspeed if deepspeed.is_engine(wrapped) else None


# --------------------------------------------------------------------------------------------- test hooks


def fault(phase: str, step: int, rank: int, tmp: Path | None = None) -> None:
    """Test hook, set by SEQPAR_FAULT_PHASE / SEQPAR_FAULT_STEP / SEQPAR_FAULT_RANK (a rank, or 'all'): the phase
    'step' raises before that step, 'checkpoint' after the shards of that step's checkpoint are written;
    'checkpoint-pause' then writes ``.paused-rank<R>`` (its pid) beside the checkpoints and waits to be killed;
    'checkpoint-enospc' points this rank's shard file at /dev/full first, so the write meets a real ENOSPC."""
    if os.environ.get("SEQPAR_FAULT_PHASE", "step") != phase or os.environ.get("SEQPAR_FAULT_STEP") != str(step):
        return
    if os.environ.get("SEQPAR_FAULT_RANK") not in (str(rank), "all"):
        return
    if phase == "checkpoint-pause" and tmp is not None:
        write_atomic(tmp.parent / f".paused-rank{rank}", f"{os.getpid()}\n")
        time.sleep(3600)
    elif phase == "checkpoint-enospc" and tmp is not None:
        (tmp / "state").mkdir(parents=True, exist_ok=True)
        (tmp / "state" / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors").symlink_to("/dev/full")
    else:
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({phase}; SEQPAR_FAULT_* is set)")
