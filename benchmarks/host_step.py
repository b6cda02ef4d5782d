"""Host time per decode step of the batched engine (`harness/replay/batched.py`), measured on the CPU.

    python benchmarks/host_step.py [--models gqa,mla,hybrid] [--paths bf16,fp8_e4m3] [--new-tokens 64]
                                   [--repeat 3] [--top 0] [--json FILE]

One wave: the first turn of every bundled canary scenario (`scenarios/canary/default.yaml`), batched, greedy,
up to `--new-tokens` tokens, through `BatchedEngine.generate` on the bundled canaries (`harness/canary/weights`).
Per model x path it prints decode forward calls, ms per decode forward call (best of `--repeat` runs, wall clock,
less the prefill forward), and that time split by a cProfile of one more run (paused during the prefill
forward): every Python function's own time goes to the code it belongs to (transformers, torch's Python, our cache/attention code, the reference kernels, the engine), and the time of
each torch op (a C builtin) to the code that called it: "model ops" is the tensor work transformers' lines
start (model math), "engine ops" the work the engine's own lines start. The shares come from the profiled run
(cProfile inflates Python) and are scaled onto the unprofiled time. A TorchFunctionMode on a third run counts
host syncs per forward call by the place that asks: `.item()`, `.tolist()`, `.cpu()`, `bool()`/`int()`/
`float()` of a tensor, `nonzero`, `equal`, boolean-mask indexing (each waits for the GPU on CUDA).

On the CPU the Python costs are what they are on a GPU; model ops are the part that differs. `--kernels
reference` runs FP8 decode through the kernel glue (`PagedKV`, paged copies, fp64 checks) with the
torch reference kernels, whose own per-row loops and syncs ("ref-kern") have no counterpart in Triton.
`--json` keeps every row's tokens, finish reason and metrics, so two revisions' outputs can be compared.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.overrides import TorchFunctionMode  # noqa: E402

from harness.kv_paths.spec import parse_path  # noqa: E402
from harness.replay.batched import BatchedEngine  # noqa: E402
from harness.replay.inprocess import InProcessModel  # noqa: E402
from harness.scenarios.sources import load_scenarios  # noqa: E402
from harness.types import Message  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "harness" / "canary" / "weights"
SCENARIOS = ROOT / "scenarios" / "canary" / "default.yaml"
# where a function's own time goes, by the file it is defined in (first match)
PLACES = (("engine", "harness/replay/batched"), ("cache+attention", "harness/kv_paths/"),
          ("kernels(ref)", "/kernels/"), ("transformers", "/transformers/"), ("torch-python", "/torch/"))
# tensor methods that wait for the device (on CUDA): a value read back to the host, or a result whose shape
# depends on the data; `__getitem__` / `__setitem__` count only with a boolean-tensor index
SYNC_FUNCTIONS = {"item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero", "equal",
                  "__getitem__", "__setitem__", "masked_select", "unique"}


class SyncCounter(TorchFunctionMode):
    """Counts host syncs by the place (`PLACES`) of the line that asks for them."""

    def __init__(self):
        super().__init__()
        self.by_place: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_FUNCTIONS and (not name.endswith("item__") or _bool_index(args)):
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            place = place_of(frame.f_code.co_filename) if frame is not None else "other"
            self.by_place[place] = self.by_place.get(place, 0) + 1
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def first_turns(model: InProcessModel) -> list[list[int]]:
    prompts = []
    for scenario in load_scenarios([SCENARIOS]):
        messages = ([Message("system", scenario.system)] if scenario.system else []) + \
            [Message("user", scenario.turns[0].user)]
        prompts.append(model.encode_chat(messages))
    return prompts


class ForwardCounter:
    """Wraps the model's forward: counts decode calls (one new token per row) and times prefill calls, which it
    keeps out of `profiler` (paused around them), so what is reported is the decode steps."""

    def __init__(self, model, profiler: cProfile.Profile | None = None):
        self.model, self.inner, self.profiler = model, model.forward, profiler
        self.calls, self.decode, self.prefill_s = 0, 0, 0.0

    def __enter__(self):
        def forward(*args, **kwargs):
            self.calls += 1
            if kwargs["input_ids"].shape[1] == 1:
                self.decode += 1
                return self.inner(*args, **kwargs)
            if self.profiler is not None:
                self.profiler.disable()
            _sync()
            start = time.perf_counter()
            out = self.inner(*args, **kwargs)
            _sync()
            self.prefill_s += time.perf_counter() - start
            if self.profiler is not None:
                self.profiler.enable()
            return out
        self.model.forward = forward
        return self

    def __exit__(self, *exc):
        del self.model.forward


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def place_of(filename: str) -> str:
    name = filename.replace("\\", "/")
    return next((place for place, marker in PLACES if marker in name), "other")


def breakdown(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per place: Python functions' own time ('X'), C builtins' time by their caller ('X ops')."""
    seconds: dict[str, float] = {}
    for (filename, _, _), (_, _, own, _, callers) in stats.stats.items():
        if filename != "~":
            key = place_of(filename)
            seconds[key] = seconds.get(key, 0.0) + own
            continue
        for (caller_file, _, _), (_, _, caller_own, _) in callers.items():
            key = place_of(caller_file) + " ops"
            seconds[key] = seconds.get(key, 0.0) + caller_own
    return seconds


def measure(model: InProcessModel, spec: str | None, prompts: list[list[int]], new_tokens: int, repeat: int,
            top: int) -> dict:
    backend = model.backend(parse_path(spec) if spec else None)
    engine = BatchedEngine(backend)
    outputs, best = None, float("inf")
    for _ in range(repeat):
        with ForwardCounter(model.model) as counter:
            start = time.perf_counter()
            rows = engine.generate(prompts, new_tokens)
            best = min(best, time.perf_counter() - start - counter.prefill_s)  # the decode steps' time
        outputs = [(r.token_ids, r.finish_reason, r.metrics) for r in rows]
    profiler = cProfile.Profile()
    with ForwardCounter(model.model, profiler):
        profiler.enable()
        engine.generate(prompts, new_tokens)
        profiler.disable()
    stats = pstats.Stats(profiler)
    with SyncCounter() as syncs:  # prefill included: its syncs are a handful per batch
        engine.generate(prompts, new_tokens)
    if top:
        stats.sort_stats("tottime").print_stats(top)
    seconds = breakdown(stats)
    total = sum(seconds.values())
    return {"model": model.arch, "path": spec or "reference", "rows": len(prompts), "forwards": counter.calls,
            "decode_forwards": counter.decode, "tokens": sum(len(o[0]) for o in outputs), "seconds": best,
            "ms_per_forward": 1e3 * best / max(counter.decode, 1),
            "share": {k: v / total for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
            "syncs_per_forward": {k: v / max(counter.decode, 1) for k, v in sorted(syncs.by_place.items())},
            "outputs": outputs}


COLUMNS = (  # (header, places summed): ms per decode forward call
    ("model ops", ("transformers ops", "torch-python ops", "other ops")),
    ("tf py", ("transformers",)), ("torch py", ("torch-python", "other")),
    ("cache py", ("cache+attention",)), ("cache ops", ("cache+attention ops",)),
    ("ref-kern", ("kernels(ref)", "kernels(ref) ops")),
    ("engine py", ("engine",)), ("engine ops", ("engine ops",)))


def print_table(results: list[dict]) -> None:
    print(f"{'model':8} {'path':9} {'dec':>4} {'tok':>5} {'s':>6} {'ms/dec':>7} | "
          + " ".join(f"{h:>10}" for h, _ in COLUMNS) + " | host syncs per forward, by place")
    for r in results:
        cells = " ".join(f"{r['ms_per_forward'] * sum(r['share'].get(p, 0.0) for p in places):10.2f}"
                         for _, places in COLUMNS)
        syncs = " ".join(f"{k}={v:.2f}" for k, v in r["syncs_per_forward"].items() if v)
        print(f"{r['model'][:8]:8} {r['path']:9} {r['decode_forwards']:4d} {r['tokens']:5d} {r['seconds']:6.2f} "
              f"{r['ms_per_forward']:7.2f} | {cells} | {syncs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gqa,mla,hybrid")
    parser.add_argument("--paths", default="bf16,fp8_e4m3")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--top", type=int, default=0, help="print cProfile's top N functions by own time")
    parser.add_argument("--kernels", choices=("off", "reference", "triton"), default="off",
                        help="reference: FP8 decode through the kernel glue (PagedKV, fp64 checks) with the "
                             "torch reference kernels, as CUDA runs it with Triton")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (FP8 decode then runs our Triton kernels "
                        "unless --kernels says otherwise; time per forward is then wall time with the device synchronised)")
    parser.add_argument("--json", help="write results (with every row's tokens and metrics) to this file")
    args = parser.parse_args()
    if args.kernels != "triton":
        os.environ["HARNESS_KERNELS"] = args.kernels
    torch.manual_seed(0)
    results = []
    for arch in args.models.split(","):
        model = InProcessModel.load(WEIGHTS / arch, device=args.device)
        prompts = first_turns(model)
        for spec in args.paths.split(","):
            results.append(measure(model, spec, prompts, args.new_tokens, args.repeat, args.top))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernels {args.kernels}; one wave of "
          f"{len(results[0]['outputs']) if results else 0} first turns, <= {args.new_tokens} new tokens")
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
