"""seqpar: plan, check and run sequence-parallel long-context training.

`import seqpar` is light (no torch): the advisor and the schema need nothing more. The training-loop API
(`seqpar.apply`, `seqpar.prepare_inputs`, `seqpar.loss`, the EasyContext-compatible functions, and
`seqpar.with_seqpar` / `seqpar.SeqparArguments` for the transformers Trainer) lives in
`seqpar.runtime` and is imported on first use.
"""

__version__ = "0.1.0"

_RUNTIME_API = {  # name -> the runtime module that defines it
    "apply": "seqpar.runtime.hf",
    "prepare_inputs": "seqpar.runtime.inputs",
    "loss": "seqpar.runtime.loss",
    "loss_from_hidden": "seqpar.runtime.loss",
    "prepare_seq_parallel_inputs": "seqpar.runtime.easycontext",
    "apply_seq_parallel_monkey_patch": "seqpar.runtime.easycontext",
    "with_seqpar": "seqpar.runtime.hf_trainer",  # transformers Trainer / TRL SFTTrainer in seqpar's modes
    "SeqparArguments": "seqpar.runtime.hf_trainer",
}


def __getattr__(name: str):
    if name in _RUNTIME_API:
        import importlib

        return getattr(importlib.import_module(_RUNTIME_API[name]), name)
    raise AttributeError(f"module 'seqpar' has no attribute {name!r}")
