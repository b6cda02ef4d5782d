"""CUDA C++ kernels compiled at first use by NVRTC and launched through the driver API (ctypes), no build step.

torch's CUDA wheels ship libnvrtc; nothing else is needed on the machine (no nvcc, no C++ compiler).
`compile_kernel(path, name, defines, device)` compiles the file once per (file, defines, device) for that GPU's
architecture (its `#include "name"` lines replaced by the files beside it: `inline_includes`) (the cubin is kept on disk, `cache_dir()`, so later processes load it) and returns a `Kernel`;
`Kernel(grid, block, smem, args)` launches it on the current torch stream (so CUDA graph capture records it).
`unavailable()` says why kernels cannot be compiled here, or None. `build(...)`: `compile_kernel` with what this
machine refused remembered (not asked again in the process), raised as `BuildError` (its reason in a few lines), so a
launcher can fall back to a Triton kernel once warned.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import re
import tempfile

import torch

from kernels.launches import launching

_MAX_DYNAMIC_SHARED = 8   # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
CACHE_ENV = "FP8_HARNESS_KERNEL_CACHE"


@functools.lru_cache(maxsize=None)
def _nvrtc() -> ctypes.CDLL:
    try:   # torch's own lookup where it has one (private; it knows its wheel's layout)
        from torch.cuda._utils import _get_gpu_rtc_library
        return _get_gpu_rtc_library()
    except (ImportError, OSError, RuntimeError):   # else the nvidia wheels beside torch, else the loader's path
        site = os.path.dirname(os.path.dirname(torch.__file__))
        for path in sorted(glob.glob(os.path.join(site, "nvidia", "**", "libnvrtc.so*"), recursive=True)):
            if "builtins" not in path:
                return ctypes.CDLL(path)
        return ctypes.CDLL("libnvrtc.so")


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why NVRTC kernels cannot run in this process (None when they can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _nvrtc()
        _driver()
    except OSError as e:
        return f"NVRTC or the CUDA driver library not found ({e})"
    return None


def _check_driver(code: int, what: str) -> None:
    if code != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(code, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else code}")


class _LaunchAttribute(ctypes.Structure):   # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):   # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class Kernel:
    """A compiled kernel in one device's context."""

    def __init__(self, function: ctypes.c_void_p, module: ctypes.c_void_p, device: int):
        self.function, self.module, self.device = function, module, device
        self.max_shared = 48 * 1024

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, args: list,
                 overlap: bool = False) -> None:
        """Launch on torch's current stream. overlap: a programmatic dependent launch (sm_90): the kernel may start
        before the stream's previous kernel has finished, once that kernel's blocks have all executed
        griddepcontrol.launch_dependents; it must wait for that kernel's results with griddepcontrol.wait."""
        launching(self.device)
        if smem > self.max_shared:
            _check_driver(_driver().cuFuncSetAttribute(self.function, _MAX_DYNAMIC_SHARED, smem),
                          f"cuFuncSetAttribute(max dynamic shared memory = {smem} bytes)")
            self.max_shared = smem
        values = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                values.append(ctypes.c_void_p(arg.data_ptr()))
            elif type(arg) is int:
                assert -2**31 <= arg < 2**31, f"int kernel argument {arg} does not fit a C int"
                values.append(ctypes.c_int(arg))
            elif type(arg) is float:
                values.append(ctypes.c_double(arg))
            else:
                raise TypeError(f"kernel arguments are tensors, ints (C int) or floats (C double), got {arg!r:.60}")
        params = (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values))   # each argument's address
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if overlap:
            attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
            config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem,
                                   ctypes.c_void_p(stream), ctypes.pointer(attribute), 1)
            _check_driver(_driver().cuLaunchKernelEx(ctypes.byref(config), self.function, params, None),
                          "cuLaunchKernelEx")
            return
        _check_driver(_driver().cuLaunchKernel(self.function, *grid, *block, smem, ctypes.c_void_p(stream), params,
                                               None), "cuLaunchKernel")


def _compile(source: str, name: str, options: list[str]) -> bytes:
    return compile_program(source, name, options)[0]


def compile_program(source: str, name: str, options: list[str],
                    lib: ctypes.CDLL | None = None) -> tuple[bytes, str]:
    """(cubin, NVRTC's log: ptxas' lines where options ask for them) of `source`, by `lib` (default: torch's NVRTC;
    kernels/sass_stats.py hands a wheel's on a CPU machine). A compile error raises RuntimeError with the log."""
    lib = lib or _nvrtc()
    prog = ctypes.c_void_p()
    code = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None)
    if code != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed ({code})")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        code = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if code != 0:
            raise RuntimeError(f"NVRTC could not compile {name} with {' '.join(options)}:\n{log.value.decode()}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, cubin) != 0:
            raise RuntimeError(f"nvrtcGetCUBIN failed for {name}")
        return cubin.raw, log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def cache_dir() -> str:
    """Where compiled kernels are kept between processes: $FP8_HARNESS_KERNEL_CACHE, else ~/.cache/fp8-harness/nvrtc."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fp8-harness", "nvrtc")


def cubin_for(source: str, name: str, options: list[str], compiler: str) -> bytes:
    """The compiled cubin of `source`: from the on-disk cache when this source, these options and this compiler
    (`compiler`: its version) made it before, else compiled and stored (a process pays NVRTC's seconds once per
    machine, not once per process). A cache that cannot be read or written only costs the compile."""
    key = hashlib.sha256("\0".join([source, name, compiler, *options]).encode()).hexdigest()[:32]
    path = os.path.join(cache_dir(), f"{name}-{key}.cubin")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        pass   # not compiled on this machine yet (or the cache is unreadable): compile below
    cubin = _compile(source, name, options)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)   # atomic: a concurrent reader sees the whole file or none
    except OSError:
        pass   # a read-only or full disk: the next process compiles again
    return cubin


_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)


def inline_includes(source: str, directory: str) -> str:
    """`source` with every `#include "name"` line replaced by the text of `directory/name` (its own includes inlined
    too), so NVRTC needs no include path and the cubin cache key covers the headers' text. A missing header raises
    FileNotFoundError naming it."""
    def text(match: re.Match) -> str:
        with open(os.path.join(directory, match.group(1))) as f:
            return inline_includes(f.read(), directory)
    return _LOCAL_INCLUDE.sub(text, source)


@functools.lru_cache(maxsize=None)
def compile_kernel(path: str, name: str, defines: tuple[tuple[str, int], ...], device: int,
                   arch_specific: bool = False) -> Kernel:
    """The kernel `name` of the CUDA file `path` (extern "C"), compiled with -D defines for `device`'s GPU
    (arch_specific: for that architecture's own features, e.g. sm_90a's wgmma; such code runs on it alone)."""
    major, minor = torch.cuda.get_device_capability(device)
    with open(path) as f:
        source = inline_includes(f.read(), os.path.dirname(path))
    options = [f"--gpu-architecture=sm_{major}{minor}{'a' if arch_specific else ''}", "-std=c++17", "-lineinfo",
               *[f"-D{key}={value}" for key, value in defines]]
    cubin = cubin_for(source, name, options, f"nvrtc {_nvrtc_version()}")
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)   # the primary context is current from here on
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check_driver(_driver().cuModuleLoadData(ctypes.byref(module), cubin), f"cuModuleLoadData({name})")
        _check_driver(_driver().cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
                      f"cuModuleGetFunction({name})")
    return Kernel(function, module, device)


class BuildError(RuntimeError):
    """NVRTC could not compile a CUDA kernel, or the driver could not load it, on this machine."""


# (path, name, defines, device, arch_specific) -> why it did not build: not retried in this process
BUILD_FAILURES: dict[tuple, str] = {}


def build(path: str, name: str, defines: tuple[tuple[str, int], ...], device: int,
          arch_specific: bool = False) -> Kernel:
    """`compile_kernel`, or BuildError with the reason (the first 3 lines of NVRTC's or the driver's, 400 characters),
    also on every later call with the same arguments in this process."""
    key = (path, name, defines, device, arch_specific)
    if key not in BUILD_FAILURES:
        try:
            return compile_kernel(path, name, defines, device, arch_specific)
        except (RuntimeError, OSError) as e:
            BUILD_FAILURES[key] = " / ".join(str(e).strip().splitlines()[:3])[:400] or type(e).__name__
    raise BuildError(BUILD_FAILURES[key])

