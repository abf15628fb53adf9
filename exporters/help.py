"""``python -m exporters.llm --help``: every option of every group, and every field with its value and what it does.

The descriptions are the schema's own comments (``exporters/config.py``): the comment block above a field, or its
class's docstring for fields that share one meaning (``model.arch.*``). One text, read where the schema is written.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any, get_type_hints

from omegaconf import DictConfig, OmegaConf

from exporters import config as schema
from exporters.config import CONF_DIR, ExportConfig

GROUPS = ("model", "quant", "backend")


def _comments(source: str) -> dict[str, dict[str, str]]:
    """class name -> field name -> its description: the comment lines right above it (a field right below another
    with no comment of its own shares that one's), else its inline comment, else its class's docstring."""
    lines = source.splitlines()
    found: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        doc = (ast.get_docstring(node) or "").split("\n\n")[0].replace("\n", " ")
        fields: dict[str, str] = {}
        previous = ""
        for stmt in node.body:
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            above, i = [], stmt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            line = lines[stmt.lineno - 1]
            inline = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            # Right below the previous field, with no comment of its own: the previous one's comment covers both.
            adjacent = not above and bool(previous) and lines[stmt.lineno - 2].strip() != ""
            text = " ".join(above) or inline or (previous if adjacent else "") or doc
            fields[stmt.target.id] = text
            previous = text
        found[node.name] = fields
    return found


def field_descriptions() -> dict[str, str]:
    """Every field of the schema by dotted path (``export.max_seq_len``) -> what it does."""
    comments = _comments(Path(schema.__file__).read_text())
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[prefix + f.name] = comments.get(cls.__name__, {}).get(f.name, "")
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")

    walk(ExportConfig, "")
    return out


def _leaves(cfg: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(cfg, dict):
        found = []
        for key, value in cfg.items():
            if isinstance(value, dict) and value and key != "options":
                found += _leaves(value, f"{prefix}{key}.")
            else:
                found.append((f"{prefix}{key}", value))
        return found
    return [(prefix.rstrip("."), cfg)]


def _as_typed(value: Any) -> str:
    """A value as it is written on the command line (null, true, [a, b])."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value)


def help_text(cfg: DictConfig) -> str:
    """The groups and their options, then each field of ``cfg`` (composed with the user's overrides) with its value
    and description."""
    described = field_descriptions()
    lines = ["python -m exporters.llm [group=option ...] [field=value ...]   (-m: a sweep over comma-separated values)",
             "", "Config groups (conf/<group>/):"]
    for group in GROUPS:
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        lines.append(f"  {group}: {', '.join(options)}")
    lines += ["", "Fields, with the value this command line composes to:"]
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    for path, value in _leaves(container):
        lines.append(f"  {path} = {_as_typed(value)}")
        text = described.get(path) or described.get(path.rsplit(".", 1)[0], "")
        if text:
            lines += textwrap.wrap(text, width=110, initial_indent="      ", subsequent_indent="      ")
    lines += ["", "Show the composed config alone: --cfg job.  Hydra's own options: --hydra-help.",
              "Details: docs/options.md."]
    return "\n".join(lines) + "\n"
