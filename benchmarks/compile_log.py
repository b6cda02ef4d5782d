"""Every Triton and NVRTC compile of one `harness` command, logged: what a cold run pays for its kernels.

    TAG=cold python benchmarks/compile_log.py run --device cuda --out /tmp/run --no-progress

Runs `harness.cli.main` with the arguments given, with Triton's compilation listener (`knobs.compilation.listener`:
kernel, cache hit or not, seconds per stage, the compiling thread) and a timer on `kernels.nvrtc._compile`. At exit
it writes the log to $OUT/$TAG.json (default: /tmp/run.json) and prints one line a kind to stderr: compiles, their
seconds, Triton's disk-cache hits, Triton 3.6's C launchers, and what the preload threads compiled
(harness/executor/kernel_ledger.py). Empty `~/.triton/cache` and `~/.cache/fp8-harness/nvrtc` first for a cold run.
"""
import atexit
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAG = os.environ.get("TAG", "run")
LOG: list[dict] = []
T0 = time.perf_counter()

from triton import knobs  # noqa: E402

from kernels import nvrtc  # noqa: E402


def listener(src, metadata, metadata_group, times, cache_hit):
    LOG.append(dict(kind="triton", name=getattr(src, "name", None) or str(src)[:60], hit=cache_hit,
                    t=time.perf_counter() - T0, init=times.ir_initialization / 1e6,
                    stages=[(n, us / 1e6) for n, us in times.lowering_stages], thread=threading.current_thread().name,
                    consts=str(getattr(src, "constants", ""))[:300], sig=str(getattr(src, "signature", ""))[:300]))


_nvrtc_compile = nvrtc._compile


def timed_nvrtc(source, name, options):
    start = time.perf_counter()
    try:
        return _nvrtc_compile(source, name, options)
    finally:
        LOG.append(dict(kind="nvrtc", name=name, s=time.perf_counter() - start, t=start - T0, opts=options,
                        thread=threading.current_thread().name))


def timed_launcher(build):
    """Triton 3.6 compiles a C launcher per kernel signature (`compile_module_from_src`, gcc) at a kernel's first
    launch, outside the compile the listener sees."""
    def launcher(src, name, *args, **kwargs):
        start = time.perf_counter()
        try:
            return build(src, name, *args, **kwargs)
        finally:
            LOG.append(dict(kind="launcher", name=name, s=time.perf_counter() - start, t=start - T0,
                            thread=threading.current_thread().name))
    return launcher


def seconds(entries: list[dict]) -> float:
    return sum(e["init"] + sum(s for _, s in e["stages"]) for e in entries)


def summary() -> None:
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"{TAG}.json"), "w") as f:
        json.dump(LOG, f)
    compiled = [e for e in LOG if e["kind"] == "triton" and not e["hit"]]
    hits = sum(1 for e in LOG if e["kind"] == "triton" and e["hit"])
    ahead = [e for e in compiled if e["thread"].startswith("kernel-preload")]
    built = [e for e in LOG if e["kind"] == "nvrtc"]
    print(f"[{TAG}] triton compiles {len(compiled)} ({seconds(compiled):.1f} s), cache hits {hits}; nvrtc compiles "
          f"{len(built)} ({sum(e['s'] for e in built):.1f} s); {time.perf_counter() - T0:.1f} s since Triton's import",
          file=sys.stderr)
    launchers = [e for e in LOG if e["kind"] == "launcher"]
    if launchers:
        slow = [e for e in launchers if e["s"] > 0.05]
        print(f"[{TAG}] C modules (launchers, utils) {len(launchers)}: {sum(e['s'] for e in launchers):.1f} s, of "
              f"which {len(slow)} over 50 ms (built, not cached) {sum(e['s'] for e in slow):.1f} s; in the preload "
              f"threads {sum(e['s'] for e in launchers if e['thread'].startswith('kernel-preload')):.1f} s",
              file=sys.stderr)
    if ahead:
        elsewhere = [e["t"] for e in compiled if e not in ahead]
        print(f"[{TAG}] preload threads compiled {len(ahead)} ({seconds(ahead):.1f} s), the last ending at "
              f"{max(e['t'] for e in ahead):.1f} s; compiles elsewhere: {len(elsewhere)}", file=sys.stderr)


if __name__ == "__main__":
    knobs.compilation.listener = listener
    nvrtc._compile = timed_nvrtc
    try:   # Triton 3.6's C launchers and utils; later versions may build none
        from triton.backends.nvidia import driver as nvidia_driver
        nvidia_driver.compile_module_from_src = timed_launcher(nvidia_driver.compile_module_from_src)
    except (ImportError, AttributeError):
        pass
    atexit.register(summary)
    from harness.cli import main
    sys.exit(main())
