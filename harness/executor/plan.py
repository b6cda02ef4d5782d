"""A run's work as a plan: tasks (a model's replay of some scenarios) placed on workers (a GPU, a CPU process, a Ray
actor), split by estimated cost rather than by count.

A unit is (model, scenario, path); a task replays a model's units for some scenarios: its reference and every path
(`Task.path` None), or, for the CPU's process pool, one path on the stored reference. The plan is plain data the
executors share (`harness/executor`), so every strategy places the same work the same way: the local per-GPU pool and
the Ray actors get identical shards, and so identical records.

Cost is an estimate, tokens x layers: each generated turn's prompt (its text at ~4 characters a token, earlier
generated replies counted at their `max_new_tokens`) plus its `max_new_tokens`, times the model's decoder layers.
Measured costs replace it where a run has them (`benchmarks/data_parallel.py` prints both).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CHARS_PER_TOKEN = 4  # a prompt's tokens estimated from its text (English BPE averages ~4 characters a token)
# Seconds a worker process costs before its first unit: imports, CUDA start, model load, kernel compile, graph
# capture. Measured 10.4-11.8 s per worker in benchmarks/scale_bench.py (2 and 4 H100s, BENCHMARKS.md sessions 7-10).
WORKER_START_S = 11.0
# Seconds of one GPU's work per unit of cost, from one measurement: the default canary set on one H200 (issue 42, at
# 3a67195) took 25.0 s, ~11 s of it start-up (above), so ~14 s of work for its estimated cost of 751_360 (`plan_cost`
# of the three canaries x the 12 scenarios of scenarios/canary/default.yaml x the reference and 7 default paths). A
# prior for deciding how many GPUs pay off, to be replaced by a measurement on a 4-GPU host (docs/MULTI_GPU.md).
SECONDS_PER_COST = 14.0 / 751_360


@dataclass(frozen=True, slots=True)
class Task:
    """A model's replay of some scenarios: its reference and every path (path None), or one path (REFERENCE: the
    reference alone) on the stored reference."""

    model: Path
    scenario_ids: tuple[str, ...]
    cost: float
    path: str | None = None

    def __post_init__(self) -> None:
        if not self.cost >= 0:  # NaN too
            raise ValueError(f"task {self.model}: cost must be >= 0, got {self.cost}")


@dataclass(frozen=True, slots=True)
class Plan:
    """Tasks per worker (one list a device or actor, in the order they run) and why that many workers."""

    devices: tuple[str, ...]
    work: tuple[tuple[Task, ...], ...]
    reason: str

    def __post_init__(self) -> None:
        if len(self.devices) != len(self.work):
            raise ValueError(f"a plan needs one task list per device: {len(self.devices)} devices, "
                             f"{len(self.work)} lists")

    @property
    def cost(self) -> float:
        return sum(t.cost for tasks in self.work for t in tasks)

    @property
    def names(self) -> tuple[str, ...]:
        """Each worker's name: its device, numbered where a device is named twice (`cpu#0`, `cpu#1`)."""
        return tuple(f"{d}#{i}" if self.devices.count(d) > 1 else d for i, d in enumerate(self.devices))

    def describe(self, model_label=lambda directory: Path(directory).name) -> dict:
        """The layout as the manifest keeps it: each worker's tasks (model, scenario ids), cost estimates."""
        return {name: [{"model": model_label(t.model), "scenarios": list(t.scenario_ids),
                        "cost": round(t.cost)} for t in tasks] for name, tasks in zip(self.names, self.work)}


def model_layers(directory: Path) -> int:
    """The decoder layers of a model directory (its config.json, or its stress variant's base's); 1 when unread."""
    from harness.canary.variants import read_variant

    try:
        variant = read_variant(Path(directory))
        weights = variant.base if variant is not None else Path(directory)
        config = json.loads((Path(weights) / "config.json").read_text())
    except (OSError, ValueError):
        return 1
    text = config.get("text_config") or config
    return max(1, int(text.get("num_hidden_layers") or 1))


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def checkpoint_bytes(directory: Path) -> int | None:
    """Bytes of a model directory's weight files (its stress variant's base's); None when it has none (random
    weights made at load) or cannot be read."""
    from harness.canary.variants import read_variant

    try:
        variant = read_variant(Path(directory))
        weights = Path(variant.base if variant is not None else directory)
        total = sum(file.stat().st_size for pattern in WEIGHT_FILES for file in weights.glob(pattern))
    except (OSError, ValueError):
        return None
    return total or None


def scenario_tokens(scenario) -> int:
    """Tokens a scenario's generated turns process: each one's prompt so far plus its `max_new_tokens`."""
    context = len(scenario.system or "") // CHARS_PER_TOKEN
    total = 0
    for turn in scenario.turns:
        context += len(turn.user) // CHARS_PER_TOKEN
        if turn.assistant is not None:
            context += len(turn.assistant) // CHARS_PER_TOKEN
            continue
        total += context + scenario.max_new_tokens
        context += scenario.max_new_tokens
    return total


def plan_cost(models: Sequence[Path], scenarios: Sequence, paths: int) -> float:
    """The estimated cost of replaying `scenarios` on every model, reference and `paths` paths each."""
    tokens = sum(scenario_tokens(s) for s in scenarios)
    return float(sum(model_layers(m) for m in models) * tokens * (1 + paths))


def workers_that_pay_off(cost: float, devices: Sequence[str]) -> tuple[int, str]:
    """How many of `devices` a run of `cost` uses, and why: another worker pays off while each worker's share of
    the work is at least one worker's start-up (`WORKER_START_S`); one worker runs in this process."""
    work_s = cost * SECONDS_PER_COST
    count = max(1, min(len(devices), math.floor(work_s / WORKER_START_S)))
    why = (f"estimated work {work_s:.0f} s (cost {cost:.0f} x {SECONDS_PER_COST:.2e} s); a worker pays off while its "
           f"share is at least one start-up ({WORKER_START_S:.0f} s): {count} of {len(devices)} device(s)")
    return count, why


def interleaved(scenarios: Sequence, cost_of) -> list:
    """Scenarios ordered longest, shortest, second longest, second shortest, ...: any contiguous run of them holds
    a mix of context lengths (lm-eval spreads requests over replicas so)."""
    ranked = sorted(scenarios, key=lambda s: -cost_of(s))
    order = []
    while ranked:
        order.append(ranked.pop(0))
        if ranked:
            order.append(ranked.pop())
    return order


def _whole_models(models: Sequence[Path], scenarios: Sequence, devices: Sequence[str], model_cost) -> list[list]:
    """Each model whole on one device: largest first onto the least loaded."""
    load, work = [0.0] * len(devices), [[] for _ in devices]
    for model in sorted(models, key=lambda m: -model_cost(m)):
        device = load.index(min(load))
        work[device].append((model, list(scenarios)))
        load[device] += model_cost(model)
    return work


def _wrapped(models: Sequence[Path], scenarios: Sequence, devices: Sequence[str], cost_of) -> list[list]:
    """Models laid end to end and cut into equal-cost segments, one a device (McNaughton's wrap-around): a model
    spans at most a few neighbouring devices, each segment a mix of context lengths (`interleaved`)."""
    sequence = [(model, s) for model in models for s in interleaved(scenarios, lambda s, m=model: cost_of(m, s))]
    total = sum(cost_of(m, s) for m, s in sequence)
    work: list[list] = [[] for _ in devices]
    done, device = 0.0, 0
    for index, (model, scenario) in enumerate(sequence):
        left = len(sequence) - index
        behind = done >= total * (device + 1) / len(devices) - cost_of(model, scenario) / 2
        if device < len(devices) - 1 and work[device] and (behind or left <= len(devices) - 1 - device):
            device += 1
        if work[device] and work[device][-1][0] == model:
            work[device][-1][1].append(scenario)
        else:
            work[device].append((model, [scenario]))
        done += cost_of(model, scenario)
    return work


def data_parallel_shards(models: Sequence[Path], scenarios: Sequence,
                         devices: Sequence[str], paths: int = 1) -> list[list[tuple[Path, list]]]:
    """Work for each device: (model, its scenarios) pairs. With at least as many models as devices each model stays
    whole on one device (its batches, and so its records, are those of a one-GPU run) unless that leaves the
    slowest device more than one worker start-up (`WORKER_START_S`) behind an even split; otherwise models are cut
    into equal-cost segments over the devices, which changes batch composition (measured by the run's
    batch-invariance floor)."""
    layers = {m: model_layers(m) for m in models}
    tokens = {s.id: scenario_tokens(s) for s in scenarios}

    def cost_of(model, scenario) -> float:
        return float(layers[model] * tokens[scenario.id] * (1 + paths))

    def model_cost(model) -> float:
        return sum(cost_of(model, s) for s in scenarios)

    whole = _whole_models(models, scenarios, devices, model_cost)
    if len(models) >= len(devices):
        slowest = max(sum(model_cost(m) for m, _ in work) for work in whole)
        even = sum(model_cost(m) for m in models) / len(devices)
        if (slowest - even) * SECONDS_PER_COST <= WORKER_START_S:
            return whole
    return _wrapped(models, scenarios, devices, cost_of)


def plan_data_parallel(models: Sequence[Path], scenarios: Sequence, devices: Sequence[str], paths: int,
                       workers: int | None = None) -> Plan:
    """The plan of a data-parallel run over `devices`: `workers` of them (None: as many as pay off), each its
    shards of the work (`data_parallel_shards`)."""
    cost = plan_cost(models, scenarios, paths)
    if workers is None:
        count, reason = workers_that_pay_off(cost, devices)
    else:
        count = min(workers, len(devices))
        reason = f"--workers {workers}: {count} of {len(devices)} device(s)"
    used = list(devices[:count])
    shards = data_parallel_shards(models, scenarios, used, paths)
    tokens = {s.id: scenario_tokens(s) for s in scenarios}
    work = tuple(tuple(Task(Path(m), tuple(s.id for s in chunk),
                            float(model_layers(m) * sum(tokens[s.id] for s in chunk) * (1 + paths)))
                       for m, chunk in pieces) for pieces in shards)
    return Plan(tuple(used), work, reason)
