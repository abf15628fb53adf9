"""Files saved beside a checkpoint (or a run) read without building anything: the architectures ``config.json``
names, the image processor's files and the settings they hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def processor_settings(folder: Path) -> dict[str, Any]:
    """The image processor's fields saved beside a checkpoint: ``processor_config.json``'s (its ``image_processor``)
    over ``preprocessor_config.json``'s (the hub's checkpoints carry either or both, neither always a superset); {}
    for a folder without them (a random-weight shape)."""
    settings: dict[str, Any] = {}
    for name in reversed(PROCESSOR_FILES):
        path = Path(folder) / name
        if path.is_file():
            raw = json.loads(path.read_text())
            settings.update(raw.get("image_processor", raw))
    return settings


def saved_architectures(folder: Path) -> list[str]:
    """The architectures ``folder``'s ``config.json`` names; [] when it has none or cannot be read (open_checkpoint
    reports that, with the fix)."""
    try:
        return list(json.loads((Path(folder) / "config.json").read_text()).get("architectures") or [])
    except (OSError, json.JSONDecodeError):
        return []

