"""fp8-harness: replay scenarios through a BF16 reference and FP8 KV paths; measure, store and report.

The flow, one folder a stage: scenarios -> kv_paths -> replay -> analysis -> judges -> runs (docs/ARCHITECTURE.md).
"""

import os
import sys
from pathlib import Path

__version__ = "0.1.0"  # keep equal to pyproject.toml's version (tests/test_cli.py checks)


def _cache_bytecode() -> None:
    """Where bytecode writing is off (PYTHONDONTWRITEBYTECODE=1, common in containers) every process compiles the
    sources of torch, transformers and ours again: 4.0 of 8.8 s to import torch and transformers on an H200 box
    (session 17). Keep the compiled files in a cache of our own (sys.pycache_prefix; site-packages untouched).
    Off with HARNESS_BYTECODE_CACHE=0; a PYTHONPYCACHEPREFIX of the user's own is left as it is."""
    if not sys.dont_write_bytecode or sys.pycache_prefix or os.environ.get("HARNESS_BYTECODE_CACHE", "1") == "0":
        return
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp8-harness" / "pycache"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # nowhere to write: compile as before
    sys.pycache_prefix, sys.dont_write_bytecode = str(cache), False


_cache_bytecode()
