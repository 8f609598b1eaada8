"""The registry of modes: ``register(description)`` makes a mode every layer accepts (the plan's strategy.mode, the
advisor's search and cost terms, the runtime's attention, the emitters' capability table); ``describe(name)`` is what
they all read. The five built-in modes register through it (seqpar.plan.modes.builtin), in the order they are listed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes.description import ModeDescription

_REGISTRY: dict[str, ModeDescription] = {}  # name -> description, in registration order


def register(description: ModeDescription, *, replace: bool = False) -> ModeDescription:
    """Make ``description`` a mode. Registering an equal description again is a no-op (a module that registers on import
    may be imported twice); another description under a taken name or implementation needs ``replace=True``."""
    if not isinstance(description, ModeDescription):
        raise TypeError(f"register takes a ModeDescription, got {type(description).__name__}")
    name = description.name
    old = _REGISTRY.get(name)
    if old == description:
        return description
    if old is not None and not replace:
        raise SeqparError(f"mode {name!r} is already registered with another description; pass replace=True to replace it")
    clash = next((d.name for d in _REGISTRY.values() if d.implementation == description.implementation and d.name != name), None)
    if clash is not None:
        raise SeqparError(f"mode {name!r}: implementation {description.implementation!r} is already {clash!r}'s")
    _REGISTRY[name] = description
    return description


def unregister(name: str) -> None:
    """Remove a registered mode (tests that register a mode of their own clean up with it)."""
    if name not in _REGISTRY:
        raise SeqparError(f"mode {name!r} is not registered")
    del _REGISTRY[name]


@contextmanager
def registered(description: ModeDescription) -> Iterator[ModeDescription]:
    """``description`` registered for the block, and the registry as it was afterwards."""
    before = _REGISTRY.get(description.name)
    register(description, replace=True)
    try:
        yield description
    finally:
        if before is None:
            _REGISTRY.pop(description.name, None)
        else:
            _REGISTRY[description.name] = before


def names() -> tuple[str, ...]:
    """The registered modes' names, in registration order (the five built-in ones first)."""
    return tuple(_REGISTRY)


def is_registered(name: object) -> bool:
    return isinstance(name, str) and name in _REGISTRY


def check_mode(mode: str, what: str = "mode") -> None:
    """SeqparError naming the registered modes when ``mode`` is not one of them."""
    if not is_registered(mode):
        raise SeqparError(f"{what} {mode!r} is unknown; use one of {', '.join(names())}")


def describe(mode: str) -> ModeDescription:
    """The description of a registered mode; SeqparError naming the valid modes for an unknown one."""
    check_mode(mode)
    return _REGISTRY[mode]


def splits_sequence(mode: str) -> bool:
    """Whether the mode splits a sequence over its sp_degree ranks (False for whole sequences and unknown names)."""
    return is_registered(mode) and _REGISTRY[mode].splits_sequence


def takes_ulysses_degree(mode: str) -> bool:
    """Whether the plan's ulysses_degree applies to the mode (a head split over part of the group; False for unknown names)."""
    return is_registered(mode) and _REGISTRY[mode].takes_ulysses_degree


def ulysses_arg(mode: str, ulysses_degree: int | None) -> int | None:
    """The runtime's ulysses_degree argument for a plan's mode: its ulysses_degree where the mode takes one, else None."""
    return ulysses_degree if takes_ulysses_degree(mode) else None


def hybrid_names() -> str:
    """The modes that take a ulysses_degree, for messages ("usp_attn")."""
    return " or ".join(m for m in _REGISTRY if _REGISTRY[m].takes_ulysses_degree) or "no registered mode"


__all__ = [
    "check_mode",
    "describe",
    "hybrid_names",
    "is_registered",
    "names",
    "register",
    "registered",
    "splits_sequence",
    "takes_ulysses_degree",
    "ulysses_arg",
    "unregister",
]
