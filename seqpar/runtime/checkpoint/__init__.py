"""Training checkpoints: sharded files committed atomically, what resuming may change, when checkpoints are written and what they cost.

storage and resume are torch-free: the launcher checks a run before starting it."""
