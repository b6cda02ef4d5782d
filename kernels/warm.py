"""This package's Triton kernels compiled ahead of their first launch, in threads, from a ledger of what a run used.

A Triton kernel compiles at its first launch, and the caller waits. A cold default `harness run --device cuda` (no
Triton cache) compiled 35 specializations of ours one after another, 11.2 s of its 43.5 s on one H200 (session 32).
Triton's compile runs mostly outside the GIL (MLIR passes, LLVM, ptxas): on that box 8 threads compiled 8 kernels
4.2x faster than one (BENCHMARKS.md, session 32). So:

- `Recorder` is Triton's `jit_cache_hook` (called before a kernel enters a process's in-memory cache, whether
  Triton's disk cache holds it or not). It keeps, for this package's kernels, the specialization data Triton
  serializes for its own `JITFunction.preload`.
- `Ledger` is a list of those on disk, one JSON line each, for one Triton version and one GPU target (the data names
  the architecture, so entries recorded on another GPU would compile for the wrong one: `target_tag`).
- `Preload` compiles a ledger's entries in a thread pool. Each entry's key in its kernel's in-process cache holds a
  `_Compiling` first, so a launch that comes before the compile ends waits for it (Triton's launch path asks the
  cached object for `.result()` in 3.6 and forwards attributes in 3.9, as for its own AsyncCompileMode's
  FutureKernel) instead of compiling it a second time. An entry that fails to compile leaves the cache as it was,
  so the launch compiles it as it would have. `used()` names the entries some launch asked for: the next ledger.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

PACKAGE = __name__.split(".")[0]   # the kernels whose specializations are recorded: this package's
LEDGER_FORMAT = 1
THREAD_PREFIX = "kernel-preload"


def target_tag() -> str:
    """Triton's version and the current GPU target, e.g. 'triton3.6.0-cuda90', and `env_suffix()`: a ledger serves
    only its own."""
    import triton
    from triton.runtime import driver
    target = driver.active.get_current_target()
    return f"triton{triton.__version__}-{target.backend}{target.arch}{env_suffix()}"


def env_suffix() -> str:
    """'' where no environment variable that changes Triton's compiles is set, else '-env' and a hash of them
    (TRITON_DEFAULT_FP_FUSION=0 and the like: an entry recorded under other settings carries their options)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    settings = get_cache_invalidating_env_vars()
    if not settings:
        return ""
    return "-env" + hashlib.sha256(json.dumps(sorted(settings.items())).encode()).hexdigest()[:8]


@dataclass(frozen=True, slots=True)
class Entry:
    module: str   # the kernel's module, e.g. kernels.store_kv
    name: str     # its qualified name in that module
    key: str      # Triton's in-process cache key of this specialization
    data: str     # Triton's serialized specialization data (JITFunction.preload's argument)


class Ledger:
    """The entries of one file: a header line {"ledger": 1, "target": TAG}, then one entry a line."""

    @staticmethod
    def read(path: Path, tag: str) -> list[Entry]:
        """The entries of `path` when it was written for `tag`; [] when it is missing, for another target, or
        unreadable (a ledger is a hint: a bad one costs only the compiles it would have saved)."""
        try:
            lines = Path(path).read_text().splitlines()
            header = json.loads(lines[0]) if lines else {}
            if header.get("ledger") != LEDGER_FORMAT or header.get("target") != tag:
                return []
            return [Entry(**json.loads(line)) for line in lines[1:] if line.strip()]
        except (OSError, ValueError, TypeError):
            return []

    @staticmethod
    def write(path: Path, tag: str, entries: list[Entry]) -> None:
        """Replace `path` with `entries` (atomic: a reader sees the old file or the new one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"ledger": LEDGER_FORMAT, "target": tag})]
        lines += [json.dumps({"module": e.module, "name": e.name, "key": e.key, "data": e.data}) for e in entries]
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)


def portable(data: str) -> str:
    """`data` without the libdevice path Triton wrote into its options (its own install's; left out, each install
    fills in its own, and Triton's disk cache keys the file by its content, not its path)."""
    spec = json.loads(data)
    options = spec.get("options") or {}
    libs = [lib for lib in options.get("extern_libs") or [] if lib[0] != "libdevice"]
    if "extern_libs" in options:
        options["extern_libs"] = libs or None
    return json.dumps(spec)


class Recorder:
    """Triton's jit_cache_hook while entered (a hook already set is called after it): the entries of this package's
    kernels that entered a process cache by a compile of their own. A preload thread's are not theirs (what a run
    took from a preload is `Preload.used`)."""

    def __init__(self):
        self.entries: dict[tuple[str, str, str], Entry] = {}
        self._previous = None

    def __enter__(self) -> Recorder:
        from triton import knobs
        self._previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, self
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs
        knobs.runtime.jit_cache_hook = self._previous

    def __call__(self, **hook):
        fn, data = hook.get("fn"), (hook.get("compile") or {}).get("specialization_data")
        module = getattr(fn, "module", None)
        ours = isinstance(module, str) and (module == PACKAGE or module.startswith(PACKAGE + "."))
        if data and ours and not threading.current_thread().name.startswith(THREAD_PREFIX):
            entry = Entry(module, fn.name, json.loads(data)["key"], portable(data))
            self.entries.setdefault((entry.module, entry.name, entry.key), entry)
        return self._previous(**hook) if self._previous is not None else None   # True would skip the compile


class _Compiling:
    """Stands in a kernel's in-process cache for its compile in a preload thread. The first launch that finds it
    waits for the compile, notes the entry used, and puts the compiled kernel in its place."""

    def __init__(self, fn, cache: dict, entry: Entry):
        self._fn, self._cache, self.entry = fn, cache, entry
        self._done = threading.Event()
        self.kernel = None
        self.used = False

    def finish(self, kernel) -> None:
        self.kernel = kernel
        if kernel is not None:
            self._cache[self.entry.key] = self   # the compile stored the kernel itself: the first launch comes here
        elif self._cache.get(self.entry.key) is self:
            del self._cache[self.entry.key]      # failed: a launch compiles it as it would have
        self._done.set()

    def result(self, ignore_errors: bool = False):
        self._done.wait()
        kernel = self.kernel if self.kernel is not None else self._fn.preload(self.entry.data)  # failed: here, raising
        self.used = True
        if self._cache.get(self.entry.key) is self:
            self._cache[self.entry.key] = kernel
        return kernel

    def __getattr__(self, name: str):   # Triton 3.9's launch path uses what it finds in the cache directly
        if name.startswith("_"):   # ours are set in __init__: a missing one is not the kernel's to answer
            raise AttributeError(name)
        return getattr(self.result(), name)


def _hash_triton_install() -> None:
    """Triton's own key of its install (every compile's cache key starts with it): a hash of its compiler sources and
    of libtriton, cached in the process but not locked. Asked by 8 compile threads at once, each hashed it: 4.1 s of
    thread time in a warm default run on one H200 (py-spy, session 33). One thread hashes it here, before the compiles
    start; where this Triton keeps it elsewhere, the compiles hash it as before."""
    try:
        from triton.runtime.cache import triton_key
        triton_key()
    except Exception:  # noqa: BLE001 - not this Triton's layout, or unreadable: each compile asks as it would have
        pass


def _build_launcher(kernel, device: int) -> None:
    """Triton 3.6 builds a C launcher for each kernel signature with gcc at the kernel's first launch, in the thread
    that launches, and keeps it in its disk cache: 8 of them, 2.3-2.4 s of a cold default run's main thread on one
    H200 (session 33's compile log). One built here from the kernel's source and metadata is that cache entry, so the
    launch loads it. The kernel object is not touched: its first launch may be under way in another thread."""
    import torch
    try:
        from triton.runtime import driver
        with torch.cuda.device(device):
            driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - another Triton's layout, or the build failed: the launch builds it as before
        pass


class Preload:
    """`entries` compiled for `device` in `workers` threads (`start`); `used`: the entries a launch took, `failed`:
    those refused or not compiled, with why."""

    def __init__(self, entries: list[Entry], device: int = 0, workers: int = 8):
        self.entries, self.device, self.workers = entries, device, max(1, workers)
        self.placeholders: list[_Compiling] = []
        self.failed: list[tuple[Entry, str]] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> Preload:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix=THREAD_PREFIX)
        install_hashed = self._pool.submit(_hash_triton_install)
        for entry in self.entries:
            placeholder = self._reserve(entry)
            if placeholder is not None:
                self.placeholders.append(placeholder)
                self._pool.submit(self._compile, placeholder, install_hashed)
        self._pool.shutdown(wait=False)
        return self

    def _reserve(self, entry: Entry) -> _Compiling | None:
        """The entry's placeholder in its kernel's cache; None when the kernel is gone, already cached here, its
        data is not its own (a launch waiting on it compiles the data's specialization again if the preload fails),
        or this Triton keeps its caches differently (then nothing is preloaded for it)."""
        try:
            fn = getattr(importlib.import_module(entry.module), entry.name)
            spec = json.loads(entry.data)
            # a launch waiting on a failed preload compiles the data's specialization: it must be the one it asked for
            if spec.get("key") != entry.key or spec.get("name") != f"{entry.module}.{entry.name}":
                raise ValueError("its data is another specialization's or another kernel's")
            cache = fn.device_caches[self.device][0]
        except Exception as error:  # noqa: BLE001 - a hint that does not fit this process: compiled at first launch
            self.failed.append((entry, f"{type(error).__name__}: {error}"))
            return None
        if entry.key in cache:
            return None
        placeholder = _Compiling(fn, cache, entry)
        cache[entry.key] = placeholder
        return placeholder

    def _compile(self, placeholder: _Compiling, install_hashed: concurrent.futures.Future) -> None:
        import torch
        kernel = None
        try:
            install_hashed.result()   # submitted first: a pool of any size runs it before this waits on it
            with torch.cuda.device(self.device):
                kernel = placeholder._fn.preload(placeholder.entry.data)
        except Exception as error:  # noqa: BLE001 - a stale or foreign entry: the launch compiles it itself
            self.failed.append((placeholder.entry, f"{type(error).__name__}: {str(error)[:200]}"))
        finally:
            placeholder.finish(kernel)
        if kernel is not None:
            _build_launcher(kernel, self.device)

    def used(self) -> list[Entry]:
        return [p.entry for p in self.placeholders if p.used]
