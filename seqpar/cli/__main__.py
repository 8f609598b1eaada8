"""``python -m seqpar.cli``: the `seqpar` command."""

from seqpar.cli import main

main()
