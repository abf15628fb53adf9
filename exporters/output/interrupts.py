"""Ctrl-C and SIGTERM stop an export between two Python steps, as a ``KeyboardInterrupt`` the pipeline turns into
``Interrupted(stage)``; the few renames that put a finished export in place run with both held back, so a signal
never leaves half of one export and half of another in a folder.

Python runs signal handlers in the main thread whichever thread the kernel delivered the signal to (torch's worker
threads do not block them), so holding signals back means swapping the Python handlers, not the thread's mask.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any, Iterator

#: The signals that stop an export, and the exit code each ends the CLI with (128 + the signal's number).
STOPPING = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python would raise ``KeyboardInterrupt`` for Ctrl-C."""

    signum = signal.SIGTERM


def signal_of(stop: BaseException) -> signal.Signals:
    """The signal behind a ``KeyboardInterrupt``: SIGTERM for ``Terminated``, else SIGINT (Ctrl-C)."""
    return signal.Signals(getattr(stop, "signum", signal.SIGINT))


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a job scheduler, ``kill``, a container stopping) stops the export as Ctrl-C does, with its cleanup,
    instead of ending the process where it stands. The CLI and sweep jobs use it; a library caller keeps its own
    handlers."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def held_back() -> Iterator[None]:
    """Run the block whole: a SIGINT or SIGTERM that arrives meanwhile is raised when it ends."""
    arrived: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in STOPPING}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if arrived:
        raise Terminated() if arrived[0] == signal.SIGTERM else KeyboardInterrupt()
