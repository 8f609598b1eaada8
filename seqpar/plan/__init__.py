"""The plan's vocabulary: specs, validity rules, the launch plan, modes, options, FLOPs, units, errors and the job spec.

Pure Python (pydantic at most): imports nothing else of seqpar, and every other package reads it."""
