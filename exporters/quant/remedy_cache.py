"""advise's measurements kept on disk: a remedy measured once for a model, its validation text and a quant config is
read back by the next export of the same (a sweep's jobs, a re-export, a release pipeline run again) instead of being
measured again, which takes a fresh copy of the model quantized and scored (a minute and more on SmolLM2)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporters.config import QuantConfig
from exporters.output.files import write_atomically


@dataclass(frozen=True)
class Measurement:
    """One remedy on one model: what advise derives the warning's numbers from."""

    perplexity: float  # the eager model with the remedy, on the validation windows
    stored_bytes: int  # its weights as the program would store them
    seconds: float  # what measuring it took


@functools.cache
def code_digest() -> str:
    """The sources that make a measurement (quantization, the models, scoring): a change in any measures again."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted([*(root / "exporters" / "quant").glob("*.py"), *(root / "models").glob("*.py"),
                        root / "exporters" / "runtime" / "quality.py"]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def identity(model: dict[str, Any], weights: dict[Path, tuple[int, int]], windows: list[Any], prompt_tokens: int,
             versions: dict[str, str]) -> str:
    """What a measurement depends on besides the quant config: the resolved model settings, each weight file's
    path, size and modification time, the validation windows' tokens, the packages' versions and our own code."""
    text = hashlib.sha256()
    for window in windows:
        text.update(window.numpy().tobytes())
    return hashlib.sha256(json.dumps({
        "model": model, "weights": sorted([str(p), *stat] for p, stat in weights.items()),
        "text": text.hexdigest(), "prompt_tokens": prompt_tokens, "versions": versions,
        "code": code_digest(),
    }, sort_keys=True, default=str).encode()).hexdigest()


class RemedyCache:
    """Measurements by (identity, quant config), one small JSON file each in ``folder``."""

    def __init__(self, folder: Path, identity: str) -> None:
        self.folder, self.identity = folder, identity

    def _path(self, cfg: QuantConfig) -> Path:
        config = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
        return self.folder / (hashlib.sha256((self.identity + config).encode()).hexdigest()[:32] + ".json")

    def get(self, cfg: QuantConfig) -> Measurement | None:
        try:
            return Measurement(**json.loads(self._path(cfg).read_text()))
        except (OSError, ValueError, TypeError):  # absent, or written by another version: measured again
            return None

    def put(self, cfg: QuantConfig, measured: Measurement) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomically(self._path(cfg), json.dumps(dataclasses.asdict(measured)).encode())
        except OSError:  # a read-only cache folder: measured again next time
            pass
