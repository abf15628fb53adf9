"""XNNPACK's weight cache, turned on from Python through ExecuTorch's C++ ``set_option`` (exporters.program.internals).

The option must reach the runtime our tools load programs with, read back as set, refuse what the runtime
refuses, and change nothing in what the methods compute. How much memory it saves is measured by the bench
(``bench.rss_after_load_mb`` against ``rss_after_load_without_weight_cache_mb``) and in docs/performance.md.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from exporters.program.internals import backend_options, set_backend_options
from exporters.runtime.driver import Driver
from exporters.runtime.programs import XNNPACK_BACKEND, LoadedProgram, use_xnnpack_weight_cache


def test_the_option_reads_back_and_the_runtime_refuses_what_it_does_not_know() -> None:
    # In a fresh interpreter: the option is process-wide, and the pip runtime's default is off.
    code = ("from exporters.program.internals import backend_options as o; "
            "print(o('XnnpackBackend', 'weight_cache_enabled', 'workspace_sharing_mode'))")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "{'weight_cache_enabled': False, 'workspace_sharing_mode': 2}" in fresh.stdout
    before = backend_options(XNNPACK_BACKEND, "weight_cache_enabled")["weight_cache_enabled"]
    try:
        for value in (True, False):
            use_xnnpack_weight_cache(value)
            assert backend_options(XNNPACK_BACKEND, "weight_cache_enabled") == {"weight_cache_enabled": value}
    finally:
        use_xnnpack_weight_cache(before)
    with pytest.raises(RuntimeError, match="0x20: no such backend"):
        set_backend_options("NoSuchBackend", weight_cache_enabled=True)
    with pytest.raises(RuntimeError, match="0x12"):
        set_backend_options(XNNPACK_BACKEND, weight_cache_enabled=3)


def test_methods_compute_the_same_with_and_without_the_weight_cache(exported) -> None:  # type: ignore[no-untyped-def]
    """Two methods sharing every weight (prefill, decode_one_token), loaded both ways: bit-identical logits."""
    pte = exported("quant=8da4w").pte_path
    outputs = []
    for weight_cache in (False, True):
        program = LoadedProgram(pte, weight_cache=weight_cache)
        driver = Driver.of(program)
        driver.load()
        first = driver.prefill(torch.arange(1, 9).view(1, -1), 0)
        outputs.append(torch.cat([first, driver.decode_one_token(int(first.argmax()), 8)]).clone())
        del driver, program
    assert torch.equal(*outputs)
