"""Cache-format fault injectors (path option `fault=NAME`): bugs in how a block-scaled or 4-bit cache is written or
read, each reproducing one the engines shipped. The format's own numerics (harness/kv_paths/formats.py: `encode`,
`decode`) run unchanged; the fault changes what the read sees of the stored codes and block scales, the way the bug
did. The write statistics (`kv_clipped_frac`, ...) are the writer's own: a layout bug at the read leaves them as a
healthy write has them.

Per token, a cache holds one block scale per head and block: the token's scale slots, [heads x blocks] in that
order (`slots`), as an engine's scale buffer holds them for one token (vLLM's NVFP4 cache: [pages, page_size,
kv_heads, head_dim / 16]). Formats with one scale per token and head (fp8 / int8 / int4 per token-head) have one
slot per head. On MLA the cache row is the latent and its RoPE part, one head each.

They are fault injectors: never a default, never a choice a user makes for speed.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from harness.kv_paths import formats as kv_formats

# name -> what goes wrong (shown in the path's description and the zoo)
FORMAT_FAULTS: dict[str, str] = {
    "scale_layout": "block scales read in the wrong layout: each token's scale slots (heads x blocks) read one slot "
                    "off, slot i with slot i+1's scale (a writer and reader that disagree on the scale buffer's "
                    "layout: vllm#49012, NVFP4 scales swizzled across the wrong dimension; vllm#50084, V scales "
                    "swizzled for one reader and read linearly by another)",
    "v_scale_first_blocks": "V's block scales stored for the first slots only: slot i holds slot i // 4's scale, "
                            "so slots 0-3 are stored four times and 4-15 never (the NVFP4 V block-scale writer of "
                            "vllm#49011 / #50084: stored_v_scale[slot] = true_scale[slot // 4]); K is written right",
    "e8m0_bias": "e8m0 block scales read with exponent bias 128 for OCP's 127: every MX value read at half its size",
    "nibble_swap": "packed FP4 codes unpacked with the even index from the high nibble (the OCP / torch "
                   "float4_e2m1fn_x2 order has it in the low one): each pair of neighbouring e2m1 values swapped",
    "dummy_block_scales": "block scales frozen from one dummy warm-up pass (per layer, head and block: the largest "
                          "magnitude the dummy tokens wrote there, recurrent state uninitialised as in failure "
                          "class 2), not computed from the values written",
}
SLOT_GROUP = 4  # v_scale_first_blocks: slots 0-3 stored, each four times (the vLLM writer's 4-slot swizzle unit)
DUMMY_PASS_FAULTS = ("dummy_block_scales",)  # the faults whose path needs a dummy warm-up pass observed


def sides(name: str, k_format: kv_formats.KVFormat, v_format: kv_formats.KVFormat) -> tuple[str, ...]:
    """Which of "k", "v" the fault `name` reaches on a path storing K in `k_format` and V in `v_format`."""
    reached = []
    for side, kv_format in (("k", k_format), ("v", v_format)):
        if name == "v_scale_first_blocks" and side == "k":
            continue
        if name == "nibble_swap" and kv_format.element is not kv_formats.E2M1:
            continue
        if name == "e8m0_bias" and kv_format.block_scale != "e8m0":
            continue
        if not kv_format.block_scale and name != "nibble_swap":  # FP8 under a static scale: no block scale
            continue
        reached.append(side)
    return tuple(reached)


def check(name: str, fmt: str, v_fmt: str) -> str | None:
    """Why the cache fault `name` cannot apply to a path storing K in `fmt` and V in `v_fmt` (None: it can)."""
    if fmt in ("bf16", "fp32"):
        return f"fault={name} is a fault of a quantised cache's format; {fmt} stores none"
    k_format, v_format = kv_formats.get_format(fmt), kv_formats.get_format(v_fmt or fmt)
    if sides(name, k_format, v_format):
        return None
    reached = ", ".join(f.spec_name for f in kv_formats.registered() if sides(name, f, f))
    need = "V in a format with block scales" if name == "v_scale_first_blocks" else "a format it reaches"
    stored = k_format.spec_name if k_format is v_format else f"K as {k_format.spec_name}, V as {v_format.spec_name}"
    return f"fault={name} needs {need} ({reached}); this path stores {stored}"


def round_trip(name: str, side: str, kv_format: kv_formats.KVFormat, x: torch.Tensor,
               scale: torch.Tensor | None, saturate: bool,
               dummy_range: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [batch, heads, tokens, D] written in `kv_format` and read back with the fault `name` on this side:
    (read back in x's dtype, the writer's |x / scale| / element max per value). `dummy_range` [2, heads, D]: the
    dummy pass's per-channel (min, max), for `dummy_block_scales`."""
    if name == "dummy_block_scales":
        assert dummy_range is not None, "dummy_block_scales needs the dummy pass's channel ranges"
        encoded = _frozen_encode(kv_format, x, scale, dummy_range.to(x.device))
        return kv_format.decode(encoded, x.dtype), kv_format.clip_ratio(x, encoded)
    encoded = kv_format.encode(x, scale, saturate)
    return kv_format.decode(_as_read(name, kv_format, encoded), x.dtype), kv_format.clip_ratio(x, encoded)


def _as_read(name: str, kv_format: kv_formats.KVFormat, encoded: kv_formats.Encoded) -> kv_formats.Encoded:
    """What the faulty read sees of a healthy write."""
    if name == "nibble_swap":
        packed = kv_formats.pack_e2m1(encoded.codes)  # [..., D / 2]: the cache's bytes, as written
        return replace(encoded, codes=torch.stack([packed >> 4, packed & 15], dim=-1).flatten(-2))
    if name == "e8m0_bias":  # 2^(bits - 128) for 2^(bits - 127): exact in fp32 (NaN scales stay NaN)
        return replace(encoded, value_scale=encoded.value_scale / 2)
    source = _slot_sources(name, _slot_count(kv_format, encoded.codes))
    value_scale = _move_slots(encoded.value_scale, encoded.scale, kv_format, source)
    value_zero = None if encoded.value_zero is None else _move_slots(encoded.value_zero, None, kv_format, source)
    return replace(encoded, value_scale=value_scale, value_zero=value_zero)


def _slot_count(kv_format: kv_formats.KVFormat, codes: torch.Tensor) -> int:
    return codes.shape[1] * _blocks_per_head(kv_format, codes.shape[-1])


def _blocks_per_head(kv_format: kv_formats.KVFormat, head_dim: int) -> int:
    return -(-head_dim // kv_format.block_size) if kv_format.block_size else 1


def _slot_sources(name: str, slots: int) -> torch.Tensor:
    """[slots] int64: the slot whose stored scale the read takes for each slot."""
    index = torch.arange(slots)
    if name == "scale_layout":
        return (index + 1) % slots
    assert name == "v_scale_first_blocks", name
    return index // SLOT_GROUP


def _move_slots(per_value: torch.Tensor, static: torch.Tensor | None, kv_format: kv_formats.KVFormat,
                source: torch.Tensor) -> torch.Tensor:
    """A per-value quantity [batch, heads, tokens, D] that is constant over each block (its block scale times the
    static scale, or its zero point), with each token's slots read from `source`; the static scale (per tensor or
    head) stays where it is, as it is not in the block-scale buffer."""
    batch, heads, tokens, dim = per_value.shape
    block = kv_format.block_size or dim
    per_block = per_value if static is None else per_value / torch.broadcast_to(static, per_value.shape)
    per_block = kv_formats._blocks(per_block, block)[..., 0]  # noqa: SLF001 - [batch, heads, tokens, blocks]
    slots = per_block.permute(0, 2, 1, 3).reshape(batch, tokens, -1)  # [batch, tokens, heads x blocks]
    moved = slots[..., source.to(slots.device)].reshape(batch, tokens, heads, -1).permute(0, 2, 1, 3)
    moved = moved.repeat_interleave(block, dim=-1)[..., :dim]
    return moved if static is None else moved * static


def _frozen_encode(kv_format: kv_formats.KVFormat, x: torch.Tensor, scale: torch.Tensor | None,
                   dummy_range: torch.Tensor) -> kv_formats.Encoded:
    """x's codes under block scales the format computes from the dummy pass: each block of each head takes the scale
    (and zero point) that a block holding the dummy pass's largest and smallest values there would get (4-over-6
    chooses its target on that block too), and x is coded against it, saturating."""
    heads, dim = dummy_range.shape[1:]
    block = kv_format.block_size or dim
    low, high = (kv_formats._blocks(r, block) for r in dummy_range.float())  # noqa: SLF001 - [heads, blocks, B]
    low, high = low.amin(-1), high.amax(-1)  # [heads, blocks]: the dummy pass's range per block
    dummy = torch.zeros(heads, low.shape[-1], block, device=x.device)  # one token a head: each block its range
    if kv_format.zero_point:
        dummy[..., :] = low.unsqueeze(-1)
        dummy[..., 0] = high
    else:
        dummy[..., 0] = torch.maximum(high.abs(), low.abs())
    dummy = dummy.flatten(-2)[..., :dim].reshape(1, heads, 1, dim)
    frozen = kv_format.encode(dummy, scale)  # the block scales of the dummy block, [1, heads, 1, D] per value
    value_scale = torch.broadcast_to(frozen.value_scale, x.shape)
    shifted = x.float() if frozen.value_zero is None else x.float() - frozen.value_zero
    scaled = torch.where(value_scale == 0, torch.zeros_like(shifted), shifted / value_scale)
    codes = kv_format.element.to_codes(scaled)
    value_zero = None if frozen.value_zero is None else torch.broadcast_to(frozen.value_zero, x.shape)
    return kv_formats.Encoded(codes, frozen.block_scales, frozen.zero, frozen.scale, value_scale, value_zero)
