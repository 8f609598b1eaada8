"""The advisor: probe the hardware, apply the guide's rules and the cost model, write a launch plan.

Pure Python: never imports torch or seqpar.runtime, so `seqpar advise` runs on a laptop without a GPU.
"""
