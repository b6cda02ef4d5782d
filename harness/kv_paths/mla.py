"""MLA weight absorption, the one place it is written: engines decode DeepSeek-style MLA over the cached latent c
by folding kv_b_proj into the query and the output (DeepSeek-V2, section 2.1.2):

    q_latent = q_nope W_UK          scores = q_latent . c + q_pe . k_pe
    out      = (softmax(scores) . c) W_UV

with kv_b_proj.weight [H * (nope + v), Dc] split per head into W_UK [H, nope, Dc] and W_UV [H, v, Dc].
Used by every paged-cache decode (one sequence or a batch), its fp64 check, and attention capture's kernel rows.
"""

from __future__ import annotations

import torch


def absorbed_weights(module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, nope, Dc], W_UV [H, v, Dc]) of an MLA attention module's kv_b_proj, in `dtype`."""
    nope = module.qk_nope_head_dim
    weight = module.kv_b_proj.weight.view(-1, nope + module.v_head_dim, module.kv_b_proj.weight.shape[-1])
    return weight[:, :nope].to(dtype), weight[:, nope:].to(dtype)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [..., H, nope] -> q_latent [..., H, Dc], in the operands' dtype."""
    return torch.einsum("...hn,hnc->...hc", q_nope, w_uk)


def expand_latent(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Attention output in latent space [..., H, Dc] -> per-head values [..., H, v], in the operands' dtype."""
    return torch.einsum("...hc,hvc->...hv", latent, w_uv)


# -- DeepSeek's latent records: one token's latent and k_pe as the engine's cache holds them (vLLM) ------------------
# fp8_ds_mla (csrc cache_kernels.cu `concat_and_cache_ds_mla_kernel`), 656 bytes a token:
#   [0, 512)   512 e4m3 latent values, tile t = values [128 t, 128 t + 128) divided by its scale
#   [512, 528) 4 fp32 tile scales (little-endian), max(amax_tile / 448, FLT_MIN)
#   [528, 656) 64 k_pe values in the model dtype (bf16), unquantised
# nvfp4_ds_mla (csrc nvfp4_ds_mla_cache_kernels.cu), 352 bytes a token:
#   [0, 256)   512 e2m1 latent values, two a byte, the even element in the low nibble
#   [256, 320) 64 e4m3 k_pe values, no scale
#   [320, 352) 32 e4m3 block scales (one per 16 latent values), block s at byte 8 (s & 3) + (s >> 2)
DS_MLA_LATENT, DS_MLA_ROPE = 512, 64  # the only shapes vLLM's writers take (DeepSeek V3.2: kv_lora_rank, rope dim)
DS_MLA_RECORD_BYTES = {"ds_mla_e4m3": 656, "ds_mla_nvfp4": 352}


def nvfp4_scale_byte(block: torch.Tensor | int):
    """Where the scale of latent block s (values [16 s, 16 s + 16)) sits among nvfp4_ds_mla's 32 scale bytes: an
    8 x 4 -> 4 x 8 transpose (vLLM's `nvfp4_sf_byte`, FlashMLA's reader)."""
    return 8 * (block & 3) + (block >> 2)


def pack_ds_mla(fmt: str, latent, rope) -> torch.Tensor:
    """(latent, k_pe) `formats.Encoded` of a ds_mla path's two sides -> uint8 records [..., DS_MLA_RECORD_BYTES]."""
    _check_record(fmt, latent.codes.shape[-1], rope.codes.shape[-1])
    if fmt == "ds_mla_e4m3":
        parts = [latent.codes.view(torch.uint8), latent.block_scales.float().contiguous().view(torch.uint8),
                 rope.codes.contiguous().view(torch.uint8)]
    else:
        from harness.kv_paths.formats import pack_e2m1

        scales = latent.block_scales.view(torch.uint8)  # [..., 32] e4m3 bits, block order
        permuted = torch.empty_like(scales)
        permuted[..., nvfp4_scale_byte(torch.arange(scales.shape[-1], device=scales.device))] = scales
        parts = [pack_e2m1(latent.codes), rope.codes.view(torch.uint8), permuted]
    return torch.cat(parts, dim=-1)


def unpack_ds_mla(fmt: str, record: torch.Tensor, rope_dtype: torch.dtype = torch.bfloat16):
    """uint8 records [..., bytes] -> (latent, k_pe) `formats.Encoded`, for `formats.get_format(...).decode`."""
    from harness.kv_paths.formats import Encoded, unpack_e2m1

    if record.shape[-1] != DS_MLA_RECORD_BYTES[fmt]:
        raise ValueError(f"{fmt} record: {record.shape[-1]} bytes a token; expected {DS_MLA_RECORD_BYTES[fmt]}")
    one = torch.ones((), dtype=torch.float32, device=record.device)
    if fmt == "ds_mla_e4m3":
        codes = record[..., :512].contiguous().view(torch.float8_e4m3fn)
        scales = record[..., 512:528].contiguous().view(torch.float32)  # [..., 4]
        rope = record[..., 528:].contiguous().view(rope_dtype)
        return (Encoded(codes, scales, None, one, scales.repeat_interleave(128, dim=-1)),
                Encoded(rope, None, None, one, one))
    codes = unpack_e2m1(record[..., :256])
    permuted = record[..., 320:352]
    stored = permuted[..., nvfp4_scale_byte(torch.arange(32, device=record.device))].contiguous()
    scales = stored.view(torch.float8_e4m3fn)
    rope = record[..., 256:320].contiguous().view(torch.float8_e4m3fn)
    return (Encoded(codes, scales, None, one, scales.float().repeat_interleave(16, dim=-1)),
            Encoded(rope, None, None, one, one))


def _check_record(fmt: str, latent: int, rope: int) -> None:
    if fmt not in DS_MLA_RECORD_BYTES:
        raise ValueError(f"no DeepSeek latent record for format {fmt!r}; records: {', '.join(DS_MLA_RECORD_BYTES)}")
    if (latent, rope) != (DS_MLA_LATENT, DS_MLA_ROPE):
        raise ValueError(f"{fmt} record: latent {latent} + k_pe {rope}; vLLM's writer takes {DS_MLA_LATENT} + "
                         f"{DS_MLA_ROPE} (DeepSeek V3.2's kv_lora_rank and rope dim)")
