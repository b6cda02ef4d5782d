"""Launch configurations of the decode kernels, per GPU: a recorded table, looked up by device name.

Each entry was measured by `python -m kernels.bench` (its sweep, batch 8, context 32k) on that GPU and is
copied here from its output; kernels/BENCHMARKS.md holds the sweep. A GPU not in the table gets DEFAULT
(the H100's entry); the H200's table is the H100's with the entries measured apart on an H200. `launch_config`
is what the launchers call; the benchmark prints the entry that ran.
Keys: block_n (tokens per tile), num_warps, num_stages (Triton's cp.async pipeline depth), prefetch (manual
register prefetch instead), swap (tokens as the MMA's M dimension, heads as N), programs_per_sm (how many
split-KV programs per SM the split plan aims for), block_h (MLA: heads per program), tma (MLA: the tile kernel,
TMA copies of whole tiles). MLA with >= 64 heads uses the `*_many_heads` entries, the fp8_mma option the
`mla_fp8_mma*` ones; the MLA entries are written by `python -m kernels.tune_mla --write`. swap with prefetch is
refused by the launchers (NaN on Triton 3.6). gqa_fp8_pv: GQA with P in fp8
(prob_scale) over an e4m3 cache. widen (session 7): fp8 tiles widened to fp16 once by inline PTX instead of by the
compiler in each MMA operand layout; split_latent (MLA, session 7): the latent dimension in 4 chunks
(_mla_decode_split_kernel). Both measured in kernels/BENCHMARKS.md (session 7); the sweeps time with CUDA graphs.
widen="v" (GQA, session 8): only the V tile widened (K by the compiler's cast); whole_waves (GQA, session 8; MLA
always): the split count rounded down to whole waves of programs_per_sm programs per SM (kernels.ab). impl="cuda"
(MLA over an fp8 cache, session 11): the CUDA kernel of kernels/mla_decode_fp8.cu, with bulk (sm_90 bulk copies, else
cp.async) and ctas (blocks per SM its registers are budgeted for); cuda_merge (session 14): its splits merged by the
CUDA merge kernel of the same file as a programmatic dependent launch instead of by the Triton merge_splits.
latent_split (MLA over an fp8 cache, session 49): kernels/mla_decode_latent_split.cu first, for a call without launch
keywords of at most latent_split_max_tokens cache slots in all (where the entry has one), the entry's other keys
where it cannot run.
"""

from __future__ import annotations

import functools

import torch

KINDS = ("gqa_fp8", "gqa_fp8_pv", "gqa_bf16", "mla_fp8", "mla_bf16", "mla_fp8_many_heads", "mla_bf16_many_heads")
KINDS += ("mla_fp8_mma", "mla_fp8_mma_many_heads")   # MLA's fp8_mma option (mla_decode(..., fp8_mma=True))
# GQA over block-scaled caches (kernels/decode_attention_block_scaled.py), one entry per element: e2m1 (NVFP4, MXFP4),
# e4m3 with block / per-token scales (MXFP8, FP8 per token-head), int8 and int4 per token-head. Not swept by
# kernels.tune (its candidates are the FP8 kernel's); asm: the PTX widening (False: plain Triton integer ops).
BLOCK_SCALED_KINDS = ("gqa_fp4", "gqa_fp8_blocks", "gqa_int8", "gqa_int4")

H100 = {
    # session 8 (kernels.ab, same process, two rounds): only V widened once (widen="v", call 1): 0.2219 vs 0.2292
    # ms at batch 8, 32k, 0.7516 vs 0.8323 at batch 32, 32k (best programs/SM of each); then the split plan in whole
    # waves of 6 programs/SM (2 waves of its 3 resident programs, call 2): 0.2091 / 0.7517 / 0.7493 / 2.929 ms at
    # batch 8 32k / 8 128k / 32 32k / 32 128k against 0.2206 / 0.7816 / 0.8227 / 3.227 at 8 programs/SM.
    # impl="cuda" (session 26, H200, same process, kernels/BENCHMARKS.md): the CUDA kernel over the plain cache
    # (kernels/gqa_decode_cuda.py), 4 warps x 3 blocks an SM: 0.1449 ms against this Triton entry's 0.1829 at batch 8,
    # 32k (1.26x); 1.10-1.30x at batch 1-32 over 8k-128k, 1.04-1.06x at 1k-2k (batch 16-64; one split: no merge
    # launch); 4 x 2 with two tiles ahead and 2 x 6 were up to 16% faster at batch 32-64, 1k, and up to 4% slower at
    # batch 8-16
    "gqa_fp8": dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, swap=False, programs_per_sm=6, widen="v",
                    whole_waves=True, impl="cuda", cuda_warps=4, ctas=3),
    # P (and Q) in fp8 over an e4m3 cache (prob_scale given). The plain layout: fp8 operands widened in the MMA's
    # operand layout (0.230 ms at batch 8, 32k); swap reaches fp8 wgmma but Triton 3.6 transposes the fp8 V tile
    # through shared memory a byte at a time (0.417 ms) (python -m kernels.tune --fp8-attention, H100)
    # session 8 (kernels.ab, call 3): V and the e4m3 P widened to fp16 (P.V on fp16 MMAs), 64-token tiles, whole
    # waves of 8 programs/SM: 0.2143 / 0.7843 / 0.7846 / 3.032 ms at batch 8 32k / 8 128k / 32 32k / 32 128k against
    # 0.2301 / 0.8957 / 0.8380 / 3.234 for the plain entry above it (kernel vs its fp64 emulation 1.00x torch's error)
    "gqa_fp8_pv": dict(block_n=64, num_warps=4, num_stages=2, prefetch=False, swap=False, programs_per_sm=8,
                       widen="v", whole_waves=True),
    "gqa_bf16": dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, swap=False, programs_per_sm=8),
}
# MLA entries: `python -m kernels.tune_mla --write` rewrites the lines between the markers with
# its sweep's fastest correct configurations (tma: the tile kernel; >= 64 heads use the *_many_heads entries).
# BEGIN H100 MLA
H100_MLA = {
    "mla_fp8": dict(block_n=32, num_warps=4, num_stages=4, prefetch=False, swap=False, programs_per_sm=2, block_h=16,
                    tma=True, widen=True, split_latent=True, impl="cuda", bulk=True, ctas=2, cuda_merge=True),
    "mla_bf16": dict(block_n=32, num_warps=4, num_stages=5, prefetch=False, swap=False, programs_per_sm=1, block_h=16,
                     tma=True, split_latent=True),
    "mla_fp8_many_heads": dict(block_n=64, num_warps=12, num_stages=3, prefetch=False, swap=False, programs_per_sm=1,
                               block_h=64, tma=True, widen=True, split_latent=True, impl="cuda", wgmma=True),
    "mla_bf16_many_heads": dict(block_n=32, num_warps=8, num_stages=5, prefetch=False, swap=False, programs_per_sm=1,
                                block_h=64, tma=True),
    "mla_fp8_mma": dict(block_n=64, num_warps=4, num_stages=5, prefetch=False, swap=True, programs_per_sm=2, block_h=16,
                        tma=True),
    "mla_fp8_mma_many_heads": dict(block_n=64, num_warps=8, num_stages=5, prefetch=False, swap=False, programs_per_sm=2,
                                   block_h=64, tma=True),
}
# END H100 MLA
# mla_fp8 (session 11): the CUDA kernel (kernels/mla_decode_fp8.cu) with 32-token tiles, 4 stages of sm_90 bulk
# copies and 2 blocks per SM, set by hand from kernels.ab's same-process A/B (call 9): 0.0889 / 0.2582 ms at batch
# 8 / 32, 32k against the Triton entry's 0.1013 / 0.3548 (kernels/BENCHMARKS.md, session 11). Where the CUDA kernel
# cannot run (no NVRTC, before sm_89, other latent sizes, FP8 attention options) mla_decode takes the Triton entry
# it replaced (kernels.mla_decode.CUDA_FALLBACK).
# cuda_merge (session 14, set by hand from a same-process A/B, 3 rounds, medians): the splits merged by the CUDA merge
# kernel as a programmatic dependent launch instead of by the Triton merge_splits: 0.0396 / 0.0867 / 0.2570 / 0.2546
# ms at batch 8 8k / 8 32k / 32 32k / 8 128k against 0.0418 / 0.0892 / 0.2577 / 0.2569 (kernels/BENCHMARKS.md).
# mla_fp8_many_heads (session 13): the warp-specialized warpgroup-MMA kernel (kernels/mla_decode_fp8_ws.cu), written
# by kernels.ab (call 8): 0.0912 / 0.2676 / 0.9379 ms at batch 8 8k / 8 32k / 32 32k against the two-group wgmma
# kernel's 0.0976 / 0.2808 / 1.0044 (call 4: 1.36-1.82x the Triton entry's 0.1336 / 0.4725 / 1.8294; removed in
# the session's review, in git history at 7c704aa); where it cannot run (not sm_90, no NVRTC) the Triton entry below runs
# (kernels.mla_decode.CUDA_FALLBACK). Before it, the Triton entry: the sweep (session 7) picked widen without
# split_latent (0.4606 ms), which a same-process A/B with two round-robin rounds then measured at 0.6707 / 0.6724 ms
# against split_latent's 0.4594 / 0.4605 ms (batch 8, 32k; batch 32: 2.53-2.60 vs 1.79 ms): the split-latent entry
# was set by hand from that A/B (kernels/BENCHMARKS.md).
H100.update(H100_MLA)
# Block-scaled GQA (issue 43), from `python -m kernels.bench_block_scaled --sweep` on an H200 (batch 8, 32k; the table
# in kernels/BENCHMARKS.md, session 16): ms of each entry against the next best variant there. The e2m1 entry widens
# with plain Triton ops (0.3230 ms; the PTX widening 0.3404 at 64 tokens, 0.3273 at 128); a register prefetch of the
# next tile lost in every kind (NVFP4 0.3441, MXFP8 0.5004, INT4 0.3264, INT8 0.4213 ms) and was removed.
# impl="cuda" (sessions 25-26): one CUDA kernel for every block-scaled layout, kernels/gqa_decode_block_scaled.cu,
# 4 warps a block, 3 blocks an SM (H200, batch 8, 32k; kernels/BENCHMARKS.md, session 26): NVFP4 0.1224 ms (the
# Triton entry 0.3196), MXFP8 0.1601 (0.3802), MXFP4 0.1480 (0.3588), INT4 0.1229 (0.2116), INT8 per token-head
# 0.1509 (0.3016); two tiles ahead where they fit the registers (the launcher's _two_ahead_fits). 4 x 2, 8 x 1 and
# 2 x 6 warps x blocks were 1-15% slower on every format.
_BLOCK_SCALED = dict(num_warps=4, num_stages=2, programs_per_sm=8, whole_waves=True)
H100.update({
    "gqa_fp4": dict(_BLOCK_SCALED, block_n=64, asm=False,           # NVFP4: Triton 0.3230 ms
                    impl="cuda", cuda_warps=4, ctas=3, cuda_prefetch=2),
    "gqa_fp8_blocks": dict(_BLOCK_SCALED, block_n=64, asm=True,     # MXFP8: Triton 0.3832 (128 tokens: 0.4232)
                           impl="cuda", cuda_warps=4, ctas=3),
    "gqa_int4": dict(_BLOCK_SCALED, block_n=128, asm=True,          # INT4: Triton 0.2119 (64 tokens: 0.2652)
                     impl="cuda", cuda_warps=4, ctas=3, cuda_prefetch=2),
    "gqa_int8": dict(_BLOCK_SCALED, block_n=128, asm=True,          # INT8: Triton 0.3021 (64 tokens: 0.3755)
                     impl="cuda", cuda_warps=4, ctas=3),
})
# H200: the H100's entries (the block-scaled ones above were measured on an H200) but our BF16 MLA kernel at 16 heads
# with 2 programs an SM. Session 48 (kernels/BENCHMARKS.md, same process, two rounds, min, 64-token pages): batch 8
# at 32k / 128k 0.1041 -> 0.0942 / 0.3607 -> 0.2912 ms, batch 32 at 8k / 32k / 128k 0.1034 -> 0.0928 / 0.3603 ->
# 0.2932 / 1.3967 -> 1.0965 (1.10-1.27x); batch 1 at 8k and batch 8 at 8k 3-4% slower (0.0183 -> 0.0188, 0.0390 ->
# 0.0405), batch 1 at 32k level, at 128k 1.03x; 3 programs an SM lost everywhere. At 128 heads 1 stays: 2 was 1-19%
# slower (batch 1 at 32k 0.0586 -> 0.0722).
# mla_fp8 at 16 heads (session 49, same process, two rounds, min, 64-token pages): the latent split
# (kernels/mla_decode_latent_split.cu, latent_split=True) before the CUDA kernel of impl="cuda", which stays the
# fallback where it cannot run: batch 8 at 8k / 32k / 128k 0.0319 -> 0.0268 / 0.0747 -> 0.0594 / 0.2469 -> 0.1793 ms,
# batch 32 at 32k 0.2524 -> 0.1806, batch 1 at 8k 0.0176 -> 0.0147 (1.17-1.40x; our BF16 1.28-1.66x).
# mla_fp8_many_heads (session 49, the same way, 128 heads): the latent split (8 blocks of 16 heads a sequence, each
# widening every row) against the warpgroup-MMA kernel (64 heads a block): 1.67x at batch 1, 8k (0.0401 -> 0.0240),
# 1.44x at 2 x 8k, 1.13x at 1 x 32k and 4 x 8k; 0.96x at 2 x 32k, 0.92x at 8 x 8k, 0.84x at 1 x 128k, 0.73x at 32 x
# 8k. So it takes calls of at most 32k cache slots in all (batch x the block table's pages x page size).
H200 = dict(H100, mla_bf16=dict(H100["mla_bf16"], programs_per_sm=2),
            mla_fp8=dict(H100["mla_fp8"], latent_split=True),
            mla_fp8_many_heads=dict(H100["mla_fp8_many_heads"], latent_split=True, latent_split_max_tokens=32768))
DEFAULT = H100
TABLE: dict[str, dict[str, dict]] = {"NVIDIA H100 80GB HBM3": H100, "NVIDIA H200": H200}


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def launch_config(kind: str, device: torch.device) -> dict:
    """The recorded configuration of `kind` for this device's GPU (a copy: callers may override keys)."""
    assert kind in KINDS + BLOCK_SCALED_KINDS, f"unknown kernel kind {kind!r}; expected one of {KINDS + BLOCK_SCALED_KINDS}"
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    return dict(TABLE.get(name, DEFAULT)[kind])


def describe(kind: str, device: torch.device) -> str:
    """One line naming the configuration and where it came from, for benchmark output."""
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    if name not in TABLE:
        source = "default (H100 entry; GPU not in the table)"
    elif TABLE[name] is not H100 and TABLE[name][kind] == H100[kind]:
        source = "the H100's entry, kept in this GPU's table"
    else:
        source = "recorded for this GPU"
    return f"{kind}: {launch_config(kind, device)} ({source})"
