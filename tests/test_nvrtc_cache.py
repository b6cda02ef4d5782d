"""The on-disk cubin cache of kernels/nvrtc.py (CPU: NVRTC itself is replaced by a counting stand-in)."""

from __future__ import annotations

import os

import pytest

from kernels import nvrtc


def test_a_kernel_compiles_once_per_source_and_options_and_is_read_back(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(nvrtc, "_compile", lambda source, name, options: calls.append(options) or b"cubin:" +
                        " ".join(options).encode())
    first = nvrtc.cubin_for("src", "k", ["-DA=1"], "nvrtc 13.0")
    again = nvrtc.cubin_for("src", "k", ["-DA=1"], "nvrtc 13.0")
    assert first == again == b"cubin:-DA=1" and len(calls) == 1, "the second process-level call compiled again"
    nvrtc.cubin_for("src", "k", ["-DA=2"], "nvrtc 13.0")            # other defines
    nvrtc.cubin_for("src changed", "k", ["-DA=1"], "nvrtc 13.0")    # an edited source
    nvrtc.cubin_for("src", "k", ["-DA=1"], "nvrtc 13.1")            # another compiler
    assert len(calls) == 4, "a changed source, option or compiler must not reuse a cubin"
    stored = os.listdir(tmp_path / "cache")
    assert len(stored) == 4 and not any(f.endswith(".tmp") for f in stored), stored


def test_an_unwritable_cache_only_costs_the_compile(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(blocker / "cache"))     # makedirs under a file fails
    calls = []
    monkeypatch.setattr(nvrtc, "_compile", lambda source, name, options: calls.append(1) or b"cubin")
    assert nvrtc.cubin_for("src", "k", [], "nvrtc 13.0") == b"cubin"
    assert nvrtc.cubin_for("src", "k", [], "nvrtc 13.0") == b"cubin" and len(calls) == 2


def test_local_includes_are_inlined_so_the_cache_key_sees_the_header(tmp_path):
    """NVRTC gets one self-contained source: each `#include "name"` line is the text of the file beside the kernel
    (nested ones too); system includes stay; an edited header changes the source, hence the cubin's cache key."""
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\n#define A 1\n')
    (tmp_path / "b.cuh").write_text("#define B 2\n")
    source = '#include <cstdint>\n#include "a.cuh"\nint k = A + B;\n'
    inlined = nvrtc.inline_includes(source, str(tmp_path))
    assert inlined == "#include <cstdint>\n#define B 2\n\n#define A 1\n\nint k = A + B;\n"
    (tmp_path / "b.cuh").write_text("#define B 3\n")
    assert nvrtc.inline_includes(source, str(tmp_path)) != inlined


def test_a_missing_header_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="gone.cuh"):
        nvrtc.inline_includes('#include "gone.cuh"\n', str(tmp_path))


def test_the_mla_kernels_compile_as_one_source_each():
    """The shipped kernels' includes resolve beside them, and the shared header is inlined once."""
    directory = os.path.dirname(nvrtc.__file__)
    for name in ("mla_decode_fp8.cu", "mla_decode_fp8_ws.cu"):
        with open(os.path.join(directory, name)) as f:
            inlined = nvrtc.inline_includes(f.read(), directory)
        assert '#include "' not in inlined and inlined.count("__device__ __forceinline__ void wait_parity") == 1


def test_a_kernel_that_does_not_build_is_refused_once_and_remembered(monkeypatch):
    """build(): the compiler's or driver's refusal comes back as BuildError with its first lines, and the same
    kernel is not compiled again in the process (a launcher falls back to Triton without paying NVRTC per call);
    other defines are asked for afresh."""
    calls = []

    def refuse(path, name, defines, device, arch_specific=False):
        calls.append(defines)
        raise RuntimeError("NVRTC could not compile k with -DA=1:\nline 2\nline 3\nline 4")

    monkeypatch.setattr(nvrtc, "BUILD_FAILURES", {})
    monkeypatch.setattr(nvrtc, "compile_kernel", refuse)
    for _ in range(3):
        with pytest.raises(nvrtc.BuildError, match="could not compile k with -DA=1: / line 2 / line 3$"):
            nvrtc.build("k.cu", "k", (("A", 1),), 0)
    with pytest.raises(nvrtc.BuildError):
        nvrtc.build("k.cu", "k", (("A", 2),), 0)
    assert calls == [(("A", 1),), (("A", 2),)], calls


def test_sass_stats_reads_ptxas_and_nvdisasm_text():
    """kernels.sass_stats' parsers on the text the tools print (ptxas -v through NVRTC's log; nvdisasm -c): predicated
    and dotted opcodes count under their name, labels and comments do not."""
    from kernels.sass_stats import opcode_histogram, ptxas_usage

    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n    16 bytes stack frame, 16 bytes spill stores, 12 bytes spill "
           "loads\nptxas info    : Used 168 registers, used 1 barriers, 1032 bytes cmem[0]\n")
    assert ptxas_usage(log) == {"registers": 168, "spill_stores": 16, "spill_loads": 12}
    assert ptxas_usage("")["registers"] == -1
    sass = ("        /*0100*/                   HMMA.16816.F32 R136, R40, R136, RZ ;\n"
            "        /*0110*/              @!P0 BRA `(.L_x_6) ;\n"
            ".L_x_6:\n"
            "        /*0120*/                   BSYNC B0 ;\n"
            "        /*0130*/              @P1 LDG.E.128.CONSTANT R8, desc[UR16][R62.64] ;\n"
            "        /*0140*/                   HMMA.16816.F32 R140, R44, R144, R140 ;\n"
            "        // a comment\n")
    assert opcode_histogram(sass) == {"HMMA": 2, "BRA": 1, "BSYNC": 1, "LDG": 1}
