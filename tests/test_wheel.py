"""The built wheel is a complete tool: it carries conf/ and runs from a folder outside the checkout.

The wheel's files are installed alone into a folder put first on PYTHONPATH (the dependencies come from
this environment), so nothing can be picked up from the checkout by accident.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.slow  # every test here exports, sweeps or builds


def test_wheel_carries_its_configs_and_exports_from_elsewhere(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO_ROOT),
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("llm_exporters-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for group in ("model", "quant", "backend", "hydra/launcher"):
        shipped = {Path(n).name for n in names if n.startswith(f"exporters/conf/{group}/")}
        assert shipped == {p.name for p in (REPO_ROOT / "conf" / group).glob("*.yaml")}, group
    assert "exporters/conf/config.yaml" in names and "exporters/conf/search.yaml" in names and "exporters/data/validation_text.txt" in names

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True, text=True, timeout=900)

    where = run("-c", "import exporters; print(exporters.__file__)")
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    help_ = run("-m", "exporters.llm", "--help")
    assert help_.returncode == 0 and "quant: 4w, 8da4w" in help_.stdout, help_.stdout + help_.stderr
    proc = run("-m", "exporters.llm", "validation.max_tokens=24", "export.methods=[decode]", "export.layout=split",
               "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((work / "run" / "manifest.json").read_text())["status"] == "ok"
