"""The one error type of seqpar: invalid input, said in one line that names the value, the rule and a fix.

Needs nothing (no pydantic, no torch), so every layer raises it directly: the schema, the advisor, the runtime on a GPU
image without pydantic, and the trainer on every rank. The CLI maps it to exit code 2.
"""

from __future__ import annotations


class SeqparError(ValueError):
    """Invalid input: one line that names the value, the rule and a fix (the CLI maps it to exit code 2)."""


__all__ = ["SeqparError"]
