"""The block-scaled KV kernels on the CPU: the paged layout against the formats' torch decode (in process), and the
kernels themselves under Triton's interpreter (tests/block_scaled_interpreted.py, one subprocess for all cases:
~12 s of CPU). The GPU suite (tests/test_kernels_block_scaled_gpu.py) judges their error and their bits on CUDA.
"""

from __future__ import annotations

import re

import pytest
import torch

from harness.kv_paths import block_layout
from harness.kv_paths import formats as kv_formats
from interpreted import run_script
from kernels import reference as ref
SERVED = ["nvfp4", "nvfp4_4over6", "mxfp8", "mxfp4", "fp4_mx_block16", "fp8_per_token_head", "int8_per_token_head",
          "int4_per_token_head"]


@pytest.mark.parametrize("fmt", SERVED)
def test_paged_layout_decodes_as_the_format(fmt):
    """What the pages hold, read by the kernels' torch mirror, is the format's own decode, bit for bit."""
    kv_format = kv_formats.get_format(fmt)
    layout = block_layout.of(kv_format)
    x = torch.randn(7, 3, 64) * torch.logspace(-3, 3, 64)
    x[0, 0, :3] = torch.tensor([1e30, float("nan"), float("-inf")])
    scale = torch.tensor([0.5, 0.02, 3.0]) if layout.static else None
    encoded = kv_format.encode(x, None if scale is None else scale.view(-1, 1))
    codes, blocks = layout.pages(encoded)
    assert codes.dtype == torch.uint8 and codes.shape == (7, 3, layout.code_bytes(64))
    got = ref.dequantize_block_scaled(codes, blocks, scale, **layout.kernel_args)
    want = kv_format.decode(encoded)
    assert ((got == want) | (got.isnan() & want.isnan())).all()


@pytest.mark.parametrize("fmt, head_size, write, reason", [
    ("e4m3", None, False, "not block-scaled"),
    ("int8_per_token_head_asym", None, False, "zero point"),
    ("nvfp4", 80, False, "head size 80"),
    ("nvfp4_4over6", None, True, "2 candidate block scales"),
])
def test_unserved_formats_say_why(fmt, head_size, write, reason):
    why = block_layout.refusal(kv_formats.get_format(fmt), head_size, write)
    assert why is not None and reason in why, why
    assert block_layout.refusal(kv_formats.get_format("nvfp4"), 128) is None


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_script("block_scaled_interpreted.py")


CASES = [f"decode-{f}" for f in SERVED if f != "nvfp4_4over6"] + \
    [f"write-{f}" for f in ("nvfp4", "mxfp4", "fp4_mx_block16", "int8_per_token_head", "int4_per_token_head")] + \
    [f"mla-{f}" for f in ("nvfp4", "mxfp8", "mxfp4", "int4_per_token_head")]


@pytest.mark.parametrize("case", CASES)
def test_kernel_under_the_interpreter(interpreted, case):
    """Decode (GQA, and MLA over a block-scaled latent) within 2 bf16 ulps of the torch mirror (lse 1e-5); the fused
    write bit for bit against the encode."""
    assert case in interpreted, f"{case} did not run"
    assert interpreted[case] is None, interpreted[case]


@pytest.mark.parametrize("fmt, head_dim, group, page, why", [
    ("mxfp8", 256, 4, 16, "head sizes (64, 128)"),
    ("int8_per_token_head", 256, 4, 16, "head sizes (64, 128)"),
    ("nvfp4", 32, 4, 16, "head sizes (64, 128, 256)"),
    ("nvfp4", 128, 32, 16, "up to 16 query heads per KV head"),
    ("nvfp4", 256, 16, 16, "9-16 query heads per KV head at head sizes (64, 128)"),
    ("nvfp4", 128, 4, 8, "must lie in one page"),
])
def test_cuda_kernel_says_what_it_does_not_serve(fmt, head_dim, group, page, why):
    """The CUDA decode (kernels/gqa_decode_block_scaled.cu) refuses shapes it is not built for with the reason,
    before any device or compiler question, so the launcher runs the Triton kernel there (or, asked for
    impl="cuda", raises that reason). Every format's layout is one it reads (a scale it does not: below)."""
    from kernels.decode_attention_block_scaled import cuda_refusal

    layout = block_layout.of(kv_formats.get_format(fmt))
    codes, blocks = layout.allocate(4, page, 2, head_dim, "cpu")
    q = torch.zeros(1, 2 * group, head_dim, dtype=torch.bfloat16)
    args = layout.kernel_args
    assert why in cuda_refusal(q, codes, blocks, args["element"], args["block_scale"], args["block_size"])
    assert cuda_refusal(q, codes, blocks, args["element"], "e4m3", 32).startswith("it reads e4m3 scales per 16")


@pytest.mark.parametrize("fmt", SERVED)
def test_cuda_kernel_checks_every_layout_before_the_device(fmt):
    """Every served layout at a served shape passes the layout checks (alignment included) and is refused only for
    its CPU tensors; the same cache one slot off its alignment is refused for that. (The alignment check once divided
    by the block size 0 that callers pass for the per token-head layouts, which have no blocks: 13 GPU tests
    failed.)"""
    from kernels.decode_attention_block_scaled import cuda_refusal

    layout = block_layout.of(kv_formats.get_format(fmt))
    codes, blocks = layout.allocate(4, 16, 2, 128, "cpu")
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    args = layout.kernel_args
    refuse = lambda c, b: cuda_refusal(q, c, b, args["element"], args["block_scale"], args["block_size"])  # noqa: E731
    assert refuse(codes, blocks) == "it runs on CUDA tensors, got cpu ones"
    u8 = codes.view(torch.uint8)
    shifted = torch.as_strided(u8, (u8.shape[0] - 1, *u8.shape[1:]), u8.stride(), storage_offset=1)
    assert "byte runs of codes" in refuse(shifted.view(codes.dtype), blocks)


@pytest.mark.parametrize("kwargs, why", [
    (dict(), "runs on CUDA tensors, got cpu ones"), (dict(softcap=20.0), "soft-capping"),
    (dict(q_scale="dynamic"), "FP8 attention"), (dict(heads=32), "up to 16 query heads"),
    (dict(page=8), "must lie in one page"), (dict(dim=256), "head sizes (64, 128)")])
def test_plain_fp8_cache_asks_the_cuda_kernel_and_hears_why(monkeypatch, kwargs, why):
    """decode_attention over an e4m3 / e5m2 cache asks the CUDA kernel (kernels/gqa_decode_cuda.py, block scale
    "none") before the Triton kernel; impl="cuda" where it cannot serve raises the reason, shape before device."""
    from kernels.decode_attention import decode_attention
    from kernels.gqa_decode_cuda import cuda_serves

    assert cuda_serves("e4m3", "none", 128) and cuda_serves("e5m2", "none", 128)
    assert not cuda_serves("e5m2", "e8m0", 32) and not cuda_serves("int8", "none", 128)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    heads, page, dim = kwargs.pop("heads", 4), kwargs.pop("page", 16), kwargs.pop("dim", 128)
    cache = torch.zeros(4, page, 1, dim, dtype=torch.float8_e5m2)
    q = torch.zeros(1, heads, dim, dtype=torch.bfloat16)
    table, seq = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    scale = torch.tensor(1.0)
    with pytest.raises(ValueError, match=re.escape(why)):
        decode_attention(q, cache, cache, table, seq, scale, scale, 0.1, impl="cuda", **kwargs)


def test_cuda_kernel_asked_for_on_cpu_tensors_says_why(monkeypatch):
    """impl="cuda" under Triton's interpreter (CPU tensors) raises the reason instead of running the Triton kernel
    under the CUDA kernel's name."""
    from kernels.decode_attention_block_scaled import decode_attention_block_scaled

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layout = block_layout.of(kv_formats.get_format("nvfp4"))
    codes, blocks = layout.allocate(2, 16, 1, 64, "cpu")
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    table, seq = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="runs on CUDA tensors, got cpu ones"):
        decode_attention_block_scaled(q, codes, codes, blocks, blocks, table, seq, None, None, 0.125, impl="cuda",
                                      **layout.kernel_args)


@pytest.mark.parametrize(("fmt", "latent", "pe_row", "why"), [
    ("fp4_mx_block16", 512, 64, "it reads NVFP4 latents (e2m1 under e4m3 scales per 16), fp8_ds_mla's (e4m3 under "
                                "fp32 scales per 128) and MX ones (e2m1 / e4m3 under e8m0 scales per 32), got e2m1 / "
                                "e8m0 / 16"),
    ("mxfp4", 512, 64, "it runs on CUDA tensors, got cpu ones"),
    ("ds_mla_e4m3", 512, 64, "it runs on CUDA tensors, got cpu ones"),   # the layout served: refused by the device
    ("int4_per_token_head", 512, 64, "it reads NVFP4 latents"),
    ("nvfp4", 256, 64, "it is built for a latent of 512 and k_pe of 64, got 256 and 64"),
    ("nvfp4", 512, 68, "it copies whole rows"),                  # k_pe slots 136 bytes apart: not 16-byte units
    ("nvfp4", 512, 64, "it runs on CUDA tensors, got cpu ones")])
def test_mla_cuda_kernel_says_what_it_does_not_serve(monkeypatch, fmt, latent, pe_row, why):
    """MLA over a block-scaled latent with impl="cuda" (kernels/mla_decode_block_scaled.cu): the layout and the shapes
    are judged before the device, and each refusal names its reason instead of running another kernel."""
    from kernels.decode_attention_block_scaled import mla_decode_block_scaled

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layout = block_layout.of(kv_formats.get_format(fmt), mla=True)
    codes, blocks = layout.allocate(2, 16, 1, latent, "cpu")
    k_pe = torch.zeros(2, 16, pe_row, dtype=torch.bfloat16)[..., :64]
    q_latent, q_pe = torch.zeros(1, 16, latent, dtype=torch.bfloat16), torch.zeros(1, 16, 64, dtype=torch.bfloat16)
    table, seq = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    scale = torch.tensor(1.0) if layout.static else None
    with pytest.raises(ValueError, match=re.escape(why)):
        mla_decode_block_scaled(q_latent, q_pe, codes, blocks, k_pe, table, seq, scale, 0.1, impl="cuda",
                                **layout.kernel_args)
