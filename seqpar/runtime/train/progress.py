"""What a person watching the run sees: a rich progress bar on rank 0 and a log file in the output folder.

The bar shows step, loss, tokens/s, peak memory and ETA. When stderr is not a terminal (CI, torchrun with redirected
output) the bar is replaced by a log line every ``log_every`` steps. Every rank logs warnings and errors; rank 0 also
logs progress to ``<output>/train.log``.

A log line carries values read from files (a checkpoint's recorded settings, a data path, a plan's name): each message
is one line with its control characters, line separators and bidirectional overrides escaped
(seqpar.plan.safe.printable), so a value cannot start a line of its own in the log or redraw the terminal. train.log
is opened without following a symbolic link (seqpar.runtime.train.run_files).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from seqpar.plan.safe import open_nofollow, printable

MESSAGE_LIMIT = 4000  # characters of one log message; the plan line and the data note are well under it

try:  # rich is a core dependency, but a bare GPU image may run the trainer without it: then log lines only
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
except ImportError:  # pragma: no cover
    Console = None


class OneLineFormatter(logging.Formatter):
    """Each message on one line, escaped (the traceback of an exception, ours, keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message, limit=MESSAGE_LIMIT)  # format() sets it afresh for every handler
        return super().formatMessage(record)


class RunLogHandler(logging.FileHandler):
    """logging.FileHandler that opens its file without following a symbolic link (a link, FIFO or folder there is a
    SeqparError when the handler is made)."""

    def _open(self):
        fd = open_nofollow(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what="log file")
        return os.fdopen(fd, "a", encoding=self.encoding or "utf-8", errors=self.errors)


def setup_logging(out: Path, rank: int) -> logging.Logger:
    log = logging.getLogger("seqpar.train")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fmt = OneLineFormatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    if rank == 0:
        fh = RunLogHandler(out / "train.log", encoding="utf-8")
        fh.setFormatter(fmt)
        log.addHandler(fh)
    sh = logging.StreamHandler(sys.stderr)
    sh.setFormatter(OneLineFormatter(f"[seqpar rank {rank}] %(message)s"))
    sh.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.addHandler(sh)
    return log


class ProgressBar:
    """Rank 0's bar; a no-op elsewhere."""

    def __init__(self, rank: int, total: int, start: int, log: logging.Logger, log_every: int = 10):
        self.log, self.log_every, self.total = log, max(1, log_every), total
        console = Console(stderr=True) if Console is not None else None
        self.live = rank == 0 and console is not None and console.is_terminal
        self.bar = None
        if self.live:
            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("peak {task.fields[mem]} GiB"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self.task = self.bar.add_task("train", total=total, completed=start, loss="-", tps="-", mem="-")
            self.bar.start()
        self.rank = rank

    def update(self, rec: dict) -> None:
        if self.rank != 0:
            return
        msg = (
            f"step {rec['step']}/{self.total} loss {rec['loss']:.4f} lr {rec['lr']:.3g} "
            f"{rec['tokens_per_s']:.0f} tok/s peak {rec['peak_memory_gib']:.2f} GiB"
        )
        if self.live:
            self.bar.update(
                self.task,
                completed=rec["step"],
                loss=f"{rec['loss']:.4f}",
                tps=f"{rec['tokens_per_s']:.0f}",
                mem=f"{rec['peak_memory_gib']:.2f}",
            )
            for h in self.log.handlers:  # the file still gets every line; the terminal has the bar
                if isinstance(h, logging.FileHandler):
                    h.handle(self.log.makeRecord(self.log.name, logging.INFO, "", 0, msg, None, None))
        elif rec["step"] % self.log_every == 0 or rec["step"] == self.total:
            self.log.info(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
