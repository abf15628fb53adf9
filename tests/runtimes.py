"""Python interpreters with a given ExecuTorch release, to run that release's stock runner on our programs.

The installed release is this interpreter; any other is a virtual environment built once from the package
registry and cached (``$LLM_EXPORTERS_CACHE/runtimes``, default ``~/.cache/llm-exporters/runtimes``).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from exporters.program.layouts import STOCK_RUNNERS

REPO_ROOT = Path(__file__).resolve().parent.parent
STOCK_RUNNER_SCRIPT = REPO_ROOT / "tests" / "stock_runner.py"

# What each release installs beside (checked together here): torch first, from its CPU wheel.
REQUIREMENTS = {
    # 1.4.1's llm runner package imports transformers.
    "1.4.1": (["torch==2.13.0"], ["executorch==1.4.1", "torchao==0.18.0", "transformers==5.23.0"]),
    "1.5.1": (["torch==2.13.0"], ["executorch==1.5.1", "torchao==0.18.0"]),
}


# The releases a stock-runner test runs under: the newest each time; the older ones' runners (built once, unchanged
# since) with `pytest -m extended`, kept out of the full run for its time (building an older release's environment
# alone takes a minute and a half). The manifest's prediction for every release is checked in the full run either way
# (tests/test_run_and_ship.py, tests/test_export.py).
STOCK_RELEASES = [pytest.param(r.release, marks=[] if r is STOCK_RUNNERS[-1] else [pytest.mark.extended])
                  for r in STOCK_RUNNERS]


def cache_dir() -> Path:
    return Path(os.environ.get("LLM_EXPORTERS_CACHE", Path.home() / ".cache" / "llm-exporters")) / "runtimes"


def runtime_python(release: str) -> Path:
    """An interpreter whose ``executorch`` is ``release`` (built and cached on first use)."""
    if metadata.version("executorch") == release:
        return Path(sys.executable)
    if release not in REQUIREMENTS:
        raise ValueError(f"no recipe for ExecuTorch {release}; known: {', '.join(REQUIREMENTS)}")
    venv = cache_dir() / f"executorch-{release}"
    python, done = venv / "bin" / "python", venv / ".complete"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".executorch-{release}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test workers build it once
        recipe = json.dumps(REQUIREMENTS[release])  # a changed recipe builds the environment again
        if not done.exists() or done.read_text() != recipe:
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            for group in REQUIREMENTS[release]:
                subprocess.run([str(python), "-m", "pip", "install", "-q", *group], check=True)
            done.write_text(recipe)
    return python


def stock_runner(release: str, pte: Path, prompt: str, max_new_tokens: int, data: Path | None = None,
                 turns: int = 1) -> dict:
    """Run ``release``'s stock TextLLMRunner greedily on ``pte`` (with its data file): its text, statistics, log.
    ``turns``: generate that many times in one runner, the conversation going on (the text of each in "turns")."""
    proc = subprocess.run([str(runtime_python(release)), str(STOCK_RUNNER_SCRIPT), str(pte),
                           str(pte.parent / "tokenizer.json"), prompt, str(max_new_tokens),
                           *(["--data", str(data)] if data else []), "--turns", str(turns), "--verbose"],
                          capture_output=True, text=True, timeout=600, cwd=pte.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["executorch"] == release
    return {**result, "log": proc.stderr}
