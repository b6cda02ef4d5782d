"""DeepSeek's MLA latent layouts (vLLM `fp8_ds_mla`, `nvfp4_ds_mla`): our formats (harness/kv_paths/formats.py) and
byte records (harness/kv_paths/mla.py) against an independent definition written here in numpy from the engine's
layout comments (vLLM csrc cache_kernels.cu `concat_and_cache_ds_mla_kernel`, nvfp4_ds_mla_cache_kernels.cu):
every byte of every token's record, bit for bit, and the bytes a token takes (656 and 352)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.kv_paths import formats as F
from harness.kv_paths import mla
from harness.kv_paths.spec import parse_path

FLT_MIN = np.float32(2.0 ** -126)


# -- element types from their bit fields ------------------------------------------------------------------------------

def e4m3_table() -> np.ndarray:
    """Value of every e4m3 code 0..0x7E (positive, finite): 4 exponent bits (bias 7), 3 mantissa bits, exponent 0
    subnormal; 0x7F is NaN (OCP FP8 E4M3)."""
    values = []
    for code in range(0x7F):
        exponent, mantissa = code >> 3, code & 7
        values.append(mantissa / 8 * 2.0 ** -6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.array(values, dtype=np.float64)


E4M3 = e4m3_table()
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0..7 (1 sign, 2 exponent bias 1, 1 mantissa)


def nearest_code(table: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Round |values| to the nearest entry of an increasing table, ties to the even code, saturating at its top
    (CUDA's satfinite conversions); the sign bit above the magnitude bits. No NaN here (inputs are finite)."""
    magnitude = np.minimum(np.abs(values.astype(np.float64)), table[-1])
    upper = np.clip(np.searchsorted(table, magnitude), 1, len(table) - 1)
    lower = upper - 1
    below, above = magnitude - table[lower], table[upper] - magnitude
    code = np.where(below < above, lower, np.where(above < below, upper, np.where(lower % 2 == 0, lower, upper)))
    sign_bit = 0x80 if len(table) == len(E4M3) else 0x8
    return np.where(np.signbit(values), code | sign_bit, code).astype(np.uint8)


# -- the records, from the engine's layout comments ---------------------------------------------------------------------

def fp8_ds_mla_record(latent: np.ndarray, rope_bits: np.ndarray) -> np.ndarray:
    """latent fp32 [T, 512] (bf16 values), rope [T, 64] bf16 bit patterns -> [T, 656] bytes: per tile of 128,
    scale = max(amax / 448, FLT_MIN) in fp32, codes = e4m3_satfinite(x / scale); 4 fp32 scales; the bf16 rope."""
    tiles = latent.reshape(-1, 4, 128).astype(np.float32)
    scale = np.maximum(np.abs(tiles).max(-1) / np.float32(448.0), FLT_MIN).astype(np.float32)  # [T, 4]
    codes = nearest_code(E4M3, (tiles / scale[..., None]).astype(np.float32)).reshape(-1, 512)
    return np.concatenate([codes, scale.astype("<f4").view(np.uint8), rope_bits.astype("<u2").view(np.uint8)], -1)


def nvfp4_ds_mla_record(latent: np.ndarray, rope: np.ndarray) -> np.ndarray:
    """latent fp32 [T, 512], rope fp32 [T, 64] -> [T, 352] bytes: per block of 16, sf = e4m3(max(amax / 6, 2^-9)),
    bumped to the next e4m3 value where it fell below; codes = e2m1_rn(x * (1 / sf)), two a byte, even element low;
    the rope as e4m3 with no scale; the 32 scales at byte 8 (s & 3) + (s >> 2)."""
    blocks = latent.reshape(-1, 32, 16).astype(np.float32)
    wanted = np.maximum(np.abs(blocks).max(-1) / np.float32(6.0), np.float32(2.0 ** -9)).astype(np.float32)
    sf = nearest_code(E4M3, wanted)
    sf = np.where((E4M3[sf] < wanted) & (sf < 0x7E), sf + 1, sf).astype(np.uint8)
    inverse = (np.float32(1.0) / E4M3[sf].astype(np.float32)).astype(np.float32)
    codes = nearest_code(E2M1, (blocks * inverse[..., None]).astype(np.float32)).reshape(-1, 512)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = np.empty_like(sf)
    s = np.arange(32)
    scales[:, 8 * (s & 3) + (s >> 2)] = sf
    return np.concatenate([packed, nearest_code(E4M3, rope.astype(np.float32)), scales], -1)


def ds_inputs(tokens: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 latent [T, 512] and k_pe [T, 64] with magnitudes over 2^-24..2^12 per tile and block (the e4m3 scale
    floor, its round-up, subnormal codes and saturation all run), some exact zeros, and one all-zero tile."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-24, 12, (tokens, 32, 1), generator=gen).float())
    latent = (torch.randn(tokens, 32, 16, generator=gen) * spread).reshape(tokens, 512)
    latent[torch.rand(tokens, 512, generator=gen) < 0.05] = 0.0
    latent[0, :128] = 0.0
    rope = torch.randn(tokens, 64, generator=gen) * torch.exp2(torch.randint(-12, 9, (tokens, 1), generator=gen).float())
    return latent.bfloat16(), rope.bfloat16()


def test_fp8_ds_mla_record_is_the_engines_bit_for_bit():
    latent, rope = ds_inputs()
    k_format, v_format = F.get_format("ds_mla_e4m3"), F.get_format("unquantised")
    record = mla.pack_ds_mla("ds_mla_e4m3", k_format.encode(latent), v_format.encode(rope))
    want = fp8_ds_mla_record(latent.float().numpy(), rope.view(torch.int16).numpy().view(np.uint16))
    assert record.shape == (latent.shape[0], 656) and record.dtype == torch.uint8
    mismatch = np.argwhere(record.numpy() != want)
    assert mismatch.size == 0, f"{len(mismatch)} bytes differ, first (token, byte): {mismatch[:5].tolist()}"


def test_nvfp4_ds_mla_record_is_the_engines_bit_for_bit():
    latent, rope = ds_inputs(seed=1)
    k_format, v_format = F.get_format("ds_mla_nvfp4"), F.get_format("e4m3_unscaled")
    record = mla.pack_ds_mla("ds_mla_nvfp4", k_format.encode(latent), v_format.encode(rope))
    want = nvfp4_ds_mla_record(latent.float().numpy(), rope.float().numpy())
    assert record.shape == (latent.shape[0], 352) and record.dtype == torch.uint8
    mismatch = np.argwhere(record.numpy() != want)
    assert mismatch.size == 0, f"{len(mismatch)} bytes differ, first (token, byte): {mismatch[:5].tolist()}"


@pytest.mark.parametrize("fmt, companion", [("ds_mla_e4m3", "unquantised"), ("ds_mla_nvfp4", "e4m3_unscaled")])
def test_a_record_reads_back_what_the_cache_write_reads_back(fmt, companion):
    """unpack(pack(encode)) decodes to the formats' own round trip, bit for bit: the record loses nothing."""
    latent, rope = ds_inputs(seed=2)
    k_format, v_format = F.get_format(fmt), F.get_format(companion)
    got_latent, got_rope = mla.unpack_ds_mla(fmt, mla.pack_ds_mla(fmt, k_format.encode(latent), v_format.encode(rope)))
    assert torch.equal(k_format.decode(got_latent, torch.bfloat16), k_format.round_trip(latent)[0])
    assert torch.equal(v_format.decode(got_rope, torch.bfloat16), v_format.round_trip(rope)[0])


def test_decode_is_code_times_scale_as_the_engines_upconvert():
    """fp8_ds_mla: e4m3 x the tile's fp32 scale in fp32; nvfp4_ds_mla: e2m1 x e4m3 scale (exact in fp32), from the
    record's own bytes (the numpy definition's decoding of them)."""
    latent, rope = ds_inputs(tokens=16, seed=3)
    record = fp8_ds_mla_record(latent.float().numpy(), rope.view(torch.int16).numpy().view(np.uint16))
    codes, scales = record[:, :512], record[:, 512:528].copy().view("<f4")
    signs = np.where(codes & 0x80, -1.0, 1.0)
    want = (signs * E4M3[codes & 0x7F]).astype(np.float32) * np.repeat(scales, 128, axis=-1)
    got_latent, _ = mla.unpack_ds_mla("ds_mla_e4m3", torch.from_numpy(record))
    assert np.array_equal(F.get_format("ds_mla_e4m3").decode(got_latent).numpy(), want.astype(np.float32))


def test_bytes_per_token_are_the_engines():
    assert F.get_format("ds_mla_e4m3").bytes_per_token(512) + F.get_format("unquantised").bytes_per_token(64) == 656
    assert F.get_format("ds_mla_nvfp4").bytes_per_token(512) + F.get_format("e4m3_unscaled").bytes_per_token(64) == 352
    assert mla.DS_MLA_RECORD_BYTES == {"ds_mla_e4m3": 656, "ds_mla_nvfp4": 352}


def test_the_scale_permutation_is_the_engines_transpose():
    """vLLM's static_assert: thread q's scale groups {4c + q} land on the contiguous bytes 8q + c."""
    assert sorted(mla.nvfp4_scale_byte(s) for s in range(32)) == list(range(32))
    assert all(mla.nvfp4_scale_byte(4 * c + q) == 8 * q + c for q in range(4) for c in range(8))


def test_a_path_names_the_layout_and_the_rope_part_stays_as_the_engine_keeps_it():
    fp8_path, nvfp4_path = parse_path("vllm:fp8_ds_mla"), parse_path("vllm:nvfp4_ds_mla")
    assert (fp8_path.fmt, fp8_path.v_fmt, fp8_path.canonical) == ("ds_mla_e4m3", "unquantised", "fp8_ds_mla")
    assert (nvfp4_path.fmt, nvfp4_path.v_fmt, nvfp4_path.canonical) == ("ds_mla_nvfp4", "e4m3_unscaled", "nvfp4_ds_mla")
    rope = torch.randn(2, 1, 3, 64).bfloat16()  # on an MLA model the cache's "value" is k_pe
    assert torch.equal(fp8_path.v_format.round_trip(rope)[0], rope)  # bf16: untouched
    # both sides quantised is another path, and says so
    assert parse_path("k=fp8_ds_mla/v=fp8_ds_mla").canonical == "k=fp8_ds_mla/v=fp8_ds_mla"


def test_a_record_of_another_shape_is_refused_with_the_shapes():
    latent, rope = torch.randn(2, 32).bfloat16(), torch.randn(2, 16).bfloat16()
    with pytest.raises(ValueError, match="latent 32 \\+ k_pe 16; vLLM's writer takes 512 \\+ 64"):
        mla.pack_ds_mla("ds_mla_e4m3", F.get_format("ds_mla_e4m3").encode(latent),
                        F.get_format("unquantised").encode(rope))


def test_the_decode_route_takes_the_block_scaled_mla_kernel_at_the_engines_shape_only():
    """The route asks the MLA block-scaled decode's capability (harness/kv_paths/capabilities.py): fp8_ds_mla's
    latent (e4m3 under fp32 scales per 128, k_pe in bf16 beside it) is served on an MLA model at latent widths of
    whole tiles; on the mla canary's 64-wide latent, and as a GQA cache, the refusal names why."""
    from harness.kv_paths import capabilities

    path = parse_path("fp8_ds_mla")
    assert capabilities.decode_refusal(path, mla=True, head_size=512, rope_size=64) is None
    assert "head size 64" in capabilities.decode_refusal(path, mla=True, head_size=64, rope_size=16)
    assert "fp32 scales per 128 values" in capabilities.decode_refusal(path, mla=False, head_size=128)
    # the fused block-scaled write serves its latent on an MLA model (k_pe beside it stored as given), not as GQA
    assert capabilities.FUSED_WRITE_BLOCK_SCALED.refusal(path, "mla") is None
    assert "unquantised" in capabilities.FUSED_WRITE_BLOCK_SCALED.refusal(path)


@pytest.mark.parametrize("spec", ["fp8_ds_mla", "nvfp4", "mxfp8", "mxfp4"])
def test_mla_latents_decode_in_the_loop_through_the_kernels_mirror(monkeypatch, ds_latent_model, spec):
    """A DeepSeek-V3 at the engine's latent shape (512 + 64), on the CPU through the kernels' torch mirror
    (HARNESS_KERNELS=reference: the glue the CUDA kernel runs behind): decode steps read the paged codes and block
    scales, one record a token for these layouts (`allocate_latent_rows`: strided views the torch write and the
    mirror go through), and the engine's own check against fp64 attention over the stored values holds them within
    the bound the GPU tests use (tests/test_harness_gpu.py: kernel error <= 4x torch's)."""
    from harness.replay.inprocess import InProcessModel
    from harness.types import Message

    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    backend = InProcessModel.load(ds_latent_model, device="cpu").backend(parse_path(spec))
    assert backend.describe()["decode_kernel"] == "triton (kernels/)", backend.describe()   # its mirror here
    chat = [Message("user", "What is 7 * 8 + 3 * 4?")]
    generation = backend.generate_sync(chat, 6)
    assert generation.metrics["kernel_steps"] > 0
    assert 0.0 < generation.metrics["kernel_err_ratio"] <= 4.0, generation.metrics


def test_fp8_ds_mla_latent_without_the_cuda_kernel_dequantises_and_warns(monkeypatch):
    """Where the CUDA kernel cannot run fp8_ds_mla (here: a latent of 256, on the CPU under Triton's interpreter),
    impl None dequantises the latent to q's type and runs our BF16 MLA kernel (on the CPU its torch mirror), warning
    once with the reason; the result is fp64 attention over the stored values within bf16's rounding (the cache and
    the output in bf16: 2^-8 of the largest output, twice that for the scores' rounding). impl="triton" refuses the
    layout by name."""
    from harness.kv_paths import block_layout
    from kernels import reference
    from kernels.decode_attention_block_scaled import mla_decode_block_scaled

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("kernels.decode_attention_block_scaled._DEQUANTISED_WARNED", set())
    layout = block_layout.of(F.get_format("ds_mla_e4m3"), mla=True)
    torch.manual_seed(0)
    codes, scales = layout.allocate(3, 16, 1, 256, "cpu")
    layout.store((torch.randn(40, 1, 256) * torch.logspace(-2, 2, 256)).bfloat16(), None, codes, scales,
                 torch.arange(40))
    k_pe = torch.randn(3, 16, 32).bfloat16()
    q_latent, q_pe = torch.randn(2, 4, 256).bfloat16() * 0.1, torch.randn(2, 4, 32).bfloat16()
    table, seq = torch.tensor([[0, 1, 2], [1, 2, 0]], dtype=torch.int32), torch.tensor([40, 9], dtype=torch.int32)
    args = (q_latent, q_pe, codes, scales, k_pe, table, seq, None, 0.07)
    why = "built for a latent of 512 and k_pe of 64, got 256 and 32"
    with pytest.warns(RuntimeWarning, match=f"{why}.*dequantised to torch.bfloat16"):
        out, _ = mla_decode_block_scaled(*args, **layout.kernel_args)
    truth, _ = reference.mla_decode_block_scaled(*(a.double() if a.is_floating_point() else a for a in args[:5]),
                                                 *args[5:], **layout.kernel_args)
    assert (out.double() - truth).abs().max() <= 3 * 2.0 ** -8 * truth.abs().max()
    with pytest.raises(AssertionError, match="reads one fp32 scale per token, not one per 128 values"):
        mla_decode_block_scaled(*args, impl="triton", **layout.kernel_args)


def test_the_engines_fp8_ds_mla_pages_are_vllms_records_byte_for_byte():
    """The decode pages of an fp8_ds_mla path (`BlockScaledLayout.allocate_latent_rows`: codes, tile scales and k_pe
    as views of one byte record a token), written by the layout's store and k_pe's, hold exactly `pack_ds_mla`'s
    record of the same token (vLLM's 656 bytes, tested above against the engine's layout), and the MLA kernel's
    launcher sees one record (one copy a row)."""
    from harness.kv_paths import block_layout
    from kernels.mla_block_scaled_cuda import is_record

    layout = block_layout.of(F.get_format("ds_mla_e4m3"), mla=True)
    torch.manual_seed(0)
    latent = (torch.randn(21, 1, 512) * torch.logspace(-3, 3, 512)).bfloat16()
    rope = torch.randn(21, 64).bfloat16()
    codes, scales, k_pe = layout.allocate_latent_rows(2, 16, 512, rope)
    slots = torch.randperm(32)[:21]
    layout.store(latent, None, codes, scales, slots)
    block_layout.store_rows(k_pe.view(-1, 64), slots, rope)
    assert is_record(codes, scales, k_pe) and codes.untyped_storage().data_ptr() == k_pe.untyped_storage().data_ptr()
    stored = torch.cat([t.view(torch.uint8).reshape(32, -1) for t in (codes, scales, k_pe)], dim=-1)[slots]
    packed = mla.pack_ds_mla("ds_mla_e4m3", F.get_format("ds_mla_e4m3").encode(latent[:, 0]),
                             F.get_format("unquantised").encode(rope))
    assert stored.shape == (21, 656) and torch.equal(stored, packed)


def test_nvfp4_ds_mla_decodes_in_the_loop_with_its_e4m3_k_pe_read_back(monkeypatch, ds_latent_model):
    """vLLM's nvfp4_ds_mla (SM100 in vLLM) on the CPU through the kernels' mirror: the latent is NVFP4's values (how
    its write rounds scales up and multiplies by reciprocals is the write's; the decode reads code x scale), so the
    block-scaled MLA decode serves it, and k_pe goes into the 16-bit pages read back through plain e4m3 (exact there),
    so the engine's check against fp64 over what the pages hold holds it within the GPU tests' bound (that check
    reads the pages, so k_pe's read-back is checked on its own below). The fused write does not serve it (the torch
    round trip writes it), and says why."""
    from harness.kv_paths import capabilities
    from harness.replay.inprocess import InProcessModel
    from harness.types import Message

    path = parse_path("nvfp4_ds_mla")
    assert capabilities.decode_refusal(path, mla=True, head_size=512, rope_size=64) is None
    assert "serves" in capabilities.FUSED_WRITE_BLOCK_SCALED.refusal(path, "mla")
    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    backend = InProcessModel.load(ds_latent_model, device="cpu").backend(path)
    generation = backend.generate_sync([Message("user", "What is 7 * 8 + 3 * 4?")], 6)
    assert generation.metrics["kernel_steps"] > 0
    assert 0.0 < generation.metrics["kernel_err_ratio"] <= 4.0, generation.metrics


def test_an_mla_rows_k_pe_goes_into_the_pages_through_its_own_format():
    """`PagedKV.store_pe`: nvfp4_ds_mla's k_pe side (plain e4m3) is stored read back, the value the engine's cache
    holds and the decode must read; fp8_ds_mla's (bf16) as given. The kernel check reads the same pages, so it could
    not see raw k_pe in them: this is the test that does."""

    from harness.kv_paths.attention import PagedKV

    torch.manual_seed(0)
    value = torch.randn(2, 1, 3, 64).bfloat16() * 3
    for fmt, expected in (("e4m3_unscaled", value.float().to(torch.float8_e4m3fn).bfloat16()), (None, value)):
        pages = [None, None, torch.zeros(1, 16, 64, dtype=torch.bfloat16)]
        step = SimpleNamespace(slots=lambda: torch.arange(6))
        paged = PagedKV(None, None, None, True, True, None, None, None, step, pages=pages,
                        pe_format=None if fmt is None else F.get_format(fmt))
        paged.store_pe(value)
        assert torch.equal(pages[2].view(-1, 64)[:6], expected[:, 0].reshape(6, 64)), fmt


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "mxfp4", "ds_mla_e4m3", "ds_mla_nvfp4"])
def test_latent_records_hold_what_three_tensors_hold(fmt):
    """`allocate_latent_rows` at 512 + 64 gives every layout the CUDA MLA kernel reads one record a token (the
    kernel's one copy a row): written through its views, codes, block scales and k_pe read back exactly what three
    separate tensors written the same way hold, so no view overlaps another or sits at the wrong offset."""
    from harness.kv_paths import block_layout
    from kernels.mla_block_scaled_cuda import is_record

    layout = block_layout.of(F.get_format(fmt), mla=True)
    torch.manual_seed(0)
    latent = (torch.randn(21, 1, 512) * torch.logspace(-3, 3, 512)).bfloat16()
    rope = torch.randn(21, 64).bfloat16()
    slots = torch.randperm(32)[:21]
    scale = torch.tensor(0.02) if layout.static else None
    record = layout.allocate_latent_rows(2, 16, 512, rope)
    apart = [*layout.allocate(2, 16, 1, 512, "cpu"), torch.zeros(2, 16, 64, dtype=torch.bfloat16)]
    assert is_record(*record) and not is_record(*apart)
    for codes, scales, k_pe in (record, apart):
        layout.store(latent, scale, codes, scales, slots)
        block_layout.store_rows(k_pe.view(-1, 64), slots, rope)
    for kept, alone in zip(record, apart):
        assert torch.equal(kept, alone), fmt


def test_the_latent_split_mla_kernel_takes_nvfp4_mx_and_fp8_ds_mla_records_and_says_what_it_refuses(monkeypatch):
    """`mla_block_scaled_cuda.latent_split_refusal`, asked for each call the CUDA entry takes: NVFP4, MXFP4, MXFP8
    and fp8_ds_mla latents, one record a token with a page's rows adjacent (its one copy a page run), and tiles of
    32 tokens that are whole pages or lie inside one. Each refusal names its reason (the device checks come after
    these, so this runs on CPU tensors; the GPU's shared memory is replaced)."""
    from harness.kv_paths import block_layout
    from kernels import mla_block_scaled_cuda as cuda

    rope = torch.zeros(1, 64, dtype=torch.bfloat16)
    nvfp4 = block_layout.of(F.get_format("nvfp4"), mla=True)
    ds = block_layout.of(F.get_format("ds_mla_e4m3"), mla=True)
    records = nvfp4.allocate_latent_rows(2, 16, 512, rope)
    assert "it reads NVFP4, MXFP4, MXFP8 and fp8_ds_mla latents, got e2m1/e4m3/32" == cuda.latent_split_refusal(
        *records, ("e2m1", "e4m3", 32))
    monkeypatch.setattr(cuda, "_gpu", lambda index: ((9, 0), 232448))   # an H100's / H200's shared memory a block
    for name, layout in (("nvfp4", cuda.NVFP4), ("mxfp4", cuda.MXFP4), ("mxfp8", cuda.MXFP8),
                         ("ds_mla_e4m3", cuda.FP8_DS_MLA)):
        fmt = block_layout.of(F.get_format(name), mla=True)
        assert tuple(fmt.kernel_args.values()) == layout, name
        assert cuda.latent_split_refusal(*fmt.allocate_latent_rows(2, 16, 512, rope), layout) is None, name
    monkeypatch.setattr(cuda, "_gpu", lambda index: ((9, 0), 65536))
    assert "91152 bytes of shared memory" in cuda.latent_split_refusal(*ds.allocate_latent_rows(2, 16, 512, rope),
                                                                      cuda.FP8_DS_MLA)
    ds_apart = [*ds.allocate(2, 16, 1, 512, "cpu"), torch.zeros(2, 16, 64, dtype=torch.bfloat16)]
    assert "one 656-byte record a token" in cuda.latent_split_refusal(*ds_apart, cuda.FP8_DS_MLA)
    apart = [*nvfp4.allocate(2, 16, 1, 512, "cpu"), torch.zeros(2, 16, 64, dtype=torch.bfloat16)]
    assert "one 416-byte record a token" in cuda.latent_split_refusal(*apart, cuda.NVFP4)
    assert "page 24" in cuda.latent_split_refusal(*nvfp4.allocate_latent_rows(2, 24, 512, rope), cuda.NVFP4)
    codes, scales, k_pe = nvfp4.allocate_latent_rows(2, 16, 512, rope)
    assert cuda.is_record(codes, scales, k_pe)
    assert "rows adjacent" in cuda.latent_split_refusal(codes[:, ::2], scales[:, ::2], k_pe[:, ::2], cuda.NVFP4)


def test_the_latent_split_mla_kernel_loads_both_builds_at_its_first_call(monkeypatch):
    """The latent split's two builds (REG_T: P . C's fragments in registers, 2 blocks an SM; or through shared memory
    at 3) are chosen by the call's grid, so a CUDA graph captured for another batch may take the other: both are
    built at the first call, the call's own first, and only the call's own failure is raised there (nvrtc.build
    remembers the other's reason for the call that needs it). nvrtc.build is replaced by a recorder (no GPU here)."""
    from kernels import mla_block_scaled_cuda as cuda
    from kernels import nvrtc

    calls = []

    def build(path, name, defines, device):
        calls.append(dict(defines))
        if dict(defines)["REG_T"] == fail:
            raise nvrtc.BuildError("no such build")
        return f"kernel REG_T={dict(defines)['REG_T']}"

    monkeypatch.setattr(nvrtc, "build", build)
    for reg_t in (False, True):
        fail = None
        calls.clear()
        assert cuda._latent_split_kernel(16, True, False, reg_t, 0) == f"kernel REG_T={int(reg_t)}"
        assert [(c["REG_T"], c["CTAS"]) for c in calls] == [(int(reg_t), 2 if reg_t else 3),
                                                             (int(not reg_t), 3 if reg_t else 2)]
        assert all(c["PAGE"] == 16 and c["Q_BF16"] == 1 and c["HAS_SCALE"] == 0 for c in calls)
        fail = int(not reg_t)
        assert cuda._latent_split_kernel(16, True, False, reg_t, 0) == f"kernel REG_T={int(reg_t)}"
        fail = int(reg_t)
        with pytest.raises(nvrtc.BuildError, match="no such build"):
            cuda._latent_split_kernel(16, True, False, reg_t, 0)
    fail, calls[:] = None, []   # fp8_ds_mla records: both builds at 2 blocks an SM (the fp8 rows' shared memory)
    assert cuda._latent_split_kernel(64, False, False, True, 0, cuda.FP8_DS_MLA) == "kernel REG_T=1"
    assert [(c["REG_T"], c["CTAS"], c["ELEM_E4M3"], c["PAGE"], c["Q_BF16"]) for c in calls] == [(1, 2, 1, 64, 0),
                                                                                                (0, 2, 1, 64, 0)]
    assert all("FP8_PE" not in c for c in calls)
    calls.clear()   # kernels/mla_decode.py's plain FP8 cache, e5m2: k_pe's codes fp8 too, the e5m2 widening
    assert cuda._latent_split_kernel(16, True, True, False, 0, cuda.PLAIN_FP8[torch.float8_e5m2]) == "kernel REG_T=0"
    assert [(c["REG_T"], c["CTAS"], c["ELEM_E4M3"], c["FP8_PE"], c["FMT_E5M2"], c["HAS_SCALE"]) for c in calls] == \
        [(0, 2, 1, 1, 1, 1), (1, 2, 1, 1, 1, 1)]


def test_the_latent_split_plan_keeps_one_wave_whole_tiles_and_short_splits_at_two_blocks_an_sm():
    """`mla_block_scaled_cuda.latent_split_plan` over batches 1-64 and contexts 1 - 1M on 132 and 78 SMs: the splits
    cover every slot with none empty, in whole tiles; the grid fits one wave (3 blocks an SM, 2 where a split would
    be shorter than LONG_SPLIT at 3, at most 2 splits an SM for one sequence; over fp8 rows 2 blocks an SM); a split
    has 4 tiles, or 2 where 4 would leave more than half the SMs idle. And the H200 shapes the rule was measured on
    (kernels/BENCHMARKS.md, session 48): the split counts that were fastest there (batch 32 at 8k excepted: 8 splits
    were 3% faster than the 12 kept, to keep batch 8 at 32k at 49 splits)."""
    from kernels import mla_block_scaled_cuda as cuda

    for sms, batch, ctas in itertools.product((132, 78), (1, 2, 3, 8, 16, 64), (cuda.SPLIT_CTAS, cuda.FP8_CTAS)):
        for tokens in (1, 31, 100, 1000, 8192, 32768, 131072, 1 << 20):
            splits, per = cuda.latent_split_plan(tokens, batch, sms, ctas)
            what = f"{sms} SMs, batch {batch}, {ctas} blocks an SM, {tokens} tokens: {splits} x {per}"
            assert per % cuda.TOKENS == 0 and splits * per >= tokens > (splits - 1) * per, what
            at_most = max(1, min(ctas * sms // batch, cuda.SPLIT_MAX_SPLITS_PER_SM * sms))
            short = -(-tokens // at_most) < cuda.LONG_SPLIT
            assert splits * batch <= max(batch, (min(ctas, cuda.REG_T_CTAS) if short else ctas) * sms), what
            assert splits <= cuda.SPLIT_MAX_SPLITS_PER_SM * sms, what
            tiles = per // cuda.TOKENS
            assert splits == 1 or tiles >= 2, what
            assert tiles >= cuda.MIN_SPLIT_TILES or splits == 1 or \
                -(-tokens // (cuda.MIN_SPLIT_TILES * cuda.TOKENS)) * batch < sms // 2, what
    measured = {(1, 8192): 128, (1, 16384): 128, (1, 32768): 256, (2, 8192): 64, (2, 32768): 128, (4, 8192): 64,
                (4, 32768): 64, (8, 8192): 32, (8, 32768): 49, (8, 131072): 49, (16, 8192): 16}
    assert {shape: cuda.latent_split_plan(shape[1], shape[0], 132)[0] for shape in measured} == measured


def test_mla_split_plan_shortens_splits_only_while_sms_would_be_idle(monkeypatch):
    """`splits.plan_splits` with MLA's idle_min_tokens (kernels/mla_decode.py's launchers): 128-token splits where
    256-token ones leave SMs without a program (one sequence's 16 heads are one program), never past one program an
    SM (batch 4 at 8k was 8% slower there on an H200), and nothing changes once the batch fills the GPU. The device's
    SM count is replaced (132, an H100's or H200's): no GPU here."""
    from kernels import splits

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))

    def plan(tokens, programs, idle):
        return splits.plan_splits(tokens, programs, 32, 2, None, None, whole_waves=True,
                                  idle_min_tokens=splits.MLA_IDLE_MIN_TOKENS if idle else None)

    assert plan(8192, 1, False) == (32, 256) and plan(8192, 1, True) == (64, 128)
    assert plan(1024, 16, False) == (4, 256) and plan(1024, 16, True) == (8, 128)
    assert plan(8192, 4, True) == plan(8192, 4, False) == (32, 256)   # 4 x 64 would pass one program an SM
    assert plan(32768, 8, True) == plan(32768, 8, False) == (32, 1024)
    assert plan(100, 1, True) == (1, 128)


def test_the_h200_launch_table_is_the_h100s_but_its_mla_entries_and_says_so(monkeypatch):
    """kernels/configs.py: an H200 runs the H100's entries except our BF16 MLA kernel's programs an SM (measured apart
    on an H200, session 48) and the FP8 MLA latent split (at 128 heads up to 32k cache slots; session 49), and
    `describe` names which entries are its own, which the H100's it keeps, and the default a GPU outside the table
    gets. The device name is replaced: no GPU here."""
    from kernels import configs

    differ = {kind for kind in configs.H100 if configs.H200[kind] != configs.H100[kind]}
    assert differ == {"mla_bf16", "mla_fp8", "mla_fp8_many_heads"}
    assert configs.H200["mla_bf16"] == dict(configs.H100["mla_bf16"], programs_per_sm=2)
    assert configs.H200["mla_fp8"] == dict(configs.H100["mla_fp8"], latent_split=True)
    assert configs.H200["mla_fp8_many_heads"] == dict(configs.H100["mla_fp8_many_heads"], latent_split=True,
                                                      latent_split_max_tokens=32768)
    device = SimpleNamespace(index=0)
    for name, kind, source in (("NVIDIA H200", "mla_bf16", "recorded for this GPU"),
                               ("NVIDIA H200", "mla_fp8", "recorded for this GPU"),
                               ("NVIDIA H200", "mla_fp8_mma", "the H100's entry, kept in this GPU's table"),
                               ("NVIDIA H100 80GB HBM3", "mla_bf16", "recorded for this GPU"),
                               ("NVIDIA A100-SXM4-80GB", "mla_bf16", "default (H100 entry; GPU not in the table)")):
        monkeypatch.setattr(configs, "_device_name", lambda index, name=name: name)
        assert configs.describe(kind, device).endswith(f"({source})"), (name, kind)
        assert configs.launch_config(kind, device)["programs_per_sm"] == \
            (2 if (name, kind) == ("NVIDIA H200", "mla_bf16") else configs.H100[kind]["programs_per_sm"])
