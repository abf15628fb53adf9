"""The folder an export writes into: found writable before any work, held by one export at a time, and an earlier
export in it replaced whole when the new one is put in place, never a mix of two exports' files."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from exporters.errors import UserError
from exporters.manifest import MANIFEST_FILE, Manifest

#: Held (``flock``) by the export writing into the folder; it holds that process's id. The kernel releases the lock
#: when the process ends, however it ends, so a killed export never leaves a folder locked.
LOCK_FILE = ".export.lock"
#: OS errors that mean the disk (or the process's file-size limit) has no room for what is being written.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def check_writable(folder: Path, what: str, fix: str) -> None:
    """Create ``folder`` if it is missing and write a file in it, so a folder that cannot be written is found before
    any long stage: a ``UserError`` naming the folder, why, and ``fix``. (Trying is the only test that holds for
    every case: root ignores permission bits, and a read-only file system refuses even root.)"""
    folder = Path(folder).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"{what} {folder} cannot be created: {existing} is a file, not a folder. {fix}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder, prefix=".write-check."):
            pass
    except OSError as e:
        verb = "written" if folder.is_dir() else "created"
        raise UserError(f"{what} {folder} cannot be {verb} ({e.strerror or e}). {fix}") from None


@contextlib.contextmanager
def held(folder: Path) -> Iterator[None]:
    """The folder for one export: a second export into it, while this one runs, is refused naming this process."""
    path = folder / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(
                f"another export (process {holder}) is writing into {folder}: two exports in one folder would mix "
                "their files. Wait for it to finish, or export into another folder (hydra.run.dir=<dir> or "
                "export.output_dir=<dir>).") from None
        # The holder before us unlinks the file as it finishes: ours must still be the file at that path.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before unlocking: a waiting export then opens a new file, not this one
        os.close(fd)


def no_room(error: OSError, files: str, folder: Path, needed: int | None) -> UserError:
    """The paragraph for ``files`` that could not be written whole into ``folder``: the bytes they need, what limited
    them (the disk's free bytes, or the process's file-size limit), the fix."""
    need = f"need {needed / 1e6:,.1f} MB ({needed:,} bytes)" if needed else "need more room"
    stopped = f"{files} could not be written completely into {folder}"
    if error.errno == errno.EFBIG:
        return UserError(f"{stopped}: they {need}, more than this process's file-size limit allows (ulimit -f; "
                         f"{error.strerror}). Nothing was kept. Raise the limit (ulimit -f unlimited) and export again.")
    free = shutil.disk_usage(folder).free
    return UserError(f"{stopped}: they {need} and the disk has {free / 1e6:,.1f} MB free ({error.strerror}). Nothing "
                     "was kept. Free some space, or export into a folder on another disk (hydra.run.dir=<dir> or "
                     "export.output_dir=<dir>).")


def is_no_room(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in NO_ROOM


def files_of_export(folder: Path) -> set[str]:
    """The files the export whose manifest is in ``folder`` wrote there: what a new export in the folder replaces
    (none when there is no manifest, or one too damaged to read)."""

    if not (folder / MANIFEST_FILE).is_file():
        return set()
    try:
        return Manifest.read(folder).files
    except (UserError, ValueError):  # damaged, or of a shape no version of this tool wrote
        return set()


#: What Hydra puts in a run folder before the export starts: the log and the composed config.
HYDRA_FILES = frozenset({"llm.log", ".hydra"})


def remove_if_nothing_written(folder: Path) -> bool:
    """Remove a run folder that holds only what Hydra put there (an export refused before it wrote anything: the
    error was on the console), and its parent if that is left empty. Whether it was removed."""
    folder = Path(folder)
    if not folder.is_dir() or not {p.name for p in folder.iterdir()} <= HYDRA_FILES:
        return False
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()  # only if empty: outputs/<model>-<quant>-<backend>/ of a first, refused export
    return True
