"""C kernels for the CPU that give torch's own bits with less work, compiled with the system's C compiler at first use.

- `linear`: a bf16 linear (`y = x @ w.T`, no bias) for x86 CPUs with AVX2 + FMA, summing in torch's fallback order.
  Where oneDNN has no bf16 kernels (AVX2 without AVX-512 BF16) torch multiplies bf16 matrices one dot product per
  output (`kernels/cpu_bf16_linear.c` says in which order), 6-8 GMAC/s on one core of the dev machine; the C file
  sums the same products in the same order with its vector lanes over 8 outputs, so a weight load serves up to 4
  input rows.
- `kv_round_trip`: an FP8 KV cache write (x -> fp8(x / s) -> bf16) and its write statistics in one call
  (`kernels/cpu_kv_round_trip.c`), the arithmetic of `kernels/reference.py`, for one sequence's writes.

Both files are compiled into one library with `cc` (or $CC) and kept on disk (`$FP8_HARNESS_KERNEL_CACHE`, where
the CUDA kernels' cubins go too; default ~/.cache/fp8-harness/cc): no build step, nothing to install. Whether their
bits are torch's on a machine is not assumed here: `harness/replay/cpu_exact.py` probes the linear against
`torch.nn.functional.linear` with the model's weights before it replaces a call, and `harness/kv_paths/cache.py`
probes the round trip against the torch reference on every bf16 input for each scale before a layer uses it.

    lib = library()            # the loaded library, or a str saying why there is none on this machine
    packed = pack(weight)      # [ceil(n / 8), k, 8] bf16, once per weight
    y = linear(x, packed, n)   # x [..., k] bf16 contiguous or not; k a multiple of 64
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.nvrtc import CACHE_ENV  # one variable names where every compiled kernel is kept

SOURCES = (Path(__file__).with_name("cpu_bf16_linear.c"), Path(__file__).with_name("cpu_kv_round_trip.c"))
FLAGS = ("-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared")
CHUNK = 64  # products per step of a dot product (8 registers x 8 lanes): k must be a multiple
LANES = 8   # outputs per packed block


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fp8-harness", "cc")


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | str:
    """The compiled library, or why there is none here (not x86-64, no compiler, a failed compile, no AVX2/FMA)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()  # checked before loading code built with -mavx2
    if not capability.startswith("AVX"):
        return f"torch dispatches {capability} kernels on this CPU (the C kernel needs AVX2 and FMA)"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return "no C compiler on PATH (cc, gcc or $CC)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"C compiler {compiler} did not run: {error}"
    sources = [source.read_text() for source in SOURCES]
    key = hashlib.sha256("\0".join([*sources, version, *FLAGS]).encode()).hexdigest()[:32]
    path = os.path.join(cache_dir(), f"cpu_kernels-{key}.so")
    if not os.path.exists(path):
        try:
            os.makedirs(cache_dir(), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_dir(), suffix=".so.tmp")
            os.close(fd)
            done = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                os.unlink(tmp)
                names = ", ".join(source.name for source in SOURCES)
                return f"{compiler} could not compile {names}: {done.stderr.strip()[-300:]}"
            os.replace(tmp, path)  # atomic: another process sees the whole library or none
        except (OSError, subprocess.SubprocessError) as error:
            return f"could not build the CPU kernels in {cache_dir()}: {error}"
    try:
        lib = ctypes.CDLL(path)
    except OSError as error:
        return f"could not load {path}: {error}"
    if not lib.fp8h_cpu_supported():
        return "this CPU lacks AVX2 or FMA"
    lib.fp8h_bf16_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_void_p]
    lib.fp8h_bf16_linear.restype = ctypes.c_int
    lib.fp8h_kv_round_trip.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.fp8h_kv_round_trip.restype = ctypes.c_int
    return lib


def supports(weight: torch.Tensor) -> str | None:
    """None where `linear` can take this weight, else why not."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return f"weight is {weight.dtype} {tuple(weight.shape)} on {weight.device}, not a 2-d bf16 CPU matrix"
    if weight.shape[1] % CHUNK:
        return f"in_features {weight.shape[1]} is not a multiple of {CHUNK}"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [ceil(n / 8), k, 8]: each block holds 8 outputs' weights side by side (zeros past n)."""
    n, k = weight.shape
    blocks = -(-n // LANES)
    padded = torch.zeros(blocks * LANES, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach()
    return padded.view(blocks, LANES, k).transpose(1, 2).contiguous()


@functools.lru_cache(maxsize=None)
def _function(name: str):
    """The library's function `name`, looked up once (they are called per layer and decode step)."""
    lib = library()
    if isinstance(lib, str):
        raise RuntimeError(f"kernels.cpu_kernels: {lib}")
    return getattr(lib, name)


def linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., k] bf16 on the CPU -> [..., n] bf16: torch's bits where the probe said so (see the module doc)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16)
    if m:
        status = _function("fp8h_bf16_linear")(rows.data_ptr(), m, k, packed.data_ptr(), n, out.data_ptr())
        if status:
            raise RuntimeError(f"kernels.cpu_kernels: the C kernel refused (status {status}: 1 = k {k} not a multiple "
                               f"of {CHUNK}, 2 = out of memory)")
    return out.view(*x.shape[:-1], n)


def kv_round_trip(x: torch.Tensor, scales: torch.Tensor, fmt: str, saturate: bool,
                  ratios: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int, float]:
    """x [batch, heads, tokens, dim] bf16 (or [batch, 1, tokens, latent]) on the CPU, scales [heads] or [1] float32:
    (read back [same] bf16, clipped, nonfinite, amax ratio), what `kernels.reference.quantize` / `dequantize` and
    the write statistics compute; `ratios` (float32, x's shape) receives |x / s| / max of each value (the probe's)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    counts = (ctypes.c_int64(), ctypes.c_int64(), ctypes.c_float())
    inner = x[0, 0].numel() if x.numel() else 0  # tokens x dim
    _function("fp8h_kv_round_trip")(x.data_ptr(), x.shape[0], x.shape[1], inner, scales.data_ptr(), scales.numel(),
                                    int(fmt == "e5m2"), int(saturate), out.data_ptr(), ctypes.byref(counts[0]),
                                    ctypes.byref(counts[1]), ctypes.byref(counts[2]),
                                    None if ratios is None else ratios.data_ptr())
    return out, counts[0].value, counts[1].value, counts[2].value
