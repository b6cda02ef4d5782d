"""The next-token candidates of the reference and a path where the path's reply first leaves the reference.

Both are teacher-forced on the same prefix (the reference's reply up to that token), so the two lists
show what the quantised cache changed in the distribution at the very token that flipped.
"""

from __future__ import annotations

import math

import torch

TOP_K = 5  # candidates listed per side


def top_candidates(logprobs: torch.Tensor | None, top: list[dict[int, float]] | None, position: int,
                   k: int = TOP_K) -> list[list[float]] | None:
    """[[token_id, logprob], ...] best first at `position`, from full log-probs ([T, V]) or an endpoint's
    top-k dicts; None when the position was not scored."""
    if logprobs is not None:
        if position >= logprobs.shape[0]:
            return None
        row = torch.log_softmax(logprobs[position].double(), dim=-1)
        values, ids = row.topk(min(k, row.numel()))
        return [[int(i), _number(v)] for i, v in zip(ids, values)]
    if top is not None and position < len(top) and top[position]:
        best = sorted(top[position].items(), key=lambda item: (-item[1], item[0]))[:k]
        return [[int(i), _number(v)] for i, v in best]
    return None


def candidates_at_divergence(reference_scores, path_scores, position: int | None) -> dict | None:
    """{"position", "reference", "path"} at the first divergent token; None when the replies agree or the
    position lies past what was scored (a path reply longer than the reference's)."""
    if position is None:
        return None
    reference = top_candidates(reference_scores.logprobs, reference_scores.top_logprobs, position)
    path = top_candidates(path_scores.logprobs, path_scores.top_logprobs, position)
    if reference is None or path is None:
        return None
    return {"position": position, "reference": reference, "path": path}


def _number(value) -> float | None:
    """A log-prob as stored: NaN/inf (a path whose cache produced them) become None, never invalid JSON."""
    value = float(value)
    return value if math.isfinite(value) else None
