"""Token-level divergence metrics: plain functions on token ids and log-probabilities."""

from __future__ import annotations

# Which way is good for each per-turn metric the harness records. Scenario thresholds, report
# colouring and the compare report's regression flags all read this one table.
METRIC_DIRECTIONS: dict[str, str] = {
    # free-running (the path's own greedy continuation against the reference's)
    "first_divergent_token": "higher",   # token index; null when the turn never diverged
    "exact_match": "higher",             # 1.0 when the whole reply matches token for token
    "common_prefix_frac": "higher",      # shared prefix length / reference length
    "token_edit_distance": "lower",      # Levenshtein distance in tokens
    # teacher-forced on the reference continuation
    "kl_mean": "lower",                  # KL(reference || path) per token, nats
    "kl_max": "lower",
    "top1_agree": "higher",              # fraction of positions where the path's argmax is the reference token
    "ref_logprob_delta_mean": "higher",  # path logprob - reference logprob of the reference token (<= 0 is worse)
    "ref_logprob_delta_min": "higher",
    "ref_rank_mean": "lower",            # rank of the reference token under the path (0 = top)
    "ref_rank_max": "lower",
    # task checks on the generated reply
    "answer_correct": "higher",          # expected answer present (arithmetic, recall, needle)
    "rules_followed": "higher",          # the scenario's rules (ending word, sentence count) kept
    "reply_tokens": "higher",            # length of the generated reply (early EOS shows here)
}
