"""``python -m seqpar.runtime.eval``: forward-only evaluation on every rank (seqpar.runtime.eval.run)."""

import sys

from seqpar.runtime.eval.run import main

sys.exit(main())
