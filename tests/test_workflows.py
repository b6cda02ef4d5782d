"""The GitHub workflows pass actionlint and zizmor (CI installs both: .ci/lint-requirements.txt)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"{name} is not installed (pip install --require-hashes -r .ci/lint-requirements.txt)")
    return found


def nightly_commands() -> list[str]:
    """The shell of every step of the nightly workflow, one string per step."""
    workflow = yaml.safe_load((WORKFLOWS / "nightly.yml").read_text())
    return [step["run"] for job in workflow["jobs"].values() for step in job["steps"] if "run" in step]


@pytest.mark.parametrize("tier, needles", [
    # the GPU test tier: every gpu-marked test (kernels vs fp64, graph decode, fused writes), slow ones too
    ("tests -m gpu", ("pytest tests", "-m gpu", "--gpu", "--slow")),
    # the multi-GPU tier (layer-sharded, data-parallel, tensor-parallel tests), on a runner with 2+ GPUs
    ("tests -m multigpu", ("pytest tests", "-m multigpu", "--gpu")),
    # the in-process gate: canaries x canary scenarios x default paths through our kernels, against last night
    ("pytest harness --gpu", ("pytest harness", "--gpu", "--baseline")),
    # the stress canaries through `harness nightly`
    ("stress suite", ("harness.cli nightly", "--suite stress", "--device cuda")),
    # the input fuzzers' random exploration (CI's gate draws a fixed set: tests/test_fuzz_inputs.py)
    ("fuzz exploration", ("HARNESS_FUZZ_SCALE=", "pytest tests/test_fuzz_inputs.py")),
])
def test_the_nightly_runs_each_gpu_tier(tier, needles):
    """Each tier is a command of the nightly job, not only a file that exists."""
    assert any(all(needle in command for needle in needles) for command in nightly_commands()), \
        f"no nightly step runs {tier} (looked for {needles})"


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
