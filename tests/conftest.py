"""Fixtures shared by the harness tests: tiny random-weight models of the three families."""

from __future__ import annotations

import pytest

from harness.canary.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """{arch: model_dir} for gqa (Llama), mla (DeepSeek-V3) and hybrid (Qwen3-Next), built once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch) for arch in ("gqa", "mla", "hybrid")}
