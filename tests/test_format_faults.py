"""Cache-format fault injectors (harness/kv_paths/format_faults.py) against definitions written out here: what each
read must give of a healthy write, value by value, and the paths they apply to. Exact comparisons: a fault moves
scales by powers of two or moves whole codes and scales, so its read is the healthy read rearranged, bit for bit
(float32 in, decoded in float32)."""

from __future__ import annotations

import pytest
import torch

from harness.kv_paths import format_faults as FF
from harness.kv_paths import formats as F
from harness.kv_paths.cache import KVWriteStats, QuantizedKVLayer
from harness.kv_paths.spec import PathSpecError, parse_path

BLOCKED = ("nvfp4", "nvfp4_4over6", "mxfp8", "mxfp4", "fp4_mx_block16", "int8_per_token_head",
           "int4_per_token_head", "fp8_per_token_head", "int8_per_token_head_asym")
# [batch, heads, tokens, head_dim]: gqa's two heads of 32, an odd token count; MLA's latent row (one head of 64)
SHAPES = ((1, 2, 3, 32), (2, 1, 5, 64))


def _x(shape) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(shape) * torch.linspace(0.1, 4.0, shape[-1])  # channels of different sizes, as K has


def _scale(kv_format: F.KVFormat, x: torch.Tensor):
    return kv_format.scale_of_amax(x.abs().amax()) if kv_format.has_static_scale else None


def _healthy(kv_format: F.KVFormat, x: torch.Tensor) -> F.Encoded:
    return kv_format.encode(x, _scale(kv_format, x))


def _faulty(name: str, kv_format: F.KVFormat, x: torch.Tensor, side: str = "k") -> torch.Tensor:
    return FF.round_trip(name, side, kv_format, x, _scale(kv_format, x), True)[0]


def _slot_scales(kv_format: F.KVFormat, encoded: F.Encoded, x: torch.Tensor) -> list[list[list[float]]]:
    """Per token (batch, token): the whole scale of each (head, block) slot, read from the healthy write, in
    slot order (heads x blocks)."""
    block = kv_format.block_size or x.shape[-1]
    batch, heads, tokens, dim = x.shape
    return [[[encoded.value_scale[b, h, t, j].item() for h in range(heads) for j in range(0, dim, block)]
             for t in range(tokens)] for b in range(batch)]


def _read_with_slots(kv_format: F.KVFormat, encoded: F.Encoded, x: torch.Tensor, source) -> torch.Tensor:
    """The healthy codes read with slot i's scale (and zero point) taken from slot source(i, n), written out."""
    block = kv_format.block_size or x.shape[-1]
    batch, heads, tokens, dim = x.shape
    values = kv_format.element.to_values(encoded.codes)
    out = torch.empty(x.shape)
    blocks = -(-dim // block)
    for b in range(batch):
        for t in range(tokens):
            for h in range(heads):
                for j in range(blocks):
                    src = source(h * blocks + j, heads * blocks)
                    sh, sj = divmod(src, blocks)
                    cols = slice(j * block, min(dim, (j + 1) * block))
                    scale = encoded.value_scale[b, sh, t, sj * block]
                    # the static scale is per tensor here: a slot's whole scale moves with it
                    zero = 0.0 if encoded.value_zero is None else encoded.value_zero[b, sh, t, sj * block]
                    out[b, h, t, cols] = values[b, h, t, cols] * scale + zero
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", BLOCKED)
def test_scale_layout_reads_each_slot_with_the_next_slots_scale(name, shape):
    kv_format, x = F.get_format(name), _x(shape)
    want = _read_with_slots(kv_format, _healthy(kv_format, x), x, lambda i, n: (i + 1) % n)
    assert torch.equal(_faulty("scale_layout", kv_format, x), want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", BLOCKED)
def test_v_scale_first_blocks_reads_slot_i_with_slot_i_div_4(name, shape):
    kv_format, x = F.get_format(name), _x(shape)
    want = _read_with_slots(kv_format, _healthy(kv_format, x), x, lambda i, n: i // 4)
    assert torch.equal(_faulty("v_scale_first_blocks", kv_format, x, "v"), want)


@pytest.mark.parametrize("name", ("mxfp8", "mxfp4", "fp4_mx_block16"))
def test_e8m0_bias_reads_every_value_at_half(name):
    kv_format, x = F.get_format(name), _x(SHAPES[0])
    healthy = kv_format.decode(_healthy(kv_format, x))
    assert torch.equal(_faulty("e8m0_bias", kv_format, x), healthy / 2)  # a power of two: exact in float32


@pytest.mark.parametrize("name", ("nvfp4", "nvfp4_4over6", "mxfp4", "fp4_mx_block16"))
def test_nibble_swap_swaps_neighbouring_values(name):
    """Neighbours 2i, 2i+1 share a block (block sizes are even), so the swapped read is the healthy read with each
    pair's values exchanged."""
    kv_format, x = F.get_format(name), _x(SHAPES[0])
    healthy = kv_format.decode(_healthy(kv_format, x))
    pairs_swapped = healthy.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    got = _faulty("nibble_swap", kv_format, x)
    assert torch.equal(got, pairs_swapped) and not torch.equal(got, healthy)


@pytest.mark.parametrize("name", BLOCKED)
def test_dummy_block_scales_from_the_same_token_are_the_healthy_write(name):
    """A dummy pass that wrote exactly this token gives each block the scale the healthy write computes: the frozen
    write is then the healthy one, bit for bit (so the fault's whole effect is where the dummy pass differs)."""
    kv_format = F.get_format(name)
    x = _x((1, 2, 1, 32))
    dummy_range = torch.stack([x[0, :, 0], x[0, :, 0]])  # [2, heads, D]: min = max = the token
    got, _ = FF.round_trip("dummy_block_scales", "k", kv_format, x, _scale(kv_format, x), True, dummy_range)
    assert torch.equal(got, kv_format.decode(_healthy(kv_format, x)))


@pytest.mark.parametrize("name, tolerance", [
    ("nvfp4", 1.0 / 8),  # e4m3 block scale: 3 mantissa bits, the frozen scale itself rounds by up to 2^-4
    ("mxfp4", 1.0),  # e8m0: the floor of log2 amax can leave the covered range up to 2x under amax
    ("int8_per_token_head", 1.0 / 127),  # fp32 scale amax / 127; the code -128 reads 128 / 127 of the top
])
def test_dummy_block_scales_clip_values_beyond_the_dummy_range(name, tolerance):
    """Values twice the dummy pass's range are read back clipped near the range's top (the element's largest
    value times the frozen scale), never at their own size."""
    kv_format = F.get_format(name)
    dummy = _x((1, 2, 4, 32))
    dummy_range = torch.stack([dummy.amin(dim=(0, 2)), dummy.amax(dim=(0, 2))])
    got, ratio = FF.round_trip("dummy_block_scales", "k", kv_format, 2 * dummy, None, True, dummy_range)
    top = dummy.abs().amax()
    assert got.abs().max() <= top * (1 + tolerance) and ratio.max() > 1  # the write statistics see the clipping


def test_faults_reach_the_sides_they_name():
    nvfp4, mxfp8, e4m3 = (F.get_format(n) for n in ("nvfp4", "mxfp8", "e4m3"))
    assert FF.sides("v_scale_first_blocks", nvfp4, nvfp4) == ("v",)
    assert FF.sides("nibble_swap", e4m3, nvfp4) == ("v",) and FF.sides("nibble_swap", mxfp8, mxfp8) == ()
    assert FF.sides("e8m0_bias", mxfp8, nvfp4) == ("k",)
    assert FF.sides("scale_layout", e4m3, e4m3) == () and FF.sides("dummy_block_scales", nvfp4, e4m3) == ("k",)


@pytest.mark.parametrize("spec, phrase", [
    ("fp8_e4m3:calibrated:fault=nibble_swap", r"needs a format it reaches \(nvfp4, nvfp4_4over6, mxfp4, fp4_mx_block16"),
    ("mxfp8:fault=nibble_swap", "this path stores mxfp8"),
    ("nvfp4:fault=e8m0_bias", r"\(mxfp8, mxfp4, fp4_mx_block16"),
    ("k=nvfp4/v=fp8_e4m3:fault=v_scale_first_blocks", "V in a format with block scales .*K as nvfp4, V as fp8_e4m3"),
    ("fp8_e4m3:fault=scale_layout", "int8_per_token_head"),
    ("bf16:fault=dummy_block_scales", "bf16 stores none"),
])
def test_a_fault_the_path_cannot_have_is_refused_naming_why(spec, phrase):
    with pytest.raises(PathSpecError, match=phrase):
        parse_path(spec)


def test_the_cache_layer_puts_the_fault_on_its_side_only():
    """v_scale_first_blocks through the cache layer: K reads back as the healthy write, V as the faulty one."""
    path = parse_path("nvfp4:fault=v_scale_first_blocks")
    layer = QuantizedKVLayer(path, torch.tensor(1.0), torch.tensor(1.0), KVWriteStats())
    k, v = _x((1, 2, 3, 32)), _x((1, 2, 3, 32)).flip(-1)
    keys, values = layer.update(k, v)
    nvfp4 = F.get_format("nvfp4")
    assert torch.equal(keys, nvfp4.round_trip(k, torch.tensor(1.0))[0])
    assert torch.equal(values, FF.round_trip("v_scale_first_blocks", "v", nvfp4, v, torch.tensor(1.0), True)[0])
    assert not torch.equal(values, nvfp4.round_trip(v, torch.tensor(1.0))[0])


def test_no_kernel_takes_a_format_fault_path_so_the_fault_reaches_the_cache_on_cuda():
    """A cache-format fault lives in the torch round trip. On CUDA the fused write and the block-scaled decode kernel
    served these paths, so the healthy format was written and read under the fault's name. Every fault of the zoo
    was MISSED on an H200 in session 19, and caught on the CPU. Each kernel now refuses the fault path and still
    serves the healthy one."""
    from harness.kv_paths import capabilities
    from harness.zoo import FORMAT_FAULT_CLASSES

    for case in FORMAT_FAULT_CLASSES:
        healthy, faulty = parse_path(case.fmt), parse_path(case.path)
        assert capabilities.FUSED_WRITE_BLOCK_SCALED.refusal(healthy) is None, case.path
        assert capabilities.decode_refusal(healthy, False, 64) is None, case.path
        assert f"fault={case.fault}" in capabilities.FUSED_WRITE_BLOCK_SCALED.refusal(faulty)
        assert f"fault={case.fault}" in capabilities.decode_refusal(faulty, False, 64)
        assert "torch round trip" in capabilities.cache_write(faulty, "cuda")
