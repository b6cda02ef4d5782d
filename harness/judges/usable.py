"""Whether an LLM judge gave the run anything: a judge whose every verdict failed or was unparsable
makes the run incomplete (`harness run` exits 3 with this message), never a silent pass."""

from __future__ import annotations

from collections import Counter

LLM_METRICS = ("judge_llm", "judge_llm_reference", "judge_pairwise")


def llm_judge_problem(store) -> str | None:
    """A message naming the judge when it was asked for verdicts and none is usable; else None."""
    judge = store.read_manifest().get("judge")
    rows = [r for r in store.read("judgements") if r.get("metric") in LLM_METRICS and r.get("status") != "skipped"]
    if not judge or not rows or any(r.get("status") == "ok" for r in rows):
        return None
    counts = Counter(str(r.get("status")) for r in rows)
    example = next((r.get("reason") for r in rows if r.get("reason")), "no reason given")
    return (f"LLM judge {judge.get('url')} (model {judge.get('model')!r}) produced no usable verdict: "
            f"{', '.join(f'{n} {status}' for status, n in sorted(counts.items()))} of {len(rows)}; "
            f"first reason: {str(example)[:300]}")
