"""Replay scenarios through a reference backend and candidate backends; write records to a run store.

Per scenario: the reference answers every turn first (its own history). Then each candidate answers
every turn, with either the reference's earlier replies as history (`reference-history`, isolating each
turn's error) or its own (`own-history`, what a user would see). Teacher-forced metrics always score
the reference's reply given the reference's history, so they measure one turn's error in both modes.
"""

from __future__ import annotations

import asyncio
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from harness.analysis.candidates import candidates_at_divergence
from harness.analysis.metrics import SUMMARY_KEYS, free_running, teacher_forced, teacher_forced_topk
from harness.analysis.thresholds import ThresholdCheck
from harness.records import encode_value, encode_values, scrub_credentials
from harness.replay.backend import Backend
from harness.replay.self_consistency import measure_turn
from harness.scenarios.checks import check_answer, check_rules
from harness.scenarios.load import Scenario
from harness.types import Generation, Message

if TYPE_CHECKING:  # the runner writes to a store it is given; it never imports the later stage
    from harness.runs.store import RunStore

HISTORY_MODES = ("reference-history", "own-history")
REFERENCE = "reference"


@dataclass(frozen=True, slots=True)
class TurnReply:
    turn: int
    user: str
    token_ids: list[int]
    text: str
    fixed: bool  # a scenario's fixed assistant turn: history only, nothing generated


def _messages(scenario: Scenario, replies: Sequence[TurnReply], upto: int) -> list[Message]:
    """System prompt, then user/assistant pairs for turns before `upto`, then turn `upto`'s user text."""
    messages = [Message("system", scenario.system)] if scenario.system else []
    for reply in replies[:upto]:
        messages += [Message("user", reply.user), Message("assistant", reply.text)]
    messages.append(Message("user", scenario.turns[upto].user))
    return messages


class Replay:
    """Runs one model's scenarios for a reference and candidates, appending to `store`."""

    def __init__(self, model: str, reference: Backend, candidates: Sequence[Backend], store: RunStore,
                 history_mode: str = "reference-history", on_unit_done: Callable[[], None] | None = None,
                 attention=None, self_consistency: bool = False):
        if history_mode not in HISTORY_MODES:
            raise ValueError(f"unknown history mode {history_mode!r}; expected one of {', '.join(HISTORY_MODES)}")
        self.model, self.reference, self.candidates = model, reference, list(candidates)
        self.store, self.history_mode = store, history_mode
        self.on_unit_done = on_unit_done or (lambda: None)
        self.attention = attention  # harness.replay.attention.AttentionOptions, or None: no capture
        self.self_consistency = self_consistency  # each candidate turn also against the server itself

    async def run(self, scenarios: Sequence[Scenario], concurrency: int = 1) -> None:
        gate = asyncio.Semaphore(concurrency)

        async def one(scenario: Scenario) -> None:
            async with gate:
                await self.run_scenario(scenario)

        await asyncio.gather(*(one(s) for s in scenarios))

    async def run_scenario(self, scenario: Scenario) -> None:
        try:
            reference = await self._reference_replies(scenario)
        except Exception as error:  # noqa: BLE001 - recorded, and the other scenarios go on
            self._record_error(scenario, REFERENCE, None, error)
            for _ in range(1 + len(self.candidates)):
                self.on_unit_done()
            return
        self.on_unit_done()
        reference_scores: dict[int, asyncio.Task] = {}

        async def candidate(backend: Backend) -> None:
            if not self.store.is_done(self.model, scenario.id, backend.label):
                try:
                    await self._candidate(scenario, backend, reference, reference_scores)
                except Exception as error:  # noqa: BLE001
                    self._record_error(scenario, backend.label, None, error)
            self.on_unit_done()

        await asyncio.gather(*(candidate(b) for b in self.candidates))  # paths of one scenario in parallel

    # -- reference ------------------------------------------------------------------------------------
    async def _reference_replies(self, scenario: Scenario) -> list[TurnReply]:
        if self.store.is_done(self.model, scenario.id, REFERENCE):
            rows = [r for r in self.store.read("texts")
                    if r["model"] == self.model and r["scenario"] == scenario.id and r["path"] == REFERENCE]
            return [TurnReply(r["turn"], r["user"], r["token_ids"], r["text"], r.get("fixed", False))
                    for r in sorted(rows, key=lambda r: r["turn"])]
        replies: list[TurnReply] = []
        records, texts = [], []
        for turn, spec in enumerate(scenario.turns):
            if spec.assistant is not None:
                replies.append(TurnReply(turn, spec.user, [], spec.assistant, fixed=True))
                texts.append(self._text_row(scenario, REFERENCE, turn, replies[-1], None))
                continue
            generation = await self.reference.generate(_messages(scenario, replies, turn), scenario.max_new_tokens)
            replies.append(TurnReply(turn, spec.user, generation.token_ids, generation.text, fixed=False))
            texts.append(self._text_row(scenario, REFERENCE, turn, replies[-1], generation))
            records += self._task_records(scenario, REFERENCE, turn, generation)
            if generation.prompt_tokens is not None:  # the prompt every path's teacher-forced series follows
                records.append(self._record(scenario, REFERENCE, turn, "context_tokens", generation.prompt_tokens))
        await asyncio.to_thread(self.store.finish_unit, self.model, scenario.id, REFERENCE,
                                {"records": records, "texts": texts})
        return replies

    # -- candidates -----------------------------------------------------------------------------------
    async def _candidate(self, scenario: Scenario, backend: Backend, reference: list[TurnReply],
                         reference_scores: dict[int, object]) -> None:
        own: list[TurnReply] = []
        tables: dict[str, list[dict]] = {"records": [], "series": [], "texts": [], "checks": [], "attention": [],
                                         "attention_channels": []}
        checks = [ThresholdCheck(metric, limit, scenario.source) for metric, limit in scenario.thresholds.items()]
        for turn, spec in enumerate(scenario.turns):
            ref = reference[turn]
            if ref.fixed:
                own.append(ref)
                tables["texts"].append(self._text_row(scenario, backend.label, turn, ref, None))
                continue
            history = own if self.history_mode == "own-history" else reference
            messages = _messages(scenario, history, turn)
            generation = await backend.generate(messages, scenario.max_new_tokens)
            reply = TurnReply(turn, spec.user, generation.token_ids, generation.text, fixed=False)
            own.append(reply)
            values = dict(free_running(ref.token_ids, generation.token_ids))
            tf_summary, tf_series, unavailable, candidates = await self._teacher_forced(
                scenario, backend, reference, turn, reference_scores, values["first_divergent_token"])
            values.update(tf_summary)
            values.update(generation.metrics or {})
            values.update(await self._attention(scenario, backend, reference, turn, tables))
            if generation.prompt_tokens is not None:
                values["context_tokens"] = generation.prompt_tokens
            rows = [self._record(scenario, backend.label, turn, metric, value) for metric, value in values.items()]
            rows += [self._record(scenario, backend.label, turn, metric, None) | {"unavailable": unavailable}
                     for metric in (SUMMARY_KEYS if unavailable else ())]
            if self.self_consistency:
                rows += await self._self_consistency_rows(scenario, backend, turn, messages, generation)
            tables["records"] += rows + self._task_records(scenario, backend.label, turn, generation)
            tables["series"] += [{**self._key(scenario, backend.label, turn), "series": name, **encode_values(series)}
                                 for name, series in tf_series.items()]
            tables["texts"].append(self._text_row(scenario, backend.label, turn, reply, generation))
            if candidates is not None:  # the next-token candidates where the reply first left the reference
                tables["texts"][-1]["candidates_at_divergence"] = candidates
            tables["checks"] += self._checks(scenario, backend.label, turn, checks, values, tables["records"])
        await asyncio.to_thread(self.store.finish_unit, self.model, scenario.id, backend.label, tables)

    async def _teacher_forced(self, scenario, backend, reference, turn, reference_scores, divergent_at=None):
        """(summary, series, None, candidates at the first divergent token), or ({}, {}, why, None) when either side could not score: the turn keeps its
        free-running metrics and records the teacher-forced ones as unavailable, with the reason."""
        try:
            scored = await self._scores(scenario, backend, reference, turn, reference_scores)
        except Exception as error:  # noqa: BLE001 - a scoring failure never costs the free-running metrics...
            if in_lockstep():
                end_in_lockstep(error)
            if getattr(error, "retry_later", False):  # ...unless a server failed for now: the unit fails and
                raise  # `--resume` redoes it whole, rather than keeping its teacher-forced metrics null for good
            return {}, {}, f"scoring failed: {type(error).__name__}: {error}", None
        ref_scores, path_scores = scored
        if ref_scores.logprobs is not None and path_scores.logprobs is not None:
            result = teacher_forced(ref_scores.logprobs, path_scores.logprobs, reference[turn].token_ids)
        elif ref_scores.top_logprobs is not None and path_scores.top_logprobs is not None:
            result = teacher_forced_topk(ref_scores.top_logprobs, path_scores.top_logprobs, reference[turn].token_ids)
        else:
            reasons = [f"{side}: {scores.unavailable or 'no logprobs'}"
                       for side, scores in ((REFERENCE, ref_scores), (backend.label, path_scores))
                       if scores.logprobs is None and scores.top_logprobs is None]
            return {}, {}, "; ".join(reasons) or "reference and path scores are of different kinds", None
        return (result.summary, result.series, None,
                candidates_at_divergence(ref_scores, path_scores, divergent_at))

    async def _scores(self, scenario, backend, reference, turn, reference_scores):
        messages = _messages(scenario, reference, turn)
        target = reference[turn].token_ids
        if turn not in reference_scores:  # one reference scoring per turn, shared by all candidates
            reference_scores[turn] = asyncio.ensure_future(self.reference.score(messages, target))
        path_scores = asyncio.ensure_future(backend.score(messages, target))  # both servers score at once
        try:
            ref_scores = await asyncio.shield(reference_scores[turn])
        except BaseException:
            path_scores.cancel()
            raise
        return ref_scores, await path_scores

    async def _self_consistency_rows(self, scenario, backend, turn, messages, generation) -> list[dict]:
        """The turn's self-consistency records (harness/replay/self_consistency.py): the server's decode against its
        own prefill of the same tokens and against a repeated decode; unmeasured ones null, with the reason."""
        measured = await measure_turn(backend, messages, scenario.max_new_tokens, generation)
        return [self._record(scenario, backend.label, turn, metric, value) | ({"unavailable": why} if why else {})
                for metric, value, why in measured.records()]

    async def _attention(self, scenario, backend, reference, turn, tables) -> dict:
        """Attention-score error of the turn (in-process backends, when asked): per-turn aggregates
        returned as record values; the per-row and per-channel detail appended to `tables`."""
        if self.attention is None or not hasattr(backend, "attention_error"):
            return {}
        try:
            measured = await backend.attention_error(_messages(scenario, reference, turn), reference[turn].token_ids,
                                                     self.attention)
        except Exception as error:  # noqa: BLE001 - named in errors.jsonl; the turn's other metrics stay
            self._record_error(scenario, backend.label, turn, error)
            return {}
        for message in getattr(measured, "errors", ()):  # a part that could not be measured, named in the run
            self._record_error(scenario, backend.label, turn, RuntimeError(message))
        key = self._key(scenario, backend.label, turn)
        tables["attention"] += [{**key, "mode": self.attention.mode, **row} for row in measured.rows]
        tables["attention_channels"] += [{**key, **row} for row in measured.channels]
        return measured.summary

    # -- rows -----------------------------------------------------------------------------------------
    def _key(self, scenario: Scenario, path: str, turn: int | None) -> dict:
        return {"model": self.model, "scenario": scenario.id, "path": path, "turn": turn}

    def _record(self, scenario: Scenario, path: str, turn: int, metric: str, value) -> dict:
        return {**self._key(scenario, path, turn), "scenario_hash": scenario.content_hash, "kind": scenario.kind,
                "tags": list(scenario.tags), "metric": metric, **encode_value(value)}

    def _task_records(self, scenario: Scenario, path: str, turn: int, generation: Generation) -> list[dict]:
        values = {"reply_tokens": len(generation.token_ids)}
        answer = check_answer(scenario, scenario.turns[turn], generation.text)
        rules = check_rules(scenario, generation.text)
        if answer is not None:
            values["answer_correct"] = float(answer)
        if rules is not None:
            values["rules_followed"] = float(rules)
        return [self._record(scenario, path, turn, metric, value) for metric, value in values.items()]

    def _text_row(self, scenario: Scenario, path: str, turn: int, reply: TurnReply, generation) -> dict:
        return {**self._key(scenario, path, turn), "user": reply.user, "text": reply.text,
                "token_ids": reply.token_ids, "tokens": generation.tokens if generation else [],
                "finish_reason": generation.finish_reason if generation else "fixed", "fixed": reply.fixed}

    def _checks(self, scenario, path, turn, checks, values, records) -> list[dict]:
        task = {r["metric"]: r["value"] for r in records if r["turn"] == turn and r["path"] == path}
        rows = []
        for check in checks:
            value = values.get(check.metric, task.get(check.metric))
            message = check.compute(turn, value)
            rows.append({**self._key(scenario, path, turn), "metric": check.metric, **encode_value(value),
                         "limit": check.limit, "passed": message is None, "message": message})
        return rows

    def _record_error(self, scenario: Scenario, path: str, turn: int | None, error: BaseException) -> None:
        if in_lockstep():
            end_in_lockstep(error)
        self.store.append("errors", [{**self._key(scenario, path, turn),
                                      "error": scrub_credentials(f"{type(error).__name__}: {error}"),
                                      "traceback": scrub_credentials(traceback.format_exc(limit=6))}])


def in_lockstep() -> bool:
    """This process is a tensor-parallel rank of several (harness/replay/tensor_parallel.py). Every rank runs each
    unit's collectives in step, so a rank cannot record a unit's error and go on to the next unit while the others
    wait inside the failed one (their collectives would meet another unit's: a gloo size mismatch, or worse, a sum
    of two sequences' partials stored as a result). The rank's error ends the run instead (`end_in_lockstep`)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# How a tensor-parallel rank ends on an error (set by `harness.executor.sharded.tensor_parallel_rank`: the error named
# in the run's manifest, then the process exits at once, before any other unit's collective; its executor stops the
# other ranks). Unset: the error is raised.
ON_LOCKSTEP_ERROR: Callable[[BaseException], None] | None = None


def end_in_lockstep(error: BaseException) -> None:
    if ON_LOCKSTEP_ERROR is not None:
        ON_LOCKSTEP_ERROR(error)
    raise error


class SelfConsistencyReplay(Replay):
    """A run with no reference: each candidate server replays every scenario with its own history, and each turn
    it generates is measured against itself. One unit per (scenario, candidate), as in `Replay`."""

    def __init__(self, model: str, candidates, store, on_unit_done=None):
        super().__init__(model, None, candidates, store, "own-history", on_unit_done=on_unit_done,
                         self_consistency=True)

    async def run_scenario(self, scenario: Scenario) -> None:
        async def candidate(backend) -> None:
            if not self.store.is_done(self.model, scenario.id, backend.label):
                try:
                    await self._alone(scenario, backend)
                except Exception as error:  # noqa: BLE001 - recorded, and the other units go on
                    self._record_error(scenario, backend.label, None, error)
            self.on_unit_done()

        await asyncio.gather(*(candidate(b) for b in self.candidates))

    async def _alone(self, scenario: Scenario, backend) -> None:
        own: list[TurnReply] = []
        tables: dict[str, list[dict]] = {"records": [], "texts": []}
        for turn, spec in enumerate(scenario.turns):
            if spec.assistant is not None:
                own.append(TurnReply(turn, spec.user, [], spec.assistant, fixed=True))
                tables["texts"].append(self._text_row(scenario, backend.label, turn, own[-1], None))
                continue
            messages = _messages(scenario, own, turn)
            generation = await backend.generate(messages, scenario.max_new_tokens)
            own.append(TurnReply(turn, spec.user, generation.token_ids, generation.text, fixed=False))
            tables["records"] += await self._self_consistency_rows(scenario, backend, turn, messages, generation)
            tables["records"] += self._task_records(scenario, backend.label, turn, generation)
            if generation.prompt_tokens is not None:
                tables["records"].append(self._record(scenario, backend.label, turn, "context_tokens",
                                                      generation.prompt_tokens))
            tables["texts"].append(self._text_row(scenario, backend.label, turn, own[-1], generation))
        await asyncio.to_thread(self.store.finish_unit, self.model, scenario.id, backend.label, tables)
