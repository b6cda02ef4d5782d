"""A run's final status and `harness run`'s exit code (the contract: docs/CONTRACTS.md, "Exit codes and
run statuses").

A run is `complete` when every expected unit (model, scenario, path; the reference included) has its
done line, whatever failed on the way: errors.jsonl keeps every failed attempt across resumes, so it
says what went wrong, never what is still missing. Units still missing make it `complete_with_errors`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from harness.judges.usable import llm_judge_problem
from harness.runs.store import RunStore

EXIT_OK, EXIT_VERDICT_FAILED, EXIT_INPUT_REFUSED, EXIT_INCOMPLETE = 0, 1, 2, 3

Unit = tuple[str, str, str]  # (model, scenario, path)


def expected_units(models: Iterable[str], scenarios: Iterable[str], paths: Iterable[str]) -> list[Unit]:
    """Every unit a run owes: each model x scenario x (the reference and each candidate path)."""
    paths = ["reference", *paths]
    return [(m, s, p) for m in models for s in scenarios for p in paths]


def unfinished_units(store: RunStore, expected: Iterable[Unit]) -> list[Unit]:
    done = {(r["model"], r["scenario"], r["path"]) for r in store.read("done")}
    return [unit for unit in expected if unit not in done]


def final_status(unfinished: list[Unit]) -> str:
    return "complete" if not unfinished else "complete_with_errors"


def failed_verdicts(run_dir: Path) -> int:
    """(model, path) pairs with a failing turn (verdicts.jsonl) or a failing per-path check (path_verdicts.jsonl:
    pooled divergence, the yardstick's own check, paired recovery, degeneration rate; harness/analysis/verdicts.py);
    0 before verdicts exist. A path that fails only its per-path checks fails the run too (issue 40)."""
    store = RunStore(run_dir)
    return len({(row.get("model"), row.get("path")) for table in ("verdicts", "path_verdicts")
                for row in store.read(table) if row.get("verdict") == "fail"})


UNUSABLE_JUDGEMENT = ("unparsable", "failed")  # harness/judges/verdict.py STATUSES without a score


def unusable_judgements(run_dir: Path) -> int:
    """LLM-judge verdicts (judge_llm*, judge_pairwise) that gave no score: a degraded measurement, named in
    the run's summary; only a judge with no usable verdict at all makes the run incomplete."""
    return sum(1 for row in RunStore(run_dir).read("judgements")
               if str(row.get("metric", "")).startswith(("judge_llm", "judge_pairwise"))
               and row.get("status") in UNUSABLE_JUDGEMENT)


def run_exit_code(run_dir: Path, fail_on_verdict: bool = True) -> int:
    """3 when units are still missing (rerun with --resume) or an LLM judge was asked and gave no usable
    verdict at all (judges/usable.py), else 1 when a path's verdict failed (unless `fail_on_verdict` is off),
    else 0. Incomplete wins: a verdict over missing units is partial."""
    manifest = RunStore(run_dir).read_manifest()
    if manifest.get("status") != "complete" or llm_judge_problem(RunStore(run_dir)):
        return EXIT_INCOMPLETE
    if fail_on_verdict and failed_verdicts(run_dir):
        return EXIT_VERDICT_FAILED
    return EXIT_OK
