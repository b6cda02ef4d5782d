"""Stage 5, judges: score generated replies 1-5 from a run's stored texts.

May import: every earlier stage (types, records, scenarios, canary, kv_paths, analysis, replay).

- `rule_judge`: the scenario's answer and rules, plus degeneration (loops, early EOS, non-text).
- `agreement_judge`: closeness to the BF16 reference's reply.
- `LLMJudge`: a model behind any OpenAI-compatible endpoint (single, reference-guided, pairwise).
- `judge_texts` / `judge_run`: which turns each judge sees, and the rows stored in the run.
"""

from harness.judges.agreement import agreement_judge
from harness.judges.llm import Conversation, LLMJudge, conversation_for, parse_pairwise, parse_rating
from harness.judges.rules import DegenerationLimits, repetition_loop, rule_judge
from harness.judges.turns import SELECTIONS, JudgeConfig, judge_run, judge_texts, judgement_records
from harness.judges.verdict import JUDGE_METRIC_DIRECTIONS, Verdict, summarise

__all__ = ["JUDGE_METRIC_DIRECTIONS", "SELECTIONS", "Conversation", "DegenerationLimits", "JudgeConfig", "LLMJudge",
           "Verdict", "agreement_judge", "conversation_for", "judge_run", "judge_texts", "judgement_records",
           "parse_pairwise", "parse_rating", "repetition_loop", "rule_judge", "summarise"]
