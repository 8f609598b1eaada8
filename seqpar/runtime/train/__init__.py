"""The trainer every rank runs (``python -m seqpar.runtime.train``), its engines, reports, trackers and stopping, and ``seqpar verify``."""
