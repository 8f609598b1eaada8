"""What a person watching the run sees: a rich progress bar on rank 0 and a log file in the output folder.

The bar shows step, loss, tokens/s, peak memory and ETA. When stderr is not a terminal (CI, torchrun with redirected
output) the bar is replaced by a log line every ``log_every`` steps. Every rank logs warnings and errors; rank 0 also
logs progress to ``<output>/train.log``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

try:  # rich is a core dependency, but a bare GPU image may run the trainer without it: then log lines only
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
except ImportError:  # pragma: no cover
    Console = None


def setup_logging(out: Path, rank: int) -> logging.Logger:
    log = logging.getLogger("seqpar.train")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fmt = logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    if rank == 0:
        fh = logging.FileHandler(out / "train.log")
        fh.setFormatter(fmt)
        log.addHandler(fh)
    sh = logging.StreamHandler(sys.stderr)
    sh.setFormatter(logging.Formatter(f"[seqpar rank {rank}] %(message)s"))
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
