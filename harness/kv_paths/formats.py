"""KV-cache formats, each declared once: a `KVFormat` says what a cache stores (element type and bits, block size
and block-scale type, a static or global scale, the scale granularity, a zero point) and holds its reference
numerics in torch (`encode` / `decode`). The path-spec grammar, the cache write and read, calibration, the route's
capability checks and the docs ask the format object; `register_format` adds one (tests/test_formats.py defines a
toy format in the test file alone).

Convention (vLLM, SGLang, TRT-LLM): stored = element(x / scale), read = element x scale, math in fp32, where scale
is the product of a format's scales: a static (per tensor / per head) scale from the path's scale source, and a
block scale computed at write from the block's amax. Block scales are per token and head, over `block_size`
consecutive values of head_dim (0: the whole head, one scale per token and head); a last block shorter than the
block size takes its own scale, as zero padding to the block would give.

The FP8 e4m3 / e5m2 formats are `kernels/reference.py`'s quantise / dequantise, called as they are: their bits
(CPU and CUDA) are unchanged. Everything else is defined here:
- e2m1 (OCP MX v1.0, 5.3.3): 1 sign, 2 exponent (bias 1), 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no
  inf or NaN; round to nearest, ties to even code, saturating at 6. Codes are one a byte here (bit 3 the sign);
  `pack_e2m1` packs two a byte, the even index in the low nibble (torch's `float4_e2m1fn_x2`, OCP, NVIDIA).
- e8m0 (OCP MX 5.4.1): a biased exponent, 2^(bits - 127), bits 0..254; 255 is NaN; no zero, no sign.
- MX block scale (OCP MX 6.3): X = 2^(floor(log2 amax) - emax_element), emax 8 for e4m3, 2 for e2m1, clamped to the
  e8m0 range; elements = element(x / X), saturating (so the top of a block may clip: the spec's floor); a block
  holding NaN or inf gets a NaN scale. The engines' MX KV caches round up instead (`scale_rounding="ceil"`):
  X = 2^ceil(log2(amax / element max)), so nothing clips (SGLang's mxfp8 `ceil(log2(amax / 448))` and
  fp4_mx_block16 `ceil(log2(amax / 6))`; torchao's RCEIL).
- NVFP4 (NVIDIA): e2m1 values, an e4m3 scale per 16 values = e4m3(amax / 6 / s), s an fp32 per-tensor scale
  (vLLM's "global scale" is 1 / s: amax / (448 x 6) calibrated, 1.0 by default); a zero block scale writes zeros.
  4-over-6 (arXiv 2512.02010): each block tries amax -> 6 and amax -> 4 and keeps the one with the smaller squared
  error (ties: 6); its static scale leaves room for the larger block scale (amax / (256 x 6)).
- DeepSeek's MLA latent layouts (vLLM `fp8_ds_mla`, `nvfp4_ds_mla`; the byte records are harness/kv_paths/mla.py's):
  fp8_ds_mla stores the latent as e4m3 in tiles of 128, an fp32 scale per tile = max(amax / 448, FLT_MIN), and
  k_pe unquantised; nvfp4_ds_mla the latent as e2m1 under an e4m3 scale per 16 = e4m3(max(amax / 6, 2^-9)) rounded
  up to the next e4m3 value where nearest fell below (so a block's top never clips), values multiplied by the fp32
  reciprocal of that scale (vLLM's writer), no global scale, and k_pe as plain e4m3 with no scale at all.
- A format may be `unscaled`: values cast as they are (scale 1, no scale of any kind): nvfp4_ds_mla's k_pe, and the
  `unquantised` side (a K or V kept in the model's dtype: `k=fp8_e4m3/v=bf16`, fp8_ds_mla's k_pe).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import reference as fp8

# -- element types ------------------------------------------------------------------------------------------------

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> |value| (OCP MX v1.0 table)
# Rounding boundaries between neighbouring e2m1 magnitudes, and whether a value exactly on one rounds up: ties go
# to the even code (the one whose mantissa bit is 0), so up from an odd code, down from an even one.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_MAX = 6.0  # largest e2m1 magnitude
E8M0_BIAS = 127
E8M0_NAN = 255
E4M3_MAX = fp8.FP8_MAX["e4m3"]  # 448


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by their scale -> e2m1 codes (uint8, one a byte, bit 3 the sign): round to
    nearest, ties to even, saturating at 6; NaN -> +0 (a NaN block's scale carries the NaN)."""
    magnitude = scaled.float().abs().nan_to_num(nan=0.0)
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for lower, midpoint in enumerate(_E2M1_MIDPOINTS):
        above = magnitude >= midpoint if lower % 2 else magnitude > midpoint  # a tie goes to the even code
        code += above.to(torch.uint8)
    return code | (torch.signbit(scaled.float()).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, one a byte) -> fp32 values. The magnitude from the code's fields (exponent e = bits 1-2,
    mantissa m = bit 0: m/2 if e = 0, else 2^(e-1) (1 + m/2)), exact in fp32 and made on the codes' device: a table
    built from a Python list would be copied from host memory, which a CUDA graph capture refuses."""
    fields = (codes & 7).to(torch.int32)
    exponent, mantissa = fields >> 1, (fields & 1).float()
    magnitude = torch.where(exponent == 0, mantissa * 0.5, torch.exp2((exponent - 1).float()) * (1.0 + mantissa * 0.5))
    return torch.where((codes & 8).bool(), -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] one-a-byte codes -> [..., n] uint8, the even index in the low nibble (view as float4_e2m1fn_x2)."""
    assert codes.shape[-1] % 2 == 0, f"packing e2m1 needs an even count of values, got {codes.shape[-1]}"
    return (codes[..., 0::2] & 15) | ((codes[..., 1::2] & 15) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def e8m0_values(bits: torch.Tensor) -> torch.Tensor:
    """e8m0 bits (uint8) -> fp32 2^(bits - 127); 255 -> NaN. 2^-127 is an fp32 subnormal, exact."""
    value = torch.ldexp(torch.ones(bits.shape, dtype=torch.float32, device=bits.device), bits.int() - E8M0_BIAS)
    return torch.where(bits == E8M0_NAN, torch.full_like(value, float("nan")), value)


def floor_log2(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2 |a|) of finite non-zero fp32 values, exactly (frexp: a = m 2^e, m in [0.5, 1))."""
    _, exponent = torch.frexp(amax.float())
    return exponent - 1


def _fp8_codes(fmt: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda scaled: fp8.quantize(scaled, torch.ones((), device=scaled.device), fmt)


def _int_codes(low: int, high: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Round half to even, clamp to [low, high]; NaN -> 0 (its scale carries the NaN)."""
    return lambda scaled: scaled.float().nan_to_num(nan=0.0).round().clamp(low, high).to(dtype)


@dataclass(frozen=True, slots=True)
class ElementType:
    """What one stored value is: `to_codes` takes fp32 values already divided by their scale (saturating),
    `to_values` gives them back as fp32. `low` is the smallest code value (asymmetric formats: 0)."""

    name: str
    bits: int
    max_value: float  # the largest magnitude a code holds (|x / scale| beyond it clips)
    to_codes: Callable[[torch.Tensor], torch.Tensor]
    to_values: Callable[[torch.Tensor], torch.Tensor]
    low: float = 0.0


E4M3 = ElementType("e4m3", 8, E4M3_MAX, _fp8_codes("e4m3"), lambda c: c.float(), -E4M3_MAX)
E5M2 = ElementType("e5m2", 8, fp8.FP8_MAX["e5m2"], _fp8_codes("e5m2"), lambda c: c.float(), -fp8.FP8_MAX["e5m2"])
E2M1 = ElementType("e2m1", 4, E2M1_MAX, e2m1_codes, e2m1_values, -E2M1_MAX)
# the model's own dtype (bf16 here; 16 bits): the values as they are, for a side a format leaves unquantised
MODEL_DTYPE = ElementType("model dtype", 16, float("inf"), lambda x: x, lambda c: c.float(), float("-inf"))
INT8 = ElementType("int8", 8, 127.0, _int_codes(-128, 127, torch.int8), lambda c: c.float(), -128.0)
INT4 = ElementType("int4", 4, 7.0, _int_codes(-7, 7, torch.int8), lambda c: c.float(), -7.0)  # symmetric: no -8
UINT8 = ElementType("uint8", 8, 255.0, _int_codes(0, 255, torch.uint8), lambda c: c.float(), 0.0)


# -- block scales -------------------------------------------------------------------------------------------------

def _e4m3_block_scale(amax: torch.Tensor, target: float, floor: float = 0.0,
                      round_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4: e4m3(max(amax / target, floor)), saturating at 448; (stored e4m3, fp32). `round_up` (vLLM
    nvfp4_ds_mla): where the nearest e4m3 value fell below, the next one up (not past 448), so amax / scale never
    exceeds the element range. NaN stays NaN (vLLM's fmaxf would drop it; here a NaN block reads back NaN)."""
    wanted = amax / torch.full_like(amax, target)
    wanted = torch.where(wanted.isnan(), wanted, wanted.clamp_min(floor)) if floor else wanted
    stored = fp8.quantize(wanted, torch.ones((), device=amax.device), "e4m3")
    if round_up:
        bits = stored.view(torch.uint8)
        below = (stored.float() < wanted) & (bits < 0x7E)  # 0x7E = 448, the largest finite e4m3
        stored = torch.where(below, bits + 1, bits).view(torch.float8_e4m3fn)  # positive e4m3 bits are monotonic
    return stored, stored.float()


def _e8m0_block_scale(amax: torch.Tensor, element: ElementType,
                      rounding: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX ("floor"): 2^(floor(log2 amax) - emax_element); "ceil": 2^ceil(log2(amax / element max)), the
    smallest power of two that leaves amax unclipped (amax / element max in fp32, then its exact ceil log2). Clamped
    to e8m0; a zero block gets 2^-127, a block with NaN or inf a NaN scale. (stored uint8 bits, fp32)."""
    if rounding == "floor":
        exponent = floor_log2(amax) - (math.frexp(element.max_value)[1] - 1)  # floor log2 of the max, in Python
    else:  # frexp: r = m 2^e, m in [0.5, 1); ceil(log2 r) is e - 1 when r is a power of two (m = 0.5), else e
        amax = amax.float()
        mantissa, exponent = torch.frexp(amax / torch.full_like(amax, element.max_value))  # IEEE division anywhere
        exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    exponent = torch.where(amax > 0, exponent, torch.full_like(amax, -E8M0_BIAS, dtype=torch.int32))
    bits = (exponent.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    bits = torch.where(amax.isfinite(), bits, torch.full_like(bits, E8M0_NAN))
    return bits, e8m0_values(bits)


def _fp32_block_scale(amax: torch.Tensor, target: float, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token-head / per tile (vLLM): max(amax / target, floor) in fp32 (NaN stays NaN). Divided by a tensor:
    IEEE division on CUDA too, as the engines' kernels divide (`kernels.reference.amax_scale` says why)."""
    scale = torch.where(amax.isnan(), amax, (amax / torch.full_like(amax, target)).clamp_min(floor))
    return scale, scale


# -- the format ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Encoded:
    """What a write stores for x [..., D]: codes [..., D] (one a byte for 4-bit elements), block scales
    [..., blocks] in their stored dtype (None: no block scale), zero points [..., blocks] fp32 (asymmetric only), and
    the static scale (fp32, [] or broadcastable over x's leading dims)."""

    codes: torch.Tensor
    block_scales: torch.Tensor | None
    zero: torch.Tensor | None
    scale: torch.Tensor
    value_scale: torch.Tensor  # [..., D] fp32 (or broadcastable): the whole scale each value was divided by
    value_zero: torch.Tensor | None = None  # [..., D] fp32: the zero point each value was shifted by (asymmetric)


def fp32_scale(scale: torch.Tensor | float | None, device) -> torch.Tensor:
    """The scale an encode divides by, as an fp32 tensor on `device`: a given tensor or number, 1.0 for None (no host
    copy of a tensor)."""
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32)
    return torch.full((), 1.0 if scale is None else float(scale), dtype=torch.float32, device=device)


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One KV-cache format. `name` is the path's `fmt` (the registry key); `spellings` are path-spec heads."""

    name: str
    spellings: tuple[str, ...]
    element: ElementType
    block_size: int = 0  # values per block scale; 0: the whole head (one scale per token and head)
    block_scale: str = ""  # "e4m3" | "e8m0" | "fp32"; "": none (only the static scale)
    # the largest |x / s| a static scale s covers (s = amax / static_range); 0: no static scale, all computed at write
    static_range: float = 0.0
    block_targets: tuple[float, ...] = ()  # e4m3 / fp32 block scales: the block amax maps to these (4-over-6: 6, 4)
    scale_rounding: str = "floor"  # e8m0 block scales: "floor" (OCP MX 6.3, may clip) or "ceil" (engines: no clip)
    scale_floor: float = 0.0  # fp32 / e4m3 block scales: the smallest scale handed out (vLLM: 1e-6)
    zero_point: bool = False  # asymmetric: codes = (x - min) / scale, read = code x scale + min
    saturating_only: bool = True  # False: the path's cast option (sat / nosat) applies (FP8 only)
    scale_round_up: bool = False  # e4m3 block scales: round up where nearest fell below (vLLM nvfp4_ds_mla)
    reciprocal: bool = False  # values multiplied by the fp32 reciprocal of their block scale, not divided by it
    unscaled: bool = False  # values cast as they are: no static, block or computed scale (scale 1)
    # named alone, V (MLA: k_pe) takes this format instead of this one (fp8_ds_mla: k_pe unquantised)
    pairs_with: str = ""
    layouts: tuple[str, ...] = ("gqa", "mla")  # model layouts it applies to (`mla`: one compressed latent)
    engines: str = ""  # which engine flag spells it, and where they differ
    description: str = ""

    def __post_init__(self):
        if not self.spellings:
            raise ValueError(f"KV format {self.name!r}: needs at least one spelling (a path-spec head)")
        if self.block_scale not in ("", "e4m3", "e8m0", "fp32"):
            raise ValueError(f"KV format {self.name!r}: block_scale {self.block_scale!r}; expected e4m3, e8m0 or fp32")
        if self.scale_rounding not in ("floor", "ceil"):
            raise ValueError(f"KV format {self.name!r}: scale_rounding {self.scale_rounding!r}; expected floor or ceil")
        if self.block_scale in ("e4m3", "fp32") and not self.block_targets:
            raise ValueError(f"KV format {self.name!r}: an {self.block_scale} block scale needs block_targets")
        if not self.block_scale and not self.static_range and not self.unscaled:
            raise ValueError(f"KV format {self.name!r}: no block scale and no static scale: nothing scales it "
                             f"(unscaled=True stores values as they are)")
        if self.unscaled and (self.block_scale or self.static_range):
            raise ValueError(f"KV format {self.name!r}: unscaled, yet it declares a scale")
        if self.zero_point and (self.block_size or self.block_scale != "fp32"):
            raise ValueError(f"KV format {self.name!r}: a zero point is per token and head here (block_size 0, "
                             f"fp32 block scale)")

    # -- what it is --
    @property
    def spec_name(self) -> str:
        return self.spellings[0]

    @property
    def has_static_scale(self) -> bool:
        return self.static_range > 0

    @property
    def is_legacy_fp8(self) -> bool:
        """FP8 e4m3 / e5m2 under a static scale alone: what our kernels, the fused write and the C write serve."""
        return self.element in (E4M3, E5M2) and not self.block_scale and not self.unscaled

    @property
    def granularity(self) -> str:
        if self.unscaled:
            return "unscaled"
        if not self.block_scale:
            return "per tensor / per head (static)"
        return "per token-head" if self.block_size == 0 else f"block of {self.block_size}"

    def bytes_per_token(self, head_dim: int, heads: int = 1) -> float:
        """Bytes one token's K (or V) takes: elements, block scales and zero points (the static scale is per
        tensor or head, not per token)."""
        blocks = -(-head_dim // self.block_size) if self.block_size else 1
        scale_bytes = {"": 0, "e4m3": 1, "e8m0": 1, "fp32": 4}[self.block_scale] * blocks
        zero_bytes = 4 * blocks if self.zero_point else 0
        return heads * (head_dim * self.element.bits / 8 + scale_bytes + zero_bytes)

    def describe(self) -> str:
        return self.description or f"{self.element.name} values, {self.granularity} scales"

    # -- scales --
    def scale_of_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The static scale that maps `amax` onto the format's static range (calibration, warm-up)."""
        assert self.has_static_scale, f"KV format {self.name!r} has no static scale"
        if self.is_legacy_fp8:
            return fp8.amax_scale(amax, self.element.name)  # the bits every FP8 path had
        amax = amax.float()
        return (amax / torch.full_like(amax, self.static_range)).clamp_min(fp8.MIN_SCALE)

    # -- numerics --
    def encode(self, x: torch.Tensor, scale: torch.Tensor | float | None = None, saturate: bool = True) -> Encoded:
        """x [..., D] (any float dtype) -> Encoded. `scale`: the static scale (None: 1.0), [] or broadcastable."""
        if self.unscaled:  # values cast as they are (an e4m3 cast at scale 1, or the model dtype kept)
            one = torch.ones((), dtype=torch.float32, device=x.device)
            return Encoded(self.element.to_codes(x), None, None, one, one)
        s = fp32_scale(scale, x.device)
        if self.is_legacy_fp8:
            codes = fp8.quantize(x, s, self.element.name, saturate=saturate)
            return Encoded(codes, None, None, s, s)
        blocks = _blocks(x.float(), self.block_size)  # [..., nblocks, B]
        s_blocks = s.unsqueeze(-1) if s.dim() else s  # [heads, 1, 1] -> [heads, 1, 1, 1]: over [.., nblocks, B]
        if self.zero_point:
            return self._encode_affine(x, blocks, s)
        block_fp32, stored, codes = self._block_codes(blocks, s_blocks)
        value_scale = torch.broadcast_to(block_fp32.unsqueeze(-1) * s_blocks, blocks.shape)
        return Encoded(_unblock(codes, x.shape[-1]), stored, None, s, _unblock(value_scale, x.shape[-1]))

    def decode(self, encoded: Encoded, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Encoded -> values in `out_dtype` (element x whole scale in fp32, cast once)."""
        if self.is_legacy_fp8:
            return fp8.dequantize(encoded.codes, encoded.scale, out_dtype=out_dtype)
        values = self.element.to_values(encoded.codes) * encoded.value_scale
        if encoded.value_zero is not None:
            values = values + encoded.value_zero
        return values.to(out_dtype)

    def round_trip(self, x: torch.Tensor, scale=None, saturate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(read back in x's dtype, |x / scale| / element max per value: > 1 clipped)."""
        encoded = self.encode(x, scale, saturate)
        return self.decode(encoded, x.dtype), self.clip_ratio(x, encoded)

    def clip_ratio(self, x: torch.Tensor, encoded: Encoded) -> torch.Tensor:
        """|x / scale| / element max per value (FP8: the ops the write statistics always used, same bits). An fp32
        block scale (amax / target, computed at write) puts the block's top at the element max within the fp32
        roundings of amax / target and x / scale: such a ratio (up to 1 + 2^-21, four fp32 ulps) is the max itself,
        not a clipped value (fp8_per_token_head and fp8_ds_mla read kv_clipped_frac 0.004 on healthy writes
        before)."""
        if encoded.value_zero is not None:
            ratio = ((x.float() - encoded.value_zero) / encoded.value_scale).abs() / self.element.max_value
        else:
            ratio = (x.float() / encoded.value_scale).abs() / self.element.max_value
        if self.block_scale == "fp32":
            ratio = torch.where((ratio > 1) & (ratio <= 1 + 2.0 ** -21), torch.ones_like(ratio), ratio)
        return ratio

    def _block_codes(self, blocks: torch.Tensor, s_blocks: torch.Tensor):
        """Per block: (fp32 block scale [..., nblocks], stored block scale, codes [..., nblocks, B])."""
        per_static = blocks / s_blocks  # x / s
        amax = per_static.abs().amax(dim=-1)  # NaN propagates: amax of a block with NaN is NaN
        if self.block_scale == "e8m0":
            stored, block_fp32 = _e8m0_block_scale(amax, self.element, self.scale_rounding)
            return block_fp32, stored, self._codes(per_static, block_fp32)
        best = None
        for target in self.block_targets:  # 4-over-6: the candidate with the smaller squared error wins (ties: first)
            if self.block_scale == "e4m3":
                stored, block_fp32 = _e4m3_block_scale(amax, target, self.scale_floor, self.scale_round_up)
            else:
                stored, block_fp32 = _fp32_block_scale(amax, target, self.scale_floor)
            codes = self._codes(per_static, block_fp32)
            error = (self.element.to_values(codes) * block_fp32.unsqueeze(-1) - per_static).square().sum(-1)
            if best is None:
                best = (block_fp32, stored, codes, error)
                continue
            better = error < best[3]
            best = (torch.where(better, block_fp32, best[0]), torch.where(better, stored, best[1]),
                    torch.where(better.unsqueeze(-1), codes, best[2]), torch.where(better, error, best[3]))
        return best[0], best[1], best[2]

    def _codes(self, per_static: torch.Tensor, block_fp32: torch.Tensor) -> torch.Tensor:
        """element(x / s / block scale); a zero block scale writes zeros (nothing to divide by)."""
        divisor = block_fp32.unsqueeze(-1)
        # vLLM's nvfp4_ds_mla writer multiplies by the fp32 reciprocal (a tie of x / scale may round the other way)
        divided = per_static * (torch.ones_like(divisor) / divisor) if self.reciprocal else per_static / divisor
        scaled = torch.where(divisor == 0, torch.zeros_like(per_static), divided)
        return self.element.to_codes(scaled)

    def _encode_affine(self, x: torch.Tensor, blocks: torch.Tensor, s: torch.Tensor) -> Encoded:
        """Asymmetric: scale = max((max - min) / (code range), floor), zero = min; codes = (x - min) / scale."""
        low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
        span = self.element.max_value - self.element.low
        scale = torch.where(high.isnan() | low.isnan(), high - low, ((high - low) / span).clamp_min(self.scale_floor))
        codes = self.element.to_codes((blocks - low.unsqueeze(-1)) / scale.unsqueeze(-1))
        value_scale = _unblock(torch.broadcast_to(scale.unsqueeze(-1), blocks.shape), x.shape[-1])
        value_zero = _unblock(torch.broadcast_to(low.unsqueeze(-1), blocks.shape), x.shape[-1])
        return Encoded(_unblock(codes, x.shape[-1]), scale, low, s, value_scale, value_zero)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., D] -> [..., nblocks, B]: a short last block is padded with zeros (which move no block's amax)."""
    size = block_size or x.shape[-1]
    pad = -x.shape[-1] % size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, (-1, size))


def _unblock(blocked: torch.Tensor, length: int) -> torch.Tensor:
    """[..., nblocks, B] -> [..., D], dropping the padding."""
    return blocked.flatten(-2)[..., :length]


# -- the registry -------------------------------------------------------------------------------------------------

_REGISTRY: dict[str, KVFormat] = {}
_SPELLINGS: dict[str, str] = {}
# Modules outside this one that registered formats: worker processes (spawned, so fresh interpreters) import them
# before replaying, so a format a user's module declares is known there too (`harness.executor.local.worker_init`).
_EXTENSION_MODULES: dict[str, str] = {}  # format name -> the module that registered it


def register_format(kv_format: KVFormat) -> KVFormat:
    """Add a format: its name becomes a path's `fmt`, its spellings path-spec heads. A name or spelling taken by
    another format is refused."""
    taken = [s for s in (kv_format.name, *kv_format.spellings) if _SPELLINGS.get(s, kv_format.name) != kv_format.name]
    if kv_format.name in _REGISTRY and _REGISTRY[kv_format.name] is not kv_format:
        taken.append(kv_format.name)
    if taken:
        raise ValueError(f"KV format {kv_format.name!r}: {', '.join(taken)} already names another format")
    _REGISTRY[kv_format.name] = kv_format
    for spelling in kv_format.spellings:
        _SPELLINGS[spelling] = kv_format.name
    caller = sys._getframe(1).f_globals.get("__name__", "")  # noqa: SLF001 - who declared it
    if caller not in (__name__, "__main__", ""):
        _EXTENSION_MODULES[kv_format.name] = caller
    return kv_format


def extension_modules(names=None) -> tuple[str, ...]:
    """Modules (besides this one) that registered formats in this process: those of the formats `names` (every one
    when None). A worker imports only the modules of the formats its run uses, so a module the parent imported
    and the worker cannot (a test file, a notebook) costs a run that does not use its formats nothing."""
    return tuple(dict.fromkeys(module for name, module in _EXTENSION_MODULES.items()
                               if names is None or name in names))


def load_extensions(modules: tuple[str, ...]) -> None:
    """Import the modules that registered formats in the parent process (a worker's start)."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ImportError(f"KV formats registered by module {module!r} in the parent process: this worker cannot "
                              f"import it ({error}); put the module on the workers' PYTHONPATH") from error


def get_format(name: str) -> KVFormat:
    if name not in _REGISTRY:
        raise KeyError(f"unknown KV format {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def format_of_spelling(head: str) -> KVFormat | None:
    """The format a path-spec head spells (`fp8`, `fp8_e4m3`, `nvfp4`, ...), or None."""
    return _REGISTRY.get(_SPELLINGS.get(head, ""))


def registered() -> list[KVFormat]:
    return list(_REGISTRY.values())


def spellings() -> list[str]:
    return list(_SPELLINGS)


# -- the formats engines ship --------------------------------------------------------------------------------------

register_format(KVFormat(
    "e4m3", ("fp8_e4m3", "fp8"), E4M3, static_range=E4M3_MAX, saturating_only=False,
    engines="vLLM fp8 / fp8_e4m3, SGLang fp8_e4m3",
    description="fp8 e4m3 values under a static per-tensor or per-head scale (or per token with per_token)"))
register_format(KVFormat(
    "e5m2", ("fp8_e5m2",), E5M2, static_range=fp8.FP8_MAX["e5m2"], saturating_only=False,
    engines="vLLM and SGLang fp8_e5m2",
    description="fp8 e5m2 values under a static per-tensor or per-head scale (or per token with per_token)"))
register_format(KVFormat(
    "nvfp4", ("nvfp4",), E2M1, block_size=16, block_scale="e4m3", static_range=E4M3_MAX * E2M1_MAX,
    block_targets=(E2M1_MAX,), engines="vLLM and SGLang nvfp4 (FlashInfer / TRT-LLM layout)",
    description="NVFP4: e2m1 values, an e4m3 scale per 16 values (amax -> 6), an fp32 per-tensor scale"))
register_format(KVFormat(
    "nvfp4_4over6", ("nvfp4_4over6",), E2M1, block_size=16, block_scale="e4m3", static_range=256.0 * E2M1_MAX,
    block_targets=(E2M1_MAX, 4.0), engines="vLLM nvfp4_4over6",
    description="NVFP4 with 4-over-6 block scales: each block maps its amax to 6 or to 4, whichever errs less"))
register_format(KVFormat(
    "mxfp8", ("mxfp8",), E4M3, block_size=32, block_scale="e8m0", scale_rounding="ceil",
    engines="SGLang mxfp8 (kernels/ops/quantization/mxfp8_quant.py: scale 2^ceil(log2(amax / 448)))",
    description="MXFP8: e4m3 values, an e8m0 (power-of-two) scale per 32 values, rounded up (no clipping)"))
register_format(KVFormat(
    "mxfp4", ("mxfp4",), E2M1, block_size=32, block_scale="e8m0", engines="none as a KV flag (OCP MX, weights)",
    description="MXFP4 (OCP MX): e2m1 values, an e8m0 (power-of-two) scale per 32 values"))
register_format(KVFormat(
    "fp4_mx_block16", ("fp4_mx_block16",), E2M1, block_size=16, block_scale="e8m0", scale_rounding="ceil",
    engines="SGLang fp4_mx_block16, formerly fp4_e2m1 (kvfp4_tensor.py: scale 2^ceil(log2(amax / 6)))",
    description="e2m1 values, an e8m0 (power-of-two) scale per 16 values, rounded up (SGLang's MX-style FP4)"))
register_format(KVFormat(
    "fp8_per_token_head", ("fp8_per_token_head",), E4M3, block_scale="fp32", block_targets=(E4M3_MAX,),
    scale_floor=1e-6, engines="vLLM fp8_per_token_head",
    description="fp8 e4m3 values, an fp32 scale per token and head (amax / 448, at least 1e-6), written at store"))
register_format(KVFormat(
    "int8_per_token_head", ("int8_per_token_head",), INT8, block_scale="fp32", block_targets=(127.0,),
    scale_floor=1e-6, engines="vLLM int8_per_token_head (symmetric)",
    description="int8 values (round half to even, [-128, 127]), an fp32 scale per token and head (amax / 127)"))
register_format(KVFormat(
    "int8_per_token_head_asym", ("int8_per_token_head_asym",), UINT8, block_scale="fp32", block_targets=(255.0,),
    scale_floor=1e-6, zero_point=True, engines="SGLang INT8 KV (asymmetric, per token-head)",
    description="uint8 codes, an fp32 scale (max - min) / 255 and an fp32 zero point (min) per token and head"))
register_format(KVFormat(
    "int4_per_token_head", ("int4_per_token_head",), INT4, block_scale="fp32", block_targets=(7.0,),
    scale_floor=1e-6, engines="vLLM int4_per_token_head: theirs is a 16-level codebook with fp16 group scales; "
                              "ours is linear symmetric int4",
    description="int4 values ([-7, 7], linear), an fp32 scale per token and head (amax / 7)"))

# -- sides kept (nearly) as they are -------------------------------------------------------------------------------

register_format(KVFormat(
    "unquantised", ("unquantised",), MODEL_DTYPE, unscaled=True,
    engines="a side an engine leaves in the model dtype (fp8_ds_mla's k_pe); spelled bf16 in k=/v=",
    description="values kept in the model's dtype (bf16), unquantised"))
register_format(KVFormat(
    "e4m3_unscaled", ("fp8_e4m3_unscaled",), E4M3, unscaled=True,
    engines="vLLM nvfp4_ds_mla's k_pe (plain e4m3, no scale)",
    description="fp8 e4m3 values cast as they are (scale 1, never calibrated)"))

# -- DeepSeek's MLA latent layouts (vLLM; byte records in harness/kv_paths/mla.py) ----------------------------------

register_format(KVFormat(
    "ds_mla_e4m3", ("fp8_ds_mla",), E4M3, block_size=128, block_scale="fp32", block_targets=(E4M3_MAX,),
    scale_floor=2.0 ** -126, pairs_with="unquantised", layouts=("mla",),  # 2^-126 = FLT_MIN, vLLM's floor
    engines="vLLM fp8_ds_mla (FlashMLA sparse): 512 e4m3 + 4 fp32 tile scales + 64 bf16 RoPE = 656 bytes a token",
    description="MLA latent as e4m3 in tiles of 128, an fp32 scale per tile (amax / 448); k_pe unquantised"))
register_format(KVFormat(
    "ds_mla_nvfp4", ("nvfp4_ds_mla",), E2M1, block_size=16, block_scale="e4m3", block_targets=(E2M1_MAX,),
    scale_floor=2.0 ** -9, scale_round_up=True, reciprocal=True, pairs_with="e4m3_unscaled", layouts=("mla",),
    engines="vLLM nvfp4_ds_mla (SM100): 256 e2m1 bytes + 64 e4m3 RoPE + 32 permuted e4m3 scales = 352 bytes a token",
    description="MLA latent as e2m1 with an e4m3 scale per 16 (amax / 6 rounded up, no global scale); k_pe plain "
                "e4m3"))
