"""Decode-kernel plug-ins: which function a path's FP8 decode steps run through (`kernel=` path option).

The contract (docs/CONTRACTS.md, "Decode-kernel plug-ins") is the signature of our own launchers:
    decode_attention(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sm_scale) -> out | (out, ...)
    mla_decode(q_latent, q_pe, cache, block_table, seq_lens, scale, sm_scale) -> out | (out, ...)
A name is a built-in (`triton`: kernels/, the default on CUDA, whose MLA decode over an FP8 cache runs a CUDA
kernel where NVRTC is present, the GPU's launch table choosing which: kernels/mla_decode_fp8.cu from sm_89,
kernels/mla_decode_latent_split.cu on an H200; `dequant`: kernels/workaround.py, the
dequantise-everything workaround of failure class 4; `reference`: the fp32 torch mirror) or
`package.module:attr` (also `package.module.attr`). attr is either one GQA function, or an object (module,
class, namespace) with a `decode_attention` and/or a `mla_decode` attribute. The harness stores into the paged
cache itself (our store kernels, bit-identical to torch's cast), calls the plug-in once per decode step and
layer, checks what it returns, and judges it against fp64 attention over the same stored codes.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from typing import Callable

import torch

BUILTIN = {
    "triton": "kernels.decode_attention:decode_attention|kernels.mla_decode:mla_decode",
    "dequant": "kernels.workaround:decode_attention|kernels.workaround:mla_decode",
    "reference": "kernels.reference:decode_attention|kernels.reference:mla_decode",
}
# the built-ins' decode over block-scaled caches (NVFP4, MX, int per token-head: harness/kv_paths/block_layout.py);
# a plug-in's contract has FP8 caches only (the route refuses block-scaled paths for it)
BLOCK_SCALED_BUILTIN = {
    "triton": "kernels.decode_attention_block_scaled:decode_attention_block_scaled",
    "reference": "kernels.reference:decode_attention_block_scaled",
}
# ... and their MLA decode over a block-scaled latent (k_pe in 16 bits beside it)
BLOCK_SCALED_MLA_BUILTIN = {
    "triton": "kernels.decode_attention_block_scaled:mla_decode_block_scaled",
    "reference": "kernels.reference:mla_decode_block_scaled",
}
DEFAULT = "triton"
# What each built-in's GQA decode computes beyond SDPA (keywords the model hands its attention function, and "window":
# a sliding-window or chunked layer's first key per row). Their MLA, block-scaled and FP8-attention (q_scale /
# prob_scale) decodes compute none; a plug-in's contract has none. The Triton kernel computes all three
# (kernels/decode_attention.py; tests/test_kernels_gpu.py::test_decode_attention_sinks_softcap_and_windows_match_fp64
# on an H200, session 21). The mirror runs the glue on the CPU (HARNESS_KERNELS=reference).
BEYOND_SDPA_COMPUTED = {"triton": frozenset({"s_aux", "softcap", "window"}),
                        "reference": frozenset({"s_aux", "softcap", "window"})}
KERNELS_ENV = "HARNESS_KERNELS"
# auto: our Triton kernels on CUDA; off: torch attention and torch cache writes everywhere; reference: the kernels'
# torch mirror (kernels/reference.py) on any device, to test the glue on a CPU
KERNEL_SETTINGS = ("auto", "off", "reference")


def kernels_setting() -> str:
    """HARNESS_KERNELS (default auto); the one place it is read. Another value is refused, naming the variable."""
    value = os.environ.get(KERNELS_ENV, "auto")
    if value not in KERNEL_SETTINGS:
        raise ValueError(f"{KERNELS_ENV}={value!r}: expected one of {', '.join(KERNEL_SETTINGS)}")
    return value
_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class KernelPluginError(ValueError):
    """A plug-in that cannot be loaded or broke the contract; the message names the plug-in and the rule."""


@dataclass(frozen=True, slots=True)
class DecodeKernel:
    name: str
    decode_attention: Callable | None
    mla_decode: Callable | None
    block_scaled: Callable | None = None  # built-ins: decode_attention over block-scaled pages
    mla_block_scaled: Callable | None = None  # built-ins: MLA decode over a block-scaled latent

    def __post_init__(self):
        if self.decode_attention is None and self.mla_decode is None:
            raise KernelPluginError(f"decode kernel {self.name!r} provides neither decode_attention nor mla_decode")


def check_name(name: str) -> str:
    """The name if it is well formed (a built-in or `package.module:attr`), else KernelPluginError. A user
    plug-in is also imported here, so a typo is refused before any work."""
    if name in BUILTIN:
        return name
    module, attr = _split(name)
    if not (_DOTTED.match(module) and attr.isidentifier()):
        raise KernelPluginError(f"kernel {name!r}: expected one of {', '.join(BUILTIN)} or 'package.module:function'")
    resolve(name)
    return name


def _split(name: str) -> tuple[str, str]:
    if ":" in name:
        module, _, attr = name.partition(":")
    else:
        module, _, attr = name.rpartition(".")
    return module, attr


def _load(target: str, name: str) -> object:
    module, attr = _split(target)
    try:
        loaded = importlib.import_module(module)
    except Exception as e:   # noqa: BLE001 - any import failure of a user's module is reported, not raised
        raise KernelPluginError(f"kernel {name!r}: cannot import module {module!r}: {type(e).__name__}: {e}") from e
    if not hasattr(loaded, attr):
        raise KernelPluginError(f"kernel {name!r}: module {module!r} has no attribute {attr!r}")
    return getattr(loaded, attr)


def resolve(name: str) -> DecodeKernel:
    """The plug-in's functions. Built-ins import their kernels module here (the Triton one needs triton)."""
    if name in BUILTIN:
        gqa, mla = (_load(target, name) for target in BUILTIN[name].split("|"))
        block_scaled = _load(BLOCK_SCALED_BUILTIN[name], name) if name in BLOCK_SCALED_BUILTIN else None
        mla_block_scaled = _load(BLOCK_SCALED_MLA_BUILTIN[name], name) if name in BLOCK_SCALED_MLA_BUILTIN else None
        return DecodeKernel(name, gqa, mla, block_scaled, mla_block_scaled)
    target = _load(name, name)
    gqa, mla = getattr(target, "decode_attention", None), getattr(target, "mla_decode", None)
    if gqa is None and mla is None:
        if not callable(target):
            raise KernelPluginError(f"kernel {name!r} is neither a function nor an object with a decode_attention "
                                    f"or mla_decode attribute (got {type(target).__name__})")
        gqa = target
    for what, fn in (("decode_attention", gqa), ("mla_decode", mla)):
        if fn is not None and not callable(fn):
            raise KernelPluginError(f"kernel {name!r}: its {what} is not callable ({type(fn).__name__})")
    return DecodeKernel(name, gqa, mla)


def _output(kernel: DecodeKernel, what: str, result: object, like: torch.Tensor, shape: tuple) -> torch.Tensor:
    out = result[0] if isinstance(result, (tuple, list)) and result else result
    if not isinstance(out, torch.Tensor):
        raise KernelPluginError(f"kernel {kernel.name!r}: {what} returned {type(out).__name__}; the contract "
                                f"(docs/CONTRACTS.md) wants a tensor {list(shape)} or a tuple starting with one")
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise KernelPluginError(f"kernel {kernel.name!r}: {what} returned {list(out.shape)} {out.dtype} on "
                                f"{out.device}; the contract wants {list(shape)} {like.dtype} on {like.device}")
    return out


def kernel_result(kernel: DecodeKernel, what: str, result: object, like: torch.Tensor,
                  shape: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse or None) of a plug-in call: out checked as `run_gqa` checks it; lse is the tuple's second
    element when it is a [B, H] tensor (our kernels and the reference return one; the contract allows none)."""
    out = _output(kernel, what, result, like, shape)
    lse = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(shape[:2]):
        lse = None
    return out, lse


def run_gqa(kernel: DecodeKernel, q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale,
            sm_scale: float, **attention_scales) -> torch.Tensor:
    """out [B, Hq, D] in q's dtype from the plug-in's decode_attention, checked against the contract.
    attention_scales (q_scale / prob_scale: FP8 attention) go only to plug-ins that take them (ours)."""
    if kernel.decode_attention is None:
        raise KernelPluginError(f"kernel {kernel.name!r} has no decode_attention (GQA/MHA models need one)")
    result = kernel.decode_attention(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sm_scale,
                                     **attention_scales)
    return _output(kernel, "decode_attention", result, q, q.shape)


def run_gqa_block_scaled(kernel: DecodeKernel, q, k_codes, v_codes, k_block_scales, v_block_scales, block_table,
                         seq_lens, k_scale, v_scale, sm_scale: float, layout: dict) -> torch.Tensor:
    """out [B, Hq, D] in q's dtype from the built-in's decode over block-scaled pages (layout: element, block_scale,
    block_size), checked as `run_gqa` checks its output."""
    if kernel.block_scaled is None:
        raise KernelPluginError(f"kernel {kernel.name!r} has no decode over block-scaled caches (only the built-ins)")
    result = kernel.block_scaled(q, k_codes, v_codes, k_block_scales, v_block_scales, block_table, seq_lens, k_scale,
                                 v_scale, sm_scale, **layout)
    return _output(kernel, "decode_attention_block_scaled", result, q, q.shape)


def run_mla_block_scaled(kernel: DecodeKernel, q_latent, q_pe, codes, block_scales, k_pe, block_table, seq_lens,
                         scale, sm_scale: float, layout: dict) -> torch.Tensor:
    """out [B, H, Dc] (latent space) from the built-in's MLA decode over a block-scaled latent (`layout`: the
    format's element / block scale / block size), checked."""
    if kernel.mla_block_scaled is None:
        raise KernelPluginError(f"kernel {kernel.name!r} has no MLA decode over block-scaled latents")
    result = kernel.mla_block_scaled(q_latent, q_pe, codes, block_scales, k_pe, block_table, seq_lens, scale,
                                     sm_scale, **layout)
    return _output(kernel, "mla_decode_block_scaled", result, q_latent, q_latent.shape)


def run_mla(kernel: DecodeKernel, q_latent, q_pe, cache, block_table, seq_lens, scale,
            sm_scale: float, **attention_scales) -> torch.Tensor:
    """out [B, H, Dc] (latent space) in q_latent's dtype from the plug-in's mla_decode, checked.
    attention_scales (q_scale / prob_scale) as in run_gqa: only to plug-ins that take them (ours)."""
    if kernel.mla_decode is None:
        raise KernelPluginError(f"kernel {kernel.name!r} has no mla_decode (MLA models need one)")
    result = kernel.mla_decode(q_latent, q_pe, cache, block_table, seq_lens, scale, sm_scale, **attention_scales)
    return _output(kernel, "mla_decode", result, q_latent, q_latent.shape)
