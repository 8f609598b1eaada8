"""DeepSpeed's own checkpoint of a ZeRO engine: its sharded state saved and loaded by DeepSpeed, and the whole weights
gathered for the export (seqpar.runtime.checkpoint.shards calls these for DeepSpeed plans; the engine itself is built by
seqpar.runtime.train.deepspeed)."""

from __future__ import annotations


def is_engine(wrapped) -> bool:
    return hasattr(wrapped, "save_checkpoint") and hasattr(wrapped, "zero_optimization_stage")


def full_weights(wrapped) -> dict:
    """Collective: the weights in the engine's compute dtype gathered on rank 0 (keys relative to the loss module); {}
    elsewhere. ZeRO-3 gathers its partitions layer by layer (``stage3_gather_16bit_weights_on_model_save``)."""
    import torch.distributed as dist

    if wrapped.zero_optimization_stage() == 3:
        return wrapped._zero3_consolidated_16bit_state_dict() or {}
    if dist.get_rank() != 0:
        return {}
    return {k: v.detach().cpu() for k, v in wrapped.module.state_dict().items()}


def save(wrapped, folder) -> None:
    """Collective: DeepSpeed's sharded checkpoint (every rank writes its partition) under ``folder``."""
    wrapped.save_checkpoint(str(folder), tag="state")


def load(wrapped, folder) -> None:
    """Collective: model, fp32 master partitions, optimizer moments and DeepSpeed's step counters from ``save``'s folder
    (the LR scheduler is the trainer's and comes from its own file)."""
    path, _ = wrapped.load_checkpoint(str(folder), tag="state", load_lr_scheduler_states=False)
    if path is None:
        from seqpar.plan.errors import SeqparError

        raise SeqparError(f"checkpoint {str(folder)!r} holds no DeepSpeed state; resume with the plan that wrote it")


__all__ = ["full_weights", "is_engine", "load", "save"]
