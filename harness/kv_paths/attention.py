"""The attention function every in-process backend runs through, and the FP8 decode-kernel path.

Registered with transformers as `harness`: it runs SDPA, lets a per-module observer see q/k/v/output,
and, for decode steps of a cache layer that keeps a paged FP8 copy (`PagedKV`), returns the output of
the path's decode plug-in (default: our `kernels.decode_attention`, or `kernels.mla_decode` with absorbed
projections for MLA; `decode_kernels.py`) while measuring its agreement with fp64 attention over the same
stored codes (`KernelAgreement`). One paged type serves both engines: a batch has one row per sequence, a
sequence replayed alone is a batch of one row (`one_sequence`); `attach_paged` is the one place a kernel is
attached to a cache.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from harness.forward_context import current as forward_context_now
from harness.forward_context import note as note_forward
from harness.forward_context import on_checks_stream, sdpa_only
from harness.kv_paths import block_layout, mla
from harness.kv_paths.decode_kernels import (BEYOND_SDPA_COMPUTED, DecodeKernel, KernelPluginError, kernels_setting,
                                             resolve, run_gqa, run_gqa_block_scaled, run_mla, run_mla_block_scaled)
from harness.kv_paths.faults import attention_fault
from harness.kv_paths.rotation import rotate
from kernels import reference as kernel_reference

ATTENTION_NAME = "harness"
BLOCK_SIZE = 16  # tokens per page of the paged cache
# fp64 cache elements a kernel-agreement check reads back at once (rows are checked in groups under it)
CHECK_ELEMENTS = 1 << 26
ADDITIVE_MASK = "additive_mask"  # a float mask the model built itself (Doge's dynamic mask): SDPA adds it as given
# Attention arguments SDPA does not compute, by the name models hand them to the attention function: gpt-oss's sinks
# (`s_aux`), Inkling's sinks and relative position bias, Gemma 2's logit soft-capping. A call with any of them runs
# the model's own eager attention; our decode kernels and the FP8-attention reference compute none of them.
BEYOND_SDPA = {"s_aux": "attention sinks", "sinks": "attention sinks", "position_bias": "a position bias",
               "softcap": "logit soft-capping", ADDITIVE_MASK: "an additive bias in its attention mask"}


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


class KernelAgreement:
    """A decode kernel's output against fp64 attention over the same stored codes, per sequence (row) of a batch (a
    sequence replayed alone is a batch of one row). Kept on the device while the batch decodes (no host sync per
    layer): steps [rows] int64, max_abs_err / max_ratio [rows] fp64, folded once at the end (`row_records`).
    `step_s`: the wall time of each kernel call over the rows it computed, when `timed` (device synchronised before and
    after: one sequence alone, and every call of a `kernel=` plug-in in a batch; our kernels' calls in a batch, some
    inside CUDA graphs, are not timed)."""

    def __init__(self, rows: int = 1, device="cpu", timed: bool = False):
        self.steps = torch.zeros(rows, dtype=torch.int64, device=device)
        self.max_abs_err = torch.zeros(rows, dtype=torch.float64, device=device)  # max |kernel - fp64|
        # max of kernel error / SDPA bf16 error (torch's own error at this precision)
        self.max_ratio = torch.zeros(rows, dtype=torch.float64, device=device)
        self.timed = timed
        self.step_s: list[float] = []

    def add(self, rows: torch.Tensor, kernel_err: torch.Tensor, ratio: torch.Tensor) -> None:
        """One check of live rows `rows` (distinct original rows). A NaN never raises a maximum, as Python's
        `max(0.0, nan)` did when this was folded on the host."""
        # a layer on another GPU than the batch's (a layer-sharded model) checks there: its results come here
        rows, kernel_err, ratio = (t.to(self.steps.device) for t in (rows, kernel_err, ratio))
        self.steps.index_add_(0, rows, torch.ones_like(rows))
        for running, found in ((self.max_abs_err, kernel_err), (self.max_ratio, ratio)):
            running.scatter_reduce_(0, rows, torch.where(found.isnan(), 0.0, found), "amax")

    def row_records(self) -> list[dict[str, float]]:
        """Per row: checked steps, the largest error and ratio, and `kernel_ms_per_step` only where calls were
        timed (an untimed batch stores no time: unmeasured, never 0)."""
        # median, so a first call's JIT compilation (seconds, once per process) does not count
        timed = {"kernel_ms_per_step": 1e3 * statistics.median(self.step_s)} if self.step_s else {}
        found = zip(self.steps.tolist(), self.max_abs_err.tolist(), self.max_ratio.tolist())
        return [{"kernel_steps": float(steps), "kernel_max_abs_err": err, "kernel_err_ratio": ratio, **timed}
                for steps, err, ratio in found]

    def as_record(self) -> dict[str, float]:
        """The one sequence's record (a batch of one row)."""
        assert self.steps.numel() == 1, f"as_record is one sequence's; this batch has {self.steps.numel()} rows"
        return self.row_records()[0]


@dataclass
class StepState:
    """What the current forward pass writes: which tokens are real, whether kernels are checked, and, when
    decode runs through a kernel, where each live row's tokens go in the paged copies. Slots, lengths and
    the block table are the same for every layer: computed once per forward pass, advanced after it (`advance`)."""

    valid: torch.Tensor | None = None  # [rows, chunk]
    check: bool = False
    # a prompt's last prefill chunk: the decode kernel checked at its last position (`PagedKV.check_prompt_end`)
    check_last: bool = False
    batch_rows: int = 0
    pages_per_row: int = 0
    rows: torch.Tensor | None = None  # [live rows] original row (int64); None: no paged copies
    lengths: torch.Tensor | None = None  # [live rows] int32, tokens stored before this forward pass
    # static decode: finished rows stay in the batch with `valid` 0 (nothing stored, counted or checked for them)
    masked: bool = False
    # each row's first real column (its left pads; on the host), where the batch was left-padded from prompts
    starts: tuple[int, ...] = ()
    _cached: dict = field(default_factory=dict)

    def start_paged(self, rows: int, pages_per_row: int, device) -> None:
        self.batch_rows, self.pages_per_row = rows, pages_per_row
        self.rows = torch.arange(rows, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.int32, device=device)
        self._cached.clear()

    def slots(self) -> torch.Tensor:
        """[live rows * chunk] int64 slot of each token of this pass (-1 for pads), row-major."""
        if "slots" not in self._cached:
            valid = self.valid.bool()
            offsets = self.lengths[:, None].long() + valid.long().cumsum(1) - 1
            slots = self.rows[:, None] * (self.pages_per_row * BLOCK_SIZE) + offsets
            self._cached["slots"] = torch.where(valid, slots, torch.full_like(slots, -1)).reshape(-1)
        return self._cached["slots"]

    def row_masks(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows, 1, chunk, 1] bool real-token mask, [rows] int64 real tokens) of this pass, for `KVWriteStats`."""
        key = ("row_masks", str(device))  # a layer-sharded model's layers ask from their own GPUs
        cached = self._cached.get(key)
        if cached is None or cached[0] is not self.valid:  # keyed by the tensor: scoring sets `valid` per chunk
            rows_valid = self.valid.to(device).bool()
            cached = self._cached[key] = (self.valid, rows_valid[:, None, :, None], rows_valid.sum(1))
        return cached[1], cached[2]

    def live(self, device) -> torch.Tensor:
        """Static decode: the batch positions still generating this pass (one host sync per checked step, shared
        by every layer)."""
        key = ("live", str(device))  # a layer-sharded model's layers ask from their own GPUs
        if key not in self._cached:
            self._cached[key] = torch.tensor(self.host_live(), dtype=torch.long, device=device)
        return self._cached[key]

    def host_live(self) -> list[int]:
        """`live` on the host (read once per pass)."""
        if "host_live" not in self._cached:
            self._cached["host_live"] = [i for i, v in enumerate(self.valid[:, -1].tolist()) if v]
        return self._cached["host_live"]

    def span(self) -> int:
        """Longest stored length after this pass (one host sync per checked step, shared by every layer)."""
        return max(self.host_lengths(), default=0)

    def host_lengths(self) -> list[int]:
        """Each row's stored length after this pass, read to the host once per pass and shared by every layer: a
        check's groups of rows take their spans from it (one read per group and layer before: 203 host waits in an
        8B-shaped 16 x 8k FP8 prefill; the GPU had work queued through them, so removing them saved no time,
        BENCHMARKS.md session 27)."""
        if "host_lengths" not in self._cached:
            self._cached["host_lengths"] = self.lengths_after().tolist()
        return self._cached["host_lengths"]

    def lengths_after(self) -> torch.Tensor:
        if "after" not in self._cached:
            self._cached["after"] = self.lengths + self.valid.sum(1).to(torch.int32)
        return self._cached["after"]

    def block_table(self) -> torch.Tensor:
        if "table" not in self._cached:
            base = (self.rows * self.pages_per_row).to(torch.int32)
            pages = torch.arange(self.pages_per_row, dtype=torch.int32, device=base.device)
            self._cached["table"] = base[:, None] + pages[None, :]
        return self._cached["table"]

    def advance(self) -> None:
        """After a forward pass: its tokens are stored (in place: a captured decode step replays this too)."""
        if self.rows is not None and self.valid is not None:
            self.lengths.copy_(self.lengths_after())
        self._cached.clear()

    def select(self, live: torch.Tensor) -> None:
        if self.rows is not None:
            self.rows, self.lengths = self.rows[live], self.lengths[live]
        self._cached.clear()


def one_sequence(tokens: int, device) -> StepState:
    """The step of one sequence (a batch of one row, no pads) with room for `tokens` tokens in its paged copies;
    the caller sets `valid` to the chunk before each forward pass and calls `advance` after it."""
    step = StepState(check=True)
    step.start_paged(1, -(-max(tokens, 1) // BLOCK_SIZE), device)
    return step


def chunk_of(step: StepState | None, tokens: int, device) -> None:
    """Before a forward pass of one sequence's next `tokens` tokens: all of them real."""
    if step is not None:
        step.valid = torch.ones(1, tokens, dtype=torch.long, device=device)


@dataclass
class RowKeys:
    """A batch decoded in rows (`BatchedEngine.generate_rows`): each sequence was prefilled alone and its cache rows
    were stacked, left-padded to the longest; each decode step's attention then runs once per row, over that row's
    own keys (from `starts[b]`, no mask) with that row's own implementation-check probe, so a row computes exactly
    what it computes alone. (SDPA over padded keys under a mask gives other bits: its blocks, and so its sums,
    depend on the key length it is handed.) The forward context carries it as `rows` (harness/forward_context.py)."""

    starts: list[int]  # per live row: its first real key in the stacked cache
    probes: list  # per live row: its `impl_check` probe, or None

    def probe(self, b: int, layer: int):
        """Row b's probe where it watches this layer (as `impl_check.attach` set it on the row's own cache layer)."""
        probe = self.probes[b]
        return probe if probe is not None and int(layer) in probe.layers else None

    def select(self, keep: list[int]) -> None:
        """Keep batch positions `keep` (rows that finished leave)."""
        self.starts = [self.starts[i] for i in keep]
        self.probes = [self.probes[i] for i in keep]


def _row_of(kwargs: dict, b: int) -> dict:
    """An attention call's keywords for batch row b alone: its position ids (the one per-row tensor transformers
    hands the attention function; SDPA does not read them, a model's own eager attention might)."""
    positions = kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() < 2:
        return kwargs
    return {**kwargs, "position_ids": positions[b:b + 1]}


@dataclass
class PagedKV:
    """One layer's paged FP8 copy, written by the store kernels beside the cache layer, for a batch of rows (one
    sequence: one row): row r owns pages [r * pages_per_row, (r + 1) * pages_per_row).

    GQA: k/v pages [num_blocks, BLOCK_SIZE, kv_heads, head_dim]; MLA: one page tensor
    [num_blocks, BLOCK_SIZE, latent + rope] with a single scale, as engines keep it. A block-scaled format (`layout`,
    harness/kv_paths/block_layout.py; GQA only): pages [K codes, K block scales, V codes, V block scales] in the
    kernels' layout, read by the built-in's block-scaled decode; k_scale / v_scale are the static scales (None where
    the format has none). Written with slot -1 for pads
    (by the fused cache write on CUDA, which stores the same codes it reads back, or by `store_kv` /
    `store_latent`); decode runs the path's decode plug-in over all live rows and, on checked steps, checks each row
    against fp64 attention over exactly the stored codes. Slots, lengths and the block table are the step's
    (`StepState`), shared by every layer.
    """

    fmt_dtype: torch.dtype | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    saturate: bool
    mla: bool
    ops: object  # store_kv / store_latent (ours: the cache layout is the contract's)
    kernel: DecodeKernel  # the decode plug-in (harness/kv_paths/decode_kernels.py)
    agreement: KernelAgreement
    step: StepState
    fusable: bool = True  # the layer's round-trip scales are these (MLA: one scale for latent and k_pe)
    pages: list = field(default_factory=list)
    absorbed: tuple | None = None  # MLA: kv_b_proj's (W_UK [H, nope, Dc], W_UV [H, v, Dc]) in fp32, cast once
    layout: object = None  # block_layout.BlockScaledLayout of a block-scaled format; None: FP8 / MLA pages
    pe_format: object = None  # a block-scaled MLA row's k_pe format (None: stored as given; nvfp4_ds_mla: e4m3)
    # a windowed layer's (layer type, window): each row attends from its window's first key (sliding: the last
    # `window` tokens; chunked: the query's chunk of `window` positions), as transformers' masks do
    window: tuple[str, int] | None = None
    # plain FP8 GQA codes on CUDA: the check's fp64 truth read from the codes (`_exact_from_codes`); False: from an
    # fp64 copy of K and V, as on the CPU (a test compares the two)
    truth_from_codes: ClassVar[bool] = True

    def _ensure(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.pages:
            return
        if self.k_scale is not None and self.k_scale.device != key.device:  # a layer-sharded model: to its GPU, once
            self.k_scale, self.v_scale = self.k_scale.to(key.device), self.v_scale.to(key.device)
        blocks = self.step.batch_rows * self.step.pages_per_row
        if self.layout is not None and self.mla:  # the latent's codes and block scales, then k_pe as given (16-bit)
            self.pages = self.layout.allocate_latent_rows(blocks, BLOCK_SIZE, key.shape[-1], value)
            return
        if self.layout is not None:
            self.pages = [page for _ in range(2)
                          for page in self.layout.allocate(blocks, BLOCK_SIZE, key.shape[1], key.shape[-1], key.device)]
            return
        if self.mla:
            shapes = [(blocks, BLOCK_SIZE, key.shape[-1] + value.shape[-1])]
        else:
            shapes = [(blocks, BLOCK_SIZE, key.shape[1], key.shape[-1])] * 2
        self.pages = [torch.zeros(shape, dtype=self.fmt_dtype, device=key.device) for shape in shapes]

    def store_targets(self, key: torch.Tensor, value: torch.Tensor) -> tuple[dict, dict] | None:
        """Where `kernels.store_kv.quantize_store` writes key and value codes (None: write them with `write`)."""
        if not self.fusable:
            return None
        self._ensure(key, value)
        slots = self.step.slots().to(key.device)  # the step's tensors live on the batch's GPU (sharded: the first)
        if self.layout is not None and self.mla:  # the latent's codes and block scales; k_pe by `store_pe`
            return dict(codes=self.pages[0], block_scales=self.pages[1], slots=slots, page_size=BLOCK_SIZE), None
        if self.layout is not None:  # block-scaled: codes and block scales of K, then of V
            return tuple(dict(codes=self.pages[i], block_scales=self.pages[i + 1], slots=slots, page_size=BLOCK_SIZE)
                         for i in (0, 2))
        pages = [p.view(torch.uint8) for p in self.pages]
        if self.mla:  # one row per token: [latent | k_pe]
            strides = (pages[0].stride(0), pages[0].stride(1), 0)
            return (dict(cache=pages[0], slots=slots, cache_strides=strides, col_offset=0, block_size=BLOCK_SIZE),
                    dict(cache=pages[0], slots=slots, cache_strides=strides, col_offset=key.shape[-1],
                         block_size=BLOCK_SIZE))
        return tuple(dict(cache=p, slots=slots, cache_strides=(p.stride(0), p.stride(1), p.stride(2)), col_offset=0,
                          block_size=BLOCK_SIZE) for p in pages)

    def store_pe(self, value: torch.Tensor) -> None:
        """An MLA row's k_pe [rows, 1, chunk, Dr] into its pages (beside a latent the fused write stored): as given,
        or read back through its own format (`pe_format`: nvfp4_ds_mla's plain e4m3, whose values the 16-bit pages
        hold exactly)."""
        if self.pe_format is not None:
            value = self.pe_format.round_trip(value)[0]
        rows, _, chunk, _ = value.shape
        block_layout.store_rows(self.pages[2].view(-1, value.shape[-1]), self.step.slots().to(value.device),
                                value[:, 0].reshape(rows * chunk, -1).to(self.pages[2].dtype))

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value: [rows, heads, chunk, dim] (MLA: latent [rows, 1, chunk, Dc], k_pe [rows, 1, chunk, Dr])
        rows, _, chunk, _ = key.shape
        self._ensure(key, value)
        slots = self.step.slots().to(key.device)
        if self.layout is not None and self.mla:  # the latent encoded (torch) in the kernels' layout; k_pe as given
            self.layout.store(key[:, 0].reshape(rows * chunk, 1, -1), self.k_scale, self.pages[0], self.pages[1],
                              slots)
            self.store_pe(value)
            return
        if self.layout is not None:  # the formats' torch encode, stored in the kernels' layout
            for x, scale, first in ((key, self.k_scale, 0), (value, self.v_scale, 2)):
                tokens = x.transpose(1, 2).reshape(rows * chunk, x.shape[1], -1)
                self.layout.store(tokens, scale, self.pages[first], self.pages[first + 1], slots)
            return
        if self.mla:
            self.ops.store_latent(key[:, 0].reshape(rows * chunk, -1), value[:, 0].reshape(rows * chunk, -1),
                                  self.pages[0], slots, self.k_scale.reshape(()), self.saturate)
        else:
            self.ops.store_kv(key.transpose(1, 2).reshape(rows * chunk, key.shape[1], -1).contiguous(),
                              value.transpose(1, 2).reshape(rows * chunk, value.shape[1], -1).contiguous(),
                              self.pages[0], self.pages[1], slots, self.k_scale, self.v_scale, self.saturate)

    def first_keys(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """[rows] int32: the first cached token each row attends to, for rows holding `lengths` tokens (the query's
        included); None without a window. On the device: a captured graph recomputes it every replay."""
        if self.window is None:
            return None
        kind, size = self.window
        if kind == "chunked_attention":  # the query (position length - 1) attends to its chunk's positions
            return (torch.div(lengths - 1, size, rounding_mode="floor") * size).clamp(min=0).int()
        return (lengths - size).clamp(min=0).int()  # transformers' sliding window: kv_idx > q_idx - window

    @staticmethod
    def beyond_sdpa(kwargs: dict) -> dict:
        """The decode kernel's keywords for what the model's attention computes beyond SDPA: gpt-oss's sinks (its
        `s_aux` [Hq] logits, fp32) and Gemma 2's soft-capping (the route let a kernel through only where it computes
        them: `route._beyond_sdpa_missing`)."""
        found = {}
        if kwargs.get("s_aux") is not None:
            found["sinks"] = kwargs["s_aux"].float().contiguous()
        if kwargs.get("softcap") is not None:
            found["softcap"] = float(kwargs["softcap"])
        return found

    def decode(self, module, query: torch.Tensor, torch_out: torch.Tensor | None, quant=None,
               kwargs: dict | None = None) -> torch.Tensor:
        """query [rows, Hq, 1, D] -> the kernel's output [rows, 1, Hq, Dv]; on a checked step, `torch_out` (torch's
        attention of the same step, same shape) is the yardstick of the agreement check. The kernel gets the raw
        query (it quantises Q itself, `quant`: an AttentionQuant of an FP8 attention path) and is judged, as torch's
        output is, against fp64 attention of the raw query over the stored codes. kwargs: the attention call's (sinks,
        soft-capping: `beyond_sdpa`)."""
        beyond = self.beyond_sdpa(kwargs or {})
        if self.agreement.timed:
            out = self._timed(module, query, quant, beyond)
        else:
            out = self._kernel(module, query, quant, beyond)
        if self.step.check:
            self._check(module, query, out, torch_out, beyond)
        return out

    def check_prompt_end(self, module, query: torch.Tensor, torch_out: torch.Tensor, quant=None,
                         kwargs: dict | None = None) -> None:
        """The agreement check at a prompt's last prefill chunk (`StepState.check_last`): the kernel over the pages
        this chunk has just written, for the chunk's last query (every row's last prompt token: rows are
        left-padded), judged as on a checked decode step. The yardstick is torch's output at that position (query
        [rows, Hq, chunk, D], torch_out [rows, chunk, Hq, Dv]): the same attention of the same query over the same
        stored K/V a decode step's torch call computes. The model keeps torch's output. A batch checked here has no
        checked (so eager) first decode step: its decode steps can all be CUDA graph replays."""
        beyond = self.beyond_sdpa(kwargs or {})
        last = query[:, :, -1:]
        self._check(module, last, self._kernel(module, last, quant, beyond), torch_out[:, -1:], beyond)

    def _timed(self, module, query: torch.Tensor, quant, beyond: dict) -> torch.Tensor:
        """`_kernel`, its wall time (its stream synchronised before and after: not the whole device, where another
        thread may be capturing a CUDA graph, `executor.local.ModelThreads`) added to the agreement."""
        stream = torch.cuda.current_stream(query.device) if query.device.type == "cuda" else None
        if stream is not None:
            stream.synchronize()
        start = time.perf_counter()
        out = self._kernel(module, query, quant, beyond)
        if stream is not None:
            stream.synchronize()
        # per row: the call's time over the rows it computed (one sequence alone: the call's time)
        self.agreement.step_s.append((time.perf_counter() - start) / query.shape[0])
        return out

    def _kernel(self, module, query: torch.Tensor, quant, beyond: dict) -> torch.Tensor:
        """The plug-in over the paged copy. `quant` goes to our kernels as q_scale / prob_scale
        (route.FP8_ATTENTION_KERNELS); on an MLA layer it quantises the absorbed query [q_latent | q_pe] the kernel
        multiplies, as engines' MLA kernels do (the torch reference quantises the model's own query [q_nope | q_pe])."""
        table, lens = self.step.block_table().to(query.device), self.step.lengths_after().to(query.device)
        if self.layout is not None and not self.mla:
            out = run_gqa_block_scaled(self.kernel, query[:, :, 0].contiguous(), self.pages[0], self.pages[2],
                                       self.pages[1], self.pages[3], table, lens, self.k_scale, self.v_scale,
                                       module.scaling, self.layout.kernel_args)
            return out.unsqueeze(1)
        scales = _attention_scales(quant, query.device)
        if not self.mla:
            first_key = self.first_keys(lens)
            window = {} if first_key is None else {"first_key": first_key}
            out = run_gqa(self.kernel, query[:, :, 0].contiguous(), self.pages[0], self.pages[1], table, lens,
                          self.k_scale, self.v_scale, module.scaling, **scales, **beyond, **window)
            return out.unsqueeze(1)
        # Absorbed MLA (harness/kv_paths/mla.py): q_latent = q_nope W_UK, out = (softmax . c) W_UV
        nope, heads = module.qk_nope_head_dim, query.shape[1]
        if self.absorbed is None:  # the weights are fixed while a batch decodes: no cast per layer and step
            self.absorbed = mla.absorbed_weights(module, torch.float32)
        w_uk, w_uv = self.absorbed
        q_nope, q_pe = query[:, :, 0, :nope], query[:, :, 0, nope:]
        q_latent = mla.absorb_query(q_nope.float(), w_uk).to(query.dtype)
        if self.layout is not None:   # a block-scaled latent and k_pe beside it
            out_latent = run_mla_block_scaled(self.kernel, q_latent.contiguous(), q_pe.contiguous(), self.pages[0],
                                              self.pages[1], self.pages[2], table, lens,
                                              None if self.k_scale is None else self.k_scale.reshape(()),
                                              module.scaling, self.layout.kernel_args)
        else:
            out_latent = run_mla(self.kernel, q_latent.contiguous(), q_pe.contiguous(), self.pages[0], table, lens,
                                 self.k_scale.reshape(()), module.scaling, **scales)
        out = mla.expand_latent(out_latent.float(), w_uv).to(query.dtype)
        return out.view(query.shape[0], 1, heads, -1)

    def _check(self, module, query: torch.Tensor, out: torch.Tensor, torch_out: torch.Tensor, beyond: dict) -> None:
        """The agreement check of every live row at once: fp64 attention over the stored codes of groups of rows
        (padded to the longest, masked); results stay on the device (one host sync per checked step, for the span,
        shared by every layer)."""
        lengths, rows, span = self.step.lengths_after().to(query.device), self.step.rows.to(query.device), \
            self.step.span()
        host_lengths = self.step.host_lengths()
        if self.step.masked:  # static decode: only the rows still generating (eager steps only: one sync a step)
            live = self.step.live(query.device)
            query, out, torch_out, lengths, rows = (t[live] for t in (query, out, torch_out, lengths, rows))
            host_lengths = [host_lengths[i] for i in self.step.host_live()]
        per_row = span * sum(p[0, 0].numel() for p in self.pages)  # fp64 cache elements per row
        group = max(1, CHECK_ELEMENTS // max(per_row, 1))
        for begin in range(0, rows.shape[0], group):
            part = slice(begin, begin + group)
            # one group: the step's span; several: each group's own (as before, so the same fp64 sums)
            part_span = span if group >= rows.shape[0] else max(host_lengths[part])
            exact = self._exact_rows(module, query[part], lengths[part], rows[part], part_span,
                                     beyond)  # [n, 1, Hq, Dv]
            kernel_err = (out[part].double() - exact).abs().amax((1, 2, 3))
            torch_err = (torch_out[part].double() - exact).abs().amax((1, 2, 3))
            # bf16 output rounding: never call torch's error smaller than half an ulp of the output's scale
            floor = exact.abs().amax((1, 2, 3)) * 2.0 ** -9
            ratio = kernel_err / torch.maximum(torch.maximum(torch_err, floor), torch.full_like(floor, 1e-30))
            self.agreement.add(rows[part], kernel_err, ratio)

    def codes_by_head(self, pages: torch.Tensor, rows: torch.Tensor, span: int) -> torch.Tensor:
        """The first `span` stored codes of each of `rows` as [n, Hkv, span, D] fp64 (a GQA layer's FP8 pages)."""
        per_row = pages.view(-1, self.step.pages_per_row * BLOCK_SIZE, *pages.shape[2:])
        return per_row[rows, :span].transpose(1, 2).to(torch.float64, memory_format=torch.contiguous_format)

    def _exact_from_codes(self, module, q: torch.Tensor, rows: torch.Tensor, span: int, k_scale: torch.Tensor,
                          v_scale: torch.Tensor, attend: Callable) -> torch.Tensor:
        """`_exact_rows` of a GQA layer of plain FP8 codes on CUDA: the same fp64 products over the values the codes
        hold (`kernels.fp64_reference`: each code read once through torch's own table of FP8 values, where the
        torch way writes and reads an fp64 copy of K and V), summed in another fixed order."""
        from kernels import fp64_reference

        k_codes, v_codes = (pages.view(-1, self.step.pages_per_row * BLOCK_SIZE, *pages.shape[2:])
                            for pages in self.pages[:2])
        table = fp64_reference.code_values(k_codes.dtype, q.device)
        n, q_heads, kv_heads = q.shape[0], q.shape[1], k_codes.shape[2]
        grouped = (q.view(n, kv_heads, q_heads // kv_heads, -1) * k_scale).contiguous()
        scores = fp64_reference.code_scores(grouped, k_codes, rows, span, table).view(n, q_heads, span)
        weights = attend(scores * module.scaling).view(n, kv_heads, q_heads // kv_heads, span)
        if v_codes.dtype != k_codes.dtype:
            table = fp64_reference.code_values(v_codes.dtype, q.device)
        out = fp64_reference.weighted_codes(weights, v_codes, rows, span, table) * v_scale
        return out.reshape(n, q_heads, -1).unsqueeze(1)

    def _exact_rows(self, module, query: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                    span: int, beyond: dict | None = None) -> torch.Tensor:
        """fp64 attention of rows' queries [n, Hq, 1, D] over the codes x scale each holds (the first `span`
        tokens of each, masked to its length and window; never rounded to bf16; with the call's soft-capping and
        sinks) -> [n, 1, Hq, Dv]: the truth both the kernel and torch's attention over the dequantised K/V are
        judged against."""
        beyond = beyond or {}
        positions = torch.arange(span, device=lengths.device)[None, :]
        keep = positions < lengths[:, None]  # [n, span]
        first_key = self.first_keys(lengths)
        if first_key is not None:
            keep &= positions >= first_key[:, None]

        def rows_of(pages: torch.Tensor) -> torch.Tensor:  # [n, span, ...] codes (fp64; block-scaled: as stored)
            per_row = pages.view(-1, self.step.pages_per_row * BLOCK_SIZE, *pages.shape[2:])
            return per_row[rows, :span] if self.layout is not None else per_row[rows, :span].double()

        def attend(scores: torch.Tensor) -> torch.Tensor:  # [n, H, span] -> softmax over the stored tokens
            if beyond.get("softcap") is not None:
                scores = beyond["softcap"] * torch.tanh(scores / beyond["softcap"])
            scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
            if beyond.get("sinks") is None:
                return torch.softmax(scores, dim=-1)
            sinks = beyond["sinks"].double().view(1, -1, 1).expand(scores.shape[0], -1, 1)  # in the denominator only
            return torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]

        q = query[:, :, 0].double()  # [n, Hq, D]
        if not self.mla:
            # K and V as [n, Hkv, span, D] fp64, made once (the matmuls' batch dims contiguous: no copy inside them),
            # and the per-tensor / per-head static scales applied to q and to the output instead of to every value;
            # query head h reads KV head h // group, so K and V are never repeated per query head (at 8B shape,
            # 16 x 8k rows, the repeated fp64 K and V were 4.3 GB a layer each)
            if self.layout is not None:  # codes x block scales x static scale, as the kernels' mirror reads them
                k, v = (kernel_reference.dequantize_block_scaled(rows_of(self.pages[i]), rows_of(self.pages[i + 1]),
                                                                 scale, **self.layout.kernel_args)
                        .transpose(1, 2).to(torch.float64, memory_format=torch.contiguous_format)
                        for i, scale in ((0, self.k_scale), (2, self.v_scale)))
                k_scale = v_scale = torch.ones((), dtype=torch.float64, device=q.device)
            else:
                k_scale, v_scale = (scale.to(q.device, torch.float64).reshape(-1, 1, 1)
                                    for scale in (self.k_scale, self.v_scale))
                if q.is_cuda and self.truth_from_codes:  # the same attention from the codes: no fp64 copy of K, V
                    return self._exact_from_codes(module, q, rows, span, k_scale, v_scale, attend)
                k, v = (self.codes_by_head(pages, rows, span) for pages in self.pages[:2])
            n, q_heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
            grouped = q.view(n, kv_heads, q_heads // kv_heads, -1) * k_scale
            scores = torch.matmul(grouped, k.transpose(-1, -2)).reshape(n, q_heads, -1)
            weights = attend(scores * module.scaling).view(n, kv_heads, q_heads // kv_heads, -1)
            return (torch.matmul(weights, v) * v_scale).reshape(n, q_heads, -1).unsqueeze(1)
        if self.layout is not None:  # the latent as the kernels' mirror reads it, k_pe as stored
            latent = kernel_reference.dequantize_block_scaled(rows_of(self.pages[0]), rows_of(self.pages[1]),
                                                              self.k_scale, **self.layout.kernel_args)[:, :, 0]
            cached = torch.cat([latent.double(), rows_of(self.pages[2]).double()], dim=-1)
        else:
            cached = rows_of(self.pages[0]) * self.k_scale.double()  # [n, span, Dc + Dr]
        nope = module.qk_nope_head_dim
        w_uk, w_uv = mla.absorbed_weights(module, torch.float64)
        c, pe = cached[..., :w_uk.shape[-1]], cached[..., w_uk.shape[-1]:]
        q_latent = mla.absorb_query(q[..., :nope], w_uk)
        scores = (torch.einsum("nhc,nsc->nhs", q_latent, c) + torch.einsum("nhr,nsr->nhs", q[..., nope:], pe))
        latent = torch.einsum("nhs,nsc->nhc", attend(scores * module.scaling), c)
        return mla.expand_latent(latent, w_uv).unsqueeze(1)


def attach_paged(cache, kv_path, kernel_name: str, device: torch.device, mla_model: bool, step: StepState,
                 agreement: KernelAgreement, *, decodes: bool = True,
                 windows: dict[int, tuple[str, int]] | None = None) -> dict[int, PagedKV]:
    """The one kernel attacher: a paged FP8 copy (`PagedKV`) of every quantised full-attention layer of `cache`,
    read by the decode plug-in `kernel_name` (the route's kernel: harness/replay/route.py), over `step`'s pages.

    decodes=True: the copy is the layer's `paged` (the layer's write stores into it; FP8 decode steps return the
    kernel's output). decodes=False (attention capture): the model keeps running torch attention; the copy is written
    beside the layer (its `update` wrapped; `detach_paged` undoes it) and read by capture's `KernelRows`.
    windows: {layer index: (layer type, window)} of the model's sliding-window and chunked layers: each gets a copy
    read from its window's first key where the plug-in computes windows (`decode_kernels.BEYOND_SDPA_COMPUTED`) and
    the copy decodes; else none (torch attention over the layer's own window). {layer index: PagedKV}."""
    if kernel_name == "triton" and device.type != "cuda":
        raise KernelPluginError(f"KV path {kv_path.name!r}: kernel=triton needs a CUDA device (run with --device cuda)")
    kernel = resolve(kernel_name)
    if not kv_path.is_fp8 and (kernel.mla_block_scaled if mla_model else kernel.block_scaled) is None:
        raise KernelPluginError(f"kernel {kernel_name!r} has no decode over block-scaled caches ({kv_path.fmt})")
    if (kernel.mla_decode if mla_model else kernel.decode_attention) is None:
        what = "mla_decode (MLA models need one)" if mla_model else "decode_attention (GQA/MHA models need one)"
        raise KernelPluginError(f"kernel {kernel_name!r} has no {what}")
    ops = kernel_ops(device)
    layout = None if kv_path.is_fp8 else block_layout.of(kv_path.k_format, mla_model)  # the route's
    fmt_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(kv_path.fmt)
    paged = {}
    windows = windows or {}
    reads_windows = (decodes and layout is None and not mla_model
                     and "window" in BEYOND_SDPA_COMPUTED.get(kernel_name, ()))
    for index, layer in enumerate(cache.layers):
        static = layout is None or layout.static
        windowed = getattr(layer, "is_sliding", False) or index in windows
        if windowed and not (reads_windows and index in windows):
            continue
        if not hasattr(layer, "paged") or (static and layer.k_scale is None):
            continue
        k_scale, v_scale = (layer.k_scale.float().to(device), layer.v_scale.float().to(device)) if static else (None, None)
        # MLA's FP8 copy stores latent and k_pe under k_scale; the fused write uses each tensor's own scale. A
        # block-scaled latent takes the fused write's codes (as heads of 256 where wider) and k_pe beside it as given
        # (or read back through its own format: nvfp4_ds_mla's e4m3)
        fusable = decodes and (not mla_model or layout is not None or bool(torch.equal(k_scale, v_scale)))
        pe_format = layer.v_format if mla_model and layout is not None else None   # cache.latent_row_formats'
        paged[index] = PagedKV(fmt_dtype, k_scale, v_scale, kv_path.saturate, mla_model, ops, kernel, agreement, step,
                               fusable, layout=layout, pe_format=pe_format,
                               window=windows.get(index) if windowed else None)
        if decodes:
            layer.paged = paged[index]
        else:
            layer.update = _writing_to(layer.update, paged[index])
    return paged


def _writing_to(update, paged: PagedKV):
    def write_too(key_states, value_states, *args, **kwargs):
        result = update(key_states, value_states, *args, **kwargs)
        paged.write(key_states, value_states)
        return result

    return write_too


def detach_paged(cache) -> None:
    """Undo `attach_paged(decodes=False)`: the writer refers to its layer, so a cache keeping it lives on until a
    full garbage collection."""
    for layer in cache.layers:
        vars(layer).pop("update", None)


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


def _causal_prefix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, kwargs: dict
                   ) -> tuple[int, ...] | None:
    """Each row's first key, where an attention call is a static prefill pass's full-attention layer whose mask is
    causal over each row's real keys and nothing else (`forward_context.CausalPrefix`, handed this very tensor: a
    mask a model changed is not asked about) and, on CUDA, flash attention takes it (torch's answer reads the
    process-wide SDPA flags: ask inside `sdpa_backends`'s block); None elsewhere. `_causal_prefix_sdpa` then
    computes it without reading the mask. Under the mask, SDPA runs the memory-efficient kernel over every key a
    query is handed, masked or not, after K and V are repeated to every query head (H200, 16 rows x 32 query / 8 KV
    heads x 2,048 queries, the passes of an 8k prompt: 91.2 against 27.6 ms a layer unpadded, 81.6 against 28.4
    padded, `benchmarks/prefill_attention.py`)."""
    prefix = forward_context_now().causal_prefix
    if prefix is None or mask is None or mask is not prefix.mask:
        return None
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    if any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "position_bias", "sliding_window")) or \
            kwargs.get("dropout"):
        return None
    if not 1 < query.shape[2] <= key.shape[2] or query.shape[1] % key.shape[1]:
        return None
    # asked as torch's own bias asks (`CausalBias._dispatch`): is_causal=False, since torch's is_causal is aligned
    # at the top left and flash refuses it for fewer queries than keys, where the bias's flash call is lower-right;
    # elsewhere (the CPU, where a test asks for it) SDPA builds the bias's mask: the same attention, no faster
    if query.is_cuda and not can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False,
                                                                key.shape[1] != query.shape[1])):
        return None
    return prefix.starts


def _causal_prefix_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                        starts: tuple[int, ...]) -> torch.Tensor:
    """query [B, Hq, T, D] over key/value [B, Hkv, L, D] -> [B, T, Hq, Dv], the queries at the last T keys'
    positions: row b's queries from its start (starts[b]: its left pads end there) attend to its keys from its start
    up to their own. That is torch's lower-right causal bias over the row's keys, which SDPA runs as flash attention
    over the KV heads as they are (`enable_gqa`). A query before its row's start (a pad) attends to itself alone, as
    under the engine's mask: its output is its own value. Rows with one start are one call; where starts differ, a
    call per run of rows with one start."""
    from torch.nn.attention.bias import causal_lower_right

    queries, keys, group = query.shape[2], key.shape[2], query.shape[1] // key.shape[1]
    begin = keys - queries  # the pass's first column
    outputs, first, rows = [], 0, len(starts)
    while first < rows:
        last = first + 1
        while last < rows and starts[last] == starts[first]:
            last += 1
        start = starts[first]
        pads = min(max(start - begin, 0), queries)  # the run's queries before its start
        parts = [value[first:last, :, begin:begin + pads].repeat_interleave(group, 1)] if pads else []
        if pads < queries:
            parts.append(torch.nn.functional.scaled_dot_product_attention(
                query[first:last, :, pads:], key[first:last, :, start:], value[first:last, :, start:],
                attn_mask=causal_lower_right(queries - pads, keys - start), scale=scaling, enable_gqa=group > 1))
        outputs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        first = last
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.transpose(1, 2).contiguous()


def _no_empty_rows(mask, length: int):
    """A boolean mask [B, 1|H, T, L] in which a query that attends to no key (a left pad of a batch row: transformers'
    padding mask leaves its row empty) attends to its own position instead, as static prefill's mask has it. SDPA
    gives an empty row zeros; the fp32 softmax of FP8 attention (`kernels.reference.attention_fp8`) and of the fault
    injectors gives NaN, which the pad's hidden state carries into the next layer's V, where a real row's 0 weight
    times NaN is NaN (batched fp8_q:fp8_p read kl_mean inf on the tiny gqa model before this). A mask without empty
    rows (one sequence alone, always) keeps its values; no host sync (a CUDA graph may capture this)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return mask
    mask = mask[..., :length]
    empty = ~mask.any(-1, keepdim=True)  # [B, 1|H, T, 1]
    chunk = mask.shape[-2]
    own = torch.arange(length, device=mask.device)[None, :] == \
        torch.arange(length - chunk, length, device=mask.device)[:, None]  # [T, L]: query t's own key
    return mask | (empty & own)


def _beyond_sdpa(kwargs: dict) -> bool:
    """A call SDPA does not compute (BEYOND_SDPA: sinks, a position bias, logit soft-capping)."""
    beyond = [name for name in BEYOND_SDPA if kwargs.get(name) is not None]
    seen = forward_context_now().seen_beyond_sdpa
    if seen is not None:
        seen.update(beyond)
    return bool(beyond)


def _additive_mask(mask) -> bool:
    """A float mask: the model's own additive bias (our mask function's are boolean), which SDPA adds as given but
    the implementation check's exact attention and our decode kernels do not."""
    additive = isinstance(mask, torch.Tensor) and mask.is_floating_point()
    seen = forward_context_now().seen_beyond_sdpa
    if additive and seen is not None:
        seen.add(ADDITIVE_MASK)
    return additive


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
    out; HARNESS_SDPA_CUDNN=1 puts it back (to compare). The choice is torch's process-wide flags, held for this
    thread while they are set (`forward_context.sdpa_only`), HARNESS_SDPA_CUDNN=1's choice too: whatever reads the
    flags for a call (SDPA's own choice, `_causal_prefix`'s question) belongs inside the block, where no other
    thread's choice reaches it."""
    import contextlib
    import os

    from torch.nn.attention import SDPBackend

    if not query.is_cuda:
        return contextlib.nullcontext()
    cudnn = [SDPBackend.CUDNN_ATTENTION] if os.environ.get("HARNESS_SDPA_CUDNN") == "1" else []
    return sdpa_only([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, *cudnn])


def kernel_alone(module, layer, query_tokens: int) -> bool:
    """Whether an attention call's output is the decode kernel's alone: an FP8 decode step (one query token) of a
    layer with a paged copy, unchecked, with no fault injector and no observer. Torch's attention is then not run,
    so the K/V it would read are not needed (`harness_attention`, `skip_unread_expansion`)."""
    paged = getattr(layer, "paged", None)
    return (paged is not None and query_tokens == 1 and not paged.step.check
            and not getattr(getattr(layer, "kv_path", None), "fault", "")
            and forward_context_now().observe is None)


def skip_unread_expansion(model) -> int:
    """Where an MLA attention module's own code expands the whole cached latent into per-head K/V before calling
    the attention function (transformers' DeepSeek-V3 `expand_kv`: kv_b_proj over every cached token of every row,
    then a copy of the keys, at every forward pass), skip it on the calls whose output is the decode kernel's alone
    (`kernel_alone`): the kernel reads the paged latent, never those K/V. The calls get empty K/V [rows, heads, 0,
    dim] instead (the attention function refuses to read them). At V2-Lite shape, batch 16, 1k context that is 27
    GEMMs of [16 x 1k, 512] x [512, 4096] and ~6.5 GB of bf16 writes a step that nothing reads, 8x that at 8k:
    fp8_e4m3's graph decode step went from 24.7 to 18 ms at 1k and from 66 to 18 ms at 8k (H200, scale_bench,
    BENCHMARKS.md session 15). Checked steps, the reference and BF16 paths expand as before, so every output keeps
    its bits. Idempotent; returns how many modules it wraps now."""
    wrapped = 0
    for module in model.modules():
        expand = getattr(module, "expand_kv", None)
        if expand is None or not hasattr(module, "kv_b_proj") or getattr(expand, "skips_unread", False):
            continue
        module.expand_kv = _expanding_when_read(module, expand)
        module.register_forward_pre_hook(_note_query_tokens, with_kwargs=True)
        wrapped += 1
    return wrapped


def _note_query_tokens(module, args, kwargs) -> None:
    hidden = args[0] if args else kwargs["hidden_states"]  # [rows, query tokens, hidden]
    note_forward("query_tokens", hidden.shape[1])


def _expanding_when_read(module, expand: Callable) -> Callable:
    def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        context = forward_context_now()
        layer = cache_layer(context.cache, module)
        if not kernel_alone(module, layer, (context.notes or {}).get("query_tokens", 0)):
            return expand(kv_nope, k_rot)
        rows, heads = kv_nope.shape[0], module.num_heads
        return (kv_nope.new_empty(rows, heads, 0, module.qk_nope_head_dim + module.qk_rope_head_dim),
                kv_nope.new_empty(rows, heads, 0, module.v_head_dim))

    expand_kv.skips_unread = True
    return expand_kv


def cache_layer(cache, module):
    """The cache layer an attention module writes, or None: no cache, or a layer that reads another layer's K/V
    and has no cache layer of its own (Gemma 3n's KV-sharing layers under transformers 5.17, whose cache holds
    only the layers that store K/V; 5.24 gives every layer one)."""
    layers = getattr(cache, "layers", None)
    if layers is None or module.layer_idx >= len(layers):
        return None
    return layers[module.layer_idx]


def register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def harness_attention(module, query, key, value, attention_mask, **kwargs):
        context = forward_context_now()
        cache = context.cache
        if getattr(module, "layer_idx", None) is None:  # attention over no cache layer (Inkling 2's residual
            return attend(module, query, key, value, attention_mask, None, None, kwargs)  # blocks): as it is
        layer = cache_layer(cache, module)
        if attention_mask is None and not getattr(module, "is_causal", True) and kwargs.get("is_causal") is None:
            # our mask function (transformers' sdpa_mask) returns no mask only for a purely causal one; a decoder
            # self-attention module built with is_causal=False (BigBird-Pegasus's) would attend both ways there
            kwargs = {**kwargs, "is_causal": True}
        rows = context.rows
        if rows is not None and query.shape[2] == 1:  # a decode step of a rows batch: each row as it would run alone
            outputs = [attend(module, query[b:b + 1], key[b:b + 1, :, start:], value[b:b + 1, :, start:], None,
                              layer, rows.probe(b, module.layer_idx), _row_of(kwargs, b))[0]
                       for b, start in enumerate(rows.starts)]
            return torch.cat(outputs), None
        return attend(module, query, key, value, attention_mask, layer, getattr(layer, "impl_probe", None), kwargs)

    def attend(module, query, key, value, attention_mask, layer, probe, kwargs):
        if getattr(getattr(layer, "kv_path", None), "hadamard", False):  # its cache holds rotated K (rotation.py)
            query = rotate(query).to(query.dtype)
        model_query, scaling = query, kwargs.get("scaling") or module.scaling  # before any path changes them
        fault = attention_fault(getattr(layer, "kv_path", None))  # an arithmetic fault injector (kv_paths/faults.py)
        if getattr(getattr(layer, "kv_path", None), "k_scale_on_scores", False):
            query, kwargs = _k_scale_on_scores(module, query, layer.k_scale, kwargs)
        quant = getattr(layer, "attn_quant", None)
        raw_query = query
        additive = _additive_mask(attention_mask)  # before any path's changes to the mask
        paged = getattr(layer, "paged", None) if not fault else None
        kernel_decodes = paged is not None and query.shape[2] == 1  # an FP8 decode step served by the kernel
        if kernel_alone(module, layer, query.shape[2]):
            # an unchecked step: the kernel's output is the output; torch's attention is only the yardstick of a
            # checked step, so it is not computed here (nor, on MLA, the K/V it reads: `skip_unread_expansion`)
            return paged.decode(module, raw_query, None, quant, kwargs), None
        if key.shape[2] == 0:
            raise RuntimeError(f"attention layer {module.layer_idx}: its K/V were not expanded (skip_unread_expansion) "
                               f"but this call reads them")
        handed_mask = attention_mask  # the mask as the model handed it (`_causal_prefix` asks about this tensor)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] > key.shape[2]:
            # a static prefill pass reads the columns up to its own (`StaticColumns.attended`): a prefix of the mask's
            attention_mask = attention_mask[..., :key.shape[2]]
        if fault or quant is not None:  # our fp32 softmax, not SDPA's: a padded query must not attend to nothing
            attention_mask = _no_empty_rows(attention_mask, key.shape[2])
        if fault:  # the path's attention is the faulty arithmetic, kernels included
            from harness.kv_paths.faults import faulty_attention

            output, weights = faulty_attention(fault, query, key, value, scaling, attention_mask, quant,
                                               getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)), None
        elif quant is None:
            with sdpa_backends(query):
                # asked under the flags the call runs with: flash's availability reads torch's process-wide flags,
                # which another model's thread may hold at MATH alone outside this block (the implementation check)
                starts = _causal_prefix(query, key, value, handed_mask, kwargs)
                if _beyond_sdpa(kwargs):
                    output, weights = _model_eager_attention(module, query, key, value, attention_mask, kwargs)
                elif starts is not None:
                    output, weights = _causal_prefix_sdpa(query, key, value, kwargs.get("scaling") or module.scaling,
                                                          starts), None
                elif _packs_gqa(query, key, attention_mask, kwargs):
                    output, weights = _decode_sdpa_packed(query, key, value, attention_mask,
                                                          kwargs.get("scaling") or module.scaling), None
                else:
                    output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        else:  # FP8 attention (q_scale / prob_scale): the torch reference (prefill; decode when no kernel takes it)
            from kernels.reference import attention_fp8

            # the scales sit on the batch's GPU (`batched._scales_on_device`); a layer-sharded layer reads its own
            q_scale, prob_scale = (s.to(query.device) if isinstance(s, torch.Tensor) else s
                                   for s in (quant.q_scale, quant.prob_scale))
            output, query = attention_fp8(query, key, value, kwargs.get("scaling") or module.scaling, attention_mask,
                                          q_scale, prob_scale, quant.fmt)
            weights = None
        if kernel_decodes:  # a checked step (every step of one sequence alone): torch's output is the yardstick
            output = paged.decode(module, raw_query, output, quant, kwargs)
        elif paged is not None and paged.step.check_last:  # a prompt's last chunk: the kernel checked at its end
            with on_checks_stream(raw_query, output):  # beside the prefill (`checks_beside`): it feeds nothing back
                paged.check_prompt_end(module, raw_query, output, quant, kwargs)
        # the implementation check (harness/kv_paths/impl_check.py): its exact attention has no sinks or soft-capping:
        # such calls (gpt-oss, Gemma 2) are not probed (they read ~440x SDPA's error on every path of a tiny gpt-oss,
        # bf16 included: the check's definition, not the path)
        if probe is not None and not _beyond_sdpa(kwargs) and not additive and not forward_context_now().unprobed:
            probe.observe(module, model_query, key, value, attention_mask, scaling, output)
        observer: Callable | None = forward_context_now().observe
        if observer is not None and getattr(module, "layer_idx", None) is not None:
            replaced = observer(module, query, key, value, output)
            output = output if replaced is None else replaced
        return output, weights

    AttentionInterface.register(ATTENTION_NAME, harness_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
