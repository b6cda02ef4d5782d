"""The harness at real-model scale on one GPU: batched replay vs plain `model.generate`, per KV path.

    python benchmarks/scale_bench.py [--configs 8b-1k,8b-8k,mla-1k] [--canary-run]
    python benchmarks/scale_bench.py --configs mla-1k,mla-8k --paths bf16,fp8_e4m3   # V2-Lite, 1k and 8k context
    python benchmarks/scale_bench.py --configs "" --gpus 2 --sharded 70b,8b   # rows across GPUs

Configurations (`--configs`, default 8b-1k,8b-8k,mla-1k): 8b-1k (8B, batch 32, 1k-token prompts, every path, plain
`generate` beside it), 8b-8k (8B, batch 16, 8k, 16 tokens or --new-8k, the first two paths, or every path --paths
names), mla-1k (V2-Lite, batch 16, 1k, the first three paths, plain `generate` beside it), mla-8k (V2-Lite, batch 16,
8k, the first two paths, 128 tokens; opt-in: its two paths' calls, six prefills of 16 x 8k tokens, took ~45 s on an
H200, and the default run with it was not timed against a device call's limit), gptoss-1k / gptoss-8k
(gpt-oss-20b-shaped: sliding windows and attention sinks, batch 32 at 1k and 16 at 8k, the first two paths, plain
`generate` beside the 1k row; opt-in: 42 GB of weights).

No downloads: random-weight models built from configs on the GPU (a Llama-3-8B-shaped GQA model and a
DeepSeek-V2-Lite-shaped MLA model), synthetic ragged prompts. For each configuration it prints generated
tokens/s of the harness's batched replay per KV path, the same for plain transformers `generate` at the same
batch and lengths (the baseline, same process), FP8 time / bf16 time, per-decode-step time against the
bandwidth roof (weights + KV bytes per step over measured copy bandwidth), and peak GPU memory.
`--canary-run` also times the default `harness run --device cuda` (bundled canaries) in a subprocess.

Across GPUs (`--gpus N`, `--sharded`):
- data-parallel (8B-shaped, a worker process per GPU, each with its own batch of 32 x 1k prompts, as a
  data-parallel run gives each GPU its own models or scenarios): decode tokens/s aggregated over the workers
  (tokens decoded after prefill / wall from the first worker's decode start to the last one's decode end, the
  workers released together by a barrier after warm-up) for 1 and N GPUs, the ratio, and each row's wall clock
  from process start to the last result (cold start included: imports, CUDA, model build, Triton compile);
- layer-sharded (`--sharded 70b`: a Llama-3-70B-shaped model, 80 layers over the GPUs, random weights made on the
  GPUs, never on the CPU; `8b`, `mla`: the 8B model or the DeepSeek-V2-Lite-shaped MLA model sharded against the
  same model on one GPU, the ratio): plain `generate` at batch 8, the harness's one-sequence-at-a-time replay and
  its batched replay at batch 8 (what a layer-sharded run replays; bf16 and FP8 through our kernels), decode
  tokens/s and % of the bandwidth roof (layers run one GPU after another, so the roof is every weight byte at one
  GPU's copy bandwidth). `--no-data-parallel`: these rows alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.kv_paths import attention  # noqa: E402
from harness.kv_paths.spec import parse_path  # noqa: E402
from harness.replay.batched import BatchedEngine, BatchSettings, kv_bytes_per_token  # noqa: E402
from harness.replay.inprocess import InProcessModel  # noqa: E402

_USER_ENV: dict | None = None  # the environment `main` started in: the canary run's (a whole `harness run`)

# Tokens of the short timed call of the batched replay: its decode tok/s is (t(new) - t(SHORT)) / (new - SHORT).
# An FP8 path runs its first decode step eagerly (Triton's first launches, absorbed weights) and captures its CUDA
# graph at the second; BF16 captures at the first. With 2 tokens the FP8 capture fell in the long call only and was
# charged to every step: V2-Lite fp8_e4m3 read 0.85x bf16 (session 10), while between 18 and 34 tokens, under a
# profiler, its step took 19.7 ms against bf16's 22.0. With 4 tokens both calls capture once.
SHORT = 4

PATHS = ["bf16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3:per_head", "fp8_e4m3:per_token"]
CONFIGS = ("8b-1k", "8b-8k", "mla-1k", "mla-8k", "gptoss-1k", "gptoss-8k")
DEFAULT_CONFIGS = "8b-1k,8b-8k,mla-1k"


def llama_8b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=16384, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)


def deepseek_v2_lite():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                            num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6,
                            n_shared_experts=2, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None,
                            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                            vocab_size=102400, max_position_embeddings=16384, bos_token_id=None, eos_token_id=None)


def gpt_oss_20b():
    """gpt-oss-20b's shape: 24 layers alternating a 128-token sliding window and full attention, attention sinks
    (`s_aux`), 64 query heads over 8 KV heads of 64, 32 experts (4 a token). 21B parameters, 42 GB in bf16."""
    from transformers import GptOssConfig

    layers = 24
    return GptOssConfig(num_hidden_layers=layers, num_local_experts=32, num_experts_per_tok=4,
                        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build(config) -> InProcessModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attention.ATTENTION_NAME)
    model.eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return InProcessModel(directory=Path("random"), model=model, tokenizer=None, device=torch.device("cuda"),
                          arch=config.model_type, random_weights=True, use_kernels=True)


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Ragged synthetic prompts: length - 0..63 tokens (as turns of a multi-turn chat differ in length)."""
    g = torch.Generator().manual_seed(seed)
    lens = [length - int(torch.randint(0, 64, (1,), generator=g)) for _ in range(batch)]
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lens]


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 10
    del x, y
    return 2 * (2 << 30) / seconds  # bytes read + written per second


# which of our CUDA launchers a path's calls ran (the column "decode attention"): filled by the counting wrappers
# `count_cuda_launchers` installs, cleared per path; empty: the Triton kernels (or torch) ran
CUDA_SEEN: set[str] = set()


def count_cuda_launchers() -> None:
    """Wrap the CUDA launchers (GQA: kernels/gqa_decode_cuda.py; MLA: kernels/mla_decode.py's, its latent split over
    the plain FP8 cache, and over a block-scaled latent kernels/mla_block_scaled_cuda.py) so each call is noted in
    CUDA_SEEN (graph replays call none: the capture's call is noted)."""
    from kernels import gqa_decode_cuda, mla_block_scaled_cuda, mla_decode
    for module, name, label in ((gqa_decode_cuda, "decode", "cuda"), (mla_decode, "_mla_decode_cuda", "cuda (mla)"),
                                (mla_block_scaled_cuda, "decode_plain_fp8", "cuda (mla, latent split)"),
                                (mla_block_scaled_cuda, "decode", "cuda (mla)")):
        real = getattr(module, name)
        if not getattr(real, "counted", False):
            def counted(*args, _real=real, _label=label, **kwargs):
                CUDA_SEEN.add(_label)
                return _real(*args, **kwargs)
            counted.counted = True
            setattr(module, name, counted)


def kernel_label(backend) -> str:
    """The decode kernel a path's calls ran: the route's refusal, else our CUDA or Triton kernels."""
    return backend.route.kernel_refusal or "+".join(sorted(CUDA_SEEN)) or "triton"


def timed(fn) -> tuple[float, float, object]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30, result


def launches_per_step(engine: BatchedEngine, ps: list[list[int]]) -> float:
    """Kernel launches (CUDA runtime + driver, Triton's included) per decode step: profiled 1- and 5-token calls."""
    from torch.profiler import ProfilerActivity, profile

    counts = []
    for n in (1, 5):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(ps, n)
        counts.append(sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key))
    return (counts[1] - counts[0]) / 4


@contextlib.contextmanager
def step_clock():
    """The wall time between successive decode steps of static / graph decode (`StaticDecodeStep.run`), collected
    while the block runs: each step ends in a host read of its tokens, so an interval is one whole step (GPU work,
    host work, the read). Its median is the decode step time free of the prefill's run-to-run spread, which
    `(t(new) - t(SHORT)) / (new - SHORT)` divides over few steps at 8k (session 22: 16 x 8k, 12 steps apart,
    read FP8 1.8 ms a step, under the bandwidth roof)."""
    from harness.replay.batched import StaticDecodeStep

    stamps: list[float] = []
    inner = StaticDecodeStep.run

    def run(self, *args, **kwargs):
        stamps.append(time.perf_counter())
        return inner(self, *args, **kwargs)

    StaticDecodeStep.run = run
    try:
        yield stamps
    finally:
        StaticDecodeStep.run = inner


@contextlib.contextmanager
def phase_clock():
    """Seconds of each phase of the batched calls made while the block runs, each phase's GPU work synchronised
    before and after it (so a phase's time is its own): prefill (every chunk of every batch), eager decode steps
    (the first step, which does the lazy initialisation, and kernel-checked steps; the check included), the fp64
    kernel-agreement checks alone (inside the prefill, at the prompt's end, or inside eager steps), and CUDA graph
    capture. What a whole call spends beyond them is graph replays and the host's work between steps."""
    from harness.replay.batched import StaticDecodeStep

    spent = {"prefill": 0.0, "eager_steps": 0.0, "kernel_checks": 0.0, "capture": 0.0}
    patched = [(BatchedEngine, "_prefill_static", "prefill"), (BatchedEngine, "_prefill", "prefill"),
               (StaticDecodeStep, "_forward", "eager_steps"), (StaticDecodeStep, "_capture", "capture"),
               (attention.PagedKV, "_check", "kernel_checks")]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]

    def clocked(inner, phase):
        def run(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():  # the forward pass a capture records: the capture's
                return inner(*args, **kwargs)
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                spent[phase] += time.perf_counter() - start
        return run

    for (owner, name, phase), (_, _, inner) in zip(patched, originals):
        setattr(owner, name, clocked(inner, phase))
    try:
        yield spent
    finally:
        for owner, name, inner in originals:
            setattr(owner, name, inner)


def median_step(stamps: list[float], skip: int = 3) -> float | None:
    """Median interval between decode steps after the first `skip` (eager step, capture), or None (too few)."""
    gaps = sorted(b - a for a, b in zip(stamps[skip:], stamps[skip + 1:]) if b > a)
    return gaps[len(gaps) // 2] if len(gaps) >= 4 else None


def difference_step(step: float, steady: float | None) -> float | None:
    """The step from two calls' difference, (t(new) - t(SHORT)) / (new - SHORT), or None where it is noise: not
    positive, or more than 2x off the median step of the timed call. At long prompts the prefill's spread between
    two calls exceeds the decode steps' time (session 26, 8k: 13,220 and -28,769 decode tok/s)."""
    if step <= 0 or (steady and not 0.5 <= step / steady <= 2.0):
        return None
    return step


def run_config(name: str, loaded: InProcessModel, batch: int, length: int, new: int, paths: list[str],
               bandwidth: float, baseline: bool, log, profile: bool = False, phases: bool = False) -> list[dict]:
    model, config = loaded.model, loaded.model.config
    rows = []
    ps = prompts(batch, length, config.vocab_size, seed=1)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mean_ctx = sum(len(p) for p in ps) / batch + new / 2

    def roof_ms(kv_bytes_per_token: float) -> float:
        return (weight_bytes + batch * mean_ctx * kv_bytes_per_token) / bandwidth * 1e3

    if baseline:
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p[::-1]) for p in ps], batch_first=True).flip(1).cuda()
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(p), dtype=torch.long) for p in ps],
                                               batch_first=True).flip(1).cuda()

        def generate(n):
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False)

        # the baseline with the harness's attention function (same SDPA calls as the replay), then with
        # transformers' stock "sdpa" (torch's default backends: cuDNN on an H100), what a user runs by default
        for label, implementation in (("plain generate (bf16)", None), ("plain generate (bf16, stock sdpa)", "sdpa")):
            try:
                if implementation is not None:  # gpt-oss: transformers refuses "sdpa" (its sinks)
                    model.set_attn_implementation(implementation)
                timed(lambda: generate(2))  # warm-up
                t2, _, _ = timed(lambda: generate(2))
                tn, peak, _ = timed(lambda: generate(new))
            except Exception as error:  # noqa: BLE001 - the stock row is information; the harness row is the baseline
                if implementation is None:
                    raise
                rows.append({"config": name, "path": label, "error": f"{type(error).__name__}: {str(error)[:80]}"})
                log(rows[-1])
                continue
            finally:
                model.set_attn_implementation(attention.ATTENTION_NAME)
            step = (tn - t2) / (new - 2)
            rows.append({"config": name, "path": label, "tok_s": batch * new / tn, "s": tn, "step_ms": step * 1e3,
                         "decode_tok_s": batch / step,
                         "roof": roof_ms(kv_bytes_per_token(config)) / (step * 1e3), "peak": peak})
            log(rows[-1])
    bf16_time = None
    for spec in paths:
        backend = loaded.backend(parse_path(spec))
        CUDA_SEEN.clear()
        engine = BatchedEngine(backend, BatchSettings(batch_size=batch, kernel_check_every=10**9))
        live_before = torch.cuda.memory_allocated() / 2**30  # what earlier runs left allocated (weights etc.)
        try:
            # warm-up at the timed shapes, so every Triton specialisation is compiled before timing
            engine.generate(ps, SHORT)
            # decode step 0 runs the kernel-agreement check (fp64, every row) and a graph is captured once per
            # call: both timed calls include each once
            t_short, _, _ = timed(lambda: engine.generate(ps, SHORT))
            with step_clock() as stamps:
                tn, peak, result = timed(lambda: engine.generate(ps, new))
        except torch.OutOfMemoryError as error:
            rows.append({"config": name, "path": spec, "error": f"OOM: {str(error)[:80]}"})
            log(rows[-1])
            torch.cuda.empty_cache()
            continue
        produced = sum(len(r.token_ids) for r in result)
        launches = launches_per_step(engine, ps) if profile else None
        spent = None
        if phases:  # a third call, phases synchronised (its total is a little above the timed call's)
            with phase_clock() as spent:
                spent["whole"], _, _ = timed(lambda: engine.generate(ps, new))
        steady = median_step(stamps)
        step = difference_step((tn - t_short) / (new - SHORT), steady)
        kv = kv_bytes_per_token(config) / (2 if backend.kv_path.is_fp8 else 1)
        if spec == "bf16":
            bf16_time = tn
        rows.append({"config": name, "path": spec, "tok_s": produced / tn, "s": tn,
                     "step_ms": step * 1e3 if step else None, "decode_tok_s": batch / step if step else None,
                     "roof": roof_ms(kv) / (step * 1e3) if step else None, "peak": peak,
                     "x_bf16": tn / bf16_time if bf16_time else None,
                     "kernel": kernel_label(backend), "batches": engine.batch_sizes_used[-1:],
                     "live_before": live_before, "launches_per_step": launches,
                     "median_step_ms": steady * 1e3 if steady else None,
                     "median_decode_tok_s": batch / steady if steady else None,
                     "decode_mode": "+".join(sorted(engine.decode_batches)),
                     "decode_fallbacks": engine.decode_fallbacks, "phases": spent})
        log(rows[-1])
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ across GPUs


def llama_70b(vocab_size: int = 128256):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=vocab_size, max_position_embeddings=8192, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)


def build_sharded(config, devices: list[str]) -> InProcessModel:
    """`config`'s model with its layers over `devices`, random weights made on each GPU (harness.replay.sharding)."""
    from harness.replay import sharding

    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        skeleton = AutoModelForCausalLM.from_config(config)
    plan = sharding.plan_for(skeleton, devices)
    del skeleton
    model = sharding._random_on_devices(config, plan, torch.bfloat16, attention.ATTENTION_NAME, seed=0).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return InProcessModel(directory=Path("random"), model=model, tokenizer=None, device=torch.device(devices[0]),
                          arch=config.model_type, random_weights=True, use_kernels=True, shard_plan=plan)


def sync_all() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def synced_wall(fn) -> float:
    """Seconds `fn()` takes, every GPU synchronised before and after (a sharded model's layers run on several)."""
    sync_all()
    start = time.perf_counter()
    fn()
    sync_all()
    return time.perf_counter() - start


def one_at_a_time_rows(name: str, loaded: InProcessModel, length: int, new: int, paths: list[str], bandwidth: float,
                       log, gpus: int) -> list[dict]:
    """The harness's one-sequence-at-a-time greedy decode (what a layer-sharded run replays), per KV path,
    and plain `generate` at batch 8: decode tokens/s from (t(new) - t(2)) / (new - 2)."""
    import types

    model, config = loaded.model, loaded.model.config
    if loaded.tokenizer is None:  # random token ids: no EOS, decoding runs to its limit
        loaded.tokenizer = types.SimpleNamespace(eos_token_id=None, pad_token_id=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    prompt = prompts(1, length, config.vocab_size, seed=1)[0]
    for spec in paths:
        backend = loaded.backend(parse_path(spec))
        CUDA_SEEN.clear()
        try:
            backend.greedy_ids(prompt, 2)  # warm-up: Triton compiles
            t2 = synced_wall(lambda: backend.greedy_ids(prompt, 2))
            generated = []
            tn = synced_wall(lambda: generated.append(backend.greedy_ids(prompt, new)))
            ids = generated[0][0]
        except torch.OutOfMemoryError as error:
            rows.append({"config": name, "path": spec, "error": f"OOM: {str(error)[:80]}"})
            log(rows[-1])
            continue
        step = (tn - t2) / (new - 2)
        kv = kv_bytes_per_token(config) / (2 if backend.kv_path.is_fp8 else 1)
        roof = (weight_bytes + (length + new / 2) * kv) / bandwidth
        rows.append({"config": name, "gpus": gpus, "path": f"{spec} (one at a time)", "decode_tok_s": 1 / step,
                     "step_ms": step * 1e3, "roof": roof / step, "kernel": kernel_label(backend),
                     "tokens": len(ids)})
        log(rows[-1])
    batch = 8
    ps = prompts(batch, length, config.vocab_size, seed=2)
    first = loaded.device
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p[::-1]) for p in ps], batch_first=True).flip(1).to(first)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(p), dtype=torch.long) for p in ps],
                                           batch_first=True).flip(1).to(first)

    def generate(n):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync_all()
        return out

    try:
        generate(2)
        start = time.perf_counter()
        generate(2)
        t2 = time.perf_counter() - start
        start = time.perf_counter()
        generate(new)
        tn = time.perf_counter() - start
        step = (tn - t2) / (new - 2)
        roof = (weight_bytes + batch * (length + new / 2) * kv_bytes_per_token(config)) / bandwidth
        rows.append({"config": name, "gpus": gpus, "path": f"plain generate b{batch} (bf16)",
                     "decode_tok_s": batch / step, "step_ms": step * 1e3, "roof": roof / step})
    except torch.OutOfMemoryError as error:
        rows.append({"config": name, "path": "plain generate", "error": f"OOM: {str(error)[:80]}"})
    log(rows[-1])
    return rows


def batched_rows(name: str, loaded: InProcessModel, length: int, new: int, paths: list[str], log, gpus: int,
                 batch: int = 8) -> list[dict]:
    """The harness's batched replay (what a layer-sharded run replays since session 21: the batched engine; a
    graph-decoded step of a layer-sharded model is one graph per GPU since session 35, `route.LAYERS_GRAPH`) at
    `batch` sequences, per KV path: decode tokens/s from
    (t(new) - t(SHORT)) / (new - SHORT), as `run_config` times it."""
    rows = []
    ps = prompts(batch, length, loaded.model.config.vocab_size, seed=2)
    for spec in paths:
        backend = loaded.backend(parse_path(spec))
        CUDA_SEEN.clear()
        engine = BatchedEngine(backend, BatchSettings(batch_size=batch, kernel_check_every=10**9))
        try:
            engine.generate(ps, SHORT)  # warm-up: Triton compiles at these shapes
            t_short = synced_wall(lambda: engine.generate(ps, SHORT))
            tn = synced_wall(lambda: engine.generate(ps, new))
        except torch.OutOfMemoryError as error:
            rows.append({"config": name, "gpus": gpus, "path": f"{spec} (batched b{batch})",
                         "error": f"OOM: {str(error)[:80]}"})
            log(rows[-1])
            free_models()
            continue
        step = (tn - t_short) / (new - SHORT)
        rows.append({"config": name, "gpus": gpus, "path": f"{spec} (batched b{batch})", "decode_tok_s": batch / step,
                     "step_ms": step * 1e3, "kernel": kernel_label(backend),
                     "note": f"decode {'+'.join(sorted(engine.decode_batches))}, largest batch "
                             f"{max(engine.batch_sizes_used, default=0)}"
                             + "".join(f"; {why}" for why in dict.fromkeys(engine.decode_fallbacks))})
        log(rows[-1])
    return rows


def free_models() -> None:
    """Drop models no longer referenced (accelerate's hooks make reference cycles: only the collector frees them)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def sharded_rows(which: list[str], gpus: int, new: int, bandwidth: float, log, batched_only: bool = False,
                 rounds: int = 1) -> list[dict]:
    # more GPUs asked for than the host has: a GPU named twice (a smoke run of the code on one GPU; rows say so)
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(gpus)]
    if len(set(devices)) < gpus:
        log({"note": f"--gpus {gpus} on a host of {torch.cuda.device_count()}: devices {devices} (GPUs named twice: "
                     f"the sharded rows time the code, not a spread over GPUs)"})
    rows = []
    paths = ["bf16", "fp8_e4m3"]
    # models that fit one GPU: on one GPU, then sharded over `gpus`: what sharding itself costs
    for key, name, make in (("8b", "8b 1k", llama_8b), ("mla", "v2-lite 1k", deepseek_v2_lite)):
        if key not in which:
            continue
        torch.manual_seed(0)
        one = build(make())
        start = len(rows)
        rows += one_at_a_time_rows(name, one, 1024, new, paths, bandwidth, log, 1)
        rows += batched_rows(name, one, 1024, new, paths, log, 1)
        alone = {r["path"]: r["decode_tok_s"] for r in rows[start:] if "decode_tok_s" in r}
        del one
        free_models()
        sharded = build_sharded(make(), devices)
        start = len(rows)
        rows += one_at_a_time_rows(name, sharded, 1024, new, paths, bandwidth, log, gpus)
        rows += batched_rows(name, sharded, 1024, new, paths, log, gpus)
        for r in rows[start:]:
            if r.get("path") in alone:
                r["x_1gpu"] = r["decode_tok_s"] / alone[r["path"]]
        del sharded
        free_models()
    if "70b" in which:
        start = time.perf_counter()
        loaded = build_sharded(llama_70b(), devices)
        built = time.perf_counter() - start
        per_gpu = [torch.cuda.memory_allocated(d) / 2**30 for d in devices]
        log({"config": "70b", "built_s": built, "allocated_gib_per_gpu": per_gpu,
             "layers": loaded.shard_plan.describe()["layers"]})
        start = len(rows)
        if not batched_only:
            rows += one_at_a_time_rows("70b 512", loaded, 512, new, paths, bandwidth, log, gpus)
        for _ in range(rounds):  # rounds alternate the paths: each batch captures its graphs anew
            rows += batched_rows("70b 512", loaded, 512, new, paths, log, gpus)
        for r in rows[start:]:
            r["note"] = "; ".join(filter(None, (r.get("note"), f"built on the GPUs in {built:.1f} s; GiB allocated "
                                                                f"per GPU {[round(g, 1) for g in per_gpu]}")))
        del loaded
        free_models()
    return rows


def _dp_worker(rank: int, barrier, results, batch: int, length: int, new: int, paths: list[str]) -> None:
    """One data-parallel worker: its own 8B model and batch on GPU `rank`; timings in perf_counter (CLOCK_MONOTONIC,
    one clock for every process of the host)."""
    try:
        torch.cuda.set_device(rank)
        torch.manual_seed(0)
        loaded = build(llama_8b())
        loaded.device = torch.device(f"cuda:{rank}")
        ps = prompts(batch, length, loaded.model.config.vocab_size, seed=1 + rank)
        out = {"rank": rank, "ready": time.perf_counter(), "paths": {}}
        for spec in paths:
            engine = BatchedEngine(loaded.backend(parse_path(spec)), BatchSettings(batch_size=batch,
                                                                                  kernel_check_every=10**9))
            engine.generate(ps, 2)  # warm-up: Triton compiles, graphs captured at these shapes
            starts = []
            for name in ("_prefill", "_prefill_static"):
                inner = getattr(engine, name)

                def marked(*args, _inner=inner, **kwargs):
                    result = _inner(*args, **kwargs)
                    torch.cuda.synchronize()
                    starts.append(time.perf_counter())  # prefill done: decode starts
                    return result
                setattr(engine, name, marked)
            barrier.wait()
            result = engine.generate(ps, new)
            torch.cuda.synchronize()
            end = time.perf_counter()
            out["paths"][spec] = {"decode_start": starts[0], "decode_end": end,
                                  "decoded": sum(max(0, len(r.token_ids) - 1) for r in result)}
            barrier.wait()
        results.put(out)
    except BaseException as error:  # noqa: BLE001 - reported by the parent, which then stops waiting
        results.put({"rank": rank, "error": f"{type(error).__name__}: {str(error)[:300]}"})
        barrier.abort()


def data_parallel_rows(gpus: int, new: int, paths: list[str], log, batch: int = 32, length: int = 1024) -> list[dict]:
    """8B-shaped batched decode on 1 and on `gpus` GPUs, a worker process each (see the module's docstring)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    rows, base = [], {}
    for n in sorted({1, gpus}):
        start = time.perf_counter()
        barrier, results = context.Barrier(n), context.Queue()
        workers = [context.Process(target=_dp_worker, args=(r, barrier, results, batch, length, new, paths))
                   for r in range(n)]
        for w in workers:
            w.start()
        got = [results.get(timeout=300) for _ in workers]
        for w in workers:
            w.join(timeout=60)
        wall = time.perf_counter() - start
        errors = [g["error"] for g in got if "error" in g]
        if errors:
            rows.append({"config": f"8b b{batch} 1k data-parallel", "gpus": n, "path": ",".join(paths),
                         "error": "; ".join(errors)[:300]})
            log(rows[-1])
            continue
        for spec in paths:
            parts = [g["paths"][spec] for g in got]
            window = max(p["decode_end"] for p in parts) - min(p["decode_start"] for p in parts)
            tok_s = sum(p["decoded"] for p in parts) / window
            per_worker = [p["decoded"] / (p["decode_end"] - p["decode_start"]) for p in parts]
            base.setdefault(spec, tok_s)
            rows.append({"config": f"8b b{batch}/GPU 1k data-parallel", "gpus": n, "path": spec,
                         "decode_tok_s": tok_s, "x_1gpu": tok_s / base[spec], "wall_s": wall,
                         "per_worker": [round(t) for t in per_worker],
                         "cold_start_s": max(g["ready"] for g in got) - start})
            log(rows[-1])
    return rows


def print_multi_rows(rows: list[dict]) -> None:
    print("\n(across GPUs; decode tok/s: data-parallel = tokens decoded after prefill by every worker / wall from "
          "the first decode start to the last decode end; one at a time and generate = batch / decode-step time)\n"
          "| config | GPUs | path | decode tok/s | x 1 GPU | ms/step | roof frac | wall s (process start to end) | "
          "cold start s | per worker tok/s | note |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r.get('gpus', '')} | {r.get('path', '')} | error: {r['error']} |")
            continue
        if "decode_tok_s" not in r:
            continue

        def f(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else ""
        print(f"| {r['config']} | {r['gpus']} | {r['path']} | {r['decode_tok_s']:.1f} | {f('x_1gpu', '.2f')} | "
              f"{f('step_ms', '.1f')} | {f('roof', '.2f')} | {f('wall_s', '.1f')} | {f('cold_start_s', '.1f')} | "
              f"{r.get('per_worker', '')} | {r.get('note', '')} |")


def write_random_model_dir(out: Path, config, tokenizer_from: Path) -> Path:
    """A model directory a `harness run` can name without weights on disk: config, the tokenizer of
    `tokenizer_from`, the random-weights marker (`--shard layers` then makes the weights on the GPUs)."""
    import shutil

    from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER

    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    config.save_pretrained(out)
    (out / RANDOM_WEIGHTS_MARKER).write_text("random weights made on the GPUs at load (seed 0): outputs are noise\n")
    return out


CANARY_SNIPPET = """
import asyncio, json, sys, time
from pathlib import Path
from harness import job
from harness.replay import batched, batched_runner, inprocess, runner
spent = {}
def add(name, seconds):
    spent[name] = spent.get(name, 0.0) + seconds
    if name in ("reference_waves", "candidate_waves", "replay_records", "judge"):
        print("CANARY_PARTIAL " + json.dumps(spent), flush=True)
        if len(sys.argv) > 2:  # also to a file, which survives the process (or its parent) being stopped
            with open(sys.argv[2], "a") as phases:
                phases.write(json.dumps(spent) + "\\n")
def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add(name, time.perf_counter() - start)
    return wrapper
def timed_async(name, fn):
    async def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            add(name, time.perf_counter() - start)
    return wrapper
inprocess.InProcessModel.load = classmethod(timed("load", inprocess.InProcessModel.load.__func__))
B = batched_runner.BatchedReplay
for name in ("_reference_waves", "_candidate_waves", "_score_waves", "_batch_invariance"):
    setattr(B, name, timed(name.strip("_"), getattr(B, name)))
runner.Replay.run = timed_async("replay_records", runner.Replay.run)
job._judge = timed_async("judge", job._judge)
job.write_verdicts = timed("verdicts", job.write_verdicts)
E = batched.BatchedEngine
steps = {"forward": 0, "decode_rows": 0}
forward = E._forward
def counted(self, ids, *args, **kwargs):
    steps["forward"] += 1
    steps["decode_rows"] += ids.shape[0] if ids.shape[1] == 1 else 0
    return forward(self, ids, *args, **kwargs)
E._forward = counted
E._prefill = timed("prefill", E._prefill)
E._score_batch = timed("score_batches", E._score_batch)
E._generate_batch = timed("generate_batches", E._generate_batch)
batched.attention.PagedKV._check = timed("kernel_checks", batched.attention.PagedKV._check)
try:
    import triton.compiler.compiler as tc
    import triton.runtime.jit as tj
    compile_fn = timed("triton_compile", tc.compile)
    tc.compile = compile_fn
    if hasattr(tj, "compile"):
        tj.compile = compile_fn
except Exception as error:
    spent["triton_compile_hook"] = str(error)
models, _ = job.default_models()
config = job.RunConfig(models=models, scenario_paths=job.default_scenarios(), paths=job.parse_kv_paths(job.DEFAULT_PATHS),
                       out=Path(sys.argv[1]), device="cuda")
start = time.perf_counter()
job.run_job(config)
spent["total"] = time.perf_counter() - start
spent.update(steps)
print("CANARY " + json.dumps(spent))
"""


def canary_run(timeout: float = 240, phases_file: Path | None = None) -> dict:
    """The default canary run on CUDA in a fresh process: total, model load and judge seconds, and the seconds
    of each phase (appended to `phases_file` as they finish, when given)."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-c", CANARY_SNIPPET, str(Path(tmp) / "run"),
                                   *([str(phases_file)] if phases_file else [])], capture_output=True, text=True,
                                  timeout=timeout, env=_USER_ENV)
        except subprocess.TimeoutExpired as error:
            partial = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
            done = subprocess.CompletedProcess([], returncode=-1, stdout=partial, stderr=f"timed out after {timeout} s")
        wall = time.perf_counter() - start
        manifest_file = Path(tmp) / "run" / "manifest.json"
        manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else {}
        done_file = Path(tmp) / "run" / "done.jsonl"
        units = sum(1 for _ in open(done_file)) if done_file.exists() else 0
    lines = done.stdout.splitlines()
    spent = next((json.loads(line[7:]) for line in lines if line.startswith("CANARY ")), None)
    if spent is None:  # stopped early: the phases finished so far
        spent = next((json.loads(line[15:]) for line in reversed(lines) if line.startswith("CANARY_PARTIAL ")), {})
    return {"wall_s": wall, "rc": done.returncode, "units": units, **spent, "status": manifest.get("status"),
            "batching": manifest.get("batching"), "stderr_tail": done.stderr[-1500:]}


def main() -> None:
    global _USER_ENV
    # the rows time replay, not its checks: the kernel agreement check is off (kernel_check_every=10**9 below) and so is
    # the implementation check, which probes every row's prefill and eager decode steps in fp64 with a host read per
    # call: in the 2-token run that the decode step time is taken against, those eager steps are most of it (with it
    # on, session 9's H100 bench read 64981 decode tok/s for fp8_e4m3: a 2-token run slower than a 64-token one)
    # (set here, not on import: a test that imports this module must keep the check)
    _USER_ENV = dict(os.environ)
    os.environ.setdefault("HARNESS_IMPL_CHECK", "0")
    count_cuda_launchers()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated, of {', '.join(CONFIGS)} (see above; default {DEFAULT_CONFIGS})")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--new", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--new-8k", type=int, default=16,
                        help="tokens generated per sequence by the 8b-8k rows (16: prefill is most of the call)")
    parser.add_argument("--canary-run", action="store_true")
    parser.add_argument("--canary-timeout", type=float, default=240.0, help="seconds before the canary run is stopped")
    parser.add_argument("--log", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="also count kernel launches per decode step")
    parser.add_argument("--phases", action="store_true",
                        help="also time one more call of each path by phase (prefill, eager steps, checks, capture)")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel rows on 1 and this many GPUs (8B-shaped)")
    parser.add_argument("--no-data-parallel", action="store_true",
                        help="with --gpus N: only the --sharded rows, not the data-parallel ones")
    parser.add_argument("--sharded", default="", help="layer-sharded rows over --gpus GPUs: 70b, 8b (comma-separated)")
    parser.add_argument("--sharded-batched-only", action="store_true",
                        help="the 70B-shaped sharded model's batched rows only (no one-at-a-time or plain generate)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the 70B-shaped batched rows this many times, alternating")
    parser.add_argument("--write-70b-dir", type=Path, default=None,
                        help="write a 70B-shaped random-weights model directory (canary tokenizer) and exit")
    args = parser.parse_args()
    unknown = [c for c in args.configs.split(",") if c and c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    if args.write_70b_dir:
        from harness.job import CANARY_WEIGHTS

        print(write_random_model_dir(args.write_70b_dir, llama_70b(vocab_size=128), CANARY_WEIGHTS / "gqa"))
        return
    out = open(args.log, "a") if args.log else None

    def log(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    import transformers
    import triton

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"triton {triton.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    rows, extra = [], []
    if args.canary_run:
        result = canary_run(args.canary_timeout, args.log.with_suffix(".canary_phases.jsonl") if args.log else None)
        log({"canary_run": result})
        extra.append(f"default canary run on cuda: {result.get('total', float('nan')):.1f} s in run_job "
                     f"(model load {result.get('load', float('nan')):.1f} s, judges {result.get('judge', float('nan')):.1f} s), "
                     f"process wall {result['wall_s']:.1f} s, {result['units']} units, status {result.get('status')}")
        phases = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()
                  if k not in ("stderr_tail", "batching", "wall_s", "rc", "units", "status")}
        extra.append(f"canary phases (s; nested: generate_batches includes prefill and kernel_checks): {json.dumps(phases)}")
    bandwidth = copy_bandwidth()
    paths = [p for p in args.paths.split(",") if p]
    multi = []
    if args.gpus > 1 and not args.no_data_parallel:
        multi += data_parallel_rows(args.gpus, args.new, ["bf16", "fp8_e4m3"], log)
    if args.sharded:
        multi += sharded_rows(args.sharded.split(","), max(args.gpus, 2), args.new, bandwidth, log,
                          args.sharded_batched_only, args.rounds)
    configs = [c for c in args.configs.split(",") if c]
    if any(c.startswith("8b") for c in configs):
        loaded = build(llama_8b())
        if "8b-1k" in configs:
            rows += run_config("8b b32 1k", loaded, 32, 1024, args.new, paths, bandwidth, True, log, args.profile,
                              args.phases)
        if "8b-8k" in configs:
            # the default path list: its first two; paths named with --paths: each of them
            long_paths = paths[:2] if args.paths == ",".join(PATHS) else paths
            rows += run_config(f"8b b16 8k{'' if args.new_8k == 16 else f' new {args.new_8k}'}", loaded, 16, 8192,
                               args.new_8k, long_paths, bandwidth, False, log, phases=args.phases)
        del loaded
        torch.cuda.empty_cache()
    if any(c.startswith("mla") for c in configs):
        loaded = build(deepseek_v2_lite())
        if "mla-1k" in configs:
            rows += run_config("v2-lite b16 1k", loaded, 16, 1024, 32, paths[:3], bandwidth, True, log, args.profile)
        if "mla-8k" in configs:
            # GPU memory at batch 16 x 8k (max_len 8224 columns: 131,584 tokens of storage), bf16:
            # - weights 29.4 GiB;
            # - the cache: transformers' DeepSeek-V3 attention (5.17 on the GPU machines, 5.24 here) caches the
            #   latent, not per-head K/V: 27 layers x (512 + 64) x 2 B = 31,104 B a token, 3.8 GiB in static
            #   storage for either path; the FP8 path adds its paged FP8 copy (1 B an element: 1.9 GiB);
            # - what one layer's pass holds at a time: the latent expanded over every cached column (`expand_kv`:
            #   kv_b_proj's [rows, L, 16 x 256] out, 8,192 B a token, and the key copy [rows, 16, L, 192], 6,144 B)
            #   = 1.8 GiB, and in prefill a 2,048-column chunk of 16 rows (32,768 tokens: layer 0's dense MLP
            #   3 x 10944 x 2 B a token = 2.0 GiB; its mask, 0.3-0.5 GiB).
            # About 37 GiB for BF16 and 39 GiB for FP8: well inside 80 GB (the decompressed K/V of all layers,
            # 16 x (192 + 128) x 2 B x 27 = 276,480 B a token, would be 34 GiB more; it is never stored).
            # 128 tokens: a step is (t(128) - t(4)) / 124, and both calls prefill 16 x 8k tokens (~5 s on an H200);
            # with 32 tokens a 1% difference between the two prefills moved the step by ~2 ms (FP8's is ~15 ms)
            long_paths = [p for p in paths if p != "fp8_e4m3:per_token"][:2]
            rows += run_config("v2-lite b16 8k", loaded, 16, 8192, 128, long_paths, bandwidth, False, log)
    if any(c.startswith("gptoss") for c in configs):
        loaded = build(gpt_oss_20b())
        two = [p for p in paths if p != "fp8_e4m3:per_token"][:2]
        if "gptoss-1k" in configs:
            rows += run_config("gpt-oss-20b b32 1k", loaded, 32, 1024, args.new, two, bandwidth, True, log, args.profile)
        if "gptoss-8k" in configs:
            rows += run_config("gpt-oss-20b b16 8k", loaded, 16, 8192, 32, two, bandwidth, False, log)
        del loaded
        torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    for line in extra:
        print(line)
    print("\n(tok/s: whole call, prefill included; decode tok/s: batch / decode-step time, the issue's measure, from "
          "(t(new) - t(4)) / (new - 4); median step: the median interval between decode steps of the timed call, "
          "`step_clock`, and batch / it)\n"
          "| config | path | tok/s | decode tok/s | s | ms/step | median step ms | decode tok/s (median step) | "
          "roof frac | peak GiB | live before GiB | launches/step | x bf16 | decode attention | decode steps |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['path']} | {r['error']} |")
            continue
        x = f"{r['x_bf16']:.2f}" if r.get("x_bf16") else ""
        median = (f"{r['median_step_ms']:.2f} | {r['median_decode_tok_s']:.0f}" if r.get("median_step_ms")
                  else " | ")
        noise = "noise (prefill spread)"   # difference_step found the two calls' difference unusable
        decode = f"{r['decode_tok_s']:.0f}" if r.get("decode_tok_s") else noise
        step_ms = f"{r['step_ms']:.1f}" if r.get("step_ms") else noise
        roof = f"{r['roof']:.2f}" if r.get("roof") else ""
        print(f"| {r['config']} | {r['path']} | {r['tok_s']:.0f} | {decode} | {r['s']:.2f} | {step_ms} | "
              f"{median} | {roof} | {r['peak']:.1f} | {r.get('live_before', float('nan')):.1f} | "
              f"{r.get('launches_per_step') or ''} | {x} | {r.get('kernel', '')} | {r.get('decode_mode', 'generate')} |")
    timed_phases = [r for r in rows if r.get("phases")]
    if timed_phases:
        print("\n(--phases: one more call of each path, each phase synchronised; s)\n"
              "| config | path | whole call | prefill | eager steps | kernel checks (inside those two) | capture | "
              "the rest |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|")
        for r in timed_phases:
            p = r["phases"]
            rest = p["whole"] - p["prefill"] - p["eager_steps"] - p["capture"]
            print(f"| {r['config']} | {r['path']} | {p['whole']:.3f} | {p['prefill']:.3f} | {p['eager_steps']:.3f} | "
                  f"{p['kernel_checks']:.3f} | {p['capture']:.3f} | {rest:.3f} |")
    for r in rows:
        for why in r.get("decode_fallbacks") or ():
            print(f"{r['config']} {r['path']}: {why}")
    if multi:
        print_multi_rows(multi)


if __name__ == "__main__":
    main()
