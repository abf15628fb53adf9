"""How the benchmarks run our exporter: compose its config as the CLI does, export in this process, or build
the command line of an export in a child process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

from benchmarks.presets import Preset, preset_overrides


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
