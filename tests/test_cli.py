"""The command line as a user runs it: a subprocess of ``python -m exporters.llm``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "exporters.llm", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_export_writes_program_manifest_and_log_into_the_run_folder(tmp_path: Path) -> None:
    proc = run_cli("backend=portable", "validation.max_tokens=24", f"hydra.run.dir={tmp_path}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for stage in ("load", "baseline", "quantize", "capture", "lower", "emit", "validate", "finalize"):
        assert f"{stage} done" in out
    assert "exported" in out and "validation: passed" in out and "methods: prefill, decode" in out
    assert "quality: perplexity " in out and "fp32 " in out
    assert (tmp_path / "model.pte").stat().st_size > 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["status"] == "ok" and manifest["validation"]["scored_tokens"] == 24
    log = (tmp_path / "llm.log").read_text()
    assert "validate done" in log
    # The console tells the story; library warnings and logging are in llm.log only.
    for noise in ("FutureWarning", "Loading custom ops library", "[exporters][INFO]"):
        assert noise not in out, noise
    assert "FutureWarning" in log and "Loading custom ops library" in log
    assert len(out.splitlines()) < 40, out
    assert (tmp_path / ".hydra" / "config.yaml").exists()


def test_user_mistake_is_one_message_without_traceback(tmp_path: Path) -> None:
    proc = run_cli("model=llama", f"hydra.run.dir={tmp_path}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert "model=llama needs a checkpoint" in out and "model.checkpoint=" in out
    assert "Traceback" not in out
    assert not tmp_path.exists()  # nothing was written: no run folder holding only Hydra's log is left behind


def test_config_typo_names_the_field_without_traceback() -> None:
    proc = run_cli("quant.grup_size=64")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "grup_size" in out and "Traceback" not in out


def test_help_lists_groups_and_options() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    listing = proc.stdout.split("Config groups (conf/<group>/):")[1].split("Fields, with the value")[0]
    groups = {line.split(":")[0].strip(): line.split(":")[1] for line in listing.splitlines() if ":" in line}
    for group in ("backend", "model", "quant"):
        options = sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))
        assert groups[group].strip() == ", ".join(options)


def test_every_example_the_help_gives_composes() -> None:
    """Each ``key=value`` example in the fields' descriptions (what --help prints) is an override Hydra accepts on
    the real conf/ tree, as a user would copy it."""
    from exporters.config import compose
    from exporters.help import field_descriptions

    override = re.compile(r'(\+?[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+=(?:\{[^}]*\}|\[[^\]]*\]|[^\s,;)"`]+))')
    examples = {m.rstrip(".") for text in field_descriptions().values() for m in override.findall(text)}
    assert "+model.adapters={chat: /path/a, summary: /path/b}" in examples and len(examples) >= 5, examples
    for example in sorted(examples):
        compose(example)  # Hydra refuses a key the config lacks (+ missing) or a value of the wrong type


def test_help_says_what_every_field_does() -> None:
    """--help lists every group's options and every field with its composed value and its description (the schema's
    comments): no field of the schema goes without one."""
    from exporters.help import field_descriptions

    missing = [path for path, text in field_descriptions().items() if not text]
    assert not missing, f"fields without a comment in exporters/config.py: {missing}"
    proc = subprocess.run([sys.executable, "-m", "exporters.llm", "--help", "quant=8da4w"], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    assert "quant: 4w, 8da4w" in proc.stdout and "  quant.linear = 8da4w\n" in proc.stdout
    assert "  export.shortcuts = true\n      Shortcuts through private ExecuTorch" in proc.stdout
    assert "  model.checkpoint = null\n" in proc.stdout
