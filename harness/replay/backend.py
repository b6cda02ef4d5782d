"""The backend interface: the in-process model and a live endpoint answer the same two calls."""

from __future__ import annotations

from typing import Protocol, Sequence

from harness.types import Generation, Message, Scores


class Backend(Protocol):
    label: str

    def describe(self) -> dict: ...

    async def generate(self, messages: Sequence[Message], max_new_tokens: int) -> Generation: ...

    async def score(self, messages: Sequence[Message], continuation_ids: Sequence[int]) -> Scores: ...

    async def aclose(self) -> None: ...
