"""`harness run` keeps transformers' torchvision, scikit-learn and SciPy imports out of its process
(harness/lean_imports.py).

Stand-ins for the three packages sit on the path, each raising when imported: without `hide_unused`, importing the
transformers modules that read the availability checks imports them (the controls: the test can fail); with it,
none is imported, and HARNESS_LEAN_IMPORTS=0 leaves transformers as it was.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

READERS = ("import transformers.image_utils, transformers.video_utils, transformers.generation.candidate_generator, "
           "transformers.loss.loss_utils")
CHECK = ("import sys; assert not {'torchvision', 'sklearn', 'scipy'} & set(sys.modules); "
         "from transformers.utils import is_scipy_available, is_sklearn_available, is_torchvision_available; "
         "print(is_torchvision_available(), is_sklearn_available(), is_scipy_available())")


@pytest.fixture
def stand_ins(tmp_path: Path) -> Path:
    for name in ("torchvision", "sklearn", "scipy"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('stand-in {name} imported')\n")
    return tmp_path


def run(code: str, stand_ins: Path, **env) -> subprocess.CompletedProcess:
    paths = os.pathsep.join([str(stand_ins), str(Path(__file__).resolve().parent.parent)])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": paths, **env})


def test_transformers_imports_the_stand_ins_without_it(stand_ins):
    done = run(READERS, stand_ins)
    assert done.returncode != 0 and "stand-in torchvision imported" in done.stderr, done.stderr[-2000:]
    # the losses' reader alone: SciPy is imported with every model class's losses
    done = run("import transformers.loss.loss_utils", stand_ins)
    assert done.returncode != 0 and "stand-in scipy imported" in done.stderr, done.stderr[-2000:]


def test_hidden_none_is_imported(stand_ins):
    done = run(f"from harness.lean_imports import hide_unused; print(hide_unused()); {READERS}; {CHECK}", stand_ins)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [str(("is_torchvision_available", "is_torchvision_v2_available",
                                             "is_sklearn_available", "is_scipy_available")), "False False False"]


def test_turned_off_it_changes_nothing(stand_ins):
    done = run("from harness.lean_imports import hide_unused; print(hide_unused()); "
               "from transformers.utils import is_torchvision_available; print(is_torchvision_available())",
               stand_ins, HARNESS_LEAN_IMPORTS="0")
    assert done.returncode == 0 and done.stdout.splitlines() == ["()", "True"], done.stderr[-2000:]


def test_a_runs_start_imports_no_pandas_and_the_replay_imports_it_ahead(tmp_path):
    """pandas is for the verdicts' and report's frames, after the replay: the modules a run starts with do not import
    it (`harness.runs.read` imports it where a frame is made), and `job.import_ahead` imports it in a thread of its
    own while the replay runs; a module that cannot be imported there raises nothing (its user says why)."""
    code = ("import sys; import harness.cli, harness.job, harness.run_inputs, harness.runs.gate; "
            "print('pandas' in sys.modules); "
            "thread = harness.job.import_ahead(('no_such_module_here', 'pandas')); "
            "print(thread.name, thread.daemon); thread.join(); print('pandas' in sys.modules)")
    done = run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["False", "import-ahead True", "True"]
