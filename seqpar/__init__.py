"""seqpar: plan, check and run sequence-parallel long-context training.

`import seqpar` is light (no torch): the advisor and the schema need nothing more. The training-loop API
(`seqpar.apply`, `seqpar.prepare_inputs`, `seqpar.loss`, the EasyContext-compatible functions, and
`seqpar.with_seqpar` / `seqpar.SeqparArguments` for the transformers Trainer) lives in `seqpar.runtime` and is imported
on first use; `dir(seqpar)` and `__all__` list it. Without torch installed, using it raises one line naming the extra to
install (seqpar.plan.extras).
"""

from seqpar.plan.extras import lazy_api

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


__getattr__, __dir__ = lazy_api("seqpar", _RUNTIME_API, globals())
