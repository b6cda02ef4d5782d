"""An MLA cache row (the latent and its RoPE part k_pe, written as `cache.update(latent, k_pe)`) in each kind of
format, as engines store it (harness/kv_paths/cache.py `latent_row_formats`): FP8 under a static scale quantises
both with one scale (vLLM's fp8 MLA cache); a block-scaled format quantises the latent and keeps k_pe in bf16
(vLLM's *_ds_mla, SGLang's DeepSeek caches); K and V apart: the row takes K's format. Bit-exact against the format's
own round trip."""

from __future__ import annotations

import pytest
import torch

from harness.kv_paths import formats as F
from harness.kv_paths.cache import build_cache, unit_scales
from harness.kv_paths.spec import parse_path
from harness.replay.route import decide


@pytest.fixture(scope="module")
def mla_config(tiny_models):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_models["mla"])


def _row(config, spec: str):
    """What the first MLA cache layer hands attention for a random latent [1, 1, 5, rank] and k_pe [1, 1, 5, rope]."""
    torch.manual_seed(0)
    latent = torch.randn(1, 1, 5, config.kv_lora_rank, dtype=torch.bfloat16)
    k_pe = torch.randn(1, 1, 5, config.qk_rope_head_dim, dtype=torch.bfloat16) * 8
    path = parse_path(spec)
    cache = build_cache(config, path, unit_scales(config) if path.has_static_scale else None)
    return latent, k_pe, cache.layers[0].update(latent, k_pe)


@pytest.mark.parametrize("spec, fmt", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("int4_per_token_head",
                                                                            "int4_per_token_head"),
                                       ("k=nvfp4/v=fp8_e4m3", "nvfp4")])
def test_block_scaled_latent_keeps_its_rope_part_in_bf16(mla_config, spec, fmt):
    latent, k_pe, (stored_latent, stored_k_pe) = _row(mla_config, spec)
    kv_format = F.get_format(fmt)
    assert torch.equal(stored_latent, kv_format.round_trip(latent, 1.0 if kv_format.has_static_scale else None)[0])
    assert torch.equal(stored_k_pe, k_pe)


@pytest.mark.parametrize("spec", ["fp8_e4m3", "k=fp8_e4m3/v=nvfp4"])
def test_fp8_latent_row_quantises_both_parts_in_k_s_format(mla_config, spec):
    latent, k_pe, (stored_latent, stored_k_pe) = _row(mla_config, spec)
    e4m3 = F.get_format("e4m3")
    assert torch.equal(stored_latent, e4m3.round_trip(latent, torch.tensor(1.0))[0])
    assert torch.equal(stored_k_pe, e4m3.round_trip(k_pe, torch.tensor(1.0))[0])


def test_the_route_says_how_the_latent_row_is_stored(mla_config):
    def written(spec: str) -> str:
        return decide(parse_path(spec), mla_config, "cpu", False).cache_write

    assert "the latent in nvfp4, its RoPE part (k_pe) in bf16" in written("nvfp4")
    assert "V's format nvfp4 unused (an MLA cache holds no V)" in written("k=fp8_e4m3/v=nvfp4")
    assert "MLA" not in written("fp8_e4m3:calibrated")


def test_gqa_keeps_k_and_v_in_their_own_formats(tiny_models):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_models["gqa"])
    layer = build_cache(config, parse_path("k=fp8_e4m3/v=nvfp4"), unit_scales(config)).layers[0]
    assert layer.k_format.name == "e4m3" and layer.v_format.name == "nvfp4"
