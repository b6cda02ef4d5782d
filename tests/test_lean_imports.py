"""`harness run` keeps transformers' torchvision and scikit-learn imports out of its process (harness/lean_imports.py).

Stand-ins for both packages sit on the path, each raising when imported: without `hide_unused`, importing the
transformers modules that read the availability checks imports them (the control: the test can fail); with it,
neither is imported, and HARNESS_LEAN_IMPORTS=0 leaves transformers as it was.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

READERS = "import transformers.image_utils, transformers.video_utils, transformers.generation.candidate_generator"
CHECK = ("import sys; assert 'torchvision' not in sys.modules and 'sklearn' not in sys.modules; "
         "from transformers.utils import is_sklearn_available, is_torchvision_available; "
         "print(is_torchvision_available(), is_sklearn_available())")


@pytest.fixture
def stand_ins(tmp_path: Path) -> Path:
    for name in ("torchvision", "sklearn"):
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


def test_hidden_neither_is_imported(stand_ins):
    done = run(f"from harness.lean_imports import hide_unused; print(hide_unused()); {READERS}; {CHECK}", stand_ins)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [str(("is_torchvision_available", "is_torchvision_v2_available",
                                             "is_sklearn_available")), "False False"]


def test_turned_off_it_changes_nothing(stand_ins):
    done = run("from harness.lean_imports import hide_unused; print(hide_unused()); "
               "from transformers.utils import is_torchvision_available; print(is_torchvision_available())",
               stand_ins, HARNESS_LEAN_IMPORTS="0")
    assert done.returncode == 0 and done.stdout.splitlines() == ["()", "True"], done.stderr[-2000:]
