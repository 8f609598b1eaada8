"""``seqpar launch``: check a plan against this machine and run its job(s) under torchrun's agent.

Importable without torch (an advisor-only install runs ``seqpar launch --dry-run``)."""
