"""Judges: strict parsing of real reply shapes, rule and agreement scoring, the LLM judge against a fake
OpenAI-compatible judge (in-memory ASGI, no sockets), pairwise order swapping, caching, turn selection."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

pytest.importorskip("starlette", reason="the '[test]' extra's HTTP server: pip install -e '.[test]'")
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from harness.judges import (
    JudgeConfig,
    LLMJudge,
    Verdict,
    agreement_judge,
    conversation_for,
    judge_texts,
    parse_pairwise,
    parse_rating,
    repetition_loop,
    rule_judge,
    summarise,
)
from harness.judges.rules import DegenerationLimits
from harness.replay.endpoint import RequestClient, RequestPolicy
from harness.scenarios.load import Scenario, Turn
from harness.types import Generation

FAST = RequestPolicy(concurrency=4, timeout_s=5.0, retries=0, backoff_s=0.0)


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("reply, score", [
    ("The reply is correct and concise.\nRating: [[5]]", 5),                 # at the end, as asked
    ("[[4]] The answer is right but wordy.", 4),                             # at the start
    ("Rating: [[ 2 ]]\nIt stops mid-sentence.", 2),                          # spaces inside the brackets
    ("Explanation: garbled output, '!!!!!!' repeated.\n\nRating: [[1]]\n", 1),
])
def test_parse_rating_accepts_one_bracketed_integer(reply, score):
    assert parse_rating(reply).value == score
    assert parse_rating(reply).problem is None


@pytest.mark.parametrize("reply, problem", [
    ("Rating: 4", "no [[N]] rating"),                                        # missing brackets
    ("I would rate this highly.", "no [[N]] rating"),                        # missing entirely
    ("Rating: [[3]]\nOn reflection, Rating: [[4]]", "2 bracketed values"),   # two scores
    ("Rating: [[4]] ... Rating: [[4]]", "2 bracketed values"),               # two, even if equal
    ("Rating: [[7]]", "out of range 1..5"),                                  # out of range
    ("Rating: [[0]]", "out of range 1..5"),
    ("Rating: [[4.5]]", "not an integer"),
    ("Rating: [[N]]", "not an integer"),                                     # the format echoed back
])
def test_parse_rating_refuses_everything_else(reply, problem):
    parsed = parse_rating(reply)
    assert parsed.value is None
    assert problem in parsed.problem


@pytest.mark.parametrize("reply, value, problem", [
    ("A is clearer.\n[[A]]", "A", None),
    ("[[B]] because A repeats itself.", "B", None),
    ("Both are equally good. [[C]]", "tie", None),
    ("Assistant A is better.", None, "no [[A]]/[[B]]/[[C]]"),
    ("[[A]] ... actually [[B]]", None, "2 bracketed values"),
    ("[[D]]", None, "not A, B or C"),
])
def test_parse_pairwise(reply, value, problem):
    parsed = parse_pairwise(reply)
    assert parsed.value == value
    assert (parsed.problem is None) if problem is None else (problem in parsed.problem)


def test_verdict_refuses_a_score_without_status_ok():
    with pytest.raises(ValueError, match="status 'unparsable' with score 3"):
        Verdict("judge_llm", "unparsable", 3.0, "")
    with pytest.raises(ValueError, match="status 'ok' with score None"):
        Verdict("judge_llm", "ok", None, "")


def test_summarise_never_averages_in_unscored_verdicts():
    verdicts = [Verdict("judge_llm", "ok", 5.0, ""), Verdict("judge_llm", "ok", 3.0, ""),
                Verdict("judge_llm", "unparsable", None, "x"), Verdict("judge_llm", "failed", None, "y")]
    assert summarise(verdicts) == {"mean": 4.0, "scored": 2, "unparsable": 1, "failed": 1, "skipped": 0}


# ---------------------------------------------------------------- rule and agreement judges

ARITH = Scenario(id="arith", kind="arithmetic", turns=(Turn(user="What is 7 * 8 + 3 * 4?", expect="68"),))
CHAT = Scenario(id="chat", kind="chat", system="End every answer with the word Thanks.",
                turns=(Turn(user="What plans do you offer?"),), rules={"ends_with": "Thanks", "max_sentences": 2})


def gen(text: str, finish: str = "eos", tokens: list[str] | None = None) -> Generation:
    tokens = list(text) if tokens is None else tokens
    return Generation(token_ids=[ord(c) for c in text], text=text, finish_reason=finish, tokens=tokens)


@pytest.mark.parametrize("scenario, text, score, reason", [
    (ARITH, "7 * 8 + 3 * 4 = 68", 5, "all fine"),
    (ARITH, "7 × 7 = 56", 2, "expected answer '68' missing"),                       # failure class 2
    (CHAT, "We offer Basic and Pro. Thanks", 5, "all fine"),
    (CHAT, "We offer Basic and Pro.", 4, "rule ends_with"),
    (CHAT, "...a S componentes_obs Worce!!!!!!!!!!!!!!!!", 1, "repetition loop: '!'"),  # failure class 1
    (CHAT, "Quantum Quantum Quantum Quantum Quantum", 1, "repetition loop: 'Quantum '"),  # failure class 3
    (CHAT, "Plans\x00\x07 here. Thanks", 3, "non-text output"),
    (CHAT, "Basic plan.<|assistant|> Thanks", 3, "template markers"),
])
def test_rule_judge(scenario, text, score, reason):
    verdict = rule_judge(scenario, 0, gen(text))
    assert (verdict.status, verdict.score) == ("ok", score), verdict.reason
    assert reason in verdict.reason


def test_rule_judge_early_eos_against_the_reference():
    reference = gen("The distance is 150 miles by road. Thanks")
    verdict = rule_judge(CHAT, 0, gen("a distance"), reference)  # class 3: 5 tokens then EOS
    assert verdict.score == 2 and "early EOS" in verdict.reason  # 5, rule broken -1, early EOS -2
    assert "early EOS" not in rule_judge(CHAT, 0, gen("a distance", finish="length"), reference).reason


def test_repetition_loop_ignores_ordinary_text():
    assert repetition_loop("1,000,000 dollars -- a fair price, said the seller, and it was.") is None


def loop_one_character_at_a_time(text: str, limits: DegenerationLimits) -> tuple[int, int, str] | None:
    """The rule as first written, one character at a time: what the vectorised `repetition_loop` must equal."""
    best = None
    for period in range(1, min(limits.loop_max_period, len(text) // 2) + 1):
        run = 0
        for i in range(period, len(text) + 1):
            if i < len(text) and text[i] == text[i - period]:
                run += 1
                continue
            span = run + period
            if run and span >= limits.loop_min_chars and span / period >= limits.loop_min_repeats:
                if best is None or span > best[1]:
                    best = (i - span, span, text[i - span:i - span + period])
            run = 0
    return best


def test_repetition_loop_equals_the_character_loop():
    # Random texts over small alphabets (so runs of every period, ties between equally long runs, runs that
    # reach the end) and awkward ones: empty, one character, non-BMP and lone-surrogate characters.
    rng = random.Random(0)
    texts = ["", "a", "aa", "!!!!!!!!!!!!", "abcabcabcabc", "ab" * 40 + "x" + "ab" * 40, "\U0001F600" * 13,
             "\ud800x" * 12, "the the the the the the the end", "1,000,000 dollars -- a fair price"]
    for _ in range(300):
        alphabet = rng.choice(["ab", "abc", "ab ", "xyz.!", "aaab"])
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 160))))
    for limits in (DegenerationLimits(), DegenerationLimits(loop_min_chars=4, loop_min_repeats=2.0, loop_max_period=5),
                   DegenerationLimits(loop_min_chars=30, loop_min_repeats=2.5, loop_max_period=64)):
        for text in texts:
            assert repetition_loop(text, limits) == loop_one_character_at_a_time(text, limits), (text, limits)


def test_agreement_judge():
    reference = gen("7 * 8 + 3 * 4 = 68")
    assert agreement_judge(ARITH, 0, reference, reference).score == 5
    assert agreement_judge(ARITH, 0, gen("7 * 8 + 3 * 4 = 68."), reference).score == 4
    wrong = agreement_judge(ARITH, 0, gen("7 * 8 + 3 * 4 = 69"), reference)
    assert wrong.score == 2 and "expected answer '68'" in wrong.reason


# ---------------------------------------------------------------- LLM judge against a fake endpoint


def fake_judge(answer_for):
    """An OpenAI-compatible judge: `answer_for(user_prompt) -> reply text | int status`. Counts calls."""
    calls = []

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        calls.append(body)
        reply = answer_for(body["messages"][-1]["content"])
        if isinstance(reply, int):
            return JSONResponse({"error": {"message": "judge down"}}, status_code=reply)
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                          "finish_reason": "stop"}]})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"data": [{"id": "judge-70b"}]})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])
    return app, calls


def judge_on(app, cache_dir=None) -> LLMJudge:
    client = RequestClient("http://judge", policy=FAST, cache_dir=cache_dir, transport=httpx.ASGITransport(app=app))
    return LLMJudge("http://judge", client=client)


CONVERSATION = conversation_for("Answer with the number only.", [], "What is 7 * 8 + 3 * 4?")


def _after(prompt: str, marker: str) -> str:
    return prompt.split(marker, 1)[1].split("\n", 1)[1].split("\n", 1)[0]


def test_llm_judge_records_model_hashes_and_raw_reply():
    app, calls = fake_judge(lambda prompt: "Correct.\nRating: [[5]]" if "68" in _after(prompt, "[The reply to judge]")
                            else "Wrong.\nRating: [[1]]")
    judge = judge_on(app)
    good, bad = asyncio.run(_both(judge.reference_guided(CONVERSATION, "68", "68"),
                                  judge.reference_guided(CONVERSATION, "56", "68")))
    assert (good.score, bad.score) == (5.0, 1.0)
    assert good.metric == "judge_llm_reference" and good.judge_model == "judge-70b"
    assert good.raw_replies == ("Correct.\nRating: [[5]]",)
    assert len(good.template_sha256) == len(good.prompt_sha256) == 64 and good.prompt_sha256 != bad.prompt_sha256
    assert all(c["temperature"] == 0 and c["seed"] == 0 for c in calls)


async def _both(*coroutines):
    return await asyncio.gather(*coroutines)


def test_llm_judge_unparsable_and_failed_are_recorded_not_defaulted():
    app, _ = fake_judge(lambda prompt: "I'd say about a four." if "hello" in prompt else 500)
    judge = judge_on(app)
    unparsable = asyncio.run(judge.single(CONVERSATION, "hello"))
    failed = asyncio.run(judge.single(CONVERSATION, "bye"))
    assert (unparsable.status, unparsable.score) == ("unparsable", None)
    assert unparsable.raw_replies == ("I'd say about a four.",) and "no [[N]] rating" in unparsable.reason
    assert (failed.status, failed.score) == ("failed", None) and "HTTP 500" in failed.reason


def test_pairwise_both_orders_and_disagreement_is_a_tie():
    def prefers_68(prompt: str) -> str:
        return "[[A]]" if "68" in _after(prompt, "[Assistant A's reply]") else "[[B]]"

    app, calls = fake_judge(prefers_68)
    win = asyncio.run(judge_on(app).pairwise(CONVERSATION, reference="56", candidate="68"))
    assert (win.score, win.detail["winner"], len(calls)) == (1.0, "candidate", 2)
    biased, _ = fake_judge(lambda prompt: "The first is better. [[A]]")  # position bias only
    tie = asyncio.run(judge_on(biased).pairwise(CONVERSATION, reference="56", candidate="68"))
    assert (tie.score, tie.detail["winner"]) == (0.5, "tie") and "orders disagree" in tie.reason
    assert len(tie.raw_replies) == 2


def test_judge_replies_are_cached_on_disk(tmp_path):
    app, calls = fake_judge(lambda prompt: "Rating: [[4]]")
    first = asyncio.run(judge_on(app, tmp_path).single(CONVERSATION, "68"))
    down, _ = fake_judge(lambda prompt: 500)
    again = asyncio.run(judge_on(down, tmp_path).single(CONVERSATION, "68"))
    assert first.score == again.score == 4.0 and len(calls) == 1


# ---------------------------------------------------------------- which turns are judged

TWO_TURNS = Scenario(id="chat2", kind="chat", turns=(Turn(user="Hi, I am Ann."), Turn(user="Who am I?")))


def text_rows(path: str, replies: list[str]) -> list[dict]:
    return [{"model": "m", "scenario": "chat2", "path": path, "turn": t, "user": TWO_TURNS.turns[t].user,
             "text": r, "token_ids": [ord(c) for c in r], "tokens": list(r), "finish_reason": "eos"}
            for t, r in enumerate(replies)]


@pytest.mark.parametrize("selection, llm_rows, judge_calls", [
    ("diverged", {("reference", 0): "skipped", ("fp8", 0): "skipped", ("reference", 1): "ok", ("fp8", 1): "ok"}, 4),
    ("all", {("reference", 0): "ok", ("fp8", 0): "ok", ("reference", 1): "ok", ("fp8", 1): "ok"}, 6),
])
def test_judge_texts_selection(selection, llm_rows, judge_calls):
    app, calls = fake_judge(lambda prompt: "[[A]]" if "[Assistant A" in prompt else "Rating: [[3]]")
    texts = text_rows("reference", ["Hello Ann.", "You are Ann."]) + text_rows("fp8", ["Hello Ann.", "You are Bob."])
    rows = asyncio.run(judge_texts(texts, {"chat2": TWO_TURNS}, judge_on(app), JudgeConfig(selection=selection)))
    llm = {(r["path"], r["turn"]): r["status"] for r in rows if r["metric"] == "judge_llm"}
    assert {k: v for k, v in llm.items() if k in llm_rows} == llm_rows
    assert len(calls) == judge_calls  # diverged: reference and fp8 at turn 1, plus 2 pairwise orders
    assert {r["metric"] for r in rows} >= {"judge_rule", "judge_agreement", "judge_llm", "judge_pairwise"}
    pairwise = [r for r in rows if r["metric"] == "judge_pairwise"]
    assert [(r["path"], r["turn"], r["value"]) for r in pairwise] == [("fp8", 1, 0.5)]  # [[A]] both orders: tie


def test_judge_run_appends_judgements_and_records_once(tmp_path):
    from harness.judges import judge_run
    from harness.runs.store import RunStore

    store = RunStore.create(tmp_path / "run", {"run_id": "judged"})
    store.append("texts", text_rows("reference", ["Hello Ann.", "You are Ann."]) +
                 text_rows("fp8", ["Hello Ann.", "You are Bob."]))
    app, calls = fake_judge(lambda prompt: "[[B]]" if "[Assistant A" in prompt else "Rating: [[4]]")
    first = asyncio.run(judge_run(store, [TWO_TURNS], judge_on(app)))
    again = asyncio.run(judge_run(store, [TWO_TURNS], judge_on(app)))
    assert first and again == [] and len(store.read("judgements")) == len(first)
    records = {(r["path"], r["turn"], r["metric"]): r["value"] for r in store.read("records")}
    assert records[("fp8", 1, "judge_llm")] == 4.0 and records[("fp8", 0, "judge_llm")] is None  # skipped
    assert records[("fp8", 1, "judge_pairwise")] == 0.5  # [[B]] in both orders: the orders disagree
    assert records[("fp8", 1, "judge_agreement")] < 5 and records[("reference", 0, "judge_rule")] == 5


class _Killed(BaseException):
    """Stands in for SIGKILL: raised inside the store after the first of the judge tables was fsynced."""


def test_a_kill_between_judge_tables_loses_nothing_after_resume(tmp_path, monkeypatch):
    """Issue 15, item 9: judgements and their records are one step. The kill lands after whichever table
    the store writes first; --resume (RunStore.resume, then judge_run) must end with one judge record and
    one judgement per (path, turn, judge) and nothing missing."""
    from harness.judges import judge_run
    from harness.runs.store import RunStore

    store = RunStore.create(tmp_path / "run", {"run_id": "judged"})
    for path, replies in (("reference", ["Hello Ann.", "You are Ann."]), ("fp8", ["Hello Ann.", "You are Bob."])):
        store.finish_unit("m", "chat2", path, {"texts": text_rows(path, replies)})
    app, _ = fake_judge(lambda prompt: "[[A]]" if "[Assistant A" in prompt else "Rating: [[4]]")
    written = []
    original = RunStore._append_locked

    def append_then_die(self, table, rows):
        if table in ("records", "judgements"):
            if written:
                raise _Killed
            written.append(table)
        original(self, table, rows)

    monkeypatch.setattr(RunStore, "_append_locked", append_then_die)
    with pytest.raises(_Killed):
        asyncio.run(judge_run(store, [TWO_TURNS], judge_on(app)))
    monkeypatch.setattr(RunStore, "_append_locked", original)
    resumed = RunStore.resume(tmp_path / "run")
    asyncio.run(judge_run(resumed, [TWO_TURNS], judge_on(app)))
    judged = [(r["path"], r["turn"], r["metric"]) for r in resumed.read("judgements")]
    recorded = [(r["path"], r["turn"], r["metric"]) for r in resumed.read("records") if r["metric"].startswith("judge_")]
    assert judged and sorted(judged) == sorted(recorded) and len(set(judged)) == len(judged)
