"""Running written programs: load them (``programs``), drive them (``driver``), generate text (``generator``),
and measure them (``speed``, ``memory``, ``quality``)."""

from typing import Any


def __getattr__(name: str) -> Any:
    """``from exporters.runtime import LoadedProgram`` (0.1, when this was one module) keeps working."""
    if name in ("LoadedProgram", "CapturedPrograms", "register_runtime_kernels"):
        from exporters.runtime import programs  # ExecuTorch's runtime bindings: loaded on first use

        return getattr(programs, name)
    raise AttributeError(f"module 'exporters.runtime' has no attribute {name!r}")
