"""The runtime: sequence-parallel attention, the transformers integration, the trainer and the launcher.

Never imports seqpar.advisor: a launch plan is all it needs.
"""

# Sequence-parallel attention API. Imported directly (this imports torch): a lazy __getattr__ cannot work here,
# because importing the submodule seqpar.runtime.attention would bind the package attribute `attention` to the module.
from seqpar.runtime.attention import attention  # noqa: E402
from seqpar.runtime.data_parallel import local_attention  # noqa: E402
from seqpar.runtime.layout import shard, unshard  # noqa: E402

__all__ = ["attention", "local_attention", "shard", "unshard"]
