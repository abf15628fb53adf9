"""Runtime speed of a written program, measured the way an app runs it.

Used by the ``bench`` stage (every sweep job) and by ``python -m benchmarks.export``, so a number in a sweep
summary and one in the README come from the same code. Speeds are medians over repeats after one
warm-up round; each round prefills a fresh prompt at position 0 (the cache is overwritten in place) and
then decodes greedy tokens one at a time through the program's one-token method.
"""

from __future__ import annotations

import statistics
import time

import torch

from exporters.runtime.driver import Driver
from exporters.manifest import Speed


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
