"""Layer sensitivity scan: FP8 on one attention layer at a time (bisection over groups for deep models),
the token divergence and teacher-forced KL each causes, a ranking, and a recommended per-layer precision
map (which layers to keep in BF16) for a divergence budget. The map is a file a path takes
(`fp8_e4m3:layers=MAP`), so a run can show the mixed-precision path beside the others, and it says the same in
the engines' own flags (`engine_flags`: vLLM's `--kv-cache-dtype X --kv-cache-dtype-skip-layers 0 3`).

Every measurement replays the same turns: each scenario turn's reference reply (greedy, on the reference's
history) is scored teacher-forced by the path (KL(ref || path) per token) and the path's own greedy reply
is compared with it (first divergent token).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from harness.analysis.metrics import free_running, teacher_forced
from harness.kv_paths.cache import attention_layer_indices
from harness.kv_paths.spec import ENGINE_KV_DTYPES, KVPath
from harness.scenarios.load import Scenario
from harness.types import Message

BUDGET_METRIC = "kl_mean"
# Decoder depth (attention layers) above which single layers are reached by bisection instead of one by one.
BISECT_ABOVE = 16


@dataclass(frozen=True, slots=True)
class ReferenceTurn:
    messages: list[Message]
    token_ids: list[int]
    logprobs: object  # torch.Tensor [T, V]


@dataclass(frozen=True, slots=True)
class Measured:
    """One configuration: FP8 on `fp8_layers` (all other attention layers BF16)."""

    fp8_layers: tuple[int, ...]
    kl_mean: float
    kl_max: float
    first_divergent_token: float | None  # earliest over the turns; None when no turn diverged
    diverged_turns: int
    turns: int

    def as_row(self) -> dict:
        return dataclasses.asdict(self) | {"fp8_layers": list(self.fp8_layers)}


def reference_turns(owner, scenarios: Sequence[Scenario], max_turns: int) -> list[ReferenceTurn]:
    """Up to max_turns generated turns: the reference's greedy reply on its own history, and its scores."""
    reference = owner.backend(None)
    turns: list[ReferenceTurn] = []
    for scenario in scenarios:
        history = [Message("system", scenario.system)] if scenario.system else []
        for spec in scenario.turns:
            messages = history + [Message("user", spec.user)]
            if spec.assistant is not None:
                history = messages + [Message("assistant", spec.assistant)]
                continue
            if len(turns) >= max_turns:
                return turns
            reply = reference.generate_sync(messages, scenario.max_new_tokens)
            if reply.token_ids:
                scores = reference.score_sync(messages, reply.token_ids)
                turns.append(ReferenceTurn(messages, list(reply.token_ids), scores.logprobs))
            history = messages + [Message("assistant", reply.text)]
    return turns


def with_fp8_layers(kv_path: KVPath, fp8_layers: Sequence[int], all_layers: Sequence[int]) -> KVPath:
    keep = tuple(i for i in all_layers if i not in set(fp8_layers))
    return dataclasses.replace(kv_path, bf16_layers=keep, bf16_sliding=False, name=f"{kv_path.name}@fp8={'+'.join(map(str, fp8_layers))}")


def measure(owner, kv_path: KVPath, turns: Sequence[ReferenceTurn], fp8_layers: Sequence[int]) -> Measured:
    backend = owner.backend(kv_path)
    kls, kl_max, first, diverged = [], 0.0, None, 0
    for turn in turns:
        scores = backend.score_sync(turn.messages, turn.token_ids)
        tf = teacher_forced(turn.logprobs, scores.logprobs, turn.token_ids).summary
        kls.append(tf["kl_mean"])
        kl_max = max(kl_max, tf["kl_max"])
        own = backend.generate_sync(turn.messages, len(turn.token_ids))
        fr = free_running(turn.token_ids, own.token_ids)
        if fr["first_divergent_token"] is not None:
            diverged += 1
            first = fr["first_divergent_token"] if first is None else min(first, fr["first_divergent_token"])
    mean = sum(kls) / len(kls) if kls else math.nan
    return Measured(tuple(fp8_layers), mean, kl_max, first, diverged, len(turns))


def scan(owner, kv_path: KVPath, turns: Sequence[ReferenceTurn], bisect_above: int = BISECT_ABOVE,
         floor: float = 0.0, on_measured: Callable[[Measured], None] | None = None) -> list[Measured]:
    """Single-layer measurements, most sensitive first. Above `bisect_above` attention layers, groups are
    halved recursively and a group whose kl_mean is <= `floor` is not split further (its layers are
    reported as that group, an upper bound for each of them)."""
    layers = attention_layer_indices(owner.model.config)
    done = on_measured or (lambda m: None)

    def run(group: Sequence[int]) -> Measured:
        measured = measure(owner, with_fp8_layers(kv_path, group, layers), turns, group)
        done(measured)
        return measured

    if len(layers) <= bisect_above:
        results = [run([i]) for i in layers]
    else:
        results, stack = [], [list(layers)]
        while stack:
            group = stack.pop()
            measured = run(group)
            if len(group) == 1 or measured.kl_mean <= floor:
                results.append(measured)
            else:
                half = len(group) // 2
                stack += [group[half:], group[:half]]
    return sorted(results, key=lambda m: (-m.kl_mean, m.fp8_layers))


def recommend(owner, kv_path: KVPath, turns: Sequence[ReferenceTurn], ranking: Sequence[Measured], budget: float,
              on_measured: Callable[[Measured], None] | None = None) -> tuple[list[int], Measured]:
    """Fewest layers (most sensitive first) to keep in BF16 so that the mixed path's measured kl_mean is
    within `budget`. Starts from the estimate that single-layer KLs add up, then verifies by measuring
    the mixed path, keeping one more layer in BF16 while it is over budget."""
    layers = attention_layer_indices(owner.model.config)
    order = [i for m in ranking for i in m.fp8_layers]
    remaining = sum(m.kl_mean for m in ranking)
    keep = 0
    for m in ranking:
        if remaining <= budget:
            break
        remaining -= m.kl_mean
        keep += len(m.fp8_layers)
    done = on_measured or (lambda m: None)
    while True:
        bf16 = order[:keep]
        fp8 = [i for i in layers if i not in bf16]
        measured = measure(owner, with_fp8_layers(kv_path, fp8, layers), turns, fp8)
        done(measured)
        if measured.kl_mean <= budget or keep >= len(order):
            return sorted(bf16), measured
        keep += 1


def precision_map(model: str, kv_path: KVPath, budget: float, bf16_layers: list[int], layers: list[int],
                  mixed: Measured, all_fp8: Measured, ranking: Sequence[Measured], budget_source: str) -> dict:
    """The file `harness sensitivity` writes and `...:layers=FILE` reads (`bf16_layers`): per layer, its format
    (bf16 or the path's), and the engines' flags that serve the same map."""
    head = cache_head(kv_path)
    return {
        "model": model, "kv_path": kv_path.canonical,
        "budget": {"metric": BUDGET_METRIC, "limit": budget, "source": budget_source},
        "bf16_layers": bf16_layers,
        "layers": {str(i): "bf16" if i in bf16_layers else head for i in layers},
        "engine_flags": engine_flags(kv_path, bf16_layers),
        "measured": {"mixed": mixed.as_row(), "all_fp8": all_fp8.as_row()},
        "ranking": [m.as_row() for m in ranking],
    }


def cache_head(kv_path: KVPath) -> str:
    """The path's cache format as its spec spells it (`fp8_e4m3`, `nvfp4`, `k=fp8_e4m3/v=nvfp4`)."""
    return kv_path.canonical.split(":")[0]


def engine_flags(kv_path: KVPath, bf16_layers: Sequence[int]) -> dict[str, str]:
    """Per engine, the launch flags that give the path's cache format with `bf16_layers` kept in the model dtype,
    or why none do: vLLM's `--kv-cache-dtype-skip-layers` takes layer indices (space-separated, as its docs spell
    it); SGLang has no per-layer KV dtype flag."""
    head, flags = cache_head(kv_path), {}
    for engine, table in ENGINE_KV_DTYPES.items():
        values = [value for value, ours in table.items() if ours == head]
        if not values:
            flags[engine] = f"no {engine} --kv-cache-dtype value stores {head} (docs/FORMATS.md)"
            continue
        value = head if head in values else values[0]
        if not bf16_layers:
            flags[engine] = f"--kv-cache-dtype {value}"
        elif engine == "vllm":
            flags[engine] = f"--kv-cache-dtype {value} --kv-cache-dtype-skip-layers {' '.join(map(str, bf16_layers))}"
        else:
            flags[engine] = (f"--kv-cache-dtype {value} quantises every layer: {engine} has no per-layer KV dtype flag "
                             f"to keep layers {', '.join(map(str, bf16_layers))} in BF16")
    return flags
