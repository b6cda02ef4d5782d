"""Where bytecode writing is off (PYTHONDONTWRITEBYTECODE=1), importing harness keeps compiled files in a cache
of its own (harness/__init__.py `_cache_bytecode`), so the next process does not compile torch's sources again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _import_harness(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1",
                   **env}
    environment.pop("PYTHONPYCACHEPREFIX", None)
    return subprocess.run([sys.executable, "-c", "import harness, sys, json.tool; print(sys.pycache_prefix)"],
                          env=environment, capture_output=True, text=True, timeout=60, check=True)


def test_compiled_files_go_to_the_harness_cache(tmp_path):
    printed = _import_harness(tmp_path).stdout.strip()
    cache = tmp_path / "fp8-harness" / "pycache"
    assert printed == str(cache)
    assert list(cache.rglob("tool*.pyc")), "json.tool, imported after harness, was not cached"


@pytest.mark.parametrize("env", [{"HARNESS_BYTECODE_CACHE": "0"}, {"PYTHONDONTWRITEBYTECODE": ""}])
def test_no_cache_when_turned_off_or_bytecode_is_written_anyway(tmp_path, env):
    assert _import_harness(tmp_path, **env).stdout.strip() == "None"
    assert not (tmp_path / "fp8-harness").exists()
