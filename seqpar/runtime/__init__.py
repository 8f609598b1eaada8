"""The runtime: sequence-parallel attention, the transformers integration, the trainer and the launcher, in wings.

Never imports seqpar.advisor: a launch plan is all it needs. Importing this package imports nothing (the launcher wing,
seqpar.runtime.launch, runs without torch); the attention API below is imported on first use, and without torch it
raises one line naming the extra to install.
"""

_API = {  # name -> the module that defines it
    "attention": "seqpar.runtime.parallel.attention",
    "local_attention": "seqpar.runtime.parallel.data_parallel",
    "shard": "seqpar.runtime.parallel.layout",
    "unshard": "seqpar.runtime.parallel.layout",
}

__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib

        try:
            module = importlib.import_module(_API[name])
        except ModuleNotFoundError as e:
            from seqpar.plan.extras import MissingExtra, from_error

            line = from_error(e)
            if line is None:
                raise
            raise MissingExtra(f"seqpar.runtime.{name}: {line}") from None
        return getattr(module, name)
    raise AttributeError(f"module 'seqpar.runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
