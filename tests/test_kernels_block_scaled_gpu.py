"""GPU tests of the block-scaled KV kernels (run with --gpu): the paged decode over NVFP4, MXFP8, MXFP4, INT8 / INT4
and FP8 per token-head caches (kernels/decode_attention_block_scaled.py) and their fused cache write
(kernels/store_kv_block_scaled.py).

Decode is judged against fp64 attention over the stored values (the codes decoded by the torch reference), relative
to the error of the computation it replaces, "dequantise with the torch reference to bf16, then our BF16 decode
kernel": err_kernel <= 1.0 x err_dequantised + slack (the tolerances beside the cases say why), plus a magnitude
check beside it (a uniform scale error keeps every direction). The fused write is compared with the formats' torch
encode on the same GPU bit for bit (codes, block scales, read-back) and its statistics exactly.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from harness.kv_paths import block_layout
from harness.kv_paths import formats as kv_formats
from kernels import reference as ref

pytestmark = pytest.mark.gpu

FORMATS = ["nvfp4", "nvfp4_4over6", "mxfp8", "mxfp4", "fp4_mx_block16", "fp8_per_token_head", "int8_per_token_head",
           "int4_per_token_head"]
# (name, sequence lengths, head_dim, query heads per KV head, KV heads): odd batch with 1-token, sub-tile and ragged
# rows; one 8k sequence with 16 query heads per KV head; batch 8 up to 8k (a full 8192 among them); batch 32.
SHAPES = [
    pytest.param([1, 17, 1000, 4099, 5], 128, 4, 2, id="b5-odd-d128-g4"),
    pytest.param([8191], 64, 16, 1, id="b1-8k-d64-g16"),
    pytest.param([8192, 1, 3000, 77, 5000, 64, 4097, 129], 256, 1, 4, id="b8-d256-g1"),
    pytest.param([int(n) for n in torch.linspace(1, 2047, 32)], 128, 3, 2, id="b32-d128-g3"),
]
# err_kernel <= 1.0 x err_dequantised + SLACK x max |truth|. Both outputs are rounded to bf16 once; where the
# dequantised computation has no error beside that rounding (MX values and e4m3 P products are exact in bf16), which
# element rounds worst is chance: a quarter of the bf16 half-ulp bound (2^-9 of the largest output) absorbs that.
SLACK = 2.0 ** -11
MAGNITUDE_TOLERANCE = 2.0 ** -6   # |norm(out) / norm(truth) - 1| per row: bf16 output rounding is 2^-9 at most


@pytest.fixture(scope="module")
def kern():
    pytest.importorskip("triton")
    from kernels.decode_attention import decode_attention
    from kernels.decode_attention_block_scaled import decode_attention_block_scaled
    from kernels.store_kv_block_scaled import quantize_store_block_scaled

    return decode_attention, decode_attention_block_scaled, quantize_store_block_scaled


def _pages(lengths: list[int], page: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Shuffled pages: (block_table [B, max_pages] int32, the slot of each token of each sequence, num_blocks)."""
    pages = [-(-n // page) for n in lengths]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    slots = []
    for b, (n, p) in enumerate(zip(lengths, pages)):
        table[b, :p] = order[sum(pages[:b]):sum(pages[:b]) + p].int()
        t = torch.arange(n)
        slots.append(table[b, t // page].long() * page + t % page)
    return table.cuda(), torch.cat(slots).cuda(), num_blocks


def _case(fmt: str, lengths: list[int], head_dim: int, group: int, kv_heads: int, page: int = 16):
    """Random K/V encoded by the format's torch encode on the GPU into paged caches, and q."""
    layout = block_layout.of(kv_formats.get_format(fmt))
    table, slots, num_blocks = _pages(lengths, page)
    total = sum(lengths)
    # heads differ 10x, channels 100x (outlier channels), a few tokens 30x: block scales matter
    magnitude = torch.logspace(0, 1, kv_heads)[:, None] * torch.logspace(-1, 1, head_dim)[torch.randperm(head_dim)]
    caches, scales = [], None
    if layout.static:
        scales = torch.rand(kv_heads, device="cuda") * 0.02 + 0.005
    for _ in range(2):
        x = torch.randn(total, kv_heads, head_dim, device="cuda") * magnitude.cuda()
        x[torch.randint(0, total, (max(1, total // 100),))] *= 30
        codes, block_scales = layout.allocate(num_blocks, page, kv_heads, head_dim, "cuda")
        layout.store(x.bfloat16(), scales, codes, block_scales, slots)
        caches.append((codes, block_scales))
    q = torch.randn(len(lengths), kv_heads * group, head_dim, device="cuda", dtype=torch.bfloat16)
    return layout, table, torch.tensor(lengths, dtype=torch.int32, device="cuda"), caches, scales, q


def _truth(layout, caches, scales, q, table, seq_lens):
    """fp64 attention over the stored values (out [B, Hq, D] fp64, lse [B, Hq]) and the dequantised bf16 caches."""
    dense = [ref.dequantize_block_scaled(c, s, scales, **layout.kernel_args) for c, s in caches]   # fp32 values
    group = q.shape[1] // dense[0].shape[2]
    outs, lses = [], []
    for b, n in enumerate(seq_lens.tolist()):
        rows = [d.view(-1, *d.shape[2:])[(table[b, :-(-n // d.shape[1])].long()[:, None] * d.shape[1]
                                          + torch.arange(d.shape[1], device="cuda")).reshape(-1)[:n]].double()
                for d in dense]
        k, v = (r.repeat_interleave(group, 1) for r in rows)                                   # [n, Hq, D]
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * q.shape[-1] ** -0.5
        outs.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v))
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses), [d.bfloat16() for d in dense]


def _assert_magnitude(out: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    """Per (sequence, head) row: |out| / |truth| within 2^-6 of 1, and cosine >= 1 - 2^-10."""
    o, t = out.double().flatten(0, 1), truth.flatten(0, 1)
    ratio = o.norm(dim=-1) / t.norm(dim=-1)
    cosine = torch.nn.functional.cosine_similarity(o, t, dim=-1)
    worst = int((ratio - 1).abs().argmax())
    assert (ratio - 1).abs().max() <= MAGNITUDE_TOLERANCE, f"{what}: row {worst} norm ratio {ratio[worst]:.6f}"
    assert cosine.min() >= 1 - 2.0 ** -10, f"{what}: cosine {cosine.min():.6f}"


# the CUDA kernel (kernels/gqa_decode_block_scaled.cu): its own cases beside SHAPES' (8 query heads a KV head, pages
# of 32, 12 and 16 at head 128: the second accumulator, G16)
CUDA_SHAPES = [pytest.param([3, 2049, 700], 64, 8, 2, 16, id="b3-d64-g8"),
               pytest.param([33, 1000], 128, 2, 3, 32, id="b2-d128-g2-page32"),
               pytest.param([17, 4099, 300], 128, 12, 2, 16, id="b3-d128-g12"),
               pytest.param([1000, 5], 128, 16, 1, 16, id="b2-d128-g16")]


@pytest.mark.parametrize("impl", ["asm", "plain", "cuda"])
@pytest.mark.parametrize("lengths, head_dim, group, kv_heads, page", [
    *(pytest.param(*p.values, 16, id=p.id) for p in SHAPES), *CUDA_SHAPES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_within_dequantised_bf16_error(kern, fmt, lengths, head_dim, group, kv_heads, page, impl):
    """asm / plain: the Triton kernel with the PTX or the plain widening; cuda: the CUDA kernel where it serves the
    case (<= 16 query heads per KV head; head 256 for NVFP4 and INT4 alone), explicitly, so a refusal cannot pass as
    the Triton kernel."""
    from kernels.decode_attention_block_scaled import cuda_refusal
    decode_bf16, decode_block_scaled, _ = kern
    layout, table, seq_lens, caches, scales, q = _case(fmt, lengths, head_dim, group, kv_heads, page)
    (k_codes, k_blocks), (v_codes, v_blocks) = caches
    args = layout.kernel_args
    if impl == "cuda":
        why = cuda_refusal(q, k_codes, k_blocks, args["element"], args["block_scale"], args["block_size"])
        if why:
            pytest.skip(f"the CUDA kernel does not serve this case: {why}")
        options = dict(impl="cuda")
    else:
        options = dict(impl="triton", asm=impl == "asm")
    out, lse = decode_block_scaled(q, k_codes, v_codes, k_blocks, v_blocks, table, seq_lens, scales, scales,
                                   head_dim ** -0.5, **options, **args)
    truth, truth_lse, (k_bf16, v_bf16) = _truth(layout, caches, scales, q, table, seq_lens)
    dequantised = decode_bf16(q, k_bf16, v_bf16, table, seq_lens, None, None, head_dim ** -0.5)[0]
    err = (out.double() - truth).abs().max().item()
    err_dequantised = (dequantised.double() - truth).abs().max().item()
    slack = SLACK * truth.abs().max().item()
    assert math.isfinite(err) and err <= err_dequantised + slack, \
        f"{fmt}: kernel max error {err:.3g} > dequantise-then-bf16's {err_dequantised:.3g} + {slack:.2g}"
    _assert_magnitude(out, truth, fmt)
    torch.testing.assert_close(lse.double(), truth_lse, atol=1e-3, rtol=1e-4)   # fp32 scores against fp64


def _cuda_call(kern, lengths, head_dim=128, group=4, kv_heads=2, fmt="nvfp4", **options):
    """A case of `fmt` and a call of the CUDA kernel on it: (the case's parts, call(**more) -> (out, lse))."""
    _, decode_block_scaled, _ = kern
    layout, table, seq_lens, caches, scales, q = _case(fmt, lengths, head_dim, group, kv_heads)
    (k_codes, k_blocks), (v_codes, v_blocks) = caches

    def call(**more):
        return decode_block_scaled(q, k_codes, v_codes, k_blocks, v_blocks, table, seq_lens, scales, scales,
                                   head_dim ** -0.5, **dict(options, **more), **layout.kernel_args)
    return (layout, table, seq_lens, caches, scales, q), call


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_per_token_head", "mxfp8", "mxfp4"])
def test_cuda_kernel_nan_stays_in_its_sequence_and_stale_slots_add_nothing(kern, fmt):
    """A NaN V scale inside sequence 1 makes exactly sequence 1's outputs NaN; NaN scales and codes in the slots
    past every sequence's end (their last, partly filled tiles) change nothing: those tokens' P is 0 and their V
    codes and scales are zeroed before P . V, since 0 x NaN would not be 0."""
    (layout, table, seq_lens, caches, _, _), call = _cuda_call(kern, [700, 300, 129], fmt=fmt, impl="cuda")
    (k_codes, k_blocks), (v_codes, v_blocks) = caches
    # per token-head fp32, e8m0 bits (255) or e4m3 bits (0x7F)
    nan = float("nan") if k_blocks.dtype == torch.float32 else 255 if layout.block_scale == "e8m0" else 0x7F
    clean = call()[0]
    for b, n in enumerate(seq_lens.tolist()):   # the rest of each sequence's last page
        page = int(table[b, (n - 1) // 16])
        k_blocks[page, n % 16 or 16:] = nan
        v_blocks[page, n % 16 or 16:] = nan
        v_codes[page, n % 16 or 16:] = 0xFF
    assert torch.equal(call()[0], clean), "stale slots past a sequence's end changed its output"
    page = int(table[1, 250 // 16])
    v_blocks[page, 250 % 16, 0] = nan                     # V of token 250 of sequence 1, KV head 0
    out = call()[0]
    assert out[1, :4].isnan().any(dim=-1).all(), "the NaN scale did not reach its KV head's query heads"
    assert out[0].isfinite().all() and out[2].isfinite().all(), "the NaN scale leaked into another sequence"


def test_cuda_kernel_repeats_and_replays_in_a_cuda_graph(kern):
    """The same bits eagerly, again, and from a CUDA graph's replays (the harness replays its decode steps); an
    empty sequence gets out 0 and lse -inf."""
    from kernels.tune import capture
    _, call = _cuda_call(kern, [4099, 1, 300, 0, 128], impl="cuda")
    first, again = call(), call()
    graph, replayed = capture(call)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for got in (again, replayed):
            assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]), "a launch differs from the first"
    assert first[1][3].isneginf().all() and (first[0][3] == 0).all(), "an empty sequence: out 0, lse -inf"


def test_cuda_kernel_that_does_not_build_falls_back_to_the_triton_kernel(kern, monkeypatch):
    """NVRTC refusing the kernel: the entry's impl="cuda" warns once and runs the Triton kernel (the same bound);
    an explicit impl="cuda" raises with the reason."""
    from kernels import gqa_decode_cuda, nvrtc

    def refuse(*args, **kwargs):
        raise RuntimeError("NVRTC could not compile gqa_block_scaled_decode (test)")

    monkeypatch.setattr(nvrtc, "BUILD_FAILURES", {})
    gqa_decode_cuda.warn_fallback.cache_clear()   # it warns once per launcher, reason and process
    monkeypatch.setattr(nvrtc, "compile_kernel", refuse)
    (layout, table, seq_lens, caches, scales, q), call = _cuda_call(kern, [300, 17, 1])
    with pytest.warns(RuntimeWarning, match="did not build here"):
        out, _ = call()
    assert torch.equal(out, call(impl="triton")[0]), "the fallback is not the Triton kernel"
    with pytest.raises(ValueError, match="could not compile"):
        call(impl="cuda")


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "nvfp4_4over6"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_head"])
@pytest.mark.parametrize("chunk", [1, 37, 300])  # 300: several programs a row and a partial one
def test_fused_write_equals_torch_encode(kern, fmt, granularity, chunk):
    """Codes, block scales and read-back bit for bit, the statistics exactly, against the torch encode on this GPU;
    bf16 input with outliers, NaN and inf, a strided view (as transformers hands K/V to the cache), left padding."""
    _, _, write = kern
    kv_format = kv_formats.get_format(fmt)
    layout = block_layout.of(kv_format)
    if granularity == "per_head" and not layout.static:
        pytest.skip(f"{fmt} has no static scale")
    rows, heads, dim, page = 3, 4, 64, 16
    g = torch.Generator(device="cuda").manual_seed(chunk)
    x = torch.randn(rows, chunk, heads, dim, device="cuda", generator=g) * torch.logspace(-2, 2, dim, device="cuda")
    x[0, 0, 0, :3] = torch.tensor([1e5, float("nan"), float("-inf")])
    x[-1, -1, -1, 0] = 470.0
    x = x.to(torch.bfloat16).transpose(1, 2)                                       # [rows, heads, chunk, dim]
    scale = None
    if layout.static:
        scale = torch.tensor(0.3, device="cuda") if granularity == "per_tensor" else \
            torch.tensor([0.5, 0.02, 1.0, 0.125], device="cuda")
    valid = torch.ones(rows, chunk + 3, dtype=torch.long, device="cuda")[:, 3:]
    valid[1, : max(1, chunk // 2)] = 0
    live = torch.tensor([4, 0, 2], device="cuda")
    counts = torch.zeros(5, 3, dtype=torch.int64, device="cuda")
    amax = torch.zeros(5, device="cuda")
    pages_per_row = -(-chunk // page)
    codes, blocks = layout.allocate(rows * pages_per_row, page, heads, dim, "cuda")
    codes.fill_(0xAB)
    slots = torch.arange(rows, device="cuda")[:, None] * pages_per_row * page + torch.arange(chunk, device="cuda")
    slots = torch.where(valid.bool(), slots, -1).reshape(-1)
    out = torch.full(x.shape, -7777.0, dtype=x.dtype, device="cuda")
    write(x, scale, out=out, codes=codes, block_scales=blocks, slots=slots, page_size=page, counts=counts, amax=amax,
          live=live, valid=valid, **layout.write_args)
    static = None if scale is None else (scale.view(-1, 1, 1) if scale.dim() else scale)
    encoded = kv_format.encode(x, static)
    read_back, ratio = kv_format.decode(encoded, x.dtype), kv_format.clip_ratio(x, encoded)
    same = (out == read_back) | (out.isnan() & read_back.isnan())
    assert same.all(), f"{fmt}: read-back differs at {(~same).nonzero()[:5].tolist()}"
    want_codes, want_blocks = layout.pages(encoded)                                # [rows, heads, chunk, ...]
    flat = slots >= 0
    got_codes = codes.view(-1, heads, codes.shape[-1])[slots[flat]]
    assert torch.equal(got_codes, want_codes.transpose(1, 2).reshape(-1, heads, codes.shape[-1])[flat]), f"{fmt}: codes"
    got_blocks = blocks.view(-1, heads, *blocks.shape[3:])[slots[flat]]
    want = want_blocks.transpose(1, 2).reshape(-1, heads, *want_blocks.shape[3:])[flat]
    if layout.block_scale == "fp32":   # NaN's payload bits are the GPU's division's, not part of the format
        assert ((got_blocks == want) | (got_blocks.isnan() & want.isnan())).all(), f"{fmt}: block scales"
    else:
        assert torch.equal(got_blocks, want.contiguous()), f"{fmt}: block scales"
    # statistics, as KVWriteStats.count computes them from the torch round trip
    real = valid.bool()[:, None, :, None].expand(x.shape)
    finite = torch.where(real, torch.nan_to_num(ratio.float(), nan=0.0, posinf=0.0), 0.0)
    for i, row in enumerate(live.tolist()):
        want_counts = [int(real[i].sum()), int(((ratio[i] > 1) & real[i]).sum()),
                       int((~read_back[i].isfinite() & real[i]).sum())]
        assert counts[row].tolist() == want_counts, f"{fmt} row {i}: counts {counts[row].tolist()} != {want_counts}"
        assert amax[row].item() == finite[i].max().item(), f"{fmt} row {i}: amax"


# ds_mla_e4m3: fp8_ds_mla's latent in vLLM's byte record (the engine's pages); ":apart": in three tensors;
# ds_mla_nvfp4: nvfp4_ds_mla's latent (NVFP4's values, written with its scales rounded up, no static scale)
MLA_FORMATS = ["nvfp4", "mxfp8", "mxfp4", "int4_per_token_head", "ds_mla_e4m3", "ds_mla_e4m3:apart", "ds_mla_nvfp4"]
# kernels/mla_decode_block_scaled.cu
MLA_CUDA_FORMATS = ("nvfp4", "ds_mla_e4m3", "ds_mla_e4m3:apart", "ds_mla_nvfp4", "mxfp8", "mxfp4")


def _mla_case(fmt, heads, lengths, page=16, q_dtype=torch.bfloat16, token_scale=None):
    """A paged block-scaled latent (512) with k_pe (64) beside it in q's type (as the engine allocates them:
    `allocate_latent_rows`, or three tensors for ":apart"), and the query; token_scale [tokens]: each token's latent
    times it."""
    name, _, apart = fmt.partition(":")
    layout = block_layout.of(kv_formats.get_format(name), mla=True)
    latent_dim, rope_dim = 512, 64
    table, slots, num_blocks = _pages(lengths, page)
    total = sum(lengths)
    scale = torch.tensor(0.01, device="cuda") if layout.static else None
    x = torch.randn(total, 1, latent_dim, device="cuda") * torch.logspace(-1, 1, latent_dim, device="cuda")
    if token_scale is not None:
        x = x * token_scale.to("cuda")[:, None, None]
    if apart:
        codes, block_scales = layout.allocate(num_blocks, page, 1, latent_dim, "cuda")
        k_pe = torch.zeros(num_blocks, page, rope_dim, device="cuda", dtype=q_dtype)
    else:
        codes, block_scales, k_pe = layout.allocate_latent_rows(num_blocks, page, latent_dim,
                                                                torch.empty(0, rope_dim, dtype=q_dtype, device="cuda"))
    layout.store(x.bfloat16(), scale, codes, block_scales, slots)   # the model's K/V: bf16 whatever q's type
    k_pe.view(-1, rope_dim)[slots] = (torch.randn(total, rope_dim, device="cuda") * 4).to(q_dtype)
    q_latent = (torch.randn(len(lengths), heads, latent_dim, device="cuda") * 0.5).to(q_dtype)
    q_pe = (torch.randn(len(lengths), heads, rope_dim, device="cuda") * 0.5).to(q_dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return SimpleNamespace(layout=layout, table=table, scale=scale, codes=codes, block_scales=block_scales, k_pe=k_pe,
                           q_latent=q_latent, q_pe=q_pe, seq_lens=seq_lens, sm_scale=(latent_dim + rope_dim) ** -0.5)


def _run_mla(case, **kwargs):
    from kernels.decode_attention_block_scaled import mla_decode_block_scaled

    return mla_decode_block_scaled(case.q_latent, case.q_pe, case.codes, case.block_scales, case.k_pe, case.table,
                                   case.seq_lens, case.scale, case.sm_scale, **case.layout.kernel_args, **kwargs)


@pytest.mark.parametrize("fmt", MLA_FORMATS)
@pytest.mark.parametrize("heads", [16, 20, 128])   # 20: head blocks of 10 (CUDA: 16 and 4); 128: eight of 16
@pytest.mark.parametrize(("impl", "q_dtype"), [("triton", torch.bfloat16), ("cuda", torch.bfloat16),
                                               ("cuda", torch.float16)])
def test_mla_decode_over_a_block_scaled_latent_within_dequantised_bf16_error(fmt, heads, impl, q_dtype):
    """MLA (latent 512 + RoPE 64) over a block-scaled latent and a 16-bit k_pe, against fp64 over the stored values,
    relative to "dequantise the latent to q's type, then our BF16 MLA kernel" (kernels/mla_decode.py), as the GQA
    cases (SLACK and the magnitude check beside). impl="cuda" serves NVFP4 and fp8_ds_mla (kernels/
    mla_decode_block_scaled.cu) and names why it does not serve the rest; the Triton kernel refuses fp8_ds_mla's fp32
    scales per 128 values, saying so."""
    from kernels.mla_decode import mla_decode

    case = _mla_case(fmt, heads, [1, 17, 1000, 4099, 5], q_dtype=q_dtype)
    if impl == "cuda" and fmt not in MLA_CUDA_FORMATS:
        with pytest.raises(ValueError, match="it reads NVFP4 latents"):
            _run_mla(case, impl="cuda")
        return
    if impl == "triton" and fmt.startswith("ds_mla_e4m3"):
        with pytest.raises(AssertionError, match="reads one fp32 scale per token, not one per 128 values"):
            _run_mla(case, impl="triton")
        return
    out, lse = _run_mla(case, impl=impl)
    lengths, page, table = case.seq_lens.tolist(), case.codes.shape[1], case.table
    latent = ref.dequantize_block_scaled(case.codes, case.block_scales, case.scale, **case.layout.kernel_args)[:, :, 0]
    cache = torch.cat([latent, case.k_pe.float()], -1)                               # [num_blocks, page, 576], fp32
    dequantised = mla_decode(case.q_latent, case.q_pe, cache.to(q_dtype), table, case.seq_lens, None, case.sm_scale)[0]
    truths, truth_lses = [], []
    for b, n in enumerate(lengths):
        rows = cache.view(-1, cache.shape[-1])[(table[b, :-(-n // page)].long()[:, None] * page
                                                + torch.arange(page, device="cuda")).reshape(-1)[:n]].double()
        s = (torch.cat([case.q_latent[b], case.q_pe[b]], -1).double() @ rows.T) * case.sm_scale
        truths.append(torch.softmax(s, -1) @ rows[:, :latent.shape[-1]])
        truth_lses.append(torch.logsumexp(s, -1))
    truth, truth_lse = torch.stack(truths), torch.stack(truth_lses)
    err = (out.double() - truth).abs().max().item()
    err_dequantised = (dequantised.double() - truth).abs().max().item()
    what = f"mla {fmt} heads={heads} impl={impl} {q_dtype}"
    assert math.isfinite(err) and err <= err_dequantised + SLACK * truth.abs().max().item(), \
        f"{what}: max error {err:.3g} against the dequantised BF16 kernel's {err_dequantised:.3g}"
    _assert_magnitude(out, truth, what)
    assert (lse.double() - truth_lse).abs().max().item() <= 1e-3, f"{what}: lse"   # fp32 scores against fp64


def test_mla_cuda_kernel_keeps_a_nan_tile_scale_in_its_sequence():
    """fp8_ds_mla through the MLA CUDA kernel: a NaN tile scale on one token of sequence 2 (inside its length) makes
    that sequence's output and lse NaN (its score and its P are NaN: never a finite number from a broken cache) and
    leaves every other sequence's bits as they were."""
    case = _mla_case("ds_mla_e4m3", 16, [17, 300, 40, 5])
    out, lse = _run_mla(case, impl="cuda")
    page = case.codes.shape[1]
    token = 33   # sequence 2's token 33 of 40
    slot = int(case.table[2, token // page]) * page + token % page
    case.block_scales.view(-1, case.block_scales.shape[-1])[slot, 1] = float("nan")
    broken, broken_lse = _run_mla(case, impl="cuda")
    assert broken[2].isnan().all() and broken_lse[2].isnan().all()
    keep = [0, 1, 3]
    assert torch.equal(broken[keep], out[keep]) and torch.equal(broken_lse[keep], lse[keep])


@pytest.mark.parametrize("fmt", ["nvfp4", "ds_mla_nvfp4", "ds_mla_e4m3", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize(("heads", "q_dtype"), [(16, torch.bfloat16), (20, torch.bfloat16), (128, torch.float16)])
@pytest.mark.parametrize("reg_t", [False, True])
def test_mla_latent_split_kernel_answers_as_the_tile_kernel(fmt, page, heads, q_dtype, reg_t):
    """kernels/mla_decode_latent_split.cu, the entry for NVFP4, MX and fp8_ds_mla records (the engine's pages): the
    definition of kernels/mla_decode_block_scaled.cu (q rounded to fp16, values widened exactly, P rounded to fp16;
    fp8_ds_mla's tile scales and MX's token exponents out of the MMAs, P times each warp's scale ratio, here in a
    second fp16 rounding; MX's exponents are each warp's 4 blocks' largest, not the token's 16), its
    scores summed in another order (four partials of 128 columns, fp32) and P taken against a running maximum that
    may lag the scores (P <= 2^8, the next test). So its output lies within 2^-8 of the largest true
    value of the tile kernel's (bf16 output rounding alone is 2^-9 relative; measured 2^-11.8 on an H200, and a
    misplaced widened matrix read 190-700x the error) and both within 1e-3 of fp64's lse: ragged sequences (empty, one
    token, partial tiles, several splits) over shuffled pages of 1, 16 and 64 rows; both builds (REG_T: P . C's
    fragments kept in registers), whose bits must agree (the entry takes either by the grid); and the error bound of
    the format tests above."""
    from kernels import mla_block_scaled_cuda

    case = _mla_case(fmt, heads, [1, 0, 31, 33, 1000, 4099], page=page, q_dtype=q_dtype)
    assert mla_block_scaled_cuda.latent_split_refusal(case.codes, case.block_scales, case.k_pe,
                                                      tuple(case.layout.kernel_args.values())) is None
    args = (case.q_latent, case.q_pe, case.codes, case.block_scales, case.k_pe, case.table, case.seq_lens,
            case.scale, case.sm_scale, None, tuple(case.layout.kernel_args.values()))
    out, lse = mla_block_scaled_cuda.decode(*args, latent_split=True, reg_t=reg_t)
    tile, tile_lse = mla_block_scaled_cuda.decode(*args, latent_split=False)
    entry, entry_lse = _run_mla(case, impl="cuda")
    assert torch.equal(entry, out) and torch.equal(entry_lse, lse), "the entry runs the latent-split kernel's bits"
    assert out[1].eq(0).all() and lse[1].eq(float("-inf")).all(), "an empty sequence: 0 and lse -inf"
    _assert_latent_split_answers_as_the_tile_kernel(case, out, lse, tile, tile_lse, [0, 2, 3, 4, 5],
                                                    f"{fmt} page {page}")


def _assert_latent_split_answers_as_the_tile_kernel(case, out, lse, tile, tile_lse, real, what):
    """Sequences `real` of the latent-split kernel's output within 2^-8 of the largest true value of the tile
    kernel's, both lse within 1e-3 of fp64's, and the magnitude check (the tolerances' reasons: the test above)."""
    page = case.codes.shape[1]
    latent = ref.dequantize_block_scaled(case.codes, case.block_scales, case.scale, **case.layout.kernel_args)[:, :, 0]
    cache = torch.cat([latent, case.k_pe.float()], -1)
    top = 0.0
    for b in real:
        n = int(case.seq_lens[b])
        rows = cache.view(-1, cache.shape[-1])[(case.table[b, :-(-n // page)].long()[:, None] * page
                                                + torch.arange(page, device="cuda")).reshape(-1)[:n]].double()
        s = (torch.cat([case.q_latent[b], case.q_pe[b]], -1).double() @ rows.T) * case.sm_scale
        truth = torch.softmax(s, -1) @ rows[:, :latent.shape[-1]]
        top = max(top, truth.abs().max().item())
        for name, got in (("latent split", lse), ("tile", tile_lse)):
            assert (got[b].double() - torch.logsumexp(s, -1)).abs().max().item() <= 1e-3, f"{name} lse, row {b}"
        _assert_magnitude(out[b:b + 1], truth[None], f"latent split {what} row {b}")
    gap = (out[real].double() - tile[real].double()).abs().max().item()
    assert math.isfinite(gap) and gap <= 2.0 ** -8 * top, f"{what}: {gap:.3g} from the tile kernel"


@pytest.mark.parametrize("fmt", ["nvfp4", "ds_mla_e4m3", "mxfp4"])
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("reg_t", [False, True])
def test_mla_latent_split_kernel_moves_its_lazy_maximum(fmt, splits, reg_t):
    """The latent-split kernel's running maximum m is lazy: P is taken against the m every warp holds, and m moves
    only at a split's first tile and at a tile with a score more than 8 (base 2) above it. Keys placed mid-sequence
    (after the first tile) with k_pe = q_pe times 8-40 score ~8-38 base-2 units above the others' mean (their
    standard deviation is ~2.4), so some must move m and some may not: a missed move leaves P up to ~2^30 in fp16
    (inf past 2^16), a move without the accumulators' rescale mixes units. One split (every key after the first
    tile) and the planned splits; tolerances as the test above (the tile kernel moves m every tile)."""
    from kernels import mla_block_scaled_cuda

    case = _mla_case(fmt, 16, [3000, 700])
    pe, page = case.k_pe.view(-1, case.k_pe.shape[-1]), case.codes.shape[1]
    for b, token, head, factor in ((0, 40, 3, 20.0), (0, 1500, 3, 40.0), (0, 2900, 9, 30.0), (1, 500, 0, 8.0)):
        pe[int(case.table[b, token // page]) * page + token % page] = (case.q_pe[b, head].float() * factor).to(pe.dtype)
    args = (case.q_latent, case.q_pe, case.codes, case.block_scales, case.k_pe, case.table, case.seq_lens,
            case.scale, case.sm_scale, splits, tuple(case.layout.kernel_args.values()))
    out, lse = mla_block_scaled_cuda.decode(*args, latent_split=True, reg_t=reg_t)
    tile, tile_lse = mla_block_scaled_cuda.decode(*args, latent_split=False)
    assert out.isfinite().all() and lse.isfinite().all()
    _assert_latent_split_answers_as_the_tile_kernel(case, out, lse, tile, tile_lse, [0, 1],
                                                    f"{fmt}, {splits} splits")


@pytest.mark.parametrize("fmt", ["ds_mla_e4m3", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("reg_t", [False, True])
def test_mla_latent_split_kernel_rescales_its_scale_units(fmt, splits, reg_t):
    """fp8_ds_mla and MX through the latent-split kernel: each warp keeps its P . C accumulator in units of S_w, the
    largest scale of its 128 columns so far (fp8_ds_mla's tile scale; MX's 2^(E - 127), E the largest exponent of
    its 4 blocks), and rescales it when a later tile's is larger; P takes scale / S_w. Each
    token's latent times 10^u, u uniform in [-3, 1] (so S_w grows at some tiles, and P's factor reaches ~1e-4),
    sequence 1 with its largest token first (S_w never grows after the first tile); one split and the planned ones.
    A missed rescale mixes units (errors of the order of the output); tolerances as the tests above."""
    from kernels import mla_block_scaled_cuda

    lengths = [3000, 700, 65]
    gen = torch.Generator().manual_seed(5)
    token_scale = 10.0 ** (torch.rand(sum(lengths), generator=gen) * 4 - 3)
    token_scale[lengths[0]] = 30.0
    case = _mla_case(fmt, 16, lengths, token_scale=token_scale)
    args = (case.q_latent, case.q_pe, case.codes, case.block_scales, case.k_pe, case.table, case.seq_lens,
            case.scale, case.sm_scale, splits, tuple(case.layout.kernel_args.values()))
    out, lse = mla_block_scaled_cuda.decode(*args, latent_split=True, reg_t=reg_t)
    tile, tile_lse = mla_block_scaled_cuda.decode(*args, latent_split=False)
    assert out.isfinite().all() and lse.isfinite().all()
    _assert_latent_split_answers_as_the_tile_kernel(case, out, lse, tile, tile_lse, [0, 1, 2],
                                                    f"{fmt}, {splits} splits")


@pytest.mark.parametrize(("fmt", "nan"), [("nvfp4", 0x7F), ("mxfp4", 0xFF), ("mxfp8", 0xFF)])
def test_mla_latent_split_kernel_keeps_a_nan_block_scale_in_its_sequence(fmt, nan):
    """NVFP4 and MX records through the latent-split kernel: a NaN block scale (e4m3 0x7F, e8m0 0xFF) on one token
    inside sequence 2 makes that sequence's output and lse NaN and leaves every other sequence's bits; NaN scales in
    the stale slots past each sequence's end change no bit (they are zeroed in shared memory, not masked after the
    product)."""
    case = _mla_case(fmt, 16, [17, 300, 40, 5])
    out, lse = _run_mla(case, impl="cuda")
    page = case.codes.shape[1]
    scales = case.block_scales.view(-1, case.block_scales.shape[-1]).view(torch.uint8)
    for b, n in enumerate(case.seq_lens.tolist()):
        last = int(case.table[b, (n - 1) // page])
        scales[last * page + n % page if n % page else (last + 1) * page:(last + 1) * page] = nan
    again, again_lse = _run_mla(case, impl="cuda")
    assert torch.equal(again, out) and torch.equal(again_lse, lse)
    token = 33
    scales[int(case.table[2, token // page]) * page + token % page, 5] = nan
    broken, broken_lse = _run_mla(case, impl="cuda")
    assert broken[2].isnan().all() and broken_lse[2].isnan().all()
    keep = [0, 1, 3]
    assert torch.equal(broken[keep], out[keep]) and torch.equal(broken_lse[keep], lse[keep])


@pytest.mark.parametrize("fmt", MLA_CUDA_FORMATS)
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_mla_cuda_kernel_reads_nothing_past_a_sequence_and_replays_in_a_cuda_graph(fmt, splits):
    """The MLA CUDA kernel: NaN block scales in the stale slots past each sequence's end (its last page's rest)
    change no output bit, at one split, three, or the planned count; and a captured launch replays to the eager
    launch's bits."""
    case = _mla_case(fmt, 16, [17, 1, 40, 300])
    out, lse = _run_mla(case, impl="cuda", num_splits=splits)
    assert out.isfinite().all() and lse.isfinite().all()
    stale = case.block_scales.view(-1, case.block_scales.shape[-1])
    stale = stale if stale.dtype == torch.float32 else stale.view(torch.uint8)
    page = case.codes.shape[1]
    for b, n in enumerate(case.seq_lens.tolist()):
        last = int(case.table[b, (n - 1) // page])
        # fp32 NaN, e8m0 bits 0xFF and e4m3 bits 0x7F
        stale[last * page + n % page if n % page else last * page + page:(last + 1) * page] = \
            float("nan") if stale.dtype == torch.float32 else 0xFF if case.layout.block_scale == "e8m0" else 0x7F
    again, again_lse = _run_mla(case, impl="cuda", num_splits=splits)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run_mla(case, impl="cuda", num_splits=splits)   # warm: built outside the capture
        with torch.cuda.graph(graph, stream=stream):
            captured, captured_lse = _run_mla(case, impl="cuda", num_splits=splits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out) and torch.equal(captured_lse, lse)
