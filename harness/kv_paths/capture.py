"""Attention capture: the logits, probabilities and outputs of sampled (head, query position) rows of
every attention layer, observed in the registered `harness` attention function.

Capture is off unless a `CaptureSession` is entered: its observer is the forward context's (harness/forward_context.py)
for the model calls inside, and no other call sees it.

What the observer sees is what the model attends with: post-RoPE query and keys as read back from the
cache (FP8 paths: dequantised), and for MLA the keys and values up-projected from the (dequantised)
latent by `kv_b_proj`, never the latent bytes. Layers that do not call the attention function (the
linear-attention layers of hybrids) are not captured.

A path that decodes through a kernel (ours on CUDA, or a `kernel=` plug-in) can also have the kernel run on
the same rows (`KernelRows`): the sampled query rows become a batch of decode queries over the layer's
paged FP8 copy, so the kernel reads exactly the codes torch's rows were computed from. The model itself
keeps running torch attention; a kernel exposes its output and lse, so that is what its rows carry.

Memory is bounded by sampling: `heads` (query heads) and `positions` (absolute query positions) are
chosen by the caller; each captured row holds [context] logits (and, for a path that rounds P to FP8, its
probabilities) in fp32 plus the [Dv] output. Isolated mode additionally keeps the reference's full attention output of each layer and chunk
(the model's own activation size) so it can be handed to the path's layer in its place.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from harness.forward_context import forward_context
from harness.kv_paths import mla


@dataclass(frozen=True, slots=True)
class CaptureSample:
    """How many query heads and query rows to capture per layer (evenly spread, ends included)."""

    max_heads: int = 8
    max_rows: int = 16

    def __post_init__(self):
        if self.max_heads < 1 or self.max_rows < 1:
            raise ValueError(f"capture sample needs at least one head and one row, got heads={self.max_heads}, "
                             f"rows={self.max_rows}")

    def heads(self, num_heads: int) -> list[int]:
        return spread(num_heads, self.max_heads)

    def positions(self, first: int, last: int) -> list[int]:
        """Absolute query positions first..last (inclusive), at most max_rows of them."""
        return [first + i for i in spread(last - first + 1, self.max_rows)]


def spread(n: int, k: int) -> list[int]:
    """min(n, k) indices of range(n), evenly spaced, first and last included."""
    if n <= 0:
        return []
    if k >= n:
        return list(range(n))
    if k == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


@dataclass
class LayerRows:
    """One layer's captured rows for one chunk: heads [Hs], positions [R] (absolute), logits [Hs, R, L] fp32
    (masked keys: -inf), probs [Hs, R, L] fp32 or None (None: softmax of the logits, computed when compared),
    out [Hs, R, Dv] fp32. A path whose decode runs through a kernel also has the kernel's rows, run beside
    torch on the same stored codes: kernel_out [Hs, R, Dv] fp32, kernel_lse [Hs, R] fp32 (None when the
    kernel returns no lse)."""

    heads: list[int]
    positions: list[int]
    logits: torch.Tensor
    probs: torch.Tensor | None
    out: torch.Tensor
    kernel_out: torch.Tensor | None = None
    kernel_lse: torch.Tensor | None = None

    def probabilities(self) -> torch.Tensor:
        return torch.softmax(self.logits, dim=-1) if self.probs is None else self.probs


@dataclass
class KernelRows:
    """Runs a decode kernel as decode queries for the sampled rows of one layer call: the R sampled query
    rows become a batch of R sequences that share the layer's pages (one block table row each) with
    seq_lens = position + 1, so each row attends exactly the keys the model's row attends.

    paged: {layer: PagedKV} of the path's cache, one sequence (`attention.attach_paged(decodes=False)`: its pages
    written by the store kernels as the model runs).
    """

    kernel: object  # harness.kv_paths.decode_kernels.DecodeKernel
    paged: dict
    failure: str | None = None  # the first error the kernel raised; it is not called again after one

    def run(self, module, query: torch.Tensor, row_idx: torch.Tensor, seq_lens: torch.Tensor,
            head_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`measure` unless the kernel already failed; a failure (e.g. a plug-in written for one sequence
        at a time, handed a batch) is kept in `failure`, never raised: torch's rows stay."""
        if self.failure is not None:
            return None
        try:
            return self.measure(module, query, row_idx, seq_lens, head_idx)
        except Exception as error:  # noqa: BLE001 - a user's plug-in may raise anything; named in the run
            self.failure = f"{type(error).__name__}: {error}"
            return None

    @property
    def name(self) -> str:
        return self.kernel.name

    def measure(self, module, query: torch.Tensor, row_idx: torch.Tensor, seq_lens: torch.Tensor,
                head_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(out [Hs, R, Dv] fp32, lse [Hs, R] fp32 or None) of the kernel for the rows row_idx of query
        [1, Hq, T, D]; None when the layer has no paged cache."""
        from harness.kv_paths.decode_kernels import KernelPluginError, kernel_result

        paged = self.paged.get(int(module.layer_idx))
        if paged is None or paged.step.span() == 0:  # one sequence: its pages are all the copy's
            return None
        rows = row_idx.numel()
        q = query[0].index_select(1, row_idx).transpose(0, 1).contiguous()  # [R, Hq, D]
        blocks = paged.pages[0].shape[0]
        table = torch.arange(blocks, dtype=torch.int32, device=q.device).expand(rows, blocks).contiguous()
        if (self.kernel.mla_decode if paged.mla else self.kernel.decode_attention) is None:
            raise KernelPluginError(f"kernel {self.name!r} has no {'mla_decode' if paged.mla else 'decode_attention'}")
        if not paged.mla:
            result = self.kernel.decode_attention(q, paged.pages[0], paged.pages[1], table, seq_lens,
                                                  paged.k_scale, paged.v_scale, float(module.scaling))
            out, lse = kernel_result(self.kernel, "decode_attention", result, q, tuple(q.shape))
        else:  # absorbed MLA, as the model's decode steps run it (harness.kv_paths.attention.PagedKV._kernel)
            nope = module.qk_nope_head_dim
            w_uk, w_uv = mla.absorbed_weights(module, torch.float32)
            q_latent = mla.absorb_query(q[..., :nope].float(), w_uk).to(q.dtype)
            q_pe = q[..., nope:].contiguous()
            result = self.kernel.mla_decode(q_latent.contiguous(), q_pe, paged.pages[0], table, seq_lens,
                                            paged.k_scale.reshape(()), float(module.scaling))
            latent, lse = kernel_result(self.kernel, "mla_decode", result, q_latent, tuple(q_latent.shape))
            out = mla.expand_latent(latent.float(), w_uv)
        out = out.index_select(1, head_idx).transpose(0, 1).float()  # [Hs, R, Dv]
        if lse is not None:
            lse = lse.index_select(1, head_idx).transpose(0, 1).float()  # [Hs, R]
        return out, lse


@dataclass
class CaptureSession:
    """Observe every attention layer of `model` while entered.

    Rows are kept in `rows` ({layer: [LayerRows per call]}) and compared after the pass: the observer
    itself only selects and multiplies (a dozen device ops, no host sync), so capture stays close to the
    cost of the pass it watches.
    on_rows(layer, rows): called with each layer call's sampled rows instead of keeping them.
    keep_outputs: keep each call's full attention output (isolated mode's reference pass).
    replace_outputs: {(layer, call index): output} handed back in place of the layer's own output
        (isolated mode's path pass), so every layer sees the reference's hidden states.
    prob_transform(layer, probs): applied to a path's probabilities before they are compared (a path
        that rounds P to FP8 multiplies V with the rounded ones).
    kernel: run this decode kernel beside torch on the sampled rows (`KernelRows`), in calls where torch
        attends exactly the stored codes (every call of a path that quantises the current chunk; one-token
        calls of a `raw_prefill` path).
    kernel_every_call: False for `raw_prefill` paths (see kernel).
    """

    model: torch.nn.Module
    heads: list[int]
    positions: list[int]
    on_rows: Callable[[int, LayerRows], None] | None = None
    keep_outputs: bool = False
    replace_outputs: dict | None = None
    prob_transform: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    kernel: KernelRows | None = None
    kernel_every_call: bool = True
    rows: dict[int, list[LayerRows]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)
    _index: dict = field(default_factory=dict)

    @contextlib.contextmanager
    def attached(self) -> Iterator["CaptureSession"]:
        with forward_context(observe=self.observe):  # the model calls entered inside inherit it
            yield self

    def observe(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                output: torch.Tensor) -> torch.Tensor | None:
        layer = int(module.layer_idx)
        call = self.calls.get(layer, 0)
        self.calls[layer] = call + 1
        chunk, length = query.shape[2], key.shape[2]
        index = self.sample_index(query.shape[1], key.shape[1], length - chunk, length, query.device)
        if index is not None:
            rows = _sample(module, query, key, output, index, self.heads)
            if self.prob_transform is not None:
                rows.probs = self.prob_transform(layer, torch.softmax(rows.logits, dim=-1))
            if self.kernel is not None and (self.kernel_every_call or chunk == 1):
                measured = self.kernel.run(module, query, index.row_idx, index.seq_lens, index.head_idx)
                if measured is not None:
                    rows.kernel_out, rows.kernel_lse = measured
            if self.on_rows is not None:
                self.on_rows(layer, rows)
            else:
                self.rows.setdefault(layer, []).append(rows)
        if self.keep_outputs:
            self.outputs[(layer, call)] = output.detach().clone()
        if self.replace_outputs is not None:
            return self.replace_outputs[(layer, call)]
        return None

    def sample_index(self, hq: int, hkv: int, past: int, length: int, device) -> "SampleIndex | None":
        """The index tensors of one call's rows, built once per (chunk, device) and shared by every layer."""
        key = (hq, hkv, past, length, str(device))
        if key not in self._index:
            self._index[key] = sample_index(self.heads, self.positions, hq, hkv, past, length, device)
        return self._index[key]


@dataclass(frozen=True, slots=True)
class SampleIndex:
    """Which rows of a call are sampled: positions (absolute, host), and on the device head_idx [Hs],
    kv_idx [Hs], row_idx [R] (within the chunk), seq_lens [R] int32 (position + 1) and valid [R, L]."""

    positions: list[int]
    head_idx: torch.Tensor
    kv_idx: torch.Tensor
    row_idx: torch.Tensor
    seq_lens: torch.Tensor
    valid: torch.Tensor


def sample_index(heads: list[int], positions: list[int], hq: int, hkv: int, past: int, length: int,
                 device) -> SampleIndex | None:
    wanted = [p for p in positions if past <= p < length]
    if not wanted:
        return None
    head_idx = torch.tensor(heads, device=device)
    pos = torch.tensor(wanted, device=device)
    valid = torch.arange(length, device=device).unsqueeze(0) <= pos.unsqueeze(1)  # [R, L]
    return SampleIndex(wanted, head_idx, head_idx // (hq // hkv), pos - past, (pos + 1).to(torch.int32), valid)


def _sample(module, query: torch.Tensor, key: torch.Tensor, output: torch.Tensor, index: SampleIndex,
            heads: list[int]) -> LayerRows:
    q = query[0].index_select(0, index.head_idx).index_select(1, index.row_idx).float()  # [Hs, R, D]
    k = key[0].index_select(0, index.kv_idx).float()  # [Hs, L, D]
    logits = torch.matmul(q * float(module.scaling), k.transpose(-1, -2)).masked_fill_(~index.valid, float("-inf"))
    out = output[0].index_select(0, index.row_idx).index_select(1, index.head_idx).transpose(0, 1).float()
    return LayerRows(heads=list(heads), positions=index.positions, logits=logits, probs=None, out=out)
