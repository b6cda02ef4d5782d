"""CPU tests of the kernels' torch references (kernels/reference.py) and of the launchers' argument checks.

The launchers need triton to import; their checks run before any launch, so CPU tensors reach them.
"""

from __future__ import annotations

import math

import pytest
import torch

from interpreted import run_script
from kernels import reference as ref

FORMATS = ["e4m3", "e5m2"]


def _codes(fmt: str) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(ref.fp8_dtype(fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0 ** -7])   # powers of two: codes * scale / scale is exact
def test_all_256_codes_round_trip(fmt, scale):
    codes = _codes(fmt)
    values = ref.dequantize(codes, scale)
    back = ref.quantize(values, scale, fmt, saturate=False)
    nan = values.isnan()
    assert torch.equal(back.view(torch.uint8)[~nan], codes.view(torch.uint8)[~nan])
    assert back.float()[nan].isnan().all()
    assert int(nan.sum()) == (2 if fmt == "e4m3" else 6)      # e4m3: S.1111.111; e5m2: S.11111.{01,10,11}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("saturate", [True, False])
def test_quantize_bytes_equal_torch_cast_in_range(fmt, saturate):
    scale = torch.tensor(0.37)
    x = torch.randn(4096) * ref.FP8_MAX[fmt] * 0.37 / 4                  # in range: overflow is tested below
    x[:64] = torch.randn(64) * 1e-5                                      # subnormals and underflow
    got = ref.quantize(x, scale, fmt, saturate=saturate)
    want = (x / scale).to(ref.fp8_dtype(fmt))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _written_out(x: torch.Tensor, scale, fmt: str, saturate: bool) -> torch.Tensor:
    """quantize as it read before it lost two passes (x widened by a copy, NaN kept by isnan + where)."""
    scaled = x.float() / torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    limit, over = ref.FP8_MAX[fmt], ref.OVERFLOW_AT[fmt]
    if saturate:
        scaled = torch.where(scaled.isnan(), scaled, scaled.clamp(-limit, limit))
    elif fmt == "e4m3":
        scaled = torch.where(scaled.abs() > over, torch.copysign(torch.tensor(math.nan), scaled), scaled)
    else:
        scaled = torch.where(scaled.abs() >= over, torch.copysign(torch.tensor(math.inf), scaled), scaled)
    return scaled.to(ref.fp8_dtype(fmt))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_is_its_written_out_definition(device, dtype):
    """quantize divides a bf16/fp16 x by a dimensioned fp32 scale (the op widens x as it reads it) and clamps in
    place: the same bytes as x.float() / scale with NaN kept by isnan + where, on every value class (40 binades,
    NaN of both signs, inf, overflow) and scale shape (a float, [], per head, per token), both formats and modes."""
    torch.manual_seed(0)
    x = (torch.randn(2, 3, 40, 64) * torch.logspace(-40, 40, 64, base=2)).to(dtype).to(device)
    x.view(-1)[::97], x.view(-1)[::89] = math.nan, -math.nan
    x.view(-1)[5], x.view(-1)[6] = math.inf, -math.inf
    for fmt in FORMATS:
        per_head = torch.tensor([0.3, 1.7, 0.05], device=device).view(-1, 1, 1)
        for scale in (0.5, torch.tensor(0.37, device=device), per_head, ref.per_token_scale(x, fmt)):
            for saturate in (True, False):
                got, want = ref.quantize(x, scale, fmt, saturate), _written_out(x, scale, fmt, saturate)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (fmt, scale, saturate)


# value, saturated result, non-saturating result (e4m3 overflow -> NaN, e5m2 overflow -> inf)
SPECIALS = {
    "e4m3": [(448.0, 448.0, 448.0), (464.0, 448.0, 448.0), (465.0, 448.0, math.nan), (-1e6, -448.0, math.nan),
             (math.inf, 448.0, math.nan), (math.nan, math.nan, math.nan), (2.0 ** -10, 0.0, 0.0)],
    "e5m2": [(57344.0, 57344.0, 57344.0), (61439.0, 57344.0, 57344.0), (61440.0, 57344.0, math.inf),
             (-1e9, -57344.0, -math.inf), (math.inf, 57344.0, math.inf), (math.nan, math.nan, math.nan)],
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_and_nan(fmt):
    x, sat, plain = (torch.tensor(col) for col in zip(*SPECIALS[fmt]))
    torch.testing.assert_close(ref.quantize(x, 1.0, fmt, saturate=True).float(), sat, equal_nan=True)
    torch.testing.assert_close(ref.quantize(x, 1.0, fmt, saturate=False).float(), plain, equal_nan=True)


def _slots(tokens: int, num_slots: int, skip: tuple[int, ...] = (3,)) -> torch.Tensor:
    slots = torch.randperm(num_slots)[:tokens]
    slots[[s for s in skip if s < tokens]] = -1
    return slots


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True])
def test_store_kv_reference_writes_slots(cache_dtype, per_head):
    tokens, heads, dim, blocks, block_size = 17, 2, 8, 4, 8
    key, value = torch.randn(2, tokens, heads, dim, dtype=torch.bfloat16)
    k_cache = torch.zeros(blocks, block_size, heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.tensor([0.01, 0.02]) if per_head else torch.tensor(0.01)
    v_scale = torch.tensor(0.03)
    slots = _slots(tokens, blocks * block_size)
    ref.store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    written = k_cache.flatten(0, 1).float()
    for n, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        if cache_dtype == torch.bfloat16:
            assert torch.equal(written[slot], key[n].float())             # plain copy, scales ignored
        else:
            want = ref.quantize(key[n], k_scale.reshape(-1, 1) if per_head else k_scale, ref.fp8_format(cache_dtype))
            assert torch.equal(written[slot], want.float())
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (written[untouched] == 0).all()


def test_store_latent_reference_writes_latent_then_rope():
    latent, k_pe = torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(5, 4, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 20, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([7, -1, 0, 3, 4])
    ref.store_latent(latent, k_pe, cache, slots, torch.tensor(0.01))
    rows = cache.flatten(0, 1)
    want = ref.quantize(torch.cat([latent, k_pe], -1), 0.01, "e4m3")
    assert torch.equal(rows[[7, 0, 3, 4]].view(torch.uint8), want[[0, 2, 3, 4]].view(torch.uint8))
    assert (rows[[1, 2, 5, 6]].float() == 0).all()


def _paged(lengths, block_size, tail, cache_dtype, scale, table=None):
    """Random cache values scattered over shuffled pages (or `table`'s); returns (cache, block_table,
    per-sequence fp64 values in token order, built without the reference's read path)."""
    pages = [-(-n // block_size) for n in lengths]
    total = sum(pages) + 2
    if table is None:
        order = torch.randperm(total)
        table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
        for b, p in enumerate(pages):
            table[b, :p] = order[sum(pages[:b]):sum(pages[:b]) + p].int()
    cache = torch.zeros(total, block_size, *tail, dtype=cache_dtype)
    dense = []
    for b, n in enumerate(lengths):
        x = torch.randn(n, *tail)
        codes = x.to(cache_dtype) if cache_dtype == torch.bfloat16 else ref.quantize(x, scale, ref.fp8_format(cache_dtype))
        slots = (table[b, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size)
        ref._write_slots(cache, slots, codes)
        values = codes.double() if cache_dtype == torch.bfloat16 else codes.double() * torch.as_tensor(scale).double()
        dense.append(values)
    return cache, table, dense


def _naive_attention_fp64(q, k, v, sm_scale):
    """q [H, D], k/v [L, H, D] fp64 -> out [H, D], lse [H] by explicit loops over heads."""
    out = torch.zeros(q.shape[0], v.shape[-1], dtype=torch.float64)
    lse = torch.zeros(q.shape[0], dtype=torch.float64)
    for h in range(q.shape[0]):
        s = (k[:, h] @ q[h]) * sm_scale
        w = torch.exp(s - s.max())
        out[h] = (w[:, None] * v[:, h]).sum(0) / w.sum()
        lse[h] = s.max() + torch.log(w.sum())
    return out, lse


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (8, 2)])
def test_decode_attention_reference_vs_naive_fp64(cache_dtype, q_heads, kv_heads):
    lengths, dim, sm_scale = [1, 17, 40], 16, 0.25
    k_scale, v_scale = torch.rand(kv_heads) * 0.02 + 0.005, torch.tensor(0.01)
    k_cache, table, k_dense = _paged(lengths, 8, (kv_heads, dim), cache_dtype, k_scale.reshape(-1, 1))
    v_cache, _, v_dense = _paged(lengths, 8, (kv_heads, dim), cache_dtype, v_scale, table)
    q = torch.randn(len(lengths), q_heads, dim)
    out, lse = ref.decode_attention(q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32),
                                    k_scale, v_scale, sm_scale)
    group = q_heads // kv_heads
    for b in range(len(lengths)):
        k = k_dense[b].repeat_interleave(group, 1)
        v = v_dense[b].repeat_interleave(group, 1)
        want_out, want_lse = _naive_attention_fp64(q[b].double(), k, v, sm_scale)
        torch.testing.assert_close(out[b].double(), want_out, atol=1e-5, rtol=1e-5)   # fp32 math vs fp64
        torch.testing.assert_close(lse[b].double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sinks, softcap, window", [(True, None, None), (False, 3.0, None), (False, None, 9),
                                                   (True, 3.0, 9)], ids=["sinks", "softcap", "window", "all"])
def test_decode_attention_reference_sinks_softcap_window_vs_naive_fp64(sinks, softcap, window):
    """The mirror's attention beyond SDPA, against loops written from the definitions: a window drops the tokens
    before it, soft-capping bends each score, a sink adds exp(sink) to the denominator and nothing to the sum."""
    lengths, dim, sm_scale, heads = [1, 17, 40], 16, 0.25, 4
    k_cache, table, k_dense = _paged(lengths, 8, (heads, dim), torch.float8_e4m3fn, 0.02)
    v_cache, _, v_dense = _paged(lengths, 8, (heads, dim), torch.float8_e4m3fn, 0.01, table)
    q = torch.randn(len(lengths), heads, dim) * 20  # scores of several units: soft-capping at 3 bends them
    sink = torch.randn(heads) if sinks else None
    first = torch.tensor([max(0, n - window) for n in lengths], dtype=torch.int32) if window else None
    out, lse = ref.decode_attention(q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32),
                                    torch.tensor(0.02), torch.tensor(0.01), sm_scale, sinks=sink, softcap=softcap,
                                    first_key=first)
    for b in range(len(lengths)):
        begin = int(first[b]) if first is not None else 0
        for h in range(heads):
            scores = [float(k_dense[b][j, h].double() @ q[b, h].double()) * sm_scale for j in range(begin, lengths[b])]
            if softcap:
                scores = [softcap * math.tanh(x / softcap) for x in scores]
            terms = scores + ([float(sink[h])] if sinks else [])
            top = max(terms)
            denominator = sum(math.exp(x - top) for x in terms)
            want = sum(math.exp(x - top) * v_dense[b][begin + j, h].double() for j, x in enumerate(scores)) / denominator
            torch.testing.assert_close(out[b, h].double(), want, atol=1e-5, rtol=1e-5)   # fp32 math vs fp64
            assert abs(float(lse[b, h]) - (top + math.log(denominator))) < 1e-5


def test_decode_attention_reference_bf16_cache_ignores_scales():
    k_cache, table, _ = _paged([9, 30], 4, (2, 16), torch.bfloat16, None)
    v_cache = torch.randn_like(k_cache)
    q, lens = torch.randn(2, 4, 16, dtype=torch.bfloat16), torch.tensor([9, 30], dtype=torch.int32)
    with_scales = ref.decode_attention(q, k_cache, v_cache, table, lens, torch.tensor(0.06), torch.tensor(0.06), 0.25)
    without = ref.decode_attention(q, k_cache, v_cache, table, lens, None, None, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(with_scales, without))


def test_decode_attention_reference_nan_code_stays_nan_and_an_empty_window_is_zero():
    """A NaN K code (e4m3 stored without saturation) makes NaN exactly the heads that read it, as the kernel does
    (tests/test_kernels_gpu.py::test_decode_attention_nan_and_overflow compares them on a GPU: the mirror once
    zeroed such heads while zeroing a window's empty sum); a row whose window holds no key reads 0, lse -inf."""
    k_cache, table, _ = _paged([9, 30], 4, (2, 16), torch.bfloat16, None)
    v_cache = torch.randn_like(k_cache)
    k_cache[table[1, 1], 0, 1, 3] = float("nan")  # sequence 1, token 4 (its second page's first), kv head 1
    q, lens = torch.randn(2, 4, 16, dtype=torch.bfloat16), torch.tensor([9, 30], dtype=torch.int32)
    out, lse = ref.decode_attention(q, k_cache, v_cache, table, lens, None, None, 0.25)
    nan_heads = out.isnan().any(dim=-1)
    assert nan_heads.tolist() == [[False] * 4, [False, False, True, True]], nan_heads  # q heads 2, 3 read kv head 1
    out, lse = ref.decode_attention(q, k_cache, v_cache, table, lens, None, None, 0.25,
                                    first_key=torch.tensor([9, 0], dtype=torch.int32))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_mla_decode_reference_vs_naive_fp64(cache_dtype):
    lengths, heads, latent_dim, rope_dim, sm_scale = [1, 17, 33], 3, 32, 8, 0.1
    scale = torch.tensor(0.02)
    cache, table, dense = _paged(lengths, 16, (latent_dim + rope_dim,), cache_dtype, scale)
    q_latent, q_pe = torch.randn(len(lengths), heads, latent_dim), torch.randn(len(lengths), heads, rope_dim)
    out, lse = ref.mla_decode(q_latent, q_pe, cache, table, torch.tensor(lengths, dtype=torch.int32), scale, sm_scale)
    for b in range(len(lengths)):
        rows = dense[b]                                                   # [L, Dc + Dr]
        q = torch.cat([q_latent[b], q_pe[b]], -1).double()               # [H, Dc + Dr]
        k = rows[:, None, :].expand(-1, heads, -1)
        v = rows[:, None, :latent_dim].expand(-1, heads, -1)
        want_out, want_lse = _naive_attention_fp64(q, k, v, sm_scale)
        torch.testing.assert_close(out[b].double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b].double(), want_lse, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ launcher argument checks (no launch)

def _gqa_args(**over):
    args = dict(q=torch.randn(2, 8, 64, dtype=torch.bfloat16),
                k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn),
                v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn),
                block_table=torch.zeros(2, 2, dtype=torch.int32), seq_lens=torch.ones(2, dtype=torch.int32),
                k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0), sm_scale=0.125)
    return {**args, **over}


GQA_BAD = {
    "q fp32": dict(q=torch.randn(2, 8, 64)),
    "Hq not multiple of Hkv": dict(q=torch.randn(2, 7, 64, dtype=torch.bfloat16)),
    "head_dim mismatch": dict(q=torch.randn(2, 8, 32, dtype=torch.bfloat16)),
    "block_table int64": dict(block_table=torch.zeros(2, 2, dtype=torch.int64)),
    "seq_lens wrong batch": dict(seq_lens=torch.ones(3, dtype=torch.int32)),
    "k_scale missing": dict(k_scale=None),
    "v_scale fp16": dict(v_scale=torch.tensor(1.0, dtype=torch.float16)),
    "k_scale wrong heads": dict(k_scale=torch.ones(3)),
    "cache fp16 with bf16 q": dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float16),
                                   v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float16)),
    "cpu tensors": {},
}


@pytest.mark.parametrize("case", list(GQA_BAD))
def test_decode_attention_launcher_rejects_before_launch(case):
    decode_attention = pytest.importorskip("kernels.decode_attention").decode_attention
    with pytest.raises(AssertionError):
        decode_attention(**_gqa_args(**GQA_BAD[case]))


def _store_args(**over):
    args = dict(key=torch.randn(3, 2, 64, dtype=torch.bfloat16), value=torch.randn(3, 2, 64, dtype=torch.bfloat16),
                k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e5m2),
                v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e5m2),
                slot_mapping=torch.tensor([0, 5, -1]), k_scale=torch.ones(2), v_scale=torch.tensor(1.0))
    return {**args, **over}


STORE_BAD = {
    "slot_mapping int32": dict(slot_mapping=torch.tensor([0, 5, -1], dtype=torch.int32)),
    "slot_mapping wrong length": dict(slot_mapping=torch.tensor([0, 5])),
    "key/value shape differ": dict(value=torch.randn(3, 2, 32, dtype=torch.bfloat16)),
    "cache heads mismatch": dict(k_cache=torch.zeros(4, 16, 1, 64, dtype=torch.float8_e5m2)),
    "cache int8": dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.int8), v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.int8)),
    "k_scale python float": dict(k_scale=0.5),
    "cpu tensors": {},
}


@pytest.mark.parametrize("case", list(STORE_BAD))
def test_store_kv_launcher_rejects_before_launch(case):
    store_kv = pytest.importorskip("kernels.store_kv").store_kv
    with pytest.raises(AssertionError):
        store_kv(**_store_args(**STORE_BAD[case]))


def _mla_args(**over):
    args = dict(q_latent=torch.randn(2, 16, 512, dtype=torch.bfloat16), q_pe=torch.randn(2, 16, 64, dtype=torch.bfloat16),
                cache=torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn), block_table=torch.zeros(2, 1, dtype=torch.int32),
                seq_lens=torch.ones(2, dtype=torch.int32), scale=torch.tensor(1.0), sm_scale=0.1)
    return {**args, **over}


MLA_BAD = {
    "cache width != Dc + Dr": dict(cache=torch.zeros(4, 64, 512, dtype=torch.float8_e4m3fn)),
    "per-head scale": dict(scale=torch.ones(16)),
    "q_pe heads differ": dict(q_pe=torch.randn(2, 8, 64, dtype=torch.bfloat16)),
    "cpu tensors": {},
}


@pytest.mark.parametrize("case", list(MLA_BAD))
def test_mla_decode_launcher_rejects_before_launch(case):
    mla_decode = pytest.importorskip("kernels.mla_decode").mla_decode
    with pytest.raises(AssertionError):
        mla_decode(**_mla_args(**MLA_BAD[case]))


def test_store_latent_launcher_rejects_before_launch():
    store_latent = pytest.importorskip("kernels.store_kv").store_latent
    latent, k_pe = torch.randn(3, 512, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 576, dtype=torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match="scale"):
        store_latent(latent, k_pe, cache, torch.tensor([0, 1, 2]), torch.ones(4))
    with pytest.raises(AssertionError, match="CUDA"):
        store_latent(latent, k_pe, cache, torch.tensor([0, 1, 2]), torch.tensor(1.0))


# ------------------------------------------------------------------ FP8 attention: the kernel's definition

def _one_sequence(scores_per_token: torch.Tensor, values: torch.Tensor):
    """A 1-head cache whose scores against q = e_0 (sm_scale 1) are `scores_per_token`: K_j = s_j e_0."""
    n, dim = values.shape
    k = torch.zeros(n, 1, dim, dtype=torch.float32)
    k[:, 0, 0] = scores_per_token
    v = values[:, None, :].float()
    table = torch.arange(-(-n // 4), dtype=torch.int32).view(1, -1)
    caches = [torch.zeros(table.shape[1], 4, 1, dim, dtype=torch.float32) for _ in range(2)]
    for cache, rows in zip(caches, (k, v)):
        cache.view(-1, 1, dim)[:n] = rows
    q = torch.zeros(1, 1, dim)
    q[0, 0, 0] = 1.0
    return q, caches, table, torch.tensor([n], dtype=torch.int32)


def test_fp8_attention_p_by_hand():
    """Two tokens, scores 0 and ln 0.3: p = (1, 0.3); with prob_scale 1/448, e4m3(448) = 448 and e4m3(134.4) = 128
    (e4m3 steps by 16 in [128, 256)), so out = (v0 + 128/448 v1) / 1.3, not renormalised."""
    q, (kc, vc), table, lens = _one_sequence(torch.tensor([0.0, math.log(0.3)]), torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    out, lse = ref.decode_attention_fp8(q, kc, vc, table, lens, None, None, 1.0, None, torch.tensor(1 / 448))
    r = float(torch.tensor(1 / 448, dtype=torch.float32).reciprocal())          # fp32(1 / prob_scale)
    assert r == pytest.approx(448, rel=1e-6)
    want = torch.tensor([448.0, 128.0]) / 448 / 1.3
    torch.testing.assert_close(out[0, 0], want.double(), atol=1e-6, rtol=1e-6)
    assert lse[0, 0].item() == pytest.approx(math.log(1.3), abs=1e-6)   # scores stored in an fp32 cache


def test_fp8_attention_tiles_set_the_running_max():
    """Tile 1 holds score 0, tile 2 score ln 8: tile 1's p = 1 is quantised against its own max, tile 2's against
    the new one; with prob_scale 1 every p here is a power of two (exact in e4m3), so the result is exact attention
    whatever the tiling, while a p of 0.3 would round differently per tiling."""
    scores = torch.tensor([0.0, math.log(0.5), math.log(8.0), math.log(2.0)], dtype=torch.float64)
    values = torch.eye(4)
    q, (kc, vc), table, lens = _one_sequence(scores, values)
    exact = torch.softmax(scores.double(), 0)
    for block_n, tps in ((2, 2), (2, 4), (4, 4), (1, 2)):
        out, _ = ref.decode_attention_fp8(q, kc, vc, table, lens, None, None, 1.0, None, torch.tensor(1.0),
                                          block_n, tps)
        torch.testing.assert_close(out[0, 0], exact, atol=1e-8, rtol=0)   # scores stored in an fp32 cache
    running = ref._running_tile_max(scores.view(1, -1), 2, 4)
    assert running.tolist() == [[0.0, 0.0, math.log(8.0), math.log(8.0)]]
    assert ref._running_tile_max(scores.view(1, -1), 2, 2).tolist() == [[0.0, 0.0, math.log(8.0), math.log(8.0)]]
    assert ref._running_tile_max(scores.view(1, -1), 1, 2)[0, 1].item() == 0.0     # max(0, ln 0.5) within split 1


def test_fp8_attention_q_matches_attention_fp8():
    """Q alone (no P quantisation): the kernel's definition is the torch reference's (per-head dynamic or one
    scale), so both agree to fp32 rounding."""
    torch.manual_seed(3)
    lengths, kv_heads, q_heads, dim = [5, 40], 2, 8, 16
    k_cache, table, k_dense = _paged(lengths, 8, (kv_heads, dim), torch.bfloat16, None)
    v_cache, _, v_dense = _paged(lengths, 8, (kv_heads, dim), torch.bfloat16, None, table)
    q = torch.randn(len(lengths), q_heads, dim, dtype=torch.bfloat16)
    seq = torch.tensor(lengths, dtype=torch.int32)
    for q_scale in ("dynamic", torch.tensor(0.01)):
        out, _ = ref.decode_attention_fp8(q, k_cache, v_cache, table, seq, None, None, 0.25, q_scale, None)
        for b, n in enumerate(lengths):
            want, _ = ref.attention_fp8(q[b].float()[None, :, None], k_dense[b].transpose(0, 1)[None].float(),
                                        v_dense[b].transpose(0, 1)[None].float(), 0.25, None, q_scale, None)
            torch.testing.assert_close(out[b].float(), want[0, 0].float(), atol=2e-5, rtol=2e-5)


def test_fp8_attention_p_error_is_the_size_of_the_normalised_references():
    """Tile-relative vs normalised P quantisation round different values by the same relative step, but the
    tile-relative one holds each tile's largest p at exactly 1 (448 in e4m3, no error), and the largest weights
    dominate a peaked row: its error is smaller (measured 0.36x here, seed 4), never larger."""
    torch.manual_seed(4)
    lengths, kv_heads, q_heads, dim = [700], 2, 8, 32
    k_cache, table, k_dense = _paged(lengths, 16, (kv_heads, dim), torch.bfloat16, None)
    v_cache, _, v_dense = _paged(lengths, 16, (kv_heads, dim), torch.bfloat16, None, table)
    q = torch.randn(1, q_heads, dim, dtype=torch.bfloat16) * 3
    seq = torch.tensor(lengths, dtype=torch.int32)
    ps = torch.tensor(1 / 448)
    exact, _ = ref.decode_attention_fp8(q, k_cache, v_cache, table, seq, None, None, dim ** -0.5, None, None)
    tiled, _ = ref.decode_attention_fp8(q, k_cache, v_cache, table, seq, None, None, dim ** -0.5, None, ps, 128, 256)
    k = k_dense[0].transpose(0, 1)[None]
    v = v_dense[0].transpose(0, 1)[None]
    normalised, _ = ref.attention_fp8(q[0][None, :, None].double(), k, v, dim ** -0.5, None, None, ps)
    tiled_err = (tiled - exact).norm().item()
    normalised_err = (normalised[0, 0].double() - exact[0]).norm().item()
    assert tiled_err > 0 and normalised_err > 0
    assert 0.1 <= tiled_err / normalised_err <= 1.0, (tiled_err, normalised_err)


FP8_ATTENTION_BAD = {
    "q_scale other string": (dict(q_scale="static"), 'q_scale must be "dynamic"'),
    "q_scale wrong heads": (dict(q_scale=torch.ones(3)), "q_scale must be an fp32 tensor of shape"),
    "q_scale fp16": (dict(q_scale=torch.tensor(1.0, dtype=torch.float16)), "q_scale must be an fp32 tensor"),
    "prob_scale per head": (dict(prob_scale=torch.ones(8)), "prob_scale must be an fp32 tensor of shape"),
    "prob_scale float": (dict(prob_scale=0.002), "prob_scale must be an fp32 tensor"),
    "qk_fp8 and q_scale": (dict(qk_fp8=True, q_scale="dynamic"), "not both"),
}


@pytest.mark.parametrize("case", list(FP8_ATTENTION_BAD))
def test_fp8_attention_launcher_rejects_bad_scales(case):
    decode_attention = pytest.importorskip("kernels.decode_attention").decode_attention
    over, message = FP8_ATTENTION_BAD[case]
    with pytest.raises(AssertionError, match=message):
        decode_attention(**_gqa_args(), **over)


# ------------------------------------------------------------------ FP8 attention in MLA: the same definition

def test_mla_fp8_attention_p_by_hand():
    """One head, Dc = 4, Dr = 2: q_latent = e_0 and c_j[0] = s_j give scores 0 and ln 0.3, so p = (1, 0.3); with
    prob_scale 1/448, e4m3(448) = 448 and e4m3(134.4) = 128: out = (c_0 + 128/448 c_1) / 1.3 (not renormalised),
    the output in latent space (the RoPE part scores, never sums)."""
    c = torch.tensor([[0.0, 1.0, 0.0, 0.0], [math.log(0.3), 0.0, 1.0, 0.0]])
    cache = torch.zeros(1, 4, 6)
    cache[0, :2, :4] = c
    q_latent, q_pe = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]), torch.zeros(1, 1, 2)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    out, lse = ref.mla_decode_fp8(q_latent, q_pe, cache, table, lens, None, 1.0, None, torch.tensor(1 / 448))
    want = (c[0] + 128 / 448 * c[1]).double() / 1.3
    torch.testing.assert_close(out[0, 0], want, atol=1e-6, rtol=1e-6)
    assert lse[0, 0].item() == pytest.approx(math.log(1.3), abs=1e-6)
    exact, _ = ref.mla_decode_fp8(q_latent, q_pe, cache, table, lens, None, 1.0, None, None)
    torch.testing.assert_close(exact[0, 0], (c[0] + 0.3 * c[1]).double() / 1.3, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("q_scale", [None, "dynamic", "per tensor", "per head"])
@pytest.mark.parametrize("prob_scale, block_n, tokens_per_split", [(None, 32, None), (1 / 448, 32, None),
                                                                   (1 / 448, 16, 64), (1 / 1792, 32, 32)])
def test_mla_fp8_attention_is_the_gqa_definition_with_one_latent_head(q_scale, prob_scale, block_n, tokens_per_split):
    """MLA = GQA with one KV head whose K row is [c | k_pe] and V row [c | 0]: the emulations agree to fp64
    rounding for every Q mode, P scale (1/1792 saturates the tile maxima at 448), tile size and split plan."""
    torch.manual_seed(5)
    lengths, heads, dc, dr = [1, 17, 150, 64], 4, 32, 16
    scale = torch.tensor(0.05)
    cache, table, _ = _paged(lengths, 16, (dc + dr,), torch.float8_e4m3fn, scale)
    q_latent = torch.randn(len(lengths), heads, dc, dtype=torch.bfloat16) * 2
    q_pe = torch.randn(len(lengths), heads, dr, dtype=torch.bfloat16)
    amax = torch.cat([q_latent, q_pe], -1).float().abs().amax(-1).amax(0)          # [H]
    qs = {"per tensor": ref.amax_scale(amax.amax(), "e4m3") / 2, "per head": ref.amax_scale(amax, "e4m3")}.get(
        q_scale, q_scale)
    ps = None if prob_scale is None else torch.tensor(prob_scale)
    seq = torch.tensor(lengths, dtype=torch.int32)
    out, lse = ref.mla_decode_fp8(q_latent, q_pe, cache, table, seq, scale, 0.2, qs, ps, block_n, tokens_per_split)
    v_cache = cache.clone()
    v_cache.view(torch.uint8)[..., dc:] = 0                                         # e4m3 code 0 is +0
    want, want_lse = ref.decode_attention_fp8(torch.cat([q_latent, q_pe], -1), cache.unsqueeze(2),
                                              v_cache.unsqueeze(2), table, seq, scale, scale, 0.2, qs, ps, block_n,
                                              tokens_per_split)
    torch.testing.assert_close(out, want[..., :dc], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
    if q_scale is not None or prob_scale is not None:   # the options change the result (not silently dropped)
        plain, _ = ref.mla_decode_fp8(q_latent, q_pe, cache, table, seq, scale, 0.2, None, None)
        assert (out - plain).abs().max() > 1e-4
        via_op, op_lse = ref.mla_decode(q_latent, q_pe, cache, table, seq, scale, 0.2, q_scale=qs, prob_scale=ps,
                                        block_n=block_n, tokens_per_split=tokens_per_split)   # the plug-in op
        assert torch.equal(via_op, out.to(torch.bfloat16)) and torch.equal(op_lse, lse.float())


MLA_FP8_ATTENTION_BAD = {
    "q_scale wrong heads": (dict(q_scale=torch.ones(3)), "q_scale must be an fp32 tensor of shape"),
    "q_scale other string": (dict(q_scale="e5m2"), 'q_scale must be "dynamic"'),
    "prob_scale per head": (dict(prob_scale=torch.ones(16)), "prob_scale must be an fp32 tensor of shape"),
    "fp8_mma and prob_scale": (dict(fp8_mma=True, prob_scale=torch.tensor(1 / 448)), "not both"),
    "non power-of-two Dc": (dict(q_latent=torch.randn(2, 16, 384, dtype=torch.bfloat16), q_scale="dynamic",
                                 cache=torch.zeros(4, 64, 448, dtype=torch.float8_e4m3fn)), "tile kernel only"),
    "register prefetch": (dict(prefetch=True, prob_scale=torch.tensor(1 / 448)), "tile kernel only"),
    "tma off": (dict(tma=False, q_scale="dynamic"), "tile kernel only"),
}


@pytest.mark.parametrize("case", list(MLA_FP8_ATTENTION_BAD))
def test_mla_fp8_attention_launcher_refuses(case):
    mla_decode = pytest.importorskip("kernels.mla_decode").mla_decode
    over, message = MLA_FP8_ATTENTION_BAD[case]
    with pytest.raises(AssertionError, match=message):
        mla_decode(**_mla_args(**over))


@pytest.fixture(scope="module")
def interpreted_beyond_sdpa() -> dict:
    return run_script("decode_attention_interpreted.py")


@pytest.mark.parametrize("case", [f"{name}-splits{s}-prefetch{p}" for name in ("sinks", "softcap", "window",
                                                                               "chunked", "all")
                                  for s in (1, 3) for p in (0, 1)])
def test_decode_kernel_sinks_softcap_window_under_the_interpreter(interpreted_beyond_sdpa, case):
    """The Triton kernel's logic (fp16 cache: no fp8 cast, which the interpreter mis-rounds) against the mirror:
    within 2e-3, two fp16 ulps of the outputs (|out| < 4; measured 9.8e-4, one ulp, in every case, as for plain
    attention); each feature moves the output by 0.13 or more, so a kernel that ignored one could not pass."""
    found = interpreted_beyond_sdpa[case]
    assert found["kernel_vs_mirror"] <= 2e-3 and found["moved"] > 0.1, found
