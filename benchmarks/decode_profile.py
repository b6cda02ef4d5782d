"""Where a batched decode step's GPU time goes, BF16 against an FP8 path (CUDA only).

    python benchmarks/decode_profile.py [--config v2-lite|8b | --canary gqa|mla|hybrid] [--batch 16]
                                        [--context 1024] [--paths bf16,fp8_e4m3] [--top 16] [--prefill]

On scale_bench's random-weight models (built on the GPU), or a bundled canary (`--canary`: the default run's models,
loaded as `harness run` loads them, EOS ignored so that every row decodes every step): per path, the decode step
time with CUDA graphs and with static decode run eagerly (both: (time of 20 tokens - time of 4 tokens) / 16: each
call runs its first step eagerly and captures its graph once, scale_bench.SHORT), the median interval between graph
steps (scale_bench's measure) beside the median GPU time of one graph replay (CUDA events: the interval less it is
host time the GPU waits for), then the CUDA kernels of one eager static decode step (a profile of SHORT + 5 tokens
less one of SHORT, over 5: step 0's kernel check in both), heaviest first, and each later path's kernels against the
first's. A graph step well above its eager kernel sum means steps that did not replay a graph; kernels in one path's
list and not the other's are what that path adds. Set HARNESS_IMPL_CHECK=0 to leave the implementation check's
probes out, as scale_bench does.
`--prefill`: the same for the prompts' prefill instead (a 1-token call: the first token comes from the prefill's
logits), its wall time synchronised, every kernel's summed time (the wall time less it: the GPU idle), the host
ops with the most time of their own, and each later path against the first: the kernels that differ most.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_bench  # noqa: E402 - after the path

from harness.kv_paths.spec import parse_path  # noqa: E402
from harness.replay.batched import BatchedEngine, BatchSettings  # noqa: E402

CONFIGS = {"v2-lite": scale_bench.deepseek_v2_lite, "8b": scale_bench.llama_8b}
CANARIES = ("gqa", "mla", "hybrid")


def engine(backend, settings: BatchSettings, canary: bool) -> BatchedEngine:
    """An engine over `backend`; a canary's with its EOS ignored (random prompts would end rows at random steps)."""
    made = BatchedEngine(backend, settings)
    if canary:
        made.eos = None
    return made


def step_ms(engine: BatchedEngine, prompts: list[list[int]]) -> float:
    """(t(SHORT + 16) - t(SHORT)) / 16 in ms, as scale_bench times its rows."""
    short = scale_bench.SHORT
    engine.generate(prompts, short)  # warm-up: compiles, graph capture
    first, _, _ = scale_bench.timed(lambda: engine.generate(prompts, short))
    longer, _, _ = scale_bench.timed(lambda: engine.generate(prompts, short + 16))
    return (longer - first) / 16 * 1e3


def replay_gpu_ms(engine: BatchedEngine, prompts: list[list[int]]) -> tuple[float, float] | None:
    """(median GPU ms of one graph replay, median wall ms between decode steps) over a SHORT + 16 token call, or
    None where no graph replayed: the GPU time from CUDA events around each `CUDAGraph.replay`, the step interval
    from `scale_bench.step_clock`. Their difference is the host's share of a step that the GPU waits for."""
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    inner = torch.cuda.CUDAGraph.replay

    def replay(graph):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        inner(graph)
        end.record()
        events.append((start, end))

    torch.cuda.CUDAGraph.replay = replay
    try:
        with scale_bench.step_clock() as stamps:
            engine.generate(prompts, scale_bench.SHORT + 16)
        torch.cuda.synchronize()
    finally:
        torch.cuda.CUDAGraph.replay = inner
    steady = scale_bench.median_step(stamps)
    if not events or steady is None:
        return None
    gpu = sorted(start.elapsed_time(end) for start, end in events)
    return gpu[len(gpu) // 2], steady * 1e3


def kernels_per_step(engine: BatchedEngine, prompts: list[list[int]]) -> list[tuple[float, float, str]]:
    """(ms, calls, kernel name) of one decode step: a profile of SHORT + 5 tokens less one of SHORT, over 5."""
    from torch.profiler import ProfilerActivity, profile

    totals = []
    for tokens in (scale_bench.SHORT + 5, scale_bench.SHORT):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, tokens)
            torch.cuda.synchronize()
        totals.append({e.key: (e.device_time_total, e.count) for e in prof.key_averages()})
    long, short = totals
    rows = [((us - short.get(k, (0, 0))[0]) / 5 / 1e3, (n - short.get(k, (0, 0))[1]) / 5, k)
            for k, (us, n) in long.items()]
    return sorted((r for r in rows if r[0] > 0), reverse=True)


def prefill_profile(engine: BatchedEngine, prompts: list[list[int]], top: int) -> tuple[float, list, list]:
    """(wall s of a 1-token call, its CUDA kernels [(ms, calls, name)], its host ops [(self ms, calls, name)])."""
    from torch.profiler import ProfilerActivity, profile

    engine.generate(prompts, 1)  # warm-up: compiles
    wall, _, _ = scale_bench.timed(lambda: engine.generate(prompts, 1))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, 1)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted(((e.device_time_total / 1e3, e.count, e.key) for e in events if e.device_time_total > 0
                      and e.cpu_time_total == 0), reverse=True)
    host = sorted(((e.self_cpu_time_total / 1e3, e.count, e.key) for e in events if e.self_cpu_time_total > 0),
                  reverse=True)
    return wall, kernels, host[:top]


def kernel_differences(base: list, other: list, top: int) -> list[tuple[float, float, float, str]]:
    """(other ms - base ms, base ms, other ms, kernel) of the kernels whose time differs most between two paths'
    lists of (ms, calls, name): what one path adds to (or saves on) the other's."""
    a, b = {name: ms for ms, _, name in base}, {name: ms for ms, _, name in other}
    rows = [(b.get(k, 0.0) - a.get(k, 0.0), a.get(k, 0.0), b.get(k, 0.0), k) for k in set(a) | set(b)]
    return sorted(rows, key=lambda r: -abs(r[0]))[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="v2-lite")
    parser.add_argument("--canary", choices=CANARIES, default=None, help="a bundled canary instead of --config")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--paths", default="bf16,fp8_e4m3")
    parser.add_argument("--top", type=int, default=16, help="kernels listed per path")
    parser.add_argument("--prefill", action="store_true", help="profile the prompts' prefill, not a decode step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: decode_profile needs a CUDA device (it profiles CUDA kernels)")
    if args.canary:
        from harness.replay.inprocess import InProcessModel
        from harness.run_config import CANARY_WEIGHTS

        loaded = InProcessModel.load(CANARY_WEIGHTS / args.canary, device="cuda")
    else:
        loaded = scale_bench.build(CONFIGS[args.config]())
    prompts = scale_bench.prompts(args.batch, args.context, loaded.model.config.vocab_size, seed=1)
    print(f"{args.canary or args.config} b{args.batch} {args.context}: {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    if args.prefill:
        profiled = {}
        for spec in args.paths.split(","):
            made = engine(loaded.backend(parse_path(spec)),
                          BatchSettings(batch_size=args.batch, kernel_check_every=10**9), bool(args.canary))
            wall, kernels, host = prefill_profile(made, prompts, args.top)
            profiled[spec] = (wall, kernels)
            busy = sum(r[0] for r in kernels)
            # the kernels' summed time against the call's wall time: what is left is GPU time no kernel ran
            print(f"\n{spec}: prefill {wall:.3f} s wall; every kernel {busy:.1f} ms ({len(kernels)} kinds), the GPU "
                  f"idle {wall * 1e3 - busy:.1f} ms\n| ms | calls | kernel |\n|---:|---:|---|")
            for ms, calls, name in kernels[:args.top]:
                print(f"| {ms:.1f} | {calls} | `{name[:100]}` |")
            print("| host ms (self) | calls | op |\n|---:|---:|---|")
            for ms, calls, name in host:
                print(f"| {ms:.1f} | {calls} | `{name[:100]}` |", flush=True)
            del made
            torch.cuda.empty_cache()
        first, *rest = profiled
        for spec in rest:
            (base_wall, base), (wall, kernels) = profiled[first], profiled[spec]
            print(f"\n{spec} against {first}: wall {(wall - base_wall) * 1e3:+.1f} ms, kernels "
                  f"{sum(r[0] for r in kernels) - sum(r[0] for r in base):+.1f} ms; the kernels that differ most")
            print(f"| ms ({spec} - {first}) | {first} ms | {spec} ms | kernel |\n|---:|---:|---:|---|")
            for delta, a, b, name in kernel_differences(base, kernels, args.top):
                print(f"| {delta:+.1f} | {a:.1f} | {b:.1f} | `{name[:100]}` |")
        return
    print("| path | graph step ms | median step ms | GPU ms a replay | eager static step ms | kernels ms / step | "
          "kernels / step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    listed = {}
    for spec in args.paths.split(","):
        backend = loaded.backend(parse_path(spec))
        settings = {mode: BatchSettings(batch_size=args.batch, kernel_check_every=10**9, decode=mode)
                    for mode in ("graph", "static")}
        graphed = engine(backend, settings["graph"], bool(args.canary))
        graph = step_ms(graphed, prompts)
        replayed = replay_gpu_ms(graphed, prompts)
        del graphed
        eager_engine = engine(backend, settings["static"], bool(args.canary))
        eager = step_ms(eager_engine, prompts)
        listed[spec] = kernels_per_step(eager_engine, prompts)
        replay = f"{replayed[1]:.2f} | {replayed[0]:.2f}" if replayed else "- | -"
        print(f"| {spec} | {graph:.2f} | {replay} | {eager:.2f} | {sum(r[0] for r in listed[spec]):.2f} | "
              f"{sum(r[1] for r in listed[spec]):.0f} |", flush=True)
        del eager_engine
        torch.cuda.empty_cache()
    for spec, rows in listed.items():
        print(f"\n{spec}: heaviest kernels of one eager static decode step")
        print("| ms | calls | kernel |\n|---:|---:|---|")
        for ms, calls, name in rows[:args.top]:
            print(f"| {ms:.3f} | {calls:.0f} | `{name[:100]}` |")
    first, *rest = listed
    for spec in rest:
        print(f"\n{spec} against {first}, one eager step: the kernels that differ most")
        print(f"| ms ({spec} - {first}) | {first} ms | {spec} ms | kernel |\n|---:|---:|---:|---|")
        for delta, a, b, name in kernel_differences(listed[first], listed[spec], args.top):
            print(f"| {delta:+.3f} | {a:.3f} | {b:.3f} | `{name[:100]}` |")


if __name__ == "__main__":
    main()
