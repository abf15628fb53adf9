"""The versions this project was checked against, read from here by every module that names one.

The private internals lowering patches (``exporters.program.internals``) were read in these releases; with another
installed, lowering takes ExecuTorch's stock path (slower, the same program) and says so once. The stock runners
whose method choices ``exporters.program.layouts`` writes down are ExecuTorch's releases listed in
:data:`STOCK_RUNNER_RELEASES`.
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata

log = logging.getLogger("exporters")

#: Installed packages whose internals exporters.program.internals reaches into, at the versions it was checked with.
CHECKED: dict[str, str] = {"executorch": "1.5.1", "torchao": "0.18.0"}
#: The ExecuTorch release this project runs (pyproject.toml pins it); messages about the runtime name it.
EXECUTORCH = CHECKED["executorch"]
#: ExecuTorch releases whose stock LLM runner the project's layouts are written for (oldest first).
STOCK_RUNNER_RELEASES: tuple[str, ...] = ("1.4.1", EXECUTORCH)


#: The packages every manifest records the versions of.
PACKAGES = ("torch", "executorch", "torchao", "transformers", "hydra-core", "tokenizers", "safetensors")


def package_versions() -> dict[str, str]:
    return {name: installed(name) or "not installed" for name in PACKAGES}


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def unchecked() -> dict[str, tuple[str | None, str]]:
    """Packages installed at another version than the checked one: name -> (installed, checked)."""
    found = {name: (installed(name), version) for name, version in CHECKED.items()}
    return {name: pair for name, pair in found.items() if pair[0] != pair[1]}


@functools.cache
def _warn_unchecked() -> None:
    differ = ", ".join(f"{name} {have} (checked: {want})" for name, (have, want) in unchecked().items())
    log.warning("lowering takes ExecuTorch's stock path: %s installed, and its private internals were checked "
                "with other versions (exporters/program/internals.py). The program is the same; lowering is slower.", differ)


def shortcuts_allowed(requested: bool) -> bool:
    """Whether lowering may take its shortcuts through private internals: asked for, and the checked versions
    installed (else a warning, once per process)."""
    if not requested:
        return False
    if unchecked():
        _warn_unchecked()
        return False
    return True
