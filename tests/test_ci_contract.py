"""CI (`.ci/run`) runs the test command README.md gives, with the test extra that provides its plugins."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_command() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"python -m pip install -q -e '\.\[test\]' && (python -m pytest[^\n]*)", readme).group(1)


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-2:] == ["python -m pip install -q -e '.[test]'", _readme_command()]


def test_the_test_extra_installs_the_workers_the_command_asks_for():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert " -n 2 " in f"{_readme_command()} " and any(req.startswith("pytest-xdist") for req in extra)
