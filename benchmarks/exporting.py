"""How the benchmarks run our exporter: compose its config as the CLI does, export in this process, or build
the command line of an export in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

from benchmarks.presets import Preset, preset_overrides

REPO = Path(__file__).resolve().parent.parent


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """The config ``python -m exporters.llm <overrides>`` would run with (the real conf/ tree)."""
    from exporters.config import compose

    return compose(*overrides)


def preset_config(preset: Preset, work_dir: Path, overrides: Sequence[str] = ()) -> DictConfig:
    """The config that exports ``preset`` (its checkpoint folder written under ``work_dir``), plus ``overrides``."""
    return compose_config([*preset_overrides(preset, work_dir), *overrides])


def export_preset(preset: Preset, out: Path, overrides: Sequence[str] = ()):  # type: ignore[no-untyped-def]
    """Export ``preset`` into ``out`` in this process; the ``ExportResult``."""
    from exporters.export import export

    return export(preset_config(preset, out, overrides), out)


def exporter_command(overrides: Sequence[str], run_dir: Path) -> list[str]:
    """``python -m exporters.llm <overrides>`` writing into ``run_dir``, with this interpreter."""
    return [sys.executable, "-m", "exporters.llm", *overrides, f"hydra.run.dir={run_dir}"]


def run_measured(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Run ``cmd`` (an export) in a child process from the repository, its output into ``log``, ``env`` added to its
    environment: its wall time (s) and peak RSS (MB, os.wait4). A failure stops the benchmark with the log's end."""
    wall, peak_mb, failure = run_measured_or_failed(cmd, log, env)
    if failure is not None:
        raise SystemExit(f"command failed ({log}): {failure}\n  {' '.join(cmd)}\n" + log.read_text()[-3000:])
    return wall, peak_mb


def run_measured_or_failed(cmd: list[str], log: Path, env: dict[str, str] | None = None,
                           ) -> tuple[float, float, str | None]:
    """:func:`run_measured`, but a failed export is a result too: its wall time, peak RSS and how it failed (a signal,
    such as the kernel's out-of-memory kill, or the exit code and the log's last error line); None if it did not."""
    from exporters.runtime.memory import wait_with_peak_rss

    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                                env=None if env is None else {**os.environ, **env})
        peak_mb = wait_with_peak_rss(proc)
    wall = time.perf_counter() - start
    return wall, peak_mb, None if proc.returncode == 0 else failure_of(proc.returncode, log)


def failure_of(returncode: int, log: Path) -> str:
    """How a child process failed, in one line: killed by a signal (SIGKILL with nothing in the log is how the kernel's
    OOM killer ends a process), or its exit code and the last line of its log that names an error."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (the kernel's out-of-memory killer)" if name == "SIGKILL" else "")
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return f"exit code {returncode}: {(errors or lines or ['no output'])[-1][:300]}"
