"""Memory of this process and of others: peak RSS of an export, RSS of a fresh process that loads a program.

Linux's ``/proc`` gives a resettable peak (``clear_refs`` + ``VmHWM``), so an export in a long-lived process
(the tests, a notebook) reports its own peak, not the process's whole life.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

# Run in a fresh interpreter: RSS and PSS a process gains by loading the program and some of its methods
# (imports not counted). A fresh process, because one that has already run the program reuses freed memory.
_MEMORY_AFTER_LOAD = """
import sys
from exporters.program.weights import data_files_beside
from exporters.runtime.memory import current_pss_mb, current_rss_mb
from exporters.runtime.programs import LoadedProgram, register_runtime_kernels, use_xnnpack_weight_cache
register_runtime_kernels()
weight_cache, pte, adapters, methods = sys.argv[1] == "1", sys.argv[2], sys.argv[3], sys.argv[4:]
use_xnnpack_weight_cache(weight_cache)
data = data_files_beside(pte, adapters.split(",") if adapters else [])
rss, pss = current_rss_mb(), current_pss_mb()
program = LoadedProgram(pte, data, weight_cache=weight_cache)
program.load(*methods)
print(current_rss_mb() - rss, current_pss_mb() - pss)
"""


def _proc_mb(key: str, file: str = "status") -> float:
    """A memory field (kB) of ``/proc/self/<file>`` (Linux) in MB."""
    with open(f"/proc/self/{file}") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def current_rss_mb() -> float:
    return _proc_mb("VmRSS")


def resident_file_mb() -> float:
    """The part of the RSS that maps files (a memory-mapped checkpoint's pages: models.mapped_pages gives them back)."""
    return _proc_mb("RssFile")


def current_pss_mb() -> float:
    """Proportional set size: a file page mapped twice (a data file's tensor loaded by two methods, each through
    its own mapping) counts once, where RSS counts it per mapping."""
    return _proc_mb("Pss", "smaps_rollup")


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window for this process (Linux ``clear_refs``); False where that is impossible,
    and then :func:`peak_rss_mb` is the peak of the process's whole life."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak RSS since :func:`reset_peak_rss` (VmHWM), or of the whole process where /proc is missing."""
    try:
        return _proc_mb("VmHWM")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def wait_with_peak_rss(child: subprocess.Popen, timeout: float | None = None) -> float | None:
    """Wait for ``child`` (its exit code goes to ``child.returncode``); its peak RSS in MB, even if it was killed.
    With ``timeout``: None if it is still running after that many seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(child.pid, 0 if deadline is None else os.WNOHANG)
        if pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_maxrss / 1024  # Linux: KiB
        if time.monotonic() >= deadline:  # type: ignore[operator]
            return None
        time.sleep(0.05)


def memory_after_load_mb(pte: Path, methods: list[str], weight_cache: bool = True,
                         adapters: Sequence[str] = ()) -> tuple[float, float]:
    """RSS and PSS a fresh process gains by loading the program (with its data file, and those of ``adapters``
    when each has its own) and ``methods``.

    Without XNNPACK's weight cache (the pip runtime's default) each loaded method packs its own copy of the
    weights, so both grow with the methods an app loads; with it, they share one. The runtime maps a data
    file's tensors once per method that uses them: RSS counts those pages per mapping, PSS once."""
    out = subprocess.run([sys.executable, "-c", _MEMORY_AFTER_LOAD, "1" if weight_cache else "0", str(pte),
                          ",".join(adapters), *methods], capture_output=True, text=True, check=True)
    rss, pss = out.stdout.strip().splitlines()[-1].split()
    return round(float(rss), 1), round(float(pss), 1)


def rss_after_load_mb(pte: Path, methods: list[str], weight_cache: bool = True) -> float:
    """RSS a fresh process gains by loading the program and ``methods`` (:func:`memory_after_load_mb`)."""
    return memory_after_load_mb(pte, methods, weight_cache)[0]


def return_freed_memory() -> None:
    """Hand memory the last stage freed back to the operating system.

    Each stage drops what the next one does not need (fp32 weights after quantize, graphs after lower), but
    glibc keeps freed heap pages mapped, so they still count in the process's RSS and stack up under the
    next stage's peak. ``malloc_trim`` releases them (docs/DESIGN.md 2c). A no-op where the C library is not
    glibc.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_FROZEN = [0]  # depth of nested collecting_new_objects_only blocks


@contextlib.contextmanager
def collecting_new_objects_only() -> Iterator[None]:
    """Within the block, garbage collections walk only the objects made inside it.

    A full collection walks every object the process tracks: after torch, ExecuTorch and transformers are
    imported that is over half a million, 0.4 s a walk, and :func:`return_freed_memory` walks after each stage
    (3.6 s of a 15 s tiny export; more in a test worker that has made other exports). What existed before the
    block is collected once and set aside (``gc.freeze``) until the block ends, so the walks see only the
    export's own objects: the same garbage is freed, in a fraction of the time. Blocks nest (the outermost
    freezes and unfreezes).
    """
    if _FROZEN[0] == 0:
        gc.collect()
        gc.freeze()
    _FROZEN[0] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1
        if _FROZEN[0] == 0:
            gc.unfreeze()
