"""`Replay` with in-process backends computed in batches first, then written by the ordinary runner.

Schedule: the reference goes turn by turn (the turn-t prompts of all scenarios form one wave, cut into
batches in scenario order), advancing on its own replies; a BF16-cache candidate (the `bf16` path) and any
`own-history` candidate go through the same waves, so the `bf16` path sees exactly the reference's batch
composition and its noise floor stays exactly zero. An FP8 candidate on the reference's history
(`reference-history`) knows every turn's prompt at once, so all its turns form one wave (fewer decode steps;
the batch-invariance floor bounds what the different composition can move). Teacher-forced scoring puts
every turn in one wave, the same for the reference and every path. `Replay` then runs unchanged over backends that answer from these results,
so records, series and texts are built by one piece of code.

A path whose route refuses batching (`route._batch_refusal`) is precomputed nothing: `Replay` runs it one sequence
at a time through its own backend (`batched.ONE_SEQUENCE`), on the batched reference's replies, while the model's
other paths stay batched; the manifest names it and why (`one_sequence_paths`).

The batch-invariance floor (one model's reference, the same prompts alone vs in their batch) is measured
per model and returned for the manifest.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import torch

from harness import model_layers
from harness.replay.batched import BatchedEngine, BatchSettings
from harness.replay.route import OWN_FLOOR, batch_floor
from harness.replay.runner import REFERENCE, Replay, TurnReply, _messages, end_in_lockstep, in_lockstep
from harness.scenarios.load import Scenario
from harness.types import Generation, Message, Scores

FLOOR_SEQUENCES = 4  # prompts of the first wave re-run alone to measure the batch-invariance floor
# Full log-probs (float32, [T, V]) one lazy scoring call may hold on the host per path: a memory bound, not a
# tuning knob (the canaries' 128-token vocabulary puts every turn in one call; an 8B model's 128k vocabulary
# puts ~4k scored tokens in one call)
HOST_SCORE_BYTES = 2 << 30


class PrecomputedBackend:
    """Answers `generate` / `score` from batched results; anything not precomputed runs one at a time.

    Teacher-forced scores are computed lazily, in the order `Replay` asks for them (scenario by scenario, turn
    by turn): a miss scores the next chunk of the queue in one batched call, at most `HOST_SCORE_BYTES` of
    full log-probs, and `Replay` drops each as it is used. Host memory stays bounded by one chunk per path
    (an 8B model's 128k vocabulary is 0.5 MB per scored token) instead of every scenario's scores at once;
    the reference and every path cut the same queue the same way, so their batches stay identical.
    """

    def __init__(self, inner, label: str):
        self.inner, self.label = inner, label
        self.generations: dict[tuple, Generation] = {}
        self.scores: dict[tuple, Scores] = {}
        self.score_queue: list[tuple] = []  # (prompt ids, continuation ids), in the order Replay asks
        self.score_engine: BatchedEngine | None = None
        self.on_score_failure = None  # called with the error when a lazy batch fails (then one at a time)
        self._queued: dict[tuple, int] = {}
        self._next = 0  # queue items before this one have been scored (or skipped)

    def describe(self) -> dict:
        return self.inner.describe()

    def _prompt(self, messages: Sequence[Message]) -> tuple[int, ...]:
        return tuple(self.inner.owner.encode_chat(messages))

    def queue_scores(self, asked: list[tuple], engine: BatchedEngine) -> None:
        self.score_queue, self.score_engine = list(asked), engine
        self._queued = {key: i for i, key in enumerate(self.score_queue)}
        self._next = 0

    async def generate(self, messages: Sequence[Message], max_new_tokens: int) -> Generation:
        found = self.generations.get((self._prompt(messages), max_new_tokens))
        return found if found is not None else await self.inner.generate(messages, max_new_tokens)

    async def score(self, messages: Sequence[Message], continuation_ids: Sequence[int]) -> Scores:
        key = (self._prompt(messages), tuple(continuation_ids))
        if key not in self.scores and self.score_engine is not None and self._queued.get(key, -1) >= self._next:
            self._score_chunk(self._queued[key])
        found = self.scores.pop(key, None)
        return found if found is not None else await self.inner.score(messages, continuation_ids)

    def _score_chunk(self, start: int) -> None:
        vocab = model_layers.field(self.inner.owner.model.config, "vocab_size")
        end, size = start, 0
        while end < len(self.score_queue) and (end == start or size + _score_bytes(self.score_queue[end], vocab)
                                               <= HOST_SCORE_BYTES):
            size += _score_bytes(self.score_queue[end], vocab)
            end += 1
        chunk = self.score_queue[start:end]
        self._next = end
        try:
            scored = self.score_engine.score([p for p, _ in chunk], [c for _, c in chunk])
        except Exception as error:  # noqa: BLE001 - named in the manifest; the rest is scored one at a time
            if in_lockstep():  # a tensor-parallel rank: the others wait inside this chunk's collectives
                end_in_lockstep(error)
            self.score_engine = None
            if self.on_score_failure is not None:
                self.on_score_failure(error)
            return
        for key, logprobs in zip(chunk, scored):
            self.scores[key] = Scores(logprobs=logprobs)

    async def attention_error(self, messages: Sequence[Message], continuation_ids: Sequence[int], options):
        """Attention capture's own teacher-forced pass (`replay/attention.py`): one sequence at a time, beside the
        batched generation and scoring (it measures on the reference's reply, which the batches produced)."""
        return await self.inner.attention_error(messages, continuation_ids, options)

    async def aclose(self) -> None:
        return None


def _score_bytes(item: tuple, vocab: int) -> int:
    return max(1, len(item[1])) * vocab * 4


class BatchedReplay:
    """One model's in-process replay in batches; `run` stores exactly what `Replay.run` would."""

    def __init__(self, model: str, reference, candidates: Sequence, store, history_mode: str,
                 settings: BatchSettings, on_unit_done=None, attention=None):
        """attention: `replay.attention.AttentionOptions` (capture each path's attention error; None: no capture)."""
        self.model, self.store, self.history_mode, self.settings = model, store, history_mode, settings
        self.reference = PrecomputedBackend(reference, reference.label)
        self.candidates = [PrecomputedBackend(c, c.label) for c in candidates]
        # a path its route refuses to batch (`route._batch_refusal`) is precomputed nothing: `Replay` runs it one
        # sequence at a time through its own backend, beside the batched rest of the model
        self.batchable = [c for c in self.candidates if c.inner.route.batch_refusal is None]
        self.replay = Replay(model, self.reference, self.candidates, store, history_mode, on_unit_done,
                             attention=attention)
        self.batch_sizes: list[int] = []
        self.engines: list[BatchedEngine] = []

    def run(self, scenarios: Sequence[Scenario]) -> dict:
        """Replay everything; returns what the manifest records about batching for this model."""
        pending = [s for s in scenarios if not self._all_done(s)]
        fallbacks: list[str] = []
        reference_replies = self._guarded(fallbacks, REFERENCE, lambda: self._reference_waves(pending))
        floor, own_floors = {}, {}
        if reference_replies is not None:
            floor = self._guarded(fallbacks, "batch-invariance floor",
                                  lambda: self._batch_invariance(self.reference, pending, reference_replies)) or {}
            for candidate in self.batchable:  # a path whose route says the reference's floor does not bound it
                if batch_floor(candidate.inner.kv_path) == OWN_FLOOR:
                    own_floors[candidate.label] = self._guarded(
                        fallbacks, f"{candidate.label} batch-invariance floor",
                        lambda: self._batch_invariance(candidate, pending, reference_replies)) or {}
            self._score_waves(self.reference, pending, reference_replies, fallbacks)
            for candidate in self.batchable:
                todo = [s for s in pending if not self.store.is_done(self.model, s.id, candidate.label)]
                done = self._guarded(fallbacks, candidate.label,
                                     lambda: self._candidate_waves(candidate, todo, reference_replies) or True)
                if done:
                    self._score_waves(candidate, todo, reference_replies, fallbacks)
        asyncio.run(self.replay.run(scenarios))  # scores are computed as it asks for them (`PrecomputedBackend`)
        return {"batch_size": self.settings.batch_size or "auto (free GPU memory)",
                "largest_batch": max(self.batch_sizes, default=0), "batches": len(self.batch_sizes),
                "kernel_check_every": self.settings.kernel_check_every, "decode": self._decode_summary(),
                "batch_invariance_floor": floor, "batch_invariance_floors": own_floors,
                "one_sequence_paths": {c.label: c.inner.route.batch_refusal for c in self.candidates
                                       if c not in self.batchable},
                "one_at_a_time_fallbacks": fallbacks}

    @staticmethod
    def _guarded(fallbacks: list[str], what: str, work):
        """Run one batched phase; if it fails, say so and let `Replay` compute what is missing one sequence at
        a time (its own per-scenario error handling then records anything that still fails). On a tensor-parallel
        rank the error ends the run instead (`runner.in_lockstep`): the other ranks wait inside the failed batch's
        collectives, and a rank going on one sequence at a time alone would meet them with another shape."""
        try:
            return work()
        except Exception as error:  # noqa: BLE001 - named in the manifest, the run goes on
            if in_lockstep():
                end_in_lockstep(error)
            fallbacks.append(f"{what}: {type(error).__name__}: {error}"[:300])
            return None

    def _all_done(self, scenario: Scenario) -> bool:
        labels = [REFERENCE] + [c.label for c in self.candidates]
        return all(self.store.is_done(self.model, scenario.id, label) for label in labels)

    def _engine(self, backend: PrecomputedBackend, settings: BatchSettings | None = None) -> BatchedEngine:
        engine = BatchedEngine(backend.inner, settings or self.settings,
                               on_batch=lambda kind, size: self.batch_sizes.append(size))
        self.engines.append(engine)
        return engine

    def _decode_summary(self) -> dict:
        """Generation batches per decode mode, why any ran in another mode than asked (named, never silent), and a
        layer-sharded model's graphs per GPU."""
        batches: dict[str, int] = {}
        fallbacks: list[str] = []
        segments: set[str] = set()
        for engine in self.engines:
            for mode, count in engine.decode_batches.items():
                batches[mode] = batches.get(mode, 0) + count
            fallbacks += [why for why in engine.decode_fallbacks if why not in fallbacks]
            segments |= engine.graph_segments
        summary = {"asked": self.settings.decode, "batches": batches, "fallbacks": fallbacks}
        if segments:  # a layer-sharded model: each captured step's graphs, by GPU
            summary["graph_segments"] = sorted(segments)
        return summary

    # -- generation waves ---------------------------------------------------------------------------------
    def _reference_waves(self, scenarios: Sequence[Scenario]) -> dict[str, list[TurnReply]]:
        replies: dict[str, list[TurnReply]] = {}
        fresh = []
        for scenario in scenarios:
            if self.store.is_done(self.model, scenario.id, REFERENCE):
                replies[scenario.id] = self._stored_reference(scenario)
            else:
                replies[scenario.id] = []
                fresh.append(scenario)
        generate_waves(self._engine(self.reference), self.reference, fresh, replies, lambda s, history: history)
        return replies

    def _candidate_waves(self, candidate: PrecomputedBackend, scenarios: Sequence[Scenario],
                         reference: dict[str, list[TurnReply]]) -> None:
        own: dict[str, list[TurnReply]] = {s.id: [] for s in scenarios}
        kv_path = candidate.inner.kv_path
        if self.history_mode == "own-history":
            generate_waves(self._engine(candidate), candidate, scenarios, own, lambda s, history: history)
        elif kv_path is None or not (kv_path.is_quantized or kv_path.is_control):
            # a BF16 cache runs with the reference's batch composition, turn by turn: its floor stays exactly zero
            # (the control arm does not: its own batch composition is part of the perturbation it measures)
            generate_waves(self._engine(candidate), candidate, scenarios, own, lambda s, history: reference[s.id])
        else:
            # an FP8 path (or the control arm) on the reference's history: every turn's prompt is known, so all go in
            # one wave
            # (batches differ from the reference's; the batch-invariance floor says how much that can move)
            asked = [(scenario, turn, tuple(candidate.inner.owner.encode_chat(_messages(scenario, reference[scenario.id], turn))))
                     for scenario in scenarios for turn, spec in enumerate(scenario.turns) if spec.assistant is None]
            generate_turns(self._engine(candidate), candidate, asked)

    def _stored_reference(self, scenario: Scenario) -> list[TurnReply]:
        rows = [r for r in self.store.read("texts")
                if r["model"] == self.model and r["scenario"] == scenario.id and r["path"] == REFERENCE]
        return [TurnReply(r["turn"], r["user"], r["token_ids"], r["text"], r.get("fixed", False))
                for r in sorted(rows, key=lambda r: r["turn"])]

    # -- scoring waves ----------------------------------------------------------------------------------
    def _score_waves(self, backend: PrecomputedBackend, scenarios: Sequence[Scenario],
                     reference: dict[str, list[TurnReply]], fallbacks: list[str]) -> None:
        """Queue the teacher-forced scoring of every generated reference turn, scenario by scenario and turn by
        turn (the order `Replay` asks); the same queue for the reference and every path, so the bf16 path's
        batches and scores equal the reference's."""
        asked = []
        for scenario in scenarios:
            for turn in range(len(scenario.turns)):
                if not reference[scenario.id][turn].fixed:
                    messages = _messages(scenario, reference[scenario.id], turn)
                    asked.append((tuple(backend.inner.owner.encode_chat(messages)),
                                  tuple(reference[scenario.id][turn].token_ids)))
        backend.queue_scores(asked, self._engine(backend))
        backend.on_score_failure = lambda error: fallbacks.append(
            f"{backend.label} scores: {type(error).__name__}: {error}"[:300])

    # -- batch-invariance floor ---------------------------------------------------------------------------
    def _batch_invariance(self, backend: PrecomputedBackend, scenarios: Sequence[Scenario],
                          reference: dict[str, list[TurnReply]]) -> dict:
        """`backend`'s teacher-forced log-probs of the reference's first-turn replies scored alone vs in one batch:
        how much batching alone moves (the reference's: every path's floor, unless its route says it needs its own,
        `route.batch_floor`)."""
        asked = []
        for scenario in scenarios:
            first = next((r for r in reference.get(scenario.id, []) if not r.fixed and r.token_ids), None)
            if first is not None:
                messages = _messages(scenario, reference[scenario.id], first.turn)
                asked.append((backend.inner.owner.encode_chat(messages), first.token_ids))
        asked = asked[:max(FLOOR_SEQUENCES, 2)]
        if len(asked) < 2:
            return {"sequences": len(asked), "note": "fewer than 2 generated replies: not measured"}
        prompts, targets = [p for p, _ in asked], [c for _, c in asked]
        batched = self._engine(backend).score(prompts, targets)
        alone_settings = BatchSettings(batch_size=1, kernel_check_every=self.settings.kernel_check_every,
                                       decode=self.settings.decode)
        alone = BatchedEngine(backend.inner, alone_settings).score(prompts, targets)
        diffs = [(a - b).abs().max().item() for a, b in zip(alone, batched)]
        kls = [torch.nn.functional.kl_div(b, a, log_target=True, reduction="none").sum(-1).mean().item()
               for a, b in zip(alone, batched)]
        argmax_same = sum(int((a.argmax(-1) == b.argmax(-1)).all()) for a, b in zip(alone, batched))
        who = "reference" if backend is self.reference else f"path {backend.label}"
        return {"sequences": len(asked), "batch": len(asked), "max_abs_logprob_diff": max(diffs),
                "kl_mean": sum(kls) / len(kls), "argmax_identical_sequences": argmax_same,
                "how": f"{who} teacher-forced log-probs of the reference's first-turn replies, batch of all vs one "
                       f"at a time"}


# -- generation in waves (the batched replay's, and the CPU replay's rows) ----------------------------------------
def generate_waves(engine: BatchedEngine, backend: PrecomputedBackend, scenarios: Sequence[Scenario],
                   replies: dict[str, list[TurnReply]], history_of, rows: bool = False) -> None:
    """Turn by turn over `scenarios`: generate every non-fixed turn-t prompt in one call (history_of(scenario,
    replies so far) gives the history a turn's prompt is built on); rows: through `generate_turns`' rows."""
    for turn in range(max((len(s.turns) for s in scenarios), default=0)):
        wave = [s for s in scenarios if turn < len(s.turns)]
        asked = []
        for scenario in wave:
            spec = scenario.turns[turn]
            if spec.assistant is not None:
                replies[scenario.id].append(TurnReply(turn, spec.user, [], spec.assistant, fixed=True))
            else:
                messages = _messages(scenario, history_of(scenario, replies[scenario.id]), turn)
                asked.append((scenario, turn, tuple(backend.inner.owner.encode_chat(messages))))
        for scenario, turn, generation in generate_turns(engine, backend, asked, rows):
            replies[scenario.id].append(TurnReply(turn, scenario.turns[turn].user, generation.token_ids,
                                                  generation.text, fixed=False))


def generate_turns(engine: BatchedEngine, backend: PrecomputedBackend, asked: list, rows: bool = False) -> list:
    """Generate (scenario, turn, prompt ids) items in one call; the backend answers them from now on. rows:
    `BatchedEngine.generate_rows` (one sequence's bits; each prefill kept for scoring the same prompt, as a sequence
    replayed alone keeps it), else the batched `generate`."""
    if not asked:
        return []
    tokenizer = backend.inner.owner.tokenizer
    prompts, limits = [p for _, _, p in asked], [s.max_new_tokens for s, _, _ in asked]
    results = engine.generate_rows(prompts, limits, remember_prefill=True) if rows else engine.generate(prompts, limits)
    done = []
    for (scenario, turn, prompt), result in zip(asked, results):
        generation = Generation(token_ids=result.token_ids, text=tokenizer.decode(result.token_ids),
                                finish_reason=result.finish_reason,
                                tokens=backend.inner.owner.token_texts(result.token_ids),
                                prompt_tokens=len(prompt), metrics=result.metrics)
        backend.generations[(prompt, scenario.max_new_tokens)] = generation
        done.append((scenario, turn, generation))
    return done


def rows_replies(backend: PrecomputedBackend, scenarios: Sequence[Scenario],
                 reference: dict[str, list[TurnReply]] | None) -> dict[str, list[TurnReply]]:
    """Every turn of `scenarios` generated for `backend` through the rows engine (the CPU replay, `route.ROWS`), so
    `Replay` finds them: what it generates one sequence at a time, bit for bit. reference: the reference's replies
    when the turns are prompted on the reference's history (every prompt known: one call); None: on the backend's
    own, turn by turn. Returns the backend's replies per scenario."""
    engine = BatchedEngine(backend.inner, BatchSettings(), prefills=backend.inner.prefills)
    replies: dict[str, list[TurnReply]] = {s.id: [] for s in scenarios}
    if reference is None:
        generate_waves(engine, backend, scenarios, replies, lambda s, history: history, rows=True)
        return replies
    asked = [(scenario, turn, tuple(backend.inner.owner.encode_chat(_messages(scenario, reference[scenario.id], turn))))
             for scenario in scenarios for turn, spec in enumerate(scenario.turns) if spec.assistant is None]
    generated = {(scenario.id, turn): g for scenario, turn, g in generate_turns(engine, backend, asked, rows=True)}
    for scenario in scenarios:
        for turn, spec in enumerate(scenario.turns):
            g = generated.get((scenario.id, turn))
            replies[scenario.id].append(TurnReply(turn, spec.user, [], spec.assistant, fixed=True) if g is None
                                        else TurnReply(turn, spec.user, g.token_ids, g.text, fixed=False))
    return replies
