"""The block-scaled kernels under Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported): run by
tests/test_kernels_block_scaled.py in a subprocess (the interpreter is chosen when a kernel is defined, so it cannot
share a process with compiled kernels). Prints one JSON object: {case: null (passed) or what failed}.

Decode (plain Triton widening: the interpreter has no inline assembly) against the torch mirror; the fused write
against the formats' torch encode for the formats whose rounding is integer arithmetic (e2m1, int) and NVFP4 with
block scales the e4m3 cast holds exactly (the interpreter mis-rounds fp32 -> e4m3 casts; it also truncates fp32 ->
bf16 and reads the e4m3 NaN code as 480, hence fp16 inputs and no NaN in NVFP4's). The statistics' ratio is the
CUDA one (|x / scale| times the fp32 1 / max), which CPU torch computes by division.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from harness.kv_paths import block_layout  # noqa: E402
from harness.kv_paths import formats as kv_formats  # noqa: E402
from kernels import reference as ref  # noqa: E402

DECODE_FORMATS = ["nvfp4", "mxfp8", "mxfp4", "fp4_mx_block16", "fp8_per_token_head", "int8_per_token_head",
                  "int4_per_token_head"]
WRITE_FORMATS = ["nvfp4", "mxfp4", "fp4_mx_block16", "int8_per_token_head", "int4_per_token_head"]


def shuffled_pages(lengths: list[int], page: int) -> tuple[torch.Tensor, int]:
    """A block table whose rows own pages in shuffled order (two spare pages beside them), and the page count."""
    pages = [-(-n // page) for n in lengths]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks).int()
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    for b, p in enumerate(pages):
        table[b, :p] = order[sum(pages[:b]):sum(pages[:b]) + p]
    return table, num_blocks


def decode_case(fmt: str) -> None:
    from kernels.decode_attention_block_scaled import decode_attention_block_scaled

    layout = block_layout.of(kv_formats.get_format(fmt))
    head_dim, kv_heads, group, page, lengths = 32, 2, 3, 16, [1, 37, 20]   # odd group, 1-token and ragged rows
    table, num_blocks = shuffled_pages(lengths, page)
    scale = torch.tensor([0.02, 0.05]) if layout.static else None
    caches = []
    for _ in range(2):
        codes, blocks = layout.allocate(num_blocks, page, kv_heads, head_dim, "cpu")
        x = torch.randn(num_blocks * page, kv_heads, head_dim) * torch.logspace(-1, 1, head_dim)
        layout.store(x.bfloat16(), scale, codes, blocks, torch.arange(num_blocks * page))
        caches.append((codes, blocks))
    (kc, kb), (vc, vb) = caches
    q = torch.randn(len(lengths), kv_heads * group, head_dim).bfloat16()
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    args = (q, kc, vc, kb, vb, table, seq_lens, scale, scale, head_dim ** -0.5)
    out, lse = decode_attention_block_scaled(*args, num_splits=2, asm=False, **layout.kernel_args)
    want, want_lse = ref.decode_attention_block_scaled(*args, **layout.kernel_args)
    # one bf16 rounding each (the kernel: fp16 P, fp32 sums in its own order): at most 2 ulps of the output apart
    bound = 2 * 2.0 ** -8 * want.float().abs().amax(-1, keepdim=True)
    assert ((out.float() - want.float()).abs() <= bound).all(), f"out: max diff {(out.float() - want.float()).abs().max()}"
    assert torch.allclose(lse, want_lse, atol=1e-5, rtol=1e-5), f"lse: max diff {(lse - want_lse).abs().max()}"


MLA_FORMATS = ["nvfp4", "mxfp8", "mxfp4", "int4_per_token_head"]


def mla_case(fmt: str) -> None:
    """MLA over a block-scaled latent (kernels' mla_decode_block_scaled), 20 heads (head blocks of 10), latent 64 +
    rope 16, against the torch mirror, as decode_case."""
    from kernels.decode_attention_block_scaled import mla_decode_block_scaled

    layout = block_layout.of(kv_formats.get_format(fmt))
    latent_dim, rope_dim, heads, page, lengths = 64, 16, 20, 16, [1, 37, 20]
    table, num_blocks = shuffled_pages(lengths, page)
    scale = torch.tensor(0.03) if layout.static else None
    codes, blocks = layout.allocate(num_blocks, page, 1, latent_dim, "cpu")
    x = torch.randn(num_blocks * page, 1, latent_dim) * torch.logspace(-1, 1, latent_dim)
    layout.store(x.bfloat16(), scale, codes, blocks, torch.arange(num_blocks * page))
    k_pe = (torch.randn(num_blocks, page, rope_dim) * 4).bfloat16()
    q_latent = torch.randn(len(lengths), heads, latent_dim).bfloat16()
    q_pe = torch.randn(len(lengths), heads, rope_dim).bfloat16()
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    args = (q_latent, q_pe, codes, blocks, k_pe, table, seq_lens, scale, (latent_dim + rope_dim) ** -0.5)
    out, lse = mla_decode_block_scaled(*args, num_splits=2, asm=False, **layout.kernel_args)
    want, want_lse = ref.mla_decode_block_scaled(*args, **layout.kernel_args)
    bound = 2 * 2.0 ** -8 * want.float().abs().amax(-1, keepdim=True)   # as decode_case: 2 bf16 ulps of the output
    assert ((out.float() - want.float()).abs() <= bound).all(), f"out: max diff {(out.float() - want.float()).abs().max()}"
    assert torch.allclose(lse, want_lse, atol=1e-5, rtol=1e-5), f"lse: max diff {(lse - want_lse).abs().max()}"


def _write_input(fmt: str, layout, rows: int, heads: int, chunk: int, dim: int) -> torch.Tensor:
    x = torch.randn(rows, chunk, heads, dim) * torch.logspace(-2, 2, dim)
    if fmt == "nvfp4":   # each block's amax / 6 / s an e4m3 value (s a power of two): the cast is exact
        blocks = x.view(rows, chunk, heads, dim // 16, 16)
        amax = 6 * 0.5 * 2.0 ** torch.randint(-6, 6, blocks.shape[:-1]) * (1 + torch.randint(0, 8, blocks.shape[:-1]) / 8)
        blocks.copy_(torch.rand(blocks.shape) * 2 - 1).mul_(amax[..., None])
        blocks[..., 3] = amax * torch.where(torch.rand(amax.shape) < 0.5, -1.0, 1.0)
    else:
        x[0, 0, 0, :3] = torch.tensor([6e4, float("nan"), float("-inf")])
    return x.half().transpose(1, 2)                                       # [rows, heads, chunk, dim]


def write_case(fmt: str) -> None:
    from kernels.store_kv_block_scaled import ELEMENT_MAX, quantize_store_block_scaled

    kv_format = kv_formats.get_format(fmt)
    layout = block_layout.of(kv_format)
    rows, heads, chunk, dim, page = 2, 2, 5, 64, 16
    x = _write_input(fmt, layout, rows, heads, chunk, dim)
    scale = torch.tensor(0.5) if layout.static else None
    codes, blocks = layout.allocate(rows, page, heads, dim, "cpu")
    slots = (torch.arange(rows)[:, None] * page + torch.arange(chunk)).reshape(-1)
    counts, amax, live = torch.zeros(rows, 3, dtype=torch.int64), torch.zeros(rows), torch.arange(rows)
    out = quantize_store_block_scaled(x, scale, codes=codes, block_scales=blocks, slots=slots, page_size=page,
                                      counts=counts, amax=amax, live=live, **layout.write_args)
    encoded = kv_format.encode(x, scale)
    read_back = kv_format.decode(encoded, x.dtype)
    assert ((out == read_back) | (out.isnan() & read_back.isnan())).all(), "read-back"
    want_codes, want_blocks = layout.pages(encoded)
    assert torch.equal(codes.view(-1, heads, codes.shape[-1])[slots],
                       want_codes.transpose(1, 2).reshape(-1, heads, codes.shape[-1])), "codes"
    got = blocks.view(-1, heads, *blocks.shape[3:])[slots]
    want = want_blocks.transpose(1, 2).reshape(-1, heads, *want_blocks.shape[3:])
    assert ((got == want) | (got.isnan() & want.isnan())).all(), "block scales"
    inverse = torch.tensor(1.0) / torch.tensor(ELEMENT_MAX[layout.element])
    ratio = (x.float() / encoded.value_scale).abs() * inverse           # CUDA torch's `/ max`
    if layout.block_scale == "fp32":                                    # formats' clip_ratio: 4 ulps above is 1
        ratio = torch.where((ratio > 1) & (ratio <= 1 + 2.0 ** -21), torch.ones_like(ratio), ratio)
    finite = torch.nan_to_num(ratio, nan=0.0, posinf=0.0)
    for r in range(rows):
        want_counts = [x[r].numel(), int((ratio[r] > 1).sum()), int((~read_back[r].isfinite()).sum())]
        assert counts[r].tolist() == want_counts, f"row {r}: counts {counts[r].tolist()} != {want_counts}"
        assert amax[r].item() == finite[r].max().item(), f"row {r}: amax {amax[r].item()} != {finite[r].max().item()}"


def main() -> None:
    torch.manual_seed(0)
    cases = {f"decode-{f}": (decode_case, f) for f in DECODE_FORMATS}
    cases.update({f"write-{f}": (write_case, f) for f in WRITE_FORMATS})
    cases.update({f"mla-{f}": (mla_case, f) for f in MLA_FORMATS})
    wanted = sys.argv[1:] or list(cases)
    results = {}
    for name in wanted:
        function, fmt = cases[name]
        try:
            function(fmt)
            results[name] = None
        except Exception:  # noqa: BLE001 - every case reports, the test asserts
            results[name] = traceback.format_exc(limit=3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
