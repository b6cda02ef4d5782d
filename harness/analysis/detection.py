"""The detection matrix: which check families fail for each fault preset and each healthy path of a zoo run.

Input is verdict rows (`verdicts.jsonl`, one per model, scenario, path, turn, with `reasons`, each naming
its `metric` and the question it answers) and optionally the per-path rows (`path_verdicts.jsonl`); a reason of
severity `fail` counts for the family its metric belongs to and for its question. A fault is caught when any
family fails on any turn or in a per-path check; a healthy path is quiet when none does. Pure functions on
plain data.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# Check families, in the order the matrix shows them, and the metrics each one covers.
FAMILIES: dict[str, tuple[str, ...]] = {
    "free-running divergence": ("first_divergent_token", "exact_match", "common_prefix_frac",
                                "token_edit_distance"),
    "teacher-forced KL": ("kl_mean", "kl_max", "top1_agree", "ref_logprob_delta_mean", "ref_logprob_delta_min",
                          "ref_rank_mean", "ref_rank_max", "kl_p99", "kl_p999", "confident_flips",
                          "first_flip_topk_ok", "kl_ratio_yardstick", "kl_mean_ratio", "kl_p999_ratio"),
    "task checks": ("answer_correct", "rules_followed", "reply_tokens", "answer_correct_recovery",
                    "rules_followed_recovery", "length_ratio"),
    "rule judge": ("judge_rule",),
    "agreement judge": ("judge_agreement",),
    "LLM judge": ("judge_llm", "judge_llm_reference", "judge_pairwise"),
    "cache cast": ("kv_clipped_frac", "kv_nonfinite", "kv_amax_over_max", "kv_write_err_ratio"),
    "attention error": ("kernel_err_ratio", "kernel_max_abs_err", "attention_err", "attention_err_ratio",
                        "attn_impl_err_ratio"),
}
FAMILY_OF = {metric: family for family, metrics in FAMILIES.items() for metric in metrics}
# Verdict checks (harness/analysis/verdicts.py) whose reasons name no metric.
CHECK_FAMILY = {"degenerate": "rule judge", "task": "task checks", "divergence": "teacher-forced KL",
                "nonfinite": "cache cast", "recovery": "task checks", "length": "task checks"}
OTHER = "other"
EXPECTATIONS = ("fail", "pass", "measure")  # measure: a stress row, shown, never asserted


@dataclass(frozen=True, slots=True)
class MatrixEntry:
    """One row of the matrix: a (model, path) pair of the run and what it is there to show."""

    label: str  # e.g. "class 1: MLA latent, scale 1.0" or "healthy"
    model: str
    path: str
    expect: str  # "fail" (a fault: some family must fail) | "pass" (healthy: none may) | "measure" (stress)

    def __post_init__(self) -> None:
        if self.expect not in EXPECTATIONS:
            raise ValueError(f"MatrixEntry {self.label!r}: expect {self.expect!r}, not one of {EXPECTATIONS}")


@dataclass(frozen=True, slots=True)
class MatrixRow:
    entry: MatrixEntry
    turns: int  # verdict rows seen for this model and path
    failed_turns: int
    families: dict[str, int]  # family -> turns on which it failed (a failing per-path check counts once)
    questions: tuple[str, ...] = ()  # the verdict questions a fail answered ("implementation", "acceptable")
    path_failed: bool = False  # a per-path check (pooled divergence, recovery, degeneration rate) failed

    @property
    def caught(self) -> bool:
        return self.failed_turns > 0 or self.path_failed

    @property
    def ok(self) -> bool:
        """A fault caught, or a healthy path quiet (and, either way, measured at all)."""
        if self.turns == 0:
            return False
        if self.entry.expect == "measure":
            return True
        return self.caught if self.entry.expect == "fail" else not self.caught

    def as_dict(self) -> dict:
        return {"label": self.entry.label, "model": self.entry.model, "path": self.entry.path,
                "expect": self.entry.expect, "turns": self.turns, "failed_turns": self.failed_turns,
                "families": dict(self.families), "questions": list(self.questions), "path_failed": self.path_failed,
                "ok": self.ok}


def family_of(reason: Mapping) -> str:
    """The family of a verdict reason: by its metric, else by its check (a degeneration finding of the
    rule judge names no metric)."""
    return FAMILY_OF.get(str(reason.get("metric")), CHECK_FAMILY.get(str(reason.get("check")), OTHER))


def detection_matrix(verdict_rows: Iterable[Mapping], entries: Sequence[MatrixEntry],
                     path_rows: Iterable[Mapping] = ()) -> list[MatrixRow]:
    turns: dict[tuple, int] = defaultdict(int)
    failed: dict[tuple, int] = defaultdict(int)
    families: dict[tuple, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    questions: dict[tuple, set[str]] = defaultdict(set)
    for row in verdict_rows:
        key = (row["model"], row["path"])
        turns[key] += 1
        failing = [r for r in row.get("reasons") or [] if r.get("severity") == "fail"]
        if row.get("verdict") == "fail":
            failed[key] += 1
            for family in {family_of(r) for r in failing} or {OTHER}:
                families[key][family] += 1
            questions[key] |= {r.get("question") or "both" for r in failing}
    path_failed = set()
    for row in path_rows:
        key = (row["model"], row["path"])
        failing = [r for r in row.get("reasons") or [] if r.get("severity") == "fail"]
        if failing:
            path_failed.add(key)
            for family in {family_of(r) for r in failing}:
                families[key][family] += 1
            questions[key] |= {r.get("question") or "both" for r in failing}
    return [MatrixRow(e, turns[(e.model, e.path)], failed[(e.model, e.path)], dict(families[(e.model, e.path)]),
                      tuple(sorted(questions[(e.model, e.path)])), (e.model, e.path) in path_failed)
            for e in entries]


def matrix_families(rows: Sequence[MatrixRow]) -> list[str]:
    """The families to show: every known one, then any other that fired."""
    seen = {family for row in rows for family in row.families}
    return list(FAMILIES) + sorted(seen - set(FAMILIES))


def format_matrix(rows: Sequence[MatrixRow]) -> str:
    """Markdown: one row per entry, the number of failed turns per family, and whether it did its job."""
    families = matrix_families(rows)
    head = "| preset | model | path | " + " | ".join(families) + " | failed turns | question | result |"
    lines = [head, "|" + "---|" * (len(families) + 6)]
    for row in rows:
        cells = [str(row.families.get(f, "")) or "." for f in families]
        failed = f"{row.failed_turns}/{row.turns}" + (" + path" if row.path_failed else "")
        verdict = {"fail": "caught" if row.ok else "MISSED", "pass": "quiet" if row.ok else "FALSE ALARM",
                   "measure": "measured"}[row.entry.expect]
        if row.turns == 0:
            verdict = "NOT RUN"
        lines.append(f"| {row.entry.label} | {row.entry.model} | `{row.entry.path}` | " + " | ".join(cells)
                     + f" | {failed} | {', '.join(row.questions) or '.'} | {verdict} |")
    return "\n".join(lines)
