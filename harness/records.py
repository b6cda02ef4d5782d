"""The record vocabulary every stage shares: metric names with the direction that is good, and how a
metric value is written to JSON (NaN and inf as text, since JSON has no such numbers).

Nothing here imports from the rest of `harness`.
"""

from __future__ import annotations

import math

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
    # what the FP8 cast did to the K/V written during the turn (in-process only)
    "kv_clipped_frac": "lower",          # fraction of values with |x / scale| > fp8 max
    "kv_nonfinite": "lower",             # NaN/inf values read back from the cache
    "kv_amax_over_max": "lower",         # largest |x / scale| / fp8 max; > 1 means the scale is too small
    # our decode kernel against an fp64 computation over the same cache (GPU runs)
    "kernel_max_abs_err": "lower",       # max |kernel - fp64| over the turn's decode steps and layers
    "kernel_err_ratio": "lower",         # that error / SDPA bf16's own error on the same inputs
    "kernel_steps": "none",              # decode attention calls that ran through the kernel
    "kernel_ms_per_step": "none",        # mean wall time of one decode-kernel call (device synchronised)
    # judges (harness/judges): 1-5 scores, pairwise 1 win / 0.5 tie / 0 loss
    "judge_rule": "higher",
    "judge_agreement": "higher",
    "judge_llm": "higher",
    "judge_llm_reference": "higher",
    "judge_pairwise": "higher",
    # context, not quality
    "context_tokens": "none",            # prompt length of the turn, for plots against context length
}


def encode_value(value) -> dict:
    """A metric value as JSON fields: finite floats as is; NaN/inf as null plus `value_text`."""
    if value is None:
        return {"value": None}
    value = float(value)
    if math.isfinite(value):
        return {"value": value}
    return {"value": None, "value_text": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
