"""Forward-only evaluation in a plan's layout (``python -m seqpar.runtime.eval``): held-out loss, needle in a haystack, and what is shown of it."""
