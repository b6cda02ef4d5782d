"""How our kernels store a block-scaled KV format (NVFP4, MXFP8, MXFP4, INT8 / INT4 / FP8 per token-head): the
mapping from a `KVFormat` (harness/kv_paths/formats.py) onto the paged layout the kernels read and write (kernels/
reference.py, "Block-scaled caches"), which takes plain tensors and names only (kernels/ does not import harness).

A format is served where our kernels compute exactly what its torch decode does: e2m1, e4m3, int8 or int4 values
under e4m3 scales per 16 or 32 values (e2m1 only: the product of two e4m3 values is not exact in fp16), e8m0 scales
per 16 or 32 (e2m1, e4m3) or one fp32 scale per token and head, with or without a static scale; no zero point. An
MLA latent also under fp32 scales per 128 (vLLM's fp8_ds_mla).
`refusal` says why not, in the format's words. The fused write also needs one candidate block scale (4-over-6's
choice sums squared errors in torch's reduction order: not reproduced).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.kv_paths.formats import Encoded, KVFormat, pack_e2m1
from kernels import mla_block_scaled_cuda
from kernels import reference as kernel_ref

_ELEMENTS = ("e2m1", "e4m3", "int8", "int4")


@dataclass(frozen=True, slots=True)
class BlockScaledLayout:
    """One format's paged layout: element, block-scale type, values per block scale (the head size for per
    token-head, given at use), what the write maps a block's amax to (`target`; e8m0: the element's emax) and the
    smallest block scale, and whether a static scale multiplies the block scales."""

    element: str
    block_scale: str
    block_size: int  # 0: one scale per token and head
    target: float
    scale_floor: float
    static: bool
    scale_rounding: str  # e8m0 block scales: OCP's "floor" or the engines' "ceil" (`KVFormat.scale_rounding`)
    kv_format: KVFormat = field(compare=False, repr=False, default=None)

    @property
    def kernel_args(self) -> dict:
        """The keywords of `decode_attention_block_scaled` and `reference.dequantize_block_scaled`."""
        return dict(element=self.element, block_scale=self.block_scale, block_size=self.block_size)

    @property
    def write_args(self) -> dict:
        """The keywords of `store_kv_block_scaled.quantize_store_block_scaled`."""
        return dict(self.kernel_args, target=self.target, scale_floor=self.scale_floor,
                    scale_rounding=self.scale_rounding)

    def code_bytes(self, head_dim: int) -> int:
        return head_dim * kernel_ref.ELEMENT_BITS[self.element] // 8

    def allocate(self, num_blocks: int, page: int, heads: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed paged (codes [num_blocks, page, heads, bytes] uint8, block scales [..., D / B] uint8 or fp32 (fp32
        per block: fp8_ds_mla), or [num_blocks, page, heads] fp32)."""
        codes = torch.zeros(num_blocks, page, heads, self.code_bytes(head_dim), dtype=torch.uint8, device=device)
        if self.block_scale == "fp32":
            shape = (num_blocks, page, heads) + ((head_dim // self.block_size,) if self.block_size else ())
            return codes, torch.zeros(shape, dtype=torch.float32, device=device)
        return codes, torch.zeros(num_blocks, page, heads, head_dim // self.block_size, dtype=torch.uint8,
                                  device=device)

    def allocate_latent_rows(self, num_blocks: int, page: int, latent_dim: int, rope: torch.Tensor) -> list:
        """An MLA model's zeroed pages: [latent codes [num_blocks, page, 1, bytes], block scales, k_pe [num_blocks,
        page, Dr] in rope's dtype]. The layouts the CUDA MLA kernel reads (NVFP4, MX, fp8_ds_mla): views into one byte
        record a token, [codes | block scales | k_pe] (fp8_ds_mla's is vLLM's 656-byte record, harness/kv_paths/
        mla.py), which the kernel copies in one piece (kernels/mla_block_scaled_cuda.is_record: at batch 8, 32k,
        16 heads on an H200 NVFP4 0.1055 -> 0.0901 ms, kernels/BENCHMARKS.md session 34); other layouts and shapes:
        three tensors."""
        k_pe_bytes = rope.shape[-1] * rope.element_size()
        kernel_shape = (latent_dim, rope.shape[-1]) == (mla_block_scaled_cuda.LATENT, mla_block_scaled_cuda.ROPE)
        if not (kernel_shape and mla_block_scaled_cuda.serves(self.element, self.block_scale, self.block_size)):
            return [*self.allocate(num_blocks, page, 1, latent_dim, rope.device),
                    torch.zeros(num_blocks, page, rope.shape[-1], dtype=rope.dtype, device=rope.device)]
        scale_bytes = 4 if self.block_scale == "fp32" else 1
        code_bytes, scale_bytes = self.code_bytes(latent_dim), scale_bytes * (latent_dim // self.block_size)
        record = torch.zeros(num_blocks, page, code_bytes + scale_bytes + k_pe_bytes, dtype=torch.uint8,
                             device=rope.device)
        codes = record[..., :code_bytes].unsqueeze(2)
        scales = record[..., code_bytes:code_bytes + scale_bytes]
        scales = scales.view(torch.float32) if self.block_scale == "fp32" else scales
        return [codes, scales.unsqueeze(2), record[..., code_bytes + scale_bytes:].view(rope.dtype)]

    def pages(self, encoded: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        """What the paged caches hold for an encode of x [..., D]: (codes [..., bytes] uint8, block scales [...,
        D / B] uint8 bits or [...] fp32)."""
        codes = encoded.codes
        if kernel_ref.ELEMENT_BITS[self.element] == 4:
            codes = pack_e2m1(codes.view(torch.uint8) if codes.dtype == torch.int8 else codes)  # int4: its nibble
        blocks = encoded.block_scales
        if self.block_scale == "fp32":
            blocks = blocks if self.block_size else blocks[..., 0]
        else:
            blocks = blocks.view(torch.uint8)
        return codes.view(torch.uint8), blocks

    def store(self, x: torch.Tensor, scale: torch.Tensor | None, codes: torch.Tensor, block_scales: torch.Tensor,
              slots: torch.Tensor) -> None:
        """The torch write: x [N, heads, D] encoded by the format (scale: [] or [heads] static, or None) into the
        paged caches at slots [N] (-1 skips), as the fused write stores it."""
        static = None if scale is None else (scale.view(-1, 1) if scale.dim() else scale)
        packed, blocks = self.pages(self.kv_format.encode(x, static))
        store_rows(codes.view(-1, *codes.shape[2:]), slots, packed)
        store_rows(block_scales.view(-1, *block_scales.shape[2:]), slots, blocks.to(block_scales.dtype))


def store_rows(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """flat[slots[i]] = rows[i] where slots[i] >= 0, without asking the host anything (so a CUDA graph can capture
    it: a boolean-mask index waits for the device to count the mask, and capture refuses it). A skipped row writes
    the first kept row's slot with that row's own values (the same bytes twice), or, when no row is kept, slot 0
    with what slot 0 holds."""
    keep = slots >= 0
    first = keep.long().argmax().view(1)             # the first kept row (0 when none is)
    fill_slot = slots[first].clamp(min=0)
    fill = torch.where(keep[first].view(-1, *[1] * (rows.dim() - 1)), rows[first], flat[fill_slot].to(rows.dtype))
    wide = [-1, *[1] * (rows.dim() - 1)]
    target = torch.where(keep, slots, fill_slot)
    flat.index_copy_(0, target, torch.where(keep.view(wide), rows, fill).to(flat.dtype))


def refusal(kv_format: KVFormat, head_size: int | None = None, write: bool = False,
            max_head_size: int = 256, mla: bool = False) -> str | None:
    """Why our block-scaled kernels (write=True: the fused write) do not serve `kv_format` (None: they do);
    max_head_size: 1024 for an MLA latent (the GQA kernels' heads stop at 256); mla: as an MLA latent (the MLA
    decode also reads fp32 scales per 128 values)."""
    name = kv_format.spec_name
    if kv_format.is_legacy_fp8 or not kv_format.block_scale:
        return f"{name}: not block-scaled (the FP8 kernels' format)"
    if kv_format.zero_point:
        return f"{name}: a zero point (the kernels read symmetric formats)"
    if kv_format.element.name not in _ELEMENTS:
        return f"{name}: {kv_format.element.name} values (the kernels read e2m1, e4m3, int8 and int4)"
    if kv_format.block_scale == "e4m3" and kv_format.element.name != "e2m1":
        return f"{name}: e4m3 block scales over {kv_format.element.name} (not exact in fp16; only over e2m1)"
    if kv_format.block_scale == "e8m0" and kv_format.element.name not in ("e2m1", "e4m3"):
        return f"{name}: e8m0 block scales over {kv_format.element.name}"
    if kv_format.block_scale == "fp32" and kv_format.block_size and (not mla or kv_format.block_size != 128):
        return (f"{name}: fp32 scales per {kv_format.block_size} values (the kernels take one per token and head; "
                f"an MLA latent also one per 128 values)")
    if kv_format.block_scale != "fp32" and kv_format.block_size not in (16, 32):
        return f"{name}: blocks of {kv_format.block_size} (the kernels take 16 or 32)"
    # how a write rounds (scales rounded up, values times a reciprocal: nvfp4_ds_mla) is the write's: the decode reads
    # code x scale whichever way they were found
    encode_only = ("scale_round_up", "reciprocal") if not write else ()
    extras = [field for field in ("scale_round_up", "reciprocal", "unscaled")
              if getattr(kv_format, field, False) and field not in encode_only]
    if extras:
        return f"{name}: {', '.join(extras)} (not in the kernels' numerics)"
    if head_size is not None:
        block = kv_format.block_size or head_size
        if not (16 <= head_size <= max_head_size and head_size & (head_size - 1) == 0 and head_size % block == 0):
            return f"{name}: head size {head_size} (the kernels take powers of two 16-{max_head_size}, whole blocks)"
        if kv_format.element.bits == 4 and head_size < 32 and not write:
            # the decode splits a head's even and odd values into two dots of head_size / 2 (>= 16 deep); joined
            # instead at head size 16, it gave kernel_err_ratio above 4 on an H200 (Triton 3.6) for every 4-bit
            # path of the tiny models, where the interpreter agreed with the mirror: not served, not debugged
            return f"{name}: head size {head_size} (4-bit values: the decode takes heads of 32 values or more)"
    if write and len(kv_format.block_targets) > 1:
        return (f"{name}: {len(kv_format.block_targets)} candidate block scales (the choice sums squared errors in "
                f"torch's reduction order)")
    return None


def of(kv_format: KVFormat, mla: bool = False) -> BlockScaledLayout:
    """The layout of a served format (ValueError naming the reason otherwise); mla: as an MLA latent."""
    why = refusal(kv_format, mla=mla)
    if why is not None:
        raise ValueError(f"KV format {kv_format.name!r} has no block-scaled kernel layout: {why}")
    target = kv_format.block_targets[0] if kv_format.block_targets else 0.0
    return BlockScaledLayout(kv_format.element.name, kv_format.block_scale, kv_format.block_size, float(target),
                             float(kv_format.scale_floor), kv_format.has_static_scale, kv_format.scale_rounding,
                             kv_format)
