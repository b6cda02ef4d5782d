"""Fixtures shared by the harness tests: tiny random-weight models of the three families."""

from __future__ import annotations

import pytest

from harness.canary.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """{arch: model_dir} for gqa (Llama), mla (DeepSeek-V3) and hybrid (Qwen3-Next), built once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch) for arch in ("gqa", "mla", "hybrid")}


def _tiny_llama(tmp_path_factory, name: str, heads: int, kv_heads: int, head_dim: int):
    """A tiny random-weight Llama (the gqa canary's config) with these heads, saved with the canary tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.canary.tiny_models import tiny_config
    from harness.canary.tokenizer import save_tokenizer

    out = tmp_path_factory.mktemp(name)
    config = tiny_config("gqa")
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, kv_heads, head_dim
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(str(out))
    save_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def head32_model(tmp_path_factory):
    """A tiny random-weight Llama whose heads hold 32 values (the tiny models' hold 16): 2 query heads over 1 KV
    head, so block-scaled formats with blocks of 32 (MX) and 4-bit values (whose decode needs heads of 32 or more)
    reach our kernels."""
    return _tiny_llama(tmp_path_factory, "head32", 2, 1, 32)


@pytest.fixture(scope="session")
def head64_model(tmp_path_factory):
    """A tiny random-weight Llama whose heads hold 64 values, 2 query heads per KV head: the smallest head the
    block-scaled CUDA decode (kernels/gqa_decode_block_scaled.cu) serves, so the engine reaches it."""
    return _tiny_llama(tmp_path_factory, "head64", 4, 2, 64)
