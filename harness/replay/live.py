"""Setting up a run against live servers: which model and API key each endpoint uses, one pre-flight
check of every server before any unit starts, and what each server could not measure.

`harness run --reference URL --candidate [LABEL=]URL [--judge URL]` names the servers; per endpoint
`--reference-model`, `--candidate-model [LABEL=]NAME`, `--judge-model` name the served model (needed where
/v1/models does not list exactly one, e.g. `transformers serve`, which lists its whole HF cache) and
`--reference-api-key-env` etc. the variable holding its key (default: `--api-key-env`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.replay.endpoint import EndpointBackend, EndpointError, PreflightError, open_endpoint

ROLES = ("reference", "candidate", "judge")


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    label: str  # "reference", a candidate's label, or "judge"
    url: str
    model: str | None = None  # served model name; None: the one /v1/models lists
    api_key_env: str | None = None

    def __post_init__(self) -> None:
        if not self.label or not self.url:
            raise ValueError(f"EndpointSpec needs a label and a URL, got {self.label!r}, {self.url!r}")


def per_label(values: Sequence[str], labels: Sequence[str], option: str) -> dict[str, str]:
    """`NAME` (every label) or `LABEL=NAME` items -> {label: NAME}; an unknown label is refused."""
    chosen: dict[str, str] = {}
    for item in values:
        label, sep, name = item.partition("=")
        if not sep:
            chosen |= dict.fromkeys(labels, item)
        elif label not in labels:
            raise ValueError(f"{option} {item!r}: no candidate is labelled {label!r} (labels: {', '.join(labels)})")
        else:
            chosen[label] = name
    return chosen


def api_key_env_for(role: str, api_key_envs: Sequence[tuple[str, str]], default: str | None) -> str | None:
    return dict(api_key_envs).get(role, default)


async def preflight(backends: Sequence[EndpointBackend]) -> None:
    """Each server once, all at once: its model, one reply with token ids, one scoring (which detects
    the scoring form). Raises `PreflightError` naming every server that cannot serve the run."""
    results = await asyncio.gather(*(b.preflight() for b in backends), return_exceptions=True)
    problems = [str(r) for r in results if isinstance(r, PreflightError)]
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, PreflightError):
            raise result
    if problems:
        raise PreflightError("endpoint pre-flight failed:\n  " + "\n  ".join(problems))


async def judge_model(url: str, model: str | None, api_key_env: str | None, cache_dir: Path | None,
                      timeout_s: float = 120.0) -> str:
    """The judge's model: the one named, else the only one /v1/models lists (`PreflightError` if not)."""
    if model is not None:
        return model
    backend = open_endpoint(url, label="judge", api_key_env=api_key_env, cache_dir=cache_dir, retries=2,
                            timeout_s=timeout_s)
    try:
        return await backend.model()
    except EndpointError as error:
        raise PreflightError(f"endpoint pre-flight failed:\n  judge {backend.client.base_url}: {error}") from None
    finally:
        await backend.aclose()


def degraded(backends: Sequence[EndpointBackend]) -> list[str]:
    """One warning per metric a server could not give, with its reason."""
    return [line for b in backends for line in b.degraded()]


def with_earlier_capabilities(earlier: dict | None, described: dict) -> dict:
    """A backend's `describe()` keeping what an earlier session of the same run (`--resume`) found and
    this one did not: a `chat_reply_invalid` seen before the interruption still explains how the units
    scored then were scored. Where both sessions found something under one name, the newer stands."""
    if not isinstance(earlier, dict) or not isinstance(earlier.get("capabilities"), dict):
        return described
    merged = {**earlier["capabilities"], **described.get("capabilities", {})}
    return {**described, "capabilities": merged}


def candidate_labels(urls: tuple[str, ...]) -> list[tuple[str, str]]:
    """`LABEL=URL` or `URL` -> (label, url); unnamed candidates are `candidate`, `candidate-2`, ..."""
    pairs = []
    for i, item in enumerate(urls, start=1):
        label, sep, url = item.partition("=")
        if not sep or "://" in label:
            label, url = ("candidate" if len(urls) == 1 else f"candidate-{i}"), item
        pairs.append((label, url))
    labels = [label for label, _ in pairs]
    if len(set(labels)) != len(labels) or "reference" in labels:
        raise ValueError(f"--candidate labels must be unique and not 'reference', got {labels}")
    return pairs
