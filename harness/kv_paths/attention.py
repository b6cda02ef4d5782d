"""The attention function every in-process backend runs through, and the FP8 decode-kernel path.

Registered with transformers as `harness`: it runs SDPA, lets a per-module observer see q/k/v/output,
and, for decode steps of a cache layer that keeps a paged FP8 copy (`PagedKV`), returns the output of
our kernel (`kernels.decode_attention`, or `kernels.mla_decode` with absorbed projections for MLA)
while measuring its agreement with the torch computation over the same dequantised cache.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Callable

import torch

ATTENTION_NAME = "harness"
BLOCK_SIZE = 16  # tokens per page of the paged cache
# The cache whose layers the running forward pass uses; set around each model call by the backend.
active_cache: contextvars.ContextVar = contextvars.ContextVar("active_cache", default=None)


@dataclass(slots=True)
class KernelAgreement:
    """Kernel output against an fp64 computation over the same dequantised cache, per call of a backend."""

    steps: int = 0
    max_abs_err: float = 0.0  # max |kernel - fp64|
    max_ratio: float = 0.0  # max of kernel error / SDPA bf16 error (torch's own error at this precision)

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
                "kernel_err_ratio": self.max_ratio}


def kernel_ops():
    """Triton launchers on CUDA; the torch reference (same names) when asked, e.g. to test the glue on CPU."""
    import os

    if os.environ.get("HARNESS_KERNELS") == "reference":
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
    ops: object
    agreement: KernelAgreement
    length: int = 0
    pages: list = field(default_factory=list)

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value: [1, heads, chunk, dim] (MLA: latent [1, 1, chunk, Dc], k_pe [1, 1, chunk, Dr])
        chunk = key.shape[-2]
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


def _kernel_decode(module, query: torch.Tensor, paged: PagedKV) -> torch.Tensor:
    """query [1, Hq, 1, D] -> attention output [1, 1, Hq, Dv] from the kernel over the paged cache."""
    table, lens = paged.block_table(query.device)
    if not paged.mla:
        out, _ = paged.ops.decode_attention(query[:, :, 0].contiguous(), paged.pages[0], paged.pages[1], table, lens,
                                            paged.k_scale, paged.v_scale, module.scaling)
        return out.unsqueeze(1)
    # Absorbed MLA: q_latent = q_nope W_UK, out = (softmax . c) W_UV, with W from kv_b_proj.
    nope, heads = module.qk_nope_head_dim, query.shape[1]
    weight = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, -1)  # [H, nope + v, Dc]
    q_nope, q_pe = query[0, :, 0, :nope], query[0, :, 0, nope:]
    q_latent = torch.einsum("hn,hnc->hc", q_nope.float(), weight[:, :nope].float()).to(query.dtype)
    out_latent, _ = paged.ops.mla_decode(q_latent.unsqueeze(0).contiguous(), q_pe.unsqueeze(0).contiguous(),
                                         paged.pages[0], table, lens, paged.k_scale.reshape(()), module.scaling)
    out = torch.einsum("hc,hvc->hv", out_latent[0].float(), weight[:, nope:].float()).to(query.dtype)
    return out.view(1, 1, heads, -1)


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
    weight = module.kv_b_proj.weight.double().view(heads, nope + module.v_head_dim, -1)
    latent_dim = weight.shape[-1]
    c, pe = rows[:, :latent_dim], rows[:, latent_dim:]
    q = query[0, :, 0].double()
    q_latent = torch.einsum("hn,hnc->hc", q[:, :nope], weight[:, :nope])
    scores = (q_latent @ c.T + q[:, nope:] @ pe.T) * module.scaling  # [H, L]
    out = torch.einsum("hc,hvc->hv", torch.softmax(scores, dim=-1) @ c, weight[:, nope:])
    return out.view(1, 1, heads, -1)


def register(observer_attr: str = "harness_observer") -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def harness_attention(module, query, key, value, attention_mask, **kwargs):
        output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        cache = active_cache.get()
        layer = cache.layers[module.layer_idx] if cache is not None else None
        paged = getattr(layer, "paged", None)
        if paged is not None and query.shape[2] == 1 and hasattr(paged, "decode"):  # batched (harness.replay.batched)
            output = paged.decode(module, query, output)
        elif paged is not None and query.shape[2] == 1 and query.shape[0] == 1:
            kernel_out = _kernel_decode(module, query, paged)
            paged.agreement.add(kernel_out, output, _exact_attention(module, query, paged))
            output = kernel_out
        observer: Callable | None = getattr(module, observer_attr, None)
        if observer is not None:
            observer(module, query, key, value, output)
        return output, weights

    AttentionInterface.register(ATTENTION_NAME, harness_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
