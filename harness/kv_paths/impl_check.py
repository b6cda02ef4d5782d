"""The implementation check: is a path's attention what its declared numerics say it should be?

A probe on each attention cache layer of a path's cache (`attach`) sees every call of the registered attention
function (`harness.kv_paths.attention`) and, for a sample of query rows, compares
  - the path's actual attention output (what the model goes on with: SDPA, the torch FP8-attention reference,
    a decode kernel's output, or a fault injector's), against
  - exact attention in fp64 over the same K/V the attention function got (an FP8 cache's codes x its declared
    scale, as the cache read them back into the model dtype) with the path's declared Q and P quantisation
    (`kernels.reference.attention_fp8`'s definition),
relative to torch's own error at the attention dtype: SDPA in that dtype on the same rows against fp64
attention over the same inputs. Both errors are pooled per layer as root-sum-square over the sampled rows
and heads (per head as well, to name the worst head), and
    attn_impl_err_ratio = max over layers of  ||o_path - o_exact|| / max(||o_sdpa - o_plain||, floor)
with floor = eps(dtype)/8 x ||o_plain|| (the output's own rounding; keeps a row whose SDPA error happens to
be 0 from dividing by 0). The KV quantisation error both the path and its exact attention share cancels:
what is left is the arithmetic. A healthy path sits near 1 (on the CPU its output is SDPA's, or attention_fp8's
fp32 arithmetic, over the very same inputs); a fault in the arithmetic sits far above.

The yardstick is the larger of SDPA's error and the rounding of the declared exact output to the attention dtype
(an implementation computing the declared numerics exactly still rounds once; with FP8 P the declared output sits
elsewhere on the dtype's grid than plain attention's, and the healthy FP8-attention path read 1.69x SDPA's error on
the hybrid canary before that rounding counted, 1.00 after).

Threshold (the verdicts' DEFAULT_THRESHOLDS, harness/analysis/verdicts.py, where its measurement is stated): warn
1.4, fail 1.8. `python benchmarks/impl_check.py --models gqa,mla,hybrid` (CPU, the 21 default canary turns):
healthy per-turn max 1.12 (gqa) / 1.00 (mla) / 1.08 (hybrid); every fault injector's per-turn max above 2.0 on
every canary, its min down to 1.05 on the hybrid's short turns.

Cost (stated in `ProbeOptions`): a few query rows per layer call, every prefill chunk, every
`decode_every`-th decode step: one small fp64 attention and one small SDPA call per probed layer call.
A batch (the batched replay) is probed all rows at once on a GPU (in groups under `CHECK_ELEMENTS`): each row's real query
positions (the engine's `StepState.valid`; rows are left-padded) against its own mask row, pooled per row, so every
sequence gets its own ratio and fault injectors replay batched (tests/test_detection.py). A decode step replayed as a
CUDA graph runs no Python and is not probed (graph decode: prefill and the eager steps), nor is a static
prefill's chunk replayed as one (`batched.StaticPrefillChunk`: the control arm's middle chunks). A batch observed
without the engine's step (no row map) is not probed (`skipped_batched`). Decode steps served by a decode kernel
are not probed either: `kernel_err_ratio` judges those (see `DeclaredProbe.observe`); on CUDA the check covers
prefill and the torch-served steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels import reference as fp8

# fp64 K (and V) elements gathered for one group of a batch's rows (128 MiB each): a long context probes in groups
CHECK_ELEMENTS = 1 << 24


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """How much each turn samples: 4 query rows of every prefill chunk and of every 8th decode step, all heads
    (up to 32), every attention layer. Its cost: `python benchmarks/impl_check.py --cost` (generation time with the
    check on and off, interleaved)."""

    rows: int = 4  # query rows per prefill chunk (evenly spread, last included)
    max_heads: int = 32  # query heads per layer (evenly spread)
    decode_every: int = 8  # probe decode steps 0, 8, 16, ... of a turn

    def __post_init__(self):
        if self.rows < 1 or self.max_heads < 1 or self.decode_every < 1:
            raise ValueError(f"implementation check needs rows, heads and decode_every >= 1, got {self}")


@dataclass
class ImplProbe:
    """Pooled squared errors per (row, layer, head): [path error^2, torch error^2, floor^2, rows], where row is a
    sequence's row in the batch it started in (one sequence alone: row 0). `live` maps the batch's current
    positions to those rows (rows that left the batch: `select`); `valid` ([live rows, chunk], the engine's
    `StepState.valid` as the forward pass runs) says which query positions of each row are real tokens."""

    options: ProbeOptions = ProbeOptions()
    sums: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)  # [(pooled [rows, 4, Hs] on the device, layer, [(row, n)])]: `_fold`
    real_of: object = None  # the prefill pass's `valid` that `real` was read from (`_real_queries`)
    real: list = field(default_factory=list)
    decode_calls: dict = field(default_factory=dict)
    skipped_batched: int = 0
    step: object = None  # the engine's StepState (its `valid`); None: every query of a batch of one row is real
    live: list = field(default_factory=lambda: [0])

    def __deepcopy__(self, memo) -> None:
        """A copy of a probed cache (the prefill kept for scoring, `inprocess.PrefillMemo`) is not probed: the
        probe judges the generation it was attached to, and its row map and step are that generation's."""
        return None

    def select(self, index: torch.Tensor) -> None:
        """The batch kept rows `index` (positions in the current batch), as the cache's `reorder_cache` did."""
        self.live = [self.live[i] for i in index.tolist()]

    def observe(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, scaling: float,
                output: torch.Tensor) -> None:
        """query [B, Hq, T, D] (before the path quantises it), key/value [B, Hkv, L, D] as the attention function
        got them, output [B, T, Hq, Dv] (the path's actual output)."""
        if (query.is_cuda and torch.cuda.is_current_stream_capturing()) or \
                (query.shape[0] != 1 and self.step is None):
            self.skipped_batched += 1  # a CUDA graph being captured, or a batch with no row map: not probed
            return
        layer = int(module.layer_idx)
        chunk = query.shape[2]
        if chunk == 1:
            calls = self.decode_calls.get(layer, 0)
            self.decode_calls[layer] = calls + 1
            if calls % self.options.decode_every:
                return
        real = [chunk] if self.step is None else self._real_queries(self.step.valid)  # real queries per row
        probed = [(b, n) for b, n in enumerate(real) if n]
        if not probed:
            return
        # rows at once on a GPU (launch-bound: one set of small kernels for the batch); one row at a time on a CPU,
        # where a row's fp64 K/V stays in cache (the batched gather measured 1.6x slower there, 16 rows x 40 queries)
        group = 1 if not query.is_cuda else max(
            1, CHECK_ELEMENTS // (min(query.shape[1], self.options.max_heads) * key.shape[2] * key.shape[3]))
        pooled = torch.cat([self._measure(module, probed[i:i + group], query, key, value, mask, scaling, output)
                            for i in range(0, len(probed), group)])
        # folded into `sums` when they are read (`_fold`): no host sync per probed layer call, which stalled the host
        # at every layer of every prefill pass; the rows are named as the batch stands now (`live` moves on)
        self.pending.append((pooled, layer, [(self.live[b], n) for b, n in probed]))

    def _real_queries(self, valid: torch.Tensor) -> list[int]:
        """Real queries per row of the pass `valid` ([rows, chunk]) belongs to. A prefill pass's is read from the
        device once, not at each of its layers: the engine sets a new `valid` for each such pass (held here, so its
        id is not reused). A decode step's is read at each call: a static decode step rewrites its own in place."""
        if valid.shape[1] == 1:
            return valid.sum(1).tolist()
        if self.real_of is not valid:
            self.real_of, self.real = valid, valid.sum(1).tolist()
        return self.real

    def _fold(self) -> None:
        """The pending measurements into `sums`, in the order they were taken (one host read for all)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        home = pending[0][0].device  # a layer-sharded model's layers measured on their own GPUs
        flat = torch.cat([pooled.flatten().to(home) for pooled, _, _ in pending]).cpu().tolist()
        offset = 0
        for pooled, layer, rows in pending:
            width = pooled.shape[1] * pooled.shape[2]
            for row, n in rows:
                errors = [flat[offset + j * pooled.shape[2]:offset + (j + 1) * pooled.shape[2]]
                          for j in range(pooled.shape[1])]
                offset += width
                heads = errors.pop()
                for i, head in enumerate(heads):
                    entry = self.sums.setdefault((row, layer, int(head)), [0.0, 0.0, 0.0, 0])
                    entry[0] += errors[0][i]
                    entry[1] += errors[1][i]
                    entry[2] += errors[2][i]
                    entry[3] += min(n, self.options.rows)

    @torch.inference_mode()
    def _measure(self, module, rows: list[tuple[int, int]], query, key, value, mask, scaling, output) -> torch.Tensor:
        """Batch rows `rows` ((b, its n real queries, which end the chunk: rows are left-padded)), each row's sampled
        queries at once -> [rows, 4, Hs] fp64: path error^2, torch error^2, floor^2 (summed over the row's sampled
        queries), and the sampled heads. Rows sampling fewer queries repeat their last one at weight 0."""
        from harness.kv_paths.capture import spread

        chunk, length, heads, device = query.shape[2], key.shape[2], query.shape[1], query.device
        picks = [[chunk - n + p for p in spread(n, self.options.rows)] for _, n in rows]
        width = max(len(pick) for pick in picks)
        index = _on_device([pick + pick[-1:] * (width - len(pick)) for pick in picks], device)  # [B, W]
        sampled = None if all(len(pick) == width for pick in picks) else _on_device(
            [[True] * len(pick) + [False] * (width - len(pick)) for pick in picks], device)[:, None, :]  # [B, 1, W]
        batch = _on_device([b for b, _ in rows], device)
        head_idx = _on_device(spread(heads, self.options.max_heads), device)
        kv_idx = head_idx // (heads // key.shape[1])
        valid = _valid(mask, batch, index, length, chunk, device).unsqueeze(1)  # [B, 1, W, L]
        q = _rows(query, rows).index_select(1, head_idx).gather(
            2, index[:, None, :, None].expand(-1, len(head_idx), -1, query.shape[3]))  # [B, Hs, W, D]
        k, v = (_rows(t, rows).index_select(1, kv_idx) for t in (key, value))  # [B, Hs, L, D] model dtype
        k64, v64 = k.double(), v.double()
        plain = _attention64(q.double(), k64, v64, valid, scaling)  # [B, Hs, W, Dv]
        # the path's declared numerics: plain attention itself unless its layers quantise Q / P (computed twice
        # before, the two calls were 18% of a CPU run's time on the gqa canary's default set, profiled)
        declared = self.declared_output(module, int(module.layer_idx), q, k64, v64, valid, scaling, plain)
        sdpa = _sdpa_rows(q, k, v, valid, scaling, sampled)  # [B, Hs, W, Dv]
        actual = _rows(output, rows).gather(1, index[..., None, None].expand(-1, -1, *output.shape[2:])).index_select(
            2, head_idx).transpose(1, 2).double()  # [B, Hs, W, Dv]

        def pooled(difference: torch.Tensor) -> torch.Tensor:  # [B, Hs, W, Dv] -> [B, Hs], padded queries left out
            squares = difference.square().sum(-1)
            return (squares if sampled is None else torch.where(sampled, squares, 0.0)).sum(-1)

        path_err = pooled(actual - declared)
        # the error the declared numerics themselves produce in the attention dtype: an implementation that computes
        # them exactly still rounds its output once. With FP8 P the declared output sits elsewhere on the dtype's grid
        # than plain attention's (healthy FP8 attention read 1.69x SDPA's error on the hybrid canary, all of it this
        # one rounding), so the yardstick is the larger of SDPA's error and that rounding
        rounding = pooled(declared.to(query.dtype).double() - declared)
        torch_err = torch.maximum(pooled(sdpa - plain), rounding)
        floor = pooled(plain) * (torch.finfo(query.dtype).eps / 8) ** 2
        return torch.stack([path_err, torch_err, floor, head_idx.to(torch.float64).expand_as(path_err)], dim=1)

    def declared_output(self, module, layer, q, k, v, valid, scaling, plain: torch.Tensor) -> torch.Tensor:
        """What the layer's declared numerics give in fp64 (`plain`: fp64 attention of q over k, v)."""
        return plain

    def row_records(self, rows: int) -> list[dict[str, float]]:
        """`as_record` of each of a batch's `rows` rows (a row never probed: {})."""
        self._fold()
        return [self.as_record(row) for row in range(rows)]

    def as_record(self, row: int = 0) -> dict[str, float]:
        """Row `row`'s attn_impl_err_ratio (the worst layer's, its heads pooled), that layer, its worst head (by the
        head's own pooled ratio) and how many (row, head) pairs were compared."""
        self._fold()
        sums = {(layer, head): e for (r, layer, head), e in self.sums.items() if r == row}
        if not sums:
            return {}
        by_layer: dict[int, list[float]] = {}
        for (layer, _), e in sums.items():
            pooled = by_layer.setdefault(layer, [0.0, 0.0, 0.0])
            for i in range(3):
                pooled[i] += e[i]
        layer_ratio = {layer: _ratio(e) for layer, e in by_layer.items()}
        worst = max(layer_ratio, key=lambda layer: (layer_ratio[layer], -layer))
        heads = {head: _ratio(e) for (layer, head), e in sums.items() if layer == worst}
        head = max(heads, key=lambda h: (heads[h], -h))
        return {"attn_impl_err_ratio": layer_ratio[worst], "attn_impl_worst_layer": float(worst),
                "attn_impl_worst_head": float(head), "attn_impl_rows": float(sum(e[3] for e in sums.values()))}


def _ratio(pooled: list[float]) -> float:
    """sqrt(path error^2) / max(sqrt(torch error^2), sqrt(floor^2)); NaN in the path's output counts as inf."""
    value = math.sqrt(pooled[0]) / max(math.sqrt(pooled[1]), math.sqrt(pooled[2]), 1e-300)
    return value if math.isfinite(value) else math.inf


@dataclass
class DeclaredProbe(ImplProbe):
    """The probe of one path's cache: the Q/P quantisation its FP8-attention layers declare."""

    layers: dict = field(default_factory=dict)  # {layer index: the cache layer (QuantizedKVLayer)}

    def observe(self, module, query, key, value, mask, scaling, output) -> None:
        cache_layer = self.layers.get(int(module.layer_idx))
        if query.shape[2] == 1 and getattr(cache_layer, "paged", None) is not None:
            # a decode step served by a decode kernel over the paged FP8 copy: the kernel's arithmetic (fp32 online
            # softmax over tiles, bf16 P.V, tile-relative P for FP8 attention) is another declared computation than
            # SDPA's, and its error against fp64 over the same codes is what kernel_err_ratio measures on these
            # steps. Probed here, healthy kernel paths read 1.5-2.4x SDPA's error on an H100 (gqa, mla, hybrid
            # canaries, tests/test_impl_check.py --gpu at 3ff5995+merges): above this check's CPU-measured limits.
            return
        super().observe(module, query, key, value, mask, scaling, output)

    def declared_output(self, module, layer, q, k, v, valid, scaling, plain: torch.Tensor) -> torch.Tensor:
        quant = getattr(self.layers.get(layer), "attn_quant", None)
        if quant is None:
            return plain
        return _attention_fp8_64(q, k, v, valid, scaling, quant)


def attach(cache, options: ProbeOptions = ProbeOptions(), step=None, rows: int = 1) -> DeclaredProbe:
    """One probe for all attention cache layers of `cache` (a path's, from `build_cache`); the attention function
    finds it as the layer's `impl_probe`. step: the engine's `StepState` of a batch of `rows` rows (None: one
    sequence, every query real)."""
    probe = DeclaredProbe(options=options, step=step, live=list(range(rows)))
    for index, layer in enumerate(cache.layers):
        if hasattr(layer, "kv_path"):
            probe.layers[index] = layer
            layer.impl_probe = probe
    return probe


def _sdpa_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scaling: float,
               sampled: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA in the attention dtype over each row's sampled queries (q [B, Hs, W, D], k/v [B, Hs, L, D], valid
    [B, 1, W, L]; sampled [B, 1, W]: a row's real queries, None: all) -> [B, Hs, W, Dv] fp64, padded queries 0.

    One row: SDPA of the row's [Hs, W, D] queries, the shapes torch sees for one sequence, as the thresholds were
    measured (3-D inputs: torch's math backend, on either device). Several rows (the GPU's groups): one call of the
    same math backend over the batch. Row by row, each call cost ~0.3 ms on an H200 whatever its size (12 rows: 3.7
    ms against 0.35 at once), 2.7 s of the default run's 21.7 (`benchmarks/phase_time.py`, session 31). At once, its
    output equalled the row-by-row one bit for bit at 4 of 5 shapes measured there and differed by at most 2^-12 at
    the 5th (32 rows, 700 keys: cuBLAS picks its batched GEMM by the batch count): the same backend's rounding, so
    the same size of yardstick."""
    if q.shape[0] == 1:  # one row's queries are all real (the width is its own): 3-D inputs, which only the math
        # backend takes whatever the flags say, so no choice is set (a CPU model thread's call reads them unlocked)
        return torch.nn.functional.scaled_dot_product_attention(
            q[0].contiguous(), k[0], v[0], attn_mask=valid[0, 0], scale=scaling)[None].double()
    from torch.nn.attention import SDPBackend

    from harness.forward_context import sdpa_only

    with sdpa_only(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=valid, scale=scaling).double()
    return out if sampled is None else torch.where(sampled[..., None], out, 0.0)


def _rows(tensor: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """The batch rows `rows` ((b, _)) of `tensor` [B, ...]: a view for one row, else a copy."""
    if len(rows) == 1:
        return tensor[rows[0][0]:rows[0][0] + 1]
    return tensor.index_select(0, _on_device([b for b, _ in rows], tensor.device))


def _on_device(data: list, device) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the device: `torch.tensor(data, device=cuda)`
    copies and then synchronises the stream, and the probe made several a probed layer call; a non-blocking copy
    from pageable memory returns once the driver has staged it."""
    return torch.tensor(data).to(device, non_blocking=True)


def _valid(mask, batch: torch.Tensor, index: torch.Tensor, length: int, chunk: int, device) -> torch.Tensor:
    """[B, W, L] bool: the keys each sampled query (index [B, W] of the chunk) of batch rows `batch` [B] attends
    (the mask's, else causal)."""
    if isinstance(mask, torch.Tensor):
        rows = mask[batch.clamp(max=mask.shape[0] - 1), 0]  # [B, T, L']: a mask of one row serves every row
        picked = rows.gather(1, index[..., None].expand(-1, -1, rows.shape[-1]))[..., :length]
        return picked if picked.dtype == torch.bool else picked > -math.inf
    positions = index + (length - chunk)
    return torch.arange(length, device=device) <= positions.unsqueeze(-1)


def _attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """fp64 softmax(q k^T * scaling) v for q [B, Hs, R, D], k/v [B, Hs, L, D] fp64, valid [B, 1, R, L]."""
    logits = (q @ k.transpose(-1, -2)) * scaling
    return torch.softmax(logits.masked_fill(~valid, -math.inf), dim=-1) @ v


def _attention_fp8_64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scaling: float,
                      quant) -> torch.Tensor:
    """`attention_fp8`'s definition in fp64: Q quantised as the path declares (the same fp32 cast, so the same
    codes), softmax in fp64, P rounded to the declared format under prob_scale, then P V."""
    qf = q.float()
    if isinstance(quant.q_scale, str):
        qs = fp8.per_token_scale(qf, quant.fmt)
        qf = fp8.dequantize(fp8.quantize(qf, qs, quant.fmt), qs)
    elif quant.q_scale is not None:
        qf = fp8.dequantize(fp8.quantize(qf, quant.q_scale, quant.fmt), quant.q_scale)
    logits = (qf.double() @ k.transpose(-1, -2)) * scaling
    probs = torch.softmax(logits.masked_fill(~valid, -math.inf), dim=-1)
    if quant.prob_scale is not None:
        scale = torch.as_tensor(quant.prob_scale, dtype=torch.float32, device=probs.device)
        probs = (probs / scale.double()).to(fp8.fp8_dtype(quant.fmt)).double() * scale.double()
    return probs @ v


def enabled() -> bool:
    """On unless HARNESS_IMPL_CHECK=0 (to time a run without it)."""
    import os

    return os.environ.get("HARNESS_IMPL_CHECK", "1") != "0"
