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


def saved_processor_parts(folder: Path) -> tuple[dict[str, Any], Any, str | None]:
    """What a processor we assemble ourselves (``models.*_images``) is made of: the image processor's fields (not
    the class names the files record), the tokenizer, and the chat template (``chat_template.jinja``, else
    ``processor_config.json``'s; None without one)."""
    from transformers import AutoTokenizer  # only where a processor is built

    folder = Path(folder)
    settings = {k: v for k, v in processor_settings(folder).items()
                if k not in ("image_processor_type", "processor_class")}
    template = folder / "chat_template.jinja"
    chat_template = template.read_text() if template.is_file() else None
    if chat_template is None and (folder / "processor_config.json").is_file():
        chat_template = json.loads((folder / "processor_config.json").read_text()).get("chat_template")
    return settings, AutoTokenizer.from_pretrained(str(folder), local_files_only=True), chat_template
