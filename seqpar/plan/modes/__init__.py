"""Sequence-parallel modes: each one registered description (seqpar.plan.modes.description) that the plan, the advisor,
the runtime and the emitters read; the five built-in ones (seqpar.plan.modes.builtin) register on import.

Adding a mode is one module: its runtime functions (``forward``, ``backward``, ``<name>_attention``, as
seqpar.runtime.parallel.attention states) and ``register(ModeDescription(...))``, choosing its layout, degrees,
communication shape, balance and export rows from the vocabularies the rest of seqpar already acts on (description.py).
A new vocabulary word (a layout, a communication pattern the cost model does not price yet) is the one thing that
takes an edit where it is read. Dependency-free (no pydantic, no torch).
"""

from __future__ import annotations

from seqpar.plan.modes import builtin  # noqa: F401  (registers the five built-in modes)
from seqpar.plan.modes.description import BALANCES, COMM, DEGREES, LAYOUTS, ModeDescription
from seqpar.plan.modes.registry import (
    check_mode,
    describe,
    hybrid_names,
    is_registered,
    names,
    register,
    registered,
    splits_sequence,
    takes_ulysses_degree,
    ulysses_arg,
    unregister,
)
from seqpar.plan.modes.split import check_heads, check_split, degrees, head_degree, nearest_multiples, split_multiple

__all__ = [
    "BALANCES",
    "COMM",
    "DEGREES",
    "LAYOUTS",
    "ModeDescription",
    "check_heads",
    "check_mode",
    "check_split",
    "degrees",
    "describe",
    "head_degree",
    "hybrid_names",
    "is_registered",
    "names",
    "nearest_multiples",
    "register",
    "registered",
    "split_multiple",
    "splits_sequence",
    "takes_ulysses_degree",
    "ulysses_arg",
    "unregister",
]
