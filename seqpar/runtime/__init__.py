"""The runtime: sequence-parallel attention, the transformers integration, the trainer and the launcher.

Never imports seqpar.advisor: a launch plan is all it needs.
"""
