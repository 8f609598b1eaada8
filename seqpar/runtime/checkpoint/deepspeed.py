"""DeepSpeed's own checkpoint of a ZeRO engine: its sharded state saved and loaded by DeepSpeed through a checkpoint
engine that never pickles, and the whole weights gathered for the export (seqpar.runtime.checkpoint.shards calls these
for DeepSpeed plans; seqpar.runtime.train.deepspeed installs the engine on the DeepSpeed engine it builds).

DeepSpeed's TorchCheckpointEngine writes each state with torch.save and reads it back with torch's full unpickler
(``weights_only`` off): a forged state file runs code on ``--resume``. ``SafeCheckpointEngine`` writes the same state
dicts as one safetensors file each (under DeepSpeed's file names, ``*.pt``): the tensors as tensors, and the rest of
the structure as JSON in the safetensors header, with a tag for each value JSON has no word for. What
DeepSpeed stores (ZeRO-2 and ZeRO-3, with and without offload, read off real runs): dicts with str and int keys,
OrderedDicts, lists, tuples, torch.Size, numbers, strings, None, tensors, torch dtypes, its ZeroStageEnum, its loss
scalers and fragment_address records. Loading rebuilds exactly those: a class is chosen from ``_CLASSES`` by name,
never imported from what the file says, so a file can fail to load (one line) but cannot run code.
``consolidated_fp32`` runs DeepSpeed's zero_to_fp32 over this format.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from pathlib import Path

TREE = "seqpar.deepspeed.tree"  # the safetensors metadata key holding the structure
VERSION = "1"
_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies them beside its states; they read pickles
# The classes DeepSpeed puts in its states: tag name -> (module, class name, how it is rebuilt)
_CLASSES = {
    "LossScaler": ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", "attrs"),
    "DynamicLossScaler": ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", "attrs"),
    "fragment_address": ("deepspeed.utils.tensor_fragment", "fragment_address", "fields"),
    "ZeroStageEnum": ("deepspeed.runtime.zero.config", "ZeroStageEnum", "enum"),
}
_DEPTH = 64  # DeepSpeed's states nest a few levels; a deeper tree is not one this engine wrote


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
    """Collective: DeepSpeed's sharded checkpoint (every rank writes its partition) under ``folder``, pickle-free."""
    install(wrapped)
    # LoRA: the frozen base stays out (DeepSpeed's own option); the run rebuilds it from its model or seed
    wrapped.save_checkpoint(str(folder), tag="state", save_latest=False, exclude_frozen_parameters=_frozen(wrapped))
    if wrapped.global_rank == 0:  # it copied them during its own save; they cannot read this format
        for name in _RECOVERY_SCRIPTS:
            Path(folder, name).unlink(missing_ok=True)


def load(wrapped, folder) -> None:
    """Collective: model, fp32 master partitions, optimizer moments and DeepSpeed's step counters from ``save``'s folder
    (the LR scheduler is the trainer's and comes from its own file)."""
    install(wrapped)
    path, _ = wrapped.load_checkpoint(
        str(folder), tag="state", load_lr_scheduler_states=False, load_module_strict=not _frozen(wrapped)
    )
    if path is None:
        from seqpar.plan.errors import SeqparError

        raise SeqparError(f"checkpoint {str(folder)!r} holds no DeepSpeed state; resume with the plan that wrote it")


def _frozen(wrapped) -> bool:
    return any(not p.requires_grad for p in wrapped.module.parameters())


def trainable_fp32(wrapped) -> dict:
    """Collective: the trainable parameters' fp32 values (DeepSpeed's master copies, whole: ``safe_get_full_fp32_param``)
    by name relative to the loss module, on rank 0; {} elsewhere. What a LoRA run's adapter is written from."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in wrapped.module.named_parameters():
        if p.requires_grad:
            full = safe_get_full_fp32_param(p)  # every rank: ZeRO-3 gathers the partitions
            if dist.get_rank() == 0:
                out[name] = full.detach().cpu()
    return out


def install(wrapped) -> None:
    """Make ``wrapped`` (a DeepSpeed engine) save and load its checkpoints with SafeCheckpointEngine."""
    if not isinstance(getattr(wrapped, "checkpoint_engine", None), _engine_class()):
        wrapped.checkpoint_engine = _engine_class()()


def _engine_class():
    global _ENGINE
    if _ENGINE is None:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

        class SafeCheckpointEngine(CheckpointEngine):
            """DeepSpeed's checkpoint engine interface over ``write`` and ``read``: no torch.save, no torch.load."""

            def __init__(self, config_params=None):
                super().__init__(config_params)
                self.name = "SeqparSafeCheckpointEngine"

            def create(self, info) -> None:
                pass

            def save(self, state_dict, path: str) -> None:
                write(state_dict, path)

            def load(self, path: str, map_location=None):
                return read(path, map_location)

            def commit(self, info) -> bool:
                return True

        _ENGINE = SafeCheckpointEngine
    return _ENGINE


_ENGINE = None


# --------------------------------------------------------------------------------------------- the format


def write(tree, path: str | Path) -> None:
    """``tree`` (a DeepSpeed state dict) as one safetensors file at ``path``: its tensors, and its structure as JSON."""
    from safetensors.torch import save_file

    tensors: dict = {}
    meta = {"format": "pt", TREE: json.dumps(_encode(tree, tensors), separators=(",", ":")), "version": VERSION}
    seen = set()
    for key, t in tensors.items():  # safetensors refuses two names over one storage (a tensor held twice)
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            tensors[key] = t.clone()
        seen.add(ptr)
    tmp = Path(f"{path}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def read(path: str | Path, map_location=None, *, structure_only: bool = False):
    """The tree ``write`` wrote at ``path``; ``map_location`` a device (or DeepSpeed's identity function: CPU).
    ``structure_only``: the tree with None for each tensor (the header alone is read)."""
    import torch
    from safetensors import SafetensorError, safe_open

    from seqpar.plan.errors import SeqparError
    from seqpar.plan.safe import printable

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("version") != VERSION or TREE not in meta:
                raise ValueError(f"no {TREE} in its header")
            tensors = {k: None if structure_only else f.get_tensor(k) for k in f.keys()}
        if map_location is not None and not callable(map_location) and not structure_only:
            tensors = {k: v.to(torch.device(map_location)) for k, v in tensors.items()}
        return _decode(json.loads(meta[TREE]), tensors, 0)
    except (SafetensorError, OSError, ValueError, TypeError, KeyError, IndexError, RecursionError) as e:
        why = printable(str(e).splitlines()[0] if str(e) else type(e).__name__, 160)
        raise SeqparError(
            f"checkpoint file {printable(str(path))!r} is not a DeepSpeed state seqpar wrote ({why}); resume from another "
            f"checkpoint (edit `latest`), or start a new --output"
        ) from None


def check(path: str | Path) -> None:
    """SeqparError (one line) unless ``path`` is a state ``write`` wrote: its header and structure, no tensor read."""
    read(path, structure_only=True)


def consolidated_fp32(folder: str | Path) -> dict:
    """DeepSpeed's fp32 weights of a ``save`` folder, consolidated by DeepSpeed's own zero_to_fp32 with this format as
    its reader (it reads with torch.load; here it reads with ``read``)."""
    from unittest import mock

    from deepspeed.utils import zero_to_fp32

    def _read(f, map_location=None, **_):
        return read(f, map_location)

    with mock.patch.object(zero_to_fp32.torch, "load", _read):
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(folder), tag="state")


def _encode(x, tensors: dict):
    import torch

    if x is None or isinstance(x, (bool, str)) or type(x) is int:
        return x
    if type(x) is float:
        return x if math.isfinite(x) else {"@": "float", "v": repr(x)}
    if torch.is_tensor(x):
        key = f"t{len(tensors)}"
        t = x.detach().to("cpu")
        # safetensors stores each tensor's own bytes: a view into a larger buffer (ZeRO's flat partitions) is copied
        tensors[key] = t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t.contiguous()
        return {"@": "tensor", "k": key}
    if isinstance(x, torch.Size):
        return {"@": "size", "v": list(x)}
    if isinstance(x, torch.dtype):
        return {"@": "dtype", "v": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"@": "device", "v": str(x)}
    if isinstance(x, (dict, OrderedDict)):
        kind = "odict" if isinstance(x, OrderedDict) else "dict"
        return {"@": kind, "v": [[_encode(k, tensors), _encode(v, tensors)] for k, v in x.items()]}
    if type(x) is list:
        return [_encode(v, tensors) for v in x]
    if type(x) is tuple:
        return {"@": "tuple", "v": [_encode(v, tensors) for v in x]}
    name = type(x).__name__
    if name in _CLASSES and type(x).__module__ == _CLASSES[name][0]:
        how = _CLASSES[name][2]
        if how == "enum":
            return {"@": "enum", "c": name, "v": x.value}
        return {"@": "object", "c": name, "v": _encode(dict(vars(x)), tensors)}
    raise TypeError(
        f"DeepSpeed's checkpoint holds a {type(x).__module__}.{type(x).__qualname__}, which seqpar's pickle-free format "
        f"does not know; add it to seqpar.runtime.checkpoint.deepspeed._CLASSES"
    )


def _decode(x, tensors: dict, depth: int):
    import torch

    if depth > _DEPTH:
        raise ValueError("the state nests deeper than DeepSpeed's do")
    if x is None or isinstance(x, (bool, str, int, float)):
        return x
    if isinstance(x, list):
        return [_decode(v, tensors, depth + 1) for v in x]
    if not isinstance(x, dict) or not isinstance(x.get("@"), str):
        raise ValueError("an untagged object in the state")
    tag, v = x["@"], x.get("v")
    if tag == "tensor":
        return tensors[x["k"]]
    if tag == "float":
        if v not in ("inf", "-inf", "nan"):
            raise ValueError(f"float {v!r}")
        return float(v)
    if tag == "size":
        return torch.Size([int(n) for n in v])
    if tag == "dtype":
        dtype = getattr(torch, str(v), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {v!r}")
        return dtype
    if tag == "device":
        return torch.device(str(v))
    if tag in ("dict", "odict"):
        pairs = [(_decode(k, tensors, depth + 1), _decode(val, tensors, depth + 1)) for k, val in v]
        if any(not isinstance(k, (str, int)) for k, _ in pairs):
            raise ValueError("a key that is not a string or an integer")
        return OrderedDict(pairs) if tag == "odict" else dict(pairs)
    if tag == "tuple":
        return tuple(_decode(val, tensors, depth + 1) for val in v)
    if tag in ("enum", "object") and x.get("c") in _CLASSES:
        import importlib

        module, cls_name, how = _CLASSES[x["c"]]
        cls = getattr(importlib.import_module(module), cls_name)
        if how == "enum":
            return cls(v)
        attrs = _decode(v, tensors, depth + 1)
        if not isinstance(attrs, dict) or any(not isinstance(k, str) for k in attrs):
            raise ValueError(f"{cls_name}'s fields")
        if how == "fields":
            return cls(**attrs)
        obj = cls.__new__(cls)  # object.__new__: no constructor of DeepSpeed's runs on the file's values
        obj.__dict__.update(attrs)
        return obj
    raise ValueError(f"unknown tag {str(tag)[:40]!r}")


__all__ = [
    "check",
    "consolidated_fp32",
    "full_weights",
    "install",
    "is_engine",
    "load",
    "read",
    "save",
    "trainable_fp32",
    "write",
]
