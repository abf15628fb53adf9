"""Numbers the docs show from measurements are the tools' JSON output rendered, not retyped (benchmarks/tables.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.tables import RENDERERS, documents, regenerate


def test_every_generated_table_matches_its_json() -> None:
    stale = [f"{doc.name}: {c}" for doc in documents() for c in regenerate(doc.read_text())[1]]
    assert not stale, f"regenerate with `python -m benchmarks.tables`: {stale}"


def test_a_region_is_rewritten_from_its_json(tmp_path: Path) -> None:
    (tmp_path / "suite.json").write_text('{"wall_s": 600, "workers": 2, "markers": "not extended", '
                                         '"outcomes": {"passed": 3}, "files": {"tests/a.py": {"tests": 2, "seconds": 90},'
                                         ' "tests/b.py": {"tests": 1, "seconds": 30}}}')
    doc = "before\n<!-- generated: suite suite.json -->\nold\n<!-- end generated -->\nafter\n"
    new, changed = regenerate(doc, tmp_path)
    assert changed == ["suite from suite.json"] and new.startswith("before\n<!-- generated: suite suite.json -->\n")
    assert "| `tests/a.py` | 2 | 90 | 75% |" in new and new.endswith("<!-- end generated -->\nafter\n")
    assert regenerate(new, tmp_path)[1] == []  # rendered once, it is current
    assert set(RENDERERS) >= {"suite", "export"}
