"""The record vocabulary every stage shares: metric names with the direction that is good, and how a
metric value is written to JSON (NaN and inf as text, since JSON has no such numbers).

Nothing here imports from the rest of `harness`.
"""

from __future__ import annotations

import math
import re

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
    "kl_p99": "lower",                   # 99th / 99.9th percentile of the per-token KL (llama.cpp's stable figures;
    "kl_p999": "lower",                  # the max grows with the number of tokens)
    "kl_max_pos": "none",                # where kl_max sits in the reply (token index), and the reference there:
    "kl_max_ref_entropy": "none",        # its entropy (nats)
    "kl_max_ref_margin": "none",         # its top-1 minus top-2 log-prob (nats): near 0 means a near-tie
    "confident_flips": "lower",          # path argmax != reference argmax where the reference's margin > 1 nat
    "near_tie_flips": "none",            # the same where the margin <= 1 nat (coin tosses, not decisions)
    "first_flip_topk_ok": "higher",      # vLLM check_logprobs_close at the first flip: each argmax in the other's top-5
    "kl_ratio_yardstick": "lower",       # the turn's kl_mean / the yardstick path's (docs/VERDICTS.md), from verdicts
    "kl_mean_ratio": "lower",            # per path: pooled kl_mean / the yardstick's on the same turns (verdicts)
    "kl_p999_ratio": "lower",            # per path: pooled 99.9th percentile of per-token KL / the yardstick's
    "yardstick_twin_ratio": "lower",     # the yardstick: pooled kl_mean / its twin's (its format outside the engine)
    "length_ratio": "none",              # per path: generated tokens / the reference's (MLPerf band [0.9, 1.1])
    # task checks on the generated reply
    "answer_correct": "higher",          # expected answer present (arithmetic, recall, needle)
    "rules_followed": "higher",          # the scenario's rules (ending word, sentence count) kept
    "reply_tokens": "higher",            # length of the generated reply (early EOS shows here)
    # what the FP8 cast did to the K/V written during the turn (in-process only)
    "kv_clipped_frac": "lower",          # fraction of values with |x / scale| > fp8 max
    "kv_nonfinite": "lower",             # NaN/inf values read back from the cache
    "kv_amax_over_max": "lower",         # largest |x / scale| / fp8 max; > 1 means the scale is too small
    "kv_write_err_ratio": "lower",       # the write check: cache read-back RMS error / the format definition's
    # our decode kernel against an fp64 computation over the same cache (GPU runs)
    "kernel_max_abs_err": "lower",       # max |kernel - fp64| over the turn's decode steps and layers
    "kernel_err_ratio": "lower",         # that error / SDPA bf16's own error on the same inputs
    "kernel_steps": "none",              # decode attention calls that ran through the kernel
    "kernel_ms_per_step": "none",        # median wall time of one decode-kernel call (device synchronised)
    # the implementation check (harness/kv_paths/impl_check.py), every in-process path turn: the path's attention
    # output vs fp64 attention over the same K/V with its declared Q/P quantisation, / torch's own error (SDPA)
    "attn_impl_err_ratio": "lower",      # worst layer's pooled ratio; ~1 for a correct implementation
    "attn_impl_worst_layer": "none",     # that layer
    "attn_impl_worst_head": "none",      # its head with the largest ratio
    "attn_impl_rows": "none",            # (query row, head) pairs compared in the turn
    # attention-score error (harness/analysis/attention_error.py), in-process runs with --attention:
    # worst and mean over the sampled (layer, head, query position) rows of the turn
    "attn_max_abs_dp_max": "lower",      # max |p_path - p_ref| over an attention row
    "attn_max_abs_dp_mean": "lower",
    "attn_kl_max": "lower",              # KL(ref row || path row), nats
    "attn_kl_mean": "lower",
    "attn_topk_overlap_min": "higher",   # shared top-8 attended keys / 8
    "attn_topk_overlap_mean": "higher",
    "attn_out_rel_err_max": "lower",     # ||o_path - o_ref|| / ||o_ref|| of the attention output
    "attn_out_rel_err_mean": "lower",
    "attn_logit_err_max": "lower",       # max |logit error| / the row's logit spread
    "attn_logit_err_mean": "lower",
    "attn_worst_layer_err": "lower",     # mean attn_out_rel_err of the worst layer
    "attn_growth_per_1k": "lower",       # slope of attn_out_rel_err against query position, per 1000 tokens
    "attn_worst_layer": "none",          # layer index with the largest mean attn_out_rel_err
    "attn_worst_head": "none",           # head index (of attn_worst_head_layer) with the largest mean error
    "attn_worst_head_layer": "none",
    "attn_heads_sampled": "none",        # what the capture sampled (see attention.jsonl for which)
    "attn_rows_sampled": "none",
    "attn_kernel_out_rel_err_max": "lower",  # decode kernel's output vs the reference's (quantisation + kernel)
    "attn_kernel_out_rel_err_mean": "lower",
    "attn_kernel_vs_torch_max": "lower",     # decode kernel's output vs torch's over the same stored codes
    "attn_kernel_vs_torch_mean": "lower",
    "attn_kernel_lse_err_max": "lower",      # |kernel lse - torch logsumexp| over the same codes, nats
    "attn_kernel_rows": "none",              # rows the kernel ran on (attention.jsonl: attention = kernel:NAME)
    "attn_kernel_failed": "lower",           # 1: the kernel raised on the sampled rows (errors.jsonl says why)
    "kv_outlier_ratio_max": "none",      # max over layers of channel amax / median channel amax of K (MLA: latent)
    # self-consistency of a server (harness/analysis/self_consistency.py, `harness run --self-consistency`): the
    # logprobs it reported while decoding its reply vs its prefill of the same prompt + reply tokens
    "selfcons_kl_mean": "lower",         # KL(prefill || decode) per token over the listed top-k, nats
    "selfcons_kl_max": "lower",
    "selfcons_logprob_delta_mean": "lower",  # |decode - prefill| logprob of the decoded token, nats
    "selfcons_logprob_delta_max": "lower",   # the verdict input (docs/VERDICTS.md, "Self-consistency")
    "selfcons_flips": "lower",           # prefill argmax != decoded token where the prefill leads by > 1 nat
    "selfcons_near_tie_flips": "none",   # the same at near-ties
    "selfcons_tokens": "none",           # positions compared
    "selfcons_repeat_delta_max": "lower",  # two identical decodes (prefix-cache hit): max |logprob difference|
    "selfcons_repeat_diverged": "lower",   # 1.0 when the two decodes' tokens differ
    "selfcons_history_turns": "none",    # earlier turns in the prompt (multi-turn: > 0)
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


def encode_values(values) -> dict:
    """A series as JSON fields: `values` with null where an entry is NaN/inf, and `values_text`
    {index: "nan" | "inf" | "-inf"} for those entries (absent when every entry is finite or null)."""
    encoded = [encode_value(v) for v in values]
    text = {str(i): e["value_text"] for i, e in enumerate(encoded) if "value_text" in e}
    return {"values": [e["value"] for e in encoded], **({"values_text": text} if text else {})}


_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def decode_value(row: dict, field: str = "value") -> float | None:
    """The number `encode_value` stored in `row[field]` (with `row[field + "_text"]`), NaN/inf restored."""
    text = row.get(f"{field}_text")
    return _SPECIAL[text] if text in _SPECIAL else row.get(field)


def decode_values(row: dict) -> list:
    """The series `encode_values` stored in a row, NaN/inf restored."""
    values = list(row.get("values") or [])
    for index, text in (row.get("values_text") or {}).items():
        values[int(index)] = _SPECIAL.get(text, values[int(index)])
    return values


_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]+@")


def scrub_credentials(text: str) -> str:
    """`http://user:secret@host/...` -> `http://***@host/...` anywhere in `text`: what the harness writes
    (manifest `command`, errors, logs) never holds a credential someone put in a URL."""
    return _URL_CREDENTIALS.sub(r"\1***@", text)
