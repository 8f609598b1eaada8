"""The runtime: sequence-parallel attention, the transformers integration, the trainer and the launcher, in wings.

Never imports seqpar.advisor: a launch plan is all it needs. Importing this package imports nothing (the launcher wing,
seqpar.runtime.launch, runs without torch); the attention API below is imported on first use, and without torch it
raises one line naming the extra to install.
"""

from seqpar.plan.extras import lazy_api

_API = {  # name -> the module that defines it
    "attention": "seqpar.runtime.parallel.attention",
    "local_attention": "seqpar.runtime.parallel.data_parallel",
    "shard": "seqpar.runtime.parallel.layout",
    "unshard": "seqpar.runtime.parallel.layout",
}

__all__ = list(_API)


__getattr__, __dir__ = lazy_api("seqpar.runtime", _API, globals())
