"""Deterministic filler text for long-context scenarios (and for the canaries' training corpus).

The same seed and length always give the same text, so a scenario file names its filler by
(seed, length) instead of carrying kilobytes of prose.
"""

from __future__ import annotations

import random

WORDS = (
    "the river runs past old stone walls while birds sing over quiet green fields and a small "
    "boat drifts near the bridge where children play in the warm light of late summer days "
    "farmers bring bread and apples to the market each morning and the baker sells fresh rolls "
    "to travellers who stop to rest beside the fountain in the square before the long road north"
).split()


def filler_text(n_chars: int, seed: int) -> str:
    """Sentences of common words, exactly `n_chars` long (cut at a word boundary, space-padded)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    length = 0
    while length < n_chars:
        words = rng.choices(WORDS, k=rng.randint(6, 12))
        sentence = " ".join(words).capitalize() + "."
        sentences.append(sentence)
        length += len(sentence) + 1
    text = " ".join(sentences)[:n_chars]
    return text.ljust(n_chars)


def insert_needle(filler: str, needle: str, depth: float) -> str:
    """Put `needle` at fraction `depth` (0 = start, 1 = end) of `filler`, at a sentence boundary.

    The filler is cut at a fixed length, so it usually ends inside a sentence (even inside a word): at
    depth 1.0 the needle goes after the last complete sentence and that fragment is dropped, so the needle
    never joins a truncated word ("While liThe meeting ...").
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], got {depth}")
    if depth == 1.0:
        end = filler.rstrip()
        last = end.rfind(".") + 1  # 0 when the filler holds no full sentence: the needle alone
        return f"{end[:last]} {needle}".strip()
    cut = int(len(filler) * depth)
    boundary = filler.rfind(". ", 0, cut)
    cut = 0 if boundary < 0 or depth == 0.0 else boundary + 2
    return f"{filler[:cut]}{needle} {filler[cut:]}".strip()
