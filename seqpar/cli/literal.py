"""Text from files printed as it reads: a plan, a model config or a data file cannot restyle or hide what the terminal shows.

``literal`` escapes control characters (ESC[2K would erase the line before it, CR would overwrite it), bidirectional
overrides (they reorder what is shown) and lone surrogates (unprintable as UTF-8); ``shown`` makes a copy of a pydantic
model with every string literal and its rich markup escaped, for the rich renderings of ``seqpar explain`` and ``advise``.
Needs rich only inside ``shown``.
"""

from __future__ import annotations

import re

# C0/C1 control characters but newline, bidirectional overrides and isolates, lone surrogates (unprintable as UTF-8)
_UNPRINTABLE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def literal(text: str, newlines: bool = True) -> str:
    """``text`` as it reads: control characters, bidi overrides and lone surrogates shown as escapes (ESC -> \\x1b);
    newlines kept unless ``newlines`` is False."""
    out = _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)
    return out if newlines else out.replace("\n", "\\n")


def shown(obj):
    """A copy of a plan (any pydantic model, list, dict) for rich to render: every string literal (``literal``, newlines
    too) and its rich markup escaped. Numbers are untouched, so the cost model predicts the copy as it would the plan."""
    from pydantic import BaseModel
    from rich.markup import escape

    if isinstance(obj, str):
        return escape(literal(obj, newlines=False))
    if isinstance(obj, BaseModel):
        fields = {k: shown(getattr(obj, k)) for k in type(obj).model_fields}
        return type(obj).model_construct(_fields_set=obj.model_fields_set, **fields)
    if isinstance(obj, (list, tuple)):
        return type(obj)(shown(x) for x in obj)
    if isinstance(obj, dict):
        return {shown(k): shown(v) for k, v in obj.items()}
    return obj


__all__ = ["literal", "shown"]
