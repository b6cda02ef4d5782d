"""Batched in-process replay: many sequences of one (model, KV path) decode, prefill and score together.

Sequences are left-padded to one length; each row carries its own attention mask and position ids (the
first real token at position 0, as alone), so a row computes what it would alone, up to the reduction
order of batched matrix products (the batch-invariance floor, measured by `batch_invariance`). A row
leaves the batch at EOS (every cache layer, the per-row write statistics and the kernel's paged copy are
re-indexed). Every KV path runs here: `QuantizedKVLayer` quantises [batch, heads, chunk, dim] with
per-tensor, per-head or per-token scales, the MLA latent and the hybrid's linear-attention state are
ordinary cache layers; write statistics are kept per row on the device (no host sync per layer).

On CUDA, FP8 decode steps go through the path's decode kernel over paged copies (`kv_paths.attention.PagedKV`,
the same type one sequence alone uses, with one row per sequence); their agreement with an fp64 computation is
checked at the prompt's last position during the prefill and on every `kernel_check_every`-th decode step after
it (the kernel runs every step; a `kernel=` plug-in is checked and timed on every step, docs/CONTRACTS.md). The
implementation check probes every row. Batches are cut to `batch_size` sequences; a CUDA out-of-memory error halves
the batch and retries it, keeping every finished row.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from harness.forward_context import DEVICE_WIDE, CausalPrefix, checks_beside, forward_context, own_stream
from harness.kv_paths import attention, impl_check
from harness import model_layers
from harness.kv_paths.attention import BLOCK_SIZE, KernelAgreement, RowKeys, StepState, attach_paged
from harness.kv_paths.cache import (KVWriteStats, StaticColumns, StaticStorageMismatch, build_cache, cache_kwargs,
                                    make_static, stack_rows)
from harness.replay.families import NO_CACHE_TYPES, static_decode_refusal  # noqa: F401 - re-exported
from harness.replay.route import DECODE_MODES, EVERY_CALL_EAGER, layout_decode_refusal
from harness.replay.segments import SegmentedGraph
from harness.replay.families import ssm_scan_bytes
from harness.replay.tensor_parallel import min_across_ranks

DEFAULT_KERNEL_CHECK_EVERY = 16  # decode steps between fp64 agreement checks (the kernel runs every step)
MAX_AUTO_BATCH = 256
# Prompt tokens (over all rows) per prefill forward pass: above it the prompt is prefilled in column chunks,
# which bounds prefill activations (8B-shaped model: ~3.7 GiB per MLP intermediate at 131k tokens).
PREFILL_TOKENS = 32768
# Rows decoded together (`generate_rows`): prompts are sorted by length and a batch takes up to ROWS_BATCH of them
# whose longest is at most ROWS_SPREAD x its shortest, so stacked rows pad little: a decode step's cost grows with the
# padded cache (the growing cache copies it, transformers' MLA attention expands the whole latent). A batch's rows give
# the same bits in any grouping. Measured (default CPU run, --jobs 1, AVX2 dispatch, 2 cores): spread 2 110.0 s,
# 8 127.9 s, unbounded 141.5 s; the mla canary's 21 default turns through fp8_e4m3, one core: 7.5-8.0 s at 2 against
# 8.9 s at 8 (BENCHMARKS.md, session 14). ROWS_BATCH bounds memory; the canaries' batches stay under 21 rows.
ROWS_BATCH, ROWS_SPREAD = 64, 2.0
# A static prefill replays its middle chunks as one CUDA graph (`StaticPrefillChunk`) where at least CHUNK_GRAPH_MIN
# of them run and each holds at most CHUNK_GRAPH_TOKENS tokens over its rows. A recording costs about one eager pass
# (a canary's decode step: 13.3 ms captured, 24.4 ms eager, H100, BENCHMARKS.md session 6) and pays off from a few
# replays; a pass of more tokens keeps the GPU busy through its launches, so its graph would save little and hold a
# memory pool of its activations. Both are margins, not measurements: the chunks they take are the control arm's
# (32 tokens; 21 x 32 for the canaries' batches).
CHUNK_GRAPH_MIN, CHUNK_GRAPH_TOKENS = 4, 4096
# a padded batch's eager prefill pass of at least this many columns attends each run of rows under a lower-right
# causal bias (`BatchedEngine._causal_prefix`). H200, `benchmarks/prefill_attention.py`, pads of 0-63 tokens, the
# passes past them: 64 rows x 512 columns 2.02x faster than under the mask, 128 x 256 0.70x (a call a row); one
# 1,024-column pass of 32 rows, the pads among its queries, 1.71x
CAUSAL_ROWS_MIN_QUERIES = 512
# where an eager static prefill pass reads only the columns up to its own (`StaticColumns.attended`): CUDA, whose
# memory-efficient SDPA computes every key it is given; not the CPU, whose exact-bits layers compare call shapes
# (harness/replay/cpu_exact.py) and whose prompts are short
ATTENDED_PREFIX_DEVICES = ("cuda",)



@dataclass(frozen=True, slots=True)
class BatchSettings:
    batch_size: int | None = None  # None: from free GPU memory (CUDA), else everything in one batch
    kernel_check_every: int = DEFAULT_KERNEL_CHECK_EVERY
    # how a batch decodes: "dynamic" (a growing cache, finished rows leave the batch), "static" (preallocated
    # cache written in place, finished rows masked), "graph" (static, each decode step one CUDA graph replay);
    # "auto": graph on CUDA, dynamic elsewhere
    decode: str = "auto"
    # a sequence replayed alone (`InProcessBackend`: one-at-a-time replay, serve, attention tools): a batch of one
    # row whose every decode step checks the kernel and times it and, on the CPU, keeps its prefill for scoring the
    # same prompt (the implementation check, impl_check.py, probes every row of any batch)
    one_sequence: bool = False

    def __post_init__(self):
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.kernel_check_every < 1:
            raise ValueError(f"kernel check interval must be >= 1 decode step, got {self.kernel_check_every}")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode mode must be one of {', '.join(DECODE_MODES)}, got {self.decode!r}")
        if self.one_sequence and (self.batch_size != 1 or self.kernel_check_every != 1 or self.decode != "dynamic"):
            raise ValueError("one sequence alone: batch size 1, every decode step checked, dynamic decode")


# One sequence at a time (see `BatchSettings.one_sequence`)
ONE_SEQUENCE = BatchSettings(batch_size=1, kernel_check_every=1, decode="dynamic", one_sequence=True)


@dataclass(frozen=True, slots=True)
class RowResult:
    token_ids: list[int]
    finish_reason: str  # eos | length | nonfinite_logits
    metrics: dict | None


@dataclass(frozen=True, slots=True)
class RowStart:
    """One prompt prefilled alone (`BatchedEngine._prefill_one`): its cache, write statistics, implementation-check
    probe and last-position logits [1, vocab] float32."""
    cache: object
    stats: KVWriteStats
    probe: object
    logits: torch.Tensor


class BatchedEngine:
    """Batched greedy decoding and teacher-forced scoring for one `InProcessBackend` (model + KV path)."""

    def __init__(self, backend, settings: BatchSettings = BatchSettings(),
                 on_batch: Callable[[str, int], None] | None = None, prefills=None):
        """prefills: where a one-sequence engine keeps post-prefill caches for scoring (`inprocess.PrefillMemo`)."""
        self.backend, self.settings, self.prefills = backend, settings, prefills
        self.model = backend.owner.model
        self.device = backend.owner.device
        tokenizer = backend.owner.tokenizer
        self.eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad = pad if pad is not None else (self.eos if self.eos is not None else 0)
        self.on_batch = on_batch or (lambda kind, size: None)
        self.batch_sizes_used: list[int] = []
        self.decode_batches: dict[str, int] = {}  # generation batches per decode mode actually used
        self.decode_fallbacks: list[str] = []  # why a batch asked for static/graph decode ran another way
        # a layer-sharded model's captured decode steps: their graphs' GPUs in order ("cuda:0 > cuda:1 > cuda:0")
        self.graph_segments: set[str] = set()
        # an eager decode step has run (Triton kernels compiled, library handles and lazy copies made): later
        # batches capture their first step instead of running it eagerly
        self.decode_warm = False

    def _layout_refusal(self) -> str | None:
        """Why this model's batches cannot decode on static storage for its layout: a tensor-parallel rank (as the
        route says for `--shard tensor`). A layer-sharded model's decode step records as one graph per GPU
        (`segments.SegmentedGraph`)."""
        return layout_decode_refusal("tensor") if getattr(self.backend.owner, "tensor_parallel", False) else None

    @property
    def layer_sharded(self) -> bool:
        return getattr(self.backend.owner, "shard_plan", None) is not None

    # -- batching with OOM back-off -------------------------------------------------------------------
    def _in_batches(self, items: list, run: Callable[[list], list], max_len: int) -> list:
        """`run` over `items` in batches of the setting's size (auto: `auto_batch_size`), in order. A CUDA
        out-of-memory error halves the size and retries the batch; on a tensor-parallel rank it is raised instead
        (`runner.in_lockstep`): the other ranks wait inside the failed batch's collectives, so no rank may cut
        batches of its own, and the rank's error ends the run, resumable."""
        from harness.replay.runner import in_lockstep

        size = self.settings.batch_size or auto_batch_size(self.model, self.device, max_len, len(items))
        results: list = []
        start = 0
        while start < len(items):
            chunk = items[start:start + size]
            try:
                results += run(chunk)
            except torch.OutOfMemoryError:
                if size == 1 or in_lockstep():
                    raise
                size = max(1, size // 2)
                _free_cuda()
                continue
            self.batch_sizes_used.append(len(chunk))
            start += len(chunk)
        return results

    # -- generation -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int] | int) -> list[RowResult]:
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        items = list(zip([list(p) for p in prompts], limits))
        longest = max((len(p) + n for p, n in items), default=0)
        return self._in_batches(items, self._generate_batch, longest)

    @torch.inference_mode()
    def generate_one(self, prompt: Sequence[int], max_new_tokens: int,
                     on_step: Callable[[torch.Tensor, int], None] | None = None,
                     remember_prefill: bool = False) -> RowResult:
        """One sequence alone (a one-sequence engine): `on_step(logits, next_id)` sees each step's logits [vocab]
        before the token is taken; remember_prefill: keep a copy of the cache and the last logits after the
        prompt's prefill for `score` of the same prompt (CPU, no kernel: a kept CUDA cache would hold memory the
        batched replay sizes its batches from)."""
        assert self.settings.one_sequence, "generate_one is a one-sequence engine's"
        keep = remember_prefill and self.prefills is not None and self.backend.route.kernel is None \
            and self.device.type == "cpu"
        [row] = self._generate_dynamic([(list(prompt), max_new_tokens)], on_step, self._remember if keep else None)
        self.decode_batches["dynamic"] = self.decode_batches.get("dynamic", 0) + 1
        return row

    @torch.inference_mode()
    def generate_rows(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                      remember_prefill: bool = False) -> list[RowResult]:
        """What `generate_one` returns for each prompt alone, bit for bit (tokens, finish reason, write statistics,
        implementation check), with the decode steps of many prompts run as one batch: each prompt is prefilled
        alone (a one-sequence engine's prefill), the rows' caches are stacked left-padded (`cache.stack_rows`), and
        each decode step runs the whole batch through the model with every row's attention over its own keys
        (`attention.RowKeys`). Every other op of a decode step computes a row from that row alone (linear layers,
        norms, RoPE, routing, the linear-attention update); tests/test_rows.py compares the two over every KV path kind
        and model family. For the CPU replay (route.ROWS), where one-row steps read every weight once per token: a batch
        reads it once for all its rows. remember_prefill: as `generate_one`'s, for each prompt. Raises ValueError for
        a model whose cache layers cannot be stacked (sliding windows, ...; `families.stack_refusal`)."""
        assert self.backend.route.kernel is None, "rows decode through torch attention (a kernel's copy is per batch)"
        results: list[RowResult | None] = [None] * len(prompts)
        alone = BatchedEngine(self.backend, ONE_SEQUENCE, prefills=self.prefills)
        for i in range(len(prompts)):  # no token asked: the prompt's prefill is all there is, as alone
            if max_new_tokens[i] <= 0:
                results[i] = alone.generate_one(prompts[i], max_new_tokens[i], remember_prefill=remember_prefill)
        order = sorted((i for i in range(len(prompts)) if results[i] is None), key=lambda i: len(prompts[i]))
        while order:
            shortest = max(1, len(prompts[order[0]]))
            group = [i for i in order[:ROWS_BATCH] if len(prompts[i]) <= ROWS_SPREAD * shortest]
            order = order[len(group):]
            rows = self._generate_stacked([(list(prompts[i]), max_new_tokens[i]) for i in group], remember_prefill)
            for i, row in zip(group, rows):
                results[i] = row
        return results

    def _generate_stacked(self, items: list[tuple[list[int], int]], remember: bool) -> list[RowResult]:
        alone = BatchedEngine(self.backend, ONE_SEQUENCE, prefills=self.prefills)
        started = [alone._prefill_one(prompt, remember) for prompt, _ in items]  # noqa: SLF001 - same class
        limits, rows = [n for _, n in items], len(items)
        fp8_path = self.backend.kv_path is not None and self.backend.kv_path.is_quantized
        step = StepState(valid=torch.ones(rows, 1, dtype=torch.long, device=self.device))
        stats = KVWriteStats.stacked([s.stats for s in started], step, self.device)
        cache = build_cache(self.model.config, self.backend.kv_path, self.backend.scales, stats)
        starts = stack_rows([s.cache for s in started], cache)
        for start in started:  # a row's decode call is one real query, as alone (the prefill's step is done)
            if start.probe is not None:
                start.probe.step = None
        row_keys = RowKeys(starts, [s.probe for s in started])
        longest = max(len(prompt) for prompt, _ in items)
        first = torch.tensor(starts, device=self.device)[:, None]
        mask = (torch.arange(longest, device=self.device)[None, :] >= first).long()
        positions = torch.tensor([[len(prompt) - 1] for prompt, _ in items], device=self.device)
        logits = torch.cat([s.logits for s in started])
        outputs: list[list[int]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        live = list(range(rows))
        with forward_context(cache=cache, rows=row_keys):
            for _ in range(max(limits, default=0)):
                step_ids, keep = self._finish_rows(logits, live, range(len(live)), outputs, finish, limits)
                if not keep:
                    break
                if len(keep) < len(live):
                    index = torch.tensor(keep, device=self.device)
                    _select_rows(cache, index, stats, step, fp8_path)
                    row_keys.select(keep)
                    mask, positions, step_ids = mask[index], positions[index], step_ids[index]
                    live = [live[i] for i in keep]
                mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
                positions = positions + 1
                step.valid = mask[:, -1:]
                logits = self._forward(step_ids.view(-1, 1), mask, positions, cache, step)
        records = stats.row_records() if fp8_path else [None] * rows
        records = [record if s.probe is None else {**(record or {}), **s.probe.as_record(0)}
                   for record, s in zip(records, started)]
        self.on_batch("generate", rows)
        self.decode_batches["rows"] = self.decode_batches.get("rows", 0) + 1
        return [RowResult(tokens, reason or "length", record)
                for tokens, reason, record in zip(outputs, finish, records)]

    def _prefill_one(self, prompt: list[int], remember: bool) -> RowStart:
        """A one-sequence engine's prefill of `prompt`, as `generate_one` runs it (remember: as its
        remember_prefill)."""
        assert self.settings.one_sequence, "_prefill_one is a one-sequence engine's"
        ids, mask, positions, step, stats, cache = self._start_batch([prompt])
        probe = self._attach_probe(cache, step, 1)
        with forward_context(cache=cache):
            logits = self._prefill(ids, mask, positions, cache, step)
        if remember and self.prefills is not None and self.device.type == "cpu":
            self._remember(prompt, cache, logits)
        return RowStart(cache, stats, probe, logits)

    def _remember(self, prompt: list[int], cache, last: torch.Tensor) -> None:
        self.prefills.put(tuple(prompt), cache, last[:, None], len(prompt) * kv_bytes_per_token(self.model.config))

    def _start_batch(self, prompts: list[list[int]], masked: bool = False):
        """Left-padded ids, mask and positions of a batch, and a fresh cache of this path whose FP8 layers count
        their write statistics per row: what generation (growing or static: masked=True) and scoring start from."""
        ids, mask = left_pad(prompts, self.pad, self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # one sequence: every step checked (a one-token prompt's prefill is a decode step too); its statistics count
        # every token of a write (no pads), so a kept copy of the cache needs no step
        alone = self.settings.one_sequence
        step = StepState(valid=mask, masked=masked, check=alone, starts=tuple(ids.shape[1] - len(p) for p in prompts))
        stats = KVWriteStats(len(prompts), None if alone else step, self.device)
        cache = build_cache(self.model.config, self.backend.kv_path, self.backend.scales, stats)
        if self.backend.kv_path is not None and self.backend.kv_path.is_quantized:
            _scales_on_device(cache, self.device)
        return ids, mask, positions, step, stats, cache

    def decode_mode(self) -> str:
        """The mode generation asks for: the setting, with "auto" = graph on CUDA, dynamic elsewhere (a model
        without static storage for every layer then still decodes dynamically: `_generate_batch`)."""
        mode = self.settings.decode
        if mode == "auto":
            mode = "graph" if self.device.type == "cuda" else "dynamic"
        if mode == "graph" and self.device.type != "cuda":
            raise ValueError(f"decode mode 'graph' needs a CUDA device, the model is on {self.device}")
        return mode

    def _batch_mode(self) -> tuple[str, str | None]:
        """The decode mode this engine's batches run in, and why it is not the one asked for (None: it is): a model
        or layout without static storage decodes dynamically, a `kernel=` plug-in judged every call statically."""
        mode = self.decode_mode()
        refusal = (self._layout_refusal() or static_decode_refusal(self.model.config)) if mode != "dynamic" else None
        if refusal is not None:
            return "dynamic", f"{mode} decode refused for this model: {refusal}"
        if mode == "graph" and self.backend.route.kernel_every_call:
            return "static", EVERY_CALL_EAGER
        return mode, None

    def _generate_batch(self, items: list[tuple[list[int], int]]) -> list[RowResult]:
        mode, why = self._batch_mode()
        if why is not None:
            self._fall_back(why)
        if mode != "dynamic":
            try:
                results = self._generate_static(items, graph=mode == "graph")
            except StaticDecodeUnavailable as error:
                self._fall_back(str(error))
            else:
                self.decode_batches[mode] = self.decode_batches.get(mode, 0) + 1
                return results
        self.decode_batches["dynamic"] = self.decode_batches.get("dynamic", 0) + 1
        return self._generate_dynamic(items)

    def _finish_rows(self, logits: torch.Tensor, live: list[int], where: Sequence[int], outputs: list[list[int]],
                     finish: list, limits: list[int], on_step=None) -> tuple[torch.Tensor, list[int]]:
        """One decode step's host bookkeeping: live[i]'s logits are row where[i] of logits [batch, vocab]; a row
        ends on non-finite logits, EOS or its token limit. Returns the next ids [batch] (kept on the device as the
        next forward's input) and the i of the rows that go on. Its `.tolist()` is the step's one host sync."""
        on_device = torch.stack([torch.isfinite(logits).all(-1).long(), logits.argmax(-1)])
        return on_device[1], self._book_rows(on_device.tolist(), live, where, outputs, finish, limits, logits, on_step)

    def _book_rows(self, finite_and_next: list[list[int]], live: list[int], where: Sequence[int],
                   outputs: list[list[int]], finish: list, limits: list[int], logits=None, on_step=None) -> list[int]:
        """`_finish_rows`' host part, from [finite flags, next ids] read to the host: the i of the rows that go on."""
        keep = []
        for i, (row, at) in enumerate(zip(live, where)):
            if not finite_and_next[0][at]:
                finish[row] = "nonfinite_logits"
                continue
            if on_step is not None:  # one sequence alone
                on_step(logits[at], finite_and_next[1][at])
            if finite_and_next[1][at] == self.eos:
                finish[row] = "eos"
            else:
                outputs[row].append(finite_and_next[1][at])
                if len(outputs[row]) >= limits[row]:
                    finish[row] = "length"
                else:
                    keep.append(i)
        return keep

    def _row_results(self, outputs: list[list[int]], finish: list, stats: KVWriteStats,
                     agreements: KernelAgreement | None, probe=None) -> list[RowResult]:
        """A finished batch's rows: tokens, finish reason, and (FP8 paths) write statistics and kernel agreement;
        a one-sequence row also the implementation check's `probe`."""
        fp8_path = self.backend.kv_path is not None and self.backend.kv_path.is_quantized
        records = stats.row_records() if fp8_path else [None] * len(outputs)
        if agreements is not None:
            for record, agreement in zip(records, agreements.row_records()):
                record.update(agreement)
        if probe is not None:
            records = [{**(record or {}), **found}
                       for record, found in zip(records, probe.row_records(len(outputs)))]
        self.on_batch("generate", len(outputs))
        return [RowResult(tokens, reason or "length", record) for tokens, reason, record in zip(outputs, finish, records)]

    def _fall_back(self, why: str) -> None:
        if why not in self.decode_fallbacks:
            self.decode_fallbacks.append(why)

    def _generate_dynamic(self, items: list[tuple[list[int], int]], on_step=None, remember=None) -> list[RowResult]:
        """on_step, remember: one sequence alone (`generate_one`)."""
        prompts, limits = [p for p, _ in items], [n for _, n in items]
        rows = len(prompts)
        ids, mask, positions, step, stats, cache = self._start_batch(prompts)
        fp8_path = self.backend.kv_path is not None and self.backend.kv_path.is_quantized
        agreements = self._attach_kernels(cache, step, rows, ids.shape[1] + max(limits, default=0))
        probe = self._attach_probe(cache, step, rows)
        outputs: list[list[int]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        live = list(range(rows))  # original row of each batch position
        prompt_checked = self._checks_prompt_end(agreements)
        with forward_context(cache=cache):
            logits = self._prefill(ids, mask, positions, cache, step, prompt_checked)
            if remember is not None:
                remember(prompts[0], cache, logits)
            for decode_step in range(max(limits, default=0)):
                step_ids, keep = self._finish_rows(logits, live, range(len(live)), outputs, finish, limits, on_step)
                if not keep:
                    break
                if len(keep) < len(live):
                    index = torch.tensor(keep, device=self.device)
                    _select_rows(cache, index, stats, step, fp8_path, probe)
                    mask, positions = mask[index], positions[index]
                    live = [live[i] for i in keep]
                    step_ids = step_ids[index]
                mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
                positions = positions[:, -1:] + 1
                step.valid = mask[:, -1:]
                step.check = self._checks_step(agreements, decode_step, prompt_checked)
                logits = self._forward(step_ids.view(-1, 1), mask, positions, cache, step)
        return self._row_results(outputs, finish, stats, agreements, probe)

    def _generate_static(self, items: list[tuple[list[int], int]], graph: bool) -> list[RowResult]:
        """`_generate_dynamic` over `StaticColumns` storage: left-padded rows write the same column each step, so
        no tensor changes shape or address and (graph=True) every decode step after the first is one CUDA graph
        replay of the whole forward pass (the fp64 kernel checks run eagerly on their steps). A finished row
        stays in the batch with `valid` 0: nothing of it is stored in the paged copy, counted or checked, and its
        tokens are dropped; the batch ends when every row has finished."""
        prompts, limits = [p for p, _ in items], [n for _, n in items]
        rows = len(prompts)
        ids, mask, positions, step, stats, cache = self._start_batch(prompts, masked=True)
        width = ids.shape[1]
        max_len = width + max(limits, default=0)
        static = StaticColumns(max_len)
        try:
            make_static(cache, static)
        except ValueError as error:
            raise StaticDecodeUnavailable(str(error)) from error
        agreements = self._attach_kernels(cache, step, rows, max_len)
        probe = self._attach_probe(cache, step, rows)
        seen = torch.zeros(rows, max_len, dtype=torch.bool, device=self.device)  # the columns each row attends to
        seen[:, :width] = mask.bool()
        outputs: list[list[int]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        live = list(range(rows))
        prompt_checked = self._checks_prompt_end(agreements)
        try:
            with forward_context(cache=cache):
                logits = self._prefill_static(ids, mask, positions, cache, step, static, seen, prompt_checked,
                                              graph)
                decode = StaticDecodeStep(self, cache, step, static, seen, positions[:, -1:].clone(), graph)
                reads = AheadOfTheHost(limits, self.eos, self.device)
                steps = max(limits, default=0)
                for decode_step in range(steps):
                    # the step's token is read to the host while the next forward pass runs: that pass is launched
                    # with the rows the device computes go on (the host's rule below, `AheadOfTheHost.book`)
                    ahead = None
                    if any(len(outputs[row]) + 1 < limits[row] for row in live):  # else every row ends here
                        check = self._checks_step(agreements, decode_step, prompt_checked)
                        ahead = decode.run(reads, logits, width + decode_step, check)
                    else:
                        reads.book(logits)
                    keep = self._book_rows(reads.wait(), live, live, outputs, finish, limits)
                    if not keep:
                        break  # a pass launched ahead for rows that all ended (an EOS) stored and counted nothing
                    live = [live[i] for i in keep]
                    logits = ahead
        except StaticStorageMismatch as error:  # nothing of this batch is kept: it decodes again, growing
            raise StaticDecodeUnavailable(str(error)) from error
        return self._row_results(outputs, finish, stats, agreements, probe)

    def _prefill_static(self, ids, mask, positions, cache, step: StepState, static: StaticColumns,
                        seen: torch.Tensor, check_last: bool = False, graph: bool = False) -> torch.Tensor:
        """`_prefill` over static storage: each chunk writes its columns and attends under an explicit mask
        (`static_attend`). graph: a batch of many small chunks (`_chunk_graph`) replays its middle ones as one CUDA
        graph (`StaticPrefillChunk`)."""
        rows, length = ids.shape
        width = self._prefill_width(rows)
        keys = torch.arange(static.max_len, device=self.device)
        kinds = window_kinds(self.model.config)
        chunks = -(-length // width)
        graphed = StaticPrefillChunk(self, cache, step, static, rows, width, kinds) \
            if graph and self._chunk_graph(rows, width, length) else None
        replayable = graphed is not None or (graph and self._chunks_replayable(rows, width, length))
        logits = None
        for index, begin in enumerate(range(0, length, width)):
            end = min(length, begin + width)
            queries = torch.arange(begin, end, device=self.device)
            attend = static_attend(seen, keys, queries)
            windowed = window_masks(self.model.config, attend, keys, queries, positions[:, begin:end], kinds)
            static.length = end
            middle = 0 < index < chunks - 1
            if graphed is not None and middle:  # the first and last chunks run eagerly
                logits = graphed.run(ids[:, begin:end], positions[:, begin:end], queries, mask[:, begin:end], attend,
                                     windowed)
                if logits is not None:  # None: recording failed, the chunk runs eagerly below
                    continue
            static.columns = queries
            step.valid, step.check_last = mask[:, begin:end], check_last and end == length
            # an eager pass reads the columns up to its own (`StaticColumns.attended`, None for the last column's
            # pass: every column; the attention function cuts the mask to them), where ATTENDED_PREFIX_DEVICES says
            prefix = self.device.type in ATTENDED_PREFIX_DEVICES
            static.attended = end if prefix and end < static.max_len else None
            causal = self._causal_prefix(attend, step.starts, end - begin) if prefix else None
            try:
                # a middle chunk of a replayable batch is not sampled by the implementation check, however it runs
                # (over several GPUs, or after a failed recording): one GPU's replays of it run no Python
                with forward_context(causal_prefix=causal, unprobed=replayable and middle):
                    logits = self._forward(ids[:, begin:end], static_mask(self.model.config, attend,
                                                                           mask[:, begin:end], windowed),
                                           positions[:, begin:end], cache, step, checks_beside_pass=True)
            finally:
                static.attended = None
        step.check_last = False
        return logits

    @staticmethod
    def _causal_prefix(attend: torch.Tensor, starts: tuple[int, ...], width: int) -> CausalPrefix | None:
        """The `CausalPrefix` of a pass of `width` columns that reads the columns up to its own (its mask: causal
        over each row's real keys, a pad's query to itself alone). A padded batch's rows are attended one run of
        equal starts at a time: only for passes of at least CAUSAL_ROWS_MIN_QUERIES columns (below that, the calls
        cost more than the mask saves: `benchmarks/prefill_attention.py`)."""
        if not starts or (any(starts) and width < CAUSAL_ROWS_MIN_QUERIES):
            return None
        return CausalPrefix(attend, starts)

    def _chunk_graph(self, rows: int, width: int, length: int) -> bool:
        """Whether a static prefill replays its middle chunks as a CUDA graph: a replayable batch
        (`_chunks_replayable`) on one GPU (not layer-sharded: there they run eagerly)."""
        return self._chunks_replayable(rows, width, length) and not self.layer_sharded

    def _chunks_replayable(self, rows: int, width: int, length: int) -> bool:
        """Whether a static prefill's middle chunks are what one GPU replays as a CUDA graph: at least
        CHUNK_GRAPH_MIN of them, of at most CHUNK_GRAPH_TOKENS tokens each, on CUDA, over a cache nothing quantises
        and no fault or plug-in touches (an unquantised path's pass keeps no state on the host; a quantised one's
        write and prompt-end checks run beside its passes, eagerly; a raw or own-format prefill reads the pass's
        columns on the host, `StaticColumns.with_raw`). The implementation check samples such a batch's first and
        last chunks only, on one GPU or several."""
        kv_path = self.backend.kv_path
        plain = kv_path is None or not (kv_path.is_quantized or kv_path.fault or kv_path.kernel or kv_path.prefill_fmt
                                        or kv_path.k_scale_on_scores or kv_path.quantizes_attention)
        return (plain and self.device.type == "cuda" and rows * width <= CHUNK_GRAPH_TOKENS
                and -(-length // width) - 2 >= CHUNK_GRAPH_MIN)

    def _prefill(self, ids, mask, positions, cache, step: StepState, check_last: bool = False) -> torch.Tensor:
        """Prompt prefill in column chunks of at most PREFILL_TOKENS tokens over the batch (one chunk for
        the canaries and any batch under the budget): every token is still written before it is read.
        check_last: the decode kernel checked at the prompt's last position (`_checks_prompt_end`)."""
        rows, length = ids.shape
        width = self._prefill_width(rows)
        logits = None
        for begin in range(0, length, width):
            end = min(length, begin + width)
            step.valid, step.check_last = mask[:, begin:end], check_last and end == length
            logits = self._forward(ids[:, begin:end], mask[:, :end], positions[:, begin:end], cache, step,
                                   checks_beside_pass=True)
        step.check_last = False
        return logits

    def _prefill_width(self, rows: int) -> int:
        """Prompt columns per prefill pass: the activation budget's, or the path's own chunk (`chunked_prefill`)."""
        width = max(BLOCK_SIZE, PREFILL_TOKENS // max(rows, 1))
        kv_path = self.backend.kv_path
        return min(width, kv_path.prefill_chunk) if kv_path is not None and kv_path.prefill_chunk else width

    def _forward(self, ids, mask, positions, cache, step: StepState, checks_beside_pass: bool = False) -> torch.Tensor:
        """Last position's logits [rows, vocab] (float32), the cache advanced by `ids`. checks_beside_pass (a prefill
        pass): its write and prompt-end checks run beside it (`checks_beside`), joined before the step advances (they
        read the pass's lengths, which `advance` overwrites, and made some of the step's cached tensors)."""
        with checks_beside(self.device) if checks_beside_pass else contextlib.nullcontext():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
        step.advance()
        return out.logits[:, -1].float()

    def _attach_probe(self, cache, step: StepState, rows: int):
        """The implementation check (impl_check.py) over every row of a path's generation (None: the reference, or
        HARNESS_IMPL_CHECK=0). It sees each real query row of a prefill chunk and of every probed eager decode
        step; a decode step replayed as a CUDA graph runs no Python, so graph decode probes its eager steps only, and
        a static prefill whose middle chunks one GPU replays probes its first and last (`_chunks_replayable`)."""
        if self.backend.kv_path is None or not impl_check.enabled():
            return None
        return impl_check.attach(cache, step=step, rows=rows)

    def _checks_prompt_end(self, agreements: KernelAgreement | None) -> bool:
        """Whether a batch's first kernel check runs at its prefill, at the prompt's last position, instead of at decode
        step 0: a check computes torch's attention beside the kernel, so a checked decode step runs eagerly, while
        the prefill computes torch's attention of that position anyway. Where the prefill attends to the stored K/V
        (`quantize_current_chunk`: not `raw_prefill` or `prefill=FMT`, whose last position reads its own chunk
        unrounded). Not for a `kernel=` plug-in (every call judged) or one sequence alone (every step checked): their
        decode step 0 is checked as before."""
        kv_path = self.backend.kv_path
        return (agreements is not None and not self.backend.route.kernel_every_call and not self.settings.one_sequence
                and kv_path is not None and kv_path.quantize_current_chunk)

    def _checks_step(self, agreements: KernelAgreement | None, decode_step: int, prompt_checked: bool) -> bool:
        """Whether decode step `decode_step` checks the kernel: every `_check_every()`-th step, step 0 left out
        where the prompt's end was checked (`_checks_prompt_end`)."""
        return (agreements is not None and decode_step % self._check_every() == 0
                and not (decode_step == 0 and prompt_checked))

    def _check_every(self) -> int:
        """Decode steps between kernel checks: 1 for a `kernel=` plug-in (every call judged, docs/CONTRACTS.md),
        else the setting (one sequence alone: 1)."""
        return 1 if self.backend.route.kernel_every_call else self.settings.kernel_check_every

    def _attach_kernels(self, cache, step: StepState, rows: int, max_len: int) -> KernelAgreement | None:
        """The route's decode kernel over paged copies of `rows` rows with room for `max_len` tokens each; its
        agreement is checked on the steps the decode loop marks (`kernel_check_every`)."""
        kernel = self.backend.route.kernel
        if kernel is None:
            return None
        agreement = KernelAgreement(rows, self.device,
                                    timed=self.settings.one_sequence or self.backend.route.kernel_every_call)
        step.start_paged(rows, -(-max_len // BLOCK_SIZE), self.device)
        windows = {shape.layer: (shape.kind, shape.window) for shape in model_layers.layer_shapes(self.model.config)
                   if shape.window}
        attach_paged(cache, self.backend.kv_path, kernel, self.device, self.backend.owner.is_mla, step, agreement,
                     windows=windows)
        if self.backend.owner.is_mla:  # the model's own latent expansion, unread on the kernel's unchecked steps
            attention.skip_unread_expansion(self.model)
        return agreement

    # -- teacher-forced scoring -------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Log-probs [T, V] float32 (CPU) of each continuation given its prompt, as `score_sync` computes them:
        prompt and continuation in two chunks (one token at a time for a `raw_prefill` path)."""
        vocab = model_layers.field(self.model.config, "vocab_size")
        items = [(i, list(p), list(c)) for i, (p, c) in enumerate(zip(prompts, continuations)) if len(c)]
        longest = max((len(p) + len(c) for _, p, c in items), default=0)
        scored = dict(zip([i for i, _, _ in items], self._in_batches(items, self._score_batch, longest)))
        return [scored.get(i, torch.zeros(0, vocab)) for i in range(len(prompts))]

    def _score_batch(self, items: list) -> list[torch.Tensor]:
        prompts, continuations = [p for _, p, _ in items], [c[:-1] for _, _, c in items]
        ids, mask, positions, step, _, cache = self._start_batch(prompts)
        last = None
        if self.prefills is not None and len(prompts) == 1:
            # one sequence: this prompt's prefill, kept by `generate_one` (the same forward pass on the same input
            # over a fresh cache of the same path, so the same bits)
            kept, last = self.prefills.take(tuple(prompts[0]))
            cache = kept if kept is not None else cache
        # the attention function reads the path's attention-side options (k_scale_on_scores, FP8 q/P, faults)
        # from the forward context: without its cache, teacher-forced scoring of such a path was the reference's
        with forward_context(cache=cache):
            return self._score_rows(ids, mask, positions, step, cache, continuations, last)

    def _score_rows(self, ids, mask, positions, step, cache, continuations, last=None) -> list[torch.Tensor]:
        """last: the prompt's last logits [rows, 1, vocab] float32 when the cache already holds the prompt."""
        kv_path = self.backend.kv_path
        if last is None and kv_path is not None and kv_path.prefill_chunk:  # the prompt as its generation prefilled it
            static = self._static_scoring(ids, continuations, cache)
            if static is not None:
                return self._score_static(ids, mask, positions, step, cache, continuations, static)
            last = self._prefill(ids, mask, positions, cache, step)[:, None]
        elif last is None:
            last = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                              **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
            last = last.logits[:, -1:].float()
        longest = max(len(c) for c in continuations)
        cont_ids, cont_mask = right_pad(continuations, self.pad, self.device)
        cont_positions = positions[:, -1:] + 1 + torch.arange(longest, device=self.device)[None, :]
        chunks = [(0, longest)] if kv_path is None or kv_path.quantize_current_chunk else \
            [(j, j + 1) for j in range(longest)]
        rows_logits = [last]
        for begin, end in chunks:
            if end <= begin:
                continue
            mask = torch.cat([mask, cont_mask[:, begin:end]], dim=1)
            step.valid = cont_mask[:, begin:end]
            out = self.model(input_ids=cont_ids[:, begin:end], attention_mask=mask,
                             position_ids=cont_positions[:, begin:end], **cache_kwargs(self.model, cache),
                             use_cache=True)
            rows_logits.append(out.logits.float())
        return self._scored(torch.cat(rows_logits, dim=1), continuations)

    def _scored(self, logits: torch.Tensor, continuations) -> list[torch.Tensor]:
        """Each row's log-probs [len(continuation) + 1, vocab] (CPU) from its logits [rows, columns, vocab]."""
        logprobs = torch.log_softmax(logits, dim=-1)
        self.on_batch("score", len(continuations))
        return [logprobs[r, :len(continuations[r]) + 1].cpu() for r in range(len(continuations))]

    def _static_scoring(self, ids, continuations, cache) -> StaticColumns | None:
        """Static storage for scoring a path that prefills in chunks, where its generation prefills on it and replays
        the middle chunks as a CUDA graph (graph decode, `_chunk_graph`): the prompt is prefilled as the generation
        prefilled it, in the same passes. None where scoring grows its cache instead (CPU, dynamic or static decode,
        a layout or layer kind without static storage, chunks too few or too large to replay)."""
        rows, width = ids.shape
        if self._batch_mode()[0] != "graph" or not self._chunk_graph(rows, self._prefill_width(rows), width):
            return None
        static = StaticColumns(width + max(len(c) for c in continuations))
        try:
            make_static(cache, static)
        except ValueError:
            return None
        return static

    def _score_static(self, ids, mask, positions, step, cache, continuations, static: StaticColumns
                      ) -> list[torch.Tensor]:
        """`_score_rows` over static storage: the prompt through `_prefill_static` (its middle chunks one CUDA graph),
        then the continuations (right-padded) in one pass at the next columns, each real token attending to its row's
        real prompt and continuation tokens up to itself, a pad to itself."""
        width = ids.shape[1]
        seen = torch.zeros(len(continuations), static.max_len, dtype=torch.bool, device=self.device)
        seen[:, :width] = mask.bool()
        last = self._prefill_static(ids, mask, positions, cache, step, static, seen, graph=True)[:, None]
        longest = static.max_len - width
        if not longest:  # one-token continuations: the prompt's last position scores them
            return self._scored(last, continuations)
        cont_ids, cont_mask = right_pad(continuations, self.pad, self.device)
        seen[:, width:] = cont_mask.bool()
        cont_positions = positions[:, -1:] + 1 + torch.arange(longest, device=self.device)[None, :]
        keys = torch.arange(static.max_len, device=self.device)
        queries = keys[width:]
        attend = static_attend(seen, keys, queries)
        windowed = window_masks(self.model.config, attend, keys, queries, cont_positions)
        static.columns, static.length = queries, static.max_len
        step.valid = cont_mask
        out = self.model(input_ids=cont_ids, attention_mask=static_mask(self.model.config, attend, cont_mask, windowed),
                         position_ids=cont_positions, **cache_kwargs(self.model, cache), use_cache=True)
        return self._scored(torch.cat([last, out.logits.float()], dim=1), continuations)


class StaticDecodeUnavailable(RuntimeError):
    """Static decode cannot run this batch (a cache layer without static storage): the engine decodes it with
    the growing cache and names why in the run."""


class AheadOfTheHost:
    """A static decode loop's reads of each step's tokens, taken while the next forward pass runs. The host's rule for
    a row (`BatchedEngine._book_rows`: it ends on non-finite logits, EOS or its token limit) is computed on the device
    too, so the next pass can be launched with the rows that go on before the host has read the step: a decode step
    no longer waits for the host's bookkeeping and launches (8B-shaped b32 1k, H200: ~0.45 ms of a ~10 ms step,
    session 28). `book` computes them on the device and enqueues their read; `wait` returns the read [finite flags,
    next ids] as lists."""

    def __init__(self, limits: list[int], eos: int | None, device: torch.device):
        self.eos = -1 if eos is None else eos
        self.limits = torch.tensor(limits, dtype=torch.long, device=device)
        self.produced = torch.zeros(len(limits), dtype=torch.long, device=device)
        self.going_on = torch.ones(len(limits), dtype=torch.bool, device=device)
        self.booked = torch.empty(2, len(limits), dtype=torch.long, device=device)  # [finite flags, next ids]
        cuda = torch.device(device).type == "cuda"
        self.host = torch.empty(2, len(limits), dtype=torch.long, pin_memory=cuda)
        self.read = torch.cuda.Event() if cuda else None

    def book(self, logits: torch.Tensor) -> None:
        """The step's tokens and the rows going on (`advance`), then their read enqueued (`read_to_host`)."""
        self.advance(logits)
        self.read_to_host()

    def advance(self, logits: torch.Tensor) -> None:
        """The device's part of a step, in place (so that a CUDA graph can hold it: `StaticDecodeStep`): `booked` is
        [finite flags, next ids] of `logits` [rows, vocab], and `going_on` the host's rule for each row."""
        finite, next_ids = torch.isfinite(logits).all(-1), logits.argmax(-1)
        torch.stack([finite.long(), next_ids], out=self.booked)
        emitted = self.going_on & finite & (next_ids != self.eos)
        self.produced += emitted.long()
        torch.bitwise_and(emitted, self.produced < self.limits, out=self.going_on)

    def read_to_host(self) -> None:
        self.host.copy_(self.booked, non_blocking=self.read is not None)
        if self.read is not None:
            self.read.record()

    def wait(self) -> list[list[int]]:
        if self.read is not None:
            self.read.synchronize()
        return self.host.tolist()


def recorded(device: torch.device, function):
    """(a CUDA graph of `function()`, what it returned): recorded, not run (replay it), on a side stream as
    `torch.cuda.graph` does, without its `synchronize()` + `empty_cache()`, which hand every cached block back to the
    driver once per batch (canaries, H100: 13.3 vs 16.1 ms per capture; at 8B shape the freed blocks would be
    allocated again)."""
    graph = torch.cuda.CUDAGraph()
    stream = own_stream("capture", device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                out = function()
            finally:
                graph.capture_end()
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)
    return graph, out


class GraphedPass:
    """A forward pass over static storage that is recorded once into a CUDA graph and replayed (`StaticDecodeStep`,
    `StaticPrefillChunk`). A subclass sets engine, step, device, graph (whether to record), captured (the graph),
    logits (the recorded pass's output buffer), `_forward`, and `instead`: how its passes go on where recording
    fails, as the run names it."""

    instead: str

    def _capture(self) -> bool:
        """Record one forward pass into a CUDA graph (recording runs nothing: the caller replays it). False when
        capture failed; the batch then goes on eagerly on the same storage, and the run names why. One capture at
        a time in the process, none beside a device-wide act of another thread (`DEVICE_WIDE`)."""
        with DEVICE_WIDE:
            return self._capture_held()

    def _capture_held(self) -> bool:
        try:
            self.captured = self._record()
        except torch.OutOfMemoryError:
            # the graph's private pool cannot take blocks the allocator holds for the eager passes (gpt-oss-20b
            # at 16 x 8k, one H200: the prefill's eager attention left ~100 GiB cached, 40 GiB allocated, and every
            # batch's capture ran out): hand the cached blocks back once and record again
            self.step._cached.clear()  # noqa: SLF001 - tensors made while recording are not valid outside it
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            try:
                self.captured = self._record()
            except Exception as error:  # noqa: BLE001
                return self._capture_failed(error)
        except Exception as error:  # noqa: BLE001 - named in the run; nothing recorded has run, no state moved
            return self._capture_failed(error)
        return True

    def _record(self) -> "torch.cuda.CUDAGraph | SegmentedGraph":
        if self.engine.layer_sharded:  # one graph per GPU, in the order the pass runs them
            graph = SegmentedGraph()
            self.logits = graph.record(self._forward)
            self.engine.graph_segments.add(" > ".join(graph.devices))
            return graph
        graph, self.logits = recorded(self.device, self._forward)
        return graph

    def _capture_failed(self, error: Exception) -> bool:
        self.graph, self.logits, self.captured = False, None, None
        self.step._cached.clear()  # noqa: SLF001 - tensors made while recording are not valid outside it
        self.engine._fall_back(f"CUDA graph capture failed, {self.instead}: "  # noqa: SLF001
                               f"{type(error).__name__}: {error}"[:300])
        return False


class StaticDecodeStep(GraphedPass):
    """One batch's decode step over static storage: fixed input buffers (ids, positions, the write column, the
    rows still generating, the attention mask) updated in place, then the forward pass run eagerly or as a
    CUDA graph captured once and replayed. The engine's first decode step runs eagerly (it does every lazy
    initialisation: Triton compiles, library handles, absorbed MLA weights); checked steps run eagerly too:
    their fp64 agreement check asks the host how long the rows are (a batch's first check runs in its prefill:
    `BatchedEngine._checks_prompt_end`)."""

    instead = "decoded eagerly on static storage"

    def __init__(self, engine: "BatchedEngine", cache, step: StepState, static: StaticColumns, seen: torch.Tensor,
                 last_positions: torch.Tensor, graph: bool):
        self.engine, self.cache, self.step, self.static, self.seen = engine, cache, step, static, seen
        rows, device = seen.shape[0], seen.device
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = last_positions
        self.valid = torch.ones(rows, 1, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        # a windowed layer type's mask: a buffer rewritten before each step (the window moves), read in place by a
        # captured graph; the full-attention mask is a view of `seen`
        self.keys = torch.arange(seen.shape[1], device=device)
        # the windowed layer types, read once: reading them walks every layer's config (~20 ms a step for a
        # 24-layer gpt-oss under transformers 5.17, session 22), and the window moves every step
        self.window_kinds = window_kinds(engine.model.config)
        self.windowed = window_masks(engine.model.config, seen[:, None, None, :], self.keys, self.column,
                                     self.positions, self.window_kinds)
        self.mask = static_mask(engine.model.config, seen[:, None, None, :], None, self.windowed)
        self.device, self.graph = device, graph
        self.captured: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the captured pass's output buffer
        self.prepared: torch.cuda.CUDAGraph | bool | None = None  # `_prepare` recorded (False: run eagerly)
        self.eager_steps = 0

    def run(self, reads: AheadOfTheHost, logits: torch.Tensor, column: int, check: bool) -> torch.Tensor:
        """Book `logits` (the step before's, [rows, vocab]: `reads.book`) and feed its tokens at `column`, the rows
        still generating masked by the device's rule; returns this pass's logits."""
        self.column.fill_(column)
        if not self._prepare_replayed(reads, logits):
            self._prepare(reads, logits)
        reads.read_to_host()
        self.static.columns, self.static.length = self.column, column + 1
        self.step.valid, self.step.check = self.valid, check
        if self.windowed:
            moved = window_masks(self.engine.model.config, self.seen[:, None, None, :], self.keys, self.column,
                                 self.positions, self.window_kinds)
            for kind, buffer in self.windowed.items():
                buffer.copy_(moved[kind])
        if not self.graph or check or not (self.eager_steps or self.engine.decode_warm):
            self.eager_steps += 1
            out = self._forward()
            self.engine.decode_warm = True
            return out
        if self.captured is None and not self._capture():
            return self._forward()
        self.captured.replay()
        return self.logits

    def _prepare(self, reads: AheadOfTheHost, logits: torch.Tensor) -> None:
        """The step's inputs from the step before's logits, every op on the device (`column` already set)."""
        reads.advance(logits)
        self.ids.copy_(reads.booked[1].view(-1, 1))
        self.positions.add_(1)
        self.seen.index_fill_(1, self.column, True)
        self.valid.copy_(reads.going_on.view(-1, 1))

    def _prepare_replayed(self, reads: AheadOfTheHost, logits: torch.Tensor) -> bool:
        """`_prepare` as one CUDA graph replay, recorded at its first use, where `logits` is this pass's own output
        buffer (every replayed step after the first; after a prefill or an eagerly run step the logits are new, and
        it runs eagerly): ~20 small ops a step become one launch, host time that a graph-decoded step had spent
        beside its one replay. The same kernels on the same buffers: the same bits. False where it runs eagerly:
        no graph decode, a moving window (its masks are remade on the host each step), layers over several GPUs,
        or recording failed (named in the run)."""
        if not self.graph or logits is not self.logits or self.windowed or self.engine.layer_sharded \
                or self.prepared is False:
            return False
        if self.prepared is None:
            with DEVICE_WIDE:  # one capture at a time in the process (`GraphedPass._capture`)
                self.prepared = self._record_prepare(reads)
            if self.prepared is False:
                return False
        self.prepared.replay()
        return True

    def _record_prepare(self, reads: AheadOfTheHost) -> "torch.cuda.CUDAGraph | bool":
        try:
            graph, _ = recorded(self.device, lambda: self._prepare(reads, self.logits))
        except Exception as error:  # noqa: BLE001 - recording ran nothing: the step's inputs are made eagerly
            self.engine._fall_back(f"CUDA graph capture of a decode step's inputs failed, made eagerly: "  # noqa: SLF001
                                   f"{type(error).__name__}: {error}"[:300])
            return False
        return graph

    def _forward(self) -> torch.Tensor:
        return self.engine._forward(self.ids, self.mask, self.positions, self.cache, self.step)  # noqa: SLF001

class StaticPrefillChunk(GraphedPass):
    """The middle chunks of one batch's static prefill (all of one width): fixed input buffers (ids, positions, the
    columns written, the real tokens, the attention masks) rewritten before each chunk, the pass recorded into a CUDA
    graph at the first of them and replayed for the others. The control arm prefills in 32-token chunks (49 passes
    of 21 rows for the canaries' longest prompt), each bound by the host's launches; a replay launches the pass at
    once. The batch's first chunk runs eagerly (lazy initialisation: a hybrid's states start there) and so does its
    last (the prompt-end kernel check, the logits the decode goes on from). A replay runs no Python: the
    implementation check (impl_check.py) probes the first and last chunks, as graph decode probes its eager steps,
    and leaves the middle ones unprobed however they run (eagerly over several GPUs, or after a failed recording, so
    the sample does not hang on the layout). Where recording fails, the chunks run eagerly, and the run names why."""

    instead = "prefilled eagerly"

    def __init__(self, engine: "BatchedEngine", cache, step: StepState, static: StaticColumns, rows: int, width: int,
                 kinds: dict):
        self.engine, self.cache, self.step, self.static, self.device = engine, cache, step, static, engine.device
        self.ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        self.positions = torch.zeros_like(self.ids)
        self.columns = torch.zeros(width, dtype=torch.long, device=self.device)
        self.valid: torch.Tensor | None = None  # [rows, width] in the prompt mask's dtype, made at the first chunk
        self.attend = torch.zeros(rows, 1, width, static.max_len, dtype=torch.bool, device=self.device)
        self.windowed = {kind: torch.zeros_like(self.attend) for kind in kinds}
        self.graph, self.captured, self.logits = True, None, None

    def run(self, ids, positions, columns, valid, attend, windowed) -> torch.Tensor | None:
        """One middle chunk: ids, positions, valid [rows, width]; columns [width]; attend and each windowed mask
        [rows, 1, width, max_len]. Returns its last position's logits (the recorded pass's buffer), or None where
        recording failed: the caller then runs the chunk eagerly, as its first and last."""
        if not self.graph:
            return None
        if self.valid is None:
            self.valid = torch.zeros_like(valid)
        for buffer, value in ((self.ids, ids), (self.positions, positions), (self.columns, columns),
                              (self.valid, valid), (self.attend, attend)):
            buffer.copy_(value)
        for kind, buffer in self.windowed.items():
            buffer.copy_(windowed[kind])
        self.static.columns, self.step.valid, self.step.check_last = self.columns, self.valid, False
        if self.captured is None and not self._capture():
            return None
        self.captured.replay()
        return self.logits

    def _forward(self) -> torch.Tensor:
        mask = static_mask(self.engine.model.config, self.attend, self.valid, self.windowed)
        return self.engine._forward(self.ids, mask, self.positions, self.cache, self.step)  # noqa: SLF001


def static_attend(seen: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[rows, 1, queries, columns] bool: what each query column of a static pass attends to, the real tokens (`seen`
    [rows, columns]) up to itself, causally; a pad query attends to itself, so no row of the mask is empty. keys:
    every column's index; queries: the pass's columns."""
    return (seen[:, None, None, :] & (keys[None, :] <= queries[:, None])) | (keys[None, :] == queries[:, None])


def static_mask(config, attend: torch.Tensor, linear_mask: torch.Tensor | None,
                windowed: dict[str | None, torch.Tensor] | None = None):
    """The `attention_mask` a static pass hands the model: the 4D bool mask (transformers uses a 4D mask as
    given); windowed: each windowed layer type's mask (`window_masks`); a model with several layer types gets one
    mask per type (a hybrid model's linear-attention and convolution layers their padding mask [rows, chunk], None
    when decoding: a generated token is never padding)."""
    windowed = windowed or {}
    if None in windowed:  # one window over every layer (Mistral's): the model takes one mask
        return windowed[None]
    types = set(model_layers.layer_types(config)) - set(NO_CACHE_TYPES)
    if "hybrid" in types:  # attention and an SSM in one layer (Falcon-H1): the model reads both masks
        types = types - {"hybrid"} | {"full_attention", "linear_attention"}
    if types <= {"full_attention"}:
        return attend
    recurrent = {"linear_attention", "conv"}  # padding masks of the SSM / convolution layers
    masks = {kind: windowed.get(kind, attend) for kind in types - recurrent}
    masks.update({kind: linear_mask for kind in types & recurrent})
    return masks


def window_masks(config, attend: torch.Tensor, keys: torch.Tensor, query_columns: torch.Tensor,
                 query_positions: torch.Tensor, kinds: dict | None = None) -> dict[str | None, torch.Tensor]:
    """`attend` [rows, 1, queries, columns] narrowed to each windowed layer type's keys (None: the one window of a
    model without layer types), as transformers' masks narrow them (`masking_utils`: a sliding window keeps keys with
    kv_idx > q_idx - window; a chunk keeps keys of the query's chunk of positions, `chunked_overlay`). A row's tokens
    sit in consecutive columns, so a key's position is its column's offset from the query's: keys [columns],
    query_columns [queries], query_positions [rows, queries]. A pad query keeps itself (`attend`'s diagonal). kinds:
    `window_kinds(config)` where the caller keeps it (None: read here)."""
    found: dict[str | None, torch.Tensor] = {}
    for kind, window in (window_kinds(config) if kinds is None else kinds).items():
        query = query_positions[:, None, :, None]
        key = keys - query_columns[:, None] + query  # [rows, 1, queries, columns]
        if (kind or "sliding_attention") == "sliding_attention":
            kept = key > query - window
        else:
            kept = torch.div(key, window, rounding_mode="floor") == torch.div(query, window, rounding_mode="floor")
        found[kind] = attend & kept
    return found


def window_kinds(config) -> dict[str | None, int]:
    """{windowed layer type: its window} (None: a model without layer types whose every layer has one window)."""
    shapes = [s for s in model_layers.layer_shapes(config) if s.window]
    if not shapes:
        return {}
    if not model_layers.field(config, "layer_types"):
        return {None: shapes[0].window}
    return {s.kind: s.window for s in shapes}


# -- helpers ------------------------------------------------------------------------------------------
def left_pad(sequences: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return _pad(sequences, pad, device, left=True)


def right_pad(sequences: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return _pad(sequences, pad, device, left=False)


def _pad(sequences: Sequence[Sequence[int]], pad: int, device, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) [rows, longest] long: each sequence at the right (left=True) or left end of its row."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            where = slice(longest - len(s), None) if left else slice(None, len(s))
            ids[i, where] = torch.tensor(s)
            mask[i, where] = 1
    return ids.to(device), mask.to(device)


def _scales_on_device(cache, device) -> None:
    """Quantised layers keep their static scales on the device (same values; no host-to-device copy, hence no
    sync, per layer and step)."""
    for layer in cache.layers:
        if hasattr(layer, "kv_path"):
            layer.k_scale = layer.k_scale.to(device) if layer.k_scale is not None else None
            layer.v_scale = layer.v_scale.to(device) if layer.v_scale is not None else None
            quant = getattr(layer, "attn_quant", None)  # FP8 attention's q / prob scales (a CUDA graph copies none)
            if quant is not None:
                q = quant.q_scale.to(device) if isinstance(quant.q_scale, torch.Tensor) else quant.q_scale
                prob = quant.prob_scale.to(device) if quant.prob_scale is not None else None
                layer.attn_quant = dataclasses.replace(quant, q_scale=q, prob_scale=prob)


def _select_rows(cache, index: torch.Tensor, stats: KVWriteStats, step: StepState, fp8_path: bool,
                 probe=None) -> None:
    for layer in cache.layers:
        layer.reorder_cache(index)
    step.select(index)
    if fp8_path:
        stats.select(index)
    if probe is not None:
        probe.select(index)


def _free_cuda() -> None:
    if torch.cuda.is_available():
        with DEVICE_WIDE:  # not while another thread captures a graph (the allocator asserts none is under way)
            torch.cuda.empty_cache()


def kv_bytes_per_token(config) -> int:
    """Bytes of bf16 KV per token over all layers, each at its own KV heads and head size (MLA: latent + rope; an
    upper bound for hybrids): `harness.model_layers.kv_bytes_per_token`."""
    return model_layers.kv_bytes_per_token(config)


# Models replayed at once on one GPU (`executor.local.ModelThreads` sets it in each of its threads): each plans its
# batches in this share of the free memory (`auto_batch_size`)
GPU_SHARERS: contextvars.ContextVar[int] = contextvars.ContextVar("gpu_sharers", default=1)


def auto_batch_size(model, device: torch.device, max_len: int, items: int) -> int:
    """Sequences per batch from free GPU memory: half of it over one sequence's footprint at `max_len` tokens
    (its cache, one forward pass's activations over all its tokens, its logits); everything on CPU.

    Where each term comes from (bytes; per token unless said):
    - cache, 2 x `kv_bytes_per_token` (the bf16 K/V of all layers): an FP8 layer keeps its bf16 round trip (1x),
      the decode kernel's paged FP8 copy (1 byte an element: 0.5x), and while a `DynamicCache` layer grows,
      torch.cat holds its old and new copy (one layer at a time: 1/layers x) plus the copy's page rounding; the
      0.5x left covers these two. Derived from the storage, not measured.
    - activations, 2 bytes (bf16) x the widths alive at once in one decoder layer when all of a sequence's tokens
      go through in one pass (scoring passes a whole prompt at once): residual and normed input (2 x hidden), q,
      k, v and the attention output (<= 4 x hidden), the MLP's gate, up and their product (3 x its width: the
      dense `intermediate_size`, or top-k x `moe_intermediate_size` where that is wider). Read from the config.
    - logits, vocab x 4 / 64: an fp32 row for 1 token in 64 of the sequence, scoring's [rows, reply, vocab]
      float32 copies amortised over the whole length. A guess: scoring holds about 14 bytes x vocab per scored
      token (bf16 logits, their float32 copy, the concatenation, log_softmax), and the scored reply's length is
      not passed here; the out-of-memory halving of `_in_batches` catches an underestimate.
    - per sequence, vocab x 8: the last position's logits, the model's bf16 row (2) and its float32 copy (4).
    - the Mamba-2 scan's working set (`ssm_scan_bytes`, measured: tests/test_families.py).
    - 0.5 of free memory: headroom for what the terms leave out (allocator fragmentation, CUDA-graph pools,
      kernel workspaces). A margin, not a measurement; an over-large batch costs one failed attempt and a
      halving (`_in_batches`), never a result.
    On tensor-parallel ranks free memory is the least over the ranks (`tensor_parallel.min_across_ranks`), so every
    rank cuts the same batches. Where several models replay at once on the GPU (`GPU_SHARERS`), each plans in an
    equal share of what is free."""
    if device.type != "cuda" or items == 0:
        return max(1, items)
    free, _ = torch.cuda.mem_get_info(device)
    free = min_across_ranks(free)  # tensor-parallel ranks cut the same batches: the least free memory of any
    free //= GPU_SHARERS.get()  # models replayed at once on this GPU: each plans in its share
    config = model.config
    hidden, vocab = model_layers.field(config, "hidden_size"), model_layers.field(config, "vocab_size")
    widest = model_layers.field(config, "intermediate_size")  # a list where each layer has its own (Gemma 3n)
    widest = max(widest) if isinstance(widest, (list, tuple)) else widest
    mlp = max(widest or 4 * hidden,
              (model_layers.field(config, "num_experts_per_tok") or 0)
              * (model_layers.field(config, "moe_intermediate_size") or 0))
    activations = 2 * (2 * hidden + 4 * hidden + 3 * mlp)
    per_token = kv_bytes_per_token(config) * 2 + activations + vocab * 4 // 64
    per_sequence = max(1, max_len) * per_token + vocab * 8 + ssm_scan_bytes(config, max_len)
    return max(1, min(items, MAX_AUTO_BATCH, int(free * 0.5 // per_sequence)))
