"""KV-cache paths inside a transformers model: a cache layer of ours replaces each full-attention layer.

transformers calls `cache.update(key, value, layer_idx)` after RoPE, so the keys we see are post-RoPE, as
engines store them. For MLA models (DeepSeek-V2/V3) the same call carries the compressed latent
(`kv_c_normed`, as "key") and its RoPE part (`k_pe`, as "value"): exactly what an MLA engine caches, so
the same layer quantises the latent. Linear-attention layers of hybrid models keep their own cache
layer and dtype.

Write: codes = fp8(x / s); read: codes * s, cast to the model dtype. Every token is written before it is
read, so a chunk attends to its own quantised K/V, unless the path names a prefill format: then a prefill chunk
(more than one token) attends to its own K/V in that format (`prefill=FORMAT`; raw for `raw_prefill`), and only
earlier tokens come from the cache. A `hadamard` path writes (and the attention function reads) K rotated over
head_dim (harness/kv_paths/rotation.py). `keep_bf16=sliding_window` leaves the model's sliding-window layers'
caches as they are (`sliding_window_layers`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import (DynamicCache, DynamicLayer, DynamicSlidingWindowLayer,
                                      LinearAttentionAndFullAttentionLayer)

from harness.kv_paths import block_layout, capabilities, format_faults
from harness.kv_paths.decode_kernels import kernels_setting
from harness.kv_paths.emulated import EmulatedKVLayer
from harness.kv_paths.formats import E4M3_MAX, MODEL_DTYPE, fp32_scale
from harness.kv_paths.rotation import rotate
from harness import model_layers
from harness.forward_context import on_checks_stream
from harness.model_layers import model_cache
from harness.kv_paths.spec import KVPath
from kernels import cpu_kernels
from kernels import reference as fp8


def cache_kwargs(model, cache) -> dict:
    """`model(..., **cache_kwargs(model, cache))`: the cache under the keyword the model's forward declares.
    transformers renamed `past_key_values` to `cache` (5.2x: the old name is deprecated there, to go in 5.40); 5.17,
    on our GPU machines, has only the old name, and a `cache=` there would fall into `**kwargs` unread: the model
    would run without our cache layers."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


@dataclass(slots=True)
class KVWriteStats:
    """What the cast did to the values written so far, per sequence (row) of a batch: a sequence replayed alone
    is a batch of one row.

    counts [rows, 3] int64 (values, clipped, nonfinite) and amax_over_max [rows] fp32, on the device of the
    writes (no host sync per layer and step), indexed by original row. With a `step` (the batched engine's
    `StepState`), `step.valid` [live rows, chunk] marks real (unpadded) tokens and `live` maps each batch position
    to its original row; without one, every row of a write counts into row 0 (one sequence). On CUDA the fused
    cache write (`kernels.store_kv.quantize_store`) adds into the same buffers (`fused_buffers`); elsewhere
    `count` does with torch ops. A write on another GPU than the buffers' (a layer-sharded model) adds into that
    GPU's own buffers (`away`), folded into these when they are read: no write adds across GPUs, so every GPU takes
    the fused write and a layer-sharded decode step records as one CUDA graph per GPU (replay/segments.py)."""

    rows: int = 1
    step: object = None  # harness.kv_paths.attention.StepState, or None: one sequence
    device: object = None  # where the counts live; None: the device of the first write
    counts: torch.Tensor | None = None  # [rows, 3] int64: values, clipped (|x / s| > fp8 max), nonfinite read back
    amax_over_max: torch.Tensor | None = None  # [rows] fp32: largest |x / s| / fp8 max; > 1: the scale is too small
    live: torch.Tensor | None = None  # [live rows] int64: the original row of each batch position (with a step)
    # the write check: [rows, 4] float64, per side (K, V) the squared error of what the cache read back and of the
    # format's own definition (`KVFormat.round_trip`) on the same values, summed over the checked (prefill) writes
    write_err: torch.Tensor | None = None
    away: dict = field(default_factory=dict)  # device -> (counts, amax_over_max) of writes on another GPU

    def __post_init__(self):
        if self.device is not None:
            self._buffers(self.device)

    def _buffers(self, device) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.rows, 3, dtype=torch.int64, device=device)
            self.amax_over_max = torch.zeros(self.rows, dtype=torch.float32, device=device)
            self.live = torch.arange(self.rows, device=device)
        if self.write_err is None:
            self.write_err = torch.zeros(self.rows, 4, dtype=torch.float64, device=device)

    def _rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """The original row each batch position of x counts into."""
        if self.step is None:
            return torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
        return self.live

    def _on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, amax_over_max) a write on `device` adds into."""
        self._buffers(device)
        if self.counts.device == device:
            return self.counts, self.amax_over_max
        if device not in self.away:
            self.away[device] = (torch.zeros_like(self.counts, device=device),
                                 torch.zeros_like(self.amax_over_max, device=device))
        return self.away[device]

    def _fold(self) -> None:
        """Add the other GPUs' counts into the home buffers (integer sums and maxima: the same numbers in any order)."""
        for counts, amax in self.away.values():
            self.counts += counts.to(self.counts.device)
            torch.maximum(self.amax_over_max, amax.to(self.amax_over_max.device), out=self.amax_over_max)
        self.away.clear()

    def fused_buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(counts, amax, live, valid) for `quantize_store`, on x's device."""
        counts, amax = self._on(x.device)
        valid = None if self.step is None else self.step.valid.to(x.device)
        return counts, amax, self._rows_of(x).to(x.device), valid

    def count(self, x: torch.Tensor, ratio: torch.Tensor, read_back: torch.Tensor) -> None:
        """x, ratio (|x / s| / fp8 max), read_back: [batch, heads, chunk, dim]; pads count nowhere. A step's masks are
        built once per forward pass (`StepState.row_masks`), not per layer and tensor."""
        if x.numel() == 0:
            return
        clipped, nonfinite = ratio > 1, ~read_back.isfinite()
        finite = torch.nan_to_num(ratio.float(), nan=0.0, posinf=0.0)
        if self.step is None:
            tokens = torch.full((x.shape[0],), x.shape[2], dtype=torch.int64, device=x.device)
        else:
            valid, tokens = self.step.row_masks(x.device)
            clipped, nonfinite = clipped & valid, nonfinite & valid
            finite = torch.where(valid, finite, 0.0)
        added = torch.stack([tokens * (x.shape[1] * x.shape[3]), clipped.sum((1, 2, 3)), nonfinite.sum((1, 2, 3))],
                            dim=1)
        counts, amax = self._on(x.device)
        rows = self._rows_of(x).to(x.device)
        counts.index_add_(0, rows, added)
        # the running max of each row, in one op (same values as max(old, new); a max has no reduction order)
        amax.scatter_reduce_(0, rows, finite.amax((1, 2, 3)), "amax")

    def add_counted(self, values: int, clipped: int, nonfinite: int, amax: float, device) -> None:
        """`count`'s effect for one sequence's write whose numbers were counted elsewhere (the CPU round trip in C:
        integer counts and a max, so the same numbers in any order)."""
        self._buffers(device)
        self.counts[0] += torch.tensor((values, clipped, nonfinite), dtype=torch.int64)
        if amax > self.amax_over_max[0]:
            self.amax_over_max[0] = amax

    def check_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the statistics row of each batch position, [rows, chunk] uint8 real tokens or None) of a write of x,
        made on the model's stream (`check_write` may run on the checks stream: `forward_context.on_checks_stream`)."""
        self._buffers(x.device)
        valid = self.step.row_masks(x.device)[0] if self.step is not None else None
        valid = None if valid is None else valid[:, 0, :, 0].view(torch.uint8)  # [rows, chunk]
        return self._rows_of(x).to(self.write_err.device), valid

    def check_write(self, side: str, x: torch.Tensor, read_back: torch.Tensor, reference: torch.Tensor | None,
                    reference_scale: torch.Tensor | None = None, rows_valid: tuple | None = None,
                    reference_format: tuple[str, bool] | None = None) -> None:
        """The write check of one side ("k" / "v"): x, what the cache read back and what the format's definition
        reads back for x, [batch, heads, chunk, dim]; pads count nowhere. With reference_scale (the fused sums
        only): `reference` is the definition's FP8 codes, read back as `reference.dequantize` does, in the sums;
        or, reference None and reference_format (element, saturate), the sums write x by the definition themselves.
        rows_valid: `check_rows(x)`, where made beforehand."""
        if x.numel() == 0:
            return
        rows, valid = rows_valid if rows_valid is not None else self.check_rows(x)
        if fused_write_on(x):  # the same sums in one Triton pass over the three tensors
            from kernels.write_check import square_error_sums

            fmt, saturate = reference_format or (None, True)
            sums = square_error_sums(x, read_back, reference, valid, reference_scale, b_format=fmt, saturate=saturate)
        else:  # NaN squares are nonfinite's, counted there
            assert reference_scale is None, "codes as the reference go to the fused sums only (fused_write_on)"
            sums = fp8.square_error_sums(x, read_back, reference, valid)
        column = 0 if side == "k" else 2
        self.write_err[:, column:column + 2].index_add_(0, rows, sums.to(self.write_err.device))

    @classmethod
    def stacked(cls, parts: list["KVWriteStats"], step, device) -> "KVWriteStats":
        """The statistics of a batch whose rows are one-sequence writes so far (`stack_rows`), counting on per row."""
        stats = cls(len(parts), step, device)
        for row, part in enumerate(parts):
            if part.counts is not None:
                part._fold()  # noqa: SLF001 - a part of the same class
                stats.counts[row] = part.counts[0]
                stats.amax_over_max[row] = part.amax_over_max[0]
                stats.write_err[row] = part.write_err[0].to(stats.write_err.device)
        return stats

    def select(self, live: torch.Tensor) -> None:
        """Keep batch positions `live` (indices into the current live rows)."""
        if self.live is not None:
            self.live = self.live[live]

    def row_records(self) -> list[dict[str, float]]:
        if self.counts is None:
            return [{"kv_clipped_frac": 0.0, "kv_nonfinite": 0.0, "kv_amax_over_max": 0.0} for _ in range(self.rows)]
        self._fold()
        counts, amax = self.counts.tolist(), self.amax_over_max.tolist()
        records = [{"kv_clipped_frac": c / v if v else 0.0, "kv_nonfinite": float(n), "kv_amax_over_max": a}
                   for (v, c, n), a in zip(counts, amax)]
        for record, errors in zip(records, self.write_err.tolist()):
            ratio = write_err_ratio(errors)
            if ratio is not None:
                record["kv_write_err_ratio"] = ratio
        return records

    def as_record(self) -> dict[str, float]:
        """The one sequence's record (a batch of one row)."""
        assert self.rows == 1, f"as_record is one sequence's; this batch has {self.rows} rows (row_records)"
        return self.row_records()[0]


def write_err_ratio(errors: list[float]) -> float | None:
    """The write check's number from [K path, K format, V path, V format] squared errors: the larger over K and V
    of the RMS error of what the cache read back over the RMS error the format's own definition makes on the same
    values (1: the write is the format's; None: no write checked). A side whose format is exact on these values
    (error 0) and whose cache is not reads inf."""
    ratios = []
    for path, own in ((errors[0], errors[1]), (errors[2], errors[3])):
        if own > 0:
            ratios.append((path / own) ** 0.5)
        elif path > 0:
            ratios.append(float("inf"))
    return max(ratios) if ratios else None


def fused_write_on(x: torch.Tensor) -> bool:
    """Whether a cache write of x runs the fused Triton round trip (CUDA, kernels not switched off or to the
    torch reference by HARNESS_KERNELS); otherwise the torch ops below, the CPU truth it is tested against."""
    return x.is_cuda and kernels_setting() == "auto"


@dataclass(frozen=True, slots=True)
class LayerScales:
    """Per-layer k/v scales: a 0-d tensor (per tensor) or shape [heads] (per head)."""

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    source: str
    provenance: str = ""
    # FP8 attention paths: per-layer 0-d q_scale / prob_scale (empty when the path does not quantise them)
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    prob: dict[int, torch.Tensor] = field(default_factory=dict)
    # fault=dummy_block_scales: per-layer [2, heads, head_dim] fp32, each channel's (min, max) over a dummy pass
    k_dummy_range: dict[int, torch.Tensor] = field(default_factory=dict)
    v_dummy_range: dict[int, torch.Tensor] = field(default_factory=dict)

    def summary(self) -> dict:
        def stats(scales: dict[int, torch.Tensor]) -> dict:
            flat = torch.cat([s.reshape(-1).float().cpu() for s in scales.values()]) if scales else torch.zeros(0)
            if flat.numel() == 0:
                return {}
            return {"min": flat.min().item(), "max": flat.max().item(), "mean": flat.mean().item()}

        def per_layer(scales: dict[int, torch.Tensor]) -> list[float]:  # largest scale of each layer
            return [float(scales[layer].float().max()) for layer in sorted(scales)]

        return {"source": self.source, "provenance": self.provenance, "k_scale": stats(self.k),
                "v_scale": stats(self.v), "layers": sorted(self.k), "k_scale_per_layer": per_layer(self.k),
                "v_scale_per_layer": per_layer(self.v),
                **({"q_scale": stats(self.q)} if self.q else {}), **({"prob_scale": stats(self.prob)} if self.prob else {})}


def latent_row_formats(kv_path: KVPath) -> tuple:
    """The formats an MLA cache row takes: (the latent's, its RoPE part k_pe's; None: k_pe stays bf16). transformers
    writes the row as `cache.update(latent, k_pe)`, so the latent comes as "K" and k_pe as "V".

    FP8 under a static scale stores both, with one scale, as vLLM's fp8 MLA cache (`concat_and_cache_mla`) does. A
    format with block scales stores the latent and leaves k_pe in bf16, as every engine that ships such a cache for
    MLA keeps it: vLLM's fp8_ds_mla / nvfp4_ds_mla (vLLM refuses plain nvfp4 on an MLA model), SGLang's and
    TensorRT-LLM's DeepSeek FP8 / FP4 caches. Measured (BENCHMARKS.md, session 17): k_pe in NVFP4 on the MLA canary
    is 500x the KL of the latent in NVFP4. K and V in different formats: the row takes K's (an MLA cache holds no V:
    the latent is read as K and as V; vLLM's fp8_k_nvfp4_v excludes MLA). A DeepSeek layout (`pairs_with`) names its
    k_pe format itself; where that is the model dtype (fp8_ds_mla's bf16 k_pe) it is stored as given (None)."""
    latent = kv_path.k_format
    if latent.pairs_with:  # a DeepSeek layout declares its RoPE part's format itself (fp8_ds_mla, nvfp4_ds_mla)
        return latent, (None if kv_path.v_format.element is MODEL_DTYPE else kv_path.v_format)   # bf16: as given
    return latent, (latent if latent.is_legacy_fp8 else None)


def latent_row_note(kv_path: KVPath | None) -> str:
    """How an MLA model's cache row stores this path's formats, for the route ("" for bf16 and plain FP8 rows)."""
    if kv_path is None or not kv_path.is_quantized or kv_path.emulated:
        return ""
    latent, rope = latent_row_formats(kv_path)
    if rope is not None and kv_path.k_format is kv_path.v_format:
        return ""
    parts = [f"MLA: the latent in {latent.spec_name}, its RoPE part (k_pe) in "
             f"{'bf16 (as engines keep it beside a block-scaled latent)' if rope is None else rope.spec_name}"]
    if kv_path.k_format is not kv_path.v_format:
        parts.append(f"V's format {kv_path.v_format.spec_name} unused (an MLA cache holds no V)")
    return "; ".join(parts)


# The fused block-scaled write takes heads of up to 256 values (kernels/store_kv_block_scaled.py)
FUSED_WRITE_HEAD_MAX = 256


def latent_split(kv_format, dim: int) -> int:
    """How many heads of the fused write an MLA latent of `dim` values is written as: one where it fits a head;
    `dim` / 256 for block scales under a per-tensor scale (NVFP4, MX: blocks of 16 or 32; fp8_ds_mla: fp32 scales
    per 128; no block straddles two heads, so the bytes and the statistics are the latent's own); 1 (and the torch
    round trip) for a scale per token-head."""
    if kv_format is None or dim <= FUSED_WRITE_HEAD_MAX or dim % FUSED_WRITE_HEAD_MAX:
        return 1
    per_block = kv_format.block_scale in ("e4m3", "e8m0") or (kv_format.block_scale == "fp32" and kv_format.block_size)
    return dim // FUSED_WRITE_HEAD_MAX if per_block else 1


class QuantizedKVLayer(DynamicLayer):
    """A `DynamicLayer` that stores a KV format (write = encode, read = decode) per a `KVPath`: K in the path's
    `k_format`, V in its `v_format` (harness/kv_paths/formats.py); on an MLA model (`mla`) the latent row as
    `latent_row_formats` says. A write runs the fused Triton kernel (CUDA) or the C call (CPU) where `capabilities`
    says they serve the path's formats, else the formats' torch round trip."""

    def __init__(self, kv_path: KVPath, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 stats: KVWriteStats, mla: bool = False):
        super().__init__()
        self.kv_path = kv_path
        self.k_scale, self.v_scale = k_scale, v_scale
        self.stats = stats
        self.mla = mla
        self.paged = None  # harness.kv_paths.attention.PagedKV when decode runs through a kernel (attach_paged)
        self.attn_quant = None  # AttentionQuant when the path quantises the attention computation
        self.static = None  # StaticColumns: preallocated storage written in place (`make_static`)
        self._c_scales: dict = {}  # id(scale) -> (scale, float32 scales for the CPU write in C, or None)
        # K's and V's formats (MLA: the latent's and k_pe's; None: stored as given, bf16)
        self.k_format, self.v_format = (latent_row_formats(kv_path) if mla and kv_path.is_quantized
                                        else (kv_path.k_format, kv_path.v_format))
        self.fused_serves = kv_path.is_quantized and capabilities.FUSED_WRITE.refusal(kv_path) is None
        # block-scaled formats' fused write (kernels/store_kv_block_scaled.py), where it serves both formats and
        # this layer's head size (decided at the first write: `_block_layouts`)
        self.fused_block_serves = (kv_path.is_quantized and
                                   capabilities.FUSED_WRITE_BLOCK_SCALED.refusal(kv_path, "mla" if mla else None)
                                   is None)
        self._layouts = None
        self._splits = (1, 1)  # heads of the fused write each side is cut into (an MLA latent wider than its heads)
        self.c_serves = kv_path.is_quantized and capabilities.CPU_C_WRITE.refusal(kv_path) is None
        # a cache-format fault injector (kv_paths/format_faults.py) and the sides it reaches; "" none
        self.format_fault = kv_path.fault if kv_path.fault in format_faults.FORMAT_FAULTS else ""
        self.faulty_sides = (format_faults.sides(self.format_fault, self.k_format, self.v_format or self.k_format)
                             if self.format_fault else ())
        if self.v_format is None:
            self.faulty_sides = tuple(side for side in self.faulty_sides if side == "k")
        self.dummy_ranges: dict[str, torch.Tensor] = {}  # fault=dummy_block_scales: "k" / "v" -> [2, heads, D]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [batch, kv_heads, chunk, head_dim] (MLA: [batch, 1, chunk, latent])
        if self.kv_path.hadamard:  # K stored rotated; the attention function rotates Q (rotation.py)
            key_states = rotate(key_states).to(key_states.dtype)
        chunk = key_states.shape[-2]
        if not self.kv_path.is_quantized:  # scales may be present; a BF16 cache must ignore them (class 3)
            keys, values = self._store(key_states, value_states)
        else:
            if self.fused_serves and fused_write_on(key_states):
                read_back = self._fused_round_trip(key_states, value_states)
                if chunk == 1 and self.static is not None:  # the read-back went straight into static storage
                    return read_back
            elif (self.fused_block_serves and fused_write_on(key_states)
                  and self._block_layouts(key_states.shape[-1], value_states.shape[-1]) is not None):
                read_back = self._fused_block_round_trip(key_states, value_states)
                if chunk == 1 and self.static is not None:  # the read-back went straight into static storage
                    return read_back
            else:
                read_back = (self._round_trip(key_states, self.k_scale, self.k_format, "k"),
                             self._round_trip(value_states, self.v_scale, self.v_format, "v"))
                if self.paged is not None:  # the kernel's own paged FP8 copy, written by its store kernel
                    self.paged.write(key_states, value_states)
            if chunk > 1:  # the write check on prefill writes (a decode step's one token: no cost in the loop)
                self._check_write(key_states, value_states, *read_back)
            keys, values = self._store(*read_back)
        if self.kv_path.quantize_current_chunk or chunk == 1:
            return keys, values
        own_keys, own_values = self._prefill_view(key_states, value_states)
        if self.static is not None:  # the chunk sits at this pass's columns, not at the end
            return self.static.with_raw(keys, own_keys), self.static.with_raw(values, own_values)
        return (torch.cat([keys[..., :-chunk, :], own_keys], dim=-2),
                torch.cat([values[..., :-chunk, :], own_values], dim=-2))

    def _check_write(self, key_states: torch.Tensor, value_states: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor) -> None:
        """The write check: what the cache read back against the format's own definition (`KVFormat.round_trip`,
        torch) on the same values and scales. Whatever wrote the cache (the torch ops, the C or Triton round trip, a
        format fault) is held to the format declared in one place; a scale layout or scale delivery bug shows here
        even where the model's outputs barely move."""
        for side, x, read, scale, kv_format in (("k", key_states, keys, self.k_scale, self.k_format),
                                                ("v", value_states, values, self.v_scale, self.v_format)):
            if kv_format is None or x.numel() == 0:
                continue
            rows_valid = self.stats.check_rows(x)
            # beside the model's stream in a prefill (`checks_beside`): nothing the model reads comes from here
            with on_checks_stream(x, read, *(t for t in rows_valid if t is not None)):
                # x written by the format's definition with the scale the cache uses (its clip ratios, which the
                # check does not read, not computed)
                write_scale = self._write_scale(x, scale, kv_format)
                if kv_format.is_legacy_fp8 and not kv_format.unscaled and fused_write_on(x):
                    # the sums write x by the definition themselves (`kernels.write_check.fp8_value`): no codes
                    self.stats.check_write(side, x, read, None, fp32_scale(write_scale, x.device),
                                           rows_valid=rows_valid, reference_format=(kv_format.element.name,
                                                                                    self.kv_path.saturate))
                    continue
                encoded = kv_format.encode(x, write_scale, saturate=self.kv_path.saturate)
                if kv_format.is_legacy_fp8 and fused_write_on(x):  # the sums read the codes back (no widened copy)
                    self.stats.check_write(side, x, read, encoded.codes, encoded.scale, rows_valid=rows_valid)
                else:
                    self.stats.check_write(side, x, read, kv_format.decode(encoded, x.dtype), rows_valid=rows_valid)

    def _write_scale(self, x: torch.Tensor, static_scale: torch.Tensor | None, kv_format) -> torch.Tensor | None:
        """The scale a write of x divides by: per token (legacy FP8 `per_token`, [batch, heads, chunk, 1]), the
        layer's static scale ([] or per head [heads, 1, 1]), or None where every scale is computed at write (block /
        per token-head formats)."""
        if self.kv_path.granularity == "per_token":
            return fp8.per_token_scale(x, kv_format.name)
        if kv_format.has_static_scale:
            scale = static_scale.to(x.device)
            return scale.view(-1, 1, 1) if scale.dim() == 1 else scale
        return None

    def _prefill_view(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a prefill chunk attends to its own K/V as: raw (`raw_prefill`), or written in the path's prefill
        format and read back (`prefill=FORMAT`; not counted in the write statistics, which are the cache's)."""
        prefill = self.kv_path.prefill_format
        if prefill is None:
            return key_states, value_states
        return (self._prefill_round_trip(key_states, self.k_scale, self.k_format, prefill),
                self._prefill_round_trip(value_states, self.v_scale, self.v_format, prefill))

    def _prefill_round_trip(self, x: torch.Tensor, static_scale: torch.Tensor | None, cache_format,
                            prefill) -> torch.Tensor:
        if self.kv_path.granularity == "per_token" and prefill.is_legacy_fp8:
            scale = fp8.per_token_scale(x, prefill.name)
        elif prefill.has_static_scale and self.kv_path.scale_source != "default":  # default: 1.0, as engines
            scale = prefill_static_scale(static_scale, cache_format, prefill, x.device)
        else:
            scale = None
        return prefill.round_trip(x, scale, saturate=self.kv_path.saturate or prefill.saturating_only)[0]

    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.static is not None:
            return self.static.write(self, keys, values)
        return DynamicLayer.update(self, keys, values)

    def get_seq_length(self) -> int:
        return self.static.length if self.static is not None else super().get_seq_length()

    def _fused_round_trip(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The round trip, the write statistics and (when the paged copy takes fused writes) the paged store, of both
        tensors in one Triton launch (two where K and V differ in format, shape or kind of scale: an MLA row, mixed
        K/V); the statistics stay on the device. A decode step's one token on static storage has its read-back
        written straight into the storage's column (no copy after it): the storage's K and V are returned."""
        from kernels.store_kv import pair_refusal, quantize_store, quantize_store_pair

        counts, amax, live, valid = self.stats.fused_buffers(key_states)
        per_token = self.kv_path.granularity == "per_token"
        targets = self.paged.store_targets(key_states, value_states) if self.paged is not None else None
        scales = [None if per_token else self._device_scale(name, x.device)
                  for x, name in ((key_states, "k_scale"), (value_states, "v_scale"))]
        outs, columns = (None, None), None
        if key_states.shape[-2] == 1 and self.static is not None:
            outs, columns = self.static.buffers(self, key_states, value_states), \
                self.static.columns_on(key_states.device)
        shared = dict(saturate=self.kv_path.saturate, out_columns=columns, counts=counts, amax=amax, live=live,
                      valid=valid)
        k_target, v_target = targets if targets is not None else ({}, {})
        if self.k_format.name == self.v_format.name and pair_refusal(
                key_states, value_states, *scales, k_target.get("cache"), v_target.get("cache")) is None \
                and k_target.get("col_offset", 0) == v_target.get("col_offset", 0) == 0:
            paged = {}
            if targets is not None:
                paged = dict(k_cache=k_target["cache"], v_cache=v_target["cache"], slots=k_target["slots"],
                             cache_strides=k_target["cache_strides"], block_size=k_target["block_size"])
            read_back = quantize_store_pair(key_states, value_states, *scales, self.k_format.name, k_out=outs[0],
                                            v_out=outs[1], **paged, **shared)
        else:
            read_back = tuple(quantize_store(x, scale, kv_format.name, out=out, **target, **shared)
                              for x, scale, kv_format, out, target in zip(
                                  (key_states, value_states), scales, (self.k_format, self.v_format), outs,
                                  (k_target, v_target)))
        if self.paged is not None and targets is None:
            self.paged.write(key_states, value_states)
        return read_back[0], read_back[1]

    def _block_layouts(self, k_dim: int, v_dim: int):
        """(K's, V's) block-scaled layouts where the fused write serves both sizes (MLA: the latent's and k_pe's;
        a side whose format is None, an MLA row's bf16 k_pe, is stored as given and has no layout), else None
        (decided once)."""
        if self._layouts is None:
            formats = (self.k_format, self.v_format)
            self._splits = tuple(latent_split(f, dim) if self.mla else 1 for f, dim in zip(formats, (k_dim, v_dim)))
            served = all(f is None or block_layout.refusal(f, dim // split, write=True, mla=self.mla) is None
                         for f, dim, split in zip(formats, (k_dim, v_dim), self._splits))
            self._layouts = (tuple(None if f is None else block_layout.of(f, self.mla) for f in formats) if served
                             else ())
        return self._layouts or None

    def _fused_block_round_trip(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """`_fused_round_trip` for block-scaled formats: block scales, codes, read-back, statistics and (when the
        paged copy takes fused writes) the paged store in one launch per tensor."""
        from kernels.store_kv_block_scaled import quantize_store_block_scaled

        counts, amax, live, valid = self.stats.fused_buffers(key_states)
        # the paged copy's targets (an MLA row: the latent's; its bf16 k_pe is stored beside it as given)
        targets = self.paged.store_targets(key_states, value_states) if self.paged is not None else None
        outs, columns = (None, None), None
        if key_states.shape[-2] == 1 and self.static is not None:  # a decode step: read-back into static storage
            outs, columns = self.static.buffers(self, key_states, value_states), \
                self.static.columns_on(key_states.device)
        read_back = []
        sides = zip((key_states, value_states), ("k_scale", "v_scale"), self._layouts, self._splits, outs)
        for i, (x, name, layout, split, out) in enumerate(sides):
            if layout is None:  # an MLA row's bf16 k_pe: stored as given
                read_back.append(x if out is None else out.index_copy_(2, columns, x))
                continue
            scale = self._device_scale(name, x.device) if layout.static else None
            target = targets[i] if targets is not None else {}
            write = dict(counts=counts, amax=amax, live=live, valid=valid, out_columns=columns, **layout.write_args)
            if split > 1:  # [rows, 1, chunk, D] as `split` heads of D / split: the same bytes in the same order
                rows, _, chunk, dim = x.shape
                heads = x[:, 0].reshape(rows, chunk, split, dim // split).transpose(1, 2)
                target = {key: value.view(*value.shape[:2], split, -1) if key in ("codes", "block_scales") else value
                          for key, value in target.items()}
                if out is None:
                    read = quantize_store_block_scaled(heads, scale, **write, **target)
                    read_back.append(read.transpose(1, 2).reshape(rows, 1, chunk, dim))
                else:  # the storage's [rows, 1, columns, D] seen as [rows, split, columns, D / split]
                    quantize_store_block_scaled(heads, scale, **write, **target, out=out[:, 0].unflatten(
                        -1, (split, dim // split)).transpose(1, 2))
                    read_back.append(out)
                continue
            read_back.append(quantize_store_block_scaled(x, scale, out=out, **write, **target))
        if self.paged is not None and targets is None:
            self.paged.write(key_states, value_states)
        elif targets is not None and targets[1] is None:
            self.paged.store_pe(value_states)
        return read_back[0], read_back[1]

    def _device_scale(self, name: str, device: torch.device) -> torch.Tensor:
        """This layer's static scale on `device` (copied once, then kept: no host-to-device copy per step)."""
        scale = getattr(self, name)
        if scale.device != device or scale.dtype != torch.float32 or not scale.is_contiguous():
            scale = scale.to(device=device, dtype=torch.float32).contiguous()
            setattr(self, name, scale)
        return scale

    def _round_trip(self, x: torch.Tensor, static_scale: torch.Tensor | None, kv_format, side: str = "k") -> torch.Tensor:
        """x (the path's `side`, "k" or "v") written in `kv_format` and read back in x's dtype, its write statistics
        counted; `kv_format` None: x as given (an MLA row's bf16 RoPE part)."""
        if kv_format is None:
            return x
        per_token = self.kv_path.granularity == "per_token"
        if (self.c_serves and self.stats.step is None and static_scale is not None and x.is_cpu
                and x.dtype is torch.bfloat16 and not per_token):
            scales = self._c_round_trip_scales(static_scale, x.shape[1], kv_format.name)
            if scales is not None:
                read_back, clipped, nonfinite, amax = cpu_kernels.kv_round_trip(x, scales, kv_format.name,
                                                                                self.kv_path.saturate)
                if x.numel():
                    self.stats.add_counted(x.numel(), clipped, nonfinite, amax, x.device)
                return read_back
        scale = self._write_scale(x, static_scale, kv_format)
        if side in self.faulty_sides:
            read_back, ratio = format_faults.round_trip(self.format_fault, side, kv_format, x, scale,
                                                        self.kv_path.saturate, self.dummy_ranges.get(side))
        else:
            read_back, ratio = kv_format.round_trip(x, scale, saturate=self.kv_path.saturate)
        self.stats.count(x, ratio, read_back)
        return read_back

    def _c_round_trip_scales(self, static_scale: torch.Tensor, heads: int, fmt: str) -> torch.Tensor | None:
        """The float32 [1] or [heads] scales for the one-sequence CPU write in C, or None where it does not apply or
        its probe refused these scales (`cpu_round_trip_exact`); decided once per scale tensor (a layer's scales
        are set, never changed in place; an inference tensor has no version counter to tell)."""
        found = self._c_scales.get(id(static_scale))
        if found is None or found[0] is not static_scale:
            scales = static_scale.detach().reshape(-1).float().contiguous()  # [] -> [1]; per head: [heads]
            usable = static_scale.is_cpu and scales.numel() in (1, heads)
            exact = usable and cpu_round_trip_exact(scales, fmt, self.kv_path.saturate)
            found = self._c_scales[id(static_scale)] = (static_scale, scales if exact else None)
        scales = found[1]
        return scales if scales is not None and scales.numel() in (1, heads) else None


def prefill_static_scale(cache_scale: torch.Tensor | None, cache_format, prefill, device) -> torch.Tensor | None:
    """The prefill format's static scale from the layer's, where the path's scale source measured one (calibrated,
    checkpoint, warm-up; the default source gives every format 1.0, as engines do): the amax the cache scale stands
    for (scale x the cache format's static range; e4m3's 448 where the cache format has none, as
    `scales_from_observers` gives such sides) over the prefill format's range. None: 1.0."""
    if cache_scale is None:
        return None
    static_range = cache_format.static_range if cache_format is not None and cache_format.has_static_scale else E4M3_MAX
    scale = prefill.scale_of_amax(cache_scale.to(device).float() * static_range)
    return scale.view(-1, 1, 1) if scale.dim() == 1 else scale


# -- the CPU write in one C call (kernels/cpu_kv_round_trip.c), where its bits are the torch ops' ----------------

_EXACT_ROUND_TRIPS: dict[tuple, bool] = {}  # (fmt, saturate, scale bits): the C call gave the torch ops' bits


def cpu_round_trip_exact(scales: torch.Tensor, fmt: str, saturate: bool) -> bool:
    """Whether `kernels.cpu_kernels.kv_round_trip` gives what `_round_trip` and `KVWriteStats.count` compute with
    torch ops, for these scales: checked once per scale on every bf16 input (65,536 per head: read-back bits,
    |x / s| / max bits, clipped and nonfinite counts, the max), so the one-sequence CPU write takes the C call
    only where it is that scale's arithmetic bit for bit. ~25 tensor ops a write become one call; a machine
    without the library (no compiler, not x86-64 AVX2) keeps the torch ops."""
    key = (fmt, saturate, scales.float().numpy().tobytes())
    exact = _EXACT_ROUND_TRIPS.get(key)
    if exact is None:
        exact = _EXACT_ROUND_TRIPS[key] = _round_trip_agrees(scales.float().contiguous(), fmt, saturate)
    return exact


def _round_trip_agrees(scales: torch.Tensor, fmt: str, saturate: bool) -> bool:
    if isinstance(cpu_kernels.library(), str):
        return False
    heads = scales.numel()
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = every.expand(1, heads, 1, -1).contiguous()
    ratios = torch.empty(x.shape, dtype=torch.float32)
    got, clipped, nonfinite, amax = cpu_kernels.kv_round_trip(x, scales, fmt, saturate, ratios)
    scale = scales.view(-1, 1, 1) if heads > 1 else scales.view(())
    want = fp8.dequantize(fp8.quantize(x, scale, fmt, saturate=saturate), scale, out_dtype=x.dtype)
    ratio = (x.float() / scale).abs() / fp8.FP8_MAX[fmt]  # as `_count` and `KVWriteStats.count` compute it
    return (torch.equal(got.view(torch.int16), want.view(torch.int16))
            and torch.equal(ratios.view(torch.int32), ratio.view(torch.int32))
            and clipped == int((ratio > 1).sum()) and nonfinite == int((~want.isfinite()).sum())
            and amax == float(torch.nan_to_num(ratio, nan=0.0, posinf=0.0).amax()))


def holds_kv(layer) -> bool:
    """A cache layer a KV path stores FP8: transformers' full-attention `DynamicLayer`, and the layer kinds built
    on it (sliding-window / chunked attention; Falcon-H1's attention + SSM-state layer)."""
    return isinstance(layer, DynamicLayer) and not isinstance(layer, (QuantizedKVLayer, AmaxObserverLayer,
                                                                        StaticKVLayer, EmulatedKVLayer))


def _of_kind(mixin: type, layer: DynamicLayer, *args):
    """`mixin(*args)` for a plain `DynamicLayer`; for another kind of a fresh `layer` (no tokens yet), an instance of
    `mixin` over that kind with both one's fields: a sliding-window layer keeps its window as transformers keeps it
    (the last window - 1 tokens), a combined layer its SSM state, while `mixin` sees every K/V write."""
    made = mixin(*args)
    kind = type(layer)
    if kind is DynamicLayer:
        return made
    name = f"{mixin.__name__}Over{kind.__name__}"
    if name not in _KINDS:
        # `_layer_type = None`: a kind defined in a modelling file registers itself in transformers' global
        # layer-type mapping by its `_layer_type` when subclassed (`CacheLayerMixin.__init_subclass__`); ours
        # inherited it and replaced the family's own class there for every model of the process
        _KINDS[name] = type(name, (mixin, kind), {"_store": _kind_store(kind), "_layer_type": None})
    made_kind = _KINDS[name]
    over = made_kind.__new__(made_kind)
    over.__dict__.update({**made.__dict__, **layer.__dict__})  # the kind's own fields over DynamicLayer's
    return over


def _kind_store(kind: type):
    def _store(self, keys: torch.Tensor, values: torch.Tensor):  # the layer kind's own update: its window, ...
        if self.static is not None:  # a window on static storage keeps every token; the mask windows it
            return self.static.write(self, keys, values)
        return kind.update(self, keys, values)
    return _store


_KINDS: dict[str, type] = {}


class StaticStorageMismatch(ValueError):
    """A cache write static storage cannot hold (`StaticColumns.write`)."""


class StaticColumns:
    """Preallocated cache storage for a batch of left-padded rows, written in place: every row writes the same
    columns in a forward pass (`columns`, a device tensor the caller sets before each pass), and attention
    reads all `max_len` columns under a mask that hides the unwritten ones. Shapes and addresses never
    change, so a decode step can be captured in a CUDA graph and replayed (harness/replay/batched.py).

    `length` is the host's count of written columns, for `get_seq_length` (transformers asks for it only
    when position ids are not given; batched replay always gives them).

    `attended` (set by the engine for an eager prefill pass, None otherwise): the pass attends to columns
    [0, attended) only, its own last column's end, so its layers hand attention views of those columns, and the
    attention function cuts the mask (built over every column) to the keys it is given; a layer that read another
    layer's storage as it is would get every column and the whole mask, as before. The columns after the pass are
    masked for every query of it: torch's memory-efficient SDPA, which an explicit mask sends prefill to, computes
    every key it is given, so a 16 x 8k prompt in four passes of 2,048 columns scored 4 x 8,208 keys a query row
    where 2,048-8,192 are read (the 8B-shaped prefill: 8.30 s before, 6.48 s after, H200, BENCHMARKS.md session 43).
    The engine sets it on CUDA only (`batched.ATTENDED_PREFIX_DEVICES`): the CPU's exact-bits layers
    (harness/replay/cpu_exact.py) key on the call shapes."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.columns: torch.Tensor | None = None  # [chunk] int64 on the cache's device
        self.length = 0
        self.attended: int | None = None

    def write(self, layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values [batch, heads, chunk, dim] into the layer's [batch, heads, max_len, dim] buffers. A layer that
        writes another number of tokens than the pass has columns (a looped model's per-loop writes: Dory) raises
        StaticStorageMismatch: the batch then decodes with the growing cache."""
        keys_at, values_at = self.buffers(layer, keys, values)
        columns = self.columns_on(keys.device)
        keys_at.index_copy_(2, columns, keys)
        values_at.index_copy_(2, columns, values)
        return self.attended_view(keys_at), self.attended_view(values_at)

    def attended_view(self, stored: torch.Tensor) -> torch.Tensor:
        """A layer's [batch, heads, max_len, dim] storage as this pass attends to it: all of it, or a prefill
        pass's columns [0, attended) (a view)."""
        return stored if self.attended is None else stored[:, :, :self.attended]

    def columns_on(self, device: torch.device) -> torch.Tensor:
        """This pass's columns on `device`: a layer-sharded model's layers on other GPUs than the batch's write there
        (a segmented graph reads them from a mirror: harness/replay/segments.py)."""
        return self.columns if self.columns.device == device else self.columns.to(device)

    def buffers(self, layer: DynamicLayer, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's [batch, heads, max_len, dim] K and V buffers (made at its first write, zeros), for a write of
        keys/values at this pass's columns; raises StaticStorageMismatch as `write` does. A fused cache write puts
        its read-back there itself (`QuantizedKVLayer._fused_round_trip`)."""
        if keys.shape[-2] != self.columns.numel():
            raise StaticStorageMismatch(f"a cache layer wrote {keys.shape[-2]} tokens in a pass of "
                                        f"{self.columns.numel()} columns: no static storage for it")
        if not layer.is_initialized or layer.keys.shape[-2] != self.max_len:
            layer.dtype, layer.device = keys.dtype, keys.device
            layer.keys = keys.new_zeros((*keys.shape[:2], self.max_len, keys.shape[-1]))
            layer.values = values.new_zeros((*values.shape[:2], self.max_len, values.shape[-1]))
            layer.is_initialized = True
        return layer.keys, layer.values

    def with_raw(self, stored: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """`stored` with this pass's columns holding `raw` instead (a prefill chunk attends to itself raw, or in its
        prefill format). A prefill pass's columns are [length - chunk, length) (`BatchedEngine._prefill_static`), so
        the other columns are copied around them: each value is written once, where a clone and an index_copy wrote
        the chunk twice (16 x 8k, 8B-shaped: 44 ms of an FP8 prefill, H200)."""
        end = self.length
        begin = end - raw.shape[2]
        assert 0 <= begin and raw.shape[2] == self.columns.numel(), \
            f"a pass of {self.columns.numel()} columns ending at {end} cannot hold {raw.shape[2]} tokens"
        if self.attended is not None:  # `stored` is columns [0, end): the earlier ones, then the pass's raw
            assert self.attended == end and stored.shape[2] == end, (self.attended, end, stored.shape)
            return raw if begin == 0 else torch.cat([stored[:, :, :begin], raw], dim=2)
        out = torch.empty_like(stored)
        out[:, :, :begin].copy_(stored[:, :, :begin])
        out[:, :, begin:end].copy_(raw)
        out[:, :, end:].copy_(stored[:, :, end:])
        return out


class StaticKVLayer(DynamicLayer):
    """A full-attention layer of the reference (or any unquantised layer) on `StaticColumns` storage."""

    def __init__(self, static: StaticColumns):
        super().__init__()
        self.static = static

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.static.write(self, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.static.length


def make_static(cache: DynamicCache, static: StaticColumns) -> None:
    """Put every attention layer of `cache` on `static` storage (the reference's layers become `StaticKVLayer`s, a
    path's `QuantizedKVLayer`s keep their round trip and store in place). A sliding-window or chunked layer keeps
    every token there: its window is the mask's (`batched.static_mask`), so it attends to the keys its growing cache
    keeps. An attention layer with an SSM state beside it (Falcon-H1's "hybrid" layers) puts its K/V there and keeps
    the state as transformers does. Linear-attention and convolution layers already keep fixed-shape states updated
    in place, and an MLP / MoE-only layer holds nothing. Raises ValueError for a layer kind that grows another way
    (indexer keys, a window beside an SSM state, ...): the caller then decodes with the growing cache."""
    for i, layer in enumerate(cache.layers):
        kind = type(layer)
        if kind in (DynamicLayer, DynamicSlidingWindowLayer):
            cache.layers[i] = StaticKVLayer(static)
        elif kind is LinearAttentionAndFullAttentionLayer:  # the reference's hybrid layer: K/V static, its state kept
            cache.layers[i] = _of_kind(StaticKVLayer, layer, static)
        elif kind in (QuantizedKVLayer, EmulatedKVLayer) or _over(layer, (DynamicSlidingWindowLayer,
                                                                           LinearAttentionAndFullAttentionLayer)):
            layer.static = static
        elif kind.__name__ == "DummyLayer" or (kind.__name__.startswith("LinearAttention")
                                               and not isinstance(layer, DynamicLayer)):
            continue
        else:
            raise ValueError(f"cache layer {i} is a {kind.__name__}: no static storage for it")


def _over(layer, kinds: tuple[type, ...]) -> bool:
    """A layer `_of_kind` made over one of transformers' `kinds` (a path's, or the reference's static one)."""
    kind = type(layer)
    return kind in _KINDS.values() and kind.__bases__[1] in kinds  # (mixin, kind)


def stack_rows(caches: list[DynamicCache], into: DynamicCache) -> list[int]:
    """Put one-sequence caches (each a batch of one row, prefilled alone) into `into`, a fresh cache of the same
    path for len(caches) rows: full-attention K/V left-padded with zeros to the longest row, linear-attention states
    side by side. Returns each row's first real key (its pad count): `attention.RowKeys.starts`. Raises ValueError
    for a layer kind stacked another way (sliding windows, ...), as `make_static` does."""
    full = [i for i, layer in enumerate(into.layers) if type(layer) in (DynamicLayer, QuantizedKVLayer, EmulatedKVLayer)]
    for i, layer in enumerate(into.layers):
        linear = type(layer).__name__.startswith("LinearAttention") and not isinstance(layer, DynamicLayer)
        if i not in full and not linear and type(layer).__name__ != "DummyLayer":  # (an MLP / MoE-only layer)
            raise ValueError(f"cache layer {i} is a {type(layer).__name__}: no stacking of rows for it")
    lengths = [cache.layers[full[0]].keys.shape[-2] if full else 0 for cache in caches]
    longest = max(lengths)
    for i, layer in enumerate(into.layers):
        rows = [cache.layers[i] for cache in caches]
        if i in full:
            def padded(name: str) -> torch.Tensor:
                return torch.cat([torch.nn.functional.pad(x, (0, 0, longest - x.shape[-2], 0))
                                  for x in (getattr(row, name) for row in rows)])
            keys, values = padded("keys"), padded("values")
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        elif type(layer).__name__ != "DummyLayer":  # a linear-attention layer
            for name, value in vars(rows[0]).items():  # conv and recurrent states ([1, ...] tensors), their flags
                if isinstance(value, torch.Tensor):
                    value = torch.cat([row.__dict__[name] for row in rows])
                elif isinstance(value, dict):
                    value = {k: torch.cat([row.__dict__[name][k] for row in rows]) if isinstance(v, torch.Tensor)
                             else v for k, v in value.items()}
                setattr(layer, name, value)
    return [longest - length for length in lengths]


class AmaxObserverLayer(DynamicLayer):
    """A plain `DynamicLayer` that records the running per-head amax of what it stores (calibration). `rotated`:
    the amax of K as a `hadamard` path stores it (rotated over head_dim); the layer stores K as it is."""

    def __init__(self, rotated: bool = False):
        super().__init__()
        self.rotated = rotated
        self.k_amax: torch.Tensor | None = None  # [heads] fp32
        self.v_amax: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.k_amax = _running_amax(self.k_amax, rotate(key_states) if self.rotated else key_states)
        self.v_amax = _running_amax(self.v_amax, value_states)
        return super().update(key_states, value_states, *args, **kwargs)


class ChannelRangeObserverLayer(AmaxObserverLayer):
    """An `AmaxObserverLayer` that also records each channel's running (min, max) of what it stores: [2, heads, D]
    fp32 (a dummy pass's, for fault=dummy_block_scales)."""

    def __init__(self, rotated: bool = False):
        super().__init__(rotated)
        self.k_range: torch.Tensor | None = None
        self.v_range: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.k_range = _running_range(self.k_range, key_states)
        self.v_range = _running_range(self.v_range, value_states)
        return super().update(key_states, value_states, *args, **kwargs)


def _running_range(current: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, chunk, head_dim] -> [2, heads, head_dim]
    x = x.detach().float()
    seen = torch.stack([x.amin(dim=(0, 2)), x.amax(dim=(0, 2))]).cpu()
    return seen if current is None else torch.stack([torch.minimum(current[0], seen[0]),
                                                     torch.maximum(current[1], seen[1])])


def _running_amax(current: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, chunk, head_dim] -> [heads]
    amax = x.detach().float().abs().amax(dim=(0, 2, 3)).cpu()
    return amax if current is None else torch.maximum(current, amax)


def attention_layer_indices(config) -> list[int]:
    """Indices of the layers whose cache holds attention K/V (`holds_kv`: the ones a path quantises)."""
    cache = model_cache(config)
    return [i for i, layer in enumerate(cache.layers) if holds_kv(layer)]


def sliding_window_layers(config) -> list[int]:
    """The attention layers with a sliding window: the ones `keep_bf16=sliding_window` keeps in BF16, as vLLM's
    `--kv-cache-dtype-skip-layers sliding_window` skips every layer whose (per-layer, else model-level) sliding
    window is set. Read per layer from the cache transformers builds for the config (a sliding-window cache layer,
    `is_sliding`, from config.layer_types or the sliding_window attributes), not from one global attribute: a
    chunked-attention layer (llama4's `chunked_attention`, a window cache too) is not a sliding-window layer."""
    layer_types = _decoder_layer_types(config)
    return [i for i, layer in enumerate(DynamicCache(config=config).layers)
            if holds_kv(layer) and getattr(layer, "is_sliding", False)
            and not (i < len(layer_types) and layer_types[i] == "chunked_attention")]


def _decoder_layer_types(config) -> list:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return list(getattr(text, "layer_types", None) or [])


def bf16_layer_set(config, kv_path: KVPath) -> set[int]:
    """Every attention layer the path keeps in BF16: its indices, and the sliding-window layers where it says so.
    Raises ValueError for `keep_bf16=sliding_window` on a model without sliding-window layers."""
    kept = set(kv_path.bf16_layers)
    if kv_path.bf16_sliding:
        sliding = sliding_window_layers(config)
        if not sliding:
            raise ValueError(no_sliding_window_problem(kv_path, config))
        kept.update(sliding)
    return kept


def no_sliding_window_problem(kv_path: KVPath, config) -> str:
    types = sorted(set(_decoder_layer_types(config))) or ["no layer_types; no sliding_window"]
    return (f"--paths {kv_path.name}: keep_bf16=sliding_window keeps the sliding-window attention layers in BF16 "
            f"(vLLM's --kv-cache-dtype-skip-layers sliding_window), but model family "
            f"{getattr(config, 'model_type', '?')!r} has none (layer types: {', '.join(map(str, types))})")


def build_cache(config, kv_path: KVPath | None, scales: LayerScales | None,
                stats: KVWriteStats | None = None) -> DynamicCache:
    """The model's own `DynamicCache`, with each full-attention layer replaced by a `QuantizedKVLayer`.

    `kv_path=None` is the reference: the model's cache untouched.
    """
    cache = model_cache(config)
    if kv_path is None or kv_path.is_reference_noise:  # the float32 reference keeps the model's own cache
        return cache
    if kv_path.emulated:  # the yardstick's twin: its own write and scales (harness/kv_paths/emulated.py)
        for i, layer in enumerate(cache.layers):
            if holds_kv(layer):
                pair = (scales.k[i], scales.v[i]) if scales is not None and i in scales.k else None
                cache.layers[i] = _of_kind(EmulatedKVLayer, layer, kv_path.fmt, kv_path.granularity,
                                           kv_path.saturate, pair)
        return cache
    if kv_path.hadamard and model_layers.field(config, "kv_lora_rank"):  # families.layout_problems says it before work
        raise ValueError(f"KV path {kv_path.name!r}: hadamard rotates per-head K; an MLA model caches a latent")
    stats = stats if stats is not None else KVWriteStats()
    kept = bf16_layer_set(config, kv_path) if kv_path.keeps_layers_bf16 else set()
    mla = model_layers.field(config, "kv_lora_rank") is not None
    for i, layer in enumerate(cache.layers):
        if not holds_kv(layer) or i in kept:
            continue
        k_scale = scales.k.get(i) if scales else None
        v_scale = scales.v.get(i) if scales else None
        needs_scales = kv_path.has_static_scale or kv_path.k_scale_on_scores
        if needs_scales and (k_scale is None or v_scale is None):
            raise ValueError(f"KV path {kv_path.name!r}: no {kv_path.scale_source} scale for layer {i}")
        cache.layers[i] = _of_kind(QuantizedKVLayer, layer, kv_path, k_scale, v_scale, stats, mla)
        if scales is not None and i in scales.k_dummy_range:
            cache.layers[i].dummy_ranges = {"k": scales.k_dummy_range[i], "v": scales.v_dummy_range[i]}
        if kv_path.fault in format_faults.DUMMY_PASS_FAULTS and not cache.layers[i].dummy_ranges:
            raise ValueError(f"KV path {kv_path.name!r}: fault={kv_path.fault} needs the dummy pass's channel "
                             f"ranges for layer {i}")
        if kv_path.quantizes_attention:
            cache.layers[i].attn_quant = attention_quant(kv_path, scales, i)
    return cache


@dataclass(frozen=True, slots=True)
class AttentionQuant:
    """One layer's FP8 attention: q_scale (None: query not quantised; "dynamic": per token) and prob_scale."""

    q_scale: torch.Tensor | str | None
    prob_scale: torch.Tensor | None
    fmt: str = "e4m3"


def attention_quant(kv_path: KVPath, scales: LayerScales | None, layer: int) -> AttentionQuant:
    def pick(table: dict, name: str):
        if scales is None or kv_path.scale_source == "dynamic":
            return None
        if layer not in table:
            raise ValueError(f"KV path {kv_path.name!r}: no {kv_path.scale_source} {name} for layer {layer}")
        return table[layer]

    q = pick(scales.q if scales else {}, "q_scale") if kv_path.fp8_q else None
    q = "dynamic" if kv_path.fp8_q and q is None else q
    # probabilities never exceed 1 (and the first query attends only to itself, so amax is exactly 1):
    # a dynamic prob scale is 1 / 448
    prob = None
    if kv_path.fp8_prob:
        prob = pick(scales.prob if scales else {}, "prob_scale")
        prob = prob if prob is not None else fp8.amax_scale(torch.tensor(1.0), "e4m3")
    return AttentionQuant(q_scale=q, prob_scale=prob)


def observer_cache(config, observer: type | None = None, rotated: bool = False) -> DynamicCache:
    """The model's cache with every attention layer observed (`observer`, default `AmaxObserverLayer`; `rotated`:
    K's amax as a `hadamard` path stores it)."""
    cache = model_cache(config)
    for i, layer in enumerate(cache.layers):
        if holds_kv(layer):
            cache.layers[i] = _of_kind(observer or AmaxObserverLayer, layer, rotated)
    return cache


def scales_from_observers(cache: DynamicCache, kv_path: KVPath, source: str, provenance: str,
                          mla: bool = False) -> LayerScales:
    """amax / the format's static range per layer (fp8: amax / fp8 max; NVFP4: amax / (448 x 6), its global scale);
    per tensor takes the max over heads. A bf16 path, and a side whose format has no static scale, still gets
    (unused) e4m3 scales, as a checkpoint made for an FP8 cache would carry them. MLA: each part of the latent row
    by the format `latent_row_formats` gives it."""
    formats = latent_row_formats(kv_path) if mla and kv_path.is_quantized else (kv_path.k_format, kv_path.v_format)
    k_scale_of, v_scale_of = (_static_scale_rule(f) for f in formats)
    k, v = {}, {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, AmaxObserverLayer) and layer.k_amax is not None:
            k[i] = _reduce(k_scale_of(layer.k_amax), kv_path)
            v[i] = _reduce(v_scale_of(layer.v_amax), kv_path)
    return LayerScales(k=k, v=v, source=source, provenance=provenance)


def _static_scale_rule(kv_format):
    if kv_format is not None and kv_format.has_static_scale:
        return kv_format.scale_of_amax
    return lambda amax: fp8.amax_scale(amax, "e4m3")


def _reduce(per_head: torch.Tensor, kv_path: KVPath) -> torch.Tensor:
    return per_head.max() if kv_path.granularity == "per_tensor" else per_head


def unit_scales(config) -> LayerScales:
    """Scale 1.0 everywhere: what vLLM and SGLang use when no scale is given."""
    one = torch.tensor(1.0)
    layers = attention_layer_indices(config)
    return LayerScales(k={i: one for i in layers}, v={i: one for i in layers}, source="default",
                       provenance="1.0 (engine default)")


def scales_from_checkpoint(tensors: dict[str, torch.Tensor], config, kv_path: KVPath,
                           model_dir: str) -> LayerScales:
    """`*.layers.N.*.k_scale` / `v_scale` tensors (vLLM's checkpoint convention) -> per-layer scales."""
    k, v = {}, {}
    for name, value in tensors.items():
        parts = name.split(".")
        if parts[-1] not in ("k_scale", "v_scale") or "layers" not in parts:
            continue
        layer = int(parts[parts.index("layers") + 1])
        value = value.float().reshape(-1)
        scale = value.max() if kv_path.granularity == "per_tensor" or value.numel() == 1 else value
        (k if parts[-1] == "k_scale" else v)[layer] = scale.reshape(()) if scale.numel() == 1 else scale
    missing = [i for i in attention_layer_indices(config) if i not in k or i not in v]
    if (kv_path.has_static_scale or kv_path.k_scale_on_scores) and missing:
        raise ValueError(f"KV path {kv_path.name!r}: checkpoint {model_dir} has no k_scale/v_scale for "
                         f"attention layers {missing} (looked for '*.layers.N.*.k_scale' tensors in *.safetensors)")
    return LayerScales(k=k, v=v, source="checkpoint", provenance=f"k_scale/v_scale tensors in {model_dir}")
