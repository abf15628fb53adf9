"""Runtime speed and memory of a written program, measured the way an app runs it.

Used by the ``bench`` stage (every sweep job) and by ``scripts/bench_export.py``, so a number in a sweep
summary and one in the README come from the same code. Speeds are medians over repeats after one
warm-up round; each round prefills a fresh prompt at position 0 (the cache is overwritten in place) and
then decodes greedy tokens one at a time through the program's one-token method.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from exporters.driver import Driver
from exporters.manifest import Speed

# Run in a fresh interpreter: RSS a process gains by loading the program and some of its methods
# (imports not counted). A fresh process, because one that has already run the program reuses freed memory.
_RSS_AFTER_LOAD = """
import sys
from exporters.benchmark import current_rss_mb
from exporters.runtime import LoadedProgram, register_runtime_kernels
register_runtime_kernels()
before = current_rss_mb()
program = LoadedProgram(sys.argv[1])
program.load(*sys.argv[2:])
print(current_rss_mb() - before)
"""


def _status_mb(key: str) -> float:
    """A memory field of ``/proc/self/status`` (Linux) in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def current_rss_mb() -> float:
    return _status_mb("VmRSS")


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
        return _status_mb("VmHWM")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def wait_with_peak_rss(child: subprocess.Popen) -> float:
    """Wait for ``child`` (its exit code goes to ``child.returncode``); its peak RSS in MB, even if it was killed."""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024  # Linux: KiB


def rss_after_load_mb(pte: Path, methods: list[str]) -> float:
    """RSS a fresh process gains by loading the program and ``methods`` (the pip runtime's XNNPACK packs
    each loaded method's weights separately, so this grows with the methods an app loads)."""
    out = subprocess.run([sys.executable, "-c", _RSS_AFTER_LOAD, str(pte), *methods], capture_output=True,
                         text=True, check=True)
    return round(float(out.stdout.strip().splitlines()[-1]), 1)


def measure_speed(driver: Driver, prompt_tokens: int, steps: int, repeats: int, vocab_size: int) -> Speed:
    """Median prefill and decode throughput; the first of ``repeats + 1`` rounds warms up."""
    return measure_speeds({"program": driver}, prompt_tokens, steps, repeats, vocab_size)["program"]


def measure_speeds(drivers: dict[str, Driver], prompt_tokens: int, steps: int, repeats: int,
                   vocab_size: int) -> dict[str, Speed]:
    """:func:`measure_speed` of several programs at once, round by round, in alternating order.

    Programs compared one after the other are measured minutes apart, and on a shared machine the
    speed of the same program drifts by 10-20% over minutes; interleaving the rounds gives every
    program the same conditions, and alternating the order gives none the advantage of going first.
    """
    for driver in drivers.values():
        driver.load()
    rates: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label in drivers}
    for r in range(repeats + 1):  # round 0 warms up
        prompt = torch.randint(0, vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(r))
        for label in (list(drivers) if r % 2 == 0 else list(reversed(drivers))):
            prefill_s, decode_s = time_round(drivers[label], prompt, steps)
            if r:
                rates[label][0].append(prompt_tokens / prefill_s)
                rates[label][1].append(steps / decode_s)
    return {label: Speed(prompt_tokens, steps, repeats, round(statistics.median(rates[label][0]), 1),
                         round(statistics.median(rates[label][1]), 1), driver.roles.prompt, driver.roles.step)
            for label, driver in drivers.items()}


def time_round(driver: Driver, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    """Seconds to prefill ``prompt`` at position 0, and to decode ``steps`` greedy tokens after it."""
    start = time.perf_counter()
    logits = driver.prefill(prompt)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(steps):
        logits = driver.decode_one_token(int(logits.argmax()), prompt.shape[1] + i)
    return prefill_s, time.perf_counter() - start
