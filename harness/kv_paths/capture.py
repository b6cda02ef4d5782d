"""Attention capture: the logits, probabilities and outputs of sampled (head, query position) rows of
every attention layer, observed in the registered `harness` attention function.

Capture is off unless a `CaptureSession` is entered: it sets `harness_observer` on the model's attention
modules for its duration and removes it after, so plain runs pay one `getattr` per layer call.

What the observer sees is what the model attends with: post-RoPE query and keys as read back from the
cache (FP8 paths: dequantised), and for MLA the keys and values up-projected from the (dequantised)
latent by `kv_b_proj`, never the latent bytes. Layers that do not call the attention function (the
linear-attention layers of hybrids) are not captured.

Memory is bounded by sampling: `heads` (query heads) and `positions` (absolute query positions) are
chosen by the caller; each captured row holds [context] logits and probabilities in fp32 plus the [Dv]
output. Isolated mode additionally keeps the reference's full attention output of each layer and chunk
(the model's own activation size) so it can be handed to the path's layer in its place.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from harness.kv_paths.attention import ATTENTION_OBSERVER


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
    """One layer's captured rows for one chunk: heads [Hs], positions [R] (absolute), logits/probs
    [Hs, R, L] fp32 (masked keys: logits -inf, probs 0), out [Hs, R, Dv] fp32."""

    heads: list[int]
    positions: list[int]
    logits: torch.Tensor
    probs: torch.Tensor
    out: torch.Tensor


@dataclass
class CaptureSession:
    """Observe every attention layer of `model` while entered.

    on_rows(layer, rows): called with each layer call's sampled rows (None: rows are kept in `rows`).
    keep_outputs: keep each call's full attention output (isolated mode's reference pass).
    replace_outputs: {(layer, call index): output} handed back in place of the layer's own output
        (isolated mode's path pass), so every layer sees the reference's hidden states.
    prob_transform(layer, probs): applied to a path's probabilities before they are compared (a path
        that rounds P to FP8 multiplies V with the rounded ones).
    """

    model: torch.nn.Module
    heads: list[int]
    positions: list[int]
    on_rows: Callable[[int, LayerRows], None] | None = None
    keep_outputs: bool = False
    replace_outputs: dict | None = None
    prob_transform: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    rows: dict[int, list[LayerRows]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def attached(self) -> Iterator["CaptureSession"]:
        modules = [m for m in self.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
        for module in modules:
            setattr(module, ATTENTION_OBSERVER, self.observe)
        try:
            yield self
        finally:
            for module in modules:
                if hasattr(module, ATTENTION_OBSERVER):
                    delattr(module, ATTENTION_OBSERVER)

    def observe(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                output: torch.Tensor) -> torch.Tensor | None:
        layer = int(module.layer_idx)
        call = self.calls.get(layer, 0)
        self.calls[layer] = call + 1
        transform = None if self.prob_transform is None else (lambda probs: self.prob_transform(layer, probs))
        rows = sample_rows(module, query, key, value, output, self.heads, self.positions, transform)
        if rows is not None:
            if self.on_rows is not None:
                self.on_rows(layer, rows)
            else:
                self.rows.setdefault(layer, []).append(rows)
        if self.keep_outputs:
            self.outputs[(layer, call)] = output.detach().clone()
        if self.replace_outputs is not None:
            return self.replace_outputs[(layer, call)]
        return None


def sample_rows(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                heads: list[int], positions: list[int],
                prob_transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LayerRows | None:
    """The sampled rows of one attention call. query [1, Hq, T, D] (the chunk at absolute positions
    past..past+T-1 with past = keys - T), key/value [1, Hkv, keys, D], output [1, T, Hq, Dv]."""
    chunk, length = query.shape[2], key.shape[2]
    past = length - chunk
    wanted = [p for p in positions if past <= p < length]
    if not wanted:
        return None
    hq, hkv = query.shape[1], key.shape[1]
    head_idx = torch.tensor(heads, device=query.device)
    kv_idx = head_idx // (hq // hkv)
    row_idx = torch.tensor([p - past for p in wanted], device=query.device)
    q = query[0].index_select(0, head_idx).index_select(1, row_idx).float()  # [Hs, R, D]
    k = key[0].index_select(0, kv_idx).float()  # [Hs, L, D]
    logits = (q @ k.transpose(-1, -2)) * float(module.scaling)  # [Hs, R, L]
    keys = torch.arange(length, device=query.device)
    valid = keys.unsqueeze(0) <= torch.tensor(wanted, device=query.device).unsqueeze(1)  # [R, L]
    logits = logits.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if prob_transform is not None:
        probs = prob_transform(probs)
    out = output[0].index_select(0, row_idx).index_select(1, head_idx).transpose(0, 1).float()  # [Hs, R, Dv]
    return LayerRows(heads=list(heads), positions=wanted, logits=logits, probs=probs, out=out)
