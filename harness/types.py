"""Plain data every stage may import: chat messages, a generated reply, teacher-forced scores.

Nothing here imports from the rest of `harness`; see docs/ARCHITECTURE.md for which stage imports which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # system | user | assistant
    content: str


@dataclass(frozen=True, slots=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "length"
    tokens: list[str]  # one string per token id
    top_logprobs: list[dict[int, float]] | None = None  # per generated token, where available
    prompt_tokens: int | None = None  # length of the rendered prompt, where known
    metrics: dict[str, float] | None = None  # backend-specific per-call numbers (e.g. KV cast statistics)


@dataclass(frozen=True, slots=True)
class Scores:
    """Teacher-forced log-probabilities of a given continuation, one row per continuation token."""

    logprobs: torch.Tensor | None  # [T, V] full log-probs (in-process)
    top_logprobs: list[dict[int, float]] | None = None  # per position top-k (HTTP)
    unavailable: str | None = None  # why scoring could not be done
