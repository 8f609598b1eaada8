"""seqpar: plan, check and run sequence-parallel long-context training.

`import seqpar` is light (no torch): the advisor and the schema need nothing more. The training-loop API
(`seqpar.apply`, `seqpar.prepare_inputs`, `seqpar.loss`, the EasyContext-compatible functions, and
`seqpar.with_seqpar` / `seqpar.SeqparArguments` for the transformers Trainer) lives in `seqpar.runtime` and is imported
on first use; `dir(seqpar)` and `__all__` list it. Without torch installed, using it raises one line naming the extra to
install (seqpar.plan.extras).
"""

__version__ = "0.1.0"

_RUNTIME_API = {  # name -> the runtime module that defines it
    "apply": "seqpar.runtime.hf.apply",
    "prepare_inputs": "seqpar.runtime.parallel.inputs",
    "loss": "seqpar.runtime.parallel.loss",
    "loss_from_hidden": "seqpar.runtime.parallel.loss",
    "prepare_seq_parallel_inputs": "seqpar.runtime.hf.easycontext",
    "apply_seq_parallel_monkey_patch": "seqpar.runtime.hf.easycontext",
    "with_seqpar": "seqpar.runtime.hf.trainer",  # transformers Trainer / TRL SFTTrainer in seqpar's modes
    "SeqparArguments": "seqpar.runtime.hf.trainer",
}

__all__ = ["__version__", *_RUNTIME_API]


def __getattr__(name: str):
    if name in _RUNTIME_API:
        import importlib

        try:
            module = importlib.import_module(_RUNTIME_API[name])
        except ModuleNotFoundError as e:
            from seqpar.plan.extras import MissingExtra, from_error

            line = from_error(e)
            if line is None:
                raise
            raise MissingExtra(f"seqpar.{name}: {line}") from None
        return getattr(module, name)
    raise AttributeError(f"module 'seqpar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_RUNTIME_API))
