"""The runtime: sequence-parallel attention, the transformers integration, the trainer and the launcher.

Never imports seqpar.advisor: a launch plan is all it needs.

The launcher side (seqpar.runtime.launch, storage, resume's launch check, data's checks) is torch-free, so this package
must import without torch: an advisor-only install runs ``seqpar launch plan.json --dry-run``. The attention API below
needs torch and is imported with the package only when torch is installed. It cannot be a lazy ``__getattr__``: the
first import of the submodule seqpar.runtime.attention (by hf.py, say) binds the package attribute ``attention`` to that
module, shadowing the function for good. Without torch, the API names raise one line naming the extra to install.
"""

import importlib.util

__all__ = ["attention", "local_attention", "shard", "unshard"]

if importlib.util.find_spec("torch") is not None:
    from seqpar.runtime.attention import attention
    from seqpar.runtime.data_parallel import local_attention
    from seqpar.runtime.layout import shard, unshard
else:

    def __getattr__(name: str):
        if name in __all__:
            from seqpar.extras import MissingExtra, missing_message

            raise MissingExtra(missing_message("torch", f"seqpar.runtime.{name}"))
        raise AttributeError(f"module 'seqpar.runtime' has no attribute {name!r}")
