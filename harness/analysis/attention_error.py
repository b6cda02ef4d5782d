"""Attention-score error: where (layer, head, query position) and why (which channels) a path's attention
departs from the reference's. Pure functions on tensors and plain rows; capture lives in
`harness.kv_paths.capture`, orchestration in `harness.replay.attention`.

Per attention row (one layer, head and query position; keys 0..pos are valid, later ones masked):
    attn_max_abs_dp    max_j |p_path[j] - p_ref[j]|
    attn_kl            sum_j p_ref[j] (log p_ref[j] - log p_path[j])   (KL(ref || path), nats; terms with
                       p_ref = 0 are 0; p_ref > 0 with p_path = 0 is +inf; rounding below 0 clamped to 0)
    attn_topk_overlap  |top-k(p_ref) & top-k(p_path)| / k with k = min(top_k, valid keys); ties go to the
                       lower key index
    attn_out_rel_err   ||o_path - o_ref|| / ||o_ref||   (0 when both are 0; +inf when only o_ref is)
    attn_logit_err     max_j |l_path[j] - l_ref[j]| / (max_j l_ref[j] - min_j l_ref[j])   (the logit error
                       relative to the row's spread; with one valid key the spread is 0 and the plain
                       max |dl| is used)
All in float64 whatever the inputs. A NaN anywhere in a path row makes every metric of that row its worst
value (inf, 1.0 for |dp|, 0 overlap).

Against key position, per row (`dp_by_key_position`):
    attn_dp_by_key_pos     [sum of |p_path[j] - p_ref[j]| over keys j in bucket b, for b = 0..bucket(pos)]
                           with buckets by absolute key position: [0], [1], [2, 3], [4, 7], ... (bucket(j) =
                           0 for j = 0, else floor(log2 j) + 1): where in the context the attention mass moved
                           (an attention sink at key 0, or the most recent keys of a long context).

A decode kernel exposes its output and its log-sum-exp, not its probabilities, so its rows (`attention` =
`kernel:<name>` in the tidy table) carry output metrics only (`kernel_errors`):
    attn_out_rel_err       ||o_kernel - o_ref|| / ||o_ref||: the path's total error through the kernel
                           (quantisation + the kernel's own)
    attn_kernel_vs_torch   ||o_kernel - o_torch|| / ||o_torch||, o_torch = torch's attention over the same
                           stored codes (the path's torch row): the kernel's own error, apart from the
                           quantisation error (which is the torch row's attn_out_rel_err). Both sides round
                           their output to bf16, so ~2^-8 relative is the floor of two correct computations.
    attn_kernel_lse_err    |lse_kernel - logsumexp(l_torch)| (nats): the kernel's softmax normaliser against
                           torch's fp32 one over the same codes (every probability it used is off by this
                           factor in log space); absent when the kernel returns no lse.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence

import torch

TOP_K = 8
ROW_METRICS = ("attn_max_abs_dp", "attn_kl", "attn_topk_overlap", "attn_out_rel_err", "attn_logit_err")
# Worst value of each row metric (a broken row).
WORST = {"attn_max_abs_dp": 1.0, "attn_kl": math.inf, "attn_topk_overlap": 0.0, "attn_out_rel_err": math.inf,
         "attn_logit_err": math.inf}
# Which direction of each row metric is bad (for "worst" and for aggregation).
HIGHER_IS_WORSE = {"attn_max_abs_dp": True, "attn_kl": True, "attn_topk_overlap": False, "attn_out_rel_err": True,
                   "attn_logit_err": True}
# The metric that names the worst layer and head of a turn: the output error is what flows on to later layers.
RANKING_METRIC = "attn_out_rel_err"


def row_errors(ref_logits: torch.Tensor, path_logits: torch.Tensor, ref_probs: torch.Tensor,
               path_probs: torch.Tensor, ref_out: torch.Tensor, path_out: torch.Tensor,
               valid: torch.Tensor, top_k: int = TOP_K) -> dict[str, torch.Tensor]:
    """Row metrics for N rows. logits/probs [N, L] (probs are what each side multiplied V with, e.g.
    FP8-rounded for a path that quantises them), out [N, Dv], valid [N, L] bool. Returns {metric: [N] float64}."""
    _check_shapes(ref_logits, path_logits, ref_probs, path_probs, ref_out, path_out, valid)
    lr, lp = ref_logits.double(), path_logits.double()
    pr = torch.where(valid, ref_probs.double(), 0.0)
    pp = torch.where(valid, path_probs.double(), 0.0)
    dp = (pp - pr).abs().amax(dim=-1)
    log_ratio = torch.log(pr) - torch.log(pp)
    kl = torch.where(pr > 0, pr * log_ratio, 0.0).sum(dim=-1).clamp_min(0.0)
    overlap = topk_overlap(pr, pp, valid, top_k)
    o_ref, o_path = ref_out.double(), path_out.double()
    out_err = _rel_err(o_path, o_ref)
    dl = torch.where(valid, (lp - lr).abs(), 0.0).amax(dim=-1)
    big, small = torch.where(valid, lr, -math.inf).amax(-1), torch.where(valid, lr, math.inf).amin(-1)
    spread = big - small
    logit_err = torch.where(spread > 0, dl / spread.clamp_min(1e-300), dl)
    result = {"attn_max_abs_dp": dp, "attn_kl": kl, "attn_topk_overlap": overlap, "attn_out_rel_err": out_err,
              "attn_logit_err": logit_err}
    broken = (torch.where(valid, pp, 0.0).isnan().any(-1) | torch.where(valid, lp, 0.0).isnan().any(-1)
              | o_path.isnan().any(-1))
    for name, worst in WORST.items():
        result[name] = result[name].masked_fill(broken, worst)
    return result


def topk_overlap(ref_probs: torch.Tensor, path_probs: torch.Tensor, valid: torch.Tensor, top_k: int) -> torch.Tensor:
    """|top-k(ref) & top-k(path)| / k per row, k = min(top_k, valid keys); ties to the lower key index."""
    n, length = ref_probs.shape
    keys = valid.sum(-1)
    k = keys.clamp(max=top_k).clamp_min(1)
    width = min(top_k, length)

    def top(p: torch.Tensor) -> torch.Tensor:
        # stable descending sort: equal probabilities keep index order, so ties go to the lower index
        masked = torch.where(valid, torch.nan_to_num(p, nan=-1.0), -math.inf)
        order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :width]
        chosen = torch.zeros(n, length, dtype=torch.bool, device=p.device)
        rank_ok = torch.arange(width, device=p.device).unsqueeze(0) < k.unsqueeze(1)
        chosen.scatter_(1, order, rank_ok)
        return chosen

    both = (top(ref_probs) & top(path_probs)).sum(-1).double()
    return both / k.double()


def _check_shapes(ref_logits, path_logits, ref_probs, path_probs, ref_out, path_out, valid) -> None:
    shape = tuple(ref_logits.shape)
    for name, x in (("path_logits", path_logits), ("ref_probs", ref_probs), ("path_probs", path_probs),
                    ("valid", valid)):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {shape} like ref_logits")
    if tuple(ref_out.shape) != tuple(path_out.shape) or ref_out.shape[0] != shape[0]:
        raise ValueError(f"ref_out {tuple(ref_out.shape)} and path_out {tuple(path_out.shape)} must both be "
                         f"[{shape[0]}, Dv]")


def key_buckets(length: int, device=None) -> torch.Tensor:
    """Bucket index of each key position 0..length-1: 0 for key 0, else floor(log2 j) + 1."""
    keys = torch.arange(length, device=device)
    return torch.where(keys == 0, 0, torch.floor(torch.log2(keys.clamp_min(1).double())).long() + 1)


def key_bucket_labels(count: int) -> list[str]:
    """Labels of the first `count` key-position buckets: "0", "1", "2-3", "4-7", ..."""
    return ["0", "1"][:count] + [f"{2 ** (b - 1)}-{2 ** b - 1}" for b in range(2, count)]


def dp_by_key_position(ref_probs: torch.Tensor, path_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N, buckets] L1 probability mass moved per key-position bucket (`key_buckets`), float64."""
    length = ref_probs.shape[-1]
    buckets = key_buckets(length, ref_probs.device)
    dp = torch.where(valid, (path_probs.double() - ref_probs.double()).abs(), 0.0)
    out = torch.zeros(dp.shape[0], int(buckets[-1]) + 1 if length else 0, dtype=torch.float64, device=dp.device)
    return out.index_add_(1, buckets, dp)


KERNEL_METRICS = ("attn_out_rel_err", "attn_kernel_vs_torch", "attn_kernel_lse_err")


def kernel_errors(ref_out: torch.Tensor, torch_out: torch.Tensor, kernel_out: torch.Tensor,
                  torch_logits: torch.Tensor, kernel_lse: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Kernel row metrics for N rows: outs [N, Dv], torch_logits [N, L] (masked keys -inf), kernel_lse [N]
    or None. Returns {metric: [N] float64} (no attn_kernel_lse_err without an lse). A NaN in the kernel's
    output or lse makes its metrics inf."""
    k = kernel_out.double()
    result = {"attn_out_rel_err": _rel_err(k, ref_out.double()), "attn_kernel_vs_torch": _rel_err(k, torch_out.double())}
    broken = k.isnan().any(-1)
    if kernel_lse is not None:
        result["attn_kernel_lse_err"] = (kernel_lse.double() - torch.logsumexp(torch_logits.double(), dim=-1)).abs()
        broken = broken | kernel_lse.isnan()
    return {name: values.masked_fill(broken, math.inf) for name, values in result.items()}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||a - b|| / ||b|| per row (0 when both are 0; +inf when only b is)."""
    num, den = (a - b).norm(dim=-1), b.norm(dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))


# ---------------------------------------------------------------- per-channel key/value statistics


def channel_stats(x: torch.Tensor) -> dict:
    """x [tokens, channels] -> per-channel amax, and the outlier ratio max(amax) / median(amax) that says
    how far one channel sticks out (a per-tensor scale sized for it leaves the rest few FP8 codes)."""
    return amax_stats(x.detach().float().abs().amax(dim=0))


def amax_stats(amax: torch.Tensor) -> dict:
    """`channel_stats` from the per-channel amax [channels]."""
    amax = amax.detach().float().cpu()
    median = float(amax.median()) if amax.numel() else 0.0
    top = float(amax.max()) if amax.numel() else 0.0
    ratio = top / median if median > 0 else (math.inf if top > 0 else 1.0)
    return {"amax": amax.tolist(), "outlier_ratio": ratio, "amax_max": top, "amax_median": median,
            "worst_channel": int(amax.argmax()) if amax.numel() else -1}


# ---------------------------------------------------------------- aggregation


def turn_summary(rows: Sequence[Mapping[str, object]]) -> dict[str, float | None]:
    """Per-turn aggregates of tidy rows (one per layer, head, query position, each with ROW_METRICS):
    worst and mean of each metric, and the worst layer and head by the mean RANKING_METRIC."""
    if not rows:
        return {}
    summary: dict[str, float | None] = {}
    for name in ROW_METRICS:
        values = [float(r[name]) for r in rows]
        worst = max(values) if HIGHER_IS_WORSE[name] else min(values)
        summary[f"{name}_{'max' if HIGHER_IS_WORSE[name] else 'min'}"] = worst
        summary[f"{name}_mean"] = _mean(values)
    by_layer = _group_mean(rows, ("layer",), RANKING_METRIC)
    by_head = _group_mean(rows, ("layer", "head"), RANKING_METRIC)
    worst_layer = max(by_layer, key=lambda key: (by_layer[key], -key[0]))
    worst_head = max(by_head, key=lambda key: (by_head[key], -key[0], -key[1]))
    summary["attn_worst_layer"] = float(worst_layer[0])
    summary["attn_worst_layer_err"] = by_layer[worst_layer]
    summary["attn_worst_head"] = float(worst_head[1])
    summary["attn_worst_head_layer"] = float(worst_head[0])
    return summary


def kernel_summary(rows: Sequence[Mapping[str, object]]) -> dict[str, float]:
    """Per-turn aggregates of a kernel's rows (`kernel_errors`): attn_kernel_out_rel_err_max|mean (against
    the reference), attn_kernel_vs_torch_max|mean, attn_kernel_lse_err_max and how many rows were measured."""
    if not rows:
        return {}
    summary: dict[str, float] = {"attn_kernel_rows": float(len(rows))}
    for name, key in (("attn_out_rel_err", "attn_kernel_out_rel_err"), ("attn_kernel_vs_torch", "attn_kernel_vs_torch")):
        values = [float(r[name]) for r in rows]
        summary[f"{key}_max"], summary[f"{key}_mean"] = max(values), _mean(values)
    lse = [float(r["attn_kernel_lse_err"]) for r in rows if r.get("attn_kernel_lse_err") is not None]
    if lse:
        summary["attn_kernel_lse_err_max"] = max(lse)
    return summary


def layer_profile(rows: Iterable[Mapping[str, object]], metric: str = RANKING_METRIC) -> dict[int, float]:
    """Mean of `metric` per layer."""
    return {key[0]: value for key, value in _group_mean(list(rows), ("layer",), metric).items()}


def growth_with_context(rows: Sequence[Mapping[str, object]], metric: str = RANKING_METRIC) -> float | None:
    """Least-squares slope of the per-position mean of `metric` against the query position, per 1000
    tokens (> 0: the error grows with context). None with fewer than two positions."""
    by_pos = _group_mean(rows, ("query_pos",), metric)
    points = [(k[0], v) for k, v in by_pos.items() if math.isfinite(v)]
    if len(points) < 2:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = _mean(xs), _mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return None if var == 0 else 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def _group_mean(rows: Sequence[Mapping[str, object]], keys: tuple[str, ...], metric: str) -> dict[tuple, float]:
    pick = operator.itemgetter(*keys, metric)  # one C call per row: a turn has thousands of rows
    groups: dict[tuple, list[float]] = {}
    for row in rows:
        *key, value = pick(row)
        groups.setdefault(tuple(key), []).append(value)
    return {tuple(int(k) for k in key): _mean([float(v) for v in values]) for key, values in groups.items()}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan
