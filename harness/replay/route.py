"""The route one KV path takes through the in-process engine, decided once per (path, model, device, environment).

A route says which decode kernel FP8 decode steps run through (or why none), whether the path can be replayed
in batches (or why one sequence at a time), which decode mode a batch uses, and what attention capture measures
(torch's rows only, or the kernel's beside them). Every "why not" of the engine is decided here, from plain
facts: the path spec, the model's config, the device type, `HARNESS_KERNELS` (read by
`decode_kernels.kernels_setting`, its one reader), whether the CPU's bf16 GEMMs are oneDNN's (`onednn_bf16`) and the
run's options. The run stores each route in its
manifest (`paths[].routes`), so a reader sees what ran without re-deriving it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from harness.kv_paths import capabilities, decode_kernels
from harness.model_layers import field, layer_shapes
from harness.kv_paths.spec import KVPath
from harness.replay.families import beyond_sdpa_needs, stack_refusal, static_decode_refusal

DECODE_MODES = ("auto", "dynamic", "static", "graph")
# Decode plug-ins that take FP8 attention (q_scale / prob_scale keywords), for GQA and MLA layers: ours and its
# torch mirror. Other plug-ins (the contract has no such keywords) run FP8 attention in the torch reference.
FP8_ATTENTION_KERNELS = ("triton", "reference")
ONE_AT_A_TIME = "one sequence at a time (growing cache)"
# The CPU replay (`job`'s in-process replay when not batched): every sequence prefilled alone and its decode steps
# batched with others', each row's attention over its own keys (`BatchedEngine.generate_rows`): one sequence's bits
ROWS = "rows (one sequence's bits: prefilled alone, decode steps batched, attention per row)"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What of a model's config a route depends on."""

    mla_dims: tuple[int, int] | None  # (kv_lora_rank, qk_rope_head_dim) of an MLA model, else None
    static_refusal: str | None  # why the model cannot decode on static storage (None: it can)
    stack_refusal: str | None  # why its one-sequence caches cannot be stacked into rows (None: they can)
    # (attention keyword, in words) of what the family's attention computes beyond SDPA (sinks, soft-capping, ...)
    beyond_sdpa: tuple[tuple[str, str], ...]
    # K/V head sizes of a GQA/MHA model's attention layers, each once (the kernels' capability asks of each: Gemma 4
    # has two); empty for MLA
    head_dims: tuple[int, ...] = ()

    @classmethod
    def of(cls, config) -> "ModelFacts":
        rank = field(config, "kv_lora_rank")
        dims = (int(rank), int(field(config, "qk_rope_head_dim"))) if rank is not None else None
        sizes = () if dims is not None else tuple(sorted({s.head_dim for s in layer_shapes(config) if s.head_dim}))
        return cls(mla_dims=dims, static_refusal=static_decode_refusal(config), stack_refusal=stack_refusal(config),
                   beyond_sdpa=tuple(beyond_sdpa_needs(config).items()), head_dims=sizes)


@dataclass(frozen=True, slots=True)
class Route:
    kernel: str | None  # the decode plug-in FP8 decode steps run through; None: torch attention
    kernel_refusal: str | None  # why decode does not run through a kernel (None when `kernel` is set)
    kernel_label: str  # the kernel as the run names it, or the refusal
    batch_refusal: str | None  # why the path replays one sequence at a time in a batched run (None: batchable)
    batch_floor: str | None  # which batch-invariance floor bounds the path when batched (None: not batched)
    decode: str  # what a generation of this path runs: one at a time, or the batched decode mode
    capture: str | None  # what attention capture measures (None: no capture asked)
    capture_kernel: str | None  # the kernel whose rows capture measures beside torch's (None: torch's only)
    # a `kernel=` plug-in: every call of it judged and timed, in a batch too (docs/CONTRACTS.md); False: ours, judged
    # every `kernel_check_every`-th decode step of a batch, untimed there
    kernel_every_call: bool = False
    cache_write: str = ""  # which write the path's K/V take (fused Triton, C, or the torch round trip and why)

    def describe(self) -> dict:
        return {"decode_kernel": self.kernel_label, "batched": self.batch_floor is not None,
                "batch_refusal": self.batch_refusal, "batch_floor": self.batch_floor, "decode": self.decode,
                "capture": self.capture, "cache_write": self.cache_write}


def decide(kv_path: KVPath | None, config, device_type: str, use_kernels: bool, *, batched: bool = False,
           decode: str = "auto", capture: bool = False, rows: bool = False, shard: str | None = None,
           facts: ModelFacts | None = None) -> Route:
    """The route of `kv_path` (None: the reference) on a model with `config` on a `device_type` device;
    use_kernels: the model's FP8 decode runs through our kernels (CUDA, or HARNESS_KERNELS=reference); rows: a CPU
    replay that is not batched generates in rows (ROWS) where it can; shard: the model's layout over several
    devices (--shard layers | tensor; None: one device); facts: `ModelFacts.of(config)` where the caller keeps it
    (a loaded model's, `InProcessModel.facts`): reading them walks every layer's config, ~26 ms for a 32-layer
    model under transformers 5.17, which a route asked for every decode step paid (session 22)."""
    return _decide(kv_path, facts if facts is not None else ModelFacts.of(config), device_type, use_kernels,
                   decode_kernels.kernels_setting(), batched, decode, capture, rows and shard is None, shard)


@functools.lru_cache(maxsize=256)
def _decide(kv_path: KVPath | None, facts: ModelFacts, device_type: str, use_kernels: bool, setting: str,
            batched: bool, decode: str, capture: bool, rows: bool = False, shard: str | None = None) -> Route:
    name = kernel_name(kv_path, setting) if kv_path is not None else None
    refusal = _kernel_refusal(kv_path, facts, use_kernels, setting, name)
    batch_refusal = _batch_refusal(kv_path, capture)
    kernel = name if refusal is None else None
    capture_kernel, measured = None, None
    if capture and kv_path is not None:
        capture_refusal = capture_kernel_refusal(kv_path, kernel)
        capture_kernel = kernel if capture_refusal is None else None
        measured = f"torch rows and kernel:{kernel} rows" if capture_kernel else f"torch rows ({capture_refusal})"
    batches = batched and batch_refusal is None
    every_call = kernel is not None and kv_path is not None and bool(kv_path.kernel)
    return Route(kernel=kernel, kernel_refusal=refusal, kernel_label=refusal or _kernel_label(kv_path),
                 batch_refusal=batch_refusal, batch_floor=batch_floor(kv_path) if batches else None,
                 decode=_rows(facts, kernel, kv_path) if rows and not batched and device_type == "cpu"
                 else _decode(facts, device_type, batches, decode, every_call, shard),
                 capture=measured, capture_kernel=capture_kernel, kernel_every_call=every_call,
                 cache_write=_cache_write(kv_path, facts, device_type))


def _cache_write(kv_path: KVPath | None, facts: ModelFacts, device_type: str) -> str:
    """The write the path's K/V take, and on an MLA model how its latent row holds the path's formats."""
    from harness.kv_paths.cache import latent_row_note

    note = latent_row_note(kv_path) if facts.mla_dims is not None else ""
    return capabilities.cache_write(kv_path, device_type) + (f"; {note}" if note else "")


def kernel_name(kv_path: KVPath, setting: str) -> str:
    """The path's plug-in, or ours: the Triton kernels (their torch mirror under HARNESS_KERNELS=reference)."""
    if kv_path.kernel:
        return kv_path.kernel
    return "reference" if setting == "reference" else decode_kernels.DEFAULT


def _kernel_label(kv_path: KVPath | None) -> str:
    if kv_path is None or not kv_path.kernel:
        return "triton (kernels/)"
    return f"plug-in {kv_path.kernel} (kernel= path option)"


def _kernel_refusal(kv_path: KVPath | None, facts: ModelFacts, use_kernels: bool, setting: str,
                    name: str | None) -> str | None:
    """Why decode does not run through a kernel for this path (None: it does)."""
    if facts.beyond_sdpa and kv_path is not None and kv_path.is_quantized:
        missing = _beyond_sdpa_missing(kv_path, facts, name)
        if missing:
            return missing
    named = kv_path is not None and kv_path.kernel and setting != "off"
    if not use_kernels and not named:  # a path that names a plug-in runs it on any device
        return "kernels off (CPU, or HARNESS_KERNELS=off)"
    if kv_path is None or not kv_path.is_quantized:
        return "not an FP8 path"
    if kv_path.emulated:
        return "emulated outside the engine (the yardstick's twin): torch's attention over its own cache write"
    # an MLA model's cache holds its latent and k_pe: their widths are what the decode kernel reads
    sizes = (facts.mla_dims[0],) if facts.mla_dims is not None else facts.head_dims
    rope = facts.mla_dims[1] if facts.mla_dims is not None else None
    for head_dim in (sizes or (None,)) if not named else (None,):
        refusal = capabilities.decode_refusal(kv_path, facts.mla_dims is not None, head_dim, rope)
        if refusal is not None:  # a plug-in takes the contract's paged FP8 caches: the same formats, any head size
            return refusal
    if kv_path.quantizes_attention and name not in FP8_ATTENTION_KERNELS:
        return ("FP8 attention (fp8_q / fp8_p) runs in the torch reference: only our kernels (decode_attention, "
                "mla_decode) take q_scale / prob_scale")
    if kv_path.quantizes_attention and facts.mla_dims is not None and name == "triton":
        if any(d & (d - 1) for d in facts.mla_dims):
            return (f"FP8 attention (fp8_q / fp8_p) runs in the torch reference: mla_decode takes q_scale / "
                    f"prob_scale in its tile kernel, for power-of-two latent and RoPE dims (this model: "
                    f"{facts.mla_dims})")
    return None


def _beyond_sdpa_missing(kv_path: KVPath, facts: ModelFacts, name: str | None) -> str | None:
    """Why the path's decode kernel cannot compute the family's attention (sinks, soft-capping, ...; None: it can):
    the built-ins' GQA decode over FP8 pages computes what `decode_kernels.BEYOND_SDPA_COMPUTED` lists; MLA,
    block-scaled, FP8-attention decodes and plug-ins none."""
    computed = decode_kernels.BEYOND_SDPA_COMPUTED.get(name, frozenset())
    if facts.mla_dims is not None or kv_path.quantizes_attention or kv_path.k_format.name in capabilities.BLOCK_SCALED:
        computed = frozenset()
    missing = [text for key, text in facts.beyond_sdpa if key not in computed]
    if not missing:
        return None
    return (f"{' and '.join(dict.fromkeys(missing))}: the decode kernel does not compute them for this path, so decode "
            f"runs torch attention as the model defines it")


# How a layer-sharded model's batches decode: each layer's cache, paged copy and kernels live on its own GPU, and a
# CUDA graph records one GPU's stream, so a graph-decoded step is one graph per GPU, replayed in order, the values
# that cross GPUs copied between them (`segments.SegmentedGraph`).
LAYERS_GRAPH = "one CUDA graph per GPU a decode step, replayed in order (harness/replay/segments.py)"
# Why a tensor-parallel model decodes its batches dynamically: every rank runs the same batches in lockstep
# (`BatchedEngine`: the batch size agreed over the ranks, a rank's error ends the run rather than a batch of its own),
# each rank's caches and kernels holding its KV heads.
TENSOR_DECODE = ("tensor-parallel ranks (a CUDA graph's capture and its out-of-memory retry would be each rank's "
                 "own, while every collective must match the other ranks'; static storage and graphs with the "
                 "plan's collectives inside are not built)")
LAYOUT_DECODE = {"tensor": TENSOR_DECODE}


def layout_decode_refusal(shard: str | None) -> str | None:
    """Why a model laid out as `shard` (--shard tensor) decodes its batches dynamically, static and graph decode
    refused (None: one device or --shard layers, any mode). The run's options check (`--decode` with --shard), the
    route, the engine's fallback and a tensor-parallel run's `parallel.batch_composition` all quote this."""
    return LAYOUT_DECODE.get(shard) if shard is not None else None


def _batch_refusal(kv_path: KVPath | None, capture: bool = False) -> str | None:
    """Why this path cannot run in batches of several sequences (harness/replay/batched.py), or None. The one place
    such a refusal is decided: a refused path runs one sequence at a time (the same engine, a batch of one row:
    `batched.ONE_SEQUENCE`) beside the model's batched paths (`batched_runner.BatchedReplay`); a refusal of the
    reference's keeps the whole model so (`executor.model_replay.replay_model`).

    Refused today: nothing. Batched since, each with what was measured: models laid out over several devices
    (`--shard layers | tensor`, a tensor-parallel one decoding dynamically: `layout_decode_refusal`;
    tests/test_multi_gpu.py and tests/test_tensor_parallel.py compare their batches with one device's); fault
    injectors (the implementation check that catches them probes every row of a batch); FP8 attention (bounded by
    its own batch-invariance floor, `batch_floor`); `kernel=` plug-ins (every call judged and timed in a batch too,
    `kernel_every_call`: on the CPU tiny models, 4 left-padded rows against each alone, 12 tokens, `kernel=dequant`
    and `kernel=reference` give the same tokens and kernel_steps, kernel_err_ratio equal to ~1e-13); attention
    capture (its own teacher-forced pass, `replay/attention._run_chunks`, still runs one sequence at a time, on the
    reference replies the batches made: `batched_runner.PrecomputedBackend.attention_error`)."""
    return None


OWN_FLOOR = "own"  # `batch_floor` of a path whose batch-invariance floor the batched replay measures on the path


def batch_floor(kv_path: KVPath | None) -> str:
    """Which batch-invariance floor bounds what batching alone moves on this path: the reference's (measured every
    batched run, `batched_runner._batch_invariance`), or the path's own (OWN_FLOOR, measured the same way on the
    path, stored per path in `batching[model].batch_invariance_floors`).

    FP8 attention (fp8_q / fp8_p) gets its own. Measured on the CPU tiny models, 4 left-padded rows against each
    alone (12 tokens): `fp8_q:fp8_p` parts from the alone run at the first token in every padded row of gqa and
    mla (top-2 gap up to 0.094, above the bf16 batch floor of 0.07): FP8 Q/P rounding amplifies the batch's
    reduction order (a bf16 score that moves by one ulp can cross an FP8 rounding boundary of Q.K's or P's
    input), so the reference's floor would understate what batching alone moves on such a path. Batched on the CPU
    canaries (default set, `--paths fp8_e4m3:fp8_q:fp8_p --batch-size 4` against one at a time, 4 first-turn replies
    each): max |log-prob| moved by batching, reference / fp8_q:fp8_p, gqa 0.19 / 0, mla 0 / 0, hybrid 0.52 / 0.87
    (kl_mean 4.8e-5 / 3.2e-4); all 63 fp8_q:fp8_p replies identical to one at a time, verdicts unchanged (21 of 21
    turns pass on each model in both runs)."""
    if kv_path is not None and kv_path.quantizes_attention:
        return OWN_FLOOR
    return "reference"


# Why a batch of a `kernel=` plug-in path decodes eagerly where graph decode was asked (the engine names it too)
EVERY_CALL_EAGER = ("static (graph decode refused: a kernel= plug-in's every call is judged and timed, device "
                    "synchronised around it, so every decode step runs eagerly)")


def _decode(facts: ModelFacts, device_type: str, batched: bool, asked: str, every_call: bool = False,
            shard: str | None = None) -> str:
    if not batched:
        return ONE_AT_A_TIME
    mode = ("graph" if device_type == "cuda" else "dynamic") if asked == "auto" else asked
    if layout_decode_refusal(shard) is not None and mode != "dynamic":
        return f"dynamic ({mode} decode refused for this model: {layout_decode_refusal(shard)})"
    if mode == "graph" and every_call:
        mode = "static" if facts.static_refusal is not None else EVERY_CALL_EAGER
    if mode != "dynamic" and facts.static_refusal is not None:
        return f"dynamic ({mode} decode refused for this model: {facts.static_refusal})"
    return mode


def _rows(facts: ModelFacts, kernel: str | None, kv_path: KVPath | None) -> str:
    """ROWS, or one sequence at a time and why not. Rows give a sequence's bits only where every op computes a row
    alone alike in any batch; the GEMMs are the ones to doubt."""
    if kernel is not None:
        why = "decode runs through a kernel (its paged copy, checks and timings are kept per sequence)"
    elif facts.stack_refusal is not None:
        why = f"cache layers that cannot be stacked ({facts.stack_refusal})"
    elif kv_path is not None and kv_path.is_reference_noise:
        why = "the float32 model's GEMMs (MKL's) are not shown to give a row the same bits in every batch size"
    elif onednn_bf16():
        why = ("oneDNN has bf16 GEMMs on this CPU, whose blocking may follow the row count (an AVX-512 BF16 EPYC: "
               "1 of 27 path x family cases of tests/test_rows.py one float apart, tokens equal)")
    else:
        return ROWS
    return f"{ONE_AT_A_TIME}; rows refused: {why}"


@functools.lru_cache(maxsize=1)
def onednn_bf16() -> bool:
    """Whether torch's bf16 GEMMs on this CPU are oneDNN's (AVX-512 BF16 / AMX) rather than its fallback, one dot
    product per output (row-independent by construction, as is kernels/cpu_bf16_linear.c beside it)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def capture_kernel_refusal(kv_path: KVPath, kernel: str | None) -> str | None:
    """Why attention capture does not measure the kernel's rows for this path (None: it does)."""
    if kernel is None:
        return "no decode kernel"
    if kv_path.is_quantized and kv_path.k_format.name in capabilities.BLOCK_SCALED_MLA:
        return "capture's kernel rows read FP8 pages, not block-scaled ones: torch's rows only"
    if not kv_path.is_fp8 or kv_path.granularity == "per_token" or kv_path.k_format is not kv_path.v_format:
        return "the path's decode does not run through a kernel"
    if kv_path.quantizes_attention:
        # decode runs these through our kernels (with q_scale / prob_scale), but capture's kernel rows call the
        # kernel without them: rows of a different computation would be mislabelled as this path's
        return "capture runs the kernel without the path's q/prob scales: torch's rows only"
    return None
