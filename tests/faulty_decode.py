"""A planted decode-only cache fault for the self-consistency tests (tests/test_self_consistency.py): a decode-kernel
plug-in (docs/CONTRACTS.md, "Decode-kernel plug-ins") that reads the FP8 cache with its scales dropped, value =
code x 1.0 instead of code x scale: the bug of a scale that never reaches the decode kernel. Prefill is not the
plug-in's (SDPA over the dequantised cache), so a server on this path prefills right and decodes wrong.

    harness serve --path fp8_e4m3:calibrated:kernel=tests.faulty_decode:decode
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels import reference


def decode_attention_scale_dropped(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sm_scale, **_):
    """The fp32 reference decode over the codes with k_scale = v_scale = 1 (q_scale / prob_scale ignored)."""
    one = torch.ones_like(k_scale)  # the scale the kernel never got: code x 1.0
    return reference.decode_attention(q, k_cache, v_cache, block_table, seq_lens, one, one, sm_scale)


def mla_decode_scale_dropped(q_latent, q_pe, cache, block_table, seq_lens, scale, sm_scale, **_):
    return reference.mla_decode(q_latent, q_pe, cache, block_table, seq_lens, torch.ones_like(scale), sm_scale)


decode = SimpleNamespace(decode_attention=decode_attention_scale_dropped, mla_decode=mla_decode_scale_dropped)
