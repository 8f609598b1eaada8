"""The cost model: per-GPU memory and step time of a strategy, their coefficients and how they are fitted to measurements."""
