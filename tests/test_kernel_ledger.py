"""Triton kernels compiled ahead from a ledger (kernels/warm.py, harness/executor/kernel_ledger.py).

The CPU tests cover the ledger's file, the plan's name, the recorder's choice of entries (Triton calls its hook
with keyword arguments; on a CPU there is no driver to launch a kernel) and the preload's order over faked kernels.
The GPU tests run the real thing in fresh processes, each with an empty Triton cache: a kernel launched under the
recorder, then the same launches in a process that preloaded the ledger first."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.executor import kernel_ledger
from kernels import warm

REPO = Path(__file__).resolve().parent.parent


def _entry(name: str = "_k", key: str = "k1") -> warm.Entry:
    return warm.Entry("kernels.store_kv", name, key, json.dumps({"name": name, "key": key}))


def test_ledger_reads_back_what_it_wrote_and_nothing_of_another_target(tmp_path):
    path = tmp_path / "sub" / "plan-triton3.6.0-cuda90.jsonl"
    entries = [_entry("_a", "k1"), _entry("_b", "k2")]
    warm.Ledger.write(path, "triton3.6.0-cuda90", entries)
    assert warm.Ledger.read(path, "triton3.6.0-cuda90") == entries
    assert warm.Ledger.read(path, "triton3.6.0-cuda100") == []   # its data would compile for sm_90
    assert warm.Ledger.read(tmp_path / "missing.jsonl", "triton3.6.0-cuda90") == []
    path.write_text("not json\n")
    assert warm.Ledger.read(path, "triton3.6.0-cuda90") == []
    assert not list(path.parent.glob("*.tmp"))


def test_plan_name_follows_the_models_and_paths_not_where_the_models_are():
    paths = [SimpleNamespace(name="bf16"), SimpleNamespace(name="fp8_e4m3")]
    here = SimpleNamespace(models=(Path("/a/weights/gqa"), Path("/a/weights/mla")), paths=paths)
    there = SimpleNamespace(models=(Path("/b/mla"), Path("/b/gqa")), paths=paths)
    other = SimpleNamespace(models=here.models, paths=paths[:1])
    assert kernel_ledger.plan_name(here) == kernel_ledger.plan_name(there) != kernel_ledger.plan_name(other)


def test_recorder_keeps_this_packages_kernels_compiled_by_the_run_and_chains_a_hook_already_set(monkeypatch):
    """Triton's jit_cache_hook gets (key, repr, fn=JitFunctionInfo(module, name, jit_function), compile={...,
    'specialization_data': JSON}, ...); a True return would skip the compile, so the previous hook's answer is
    passed on unchanged."""
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **hook: seen.append(hook["key"]) or None)

    def call(module: str, key: str):
        data = json.dumps({"name": "f", "key": key})
        return knobs.runtime.jit_cache_hook(key=key, repr="f", fn=SimpleNamespace(module=module, name="_f"),
                                            compile={"key": key, "specialization_data": data}, is_manual_warmup=False,
                                            already_compiled=False)

    with warm.Recorder() as recorder:
        assert call("kernels.store_kv", "k1") is None
        call("kernels.store_kv", "k1")
        call("torch._inductor.something", "k2")   # not ours
        preloading = threading.Thread(target=call, args=("kernels.store_kv", "k3"), name=warm.THREAD_PREFIX + "_0")
        preloading.start()
        preloading.join()
    assert [e.key for e in recorder.entries.values()] == ["k1"]
    assert seen == ["k1", "k1", "k2", "k3"] and knobs.runtime.jit_cache_hook is not recorder


def test_a_recorded_entry_names_no_path_of_the_install_that_recorded_it():
    data = json.dumps({"name": "f", "key": "k", "options": {"num_warps": 4, "extern_libs": [
        ["libdevice", "/opt/other/site-packages/triton/backends/nvidia/lib/libdevice.10.bc"]]}})
    assert json.loads(warm.portable(data))["options"] == {"num_warps": 4, "extern_libs": None}


def test_the_bundled_ledgers_are_the_default_plans_and_name_kernels_that_exist():
    """A bundled ledger serves the default `harness run --device cuda` on a fresh machine. Renamed, it would never be
    read: when the default models or paths change, record it again on a GPU (`harness run --device cuda`, then copy
    ~/.cache/fp8-harness/triton-ledger/PLAN-TARGET.jsonl to harness/canary/ledgers/)."""
    from harness import job
    from harness.run_config import build_run_config

    models, _ = job.default_models()
    plan = kernel_ledger.plan_name(build_run_config(command=["harness"], device="cpu", models=models))
    assert kernel_ledger.BUNDLED_DIR.is_dir()
    bundled = sorted(kernel_ledger.BUNDLED_DIR.glob("*.jsonl"))
    assert bundled and all(p.name.startswith(plan + "-") for p in bundled), (plan, [p.name for p in bundled])
    for path in bundled:
        tag = path.stem.split("-", 1)[1]
        entries = warm.Ledger.read(path, tag)
        assert entries, path
        for entry in entries:
            kernel = getattr(importlib.import_module(entry.module), entry.name)
            assert hasattr(kernel, "preload"), f"{path.name}: {entry.module}.{entry.name} is not a Triton kernel"
            assert json.loads(entry.data)["key"] == entry.key and "/" not in json.dumps(
                json.loads(entry.data)["options"]), f"{path.name}: {entry.name}'s data is not portable"


def test_a_ledger_recorded_under_other_compile_settings_is_another_targets(monkeypatch):
    """TRITON_DEFAULT_FP_FUSION=0 and the like change what Triton compiles, and the recorded options carry the
    recording process's settings: such a ledger is named apart. TRITON_CACHE_DIR changes nothing compiled."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/elsewhere")
    assert warm.env_suffix() == ""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert warm.env_suffix().startswith("-env")


def test_an_entry_whose_data_is_not_its_own_is_not_preloaded():
    """A launch that finds a placeholder whose preload failed compiles the entry's data itself: data naming another
    kernel or another specialization than its key would give that launch the wrong kernel, so it is refused before
    any placeholder is made (checked before the kernel's per-device cache, which a CPU does not have)."""
    pytest.importorskip("triton")
    name = "kernels.write_check._square_error_sums_kernel"
    preload = warm.Preload([warm.Entry("kernels.write_check", "_square_error_sums_kernel", "k1",
                                       json.dumps({"name": name, "key": "k2"})),
                            warm.Entry("kernels.write_check", "_square_error_sums_kernel", "k1",
                                       json.dumps({"name": "kernels.splits._other", "key": "k1"}))])
    assert [preload._reserve(entry) for entry in preload.entries] == [None, None]
    assert [reason.startswith("ValueError") for _, reason in preload.failed] == [True, True]


def test_the_preload_hashes_triton_once_then_compiles_then_builds_each_launcher(monkeypatch):
    """Every Triton compile's cache key starts with `triton_key()`, a hash of Triton's sources and libtriton that the
    process caches without a lock: 8 preload threads starting at once each hashed it (4.1 s of thread time in a warm
    default run, session 33). One thread hashes it first; the compiles wait for it. After its compile each entry's
    C launcher is built from the kernel's source and metadata, once the placeholder has handed the kernel over (a
    launch may be using it), and a launcher that fails to build fails nothing. Kernels and driver faked: a CPU has
    none to compile for."""
    triton_cache = pytest.importorskip("triton.runtime.cache")
    from triton.runtime import driver
    import torch

    events, lock = [], threading.Lock()

    def triton_key():
        time.sleep(0.05)   # long enough that a compile not waiting for it would land first
        with lock:
            events.append("hashed")

    class Kernel:
        device_caches = {0: [{}]}

        def preload(self, data):
            key = json.loads(data)["key"]
            with lock:
                events.append(f"compiled {key}")
            return SimpleNamespace(src=key, metadata={"key": key})

    def launcher_cls(src, metadata):
        placeholder = Kernel.device_caches[0][0][src]
        with lock:
            events.append(f"launcher {src} {metadata == {'key': src} and placeholder._done.is_set()}")
        if src == "k3":
            raise RuntimeError("gcc failed")

    module = types.ModuleType("kernels._preload_fake")
    module._k = Kernel()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(triton_cache, "triton_key", triton_key)
    monkeypatch.setattr(driver, "_active", SimpleNamespace(launcher_cls=launcher_cls))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    entries = [warm.Entry(module.__name__, "_k", f"k{i}", json.dumps({"name": f"{module.__name__}._k", "key": f"k{i}"}))
               for i in range(8)]
    preload = warm.Preload(entries, 0, 8).start()
    preload._pool.shutdown(wait=True)
    assert events[0] == "hashed" and preload.failed == []
    for i in range(8):
        assert events.index(f"compiled k{i}") < events.index(f"launcher k{i} True"), events


def test_preload_is_off_with_its_switch(monkeypatch):
    """HARNESS_KERNEL_PRELOAD=0: no ledger is read or written (the baseline of a cold run's timing)."""
    from harness import cli
    monkeypatch.setenv(kernel_ledger.SWITCH_ENV, "0")
    config = SimpleNamespace(device="cuda", models=(), paths=(), shard=None)
    cli._start_cuda_beside(config)
    assert kernel_ledger.plan_name(config) not in kernel_ledger._STARTED   # nothing registered for the replay
    with kernel_ledger.compiled_ahead(config):
        pass
    assert not kernel_ledger._STARTED


def test_only_a_run_on_one_gpu_in_this_process_compiles_ahead():
    def config(device, shard=None):
        return SimpleNamespace(device=device, shard=shard, models=(), paths=())
    assert [kernel_ledger.one_gpu(config(d)) for d in ("cuda", "cuda:3", "cpu", "cuda:0,1", "cuda:all")] == \
        [0, 3, None, None, None]
    assert kernel_ledger.one_gpu(config("cuda", shard="layers")) is None
    assert kernel_ledger.one_gpu(SimpleNamespace(device="cuda", shard=None, executor="ray")) is None
    with kernel_ledger.compiled_ahead(config("cpu")):   # nothing to compile ahead: the replay runs as it is
        pass


# ---- on a GPU: fresh processes, each with an empty Triton cache ----

LAUNCHES = """
import json, sys, torch
from kernels import warm
from kernels.write_check import square_error_sums
ledger, mode = sys.argv[1], sys.argv[2]
tag = None
preload = None
if mode == "preload":
    torch.cuda.init()
    tag = warm.target_tag()
    preload = warm.Preload(warm.Ledger.read(ledger, tag), 0, 4).start()
torch.manual_seed(0)
sums = []
with warm.Recorder() as recorder:
    for dim in (32, 48, 64):   # three specializations (BLOCK_D 32, 64, 64 with D 48 and 64)
        x = torch.randn(3, 2, 5, dim, device="cuda", dtype=torch.bfloat16)
        a, b = x + 0.01 * torch.randn_like(x), x.half().bfloat16()
        sums.append(square_error_sums(x, a, b).tolist())
tag = tag or warm.target_tag()
if mode == "record":
    warm.Ledger.write(ledger, tag, list(recorder.entries.values()))
print(json.dumps({"sums": sums, "compiled_here": len(recorder.entries),
                  "used": len(preload.used()) if preload else 0, "failed": len(preload.failed) if preload else 0}))
"""


def _launch(tmp_path: Path, ledger: Path, mode: str, cache: str) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / cache), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", LAUNCHES, str(ledger), mode], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_gpu_preloaded_kernels_are_the_ones_launched_and_compute_the_same(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    recorded = _launch(tmp_path, ledger, "record", "cache_a")
    assert recorded["compiled_here"] == 3 and len(ledger.read_text().splitlines()) == 4
    preloaded = _launch(tmp_path, ledger, "preload", "cache_b")
    assert preloaded == {**recorded, "compiled_here": 0, "used": 3, "failed": 0}


@pytest.mark.gpu
def test_gpu_a_stale_or_broken_ledger_entry_costs_only_its_compile(tmp_path):
    """A stale entry (a key no launch asks for) is compiled and not used; a broken one (its data no longer
    Triton's) fails in the preload thread, and the launch that needs it compiles it itself."""
    ledger = tmp_path / "ledger.jsonl"
    recorded = _launch(tmp_path, ledger, "record", "cache_a")
    lines = ledger.read_text().splitlines()
    stale = json.loads(lines[1])
    stale_data = json.loads(stale["data"])
    stale["key"] = stale_data["key"] = stale["key"] + "-stale"   # as if recorded from another launch
    stale["data"] = json.dumps(stale_data)
    broken = json.loads(lines[2])
    broken["data"] = json.dumps({"name": "nothing"})
    ledger.write_text("\n".join([lines[0], json.dumps(stale), json.dumps(broken), lines[3]]) + "\n")
    preloaded = _launch(tmp_path, ledger, "preload", "cache_b")
    # entries 1 (its key changed) and 2 (broken) compile here; entry 3 comes from the preload
    assert preloaded == {**recorded, "compiled_here": 2, "used": 1, "failed": 1}


RUN_JOB = """
import json, sys, threading
from pathlib import Path
from triton import knobs
from harness import job
from harness.run_config import build_run_config
compiled = []
knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: cache_hit or compiled.append(
    threading.current_thread().name)
models, _ = job.default_models()
models = [m for m in models if m.name == "gqa"]
job.run_job(build_run_config(command=["test"], out=Path(sys.argv[1]), device="cuda", models=models, paths="fp8_e4m3",
                             select=("id:canary-arith-1",)), progress=None, warn=lambda message: None)
print(json.dumps({"ahead": sum(t.startswith("kernel-preload") for t in compiled),
                  "at_launch": sum(not t.startswith("kernel-preload") for t in compiled)}))
"""


@pytest.mark.gpu
def test_gpu_harness_run_keeps_its_ledger_and_a_replay_that_preloaded_it_compiles_nothing_at_launch(tmp_path):
    """Two runs of one plan, each with an empty Triton cache. The first, `harness run --device cuda`, compiles at
    first launch and writes the plan's ledger. The second, `job.run_job` as `pytest harness` and the nightly call it,
    compiles every kernel ahead in the preload threads, none at launch, and stores the same records and ledger."""
    env = {**os.environ, kernel_ledger.LEDGER_ENV: str(tmp_path / "ledgers"), "PYTHONPATH": str(REPO)}
    cli_run = [sys.executable, "-c", "import sys; from harness.cli import main; sys.exit(main())", "run", "--device",
               "cuda", "--models", "gqa", "--paths", "fp8_e4m3", "--select", "id:canary-arith-1", "--no-progress",
               "--out"]
    done = [subprocess.run(command + [str(tmp_path / f"run{n}")], env={**env, "TRITON_CACHE_DIR": str(
        tmp_path / f"triton{n}")}, capture_output=True, text=True, timeout=600)
        for n, command in ((1, cli_run), (2, [sys.executable, "-c", RUN_JOB]))]
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-3000:] for d in done]
    assert "not compiled ahead" not in done[0].stderr
    compiles = json.loads(done[1].stdout.strip().splitlines()[-1])
    assert compiles["ahead"] > 0 and compiles["at_launch"] == 0, compiles
    ledgers = list((tmp_path / "ledgers").glob("*.jsonl"))
    assert len(ledgers) == 1 and len(ledgers[0].read_text().splitlines()) == compiles["ahead"] + 1
    records = [sorted((tmp_path / f"run{n}" / "records.jsonl").read_text().splitlines()) for n in (1, 2)]
    assert records[0] == records[1]
