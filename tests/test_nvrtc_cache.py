"""The on-disk cubin cache of kernels/nvrtc.py (CPU: NVRTC itself is replaced by a counting stand-in)."""

from __future__ import annotations

import os

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
