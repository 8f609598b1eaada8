"""How a strategy's options read in text: declared once, on each option's field, and read by every renderer.

An option (a Strategy field a plan turns on beside its mode, degrees, checkpointing, sharding and loss: fused_ops,
tiled_mlp) carries a ``Shown`` in its annotation, ``Annotated[bool, Shown(...)]``: pydantic keeps it in the field's
metadata and out of the JSON schema. Renderers never name an option: a strategy's one-line name
(seqpar.advisor.search.describe), a measurement row's label (seqpar.advisor.cost.measurements), a picture's title
(seqpar.advisor.plots) and the plan's Strategy table (seqpar.advisor.render) come from ``tags`` and ``rows``, and the
advisor carries a request's pins into a strategy through ``option_names``. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Form = Literal["name", "label", "title"]


@dataclass(frozen=True)
class Shown:
    """``row``: the option's row in the plan's Strategy table (a switch reads yes / no there, other values as they are).
    The others are tags, shown only where the value differs from the field's default, ``{}`` standing for the value:
    ``name`` in a strategy's one-line name (``ops={}``), ``label`` in a measurement row's label, ``title`` in a
    picture's title."""

    row: str
    name: str
    label: str
    title: str


def shown_fields(model) -> dict[str, Shown]:
    """The option fields of a pydantic model (class or instance), in declaration order, with their ``Shown``."""
    fields = type(model).model_fields if not isinstance(model, type) else model.model_fields
    return {k: m for k, f in fields.items() for m in f.metadata if isinstance(m, Shown)}


def option_names(model) -> tuple[str, ...]:
    """The names of the option fields (fused_ops, tiled_mlp, ...) in declaration order."""
    return tuple(shown_fields(model))


def tags(strategy, form: Form) -> list[str]:
    """The tags in ``form`` of the options whose value differs from the default, sorted (so where an option is declared
    does not move them)."""
    fields = type(strategy).model_fields
    out = []
    for k, shown in shown_fields(strategy).items():
        value = getattr(strategy, k)
        if value != fields[k].default:
            out.append(getattr(shown, form).format(value))
    return sorted(out)


def rows(strategy) -> list[tuple[str, str]]:
    """(row, value) of every option in declaration order: a switch as yes / no, other values as they are."""
    out = []
    for k, shown in shown_fields(strategy).items():
        value = getattr(strategy, k)
        out.append((shown.row, ("yes" if value else "no") if isinstance(value, bool) else str(value)))
    return out


__all__ = ["Form", "Shown", "option_names", "rows", "shown_fields", "tags"]
