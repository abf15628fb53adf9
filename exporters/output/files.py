"""Writing files so that a reader never sees half of one, and hashing them without reading them whole."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import BinaryIO, Callable, Iterator


def private_path(final: Path, kind: str) -> Path:
    """A hidden name beside ``final`` that only this process writes (``.<name>.<pid>.<kind>``): where a file is
    written before it is renamed into place."""
    return final.with_name(f".{final.name}.{os.getpid()}.{kind}")


def private_files(folder: Path) -> Iterator[Path]:
    """This process's :func:`private_path` files in ``folder`` (another process's may still be writing)."""
    return (p for p in folder.glob(f".*.{os.getpid()}.*") if p.is_file())


def write_atomically(path: Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` (bytes, or a function that writes to an open file) to a temporary name in the same
    folder, fsync, then rename: never a half-written file."""
    tmp = private_path(path, "tmp")
    try:
        with open(tmp, "wb") as fh:
            if isinstance(data, bytes):
                fh.write(data)
            else:
                data(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_of(path: Path) -> str:
    """The file's sha256, computed once per version of the file (a data file is checked at every load)."""
    stat = Path(path).stat()
    return _sha256_of(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
