"""Which replies the judges see, and the rows they give back, from a run's stored texts.

`judge_texts` reads rows shaped like texts.jsonl and returns one row per (model, scenario, path,
turn, judge): the row keys plus `Verdict.as_row()`. Rule and agreement judges are cheap and run on
every turn. The LLM judge runs where it adds information: `selection="all"` judges every turn;
`selection="diverged"` judges a candidate's turn only where its conversation so far differs from the
reference's (elsewhere it is the reference's conversation, so the reference's verdict is reused, or
the turn is skipped when no path needed the reference judged).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from harness.judges.agreement import agreement_judge
from harness.judges.llm import Conversation, LLMJudge, conversation_for
from harness.judges.rules import DegenerationLimits, rule_judge
from harness.judges.verdict import Verdict
from harness.scenarios.load import Scenario
from harness.types import Generation

SELECTIONS = ("all", "diverged")
REFERENCE = "reference"  # the reference's path name in stored runs (harness.replay.runner.REFERENCE)


@dataclass(frozen=True, slots=True)
class JudgeConfig:
    selection: str = "diverged"  # all | diverged: which turns the LLM judge sees
    history_mode: str = "reference-history"  # the run's: whose earlier replies each path saw
    pairwise: bool = True  # also ask the LLM judge reference vs candidate (both orders)
    limits: DegenerationLimits = DegenerationLimits()

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(f"JudgeConfig.selection {self.selection!r}: expected one of {', '.join(SELECTIONS)}")
        if self.history_mode not in ("reference-history", "own-history"):
            raise ValueError(f"JudgeConfig.history_mode {self.history_mode!r}: expected reference-history or "
                             f"own-history")


def _generation(row: Mapping) -> Generation:
    return Generation(token_ids=list(row.get("token_ids") or []), text=row["text"],
                      finish_reason=row.get("finish_reason", ""), tokens=list(row.get("tokens") or []))


def _key(row: Mapping) -> dict:
    return {"model": row["model"], "scenario": row["scenario"], "path": row["path"], "turn": row["turn"]}


class _ScenarioTexts:
    """One model's stored texts of one scenario: {path: {turn: row}}."""

    def __init__(self, scenario: Scenario, rows: list[Mapping], config: JudgeConfig):
        self.scenario, self.config = scenario, config
        self.by_path: dict[str, dict[int, Mapping]] = defaultdict(dict)
        for row in rows:
            self.by_path[row["path"]][int(row["turn"])] = row

    def generated(self, path: str) -> list[Mapping]:
        return [row for _, row in sorted(self.by_path[path].items()) if not row.get("fixed")]

    def diverged(self, path: str, turn: int) -> bool:
        """Whether the path's conversation up to and including `turn` differs from the reference's."""
        reference, own = self.by_path[REFERENCE], self.by_path[path]
        first = 0 if self.config.history_mode == "own-history" else turn
        return any(own.get(t, {}).get("token_ids") != reference.get(t, {}).get("token_ids")
                   or own.get(t, {}).get("text") != reference.get(t, {}).get("text") for t in range(first, turn + 1))

    def conversation(self, path: str, turn: int) -> Conversation:
        history_path = path if self.config.history_mode == "own-history" else REFERENCE
        rows = self.by_path[history_path]
        earlier = [(rows[t]["user"], rows[t]["text"]) for t in range(turn)]
        return conversation_for(self.scenario.system, earlier, self.by_path[path][turn]["user"])


async def judge_texts(texts: Iterable[Mapping], scenarios: Mapping[str, Scenario], llm: LLMJudge | None = None,
                      config: JudgeConfig = JudgeConfig()) -> list[dict]:
    """Judge every stored reply of `texts` (texts.jsonl rows) whose scenario is in `scenarios`."""
    groups: dict[tuple[str, str], list[Mapping]] = defaultdict(list)
    for row in texts:
        if row["scenario"] in scenarios:
            groups[(row["model"], row["scenario"])].append(row)
    results = await asyncio.gather(*(_judge_scenario(_ScenarioTexts(scenarios[scenario], rows, config), llm)
                                     for (_, scenario), rows in sorted(groups.items())))
    return [row for rows in results for row in rows]


async def _judge_scenario(texts: _ScenarioTexts, llm: LLMJudge | None) -> list[dict]:
    rows = []
    for path in sorted(texts.by_path):
        for row in texts.generated(path):
            reference = texts.by_path[REFERENCE].get(int(row["turn"]))
            ref_generation = _generation(reference) if reference is not None and path != REFERENCE else None
            rows.append(_key(row) | rule_judge(texts.scenario, int(row["turn"]), _generation(row), ref_generation,
                                               texts.config.limits).as_row())
            if ref_generation is not None:
                rows.append(_key(row) | agreement_judge(texts.scenario, int(row["turn"]), _generation(row),
                                                        ref_generation).as_row())
    if llm is not None:
        rows += await _llm_verdicts(texts, llm)
    return rows


def _llm_call(texts: _ScenarioTexts, llm: LLMJudge, path: str, turn: int):
    """The single or reference-guided grading coroutine for one reply."""
    row, conversation = texts.by_path[path][turn], texts.conversation(path, turn)
    if _reference_guided(texts.scenario, turn):
        return llm.reference_guided(conversation, row["text"], texts.scenario.turns[turn].expect)
    return llm.single(conversation, row["text"])


async def _llm_verdicts(texts: _ScenarioTexts, llm: LLMJudge) -> list[dict]:
    """One LLM verdict row per generated reply (judged, reused from the reference, or skipped), plus
    a pairwise row per judged candidate turn whose reply differs from the reference's."""
    everything = texts.config.selection == "all"
    candidates = [p for p in sorted(texts.by_path) if p != REFERENCE]
    wanted = {(path, int(row["turn"])) for path in candidates for row in texts.generated(path)
              if everything or texts.diverged(path, int(row["turn"]))}
    jobs = {(REFERENCE, int(r["turn"])): _llm_call(texts, llm, REFERENCE, int(r["turn"]))
            for r in texts.generated(REFERENCE) if everything or any((p, int(r["turn"])) in wanted for p in candidates)}
    jobs |= {key: _llm_call(texts, llm, *key) for key in sorted(wanted)}
    if texts.config.pairwise:
        jobs |= {(path, turn, "pairwise"): llm.pairwise(texts.conversation(path, turn),
                                                        texts.by_path[REFERENCE][turn]["text"],
                                                        texts.by_path[path][turn]["text"])
                 for path, turn in sorted(wanted) if texts.diverged(path, turn)}
    done = dict(zip(jobs, await asyncio.gather(*jobs.values())))
    rows = []
    for path in [REFERENCE, *candidates]:
        for row in texts.generated(path):
            turn = int(row["turn"])
            verdict = _verdict_or_reuse(done.get((path, turn)), done.get((REFERENCE, turn)),
                                        _metric(texts.scenario, turn))
            rows.append(_key(row) | verdict.as_row())
            if (path, turn, "pairwise") in done:
                rows.append(_key(row) | done[(path, turn, "pairwise")].as_row())
    return rows


def _reference_guided(scenario: Scenario, turn: int) -> bool:
    return scenario.kind == "arithmetic" and scenario.turns[turn].expect is not None


def _metric(scenario: Scenario, turn: int) -> str:
    return "judge_llm_reference" if _reference_guided(scenario, turn) else "judge_llm"


def _verdict_or_reuse(own: Verdict | None, reference: Verdict | None, metric: str) -> Verdict:
    if own is not None:
        return own
    if reference is not None:  # same conversation as the reference's: its verdict, marked as reused
        return Verdict(reference.metric, reference.status, reference.score, reference.reason,
                       reference.judge_model, reference.template_sha256, reference.prompt_sha256,
                       reference.raw_replies, {**reference.detail, "reused_from": REFERENCE})
    return Verdict(metric, "skipped", None, "identical to the reference and no path diverged here "
                                            "(selection: diverged); not sent to the judge")


def judgement_records(rows: Iterable[Mapping], scenarios: Mapping[str, Scenario]) -> list[dict]:
    """records.jsonl rows (one per judge metric) for judgement rows: value null unless status is ok."""
    out = []
    for row in rows:
        scenario = scenarios[row["scenario"]]
        out.append({"model": row["model"], "scenario": row["scenario"], "scenario_hash": scenario.content_hash,
                    "kind": scenario.kind, "tags": list(scenario.tags), "path": row["path"], "turn": row["turn"],
                    "metric": row["metric"], "value": row["value"] if row["status"] == "ok" else None})
    return out


async def judge_run(store, scenarios: Sequence[Scenario], llm: LLMJudge | None = None,
                    config: JudgeConfig = JudgeConfig()) -> list[dict]:
    """Judge a stored run (a `harness.runs.store.RunStore`) and append to it: `judgements.jsonl` (every
    verdict with reason, judge model, hashes and raw replies) and the judge metrics to
    `records.jsonl`. Replies already judged (by model, scenario, path, turn, judge) are skipped, so a
    resumed run judges only what is new."""
    by_id = {s.id: s for s in scenarios}
    seen = {(r["model"], r["scenario"], r["path"], r["turn"], r["metric"]) for r in store.read("judgements")}
    rows = [r for r in await judge_texts(store.read("texts"), by_id, llm, config)
            if (r["model"], r["scenario"], r["path"], r["turn"], r["metric"]) not in seen]
    store.append_judged(rows, judgement_records(rows, by_id))  # one step: a kill loses nothing for good
    return rows
