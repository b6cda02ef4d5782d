"""The implementation check (`attn_impl_err_ratio`, harness/kv_paths/impl_check.py): healthy paths against the
attention-arithmetic fault injectors (harness/kv_paths/faults.py), per canary, and what the check costs.

For every model, scenario turn and path, the path generates the turn (own history, at most --tokens tokens) with
the check on, and the turn's ratio is kept. Prints per model: each path's max (and median) ratio over the turns,
then the largest healthy max against each fault's smallest turn value, and the margin between them. With --cost,
each healthy path's turns are generated a second time with the check off (HARNESS_IMPL_CHECK=0), interleaved, and
the summed generation times compared.

    python benchmarks/impl_check.py [--models gqa,mla,hybrid] [--scenarios scenarios/canary/default.yaml]
        [--tokens 24] [--select TERMS] [--cost] [--json OUT] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from harness.job import CANARY_WEIGHTS
from harness.kv_paths.spec import parse_path
from harness.replay.inprocess import InProcessModel
from harness.scenarios.select import select_scenarios
from harness.scenarios.sources import load_scenarios
from harness.types import Message

HEALTHY = ("bf16", "fp8_e4m3", "fp8_e4m3:calibrated", "fp8_e4m3:per_head:calibrated", "fp8_e5m2",
           "fp8_e4m3:calibrated:fp8_q", "fp8_e4m3:calibrated:fp8_p", "fp8_e4m3:calibrated:fp8_q:fp8_p")
FAULTS = ("fp8_e4m3:calibrated:fault=scores_bf16", "fp8_e4m3:calibrated:fault=scale_off",
          "fp8_e4m3:calibrated:fault=exp_poly", "fp8_e4m3:calibrated:fault=pv_bf16",
          "fp8_e4m3:per_head:calibrated:fault=k_scale_swap", "fp8_e4m3:calibrated:fp8_p:fault=p_e5m2")


def turns(scenarios, tokens: int):
    """(scenario id, turn index, messages before the reply, max new tokens) of every generated turn; earlier
    generated turns stand in the history as their user text answered by a fixed short reply."""
    for scenario in scenarios:
        history = [Message("system", scenario.system)] if scenario.system else []
        for index, turn in enumerate(scenario.turns):
            messages = history + [Message("user", turn.user)]
            if turn.assistant is None:
                yield scenario.id, index, messages, min(tokens, scenario.max_new_tokens)
            history = messages + [Message("assistant", turn.assistant if turn.assistant is not None else "Okay.")]


def measure(model_name: str, scenarios, paths, tokens: int, cost: bool, device: str = "cpu") -> dict:
    model = InProcessModel.load(CANARY_WEIGHTS / model_name, device=device)
    found: dict[str, list[float]] = {}
    seconds = {"on": 0.0, "off": 0.0}
    for path in paths:
        backend = model.backend(parse_path(path))
        for _, _, messages, limit in turns(scenarios, tokens):
            prompt = model.encode_chat(messages)
            for state in (("on", "off") if cost and path in HEALTHY else ("on",)):
                os.environ["HARNESS_IMPL_CHECK"] = "1" if state == "on" else "0"
                start = time.perf_counter()
                _, _, metrics = backend.greedy_ids(prompt, limit)
                seconds[state] += time.perf_counter() - start
                if state == "on":
                    found.setdefault(path, []).append((metrics or {}).get("attn_impl_err_ratio", float("nan")))
        print(f"[{model_name}] {path}: max {max(found[path]):.3f} over {len(found[path])} turns", flush=True)
    os.environ.pop("HARNESS_IMPL_CHECK", None)
    return {"ratios": found, "seconds": seconds}


def report(model_name: str, result: dict) -> None:
    ratios = result["ratios"]
    print(f"\n## {model_name}\n\n| path | turns | median | max | min |\n|---|---|---|---|---|")
    for path, values in ratios.items():
        print(f"| `{path}` | {len(values)} | {statistics.median(values):.3f} | {max(values):.3f} | {min(values):.3f} |")
    healthy = max(max(v) for p, v in ratios.items() if p in HEALTHY)
    for path, values in ratios.items():
        if path not in HEALTHY:
            print(f"- {path}: min {min(values):.3f} = {min(values) / healthy:.2f}x the healthy max {healthy:.3f}")
    if result["seconds"]["off"]:
        on, off = result["seconds"]["on"], result["seconds"]["off"]
        print(f"- cost (healthy paths' generation): on {on:.1f} s, off {off:.1f} s: {100 * (on / off - 1):+.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gqa,mla,hybrid")
    parser.add_argument("--scenarios", action="append")
    parser.add_argument("--select", action="append", default=[])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--paths", default=",".join(HEALTHY + FAULTS))
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--device", default="cpu", help="cpu | cuda (FP8 decode steps then run our Triton kernels)")
    args = parser.parse_args()
    scenarios = load_scenarios(args.scenarios or ["scenarios/canary/default.yaml"])
    if args.select:
        scenarios = select_scenarios(scenarios, args.select)
    out = {}
    for name in args.models.split(","):
        out[name] = measure(name, scenarios, args.paths.split(","), args.tokens, args.cost, args.device)
        report(name, out[name])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=1)


if __name__ == "__main__":
    main()
