"""What each of our kernels serves, declared once (as vLLM's AttentionBackend declares its KV-cache dtypes, head
sizes and layouts): the route (harness/replay/route.py) and the cache write (harness/kv_paths/cache.py) ask
`refusal(...)` and fall back to the torch round trip and torch attention, with the reason, where a kernel does not
serve a path. The kernels themselves (kernels/) stay importable without `harness`: this table names them.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.kv_paths import block_layout
from harness.kv_paths.format_faults import FORMAT_FAULTS
from harness.kv_paths.spec import KVPath


@dataclass(frozen=True, slots=True)
class KernelCapability:
    """A kernel and what it serves: KV formats (KVFormat names), scale granularities, head sizes (inclusive range;
    None: any) and model layouts (`gqa`: per-head K/V; `mla`: one compressed latent)."""

    name: str
    where: str  # the kernel's entry point
    formats: tuple[str, ...]
    granularities: tuple[str, ...]
    layouts: tuple[str, ...] = ("gqa", "mla")
    head_sizes: tuple[int, int] | None = None
    mixed: bool = False  # K and V in different formats (one launch per tensor): True; one cache dtype: False
    power_of_two_heads: bool = False  # head sizes must be powers of two (the block-scaled kernels' tiles)

    def refusal(self, kv_path: KVPath, layout: str | None = None, head_size: int | None = None) -> str | None:
        """Why this kernel does not serve `kv_path` (None: it does)."""
        if not kv_path.is_quantized:
            return "not an FP8 path"
        # a DeepSeek latent layout names its k_pe side's format itself (fp8_ds_mla: k_pe in bf16 beside the latent)
        paired = layout == "mla" and kv_path.k_format.pairs_with == kv_path.v_format.name
        sides = (kv_path.k_format,) if paired else (kv_path.k_format, kv_path.v_format)
        unserved = [f.spec_name for f in dict.fromkeys(sides) if f.name not in self.formats]
        if unserved:
            return (f"{self.name} ({self.where}) serves {', '.join(self.formats)}; not {', '.join(unserved)}: the torch "
                    f"round trip of harness/kv_paths/formats.py instead")
        if kv_path.fault in FORMAT_FAULTS:  # on CUDA the fused write and the decode kernel once bypassed it (session 19)
            return (f"fault={kv_path.fault} is a cache-format fault injected in the torch round trip "
                    f"(harness/kv_paths/format_faults.py); {self.name} would write and read the healthy format")
        if kv_path.hadamard:
            return (f"{self.name} ({self.where}) reads K as written, against the model's query; this path rotates "
                    f"K and Q (hadamard): the torch round trip and torch attention instead")
        if not self.mixed and not paired and kv_path.k_format is not kv_path.v_format:
            return (f"{self.name} ({self.where}) reads K and V in one format; this path stores K in "
                    f"{kv_path.k_format.spec_name} and V in {kv_path.v_format.spec_name}")
        if kv_path.granularity not in self.granularities:
            what = "per-token scales" if kv_path.granularity == "per_token" else f"{kv_path.granularity} scales"
            return f"{what}: {self.name} ({self.where}) takes {' or '.join(self.granularities)} scales"
        if layout is not None and layout not in self.layouts:
            return f"{self.name} ({self.where}) serves {' and '.join(self.layouts)} layouts, not {layout}"
        if head_size is not None and self.head_sizes and not self.head_sizes[0] <= head_size <= self.head_sizes[1]:
            return f"{self.name} ({self.where}) takes head sizes {self.head_sizes[0]}-{self.head_sizes[1]}, not {head_size}"
        if head_size is not None and self.power_of_two_heads and head_size & (head_size - 1):
            return f"{self.name} ({self.where}) takes head sizes that are powers of two, not {head_size}"
        return None


FP8 = ("e4m3", "e5m2")
# decode: paged FP8 K/V read with a static scale per tensor or head (kernels/decode_attention.py asserts 16-256)
DECODE_ATTENTION = KernelCapability("decode_attention", "kernels/decode_attention.py", FP8,
                                    ("per_tensor", "per_head"), ("gqa",), (16, 256))
MLA_DECODE = KernelCapability("mla_decode", "kernels/mla_decode.py", FP8, ("per_tensor", "per_head"), ("mla",))
# the CUDA cache write: round trip, paged store and write statistics in one launch (per-token scales computed there)
FUSED_WRITE = KernelCapability("quantize_store", "kernels/store_kv.py", FP8, ("per_tensor", "per_head", "per_token"),
                               mixed=True)
# the CPU cache write in C, used where probed bit-equal to torch (kernels/cpu_kv_round_trip.c): static scales only
CPU_C_WRITE = KernelCapability("kv_round_trip", "kernels/cpu_kv_round_trip.c", FP8, ("per_tensor", "per_head"),
                               mixed=True)

# block-scaled formats (harness/kv_paths/block_layout.py maps each onto the kernels' paged layout; its `refusal` says
# why another is not): paged codes and block scales read and widened in registers (GQA), written in one fused pass
BLOCK_SCALED = ("nvfp4", "nvfp4_4over6", "mxfp8", "mxfp4", "fp4_mx_block16", "fp8_per_token_head",
                "int8_per_token_head", "int4_per_token_head")
DECODE_ATTENTION_BLOCK_SCALED = KernelCapability(
    "decode_attention_block_scaled", "kernels/decode_attention_block_scaled.py", BLOCK_SCALED, ("per_tensor", "per_head"),
    ("gqa",), (16, 256), power_of_two_heads=True)
# MLA over a block-scaled latent (k_pe kept in 16 bits beside it, as engines do): the same Triton kernel, one latent
# read by head blocks; the latent a power of two up to 1024 (DeepSeek: 512). NVFP4, MXFP8, MXFP4, vLLM's nvfp4_ds_mla
# (NVFP4's values; its e4m3 k_pe read back into the 16-bit k_pe pages) and fp8_ds_mla (e4m3 under fp32 scales per
# 128) at 512 + 64 on sm_90: the CUDA kernels of kernels/mla_block_scaled_cuda.py (kernels/mla_decode_latent_split.cu
# over the engine's one-record pages); fp8_ds_mla elsewhere: its latent dequantised, then our BF16 MLA kernel (the
# Triton kernel reads no per-block fp32)
BLOCK_SCALED_MLA = BLOCK_SCALED + ("ds_mla_e4m3", "ds_mla_nvfp4")
MLA_DECODE_BLOCK_SCALED = KernelCapability(
    "mla_decode_block_scaled", "kernels/decode_attention_block_scaled.py", BLOCK_SCALED_MLA,
    ("per_tensor", "per_head"), ("mla",), (32, 1024), power_of_two_heads=True)
# 4-over-6's block choice sums squared errors in torch's reduction order, which the write does not reproduce;
# nvfp4_ds_mla's write rounds its scales up and multiplies by their reciprocals (the torch round trip writes it)
FUSED_WRITE_BLOCK_SCALED = KernelCapability(
    "quantize_store_block_scaled", "kernels/store_kv_block_scaled.py",
    tuple(f for f in BLOCK_SCALED_MLA if f not in ("nvfp4_4over6", "ds_mla_nvfp4")), ("per_tensor", "per_head"),
    mixed=True, power_of_two_heads=True, head_sizes=(16, 256))

DECODE_KERNELS = (DECODE_ATTENTION, DECODE_ATTENTION_BLOCK_SCALED, MLA_DECODE, MLA_DECODE_BLOCK_SCALED)
CACHE_WRITES = (FUSED_WRITE, FUSED_WRITE_BLOCK_SCALED, CPU_C_WRITE)


def decode_kernel(kv_path: KVPath, mla: bool) -> KernelCapability:
    """The decode kernel a path's layout and format family asks (the block-scaled one for block-scaled K)."""
    if mla:
        return MLA_DECODE_BLOCK_SCALED if kv_path.k_format.name in BLOCK_SCALED_MLA else MLA_DECODE
    return DECODE_ATTENTION_BLOCK_SCALED if kv_path.k_format.name in BLOCK_SCALED else DECODE_ATTENTION


def decode_refusal(kv_path: KVPath, mla: bool, head_size: int | None = None,
                   rope_size: int | None = None) -> str | None:
    """Why our decode kernel for this layout does not serve the path (None: it does). On an MLA model head_size is
    the latent's width and rope_size k_pe's."""
    if not kv_path.is_quantized:
        return "not an FP8 path"
    kernel = decode_kernel(kv_path, mla)
    if kv_path.k_format.name not in (BLOCK_SCALED_MLA if mla else BLOCK_SCALED) + FP8:
        fp8, block_scaled = (MLA_DECODE, MLA_DECODE_BLOCK_SCALED) if mla else (DECODE_ATTENTION,
                                                                              DECODE_ATTENTION_BLOCK_SCALED)
        why = block_layout.refusal(kv_path.k_format, head_size, max_head_size=1024 if mla else 256, mla=mla)
        return (f"no decode kernel serves {kv_path.k_format.spec_name} ({why}): {fp8.name} takes "
                f"{', '.join(FP8)}, {block_scaled.name} {', '.join(BLOCK_SCALED)}; torch attention instead")
    refusal = kernel.refusal(kv_path, "mla" if mla else "gqa", head_size)
    if refusal is None and kernel in (DECODE_ATTENTION_BLOCK_SCALED, MLA_DECODE_BLOCK_SCALED):   # blocks vs the head
        refusal = block_layout.refusal(kv_path.k_format, head_size, max_head_size=1024 if mla else 256, mla=mla)
        if refusal is None and mla and rope_size is not None and (rope_size < 16 or rope_size & (rope_size - 1)):
            refusal = f"k_pe of {rope_size} values (its dot takes a power of two of 16 or more)"
        refusal = refusal and f"{kernel.name} ({kernel.where}): {refusal}"
    return refusal


def write_kernel(kv_path: KVPath, device_type: str) -> KernelCapability:
    """The cache write a path's K format asks on this device (the C write on a CPU: FP8 only)."""
    if device_type != "cuda":
        return CPU_C_WRITE
    return FUSED_WRITE_BLOCK_SCALED if kv_path.k_format.name in BLOCK_SCALED else FUSED_WRITE


def cache_write(kv_path: KVPath | None, device_type: str) -> str:
    """Which cache write the path's K/V take on this device, or the torch round trip and why."""
    if kv_path is None or not kv_path.is_quantized:
        return "none (bf16 cache)"
    kernel = write_kernel(kv_path, device_type)
    refusal = kernel.refusal(kv_path)
    if refusal is None:
        return (f"{kernel.name} ({kernel.where})" if device_type == "cuda" else
                f"{kernel.name} ({kernel.where}) where probed bit-equal to the torch round trip, else torch")
    return f"torch round trip ({refusal})"
