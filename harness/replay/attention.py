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
from harness.forward_context import forward_context
from harness.kv_paths import attention as attn
from harness import model_layers
from harness.kv_paths.cache import LayerScales, build_cache, cache_kwargs
from harness.kv_paths.capture import CaptureSample, CaptureSession, KernelRows, LayerRows
from harness.kv_paths.decode_kernels import resolve
from harness.kv_paths.spec import KVPath

MODES = ("isolated", "end-to-end")
# Row elements (rows x keys) compared in one batch: the fp64 temporaries of `row_errors` stay near 32 MiB each
# (the 8B-shaped benchmark at 8k context: 4 layers a batch, 8 batches a turn).
COMPARE_ELEMENTS = 1 << 22


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
    errors: tuple[str, ...] = ()  # measurements that could not be made (the turn's other rows stand)


def chunks_for(kv_path: KVPath | None, prompt: list[int], continuation: list[int]) -> list[list[int]]:
    rest = continuation[:-1]
    if kv_path is None or kv_path.quantize_current_chunk:
        return [prompt] + ([rest] if rest else [])
    return [prompt] + [[t] for t in rest]


@torch.inference_mode()
def measure_turn(model: torch.nn.Module, device: torch.device, kv_path: KVPath, scales: LayerScales | None,
                 prompt: Sequence[int], continuation: Sequence[int], options: AttentionOptions,
                 prob_transform=None, kernel: str | None = None) -> AttentionTurn:
    """Compare the path's attention with the reference's on prompt + continuation (teacher-forced).

    kernel: the path's decode plug-in (`kernel=` name; None: torch only). Its rows are measured beside
    torch's on the same stored codes (`KernelRows`) and land in the same table, named `kernel:<name>`."""
    prompt, continuation = list(prompt), list(continuation)
    if not prompt or not continuation:
        return AttentionTurn(summary={}, rows=[], channels=[], sampled={})
    config = model.config
    heads = options.sample.heads(int(model_layers.field(config, "num_attention_heads")))
    positions = options.sample.positions(len(prompt) - 1, len(prompt) + len(continuation) - 2)
    chunks = chunks_for(kv_path, prompt, continuation)
    isolated = options.mode == "isolated"

    reference = CaptureSession(model, heads, positions, keep_outputs=isolated)
    ref_cache = build_cache(config, None, None)
    with reference.attached():
        _run_chunks(model, device, chunks, ref_cache)
    path_cache = build_cache(config, kv_path, scales)
    if prob_transform is None and kv_path.fp8_prob:
        prob_transform = _prob_rounding(_attention_quants(path_cache))
    kernel_note = _kernel_note(kv_path, kernel)
    kernel_rows, step = None, None
    if kernel_note is None:  # the kernel's paged copy is written beside the path's layers, read by `KernelRows`
        step = attn.one_sequence(len(prompt) + len(continuation), device)
        paged = attn.attach_paged(path_cache, kv_path, kernel, device, _is_mla(config), step,
                                  attn.KernelAgreement(1, device), decodes=False)
        kernel_rows = KernelRows(resolve(kernel), paged)
    path = CaptureSession(model, heads, positions, replace_outputs=reference.outputs if isolated else None,
                          prob_transform=prob_transform, kernel=kernel_rows,
                          kernel_every_call=kv_path.quantize_current_chunk)
    _run_path(model, device, chunks, path_cache, path, step)
    reference.outputs.clear()
    errors = _kernel_errors(kernel, kernel_rows)
    if errors:
        kernel_rows, kernel_note = None, f"failed: {kernel_rows.failure}"
    label = f"kernel:{kernel}" if kernel_rows is not None else None
    rows, kernel_table = compare_rows(reference.rows, path.rows, options.top_k, label)
    channels = channel_rows(ref_cache, kv_path, scales, _is_mla(config))
    summary = _summary(rows, kernel_table, channels, len(heads), len(positions), bool(errors))
    sampled = {"mode": options.mode, "heads": heads, "query_positions": positions,
               "num_heads": int(model_layers.field(config, "num_attention_heads")), "context_tokens": len(prompt) + len(continuation) - 1,
               "layers": sorted(reference.rows)}
    if kernel is not None:
        sampled["kernel"] = label or f"not measured: {kernel_note}"
    return AttentionTurn(summary=summary, rows=rows + kernel_table, channels=channels, sampled=sampled, errors=errors)


def _run_path(model, device, chunks: list[list[int]], cache, session: CaptureSession, step=None) -> None:
    try:
        with session.attached():
            _run_chunks(model, device, chunks, cache, step)
    finally:
        attn.detach_paged(cache)


def _kernel_errors(kernel: str | None, kernel_rows: KernelRows | None) -> tuple[str, ...]:
    if kernel_rows is None or kernel_rows.failure is None:
        return ()
    return (f"attention capture: decode kernel {kernel!r} failed on the sampled rows (run as a batch of decode "
            f"queries sharing the sequence's pages, per docs/CONTRACTS.md); torch's rows are kept, the kernel's "
            f"dropped: {kernel_rows.failure}",)


def _summary(rows: list[dict], kernel_table: list[dict], channels: list[dict], heads: int, positions: int,
             kernel_failed: bool) -> dict:
    """Per-turn record values: torch's rows' aggregates, the kernel's, the K (MLA: latent) outlier ratio and
    what was sampled."""
    summary = ae.turn_summary(rows)
    if rows:
        summary["attn_growth_per_1k"] = ae.growth_with_context(rows)
    summary.update(ae.kernel_summary(kernel_table))
    if kernel_failed:
        summary["attn_kernel_failed"] = 1.0
    ratios = [c["outlier_ratio"] for c in channels if c["tensor"] in ("k", "latent")]
    if ratios:
        summary["kv_outlier_ratio_max"] = max(ratios)
    summary["attn_heads_sampled"] = float(heads)
    summary["attn_rows_sampled"] = float(positions)
    return summary


def _kernel_note(kv_path: KVPath, kernel: str | None) -> str | None:
    """Why the kernel's rows are not measured for this path (None: they are): `route.capture_kernel_refusal`."""
    from harness.replay.route import capture_kernel_refusal

    return capture_kernel_refusal(kv_path, kernel)


def _attention_quants(cache) -> dict[int, object]:
    """{layer: AttentionQuant} of the path's attention layers."""
    return {i: layer.attn_quant for i, layer in enumerate(cache.layers) if getattr(layer, "attn_quant", None)}


def _prob_rounding(quants: dict[int, object]):
    from kernels.reference import dequantize, quantize

    def transform(layer: int, probs: torch.Tensor) -> torch.Tensor:
        quant = quants.get(layer)
        if quant is None or quant.prob_scale is None:
            return probs
        return dequantize(quantize(probs, quant.prob_scale, quant.fmt), quant.prob_scale)

    return transform


def _run_chunks(model, device, chunks: list[list[int]], cache, step=None) -> None:
    """step: the paged copies' `StepState` when a kernel's copy is written beside the cache (advanced per chunk)."""
    with forward_context(cache=cache):
        for chunk in chunks:
            attn.chunk_of(step, len(chunk), device)
            # capture needs no next-token logits: keep one row, not [chunk, vocab]
            model(input_ids=torch.tensor([chunk], device=device), **cache_kwargs(model, cache), use_cache=True,
                  logits_to_keep=1)
            if step is not None:
                step.advance()


def compare_rows(ref: dict[int, list[LayerRows]], path: dict[int, list[LayerRows]], top_k: int,
                 kernel_label: str | None = None) -> tuple[list[dict], list[dict]]:
    """Tidy rows (torch's, then the kernel's) of every captured layer call, computed in one batch per row
    shape: a few dozen device ops and one host transfer for the whole turn."""
    groups: dict[tuple, list[tuple[int, LayerRows, LayerRows]]] = {}
    for layer in sorted(path):
        mine, theirs = path[layer], ref.get(layer, [])
        if len(mine) != len(theirs):
            raise RuntimeError(f"layer {layer}: the reference made {len(theirs)} attention calls, the path "
                               f"{len(mine)}; the two passes did not chunk alike")
        for r, p in zip(theirs, mine):
            if r.positions != p.positions or r.logits.shape != p.logits.shape:
                raise RuntimeError(f"layer {layer}: reference and path captured different rows "
                                   f"({r.positions} vs {p.positions}); the two passes did not chunk alike")
            groups.setdefault(tuple(r.logits.shape), []).append((layer, r, p))
    torch_rows: list[dict] = []
    kernel_rows: list[dict] = []
    for (hs, r, length), members in groups.items():
        per_batch = max(1, COMPARE_ELEMENTS // (hs * r * length))
        for start in range(0, len(members), per_batch):
            batch = members[start:start + per_batch]
            torch_part, kernel_part = _compare_batch(batch, hs, r, length, top_k, kernel_label)
            torch_rows += torch_part
            kernel_rows += kernel_part
    return torch_rows, kernel_rows


def _compare_batch(members, hs: int, r: int, length: int, top_k: int,
                   kernel_label: str | None) -> tuple[list[dict], list[dict]]:
    def cat(pick, width):
        return torch.cat([pick(m).reshape(hs * r, width) for m in members])

    lr, lp = cat(lambda m: m[1].logits, length), cat(lambda m: m[2].logits, length)
    pr, pp = cat(lambda m: m[1].probabilities(), length), cat(lambda m: m[2].probabilities(), length)
    o_ref, o_path = cat(lambda m: m[1].out, -1), cat(lambda m: m[2].out, -1)
    valid = lr > -math.inf
    metrics = ae.row_errors(lr, lp, pr, pp, o_ref, o_path, valid, top_k)
    torch_rows = _tidy(members, hs, r, ae.ROW_METRICS, metrics, "torch")
    by_key = ae.dp_by_key_position(pr, pp, valid).cpu().tolist()
    for row, moved in zip(torch_rows, by_key):  # 4 significant digits: a view's series, one list per row
        row["attn_dp_by_key_pos"] = [float(f"{v:.4g}") for v in moved[: _bucket(row["query_pos"]) + 1]]
    measured = [m for m in members if m[2].kernel_out is not None]
    if kernel_label is None or not measured:
        return torch_rows, []
    keep = torch.tensor([i for i, m in enumerate(members) if m[2].kernel_out is not None], device=lr.device)
    rows = (torch.arange(hs * r, device=lr.device) + keep.unsqueeze(1) * (hs * r)).reshape(-1)
    lses = [m[2].kernel_lse for m in measured]
    lse = None if any(x is None for x in lses) else torch.cat([x.reshape(-1) for x in lses])
    kernel = ae.kernel_errors(o_ref.index_select(0, rows), o_path.index_select(0, rows),
                              torch.cat([m[2].kernel_out.reshape(hs * r, -1) for m in measured]),
                              lp.index_select(0, rows), lse)
    return torch_rows, _tidy(measured, hs, r, tuple(kernel), kernel, kernel_label)


def _bucket(position: int) -> int:
    return 0 if position == 0 else position.bit_length()  # floor(log2 p) + 1, as ae.key_buckets


def _tidy(members, hs: int, r: int, names: tuple[str, ...], metrics: dict, label: str) -> list[dict]:
    columns = dict(zip(names, torch.stack([metrics[n] for n in names]).cpu().tolist()))
    out = []
    for block, (layer, ref, _) in enumerate(members):
        for i in range(hs * r):
            at = block * hs * r + i
            out.append({"layer": layer, "head": ref.heads[i // r], "query_pos": ref.positions[i % r],
                        "context": ref.positions[i % r] + 1, "attention": label,
                        **{name: columns[name][at] for name in names}})
    return out


def _is_mla(config) -> bool:
    return model_layers.field(config, "kv_lora_rank") is not None


def channel_rows(cache, kv_path: KVPath | None, scales: LayerScales | None, mla: bool) -> list[dict]:
    """Per-layer, per-tensor channel statistics of what the reference cached, with the path's largest
    representable value per channel (scale x fp8 max) and how many channels exceed it."""
    from transformers.cache_utils import DynamicLayer

    names = ("latent", "k_pe") if mla else ("k", "v")
    found = []
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer or getattr(layer, "keys", None) is None:
            continue
        for name, tensor, side in ((names[0], layer.keys, "k"), (names[1], layer.values, "v")):
            # [1, heads, tokens, dim] -> per channel (head x dim) amax on the device; one transfer for all
            found.append((i, name, side, tensor.shape, tensor[0].abs().amax(dim=1).reshape(-1)))
    if not found:
        return []
    amaxes = torch.cat([f[4] for f in found]).float().cpu().split([f[4].numel() for f in found])
    rows = []
    for (i, name, side, shape, _), amax in zip(found, amaxes):
        stats = ae.amax_stats(amax)
        row = {"layer": i, "tensor": name, "heads": int(shape[1]), **stats}
        limit = _channel_limit(kv_path, scales, i, side, int(shape[1]), int(shape[3]))
        if limit is not None:
            row["fp8_limit"] = limit
            row["clipped_channels"] = sum(a > m for a, m in zip(stats["amax"], limit))
        rows.append(row)
    return rows


def _channel_limit(kv_path, scales, layer, side, heads, dim) -> list[float] | None:
    kv_format = None if kv_path is None else (kv_path.k_format if side == "k" else kv_path.v_format)
    if kv_format is None or not kv_path.has_static_scale or not kv_format.has_static_scale or scales is None:
        return None  # no static scale: block / token scales follow the values, nothing clips a channel up front
    scale = (scales.k if side == "k" else scales.v).get(layer)
    if scale is None:
        return None
    per = scale.float().reshape(-1)
    per = per.expand(heads) if per.numel() == 1 else per
    return (per.repeat_interleave(dim) * kv_format.static_range).tolist()
