"""The GitHub workflows pass actionlint and zizmor (CI installs both: .ci/lint-requirements.txt)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"{name} is not installed (pip install --require-hashes -r .ci/lint-requirements.txt)")
    return found


def test_there_is_a_nightly_workflow():
    assert (WORKFLOWS / "nightly.yml").is_file()


def test_workflows_pass_actionlint():
    result = subprocess.run([tool("actionlint"), "-no-color"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_workflows_pass_zizmor():
    result = subprocess.run([tool("zizmor"), "--offline", "--no-progress", str(WORKFLOWS)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    """The lint test can fail: an undefined expression and a bad runner label are reported."""
    broken = tmp_path / ".github" / "workflows"
    broken.mkdir(parents=True)
    (broken / "bad.yml").write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                                    "      - run: echo ${{ nope.value }}\n")
    result = subprocess.run([tool("actionlint"), "-no-color", str(broken / "bad.yml")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "nope" in result.stdout
