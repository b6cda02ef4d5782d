"""A CUDA kernel's machine code without a GPU: compile one of kernels/*.cu with NVRTC for an architecture, then print
ptxas' registers and spills and an opcode histogram of the SASS (nvdisasm). Session 26 found MXFP8's 305 branches this
way (kernels/BENCHMARKS.md): a kernel's instruction count per layout is a measurement a CPU machine can make.

    python -m kernels.sass_stats kernels/gqa_decode_block_scaled.cu gqa_block_scaled_decode ELEMENT=1 SCALE=1 \\
        BLOCK=32 HEAD_DIM=128 PAGE=16 CS=1024 SS=64 NW=4 CTAS=3 PREFETCH=1 Q_BF16=1 [--arch sm_90] [--top 30]
        [--nvrtc PATH] [--nvdisasm PATH] [--dump FILE]

NVRTC: torch's where it has one (a CUDA wheel), else --nvrtc (on a CPU machine: `pip install nvidia-cuda-nvrtc-cu12`,
lib/libnvrtc.so.12). nvdisasm: on PATH, else --nvdisasm (`pip install nvidia-cuda-nvdisasm`, bin/nvdisasm).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import shutil
import subprocess
import tempfile

from kernels.nvrtc import compile_program, inline_includes

OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")   # /*0120*/ @!P0 BRA ...


def ptxas_usage(log: str) -> dict[str, int]:
    """Registers and spill bytes from ptxas' -v lines in an NVRTC log (-1 where it printed none)."""
    found = {key: re.search(pattern, log) for key, pattern in (
        ("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
        ("spill_loads", r"(\d+) bytes spill loads"))}
    return {key: int(match.group(1)) if match else -1 for key, match in found.items()}


def opcode_histogram(sass: str) -> collections.Counter:
    """Instructions per opcode (its name before the first '.': HMMA.16816.F32 counts as HMMA) of nvdisasm's text."""
    return collections.Counter(match.group(1) for match in map(OPCODE.match, sass.splitlines()) if match)


def compile_cubin(path: str, name: str, defines: list[tuple[str, str]], arch: str,
                  library: ctypes.CDLL | None) -> tuple[bytes, str]:
    """(cubin, NVRTC log with ptxas' -v lines) of the kernel `name` in `path` (its local includes inlined)."""
    with open(path) as f:
        source = inline_includes(f.read(), os.path.dirname(os.path.abspath(path)))
    options = [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v", *[f"-D{k}={v}" for k, v in defines]]
    try:
        return compile_program(source, name, options, library)
    except RuntimeError as e:   # a compile error: NVRTC's log, not a traceback
        raise SystemExit(str(e)) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("kernel", help='the extern "C" kernel name')
    parser.add_argument("defines", nargs="*", help="NAME=VALUE, passed as -D")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--top", type=int, default=30, help="opcodes printed, most frequent first")
    parser.add_argument("--nvrtc", help="libnvrtc.so path (default: torch's)")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="nvdisasm path (default: on PATH)")
    parser.add_argument("--dump", help="write the SASS text here")
    args = parser.parse_args()
    bad = [d for d in args.defines if "=" not in d]
    if bad:
        parser.error(f"defines are NAME=VALUE, got {bad}")
    if not args.nvdisasm:
        parser.error("nvdisasm not found: put it on PATH or give --nvdisasm (pip install nvidia-cuda-nvdisasm)")
    library = ctypes.CDLL(args.nvrtc) if args.nvrtc else None   # None: torch's NVRTC
    cubin, log = compile_cubin(args.path, args.kernel, [tuple(d.split("=", 1)) for d in args.defines], args.arch,
                               library)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([args.nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)
    usage, ops = ptxas_usage(log), opcode_histogram(sass)
    print(f"{args.kernel} {args.arch} {' '.join(args.defines)}")
    print(f"registers {usage['registers']}, spill stores {usage['spill_stores']} B, spill loads "
          f"{usage['spill_loads']} B, instructions {sum(ops.values())}")
    print(" ".join(f"{op}:{n}" for op, n in ops.most_common(args.top)))


if __name__ == "__main__":
    main()
