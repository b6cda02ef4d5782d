"""GPU tests of the Triton kernels against the torch reference and fp64 attention (run with --gpu).

Attention error is judged against fp64 attention over the same dequantised cache values, relative to
torch's own bf16 error on those values (SDPA with K/V rounded to bf16): err_kernel <= k * err_torch + eps.
Quantised bytes must equal the reference's (torch's cast) bit for bit.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref

pytestmark = pytest.mark.gpu

MIXED_LENGTHS = [1, 17, 1000, 4099, 5]      # odd batch; 1-token, sub-tile, multi-split and ragged tails
CACHE_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "bf16": torch.bfloat16}

# cache format, k: kernel max error <= k * torch bf16 SDPA max error (+ eps), against fp64 attention.
ATTENTION_FORMATS = [
    # FP8: the kernel multiplies exact codes in fp16 and folds the scales; torch first rounds the dequantised
    # K/V to bf16 and uses bf16 P, so the kernel's error is at most torch's; 2x absorbs max-abs noise.
    pytest.param("e4m3", 2.0, id="e4m3"),
    pytest.param("e5m2", 2.0, id="e5m2"),
    # BF16: same arithmetic as flash SDPA (bf16 P, fp32 accumulation, one final rounding): equal-size errors.
    pytest.param("bf16", 2.0, id="bf16"),
]


@pytest.fixture(scope="module")
def kern():
    pytest.importorskip("triton")
    from kernels.decode_attention import decode_attention
    from kernels.mla_decode import mla_decode
    from kernels.store_kv import store_kv, store_latent

    return SimpleNamespace(store_kv=store_kv, store_latent=store_latent, decode_attention=decode_attention,
                           mla_decode=mla_decode)


def assert_close_verbose(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    """assert_close that reports the mismatch count, the worst indices and values, and NaN/inf disagreements."""
    a, e = actual.double().cpu(), expected.double().cpu()
    nan_diff = a.isnan() != e.isnan()
    inf_diff = a.isinf() != e.isinf()
    assert not nan_diff.any(), f"{what}: NaN disagrees at {nan_diff.nonzero()[:8].tolist()} ({int(nan_diff.sum())} places)"
    assert not inf_diff.any(), f"{what}: inf disagrees at {inf_diff.nonzero()[:8].tolist()} ({int(inf_diff.sum())} places)"
    finite = a.isfinite() & e.isfinite()
    err = torch.where(finite, (a - e).abs(), 0.0)
    bad = err > atol + rtol * e.abs().nan_to_num(0.0)
    if bad.any():
        worst = torch.topk(err.flatten(), min(5, int(bad.sum()))).indices
        rows = [(tuple(torch.unravel_index(i, err.shape)), a.flatten()[i].item(), e.flatten()[i].item()) for i in worst]
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.numel()} mismatched (atol {atol}, rtol {rtol}); "
                             f"worst (index, actual, expected): {rows}")


def _assert_error_ratio(out: torch.Tensor, truth: torch.Tensor, torch_out: torch.Tensor, k: float, what: str) -> None:
    err = (out.double() - truth).abs().max().item()
    err_torch = (torch_out.double() - truth).abs().max().item()
    eps = 1e-6 * truth.abs().max().item()
    assert math.isfinite(err) and err <= k * err_torch + eps, \
        f"{what}: kernel max error {err:.3g} > {k} x torch bf16 max error {err_torch:.3g} + {eps:.1g}"


def _page_table(lengths: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Shuffled pages: (block_table [B, max_pages] int32, slot per token of each sequence, num_blocks)."""
    pages = [-(-n // page_size) for n in lengths]
    num_blocks = sum(pages) + 3                          # a few pages nobody owns
    order = torch.randperm(num_blocks)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    slots = []
    for b, (n, p) in enumerate(zip(lengths, pages)):
        table[b, :p] = order[sum(pages[:b]):sum(pages[:b]) + p].int()
        t = torch.arange(n)
        slots.append(table[b, t // page_size].long() * page_size + t % page_size)
    return table, torch.cat(slots), num_blocks


def _quantised(x: torch.Tensor, fmt: str, per_head: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(codes in the cache dtype, scale or None, dequantised fp64 values). x: [T, heads, D] or [T, W]."""
    if fmt == "bf16":
        codes = x.to(torch.bfloat16)
        return codes, None, codes.double()
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax()
    scale = ref.amax_scale(amax * 1.25, fmt)             # headroom, as a calibrated scale would have
    bcast = scale.reshape(-1, 1) if per_head else scale
    codes = ref.quantize(x, bcast, fmt)
    return codes, scale, codes.double() * bcast.double()


def _gqa_case(lengths, page_size, q_heads, kv_heads, head_dim, fmt, per_head, q_dtype=torch.bfloat16):
    table, slots, num_blocks = _page_table(lengths, page_size)
    total = sum(lengths)
    magnitude = torch.logspace(0, 1, kv_heads)[None, :, None]           # heads differ 10x: per-head scales matter
    k = torch.randn(total, kv_heads, head_dim) * magnitude
    v = torch.randn(total, kv_heads, head_dim) * magnitude
    (k_codes, k_scale, k_dense), (v_codes, v_scale, v_dense) = _quantised(k, fmt, per_head), _quantised(v, fmt, per_head)
    cache_dtype = CACHE_DTYPES[fmt] if fmt != "bf16" else q_dtype
    if fmt == "bf16" and q_dtype == torch.float16:
        k_codes, v_codes = k.half(), v.half()
        k_dense, v_dense = k_codes.double(), v_codes.double()
    caches = [torch.zeros(num_blocks, page_size, kv_heads, head_dim, dtype=cache_dtype) for _ in range(2)]
    for cache, codes in zip(caches, (k_codes, v_codes)):
        ref._write_slots(cache, slots, codes)
    q = torch.randn(len(lengths), q_heads, head_dim).to(q_dtype)
    cuda = lambda t: None if t is None else t.cuda()                    # noqa: E731
    return SimpleNamespace(
        q=q.cuda(), k_cache=caches[0].cuda(), v_cache=caches[1].cuda(), block_table=table.cuda(),
        seq_lens=torch.tensor(lengths, dtype=torch.int32).cuda(), k_scale=cuda(k_scale), v_scale=cuda(v_scale),
        k_dense=k_dense.split(lengths), v_dense=v_dense.split(lengths), sm_scale=head_dim ** -0.5)


def _gqa_truth_and_torch(case):
    """fp64 attention and torch's SDPA in q's dtype over K/V rounded to q's dtype, per sequence."""
    group = case.q.shape[1] // case.k_cache.shape[2]
    outs, lses, torch_outs = [], [], []
    for b, (k, v) in enumerate(zip(case.k_dense, case.v_dense)):
        k, v = k.cuda().repeat_interleave(group, 1), v.cuda().repeat_interleave(group, 1)   # [L, Hq, D]
        s = torch.einsum("hd,lhd->hl", case.q[b].double(), k) * case.sm_scale
        outs.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v))
        lses.append(torch.logsumexp(s, -1))
        dt = case.q.dtype
        torch_outs.append(F.scaled_dot_product_attention(
            case.q[b][None, :, None], k.to(dt).transpose(0, 1)[None], v.to(dt).transpose(0, 1)[None],
            scale=case.sm_scale)[0, :, 0])
    return torch.stack(outs), torch.stack(lses), torch.stack(torch_outs)


def _run_gqa(kern, case, num_splits=None, impl=None):
    return kern.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                                 case.k_scale, case.v_scale, case.sm_scale, num_splits=num_splits, impl=impl)


def _check_gqa(kern, case, k_tol, what, num_splits=None, impl=None):
    out, lse = _run_gqa(kern, case, num_splits, impl)
    truth, truth_lse, torch_out = _gqa_truth_and_torch(case)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape and lse.shape == case.q.shape[:2]
    _assert_error_ratio(out, truth, torch_out, k_tol, what)
    assert_close_verbose(lse, truth_lse, atol=1e-3, rtol=1e-4, what=f"{what} lse")   # fp32 scores vs fp64
    ref_out, ref_lse = ref.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                                            case.k_scale, case.v_scale, case.sm_scale)
    _assert_error_ratio(ref_out, truth, torch_out, 1.0, f"{what} (reference itself)")
    assert_close_verbose(lse, ref_lse, atol=1e-3, rtol=1e-4, what=f"{what} lse vs reference")


# ------------------------------------------------------------------------------------------ decode attention

# the kernels over an fp8 cache: the entry's (None), the Triton kernel, the CUDA kernel (kernels/gqa_decode_cuda.py)
IMPLS = [None, "triton", "cuda"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt, k_tol", ATTENTION_FORMATS)
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(8, 8, 128), (32, 8, 128), (16, 2, 128), (32, 8, 64),
                                                     (32, 2, 128), (24, 2, 64)])
def test_decode_attention_matches_fp64(kern, fmt, k_tol, per_head, q_heads, kv_heads, head_dim, impl):
    if fmt == "bf16" and (per_head or impl):
        pytest.skip("a bf16 cache has no scales and one kernel")
    case = _gqa_case(MIXED_LENGTHS, 16, q_heads, kv_heads, head_dim, fmt, per_head)
    _check_gqa(kern, case, k_tol, f"decode {fmt} {q_heads}/{kv_heads}x{head_dim} impl={impl}", impl=impl)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("lengths", [[1, 16, 17, 300, 4099], [8192] * 3], ids=["mixed", "8k"])
def test_decode_attention_cuda_kernel_with_sinks(kern, fmt, num_splits, lengths):
    """The CUDA kernel over a plain fp8 cache, sinks merged with its splits: the bound of the Triton kernel's test
    (2x torch's bf16 error on the same values), lse against fp64."""
    case = _gqa_case(lengths, 16, 32, 8, 128, fmt, per_head=True)
    sinks = torch.randn(32, device="cuda") * 2
    out, lse = kern.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                                     case.k_scale, case.v_scale, case.sm_scale, num_splits=num_splits, sinks=sinks,
                                     impl="cuda")
    truth, truth_lse, torch_out = _beyond_sdpa_truth_and_torch(case, sinks, None, None)
    what = f"cuda decode {fmt} sinks splits={num_splits}"
    _assert_error_ratio(out, truth, torch_out, 2.0, what)
    assert_close_verbose(lse, truth_lse, atol=1e-3, rtol=1e-4, what=f"{what} lse")


def test_decode_attention_cuda_kernel_says_what_it_does_not_serve(kern):
    """impl="cuda" over what it does not compute raises the reason; the entry's choice runs the Triton kernel."""
    case = _gqa_case([40], 16, 32, 8, 128, "e4m3", per_head=False)
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, case.k_scale, case.v_scale,
            case.sm_scale)
    for kwargs, why in ((dict(softcap=20.0), "soft-capping"), (dict(q_scale="dynamic"), "FP8 attention")):
        with pytest.raises(ValueError, match=why):
            kern.decode_attention(*args, impl="cuda", **kwargs)
    wide = _gqa_case([40], 16, 32, 1, 128, "e4m3", per_head=False)   # 32 query heads a KV head
    with pytest.raises(ValueError, match="up to 16 query heads"):
        _run_gqa(kern, wide, impl="cuda")
    pages_of_8 = _gqa_case([40, 100], 8, 32, 8, 128, "e4m3", per_head=False)   # half a 16-token tile a page
    with pytest.raises(ValueError, match="must lie in one page"):
        _run_gqa(kern, pages_of_8, impl="cuda")
    _check_gqa(kern, pages_of_8, 2.0, "pages of 8, the entry's kernel")


def _beyond_sdpa_truth_and_torch(case, sinks, softcap, first_key):
    """fp64 attention with sinks / soft-capping / each row's window, and torch's eager attention in q's dtype over
    K/V rounded to q's dtype (the model's own eager path for these: bf16 scores, softcap, sink column, fp32
    softmax), per sequence."""
    group = case.q.shape[1] // case.k_cache.shape[2]
    outs, lses, torch_outs = [], [], []
    for b, (k, v) in enumerate(zip(case.k_dense, case.v_dense)):
        first = int(first_key[b]) if first_key is not None else 0
        k, v = (x.cuda().repeat_interleave(group, 1)[first:] for x in (k, v))        # [L, Hq, D]
        sink = None if sinks is None else sinks.double()[:, None]

        def attend(q, k, v, dtype):
            s = torch.einsum("hd,lhd->hl", q.to(dtype), k.to(dtype)) * case.sm_scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            total = s if sink is None else torch.cat([s, sink.to(s.dtype)], -1)
            lse = torch.logsumexp(total.double(), -1, keepdim=True)
            return torch.einsum("hl,lhd->hd", torch.exp(s.double() - lse).to(dtype), v.to(dtype)), lse[:, 0]

        out, lse = attend(case.q[b], k, v, torch.float64)
        outs.append(out)
        lses.append(lse)
        torch_outs.append(attend(case.q[b], k, v, case.q.dtype)[0])
    return torch.stack(outs), torch.stack(lses), torch.stack(torch_outs)


# the features gpt-oss (sinks, a 128-token window), Gemma 2 (soft-capping 50, a 4096 window; 20 at the tiny size) and
# Llama 4 (chunks) ask of a decode step; each alone and all three. The error bound is the plain decode's (2x torch's
# bf16 error on the same values: the kernel adds tanh in fp32 and the sink in the fp32 merge)
BEYOND_SDPA = [pytest.param(dict(sinks=True), id="sinks"), pytest.param(dict(softcap=20.0), id="softcap"),
               pytest.param(dict(window=128), id="window"), pytest.param(dict(chunk=256), id="chunked"),
               pytest.param(dict(sinks=True, softcap=20.0, window=128), id="all")]


@pytest.mark.parametrize("features", BEYOND_SDPA)
@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_attention_sinks_softcap_and_windows_match_fp64(kern, features, fmt, num_splits):
    case = _gqa_case(MIXED_LENGTHS, 16, 32, 8, 64, fmt, per_head=True)
    lengths = case.seq_lens.long()
    sinks = torch.randn(32, device="cuda") * 2 if features.get("sinks") else None
    first_key = None
    if "window" in features:
        first_key = (lengths - features["window"]).clamp(min=0).int()
    elif "chunk" in features:
        first_key = ((lengths - 1).clamp(min=0) // features["chunk"] * features["chunk"]).int()
    softcap = features.get("softcap")
    out, lse = kern.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                                     case.k_scale, case.v_scale, case.sm_scale, num_splits=num_splits, sinks=sinks,
                                     softcap=softcap, first_key=first_key)
    truth, truth_lse, torch_out = _beyond_sdpa_truth_and_torch(case, sinks, softcap, first_key)
    what = f"decode {fmt} {features} splits={num_splits}"
    _assert_error_ratio(out, truth, torch_out, 2.0, what)
    assert_close_verbose(lse, truth_lse, atol=1e-3, rtol=1e-4, what=f"{what} lse")   # fp32 scores vs fp64
    ref_out, ref_lse = ref.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                                            case.k_scale, case.v_scale, case.sm_scale, sinks=sinks, softcap=softcap,
                                            first_key=first_key)
    _assert_error_ratio(ref_out, truth, torch_out, 1.0, f"{what} (reference itself)")
    assert_close_verbose(lse, ref_lse, atol=1e-3, rtol=1e-4, what=f"{what} lse vs reference")


@pytest.mark.parametrize("page_size", [1, 32, 48])
def test_decode_attention_page_sizes(kern, page_size):
    case = _gqa_case(MIXED_LENGTHS, page_size, 32, 8, 128, "e4m3", per_head=True)
    _check_gqa(kern, case, 2.0, f"decode page_size={page_size}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("length", [1, 17, 1000, 4099])
@pytest.mark.parametrize("num_splits", [None, 1, 5, 64])
def test_decode_attention_lengths_and_splits(kern, length, num_splits, impl):
    case = _gqa_case([length], 16, 32, 8, 128, "e5m2", per_head=False)
    _check_gqa(kern, case, 2.0, f"decode length={length} splits={num_splits} impl={impl}", num_splits, impl)


@pytest.mark.parametrize("config", [
    dict(block_n=64, num_warps=4, num_stages=2, prefetch=False), dict(block_n=32, num_warps=4, num_stages=1, prefetch=True),
    dict(block_n=64, num_warps=8, num_stages=1, prefetch=True), dict(block_n=128, num_warps=4, num_stages=2, prefetch=False),
    dict(block_n=16, num_warps=2, num_stages=1, prefetch=True),
    dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, swap=True),
    dict(block_n=64, num_warps=4, num_stages=3, prefetch=False, swap=True, programs_per_sm=16),
    # session 7: fp8 tiles widened once by inline PTX (a bf16 cache ignores widen)
    dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, widen=True),
    dict(block_n=32, num_warps=4, num_stages=1, prefetch=True, widen=True),
    dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, swap=True, widen=True),
    # session 8: only the V tile widened (K by the compiler's cast); whole waves
    dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, widen="v"),
    dict(block_n=64, num_warps=4, num_stages=3, prefetch=False, widen="v", programs_per_sm=16),
    dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, swap=True, widen="v"),
    dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, widen="v", programs_per_sm=6, whole_waves=True),
    dict(block_n=64, num_warps=4, num_stages=2, prefetch=False, widen="v", programs_per_sm=4, whole_waves=True)],
    ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "bf16"])
def test_decode_attention_launch_configs(kern, config, fmt):
    """Every tuning knob the benchmark may pick computes the same attention (prefetch covers ragged tails)."""
    case = _gqa_case(MIXED_LENGTHS, 16, 32, 8, 128, fmt, per_head=True)
    out, lse = kern.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                                     case.k_scale, case.v_scale, case.sm_scale, 7, **config)
    truth, truth_lse, torch_out = _gqa_truth_and_torch(case)
    _assert_error_ratio(out, truth, torch_out, 2.0, f"decode {config}")
    assert_close_verbose(lse, truth_lse, atol=1e-3, rtol=1e-4, what=f"decode {config} lse")


def _qk_fp8_query(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the qk_fp8 kernel multiplies: q quantised per head under amax / fp8 max, as fp64 values."""
    qf = q.float()
    q_s = ref.amax_scale(qf.abs().amax(dim=-1, keepdim=True), fmt)   # IEEE division (see amax_scale)
    q_s = torch.where(q_s > 0, q_s, torch.ones_like(q_s))
    return ref.quantize(qf, q_s, fmt).double() * q_s.double()


@pytest.mark.parametrize("fmt", ["e4m3"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("config", [dict(swap=True, num_stages=3), dict(swap=False)], ids=str)
def test_decode_attention_qk_fp8(kern, fmt, per_head, config):
    """qk_fp8 computes attention of the fp8-rounded Q exactly as well as torch does (judged against fp64 attention
    of that Q, relative to SDPA bf16 on the same Q); its extra error against the true Q is the option's cost,
    printed by `python -m kernels.tune --qk-fp8` and recorded in kernels/BENCHMARKS.md, not bounded here."""
    case = _gqa_case(MIXED_LENGTHS, 16, 32, 8, 128, fmt, per_head=per_head)
    out, lse = kern.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                                     case.k_scale, case.v_scale, case.sm_scale, qk_fp8=True, **config)
    q8 = SimpleNamespace(**vars(case))
    q8.q = _qk_fp8_query(case.q, fmt).to(torch.bfloat16)          # SDPA's view of that Q, rounded to bf16
    _, _, torch_out = _gqa_truth_and_torch(q8)
    q_exact = _qk_fp8_query(case.q, fmt).cuda()                    # fp64: the exact fp8 Q
    group = case.q.shape[1] // case.k_cache.shape[2]
    outs = []
    for b, (k, v) in enumerate(zip(case.k_dense, case.v_dense)):
        k, v = k.cuda().repeat_interleave(group, 1), v.cuda().repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q_exact[b], k) * case.sm_scale
        outs.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v))
    truth = torch.stack(outs)
    _assert_error_ratio(out, truth, torch_out, 2.0, f"qk_fp8 {fmt} {config}")
    assert out.isfinite().all() and lse.isfinite().all()


@pytest.mark.parametrize("fmt", ["e5m2", "bf16"])
def test_qk_fp8_needs_an_e4m3_cache(kern, fmt):
    """e5m2 failed the qk_fp8 agreement test above with per-tensor scales on an H100 (2 of 4 e5m2 cases, swap
    and plain; kernels/BENCHMARKS.md), so the launcher refuses it rather than run an option it cannot vouch for."""
    case = _gqa_case([40], 16, 8, 2, 64, fmt, per_head=False)
    with pytest.raises(AssertionError, match="qk_fp8 needs an e4m3 cache"):
        kern.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, case.k_scale,
                              case.v_scale, case.sm_scale, qk_fp8=True)


def test_swap_with_prefetch_is_refused(kern):
    case = _gqa_case([40], 16, 8, 2, 64, "e4m3", per_head=False)
    with pytest.raises(AssertionError, match="swap with prefetch"):
        kern.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, case.k_scale,
                              case.v_scale, case.sm_scale, swap=True, prefetch=True)


@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_decode_attention_fp16_q(kern, fmt):
    case = _gqa_case(MIXED_LENGTHS, 16, 32, 8, 128, fmt, per_head=False, q_dtype=torch.float16)
    _check_gqa(kern, case, 2.0, f"decode fp16 q, {fmt} cache")


@pytest.mark.parametrize("scale", [torch.tensor(0.06), torch.full((8,), 0.06)], ids=["per_tensor", "per_head"])
def test_decode_attention_bf16_cache_ignores_scales(kern, scale):
    """Failure class 3: a checkpoint's k_scale/v_scale next to a BF16 cache must change nothing, bit for bit."""
    case = _gqa_case(MIXED_LENGTHS, 16, 32, 8, 128, "bf16", per_head=False)
    plain = _run_gqa(kern, case)
    case.k_scale, case.v_scale = scale.cuda(), scale.cuda()
    scaled = _run_gqa(kern, case)
    assert torch.equal(plain[0], scaled[0]) and torch.equal(plain[1], scaled[1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("saturate", [True, False])
def test_decode_attention_nan_and_overflow(kern, saturate, impl):
    """An overflowing K value stored without saturation (e4m3 -> NaN code) must surface as NaN in exactly
    the heads that read it, as in the reference; saturated, everything stays finite."""
    lengths, page_size, kv_heads, head_dim = [17, 40], 16, 2, 64
    table, slots, num_blocks = _page_table(lengths, page_size)
    k = torch.randn(sum(lengths), kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k[17 + 5, 1, 3] = 1e6                                  # sequence 1, token 5, kv head 1: 1e6 / 0.05 >> 448
    scale = torch.tensor(0.05, device="cuda")
    caches = [torch.zeros(num_blocks, page_size, kv_heads, head_dim, dtype=torch.float8_e4m3fn, device="cuda")
              for _ in range(2)]
    kern.store_kv(k.cuda(), v.cuda(), *caches, slots.cuda(), scale, scale, saturate=saturate)
    q = torch.randn(2, 8, head_dim, dtype=torch.bfloat16, device="cuda")
    args = (q, *caches, table.cuda(), torch.tensor(lengths, dtype=torch.int32, device="cuda"), scale, scale, 0.125)
    out, lse = kern.decode_attention(*args, impl=impl)
    ref_out, ref_lse = ref.decode_attention(*args)
    # kernel against its torch mirror on the same codes, both accumulating in fp32 and rounding the output to bf16
    # once: they differ by the fp32 sum order, about one bf16 ulp of the output. |out| <= max |v|, ~4 for these
    # randn values: one ulp in [2, 4) is 2^-6 = 0.0156 -> atol 2e-2, and rtol 2e-2 (5 ulps at 2^-8 relative) covers
    # a value in [4, 8). Not tightened: not re-measured on a GPU this session. NaN heads must match as NaN.
    assert_close_verbose(out, ref_out, atol=2e-2, rtol=2e-2, what="decode with overflow")
    # lse is fp32 on both sides, summed in another order: |lse| < 10 here, where fp32 rounding over at most 40 keys
    # is ~1e-5; 1e-3 is the lse bound every agreement check in this file uses
    assert_close_verbose(lse, ref_lse, atol=1e-3, rtol=1e-4, what="lse with overflow")
    assert out[1, 4:].isnan().all().item() != saturate   # heads 4..7 read kv head 1
    assert out[0].isfinite().all() and out[1, :4].isfinite().all()


# ------------------------------------------------------------------------------------------ MLA decode

def _mla_case(lengths, page_size, heads, fmt, latent_dim=512, rope_dim=64):
    table, slots, num_blocks = _page_table(lengths, page_size)
    rows = torch.randn(sum(lengths), latent_dim + rope_dim)
    rows[:, latent_dim:] *= 4.0                            # RoPE part larger, as in DeepSeek-style models
    codes, scale, dense = _quantised(rows, fmt, per_head=False)
    cache = torch.zeros(num_blocks, page_size, latent_dim + rope_dim, dtype=CACHE_DTYPES[fmt])
    ref._write_slots(cache, slots, codes)
    return SimpleNamespace(
        q_latent=(torch.randn(len(lengths), heads, latent_dim) * 0.5).bfloat16().cuda(),
        q_pe=(torch.randn(len(lengths), heads, rope_dim) * 0.5).bfloat16().cuda(),
        cache=cache.cuda(), block_table=table.cuda(), seq_lens=torch.tensor(lengths, dtype=torch.int32).cuda(),
        scale=None if scale is None else scale.cuda(), dense=dense.split(lengths), sm_scale=192 ** -0.5,
        latent_dim=latent_dim)


def _run_mla(kern, case, num_splits=None):
    return kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                           case.sm_scale, num_splits=num_splits)


def _mla_truth_and_torch(case, queries: torch.Tensor | None = None):
    """fp64 attention over the dequantised cache, and torch bf16 SDPA's, of the case's query or of `queries`
    ([B, H, Dc + Dr], e.g. the fp8 query that fp8_mma multiplies)."""
    outs, lses, torch_outs = [], [], []
    dc = case.latent_dim
    for b, rows in enumerate(case.dense):
        rows = rows.cuda()
        q = torch.cat([case.q_latent[b], case.q_pe[b]], -1) if queries is None else queries[b]   # [H, Dc + Dr]
        s = (q.double() @ rows.T) * case.sm_scale
        outs.append(torch.softmax(s, -1) @ rows[:, :dc])
        lses.append(torch.logsumexp(s, -1))
        k = rows.bfloat16()[None, None].expand(1, q.shape[0], -1, -1)
        torch_outs.append(F.scaled_dot_product_attention(q.bfloat16()[None, :, None], k, k[..., :dc],
                                                         scale=case.sm_scale)[0, :, 0])
    return torch.stack(outs), torch.stack(lses), torch.stack(torch_outs)


@pytest.mark.parametrize("fmt, k_tol", ATTENTION_FORMATS)
@pytest.mark.parametrize("heads, page_size", [(16, 64), (20, 16), (128, 1)])
def test_mla_decode_matches_fp64(kern, fmt, k_tol, heads, page_size):
    case = _mla_case(MIXED_LENGTHS, page_size, heads, fmt)
    out, lse = _run_mla(kern, case)
    truth, truth_lse, torch_out = _mla_truth_and_torch(case)
    assert out.shape == case.q_latent.shape and out.dtype == torch.bfloat16
    what = f"mla {fmt} H={heads} page={page_size}"
    _assert_error_ratio(out, truth, torch_out, k_tol, what)
    assert_close_verbose(lse, truth_lse, atol=1e-3, rtol=1e-4, what=f"{what} lse")


@pytest.mark.parametrize("num_splits", [1, 7])
def test_mla_decode_splits(kern, num_splits):
    case = _mla_case([4099, 1, 300], 64, 16, "e4m3")
    out, _ = _run_mla(kern, case, num_splits)
    truth, _, torch_out = _mla_truth_and_torch(case)
    _assert_error_ratio(out, truth, torch_out, 2.0, f"mla splits={num_splits}")


@pytest.mark.parametrize("config", [
    dict(block_n=32, num_warps=8, num_stages=2, prefetch=False), dict(block_n=16, num_warps=4, num_stages=1, prefetch=True),
    dict(block_n=32, num_warps=8, num_stages=1, prefetch=True), dict(block_n=64, num_warps=8, num_stages=1, prefetch=True),
    dict(block_n=32, num_warps=4, num_stages=2, prefetch=False),
    dict(block_n=32, num_warps=4, num_stages=3, prefetch=False, swap=True),
    dict(block_n=32, num_warps=8, num_stages=2, prefetch=False, block_h=64),
    dict(block_n=64, num_warps=4, num_stages=2, prefetch=False, swap=True, block_h=32)], ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_mla_decode_launch_configs(kern, config, fmt):
    case = _mla_case([4099, 1, 300, 17], 64, 20, fmt)
    out, lse = kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                               case.sm_scale, 5, **config)
    truth, truth_lse, torch_out = _mla_truth_and_torch(case)
    _assert_error_ratio(out, truth, torch_out, 2.0, f"mla {config}")
    assert_close_verbose(lse, truth_lse, atol=1e-3, rtol=1e-4, what=f"mla {config} lse")


def test_mla_decode_bf16_cache_ignores_scale(kern):
    case = _mla_case(MIXED_LENGTHS, 64, 16, "bf16")
    plain = _run_mla(kern, case)
    case.scale = torch.tensor(0.06, device="cuda")
    scaled = _run_mla(kern, case)
    assert torch.equal(plain[0], scaled[0]) and torch.equal(plain[1], scaled[1])


# The tile kernel (mla_decode(..., tma=True)): whole tiles by TMA where page_size % block_n == 0, else pointer loads;
# the split's last partial tile masked. Unwritten slots hold NaN here, so a read past seq_len would show.
MLA_TILE_CONFIGS = [
    pytest.param(dict(tma=True, block_n=32, num_warps=4, num_stages=5, swap=True, block_h=16), id="tma-swap-32-4-5-h16"),
    pytest.param(dict(tma=True, block_n=32, num_warps=8, num_stages=4, swap=False, block_h=64), id="tma-32-8-4-h64"),
    # session 7: fp8 tiles widened once by inline PTX (widen), the latent in 4 chunks (split_latent)
    pytest.param(dict(tma=True, block_n=32, num_warps=4, num_stages=5, swap=False, block_h=16, widen=True),
                 id="widen-32-4-5-h16"),
    pytest.param(dict(tma=True, block_n=32, num_warps=4, num_stages=5, swap=False, block_h=16, widen=True,
                      split_latent=True), id="split-widen-32-4-5-h16"),
    pytest.param(dict(tma=True, block_n=64, num_warps=4, num_stages=4, swap=False, block_h=16, widen=True,
                      split_latent=True), id="split-widen-64-4-4-h16"),
    pytest.param(dict(tma=True, block_n=32, num_warps=8, num_stages=5, swap=False, block_h=64, widen=True,
                      split_latent=True), id="split-widen-32-8-5-h64"),
    pytest.param(dict(tma=True, block_n=32, num_warps=4, num_stages=5, swap=False, block_h=16, widen=False,
                      split_latent=True), id="split-32-4-5-h16"),
]

def _poison_unwritten(case, lengths: list[int]) -> None:
    """NaN in every cache slot that no sequence owns below its length (stale pages, tails of last pages)."""
    page = case.cache.shape[1]
    written = torch.zeros(case.cache.shape[0] * page, dtype=torch.bool, device=case.cache.device)
    for b, n in enumerate(lengths):
        t = torch.arange(n, device=written.device)
        written[case.block_table[b, t // page].long() * page + t % page] = True
    rows = case.cache.view(-1, case.cache.shape[2])
    if case.cache.element_size() == 1:
        rows.view(torch.uint8)[~written] = 0x7F           # NaN in e4m3fn and in e5m2
    else:
        rows[~written] = float("nan")


@pytest.mark.parametrize("config", MLA_TILE_CONFIGS)
@pytest.mark.parametrize("fmt, k_tol", ATTENTION_FORMATS)
@pytest.mark.parametrize("page_size", [64, 16], ids=["page64-tma", "page16-pointers"])
def test_mla_tile_kernel_matches_fp64(kern, config, fmt, k_tol, page_size):
    lengths = [4099, 1, 300, 17, 128]                    # 128: a split that ends on a whole tile
    case = _mla_case(lengths, page_size, 20, fmt)
    _poison_unwritten(case, lengths)
    out, lse = kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                               case.sm_scale, 5, **config)
    truth, truth_lse, torch_out = _mla_truth_and_torch(case)
    what = f"mla tile {fmt} page={page_size} {config}"
    _assert_error_ratio(out, truth, torch_out, k_tol, what)
    assert_close_verbose(lse, truth_lse, atol=1e-3, rtol=1e-4, what=f"{what} lse")


# The CUDA kernels (mla_decode(..., impl="cuda")): kernels/mla_decode_fp8.cu, one config per warp layout it is
# built for (4 warps x 2 token blocks, 8 x 1, 4 x 1; 32 heads a block; cp.async instead of bulk copies; wgmma=False
# keeps it where the 128-head entry is the other kernel), and mla_decode_fp8_ws.cu (wgmma=True, sm_90: 64 heads
# and 64 tokens a block of 12 warps, fixed; 3 and 2 stages), at the
# FP8 rows of ATTENTION_FORMATS (the same arithmetic as the tile kernel: exact codes in fp16, fp32 accumulation, P
# rounded to fp16). Unwritten slots hold NaN: a kernel that read past a split's end fails.
MLA_CUDA_CONFIGS = [
    pytest.param(dict(impl="cuda", wgmma=False, block_n=64, num_warps=4, num_stages=3, block_h=16), id="cuda-64-4-3"),
    pytest.param(dict(impl="cuda", wgmma=False, block_n=64, num_warps=8, num_stages=3, block_h=16), id="cuda-64-8-3"),
    pytest.param(dict(impl="cuda", wgmma=False, block_n=64, num_warps=8, num_stages=4, block_h=16), id="cuda-64-8-4"),
    pytest.param(dict(impl="cuda", wgmma=False, block_n=32, num_warps=4, num_stages=3, block_h=16, ctas=3),
                 id="cuda-32-4-3-x3"),
    pytest.param(dict(impl="cuda", wgmma=False, block_n=64, num_warps=8, num_stages=3, block_h=32),
                 id="cuda-64-8-3-h32"),
    pytest.param(dict(impl="cuda", wgmma=False, block_n=64, num_warps=8, num_stages=3, block_h=16, bulk=False),
                 id="cuda-64-8-3-cp.async"),
    pytest.param(dict(impl="cuda", wgmma=True, block_n=64, num_warps=12, num_stages=3, block_h=64),
                 id="cuda-wgmma-64-12-3"),
    pytest.param(dict(impl="cuda", wgmma=True, block_n=64, num_warps=12, num_stages=2, block_h=64),
                 id="cuda-wgmma-64-12-2"),
    pytest.param(dict(impl="cuda", wgmma=False, block_n=32, num_warps=4, num_stages=4, block_h=16, ctas=2,
                      cuda_merge=True), id="cuda-32-4-4-x2-cuda-merge"),
]


@pytest.mark.parametrize("config", MLA_CUDA_CONFIGS)
@pytest.mark.parametrize("fmt, k_tol", [p for p in ATTENTION_FORMATS if p.id != "bf16"])
@pytest.mark.parametrize("heads, page_size, splits", [(16, 64, None), (20, 16, 5), (128, 1, 3)],
                         ids=["h16-page64", "h20-page16-splits5", "h128-page1-splits3"])
def test_mla_cuda_kernel_matches_fp64(kern, config, fmt, k_tol, heads, page_size, splits):
    lengths = [4099, 1, 300, 17, 128]
    case = _mla_case(lengths, page_size, heads, fmt)
    _poison_unwritten(case, lengths)
    out, lse = kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                               case.sm_scale, splits, **config)
    truth, truth_lse, torch_out = _mla_truth_and_torch(case)
    what = f"mla cuda {fmt} H={heads} page={page_size} {config}"
    _assert_error_ratio(out, truth, torch_out, k_tol, what)
    assert_close_verbose(lse, truth_lse, atol=1e-3, rtol=1e-4, what=f"{what} lse")


# kernels/mla_decode_latent_split.cu over the plain FP8 cache (mla_decode(..., latent_split=True): the latent's 512
# columns split between 4 warps, 16 heads a block, k_pe's fp8 codes widened beside them): the same arithmetic as the
# CUDA kernels above (exact codes in fp16, fp32 accumulation, P rounded to fp16; its running maximum may lag the
# scores by 2^8, so P <= 2^8), so the same bound; both builds (REG_T: P . C's fragments transposed in registers) give
# the same bits. Unwritten slots hold NaN.
@pytest.mark.parametrize("fmt, k_tol", [p for p in ATTENTION_FORMATS if p.id != "bf16"])
@pytest.mark.parametrize("heads, page_size, splits", [(16, 64, None), (20, 16, 5), (128, 1, 3), (16, 32, 1)],
                         ids=["h16-page64", "h20-page16-splits5", "h128-page1-splits3", "h16-page32-one-split"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bf16-q", "fp16-q"])
def test_mla_latent_split_over_the_fp8_cache_matches_fp64(kern, fmt, k_tol, heads, page_size, splits, q_dtype):
    from kernels import mla_block_scaled_cuda

    lengths = [4099, 1, 300, 17, 128, 0]
    case = _mla_case(lengths, page_size, heads, fmt)
    case.q_latent, case.q_pe = case.q_latent.to(q_dtype), case.q_pe.to(q_dtype)
    _poison_unwritten(case, lengths)
    assert mla_block_scaled_cuda.plain_fp8_refusal(case.q_latent, case.q_pe, case.cache) is None
    args = (case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale, case.sm_scale, splits)
    out, lse = mla_block_scaled_cuda.decode_plain_fp8(*args, reg_t=False)
    other, other_lse = mla_block_scaled_cuda.decode_plain_fp8(*args, reg_t=True)
    assert torch.equal(out, other) and torch.equal(lse, other_lse), "the two builds' bits differ"
    entry, entry_lse = kern.mla_decode(*args, latent_split=True)
    assert torch.equal(entry, out) and torch.equal(entry_lse, lse), "mla_decode(latent_split=True) runs it"
    assert out[5].eq(0).all() and lse[5].isneginf().all(), "an empty sequence: out 0, lse -inf"
    case.dense = case.dense[:5]
    truth, truth_lse, torch_out = _mla_truth_and_torch(case)
    what = f"mla latent split {fmt} H={heads} page={page_size} splits={splits} {q_dtype}"
    _assert_error_ratio(out[:5], truth, torch_out, k_tol, what)
    assert_close_verbose(lse[:5], truth_lse, atol=1e-3, rtol=1e-4, what=f"{what} lse")


def test_mla_latent_split_over_the_fp8_cache_keeps_a_nan_code_in_its_sequence_and_replays(kern):
    """A NaN code inside sequence 1 makes exactly sequence 1's outputs NaN; the other sequences' bits do not move,
    and a captured launch replays to the eager bits."""
    from kernels.tune import capture

    lengths = [700, 300, 129]
    case = _mla_case(lengths, 16, 16, "e4m3")
    args = (case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale, case.sm_scale, 4)
    clean, clean_lse = kern.mla_decode(*args, latent_split=True)
    graph, replayed = capture(lambda: kern.mla_decode(*args, latent_split=True))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed[0], clean) and torch.equal(replayed[1], clean_lse)
    page = case.cache.shape[1]
    slot = case.block_table[1, 250 // page].long() * page + 250 % page
    case.cache.view(-1, case.cache.shape[2]).view(torch.uint8)[slot, 7] = 0x7F
    out, lse = kern.mla_decode(*args, latent_split=True)
    assert out[1].isnan().all() and lse[1].isnan().all(), "the NaN code did not reach every output of its sequence"
    assert torch.equal(out[[0, 2]], clean[[0, 2]]) and torch.equal(lse[[0, 2]], clean_lse[[0, 2]])


def test_mla_latent_split_says_what_it_cannot_run(kern, monkeypatch):
    """An explicit latent_split=True it cannot run is refused with the reason; an entry's latent_split gives way to
    launch keywords (they choose another kernel)."""
    import kernels.mla_decode as M

    case = _mla_case([40], 16, 16, "bf16")
    args = (case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale, case.sm_scale)
    with pytest.raises(AssertionError, match="it reads e4m3 or e5m2 caches"):
        kern.mla_decode(*args, latent_split=True)
    case = _mla_case([40], 24, 16, "e4m3")
    args = (case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale, case.sm_scale)
    with pytest.raises(AssertionError, match="whole pages or lie inside one: page 24"):
        kern.mla_decode(*args, latent_split=True)
    with pytest.raises(AssertionError, match="no fp8_mma, q_scale or prob_scale"):
        kern.mla_decode(*args, latent_split=True, q_scale="dynamic")
    out, _ = kern.mla_decode(*args)   # page 24: the entry's other kernel runs
    truth, _, torch_out = _mla_truth_and_torch(case)
    _assert_error_ratio(out, truth, torch_out, 2.0, "mla fp8, page 24")
    runs = []
    real = M.mla_block_scaled_cuda.decode_plain_fp8
    monkeypatch.setattr(M.mla_block_scaled_cuda, "decode_plain_fp8", lambda *a, **k: runs.append(1) or real(*a, **k))
    case = _mla_case([40], 16, 16, "e4m3")
    args = (case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale, case.sm_scale)
    entry = M.launch_config("mla_fp8", case.cache.device)
    kern.mla_decode(*args, **{k: v for k, v in entry.items() if k != "latent_split"})
    assert runs == [], "launch keywords chose the entry's other kernel"
    kern.mla_decode(*args, latent_split=True)
    assert runs == [1]
    slots = case.block_table.numel() * case.cache.shape[1]   # 1 sequence x 3 pages of 16
    for most, taken in ((slots, [1, 1]), (slots - 1, [1, 1])):   # an entry's limit on batch x cache slots
        monkeypatch.setattr(M, "launch_config", lambda kind, device, most=most: dict(
            entry, latent_split=True, latent_split_max_tokens=most))
        kern.mla_decode(*args)
        assert runs == taken, f"latent_split_max_tokens {most} against {slots} slots"


@pytest.mark.parametrize("config", [
    pytest.param(dict(wgmma=False, block_n=64, num_warps=4, num_stages=3), id="mma.sync"),
    pytest.param(dict(wgmma=True, block_n=64, num_warps=12, num_stages=3, block_h=64), id="wgmma"),
    pytest.param(dict(wgmma=False, block_n=32, num_warps=4, num_stages=4, ctas=2, cuda_merge=True),
                 id="mma.sync-cuda-merge")])
def test_mla_cuda_kernel_nan_code_stays_in_its_sequence(kern, config):
    """A NaN code written inside sequence 1 makes exactly sequence 1's outputs NaN (every head, every column):
    the kernel neither drops it nor leaks it into the other sequences sharing its launch."""
    lengths = [700, 300, 129]
    case = _mla_case(lengths, 16, 72 if config.get("wgmma") else 16, "e4m3")
    page = case.cache.shape[1]
    slot = case.block_table[1, 250 // page].long() * page + 250 % page
    case.cache.view(-1, case.cache.shape[2]).view(torch.uint8)[slot, 7] = 0x7F
    out, _ = kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                             case.sm_scale, 4, impl="cuda", **config)
    assert out[1].isnan().all(), "the NaN code did not reach every output of its sequence"
    assert out[0].isfinite().all() and out[2].isfinite().all(), "the NaN code leaked into another sequence"


@pytest.mark.parametrize("splits", [None, 70], ids=["planned-splits", "70-splits"])
def test_mla_cuda_merge_repeats_and_replays(kern, splits):
    """cuda_merge (the merge kernel as a programmatic dependent launch): repeated calls and CUDA-graph replays give
    the same bits, within the merge's rounding of merge_splits' results; an empty sequence gets out 0, lse -inf.
    70 splits: more than the merge's chunk of 32 loads a thread (three chunks, the last partial), many splits empty."""
    from kernels.tune import capture
    case = _mla_case([4099, 1, 300, 0, 128], 64, 16, "e4m3")
    config = dict(impl="cuda", wgmma=False, block_n=32, num_warps=4, num_stages=4, block_h=16, ctas=2)
    args = (case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale, case.sm_scale, splits)
    two_kernels = kern.mla_decode(*args, cuda_merge=False, **config)
    first = kern.mla_decode(*args, cuda_merge=True, **config)
    again = kern.mla_decode(*args, cuda_merge=True, **config)
    graph, replayed = capture(lambda: kern.mla_decode(*args, cuda_merge=True, **config))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for got in (again, replayed):
            assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]), "a launch differs from the first"
    # the same formula as merge_splits, summed in another order (Triton: a tree, div.full, lg2.approx): fp32 sums that
    # differ in their last bits can round a bf16 output one ulp (2^-8 relative) apart, so 1e-2 allows two; the lse
    # is fp32 (2^-24 relative), 1e-6 a few ulps
    assert_close_verbose(first[0].float(), two_kernels[0].float(), atol=1e-2, rtol=1e-2, what="cuda_merge out")
    assert_close_verbose(first[1], two_kernels[1], atol=1e-5, rtol=1e-6, what="cuda_merge lse")
    assert first[1][3].isneginf().all() and (first[0][3] == 0).all(), "an empty sequence: out 0, lse -inf"


def test_mla_cuda_kernel_that_does_not_build_falls_back_to_the_triton_entry(kern, monkeypatch):
    """NVRTC or the driver refusing the kernel (an old toolkit, say): the table's impl="cuda" entry warns once and
    runs the Triton entry (same results within the bound); an explicit impl="cuda" raises with the reason."""
    import kernels.mla_decode as M
    from kernels import nvrtc

    def refuse(*args):
        raise RuntimeError("NVRTC could not compile mla_fp8_decode (test)")

    monkeypatch.setattr(nvrtc, "BUILD_FAILURES", {})
    M._warn_cuda_fallback.cache_clear()   # it warns once per reason and process
    monkeypatch.setattr(nvrtc, "compile_kernel", refuse)
    case = _mla_case([300, 17, 1], 64, 16, "e4m3")
    entry = dict(impl="cuda", block_n=64, num_warps=4, num_stages=3, block_h=16)
    monkeypatch.setattr(M, "launch_config", lambda kind, device: dict(M.CUDA_FALLBACK["mla_fp8"], **entry))
    with pytest.warns(RuntimeWarning, match="did not build here"):
        out, _ = kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                                 case.sm_scale)
    truth, _, torch_out = _mla_truth_and_torch(case)
    _assert_error_ratio(out, truth, torch_out, 2.0, "mla fallback after a failed build")   # e4m3's bound above
    with pytest.raises(RuntimeError, match="could not compile"):
        kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                        case.sm_scale, **entry)


def test_mla_cuda_refuses_what_it_cannot_run(kern):
    """An explicit impl="cuda" it cannot run is refused with the reason (a bf16 cache; a tile it is not built for)."""
    case = _mla_case([40], 16, 16, "bf16")
    with pytest.raises(AssertionError, match="fp8 caches only"):
        kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                        case.sm_scale, impl="cuda", block_n=64, num_warps=4, num_stages=3)
    case = _mla_case([40], 16, 16, "e4m3")
    with pytest.raises(AssertionError, match="n8 blocks"):
        kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                        case.sm_scale, impl="cuda", block_n=48, num_warps=4, num_stages=3)
    with pytest.raises(AssertionError, match="wgmma=True is built for block_n 64, num_warps 12, block_h 64"):
        kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                        case.sm_scale, impl="cuda", wgmma=True, block_n=64, num_warps=12, num_stages=3, block_h=16)


def _fp8_query(q: torch.Tensor) -> torch.Tensor:
    """What fp8_mma multiplies: per head q_s * e4m3(q / q_s), q_s = amax / 448 (fp32, round to nearest even)."""
    q_s = q.float().abs().amax(-1, keepdim=True) / 448.0
    return ref.quantize(q.float() / q_s, 1.0, "e4m3").double() * q_s.double()


# fp8_mma rounds P to e4m3 (3 mantissa bits vs bf16's 7) and accumulates fp8 products in Hopper's reduced-precision
# adder (Triton's default for fp8 dots on sm_90: no promotion to fp32 inside a dot): against fp64 of the fp8 Q it
# multiplied, `python -m kernels.tune_mla` measured 1.86-2.01x torch bf16's output error and an lse error of
# 0.4-1.0e-3; this test's data measured an lse error of 5.0e-3 on the H100 (session 5, kernels/BENCHMARKS.md; it
# failed a first bound of 3e-3). Bounds: 2x the worst measured.
FP8_MMA_K = 4.0
FP8_MMA_LSE_ATOL = 1e-2


@pytest.mark.parametrize("config", [
    pytest.param(dict(block_n=64, num_warps=8, num_stages=5, swap=True, block_h=16), id="swap-64-8-5-h16"),
    pytest.param(dict(block_n=32, num_warps=8, num_stages=5, swap=False, block_h=64), id="32-8-5-h64")])
@pytest.mark.parametrize("page_size", [64, 16], ids=["page64-tma", "page16-pointers"])
def test_mla_fp8_mma_matches_fp64_of_its_fp8_query(kern, config, page_size):
    lengths = [4099, 1, 300, 17, 128]
    case = _mla_case(lengths, page_size, 20, "e4m3")
    _poison_unwritten(case, lengths)
    out, lse = kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                               case.sm_scale, 5, fp8_mma=True, **config)
    truth, truth_lse, torch_out = _mla_truth_and_torch(case, _fp8_query(torch.cat([case.q_latent, case.q_pe], -1)))
    _assert_error_ratio(out, truth, torch_out, FP8_MMA_K, f"mla fp8_mma page={page_size} {config}")
    assert_close_verbose(lse, truth_lse, atol=FP8_MMA_LSE_ATOL, rtol=0, what=f"mla fp8_mma {config} lse")


@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_mla_non_power_of_two_latent_runs_on_the_table_config(kern, fmt):
    """Dc = 384: whatever the table names, session 4's kernel takes it; an explicit tma=True is refused."""
    case = _mla_case([300, 17, 1], 64, 16, fmt, latent_dim=384)
    out, _ = _run_mla(kern, case)
    truth, _, torch_out = _mla_truth_and_torch(case)
    _assert_error_ratio(out, truth, torch_out, 2.0, f"mla {fmt} Dc=384")
    with pytest.raises(AssertionError, match="power-of-two"):
        kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                        case.sm_scale, tma=True)


@pytest.mark.parametrize("fmt", ["e5m2", "bf16"])
def test_mla_fp8_mma_needs_an_e4m3_cache(kern, fmt):
    case = _mla_case([40], 64, 16, fmt)
    with pytest.raises(AssertionError, match="fp8_mma needs an e4m3 cache"):
        kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                        case.sm_scale, fp8_mma=True)


def _check_mla_fp8_attention(kern, case, mode: str, config: dict, num_splits: int) -> None:
    """mla_decode with q_scale / prob_scale against the fp64 emulation of its definition (reference.mla_decode_fp8,
    the launch's tiles and splits), at _check_fp8_attention's bounds and for its reasons: the kernel multiplies the
    same e4m3 Q and P values (exact in fp16) and differs by fp32 accumulation, the bf16 output rounding and rare
    e4m3 ties of P that fp32 exp2 puts on the other side."""
    from kernels.decode_attention import plan_splits

    q = torch.cat([case.q_latent, case.q_pe], -1)
    kw = _attention_scales(q, mode)
    out, lse = kern.mla_decode(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens, case.scale,
                               case.sm_scale, num_splits, **config, **kw)
    heads_per_program = config["block_h"]
    tps = plan_splits(case.block_table.shape[1] * case.cache.shape[1], q.shape[0] * -(-q.shape[1] // heads_per_program),
                      config["block_n"], 2, q.device, num_splits)[1]
    emul, emul_lse = ref.mla_decode_fp8(case.q_latent, case.q_pe, case.cache, case.block_table, case.seq_lens,
                                        case.scale, case.sm_scale, kw.get("q_scale"), kw.get("prob_scale"),
                                        config["block_n"], tps)
    truth, _, torch_out = _mla_truth_and_torch(case)
    torch_err = (torch_out.double() - truth).abs().max().item()
    gap = (out.double() - emul).abs().max().item()
    err = (out.double() - truth).abs().max().item()
    emul_err = (emul - truth).abs().max().item()
    what = (f"mla fp8 attention {mode} {config} splits={num_splits}: |kernel - emulation| {gap:.3g} = "
            f"{gap / torch_err:.2f}x torch bf16's error {torch_err:.3g}; kernel error vs fp64 {err:.3g}, "
            f"emulation's {emul_err:.3g}")
    assert gap <= 2.0 * torch_err + 1e-6 * truth.abs().max().item(), what
    assert err <= emul_err + 2 * torch_err, what
    assert_close_verbose(lse, emul_lse, atol=1e-3, rtol=1e-4, what=f"{what}; lse")   # fp32 scores vs fp64
    assert out.isfinite().all()


MLA_FP8_ATTENTION_CONFIG = dict(block_n=32, num_warps=4, num_stages=5, swap=False, block_h=16)   # Triton tile kernel


@pytest.mark.parametrize("mode", ["q dynamic + p", "q per tensor", "q per head + p", "p saturating"])
def test_mla_fp8_attention_matches_its_emulation(kern, mode):
    """Page 64 (TMA tiles), ragged lengths, 5 splits, NaN in every unowned slot; H = 20 (a partial head block)."""
    lengths = [4099, 1, 300, 17, 128]
    case = _mla_case(lengths, 64, 20, "e4m3")
    _poison_unwritten(case, lengths)
    _check_mla_fp8_attention(kern, case, mode, MLA_FP8_ATTENTION_CONFIG, 5)


@pytest.mark.parametrize("fmt, page_size, num_splits, config", [
    pytest.param("e4m3", 16, 1, dict(block_n=32, num_warps=4, num_stages=5, swap=True, block_h=16),
                 id="e4m3-page16-pointers-swap-1split"),
    pytest.param("bf16", 64, 7, MLA_FP8_ATTENTION_CONFIG, id="bf16-page64-7splits")])
def test_mla_fp8_attention_layouts_caches_and_splits(kern, fmt, page_size, num_splits, config):
    """Page 16 through pointer loads in the swap layout with one split (no merge); a bf16 cache (e4m3 Q and P
    widened to bf16: exact) over 7 splits."""
    lengths = [4099, 1, 300, 17, 128]
    case = _mla_case(lengths, page_size, 20, fmt)
    _poison_unwritten(case, lengths)
    _check_mla_fp8_attention(kern, case, "q per head + p", config, num_splits)


# ------------------------------------------------------------------------------------------ stores

def _assert_same_codes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bytes equal wherever the value is not NaN; NaN exactly where the reference has NaN (a NaN's sign and
    payload bits are not part of the contract: torch's CPU/GPU casts and PTX cvt canonicalise them differently)."""
    got, want = got.cpu(), want.cpu()
    nan_got, nan_want = got.float().isnan(), want.float().isnan()
    assert torch.equal(nan_got, nan_want), f"{what}: NaN at {int(nan_got.sum())} places, reference {int(nan_want.sum())}"
    width = got.element_size()
    bytes_got = got.view(torch.uint8).view(*got.shape, width)
    bytes_want = want.view(torch.uint8).view(*want.shape, width)
    diff = (bytes_got != bytes_want).any(-1) & ~nan_want
    assert not diff.any(), (f"{what}: {int(diff.sum())} values differ, first at {diff.nonzero()[:4].tolist()}: "
                            f"got {got[diff][:4].tolist()}, want {want[diff][:4].tolist()}")


def _store_inputs(tokens, kv_heads, head_dim, dtype):
    x = torch.randn(2, tokens, kv_heads, head_dim) * torch.logspace(0, 1, kv_heads)[None, None, :, None]
    x[:, ::97] *= 1e4                                      # overflow rows (saturation / NaN / inf paths)
    x[0, 0, 0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    return x[0].to(dtype), x[1].to(dtype)


def _random_bytes_like(shape, dtype):
    """A cache pre-filled with random finite bytes, so that untouched slots are checked too."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8) & 0xF7      # clear the low exponent bit: no NaN/inf
    return raw.view(dtype) if dtype.itemsize == 1 else torch.randn(shape).to(dtype)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
def test_store_kv_bytes_match_torch_cast(kern, fmt, per_head, saturate):
    tokens, kv_heads, head_dim, page_size, num_blocks = 1000, 8, 128, 16, 80
    key, value = _store_inputs(tokens, kv_heads, head_dim, torch.bfloat16)
    slots = torch.randperm(num_blocks * page_size)[:tokens]
    slots[::7] = -1
    k_scale = (torch.rand(kv_heads) + 0.01) if per_head else torch.tensor(0.02)
    v_scale = torch.tensor(0.03)
    shape = (num_blocks, page_size, kv_heads, head_dim)
    caches = [_random_bytes_like(shape, CACHE_DTYPES[fmt]) for _ in range(2)]
    want = [c.clone() for c in caches]
    ref.store_kv(key, value, *want, slots, k_scale, v_scale, saturate=saturate)
    got = [c.cuda() for c in caches]
    kern.store_kv(key.cuda(), value.cuda(), *got, slots.cuda(), k_scale.cuda(), v_scale.cuda(), saturate=saturate)
    for name, g, w in zip("kv", got, want):
        _assert_same_codes(g, w, f"{name} cache")


@pytest.mark.parametrize("cache, head_dim, page_size, in_dtype, tokens", [
    ("e5m2", 64, 1, torch.float16, 17),
    ("e4m3", 128, 32, torch.bfloat16, 1),
    ("bf16", 128, 16, torch.bfloat16, 1000),     # plain copy, scales present but ignored
    ("bf16", 64, 16, torch.float16, 17),         # fp16 in, bf16 cache: torch's cast
])
def test_store_kv_shapes_and_bf16_copy(kern, cache, head_dim, page_size, in_dtype, tokens):
    kv_heads, num_blocks = 2, 64
    key, value = _store_inputs(tokens, kv_heads, head_dim, in_dtype)
    slots = torch.randperm(num_blocks * page_size)[:tokens]
    shape = (num_blocks, page_size, kv_heads, head_dim)
    caches = [_random_bytes_like(shape, CACHE_DTYPES[cache]) for _ in range(2)]
    want = [c.clone() for c in caches]
    scale = torch.tensor(0.06)
    ref.store_kv(key, value, *want, slots, scale, scale)
    got = [c.cuda() for c in caches]
    kern.store_kv(key.cuda(), value.cuda(), *got, slots.cuda(), scale.cuda(), scale.cuda())
    for name, g, w in zip("kv", got, want):
        _assert_same_codes(g, w, f"{name} cache")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "bf16"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_store_latent_bytes_match_torch_cast(kern, fmt, page_size):
    tokens, num_blocks = 1000 if page_size == 64 else 17, 32
    latent = (torch.randn(tokens, 512) * 3).bfloat16()
    k_pe = (torch.randn(tokens, 64) * 30).bfloat16()
    latent[::50] *= 1e4
    slots = torch.randperm(num_blocks * page_size)[:tokens]
    slots[1::9] = -1
    cache = _random_bytes_like((num_blocks, page_size, 576), CACHE_DTYPES[fmt])
    want = cache.clone()
    scale = torch.tensor(0.01)
    ref.store_latent(latent, k_pe, want, slots, scale)
    got = cache.cuda()
    kern.store_latent(latent.cuda(), k_pe.cuda(), got, slots.cuda(), scale.cuda())
    _assert_same_codes(got, want, "latent cache")


# ------------------------------------------------------------------ FP8 attention (q_scale / prob_scale)

def _attention_scales(q: torch.Tensor, mode: str) -> dict:
    """decode_attention keywords of one FP8 attention mode (scales from q's amax, as a calibration would)."""
    amax = q.float().abs().amax(dim=-1)                                             # [B, Hq]
    per_head = (amax.amax(0) / ref.FP8_MAX["e4m3"]).contiguous()
    kw = {"q dynamic": dict(q_scale="dynamic"), "q per tensor": dict(q_scale=per_head.amax().reshape(())),
          "q per head": dict(q_scale=per_head), "q saturating": dict(q_scale=per_head.amax().reshape(()) / 8),
          "p": {}, "p saturating": {}}.get(mode.split(" + ")[0], {})
    if mode.endswith("p") or mode == "p saturating":   # ("p saturating" gave no prob_scale before session 5's mlaq)
        kw["prob_scale"] = torch.tensor(1 / 448 if mode != "p saturating" else 1 / 1792, device=q.device)
    return kw


def _check_fp8_attention(kern, case, mode: str, config: dict, num_splits: int = 5) -> None:
    """The kernel against the fp64 emulation of its own definition (reference.decode_attention_fp8, same tiles
    and splits): within 2x torch bf16 SDPA's error against fp64, since what is left is fp32 accumulation, the
    output's bf16 rounding and rare e4m3 ties that fp32 exp2 puts on the other side; and against fp64
    attention of the unquantised Q and P: within the emulation's own error plus 2x torch's (the option's cost is
    the emulation's, nothing more)."""
    from kernels.decode_attention import plan_splits

    kw = _attention_scales(case.q, mode)
    out, lse = kern.decode_attention(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                                     case.k_scale, case.v_scale, case.sm_scale, num_splits, **config, **kw)
    block_n = config["block_n"]
    tps = plan_splits(case.block_table.shape[1] * case.k_cache.shape[1], case.q.shape[0] * case.k_cache.shape[2],
                      block_n, 8, case.q.device, num_splits)[1]
    emul, emul_lse = ref.decode_attention_fp8(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                                              case.k_scale, case.v_scale, case.sm_scale, kw.get("q_scale"),
                                              kw.get("prob_scale"), block_n, tps)
    truth, _, torch_out = _gqa_truth_and_torch(case)
    torch_err = (torch_out.double() - truth).abs().max().item()
    gap = (out.double() - emul).abs().max().item()
    lse_gap = (lse.double() - emul_lse).abs().max().item()
    err = (out.double() - truth).abs().max().item()
    emul_err = (emul - truth).abs().max().item()
    what = (f"fp8 attention {mode} {config} splits={num_splits}: |kernel - emulation| {gap:.3g} = "
            f"{gap / torch_err:.2f}x torch bf16's error {torch_err:.3g}; lse gap {lse_gap:.3g}; kernel error vs fp64 "
            f"{err:.3g}, emulation's {emul_err:.3g}")
    assert gap <= 2.0 * torch_err + 1e-6 * truth.abs().max().item(), what
    assert err <= emul_err + 2 * torch_err, what
    assert_close_verbose(lse, emul_lse, atol=1e-3, rtol=1e-4, what=f"{what}; lse")   # fp32 scores vs fp64
    assert out.isfinite().all()


FP8_ATTENTION_CONFIGS = [pytest.param(dict(block_n=128, num_warps=4, num_stages=2, swap=True), id="swap128"),
                         pytest.param(dict(block_n=128, num_warps=4, num_stages=2, swap=False), id="plain128"),
                         pytest.param(dict(block_n=64, num_warps=4, num_stages=3, swap=True), id="swap64"),
                         # session 8: V widened to fp16 once (and the e4m3 P with it), P.V on fp16 MMAs
                         pytest.param(dict(block_n=128, num_warps=4, num_stages=2, swap=False, widen="v"),
                                      id="plain128-widen-v")]


@pytest.mark.parametrize("mode", ["q dynamic", "q per tensor", "q per head", "p", "q dynamic + p", "q per head + p"])
@pytest.mark.parametrize("config", FP8_ATTENTION_CONFIGS[:2] + FP8_ATTENTION_CONFIGS[3:])
def test_fp8_attention_e4m3(kern, mode, config):
    case = _gqa_case(MIXED_LENGTHS, 16, 32, 8, 128, "e4m3", per_head=True)
    _check_fp8_attention(kern, case, mode, config)


@pytest.mark.parametrize("mode", ["q saturating + p", "p saturating"])
def test_fp8_attention_saturates_as_defined(kern, mode):
    """A q_scale or prob_scale too small for the values: e4m3 saturates at 448, in the kernel as in the emulation."""
    case = _gqa_case(MIXED_LENGTHS, 16, 32, 8, 128, "e4m3", per_head=False)
    _check_fp8_attention(kern, case, mode, dict(block_n=128, num_warps=4, num_stages=2, swap=True))


@pytest.mark.parametrize("fmt", ["e5m2", "bf16"])
@pytest.mark.parametrize("mode", ["q per head + p", "p"])
def test_fp8_attention_other_caches(kern, fmt, mode):
    """Over an e5m2 or bf16 cache the e4m3 Q and P are widened to fp16 / bf16 (exact): same definition, no fp8 MMA."""
    case = _gqa_case(MIXED_LENGTHS, 16, 32, 8, 128, fmt, per_head=fmt != "bf16")
    _check_fp8_attention(kern, case, mode, dict(block_n=128, num_warps=4, num_stages=2, swap=True))


@pytest.mark.parametrize("page_size", [1, 48])
@pytest.mark.parametrize("num_splits", [1, 64])
def test_fp8_attention_pages_and_splits(kern, page_size, num_splits):
    """Ragged lengths over odd page sizes, one split (no merge) and 64 (most splits of the short sequences
    empty): the exact merge of the partial outputs keeps the definition's split boundaries."""
    case = _gqa_case(MIXED_LENGTHS, page_size, 32, 8, 128, "e4m3", per_head=True)
    _check_fp8_attention(kern, case, "q dynamic + p", dict(FP8_ATTENTION_CONFIGS[2].values[0]), num_splits)


def test_fp8_attention_lengths_mha_and_head_dim(kern):
    case = _gqa_case([1, 2, 129, 3000], 16, 16, 16, 64, "e4m3", per_head=True)
    _check_fp8_attention(kern, case, "q per head + p", dict(block_n=128, num_warps=4, num_stages=2, swap=True))


def test_amax_scale_divides_exactly_on_cuda():
    """The reference's scales (and the dynamic-Q emulation) divide as the kernels do (IEEE): torch on CUDA divides by
    a Python scalar as a multiplication by its reciprocal, one bit off for 71 of the 128 bf16 mantissas; that moved
    e4m3 ties of Q and failed every dynamic-Q agreement test on the H100 (session 5) before amax_scale divided by a
    tensor."""
    amax = torch.arange(128, 256, device="cuda", dtype=torch.float32) * 2.0 ** -7
    exact = (amax.double() / 448).float()                          # correctly rounded quotient
    assert torch.equal(ref.amax_scale(amax, "e4m3"), exact)


@pytest.mark.parametrize("num_splits, dim", [(1, 128), (7, 80), (49, 512), (300, 64), (600, 128)])
@pytest.mark.parametrize("sinks", [False, True])
def test_merge_splits_against_fp64(kern, num_splits, dim, sinks):
    """`splits.merge_splits` (a program per row and column chunk, the splits read as tiles of up to 256) against the
    fp64 sum of its definition: out = sum_s 2^(lse_s - m) out_s / (sum_s 2^(lse_s - m) [+ 2^(sink log2 e - m)]), lse
    its natural log, on split counts that take one tile, part of one, and several (300, 600), a head size no power of
    two, empty splits (lse -inf, partial 0) and a row whose splits are all empty (0 and lse -inf, or the sink's alone).
    fp32 sums of up to 600 terms in [0, 1] times values of ~1 into an fp32 output: within 1e-5 of fp64, relative. A NaN
    partial makes its row NaN and no other."""
    from kernels.splits import merge_splits

    torch.manual_seed(0)
    batch, heads = 3, 4
    part = torch.randn(batch, heads, num_splits, dim, device="cuda")
    lse = torch.randn(batch, heads, num_splits, device="cuda") * 4
    lse[0, 1, ::3] = float("-inf")                        # empty splits
    part[0, 1, ::3] = 0.0
    lse[2, 3] = float("-inf")                             # a row of empty splits only
    part[2, 3] = 0.0
    sink = torch.randn(heads, device="cuda") if sinks else None
    out = torch.empty(batch, heads, dim, dtype=torch.float32, device="cuda")
    got_lse = merge_splits(part, lse, out, sink)
    l64 = lse.double() * math.log(2)                      # the partials' lse is base 2
    if sinks:
        terms = torch.cat([l64, sink.double()[None, :, None].expand(batch, heads, 1)], dim=-1)
    else:
        terms = l64
    want_lse = torch.logsumexp(terms, dim=-1)
    weights = torch.exp(l64 - want_lse[..., None])
    want = torch.where(want_lse[..., None] == float("-inf"), 0.0,
                       (weights.nan_to_num(0.0)[..., None] * part.double()).sum(2))
    assert torch.equal(got_lse.isinf(), want_lse.isinf())
    finite = want_lse.isfinite()
    assert (got_lse.double() - want_lse)[finite].abs().max().item() <= 1e-5 * max(1.0, want_lse[finite].abs().max())
    assert (out.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    if not sinks:
        assert out[2, 3].eq(0).all()
    part[1, 2, num_splits // 2, dim // 3] = float("nan")
    again = torch.empty_like(out)
    merge_splits(part, lse, again, sink)
    assert again[1, 2].isnan().any() and torch.equal(again[1, 0], out[1, 0]) and torch.equal(again[0], out[0])
