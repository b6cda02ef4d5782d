"""Two scans transformers makes at every import, remembered on disk between `harness run` processes.

`import transformers` reads every file of its models folder to list what each module exports
(`utils.import_utils.define_import_structure`: 2,597 files, twice, once for `transformers` and once for
`transformers.models`), and transformers 5.17 (the GPU machines' version) maps import names to distributions at
import (`importlib.metadata.packages_distributions`, which stats every file that torch's and CUDA's wheels list).
In a warm default `harness run --device cuda` on one H200 box these were 1.27 s and 0.85 s of the main thread's wall
(py-spy with idle samples, session 41), before the replay could start; transformers 5.24 makes the second lazily.

Both are functions of files on disk. `remember()` keeps each answer in $FP8_HARNESS_START_CACHE (default
`~/.cache/fp8-harness/transformers-start`, XDG_CACHE_HOME honoured), under a key made of what the answer is read
from: for the import structure, the name, modification time and size of every `.py` file and the name of every
folder under the scanned folder, with the scanning module's own file; for the distributions, every `*.dist-info` /
`*.egg-info` entry on `sys.path` with its files' times and sizes. An install, upgrade or edit changes the key, and
the answer is computed again. A cache that cannot be read or written is skipped (the answer is computed, as without
it). It runs in the `harness run` process and its workers, before transformers' first import (later it cannot reach
the first scan); the pytest plugin runs in a user's process and never calls it. HARNESS_LEAN_IMPORTS=0 turns it
off, with `lean_imports`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.metadata
import json
import os
import pickle
import sys
import tempfile
from pathlib import Path

SCANNER = "transformers.utils.import_utils"  # the module whose define_import_structure is remembered
CACHE_ENV = "FP8_HARNESS_START_CACHE"  # where the answers are kept (benchmarks/run_ab.py's cold runs: an empty folder)


def remember() -> tuple[str, ...]:
    """Put the remembered scans in place; returns what was (nothing where turned off, where no cache folder can be
    made, or for the import structure where transformers is imported already)."""
    if os.environ.get("HARNESS_LEAN_IMPORTS") == "0":
        return ()
    folder = cache_folder()
    if folder is None:
        return ()
    done = []
    if not getattr(importlib.metadata.packages_distributions, "remembered", False):
        importlib.metadata.packages_distributions = remembered_distributions(
            importlib.metadata.packages_distributions, folder)
    done.append("packages_distributions")
    if SCANNER not in sys.modules and not any(isinstance(f, PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, PatchAfterImport(SCANNER, functools.partial(remember_import_structure, folder=folder)))
        done.append("define_import_structure")
    return tuple(done)


def cache_folder() -> Path | None:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = Path(os.environ.get(CACHE_ENV) or root / "fp8-harness" / "transformers-start")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` once, right after the module `name` has executed (and before its importer reads from
    it): the finders after this one find and load it as they would have."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader, patch = spec.loader, self.patch
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def remember_import_structure(module, folder: Path) -> None:
    """`module.define_import_structure` answered from the cache where the scanned files are unchanged."""
    compute = getattr(module, "define_import_structure", None)
    if compute is None:
        return
    scanner = Path(module.__file__)

    @functools.wraps(compute)
    def define_import_structure(module_path, *args, **kwargs):
        key = hashlib.sha256(repr((sys.version_info[:2], str(module_path), args, sorted(kwargs.items()))).encode())
        key.update(_stamp(scanner).encode())
        scanned = Path(module_path)
        key.update(_tree_key(scanned.parent if scanned.is_file() else scanned))
        return _cached(folder / f"import-structure-{key.hexdigest()[:32]}.pickle", pickle,
                       lambda: compute(module_path, *args, **kwargs))

    module.define_import_structure = define_import_structure


def remembered_distributions(compute, folder: Path):
    """`importlib.metadata.packages_distributions` answered from the cache where no distribution on sys.path
    changed."""
    @functools.wraps(compute)
    def packages_distributions():
        key = hashlib.sha256(repr(sys.version_info[:2]).encode())
        for entry in sys.path:
            key.update(f"\0{entry}".encode())
            key.update(_distributions_key(Path(entry or ".")))
        return _cached(folder / f"packages-distributions-{key.hexdigest()[:32]}.json", json, compute)

    packages_distributions.remembered = True
    return packages_distributions


def _cached(file: Path, codec, compute):
    """The answer kept in `file` (pickle or json), or `compute()`'s, then kept there (a whole file or none)."""
    binary = codec is pickle
    try:
        with open(file, "rb" if binary else "r") as kept:
            return codec.load(kept)
    except Exception:  # noqa: BLE001 - absent, cut short or unreadable: computed again
        pass
    answer = compute()
    name = None
    try:
        with tempfile.NamedTemporaryFile("wb" if binary else "w", dir=file.parent, delete=False) as part:
            name = part.name
            codec.dump(answer, part)
        os.replace(name, file)
    except Exception:  # noqa: BLE001 - nowhere to keep it (read-only, full, an answer json cannot hold): as without
        if name is not None:
            with contextlib.suppress(OSError):
                os.unlink(name)
    return answer


def _stamp(path) -> str:
    """A file's name, modification time and size ("-" where it cannot be read)."""
    try:
        stat = os.stat(path)
    except OSError:
        return f"{path}:-"
    return f"{path}:{stat.st_mtime_ns}:{stat.st_size}"


def _tree_key(folder: Path) -> bytes:
    """Every folder's name (but __pycache__) and every .py file's name, time and size under `folder`, in name order:
    what `create_import_structure_from_path` reads."""
    parts: list[str] = []

    def walk(path: str) -> None:
        try:
            with os.scandir(path) as found:
                entries = sorted(found, key=lambda e: e.name)
        except OSError:
            parts.append(f"{path}:-")
            return
        for entry in entries:
            if entry.name == "__pycache__":
                continue
            if entry.is_dir():
                parts.append(f"{entry.path}/")
                walk(entry.path)
            elif entry.name.endswith(".py"):
                parts.append(_stamp(entry.path))

    walk(str(folder))
    return "\n".join(parts).encode()


def _distributions_key(folder: Path) -> bytes:
    """The *.dist-info and *.egg-info entries of one sys.path entry, each with its files' names, times and sizes (a
    file on sys.path, such as a zip: its time and size)."""
    if not folder.is_dir():
        return _stamp(folder).encode()
    parts = []
    try:
        with os.scandir(folder) as found:
            infos = sorted((e for e in found if e.name.endswith((".dist-info", ".egg-info"))), key=lambda e: e.name)
        for info in infos:
            if info.is_dir():
                with os.scandir(info.path) as files:
                    parts += [_stamp(f.path) for f in sorted(files, key=lambda f: f.name) if f.is_file()]
            else:
                parts.append(_stamp(info.path))
    except OSError:
        parts.append(f"{folder}:-")
    return "\n".join(parts).encode()
