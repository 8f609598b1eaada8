"""When the trainer writes checkpoints, and what surrounds a write: the interval, free space, a full disk, --keep-last,
the final export, and asynchronous writes.

* Interval (seqpar.runtime.checkpoint.storage.interval): every K steps; 0 = only the final one; None = about hourly, decided after
  the first two measured steps from rank 0's step time when the plan predicts none. The final checkpoint (the only one
  with the save_pretrained export) is written after the last step unless --no-final-checkpoint.
* Before a write rank 0 checks the free space for it and the ranks agree on the answer; a write that meets ENOSPC or a
  quota anyway (on any rank: torch.distributed.checkpoint gathers every rank's failure) removes its unfinished folder
  and stops the run with one line (TrainingStopped) that names the disk, the sizes and the intact previous checkpoint.
* Asynchronous writes (on by default on CUDA for the interval checkpoints; ``--async-checkpoint on`` elsewhere):
  ``dcp.async_save`` copies this rank's shards into host memory and writes them on a thread over a gloo group of its
  own while training continues; the write is committed (manifest, rename, ``latest``) at the next step boundary after
  every rank finished, so ``latest`` never names a checkpoint still being written. The final checkpoint is synchronous.
"""

from __future__ import annotations

import errno
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from seqpar.plan.errors import SeqparError, TrainingStopped
from seqpar.runtime.checkpoint import resume, storage
from seqpar.runtime.checkpoint import shards as ckpt

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Saver:
    """Collective: every rank builds one and calls ``save``/``wait`` at the same steps."""

    def __init__(self, r, *, every: int | None, keep_last: int, final: bool, async_mode: str):
        self.r, self.rank, self.every, self.keep_last, self.final = r, r.topo.rank, every, keep_last, final
        self.root, self.sizes = r.root, storage.sizes(r.plan, r.merge_lora)
        self.async_save = async_mode == "on" or (async_mode == "auto" and r.topo.device.type == "cuda")
        self.async_save = self.async_save and r.backward is None  # DeepSpeed writes its own checkpoint
        self.group = dist.new_group(backend="gloo") if self.async_save else None  # collective: every rank creates it
        self.pending = None  # (step, tmp, state, future, t0) of an asynchronous write
        self.written: list[dict] = []
        if self.rank == 0:
            ckpt.clean(self.root)

    def due(self, done: int, steps: int) -> bool:
        if done == steps:
            return self.final
        return bool(self.every) and done % self.every == 0

    def observe(self, done: int, start: int, step_time_s: float) -> None:
        """Interval None: after the first two measured steps, about hourly at rank 0's step time (all ranks agree)."""
        if self.every is None and done >= start + 2:
            t = [step_time_s]
            dist.broadcast_object_list(t, src=0)
            self.every = storage.hourly(t[0])
            self.r.log.info("checkpoints every %d steps (about hourly at %.3g s per step)", self.every, t[0])

    def save(self, step: int, state: dict, *, final: bool) -> None:
        self.wait()
        tmp, t0, r = self.root / f".step-{step:06d}.tmp", time.perf_counter(), self.r
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        try:
            self._agree(lambda: self._space(self.sizes.checkpoint + (self.sizes.export if final else 0), step), step)
            ckpt.fault("checkpoint-enospc", step, self.rank, tmp)
            if self.async_save and not final:
                self.pending = (step, tmp, state, self._write_async(tmp), t0)
                return
            ckpt.write(tmp, wrapped=r.wrapped, optimizer=r.optimizer, rank=self.rank)
            if final:
                dtype = EXPORT_DTYPES[r.plan.workload.dtype]
                out = dict(wrapped=r.wrapped, hf_model=r.model, dtype=dtype, rank=self.rank, **r.tokenizer)
                if r.adapter is not None:  # a LoRA run's export is its adapter (and, asked, the merged model)
                    from seqpar.runtime.checkpoint.adapter import export_lora

                    export_lora(tmp, adapter=r.adapter, merge=r.merge_lora, **out)
                else:
                    ckpt.export(tmp, **out)
            ckpt.fault("checkpoint", step, self.rank)
            ckpt.fault("checkpoint-pause", step, self.rank, tmp)
        except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            self._failed(e, tmp, step)
            raise
        self._commit(step, tmp, state, t0)

    def wait(self) -> None:
        """Commit an asynchronous write once every rank has finished it."""
        if self.pending is None:
            return
        step, tmp, state, future, t0 = self.pending
        self.pending = None
        try:
            future.result()
        except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            self._failed(e, tmp, step)
            raise
        self._commit(step, tmp, state, t0)

    # ----- parts

    def _write_async(self, tmp: Path):
        import torch.distributed.checkpoint as dcp

        sd = ckpt.tensors(self.r.wrapped, self.r.optimizer)
        if self.r.topo.device.type == "cpu":
            # DCP's stager would keep CPU tensors by reference, which the next optimizer step updates in place.
            sd = _clone(sd)
        future = dcp.async_save(sd, storage_writer=ckpt.writer(tmp), process_group=self.group)
        ckpt.rng.write(tmp, self.rank)
        return future

    def _commit(self, step: int, tmp: Path, state: dict, t0: float) -> None:
        dist.barrier()
        # The manifest's SHA-256s, every rank hashing a share of the files (rank 0 alone would read the whole checkpoint).
        shares = [None] * dist.get_world_size() if self.rank == 0 else None
        try:
            share = ckpt.hash_share(tmp, self.rank, dist.get_world_size())
        except (OSError, SeqparError):  # rank 0 hashes what is missing and names what is wrong
            share = {}
        dist.gather_object(share, shares, dst=0)
        digests = {k: v for share in shares or [] for k, v in share.items()}
        box: dict = {}
        try:
            self._agree(
                lambda: box.update(final=ckpt.commit(self.root, tmp, state, digests), gone=ckpt.prune(self.root, self.keep_last)),
                step,
            )
        except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            self._failed(e, tmp, step)
            raise
        if self.rank == 0:
            size = sum(p.stat().st_size for p in box["final"].rglob("*") if p.is_file())
            self.written.append({"step": step, "bytes": size, "seconds": round(time.perf_counter() - t0, 3)})
            gone = f"; deleted {', '.join(box['gone'])} (--keep-last {self.keep_last})" if box["gone"] else ""
            self.r.log.info("checkpoint %s (%.3g GiB)%s", box["final"], size / storage.GIB, gone)

    def _space(self, need: int, step: int) -> None:
        free = storage.free_bytes(self.root)
        if free < need:  # before writing anything
            raise OSError(errno.ENOSPC, f"checkpoint step {step} needs {need} bytes, {free} are free")

    def _agree(self, fn, step: int) -> None:
        """Run ``fn`` on rank 0; every rank raises if it failed (rank 0's error, or the disk-full line)."""
        err = None
        if self.rank == 0:
            try:
                fn()
            except Exception as e:
                err = e
        box = [None if err is None else (storage.is_disk_full(err), f"{type(err).__name__}: {err}")]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        full, line = box[0]
        if full:
            raise OSError(errno.ENOSPC, line)  # _failed names it
        raise err if err is not None else RuntimeError(f"rank 0 failed while writing checkpoint step {step}: {line}")

    def _failed(self, e: BaseException, tmp: Path, step: int) -> None:
        """A full disk: give the space back and stop with one line; anything else propagates (the folder stays hidden)."""
        if storage.is_disk_full(e):
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            last = resume.latest(self.root)
            msg = storage.disk_full_message(self.r.out, f"checkpoint step {step}", self.r.plan, last.name if last else None)
            raise TrainingStopped(msg) from None


def _clone(obj):
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj.detach().clone() if torch.is_tensor(obj) else obj
