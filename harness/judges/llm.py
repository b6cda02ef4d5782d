"""LLM judge through any OpenAI-compatible endpoint: single-answer 1-5, reference-guided 1-5, and
pairwise reference-vs-candidate in both orders.

Prompts are the jinja2 templates in `templates/`. Replies are parsed strictly: exactly one
`[[...]]` in the reply, holding an integer 1-5 (ratings) or A, B or C (pairwise). Anything else, or
a request that failed, is recorded with status "unparsable" or "failed" and no score. The judge
model, the template's and the prompt's sha256 and every raw reply go into the verdict. Requests go
through `RequestClient`, so they are retried, bounded and cached on disk like any other.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

from harness.judges.verdict import SCORE_RANGE, Verdict
from harness.replay.endpoint import EndpointError, RequestClient, RequestPolicy
from harness.types import Message

TEMPLATES = Path(__file__).parent / "templates"
BRACKETED = re.compile(r"\[\[(.*?)\]\]", re.DOTALL)
PAIRWISE_WINNER = {"A": "A", "B": "B", "C": "tie"}
PAIRWISE_SCORE = {"candidate": 1.0, "tie": 0.5, "reference": 0.0}  # from the candidate's side


@dataclass(frozen=True, slots=True)
class Parsed:
    value: str | int | None  # the rating, or "A" | "B" | "tie"; None when unparsable
    problem: str | None = None


def parse_rating(reply: str, low: int = SCORE_RANGE[0], high: int = SCORE_RANGE[1]) -> Parsed:
    """The single `[[N]]` of a reply, N an integer in low..high."""
    found = BRACKETED.findall(reply)
    if len(found) != 1:
        return Parsed(None, "no [[N]] rating in the reply" if not found else
                      f"{len(found)} bracketed values {found[:4]} where exactly one rating is allowed")
    text = found[0].strip()
    if not re.fullmatch(r"[+-]?\d+", text):
        return Parsed(None, f"rating [[{text}]] is not an integer")
    if not low <= int(text) <= high:
        return Parsed(None, f"rating {int(text)} is out of range {low}..{high}")
    return Parsed(int(text))


def parse_pairwise(reply: str) -> Parsed:
    """The single `[[A]]`, `[[B]]` or `[[C]]` (tie) of a reply."""
    found = BRACKETED.findall(reply)
    if len(found) != 1:
        return Parsed(None, "no [[A]]/[[B]]/[[C]] verdict in the reply" if not found else
                      f"{len(found)} bracketed values {found[:4]} where exactly one verdict is allowed")
    text = found[0].strip()
    if text not in PAIRWISE_WINNER:
        return Parsed(None, f"verdict [[{text}]] is not A, B or C")
    return Parsed(PAIRWISE_WINNER[text])


@dataclass(frozen=True, slots=True)
class Conversation:
    """What the judged reply answers: the system prompt and the turns up to the user's last message."""

    system: str | None
    history: tuple[Message, ...]

    def __post_init__(self) -> None:
        if not self.history or self.history[-1].role != "user":
            raise ValueError("Conversation.history must end with the user message that the judged reply answers")


@lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              autoescape=False, keep_trailing_newline=False)


@lru_cache(maxsize=None)
def template_sha256(name: str) -> str:
    """sha256 over the template and the templates it includes (all of `templates/`, sorted)."""
    digest = hashlib.sha256()
    for file in sorted(TEMPLATES.glob("*.j2")):
        if file.name in (name, "system.j2") or file.name.startswith("_"):
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def render(name: str, conversation: Conversation, **fields: str) -> list[dict]:
    """The judge's chat messages for template `name`."""
    env = _environment()
    history = [{"role": m.role, "content": m.content} for m in conversation.history]
    user = env.get_template(name).render(system=conversation.system, history=history, **fields)
    return [{"role": "system", "content": env.get_template("system.j2").render().strip()},
            {"role": "user", "content": user}]


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class LLMJudge:
    """Grades replies with a model behind an OpenAI-compatible endpoint, temperature 0, fixed seed."""

    def __init__(self, url: str, *, model: str | None = None, api_key_env: str | None = None,
                 cache_dir: str | Path | None = None, policy: RequestPolicy = RequestPolicy(), seed: int = 0,
                 max_tokens: int = 1024, client: RequestClient | None = None):
        self.client = client or RequestClient(url, policy=policy, api_key_env=api_key_env, cache_dir=cache_dir)
        self.model, self.seed, self.max_tokens = model, seed, max_tokens

    def describe(self) -> dict:
        return {"url": self.client.base_url, "model": self.model, "seed": self.seed, "max_tokens": self.max_tokens,
                "templates": {name: template_sha256(name) for name in ("single.j2", "reference.j2", "pairwise.j2")}}

    async def aclose(self) -> None:
        await self.client.aclose()

    async def single(self, conversation: Conversation, answer: str) -> Verdict:
        """Single-answer grading, 1-5."""
        return await self._rated("judge_llm", "single.j2", render("single.j2", conversation, answer=answer))

    async def reference_guided(self, conversation: Conversation, answer: str, reference: str) -> Verdict:
        """Grading against a known-correct reference answer (arithmetic), 1-5."""
        messages = render("reference.j2", conversation, answer=answer, reference=reference)
        return await self._rated("judge_llm_reference", "reference.j2", messages)

    async def pairwise(self, conversation: Conversation, reference: str, candidate: str) -> Verdict:
        """Reference vs candidate, asked in both orders; orders that disagree make a tie.
        Score from the candidate's side: 1 win, 0.5 tie, 0 loss."""
        orders = [render("pairwise.j2", conversation, answer_a=reference, answer_b=candidate),
                  render("pairwise.j2", conversation, answer_a=candidate, answer_b=reference)]
        common = dict(template_sha256=template_sha256("pairwise.j2"), prompt_sha256=_sha256(orders))
        replies = []
        for messages in orders:
            reply = await self._ask(messages)
            if isinstance(reply, EndpointError):
                return Verdict("judge_pairwise", "failed", None, f"judge request failed: {reply}",
                               judge_model=self.model, raw_replies=tuple(replies), **common)
            replies.append(reply)
        parsed = [parse_pairwise(reply) for reply in replies]
        for order, result in zip(("reference first", "candidate first"), parsed):
            if result.problem:
                return Verdict("judge_pairwise", "unparsable", None, f"{order}: {result.problem}",
                               judge_model=self.model, raw_replies=tuple(replies), **common)
        winners = [{"A": "reference", "B": "candidate"}.get(parsed[0].value, "tie"),
                   {"A": "candidate", "B": "reference"}.get(parsed[1].value, "tie")]
        winner = winners[0] if winners[0] == winners[1] else "tie"
        reason = (f"both orders: {winner}" if winners[0] == winners[1]
                  else f"orders disagree ({winners[0]} with the reference first, {winners[1]} with it second): tie")
        return Verdict("judge_pairwise", "ok", PAIRWISE_SCORE[winner], reason, judge_model=self.model,
                       raw_replies=tuple(replies), detail={"winner": winner, "by_order": winners}, **common)

    async def _rated(self, metric: str, template: str, messages: list[dict]) -> Verdict:
        common = dict(template_sha256=template_sha256(template), prompt_sha256=_sha256(messages))
        reply = await self._ask(messages)
        if isinstance(reply, EndpointError):
            return Verdict(metric, "failed", None, f"judge request failed: {reply}", judge_model=self.model, **common)
        parsed = parse_rating(reply)
        if parsed.problem:
            return Verdict(metric, "unparsable", None, parsed.problem, judge_model=self.model,
                           raw_replies=(reply,), **common)
        return Verdict(metric, "ok", float(parsed.value), _explanation(reply), judge_model=self.model,
                       raw_replies=(reply,), **common)

    async def _ask(self, messages: list[dict]) -> str | EndpointError:
        """The judge's reply text, or the error that stopped it (a reply with no text is an error too)."""
        try:
            if self.model is None:
                listed = (await self.client.get("/v1/models")).get("data") or []
                if not listed:
                    return EndpointError(f"{self.client.base_url}/v1/models", ["no judge model listed"])
                self.model = str(listed[0]["id"])
            body = {"model": self.model, "messages": messages, "temperature": 0.0, "seed": self.seed,
                    "max_tokens": self.max_tokens}
            reply = await self.client.post("/v1/chat/completions", body)
        except EndpointError as error:
            return error
        choices = reply.get("choices") or [{}]
        content = (choices[0].get("message") or {}).get("content") if isinstance(choices[0], dict) else None
        if not isinstance(content, str):
            return EndpointError(f"{self.client.base_url}/v1/chat/completions",
                                 [f"judge reply has no text content: {json.dumps(reply)[:200]}"])
        return content


def _explanation(reply: str, limit: int = 500) -> str:
    text = " ".join(BRACKETED.sub("", reply).replace("Rating:", "").split())
    return text if len(text) <= limit else text[:limit] + "..."


def conversation_for(system: str | None, turns: Sequence[tuple[str, str]], user: str) -> Conversation:
    """A Conversation from earlier (user, assistant) pairs and the last user message."""
    history = [m for u, a in turns for m in (Message("user", u), Message("assistant", a))]
    return Conversation(system, tuple(history + [Message("user", user)]))
