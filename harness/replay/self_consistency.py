"""The requests of a server's self-consistency check (`harness run --candidate URL --self-consistency`).

Per generated turn, three requests to the one server:
1. the decode: the turn's chat completion with per-token top-k logprobs (the reply the run already asked for);
2. the same decode again, past the run's response cache: on a server that caches prefixes, a prefix-cache hit,
   which must give the same logprobs (variant a);
3. the prefill replay: the chat prompt + the reply's tokens sent back as a prompt, scored by the server's
   teacher-forced form (vLLM's `prompt_logprobs`, or `echo` + `logprobs`), the same tokens' logprobs read back.
A later turn's prompt holds the earlier turns (variant b, multi-turn: `selfcons_history_turns` > 0); with no
reference the history is the server's own replies, so a server that caches the blocks it decoded serves that
history from its cache. The statistics are `harness.analysis.self_consistency`; what a server cannot give is a
named `unavailable` reason on the turn's records and in the manifest (the server's capabilities, its warnings).

Without `--reference`, `runner.SelfConsistencyReplay` replays each candidate alone (own history), stores its replies and
these measurements, and the verdicts judge the implementation question on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from harness.analysis.self_consistency import DECODE_VS_PREFILL, REPEAT, decode_vs_prefill, repeat_decode
from harness.types import Generation, Message


@dataclass(frozen=True, slots=True)
class SelfConsistency:
    """One turn's measurement: the values measured, and per metric group not measured, why."""

    values: dict[str, float | None]
    unavailable: dict[str, str] = field(default_factory=dict)  # metric -> reason

    def records(self) -> list[tuple[str, float | None, str | None]]:
        """(metric, value, unavailable reason) for every metric of the check, measured or not."""
        return ([(metric, value, None) for metric, value in self.values.items()]
                + [(metric, None, why) for metric, why in self.unavailable.items() if metric not in self.values])


def _label(backend) -> str:
    url = getattr(getattr(backend, "client", None), "base_url", None)
    return f"{backend.label} ({url})" if url else backend.label


def _note(backend, reason: str) -> str:
    """The reason, also kept as the server's `self_consistency` capability (the manifest and its warnings)."""
    capabilities = getattr(backend, "capabilities", None)
    if isinstance(capabilities, dict):
        capabilities.setdefault("self_consistency", reason)
    return reason


async def _measured(request, what: str, backend):
    """A request's result, or the reason it could not be had: a server that failed for now (retries spent, a
    dead connection) fails the unit for `--resume`; any other failure makes the measurement unavailable."""
    try:
        return await request, None
    except Exception as error:  # noqa: BLE001 - named, never a traceback
        if getattr(error, "retry_later", False):
            raise
        return None, f"unavailable: {what} to {_label(backend)} failed: {type(error).__name__}: {error}"


async def measure_turn(backend, messages: Sequence[Message], max_new_tokens: int,
                       decode: Generation) -> SelfConsistency:
    """The turn's self-consistency on `decode`, the server's reply to `messages` (already generated)."""
    values = {"selfcons_history_turns": float(sum(1 for m in messages if m.role == "assistant"))}
    if decode.top_logprobs is None:
        why = _note(backend, f"unavailable: {_label(backend)} gave no per-token logprobs by token id with its "
                             f"replies (chat_logprobs: {getattr(backend, 'capabilities', {}).get('chat_logprobs')})")
        return SelfConsistency(values, dict.fromkeys(DECODE_VS_PREFILL + REPEAT, why))
    unavailable: dict[str, str] = {}
    repeat, why = await _measured(backend.generate(messages, max_new_tokens, cache=False), "the repeated decode",
                                  backend)
    if repeat is not None and repeat.top_logprobs is not None:
        values |= repeat_decode(decode.token_ids, decode.top_logprobs, repeat.token_ids, repeat.top_logprobs)
    else:
        unavailable |= dict.fromkeys(REPEAT, why or f"unavailable: the repeated decode from {_label(backend)} "
                                                    f"carried no logprobs")
    prefill, why = await _measured(backend.score(messages, decode.token_ids), "the prefill replay", backend)
    if prefill is not None and prefill.top_logprobs is not None:
        values |= decode_vs_prefill(decode.top_logprobs, prefill.top_logprobs, decode.token_ids)
    else:
        why = why or f"unavailable: {_label(backend)}: {(prefill.unavailable or 'no prompt logprobs').removeprefix('unavailable: ')}"
        unavailable |= dict.fromkeys(DECODE_VS_PREFILL, _note(backend, why))
    return SelfConsistency(values, unavailable)
