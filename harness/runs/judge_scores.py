"""The multi-turn judge-score table of a stored run: mean 1-5 score per model and path, per judge.

In the style of the GLM-4.7-Flash report (BF16 cache 4.61, FP8 cache 1.07 over 20 multi-turn scenarios):
one row per (model, path), the reference first, over every generated turn of the run's multi-turn scenarios
(more than one turn). The rule and agreement judges always ran; the LLM judge's column is filled when the run
had `--judge URL`. Reads the run directory only.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from harness.runs.read import RunView

JUDGE_METRICS = {"judge_rule": "rule judge", "judge_agreement": "agreement judge", "judge_llm": "LLM judge"}


def multi_turn_scenarios(texts: list[dict]) -> set[tuple[str, str]]:
    turns: dict[tuple[str, str], set[int]] = defaultdict(set)
    for row in texts:
        turns[(row["model"], row["scenario"])].add(int(row["turn"]))
    return {key for key, seen in turns.items() if len(seen) > 1}


def judge_score_rows(run_dir: Path | str, multi_turn_only: bool = True) -> list[dict]:
    """[{model, path, scenarios, turns, judge_rule, judge_agreement, judge_llm}] with means (None: not judged)."""
    run = RunView(run_dir)
    keep = multi_turn_scenarios(run.texts) if multi_turn_only else None
    scores: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    scenarios: dict[tuple[str, str], set[str]] = defaultdict(set)
    for row in run.records:
        if row["metric"] not in JUDGE_METRICS or row.get("value") is None:
            continue
        if keep is not None and (row["model"], row["scenario"]) not in keep:
            continue
        scores[(row["model"], row["path"])][row["metric"]].append(float(row["value"]))
        scenarios[(row["model"], row["path"])].add(row["scenario"])
    rows = []
    for (model, path), by_metric in scores.items():
        turns = max(len(values) for values in by_metric.values())
        rows.append({"model": model, "path": path, "scenarios": len(scenarios[(model, path)]), "turns": turns,
                     **{m: (sum(v) / len(v) if (v := by_metric.get(m)) else None) for m in JUDGE_METRICS}})
    return sorted(rows, key=lambda r: (r["model"], r["path"] != "reference", r["path"] != "bf16", r["path"]))


def format_judge_scores(rows: list[dict]) -> str:
    def cell(value) -> str:  # a judge that did not run (or gave no score) is not a 0
        return "—" if value is None else f"{value:.2f}"

    lines = ["| model | path | scenarios | turns | " + " | ".join(JUDGE_METRICS.values()) + " |",
             "|---|---|---:|---:|" + "---:|" * len(JUDGE_METRICS)]
    for r in rows:
        lines.append(f"| {r['model']} | `{r['path']}` | {r['scenarios']} | {r['turns']} | "
                     + " | ".join(cell(r[m]) for m in JUDGE_METRICS) + " |")
    return "\n".join(lines)
