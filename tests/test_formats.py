"""KV formats (harness/kv_paths/formats.py) against independent definitions: torch's own float8 / float8_e8m0fnu /
float4_e2m1fn_x2 dtypes, the OCP MX v1.0 and NVFP4 definitions written out here, float64 error bounds, and
compressed-tensors' quantiser (the field library chosen: pure Python, installs on a CPU torch; skipped where absent).
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.kv_paths import formats as F
from kernels import reference as fp8

# OCP MX v1.0 e2m1, written from the bit fields (1 sign, 2 exponent bias 1, 1 mantissa; exponent 0 is subnormal)
def ocp_e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def every_bf16() -> torch.Tensor:
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


# -- element types ---------------------------------------------------------------------------------------------------

def test_every_e2m1_code_decodes_to_the_ocp_value():
    codes = torch.arange(16, dtype=torch.uint8)
    assert F.e2m1_values(codes).tolist() == [ocp_e2m1(c) for c in range(16)]


def test_every_e2m1_code_encodes_back_to_itself():
    codes = torch.arange(16, dtype=torch.uint8)
    assert F.e2m1_codes(F.e2m1_values(codes)).tolist() == list(range(16))  # -0 keeps its sign bit (code 8)


@pytest.mark.parametrize("value, code", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # ties go to the even code
    (0.2500001, 1), (4.9999, 6), (5.0001, 7),  # just off a tie
    (6.0, 7), (7.0, 7), (1e30, 7), (float("inf"), 7),  # saturation at 6
    (-0.1, 8), (-5.0, 14), (float("-inf"), 15), (float("nan"), 0),  # sign bit; NaN -> +0 (its block scale is NaN)
])
def test_e2m1_rounding_ties_saturation(value, code):
    assert F.e2m1_codes(torch.tensor([value])).item() == code


def test_e2m1_packing_is_torchs_float4_e2m1fn_x2_byte_order():
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip(f"torch {torch.__version__} has no float4_e2m1fn_x2")
    codes = torch.tensor([1, 2, 15, 8, 7, 0], dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.tolist() == [0x21, 0x8F, 0x07]  # even index in the low nibble
    as_torch = packed.view(torch.float4_e2m1fn_x2)  # torch stores two e2m1 a byte, no conversion on the CPU
    assert as_torch.view(torch.uint8).tolist() == packed.tolist()
    assert torch.equal(F.unpack_e2m1(packed), codes)


def test_every_e8m0_bit_pattern_decodes_as_torchs_float8_e8m0fnu():
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip(f"torch {torch.__version__} has no float8_e8m0fnu")
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours, theirs = F.e8m0_values(bits), bits.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours[:255], theirs[:255]) and ours[255].isnan() and theirs[255].isnan()
    assert ours[127].item() == 1.0 and ours[0].item() == 2.0 ** -127 and ours[254].item() == 2.0 ** 127  # bias 127


def test_every_power_of_two_is_torchs_e8m0_encoding():
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip(f"torch {torch.__version__} has no float8_e8m0fnu")
    exponents = torch.arange(-127, 128)
    values = torch.ldexp(torch.ones(255), exponents)
    torch_bits = values.to(torch.float8_e8m0fnu).view(torch.uint8)
    assert torch.equal(torch_bits.int(), exponents.int() + F.E8M0_BIAS)


def test_floor_log2_is_exact_on_every_bf16():
    x = every_bf16().float()
    keep = x.isfinite() & (x > 0)
    want = torch.tensor([math.floor(math.log2(v)) for v in x[keep].double().tolist()])
    assert torch.equal(F.floor_log2(x[keep]).long(), want)


# -- the FP8 formats: kernels/reference.py's bits, unchanged ---------------------------------------------------------

@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.0123, 7.5])
def test_fp8_formats_are_the_reference_quantiser_bit_for_bit(name, saturate, scale):
    x = every_bf16().view(1, 1, 1, -1)
    s = torch.tensor(scale)
    got, ratio = F.get_format(name).round_trip(x, s, saturate)
    want = fp8.dequantize(fp8.quantize(x, s, name, saturate=saturate), s, out_dtype=x.dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    want_ratio = (x.float() / s).abs() / fp8.FP8_MAX[name]
    assert torch.equal(ratio.view(torch.int32), want_ratio.view(torch.int32))
    assert torch.equal(F.get_format(name).scale_of_amax(torch.tensor([3.0, 0.0])),
                       fp8.amax_scale(torch.tensor([3.0, 0.0]), name))


def test_per_head_static_scale_broadcasts_over_heads():
    x = torch.randn(2, 3, 5, 32, dtype=torch.bfloat16)
    s = torch.tensor([0.01, 0.1, 1.0]).view(-1, 1, 1)
    for name in ("e4m3", "nvfp4"):
        got, _ = F.get_format(name).round_trip(x, s)
        for head in range(3):
            alone, _ = F.get_format(name).round_trip(x[:, head:head + 1], s[head])
            assert torch.equal(got[:, head:head + 1], alone), name


# -- block formats against the OCP MX / NVFP4 definitions, value by value ------------------------------------------

def mx_reference(block: list[float], element_max: float, element_cast, rounding: str = "floor") -> list[float]:
    """One block, in float64, clamped to e8m0. OCP MX 6.3 ("floor"): X = 2^(floor(log2 amax) - floor(log2 element
    max)). SGLang's MX KV caches ("ceil"): X = 2^ceil(log2(amax / element max)) (kernels/ops/quantization/
    mxfp8_quant.py: ceil(log2(amax / 448.0)); kvfp4_tensor.py: ceil(log2(amax / 6)))."""
    amax = max(abs(v) for v in block)
    if amax == 0:
        return [0.0] * len(block)
    if rounding == "floor":
        exponent = math.floor(math.log2(amax)) - math.floor(math.log2(element_max))
    else:  # amax / element max as the engines divide it, in fp32; its log2 ceiled exactly
        ratio = torch.tensor(amax, dtype=torch.float32) / torch.tensor(element_max, dtype=torch.float32)
        exponent = math.ceil(math.log2(ratio.item()))
    exponent = max(-127, min(127, exponent))
    x = 2.0 ** exponent
    return [element_cast(v / x) * x for v in block]


def e2m1_cast(v: float) -> float:  # saturating round-to-nearest-even onto the OCP e2m1 grid
    grid = sorted({abs(ocp_e2m1(c)) for c in range(8)})
    m = min(abs(v), 6.0)
    best = min(grid, key=lambda g: (abs(g - m), [0.0, 1.0, 2.0, 4.0, 0.5, 1.5, 3.0, 6.0].index(g) >= 4))
    return math.copysign(best, v)


def e4m3_cast(v: float) -> float:
    return torch.tensor(max(-448.0, min(448.0, v))).to(torch.float8_e4m3fn).item()


@pytest.mark.parametrize("name, element_max, cast, rounding", [
    ("mxfp4", 6.0, e2m1_cast, "floor"),  # OCP MX, no engine KV flag
    ("mxfp8", 448.0, e4m3_cast, "ceil"),  # SGLang mxfp8
    ("fp4_mx_block16", 6.0, e2m1_cast, "ceil"),  # SGLang fp4_mx_block16
])
def test_mx_formats_follow_their_definition(name, element_max, cast, rounding):
    kv_format = F.get_format(name)
    assert kv_format.scale_rounding == rounding
    torch.manual_seed(1)
    # awkward row: 3 blocks and a short tail; magnitudes over 12 binades, a zero block, exact powers of two
    x = (torch.randn(4, 3 * kv_format.block_size + 5) * torch.logspace(-6, 6, 4).unsqueeze(-1)).to(torch.bfloat16)
    x[1, :kv_format.block_size] = 0
    x[2, 0] = 2.0 ** 10
    got = kv_format.decode(kv_format.encode(x)).double()
    for row in range(x.shape[0]):
        values = x[row].double().tolist()
        want = []
        for start in range(0, len(values), kv_format.block_size):
            want += mx_reference(values[start:start + kv_format.block_size], element_max, cast, rounding)
        assert got[row].tolist() == want, (name, row)


def test_mx_block_with_nan_or_inf_reads_back_nan_block():
    x = torch.ones(1, 64)
    x[0, 3], x[0, 40] = float("nan"), float("inf")
    kv_format = F.get_format("mxfp8")
    encoded = kv_format.encode(x)
    assert encoded.block_scales.tolist() == [[F.E8M0_NAN, F.E8M0_NAN]]
    assert kv_format.decode(encoded).isnan().all()


def nvfp4_reference(block: list[float], s: float, targets=(6.0,)) -> list[float]:
    """NVFP4 value by value, fp32 as the definition computes: x / s, block scale e4m3(amax / target), values
    e2m1(x / s / scale) x (scale x s); 4-over-6 keeps the candidate with the smaller squared error."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    per_static = [f32(v) / f32(s) for v in block]
    amax = max(abs(v.item()) for v in per_static)
    best = None
    for target in targets:
        scale = e4m3_cast((f32(amax) / target).item())
        whole = f32(scale) * f32(s)
        values = [0.0 if scale == 0 else (f32(e2m1_cast((v / scale).item())) * whole).item() for v in per_static]
        error = sum((a - b.item() * s) ** 2 for a, b in zip(values, per_static))
        if best is None or error < best[0]:
            best = (error, values)
    return best[1]


@pytest.mark.parametrize("name, targets", [("nvfp4", (6.0,)), ("nvfp4_4over6", (6.0, 4.0))])
@pytest.mark.parametrize("s", [1.0, 0.0037])
def test_nvfp4_follows_the_definition(name, targets, s):
    kv_format = F.get_format(name)
    torch.manual_seed(2)
    x = (torch.randn(6, 37) * torch.logspace(-3, 3, 6).unsqueeze(-1)).to(torch.bfloat16)
    got = kv_format.decode(kv_format.encode(x, torch.tensor(s))).double()
    for row in range(x.shape[0]):
        values = x[row].double().tolist()
        want = []
        for start in range(0, len(values), 16):
            want += nvfp4_reference(values[start:start + 16], s, targets)
        assert got[row].tolist() == pytest.approx(want, rel=0, abs=0), (name, row)


def test_nvfp4_scales_are_e4m3_and_4over6_picks_4_where_it_errs_less():
    block = torch.tensor([[5.0] + [0.0] * 15])  # amax 5: /6 -> 5/6 scale, 5 rounds to 4 or 6; /4 -> 1.25, exact 4
    four_over_six = F.get_format("nvfp4_4over6").encode(block)
    assert four_over_six.block_scales.dtype == torch.float8_e4m3fn
    assert F.get_format("nvfp4_4over6").decode(four_over_six)[0, 0].item() == 5.0
    assert F.get_format("nvfp4").decode(F.get_format("nvfp4").encode(block))[0, 0].item() != 5.0


# -- per token-head formats -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, qmax, low, high", [("int8_per_token_head", 127, -128, 127),
                                                   ("int4_per_token_head", 7, -7, 7),
                                                   ("fp8_per_token_head", 448, -448, 448)])
def test_per_token_head_scale_is_amax_over_max(name, qmax, low, high):
    torch.manual_seed(3)
    x = torch.randn(2, 4, 3, 24)
    encoded = F.get_format(name).encode(x)
    want_scale = (x.abs().amax(-1) / qmax).clamp_min(1e-6)
    assert torch.equal(encoded.block_scales, want_scale.unsqueeze(-1))
    codes = encoded.codes.float()
    assert codes.min() >= low and codes.max() <= high
    assert (codes.abs().amax(-1) == qmax).all()  # the amax value lands on the largest code


def test_int8_asymmetric_spans_min_to_max():
    x = torch.tensor([[-1.0, 0.0, 3.0, 2.5]])
    kv_format = F.get_format("int8_per_token_head_asym")
    encoded = kv_format.encode(x)
    assert encoded.codes.dtype == torch.uint8 and encoded.codes.tolist() == [[0, 64, 255, 223]]
    assert encoded.zero.tolist() == [[-1.0]] and encoded.block_scales.item() == pytest.approx(4 / 255)
    assert kv_format.decode(encoded)[0].tolist() == pytest.approx(x[0].tolist(), abs=4 / 255 / 2)


def test_zero_tensor_reads_back_zeros_in_every_format():
    for kv_format in F.registered():
        s = torch.tensor(1.0) if kv_format.has_static_scale else None
        assert torch.equal(kv_format.round_trip(torch.zeros(1, 2, 3, 32), s)[0], torch.zeros(1, 2, 3, 32)), kv_format.name


# -- error against float64, relative to each format's own rounding bound ---------------------------------------------

# The bound: half the element's spacing at the top of its range, relative to the block's amax (|x - q| <= bound *
# amax for an unclipped value); e4m3 block scales (NVFP4) add their own rounding (amax/6 rounded to 3 mantissa bits,
# the value's share up to 1/16). Clipping (OCP MX's floor) may move the block's largest values further: excluded.
ROUNDING_BOUNDS = {  # name: (max |x - q| / block amax, mean relative error to the float64 value at most)
    "nvfp4": (1 / 6 * (1 + 1 / 16), 0.12), "nvfp4_4over6": (1 / 6 * (1 + 1 / 16), 0.12),
    "mxfp4": (1 / 4 * 2, 0.2), "fp4_mx_block16": (1 / 4 * 2, 0.2), "mxfp8": (2 ** -4 * 2, 0.05),
    "fp8_per_token_head": (2 ** -4, 0.04), "int8_per_token_head": (0.5 / 127 + 1e-6, 0.01),
    "int4_per_token_head": (0.5 / 7 + 1e-6, 0.15), "int8_per_token_head_asym": (0.5 / 255 * 2 + 1e-6, 0.01),
}


@pytest.mark.parametrize("name", sorted(ROUNDING_BOUNDS))
def test_error_against_float64_within_the_formats_rounding_bound(name):
    kv_format = F.get_format(name)
    torch.manual_seed(4)
    x = torch.randn(3, 4, 7, 64, dtype=torch.float64)
    s = x.abs().amax().float() / kv_format.static_range if kv_format.has_static_scale else None
    encoded = kv_format.encode(x.float(), s)
    read = kv_format.decode(encoded, torch.float64)
    clipped = kv_format.clip_ratio(x.float(), encoded) > 1
    block = kv_format.block_size or x.shape[-1]
    amax = x.abs().unflatten(-1, (-1, block)).amax(-1, keepdim=True).expand(-1, -1, -1, -1, block).flatten(-2)
    bound, mean_bound = ROUNDING_BOUNDS[name]
    worst = ((read - x).abs() / amax)[~clipped].max().item()
    assert worst <= bound, f"{name}: max |x - q| / amax {worst:.4g} > {bound:.4g}"
    relative = ((read - x).abs() / x.abs().clamp_min(1e-30)).median().item()
    assert relative <= mean_bound, f"{name}: median relative error {relative:.4g} > {mean_bound}"


def test_bytes_per_token():
    assert F.get_format("e4m3").bytes_per_token(128) == 128
    assert F.get_format("nvfp4").bytes_per_token(128) == 64 + 8  # 4 bits a value + an e4m3 scale per 16
    assert F.get_format("mxfp4").bytes_per_token(128) == 64 + 4
    assert F.get_format("mxfp8").bytes_per_token(128, heads=8) == 8 * (128 + 4)
    assert F.get_format("int8_per_token_head").bytes_per_token(128) == 128 + 4
    assert F.get_format("int8_per_token_head_asym").bytes_per_token(128) == 128 + 8


def test_registry_refuses_a_taken_spelling():
    with pytest.raises(ValueError, match="nvfp4"):
        F.register_format(F.KVFormat("my_fp4", ("nvfp4",), F.E2M1, block_size=16, block_scale="e8m0"))
    with pytest.raises(ValueError, match="needs block_targets"):
        F.KVFormat("bad", ("bad",), F.E2M1, block_size=16, block_scale="e4m3")


# -- an independent field library: compressed-tensors ----------------------------------------------------------------

def test_e2m1_rounding_matches_compressed_tensors_on_every_bf16():
    fp4_utils = pytest.importorskip("compressed_tensors.quantization.utils.fp4_utils")
    x = every_bf16().float()
    x = x[x.isfinite()]
    theirs = fp4_utils.cast_to_fp4(x.clone())
    ours = F.e2m1_values(F.e2m1_codes(x))
    assert torch.equal(ours, theirs)  # values (their -0 for a small negative is our code 8: equal as floats)


@pytest.mark.parametrize("name, bits", [("mxfp4", 4), ("mxfp8", 8)])
def test_mx_scales_match_compressed_tensors_except_its_round_up(name, bits):
    """compressed-tensors (and vLLM's reference_mxfp4) round the block amax up to the next power of two when its
    mantissa is at least 1.75 (no clipping); OCP MX floors (the top of such a block clips). Equal elsewhere."""
    mxfp = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    amax = every_bf16().float()
    amax = amax[amax.isfinite() & (amax > 2.0 ** -100) & (amax < 2.0 ** 100)]
    theirs = mxfp.generate_mx_scales(amax.clone(), bits).long()
    ours = F._e8m0_block_scale(amax, F.get_format(name).element, "floor")[0].long()  # noqa: SLF001 - OCP's rule
    mantissa, _ = torch.frexp(amax)
    rounds_up = mantissa * 2 >= 1.75
    assert torch.equal(ours[~rounds_up], theirs[~rounds_up])
    assert torch.equal(ours[rounds_up] + 1, theirs[rounds_up])


@pytest.mark.parametrize("element", [F.E2M1, F.E4M3])
def test_rounded_up_mx_scale_is_the_smallest_power_of_two_that_does_not_clip(element):
    """The engines' rule on every finite positive bf16 amax: amax / X <= element max (nothing clips), and with X / 2
    it would clip (the smallest such power of two), where X is inside e8m0's range."""
    amax = every_bf16().float()
    amax = amax[amax.isfinite() & (amax > 2.0 ** -100) & (amax < 2.0 ** 100)]
    _, scale = F._e8m0_block_scale(amax, element, "ceil")  # noqa: SLF001 - the block-scale rule
    assert bool((amax / scale <= element.max_value).all())
    assert bool((amax / (scale / 2) > element.max_value).all())


# -- the engine flag map (docs/FORMATS.md) ---------------------------------------------------------------------------

VLLM_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                     "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                     "turboquant_3bit_nc", "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4",
                     "nvfp4_4over6")  # vllm/config/cache.py CacheDType, read at 002f10e0
SGLANG_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16",
                       "fp4_e2m1")  # python/sglang/srt/server_args.py kv_cache_dtype choices, read at 001067ff
ENGINE_FLAGS = ("--kv-cache-dtype-skip-layers", "--prefill-kv-cache-dtype")  # the skip and prefill flags


def _docs_table() -> str:
    from pathlib import Path

    return (Path(__file__).parents[1] / "docs" / "FORMATS.md").read_text()


@pytest.mark.parametrize("engine, values", [("vllm", VLLM_CACHE_DTYPES), ("sglang", SGLANG_CACHE_DTYPES)])
def test_every_engine_kv_cache_dtype_maps_to_a_path_or_a_refusal(engine, values):
    """Each value of the release's list: a row in docs/FORMATS.md, and `ENGINE:VALUE` parses to a path, or is refused
    with the documented reason (the table's words, in the error); the same as a prefill format."""
    from harness.kv_paths.spec import ENGINE_KV_DTYPES, ENGINE_REFUSALS, PathSpecError, parse_path

    table = _docs_table()
    for value in values:
        assert f"`{value}`" in table, f"docs/FORMATS.md has no row for {engine} {value}"
        assert (value in ENGINE_KV_DTYPES[engine]) != (value in ENGINE_REFUSALS[engine]), (engine, value)
        try:
            path = parse_path(f"{engine}:{value}")
        except PathSpecError as refusal:
            assert f"{engine} --kv-cache-dtype {value} is refused: {ENGINE_REFUSALS[engine][value]}" in str(refusal)
            assert "refused" in table[table.index(f"`{value}`"):].split("\n")[0]  # the docs row says refused too
            continue
        assert path.name == f"{engine}:{value}" and path.canonical
        try:
            prefill = parse_path(f"{engine}:{values[-1] if value == values[0] else values[0]}:prefill={value}")
        except PathSpecError as refusal:  # a latent layout is not a prefill format; a refused value stays refused
            assert "--prefill-kv-cache-dtype" in str(refusal) or "latent layout" in str(refusal), str(refusal)
            continue
        assert prefill.canonical


def test_the_skip_and_prefill_flags_have_rows():
    table = _docs_table()
    for flag in ENGINE_FLAGS:
        assert f"`{flag}" in table, f"docs/FORMATS.md has no row for {flag}"
    assert "keep_bf16=sliding_window" in table and "prefill=X" in table


def test_engine_spelling_keeps_options_and_names_unknown_values():
    from harness.kv_paths.spec import PathSpecError, parse_path

    assert parse_path("vllm:nvfp4:calibrated").canonical == "nvfp4:per_tensor:calibrated"
    assert parse_path("vllm:fp8").canonical == parse_path("fp8_e4m3").canonical
    assert parse_path("sglang:mxfp8").fmt == "mxfp8"
    with pytest.raises(PathSpecError, match="unknown vllm --kv-cache-dtype 'fp9'"):
        parse_path("vllm:fp9")
    assert parse_path("sglang:nvfp4:prefill=bfloat16").canonical == parse_path("nvfp4:raw_prefill").canonical
    with pytest.raises(PathSpecError, match="unknown sglang --prefill-kv-cache-dtype 'nvfp4_4over6'"):
        parse_path("sglang:nvfp4:prefill=nvfp4_4over6")  # under an engine head, the engine's own values
    with pytest.raises(PathSpecError, match="vllm --prefill-kv-cache-dtype turboquant_k8v4 is refused"):
        parse_path("vllm:nvfp4:prefill=turboquant_k8v4")
