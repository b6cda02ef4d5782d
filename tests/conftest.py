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


@pytest.fixture(scope="session")
def ds_latent_model(tmp_path_factory):
    """The mla canary's tiny DeepSeek-V3 with DeepSeek's latent shape (kv_lora_rank 512, RoPE 64) and 16 heads: the
    shape vLLM's fp8_ds_mla record takes and kernels/mla_decode_block_scaled.cu serves (a head block of 16)."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.canary.tiny_models import tiny_config
    from harness.canary.tokenizer import save_tokenizer

    out = tmp_path_factory.mktemp("ds-latent")
    canary = tiny_config("mla")   # its derived sizes (qk_head_dim, head_dim: RoPE's) set with the new ones
    config = type(canary)(**{**canary.to_dict(), "kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64,
                             "qk_head_dim": canary.qk_nope_head_dim + 64, "num_attention_heads": 16,
                             "num_key_value_heads": 16})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(str(out))
    save_tokenizer(out)
    return out
