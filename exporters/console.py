"""What the console shows: our stages, progress and summary. Everything else goes to the run's log.

Libraries talk a lot during an export: Python warnings (FutureWarning from torch and ExecuTorch), INFO
lines on the root logger, and the C++ runtime and cpuinfo writing straight to file descriptor 2 ("No temp
allocator provided", once per kernel call). They go to ``llm.log`` (or nowhere, for ``exporters.generate``);
``verbose=true`` puts them back on the console.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

VERBOSE = False  # set from the command line's verbose=true


class StoryFilter(logging.Filter):
    """Console filter: this tool's own records, and errors from anyone."""

    def filter(self, record: logging.LogRecord) -> bool:
        return VERBOSE or record.name.split(".")[0] == "exporters" or record.levelno >= logging.ERROR


@contextlib.contextmanager
def native_stderr_to(path: str | Path | None) -> Iterator[None]:
    """Send what native code writes to file descriptor 2 into ``path`` (appended; None = discarded).

    Python's own stderr is the same descriptor, so a traceback printed after this block still reaches
    the terminal: the descriptor is restored on the way out, exception or not.
    """
    if VERBOSE:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(os.devnull if path is None else str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(target, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def log_file() -> Path | None:
    """The file the root logger writes to (Hydra's ``<run folder>/llm.log``), if any."""
    return next((Path(h.baseFilename) for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)),
                None)
