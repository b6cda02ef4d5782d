"""The attention function every in-process backend runs through, and the FP8 decode-kernel path.

Registered with transformers as `harness`: it runs SDPA, lets a per-module observer see q/k/v/output,
and, for decode steps of a cache layer that keeps a paged FP8 copy (`PagedKV`), returns the output of
the path's decode plug-in (default: our `kernels.decode_attention`, or `kernels.mla_decode` with absorbed
projections for MLA; `decode_kernels.py`) while measuring its agreement with fp64 attention over the same
stored codes and its time.
"""

from __future__ import annotations

import contextvars
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.kv_paths import mla
from harness.kv_paths.decode_kernels import DecodeKernel, kernels_setting, run_gqa, run_mla

ATTENTION_NAME = "harness"
# Attribute an attention module may carry: a callable (module, query, key, value, output) that observes
# each call and may return a tensor to use as the output instead (attention capture, isolated mode).
ATTENTION_OBSERVER = "harness_observer"
BLOCK_SIZE = 16  # tokens per page of the paged cache
# The cache whose layers the running forward pass uses; set around each model call by the backend.
active_cache: contextvars.ContextVar = contextvars.ContextVar("active_cache", default=None)


@dataclass(slots=True)
class KernelAgreement:
    """Kernel output against an fp64 computation over the same dequantised cache, per call of a backend."""

    steps: int = 0
    max_abs_err: float = 0.0  # max |kernel - fp64|
    max_ratio: float = 0.0  # max of kernel error / SDPA bf16 error (torch's own error at this precision)
    step_s: list = field(default_factory=list)  # wall time of each decode-kernel call (device synchronised)

    def add(self, kernel: torch.Tensor, sdpa: torch.Tensor, exact: torch.Tensor) -> None:
        kernel_err = (kernel.double() - exact).abs().max().item()
        torch_err = (sdpa.double() - exact).abs().max().item()
        self.steps += 1
        self.max_abs_err = max(self.max_abs_err, kernel_err)
        # bf16 output rounding: never call torch's error smaller than half an ulp of the output's scale
        floor = exact.abs().max().item() * 2.0 ** -9
        self.max_ratio = max(self.max_ratio, kernel_err / max(torch_err, floor, 1e-30))

    def as_record(self) -> dict[str, float]:
        return {"kernel_steps": float(self.steps), "kernel_max_abs_err": self.max_abs_err,
                "kernel_err_ratio": self.max_ratio,
                # median, so a first call's JIT compilation (seconds, once per process) does not count
                "kernel_ms_per_step": 1e3 * statistics.median(self.step_s) if self.step_s else 0.0}


def kernel_ops(device: torch.device | None = None):
    """Triton launchers on CUDA; the torch reference (same names) when asked, e.g. to test the glue on CPU,
    or on a CPU device (a path that names a plug-in kernel stores through the reference there)."""
    if kernels_setting() == "reference" or (device is not None and device.type != "cuda"):
        from kernels import reference as ops
        return ops
    import kernels.decode_attention
    import kernels.mla_decode
    import kernels.store_kv

    class Ops:
        store_kv = staticmethod(kernels.store_kv.store_kv)
        store_latent = staticmethod(kernels.store_kv.store_latent)
        decode_attention = staticmethod(kernels.decode_attention.decode_attention)
        mla_decode = staticmethod(kernels.mla_decode.mla_decode)

    return Ops


@dataclass
class PagedKV:
    """One layer's paged FP8 cache, written by `store_kv` / `store_latent` beside the reference layer.

    GQA: k/v pages [num_blocks, BLOCK_SIZE, kv_heads, head_dim]; MLA: one page tensor
    [num_blocks, BLOCK_SIZE, latent + rope] with a single scale, as engines keep it.
    """

    fmt_dtype: torch.dtype
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    saturate: bool
    mla: bool
    ops: object  # store_kv / store_latent (ours: the cache layout is the contract's)
    agreement: KernelAgreement
    kernel: DecodeKernel  # the decode plug-in (harness/kv_paths/decode_kernels.py)
    length: int = 0
    pages: list = field(default_factory=list)

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value: [1, heads, chunk, dim] (MLA: latent [1, 1, chunk, Dc], k_pe [1, 1, chunk, Dr])
        chunk = key.shape[-2]
        if self.k_scale.device != key.device:  # a layer-sharded model: this layer's GPU, once
            self.k_scale, self.v_scale = self.k_scale.to(key.device), self.v_scale.to(key.device)
        self._grow(self.length + chunk, key, value)
        slots = torch.arange(self.length, self.length + chunk, device=key.device, dtype=torch.int64)
        if self.mla:
            self.ops.store_latent(key[0, 0], value[0, 0], self.pages[0], slots, self.k_scale.reshape(()), self.saturate)
        else:
            self.ops.store_kv(key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous(),
                              self.pages[0], self.pages[1], slots, self.k_scale, self.v_scale, self.saturate)
        self.length += chunk

    def _grow(self, needed: int, key: torch.Tensor, value: torch.Tensor) -> None:
        have = self.pages[0].shape[0] * BLOCK_SIZE if self.pages else 0
        if needed <= have:
            return
        blocks = max(-(-needed // BLOCK_SIZE), 2 * (have // BLOCK_SIZE))
        if self.mla:
            shapes = [(blocks, BLOCK_SIZE, key.shape[-1] + value.shape[-1])]
        else:
            shapes = [(blocks, BLOCK_SIZE, key.shape[1], key.shape[-1])] * 2
        grown = [torch.zeros(shape, dtype=self.fmt_dtype, device=key.device) for shape in shapes]
        for old, new in zip(self.pages, grown):
            new.view(torch.uint8)[: old.shape[0]] = old.view(torch.uint8)
        self.pages = grown

    def block_table(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = self.pages[0].shape[0]
        return (torch.arange(blocks, dtype=torch.int32, device=device).view(1, -1),
                torch.tensor([self.length], dtype=torch.int32, device=device))


def _timed_decode(module, query: torch.Tensor, paged: PagedKV, quant=None) -> torch.Tensor:
    """`_kernel_decode`, its wall time (device synchronised before and after) added to the agreement."""
    cuda = query.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(query.device)
    start = time.perf_counter()
    out = _kernel_decode(module, query, paged, quant)
    if cuda:
        torch.cuda.synchronize(query.device)
    paged.agreement.step_s.append(time.perf_counter() - start)
    return out


def _kernel_decode(module, query: torch.Tensor, paged: PagedKV, quant=None) -> torch.Tensor:
    """query [1, Hq, 1, D] -> attention output [1, 1, Hq, Dv] from the plug-in over the paged cache. `quant`
    (an AttentionQuant: FP8 attention) goes to our kernels as q_scale / prob_scale (route.FP8_ATTENTION_KERNELS); on an
    MLA layer it quantises the absorbed query [q_latent | q_pe] the kernel multiplies, as engines' MLA kernels do
    (the torch reference quantises the model's own query [q_nope | q_pe])."""
    table, lens = paged.block_table(query.device)
    if not paged.mla:
        out = run_gqa(paged.kernel, query[:, :, 0].contiguous(), paged.pages[0], paged.pages[1], table, lens,
                      paged.k_scale, paged.v_scale, module.scaling, **_attention_scales(quant, query.device))
        return out.unsqueeze(1)
    # Absorbed MLA (harness/kv_paths/mla.py): q_latent = q_nope W_UK, out = (softmax . c) W_UV
    nope, heads = module.qk_nope_head_dim, query.shape[1]
    w_uk, w_uv = mla.absorbed_weights(module, torch.float32)
    q_nope, q_pe = query[0, :, 0, :nope], query[0, :, 0, nope:]
    q_latent = mla.absorb_query(q_nope.float(), w_uk).to(query.dtype)
    out_latent = run_mla(paged.kernel, q_latent.unsqueeze(0).contiguous(), q_pe.unsqueeze(0).contiguous(),
                         paged.pages[0], table, lens, paged.k_scale.reshape(()), module.scaling,
                         **_attention_scales(quant, query.device))
    out = mla.expand_latent(out_latent[0].float(), w_uv).to(query.dtype)
    return out.view(1, 1, heads, -1)


def _attention_scales(quant, device: torch.device) -> dict:
    """AttentionQuant -> the q_scale / prob_scale keywords of our decode_attention / mla_decode (fp32 on `device`)."""
    if quant is None:
        return {}
    assert quant.fmt == "e4m3", f"FP8 attention in {quant.fmt}: our kernels quantise Q and P to e4m3 only"
    q = quant.q_scale
    if isinstance(q, torch.Tensor):   # one scale ([] or [1]) or one per query head
        q = q.to(device, torch.float32).reshape(() if q.numel() == 1 else (-1,))
    prob = quant.prob_scale
    return {"q_scale": q, "prob_scale": None if prob is None else prob.to(device, torch.float32).reshape(())}


def _exact_attention(module, query: torch.Tensor, paged: PagedKV) -> torch.Tensor:
    """fp64 attention of one decode query over exactly what the paged cache holds (codes x scale, never
    rounded to bf16): the truth both the kernel and SDPA over the dequantised bf16 K/V are judged against."""
    length = paged.length
    if not paged.mla:
        def read(pages, scale):  # [blocks, page, Hkv, D] -> [Hkv, L, D]
            rows = pages.flatten(0, 1)[:length].double() * scale.double().reshape(-1, 1)
            return rows.transpose(0, 1)

        group = query.shape[1] // paged.pages[0].shape[2]
        k = read(paged.pages[0], paged.k_scale).repeat_interleave(group, dim=0)
        v = read(paged.pages[1], paged.v_scale).repeat_interleave(group, dim=0)
        weights = torch.softmax((query[0, :, 0:1].double() @ k.transpose(-1, -2)) * module.scaling, dim=-1)
        return (weights @ v).transpose(0, 1).unsqueeze(0)  # [1, 1, Hq, D]
    rows = paged.pages[0].flatten(0, 1)[:length].double() * paged.k_scale.double()  # [L, Dc + Dr]
    nope, heads = module.qk_nope_head_dim, query.shape[1]
    w_uk, w_uv = mla.absorbed_weights(module, torch.float64)
    latent_dim = w_uk.shape[-1]
    c, pe = rows[:, :latent_dim], rows[:, latent_dim:]
    q = query[0, :, 0].double()
    q_latent = mla.absorb_query(q[:, :nope], w_uk)
    scores = (q_latent @ c.T + q[:, nope:] @ pe.T) * module.scaling  # [H, L]
    out = mla.expand_latent(torch.softmax(scores, dim=-1) @ c, w_uv)
    return out.view(1, 1, heads, -1)


def _k_scale_on_scores(module, query: torch.Tensor, k_scale: torch.Tensor, kwargs: dict):
    """Failure class 3 on purpose: scores = q.k * scaling * k_scale over a BF16 cache (a per-head
    k_scale scales the query heads of each KV head's group)."""
    if k_scale.numel() == 1:
        scaling = kwargs.get("scaling") or module.scaling
        return query, {**kwargs, "scaling": scaling * float(k_scale)}
    factor = k_scale.to(query.device, torch.float32).repeat_interleave(query.shape[1] // k_scale.numel())
    return (query.float() * factor.view(1, -1, 1, 1)).to(query.dtype), kwargs


def _packs_gqa(query: torch.Tensor, key: torch.Tensor, mask, kwargs: dict) -> bool:
    """A CUDA decode step of a GQA layer under a mask shared by all heads, which transformers (5.17) would hand
    SDPA as K/V repeated to every query head: at 8B shape, batch 32, 1k context that copy is ~0.6 GB per layer
    and step. `_decode_sdpa_packed` runs it on the KV heads instead (what transformers 5.23 does too). A call
    with anything plain SDPA does not compute (logit soft-capping, attention sinks, a position bias, dropout)
    is left to transformers."""
    if any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "position_bias")) or kwargs.get("dropout"):
        return False  # (s_aux and position_bias are tensors: asked whether present, not whether true)
    return (query.is_cuda and query.shape[2] == 1 and key.shape[1] < query.shape[1]
            and query.shape[1] % key.shape[1] == 0 and isinstance(mask, torch.Tensor) and mask.dim() == 4
            and mask.shape[1] == 1 and mask.shape[2] == 1)


def _beyond_sdpa(kwargs: dict) -> bool:
    """A call SDPA does not compute: attention sinks (gpt-oss `s_aux`) or logit soft-capping (Gemma 2)."""
    return kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None


def _model_eager_attention(module, query, key, value, mask, kwargs: dict):
    """The model's own eager attention (its modeling file's `eager_attention_forward`, which computes sinks and
    soft-capping as the model defines them) under our mask: SDPA's boolean mask (True = attend) becomes the
    additive one eager attention adds; no mask (SDPA's causal shortcut) becomes the bottom-right causal mask."""
    import sys

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is None and q_len > 1:
        positions = torch.arange(kv_len, device=query.device)
        mask = positions[None, :] <= positions[kv_len - q_len:, None]  # [q, kv]
        mask = mask[None, None]
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("is_causal",)}
    return eager(module, query, key, value, mask, **kwargs)


def _decode_sdpa_packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                        scaling: float) -> torch.Tensor:
    """query [B, Hq, 1, D] over key/value [B, Hkv, L, D] -> [B, 1, Hq, Dv]: the query heads of each KV head (head
    h reads KV head h // group, as `repeat_kv`) become that head's rows, the mask [B, 1, 1, L] applies to all."""
    batch, q_heads, _, dim = query.shape
    packed = query.reshape(batch, key.shape[1], q_heads // key.shape[1], dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask[..., :key.shape[2]],
                                                           scale=scaling)
    return out.reshape(batch, q_heads, 1, -1).transpose(1, 2).contiguous()


def sdpa_backends(query: torch.Tensor):
    """The SDPA backends our attention calls may use. On CUDA, torch (2.11, H100) prefers cuDNN attention, which
    builds an execution plan for every new shape: 68-96 ms per call when the key length grows by one each decode
    step, against 0.3-0.5 ms for the other backends (H100, `benchmarks/sdpa_backends.py`). A batch of static
    decode reuses one shape, but every batch, prefill chunk and scoring call brings a new one. So cuDNN is left
    out; HARNESS_SDPA_CUDNN=1 puts it back (to compare)."""
    import contextlib
    import os

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not query.is_cuda or os.environ.get("HARNESS_SDPA_CUDNN") == "1":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def register(observer_attr: str = ATTENTION_OBSERVER) -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def harness_attention(module, query, key, value, attention_mask, **kwargs):
        cache = active_cache.get()
        layer = cache.layers[module.layer_idx] if cache is not None else None
        model_query, scaling = query, kwargs.get("scaling") or module.scaling  # before any path changes them
        fault = getattr(getattr(layer, "kv_path", None), "fault", "")  # a fault injector (kv_paths/faults.py)
        if getattr(getattr(layer, "kv_path", None), "k_scale_on_scores", False):
            query, kwargs = _k_scale_on_scores(module, query, layer.k_scale, kwargs)
        quant = getattr(layer, "attn_quant", None)
        raw_query = query
        paged = getattr(layer, "paged", None) if not fault else None
        batched_kernel = paged is not None and query.shape[2] == 1 and hasattr(paged, "decode")
        if batched_kernel and not paged.step.check and getattr(module, observer_attr, None) is None:
            # batched replay, unchecked step: the kernel's output is the output; torch's attention is only the
            # yardstick of a checked step, so it is not computed here
            return paged.decode(module, raw_query, None), None
        if fault:  # the path's attention is the faulty arithmetic, kernels included
            from harness.kv_paths.faults import faulty_attention

            output, weights = faulty_attention(fault, query, key, value, scaling, attention_mask, quant,
                                               getattr(layer, "k_scale", None)), None
        elif quant is None:
            with sdpa_backends(query):
                if _beyond_sdpa(kwargs):
                    output, weights = _model_eager_attention(module, query, key, value, attention_mask, kwargs)
                elif _packs_gqa(query, key, attention_mask, kwargs):
                    output, weights = _decode_sdpa_packed(query, key, value, attention_mask,
                                                          kwargs.get("scaling") or module.scaling), None
                else:
                    output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        else:  # FP8 attention (q_scale / prob_scale): the torch reference (prefill; decode when no kernel takes it)
            from kernels.reference import attention_fp8

            output, query = attention_fp8(query, key, value, kwargs.get("scaling") or module.scaling, attention_mask,
                                          quant.q_scale, quant.prob_scale, quant.fmt)
            weights = None
        if batched_kernel:  # harness.replay.batched, a checked step
            output = paged.decode(module, raw_query, output)
        elif paged is not None and query.shape[2] == 1 and query.shape[0] == 1:
            # The kernel gets the raw query (it quantises Q itself) and is judged, as the torch reference's FP8
            # attention (`output`) is, against fp64 attention of the raw query over the stored codes.
            kernel_out = _timed_decode(module, raw_query, paged, quant)
            paged.agreement.add(kernel_out, output, _exact_attention(module, raw_query, paged))
            output = kernel_out
        probe = getattr(layer, "impl_probe", None)  # the implementation check (harness/kv_paths/impl_check.py)
        # its exact attention has no sinks or soft-capping: such calls (gpt-oss, Gemma 2) are not probed (they read
        # ~440x SDPA's error on every path of a tiny gpt-oss, bf16 included: the check's definition, not the path)
        if probe is not None and not _beyond_sdpa(kwargs):
            probe.observe(module, model_query, key, value, attention_mask, scaling, output)
        observer: Callable | None = getattr(module, observer_attr, None)
        if observer is not None:
            replaced = observer(module, query, key, value, output)
            output = output if replaced is None else replaced
        return output, weights

    AttentionInterface.register(ATTENTION_NAME, harness_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
