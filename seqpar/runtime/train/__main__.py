"""``python -m seqpar.runtime.train``: the trainer every rank runs (seqpar.runtime.train.loop)."""

import logging
import os
import sys

from seqpar.runtime.train.loop import main

code = main()
# Whatever the outcome, everything is written and recorded by now (checkpoint, report, metrics, trackers finished,
# torchrun's error file): skip the interpreter's teardown, where a C++ thread of gloo or the heartbeat's store client
# can still abort the rank ("terminate called without an active exception", a second line after the launcher's one,
# or a finished run's rank killed by SIGABRT; seen under load), and which costs seconds of CPU per rank.
logging.shutdown()
sys.stdout.flush(), sys.stderr.flush()
os._exit(code)
