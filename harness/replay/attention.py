"""Attention-score error of one turn: the reference and a path run teacher-forced over the same tokens
(the reference's reply on the reference's history), with capture on, and their sampled attention rows
compared per layer, head and query position.

Modes:
  isolated     every layer of the path gets the reference's inputs: the path's attention output is
               measured, then replaced by the reference's before the layer goes on, so the error of
               layer L is that layer's own quantisation error (it cannot depend on layers < L).
  end-to-end   the path runs on its own activations: the error includes what earlier layers passed on.

Chunking is the one `InProcessBackend.score_sync` uses (prompt, then the continuation as one chunk, or
one token at a time for `raw_prefill` paths), for the reference pass too, so the `bf16` path compares
bit-identical computations and shows exactly zero error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from harness.analysis import attention_error as ae
from harness.kv_paths import attention as attn
from harness.kv_paths.cache import LayerScales, build_cache
from harness.kv_paths.capture import CaptureSample, CaptureSession, LayerRows
from harness.kv_paths.spec import KVPath
from kernels.reference import FP8_MAX

MODES = ("isolated", "end-to-end")


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    mode: str = "isolated"
    sample: CaptureSample = CaptureSample()
    top_k: int = ae.TOP_K

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown attention capture mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if self.top_k < 1:
            raise ValueError(f"attention top_k must be >= 1, got {self.top_k}")

    def describe(self) -> dict:
        return {"mode": self.mode, "max_heads": self.sample.max_heads, "max_rows": self.sample.max_rows,
                "top_k": self.top_k}


@dataclass(frozen=True, slots=True)
class AttentionTurn:
    """summary: per-turn aggregates (record metrics); rows: one per (layer, head, query position);
    channels: per-channel amax of what the reference cached, per layer and tensor; sampled: what was captured."""

    summary: dict
    rows: list[dict]
    channels: list[dict]
    sampled: dict


def chunks_for(kv_path: KVPath | None, prompt: list[int], continuation: list[int]) -> list[list[int]]:
    rest = continuation[:-1]
    if kv_path is None or kv_path.quantize_current_chunk:
        return [prompt] + ([rest] if rest else [])
    return [prompt] + [[t] for t in rest]


@torch.inference_mode()
def measure_turn(model: torch.nn.Module, device: torch.device, kv_path: KVPath, scales: LayerScales | None,
                 prompt: Sequence[int], continuation: Sequence[int], options: AttentionOptions,
                 prob_transform=None) -> AttentionTurn:
    """Compare the path's attention with the reference's on prompt + continuation (teacher-forced)."""
    prompt, continuation = list(prompt), list(continuation)
    if not prompt or not continuation:
        return AttentionTurn(summary={}, rows=[], channels=[], sampled={})
    config = model.config
    heads = options.sample.heads(int(config.num_attention_heads))
    positions = options.sample.positions(len(prompt) - 1, len(prompt) + len(continuation) - 2)
    chunks = chunks_for(kv_path, prompt, continuation)
    isolated = options.mode == "isolated"

    reference = CaptureSession(model, heads, positions, keep_outputs=isolated)
    ref_cache = build_cache(config, None, None)
    with reference.attached():
        _run_chunks(model, device, chunks, ref_cache)
    rows: list[dict] = []
    seen: dict[int, int] = {}

    def compare(layer: int, path_rows: LayerRows) -> None:
        index = seen.get(layer, 0)
        seen[layer] = index + 1
        rows.extend(_compare_rows(layer, reference.rows[layer][index], path_rows, options.top_k))

    if prob_transform is None and kv_path.fp8_prob:
        prob_transform = _prob_rounding(path_cache_probe(config, kv_path, scales))
    path = CaptureSession(model, heads, positions, on_rows=compare,
                          replace_outputs=reference.outputs if isolated else None, prob_transform=prob_transform)
    path_cache = build_cache(config, kv_path, scales)
    with path.attached():
        _run_chunks(model, device, chunks, path_cache)
    channels = channel_rows(ref_cache, kv_path, scales, _is_mla(config))
    summary = ae.turn_summary(rows)
    if rows:
        summary["attn_growth_per_1k"] = ae.growth_with_context(rows)
    ratios = [c["outlier_ratio"] for c in channels if c["tensor"] in ("k", "latent")]
    if ratios:
        summary["kv_outlier_ratio_max"] = max(ratios)
    sampled = {"mode": options.mode, "heads": heads, "query_positions": positions,
               "num_heads": int(config.num_attention_heads), "context_tokens": len(prompt) + len(continuation) - 1,
               "layers": sorted(reference.rows)}
    summary["attn_heads_sampled"] = float(len(heads))
    summary["attn_rows_sampled"] = float(len(positions))
    return AttentionTurn(summary=summary, rows=rows, channels=channels, sampled=sampled)


def path_cache_probe(config, kv_path: KVPath, scales: LayerScales | None) -> dict[int, object]:
    """{layer: AttentionQuant} of the path's attention layers."""
    cache = build_cache(config, kv_path, scales)
    return {i: layer.attn_quant for i, layer in enumerate(cache.layers) if getattr(layer, "attn_quant", None)}


def _prob_rounding(quants: dict[int, object]):
    from kernels.reference import dequantize, quantize

    def transform(layer: int, probs: torch.Tensor) -> torch.Tensor:
        quant = quants.get(layer)
        if quant is None or quant.prob_scale is None:
            return probs
        return dequantize(quantize(probs, quant.prob_scale, quant.fmt), quant.prob_scale)

    return transform


def _run_chunks(model, device, chunks: list[list[int]], cache) -> None:
    token = attn.active_cache.set(cache)
    try:
        for chunk in chunks:
            # capture needs no next-token logits: keep one row, not [chunk, vocab]
            model(input_ids=torch.tensor([chunk], device=device), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
    finally:
        attn.active_cache.reset(token)


def _compare_rows(layer: int, ref: LayerRows, path: LayerRows, top_k: int) -> list[dict]:
    if ref.positions != path.positions or ref.logits.shape != path.logits.shape:
        raise RuntimeError(f"layer {layer}: reference and path captured different rows "
                           f"({ref.positions} vs {path.positions}); the two passes did not chunk alike")
    hs, r, length = ref.logits.shape
    valid = (ref.logits > -math.inf).reshape(hs * r, length)
    metrics = ae.row_errors(ref.logits.reshape(hs * r, length), path.logits.reshape(hs * r, length),
                            ref.probs.reshape(hs * r, length), path.probs.reshape(hs * r, length),
                            ref.out.reshape(hs * r, -1), path.out.reshape(hs * r, -1), valid, top_k)
    columns = {name: values.cpu().tolist() for name, values in metrics.items()}
    out = []
    for i in range(hs * r):
        head, pos = ref.heads[i // r], ref.positions[i % r]
        out.append({"layer": layer, "head": head, "query_pos": pos, "context": pos + 1,
                    **{name: columns[name][i] for name in ae.ROW_METRICS}})
    return out


def _is_mla(config) -> bool:
    return getattr(config, "kv_lora_rank", None) is not None


def channel_rows(cache, kv_path: KVPath | None, scales: LayerScales | None, mla: bool) -> list[dict]:
    """Per-layer, per-tensor channel statistics of what the reference cached, with the path's largest
    representable value per channel (scale x fp8 max) and how many channels exceed it."""
    from transformers.cache_utils import DynamicLayer

    rows = []
    names = ("latent", "k_pe") if mla else ("k", "v")
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer or getattr(layer, "keys", None) is None:
            continue
        for name, tensor, side in ((names[0], layer.keys, "k"), (names[1], layer.values, "v")):
            flat = tensor[0].transpose(0, 1).reshape(tensor.shape[2], -1)  # [tokens, heads * dim]
            stats = ae.channel_stats(flat)
            row = {"layer": i, "tensor": name, "heads": int(tensor.shape[1]), **stats}
            limit = _channel_limit(kv_path, scales, i, side, int(tensor.shape[1]), int(tensor.shape[3]))
            if limit is not None:
                row["fp8_limit"] = limit
                row["clipped_channels"] = sum(a > m for a, m in zip(stats["amax"], limit))
            rows.append(row)
    return rows


def _channel_limit(kv_path, scales, layer, side, heads, dim) -> list[float] | None:
    if kv_path is None or not kv_path.is_fp8 or scales is None:
        return None
    scale = (scales.k if side == "k" else scales.v).get(layer)
    if scale is None:
        return None
    per = scale.float().reshape(-1)
    per = per.expand(heads) if per.numel() == 1 else per
    return (per.repeat_interleave(dim) * FP8_MAX[kv_path.fmt]).tolist()
