"""Attention-score error: the metrics on hand-computed rows, capture on real (tiny and canary) models,
isolated vs end-to-end, scale-file export for vLLM/SGLang and the :checkpoint round trip."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.analysis import attention_error as ae
from harness.kv_paths import calibration
from harness.kv_paths.capture import CaptureSample, spread
from harness.kv_paths.spec import parse_path
from harness.replay.attention import AttentionOptions, measure_turn
from harness.replay.inprocess import InProcessModel
from harness.types import Message


def _rows(ref_logits, path_logits, ref_out=((1.0, 0.0),), path_out=((1.0, 0.0),), top_k=2):
    lr, lp = torch.tensor(ref_logits, dtype=torch.float64), torch.tensor(path_logits, dtype=torch.float64)
    valid = lr > -math.inf
    return ae.row_errors(lr, lp, torch.softmax(lr, -1), torch.softmax(lp, -1), torch.tensor(ref_out),
                         torch.tensor(path_out), valid, top_k)


# ---------------------------------------------------------------- metrics, by hand


def test_row_metrics_hand_computed():
    # ref logits [0, ln 3] -> p = [1/4, 3/4]; path [0, 0] -> q = [1/2, 1/2]
    m = _rows([[0.0, math.log(3.0)]], [[0.0, 0.0]], ref_out=[[3.0, 4.0]], path_out=[[3.0, 5.0]])
    assert m["attn_max_abs_dp"].item() == pytest.approx(0.25, abs=1e-15)
    kl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert m["attn_kl"].item() == pytest.approx(kl, rel=1e-12)
    assert m["attn_out_rel_err"].item() == pytest.approx(1.0 / 5.0, rel=1e-15)  # |(0,1)| / |(3,4)|
    assert m["attn_logit_err"].item() == pytest.approx(1.0, rel=1e-12)  # |dl| = ln 3, spread = ln 3
    assert m["attn_topk_overlap"].item() == 1.0  # k = 2 of 2 keys: both sets are everything


def test_topk_overlap_and_masking_by_hand():
    # 4 keys, the last masked (causal). ref top-2 = {2, 1}; path top-2 = {0, 2}: overlap 1 of 2.
    ref = [[0.0, 1.0, 2.0, -math.inf]]
    path = [[3.0, 1.0, 2.0, -math.inf]]
    m = _rows(ref, path, top_k=2)
    assert m["attn_topk_overlap"].item() == 0.5
    # k is capped by the valid keys: one valid key, top_k=8 -> k=1, and the lone key always overlaps
    one = _rows([[0.5, -math.inf]], [[9.0, -math.inf]], top_k=8)
    assert one["attn_topk_overlap"].item() == 1.0
    assert one["attn_max_abs_dp"].item() == 0.0 and one["attn_kl"].item() == 0.0
    assert one["attn_logit_err"].item() == pytest.approx(8.5)  # spread 0: the plain |dl|


def test_topk_ties_go_to_lower_index():
    # all equal: top-1 is key 0 on both sides even though the path row is a permutation-invariant tie
    m = _rows([[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]], top_k=1)
    assert m["attn_topk_overlap"].item() == 1.0


def test_identical_rows_are_exactly_zero_and_broken_rows_are_worst():
    m = _rows([[0.1, 0.7, -0.3]], [[0.1, 0.7, -0.3]], ref_out=[[1.0, 2.0]], path_out=[[1.0, 2.0]], top_k=8)
    assert all(m[k].item() == 0.0 for k in ("attn_max_abs_dp", "attn_kl", "attn_out_rel_err", "attn_logit_err"))
    assert m["attn_topk_overlap"].item() == 1.0
    broken = _rows([[0.0, 1.0]], [[0.0, float("nan")]])
    assert broken["attn_kl"].item() == math.inf and broken["attn_max_abs_dp"].item() == 1.0
    assert broken["attn_topk_overlap"].item() == 0.0


def test_kl_is_inf_when_path_drops_attended_mass():
    lr = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    valid = torch.ones(1, 2, dtype=torch.bool)
    q = torch.tensor([[1.0, 0.0]], dtype=torch.float64)  # e.g. FP8-rounded probabilities flushed to 0
    m = ae.row_errors(lr, lr, torch.softmax(lr, -1), q, torch.ones(1, 1), torch.ones(1, 1), valid)
    assert m["attn_kl"].item() == math.inf and m["attn_max_abs_dp"].item() == 0.5


def test_channel_stats_outlier_ratio():
    x = torch.tensor([[1.0, -2.0, 10.0], [0.5, 1.0, -3.0]])  # amax [1, 2, 10], median 2
    stats = ae.channel_stats(x)
    assert stats["amax"] == [1.0, 2.0, 10.0] and stats["outlier_ratio"] == 5.0 and stats["worst_channel"] == 2


def test_turn_summary_names_worst_layer_and_head():
    rows = [{"layer": l, "head": h, "query_pos": p, **dict.fromkeys(ae.ROW_METRICS, 0.0),
             "attn_out_rel_err": 0.5 if (l, h) == (1, 3) else 0.01, "attn_topk_overlap": 1.0}
            for l in (0, 1) for h in (0, 3) for p in (10, 20)]
    s = ae.turn_summary(rows)
    assert (s["attn_worst_layer"], s["attn_worst_head"], s["attn_worst_head_layer"]) == (1.0, 3.0, 1.0)
    assert s["attn_out_rel_err_max"] == 0.5 and s["attn_topk_overlap_min"] == 1.0
    growing = [{"layer": 0, "head": 0, "query_pos": p, "attn_out_rel_err": p / 1000} for p in (0, 500, 1000)]
    assert ae.growth_with_context(growing) == pytest.approx(1.0)


def test_mass_moved_by_key_position_by_hand():
    # 6 keys: buckets [0], [1], [2, 3], [4, 5]; the last key masked. ref p = (.5, .1, .1, .1, .2, 0);
    # path p = (.3, .1, .2, .1, .3, 0): |dp| = (.2, 0, .1, 0, .1) -> buckets (.2, 0, .1, .1)
    assert ae.key_buckets(9).tolist() == [0, 1, 2, 2, 3, 3, 3, 3, 4]
    assert ae.key_bucket_labels(5) == ["0", "1", "2-3", "4-7", "8-15"]
    ref = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2, 0.0]], dtype=torch.float64)
    path = torch.tensor([[0.3, 0.1, 0.2, 0.1, 0.3, 0.7]], dtype=torch.float64)
    valid = torch.tensor([[True] * 5 + [False]])
    moved = ae.dp_by_key_position(ref, path, valid)
    assert moved.tolist()[0] == pytest.approx([0.2, 0.0, 0.1, 0.1], abs=1e-15)


def test_kernel_metrics_hand_computed():
    # o_ref (3, 4), o_torch (3, 4.5), o_kernel (3, 5): |(0,1)|/|(3,4)| = 0.2 against the reference,
    # |(0,0.5)|/|(3,4.5)| against torch; lse: logsumexp(0, ln 3) = ln 4, the kernel says ln 4 + 0.25
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf]], dtype=torch.float64)
    m = ae.kernel_errors(torch.tensor([[3.0, 4.0]]), torch.tensor([[3.0, 4.5]]), torch.tensor([[3.0, 5.0]]),
                         logits, torch.tensor([math.log(4.0) + 0.25]))
    assert m["attn_out_rel_err"].item() == pytest.approx(0.2, rel=1e-15)
    assert m["attn_kernel_vs_torch"].item() == pytest.approx(0.5 / math.hypot(3.0, 4.5), rel=1e-12)
    assert m["attn_kernel_lse_err"].item() == pytest.approx(0.25, rel=1e-6)  # the lse was given in fp32
    no_lse = ae.kernel_errors(torch.ones(1, 2), torch.ones(1, 2), torch.ones(1, 2), logits, None)
    assert set(no_lse) == {"attn_out_rel_err", "attn_kernel_vs_torch"} and no_lse["attn_kernel_vs_torch"].item() == 0.0
    broken = ae.kernel_errors(torch.ones(1, 2), torch.ones(1, 2), torch.tensor([[1.0, float("nan")]]), logits, None)
    assert broken["attn_out_rel_err"].item() == math.inf and broken["attn_kernel_vs_torch"].item() == math.inf
    rows = [{"layer": 0, "attn_out_rel_err": e, "attn_kernel_vs_torch": v, "attn_kernel_lse_err": l}
            for e, v, l in ((0.1, 0.01, 0.002), (0.3, 0.02, 0.001))]
    s = ae.kernel_summary(rows)
    assert s == {"attn_kernel_rows": 2.0, "attn_kernel_out_rel_err_max": 0.3,
                 "attn_kernel_out_rel_err_mean": pytest.approx(0.2), "attn_kernel_vs_torch_max": 0.02,
                 "attn_kernel_vs_torch_mean": pytest.approx(0.015), "attn_kernel_lse_err_max": 0.002}
    assert ae.kernel_summary([]) == {}


def test_sample_spread():
    assert spread(5, 8) == [0, 1, 2, 3, 4]
    assert spread(10, 3) == [0, 4, 9] or spread(10, 3) == [0, 5, 9]
    assert CaptureSample(2, 3).positions(100, 109)[0] == 100 and CaptureSample(2, 3).positions(100, 109)[-1] == 109
    with pytest.raises(ValueError):
        CaptureSample(0, 4)


# ---------------------------------------------------------------- capture on models


def _turn(model: InProcessModel, spec: str, mode: str, scales=None, text="Hello there, what is 7 * 8? " * 4,
          kernel=None):
    prompt = model.encode_chat([Message("user", text)])
    continuation = [5 + (i * 7) % 60 for i in range(12)]  # any fixed token ids: teacher-forced
    path = parse_path(spec)
    return measure_turn(model.model, model.device, path, scales if scales is not None else model.scales_for(path),
                        prompt, continuation, AttentionOptions(mode=mode, sample=CaptureSample(4, 6)), kernel=kernel)


def _split(turn):
    torch_rows = [r for r in turn.rows if r["attention"] == "torch"]
    return torch_rows, [r for r in turn.rows if r["attention"] != "torch"]


def _where(rows):
    return [(r["layer"], r["head"], r["query_pos"]) for r in rows]


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
def test_bf16_path_shows_exactly_zero_attention_error(tiny_models, arch):
    model = InProcessModel.load(tiny_models[arch])
    for mode in ("isolated", "end-to-end"):
        turn = _turn(model, "bf16", mode)
        assert turn.rows, "nothing captured"
        for name in ("attn_max_abs_dp", "attn_kl", "attn_out_rel_err", "attn_logit_err"):
            assert max(r[name] for r in turn.rows) == 0.0, (arch, mode, name)
        assert all(set(r["attn_dp_by_key_pos"]) == {0.0} for r in turn.rows)
        assert min(r["attn_topk_overlap"] for r in turn.rows) == 1.0


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
def test_fp8_path_shows_nonzero_error_and_what_was_sampled(tiny_models, arch):
    model = InProcessModel.load(tiny_models[arch])
    turn = _turn(model, "fp8_e4m3:per_head:calibrated", "isolated")
    assert max(r["attn_out_rel_err"] for r in turn.rows) > 0
    for r in turn.rows:  # one bucket per key-position octave up to the query's own position; they sum to the L1
        assert len(r["attn_dp_by_key_pos"]) == r["query_pos"].bit_length() + 1
        assert max(r["attn_dp_by_key_pos"]) <= 2 * r["attn_max_abs_dp"] * r["context"] + 1e-12
    assert turn.summary["attn_heads_sampled"] == 4.0 and turn.summary["attn_rows_sampled"] == 6.0
    layers = {r["layer"] for r in turn.rows}
    assert layers == set(turn.sampled["layers"])
    if arch == "hybrid":  # only the full-attention layers call the attention function
        assert layers == {i for i, t in enumerate(model.model.config.layer_types) if t == "full_attention"}
    names = {c["tensor"] for c in turn.channels}
    assert names == ({"latent", "k_pe"} if arch == "mla" else {"k", "v"})


def test_isolated_error_of_a_layer_does_not_depend_on_earlier_layers(tiny_models):
    """Break layer 0's K scale (/20: clips): in isolated mode layer 1's rows are bit-identical; end-to-end they move."""
    model = InProcessModel.load(tiny_models["gqa"])
    path = parse_path("fp8_e4m3:per_tensor:calibrated")
    good = model.scales_for(path)
    bad_k = dict(good.k)
    bad_k[0] = good.k[0] / 20
    bad = type(good)(k=bad_k, v=dict(good.v), source=good.source)
    for mode, same in (("isolated", True), ("end-to-end", False)):
        a = _turn(model, path.name, mode, good)
        b = _turn(model, path.name, mode, bad)
        layer0 = [r["attn_out_rel_err"] for r in a.rows if r["layer"] == 0]
        layer0_bad = [r["attn_out_rel_err"] for r in b.rows if r["layer"] == 0]
        assert layer0 != layer0_bad  # the broken layer itself always shows it
        layer1 = [r for r in a.rows if r["layer"] == 1]
        layer1_bad = [r for r in b.rows if r["layer"] == 1]
        assert (layer1 == layer1_bad) is same, mode


# ---------------------------------------------------------------- the decode-kernel path


def forgets_v_scale(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sm_scale):
    """A plausible kernel bug: V read as raw codes (its scale never applied)."""
    from kernels.reference import decode_attention

    return decode_attention(q, k_cache, v_cache, block_table, seq_lens, k_scale, torch.ones_like(v_scale), sm_scale)


def one_sequence_only(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sm_scale):
    """A plug-in written for the one-sequence decode the harness runs: it refuses a batch."""
    from kernels.reference import decode_attention

    assert q.shape[0] == 1, f"this kernel decodes one sequence, got a batch of {q.shape[0]}"
    return decode_attention(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sm_scale)


# Bounds for a correct kernel against torch over the same stored codes. Both outputs are rounded to bf16
# (2^-9 relative each) and torch reads K/V dequantised to bf16 (2^-9 relative per element): measured on these
# tiny models, the reference kernel is within 4.6e-3 of torch (lse within 1.5e-3 nats); 1e-2 leaves 2x.
KERNEL_VS_TORCH_MAX = 1e-2
KERNEL_LSE_MAX = 1e-2


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
def test_kernel_rows_run_beside_torch_on_the_same_codes(tiny_models, arch):
    """The `reference` decode kernel (the plug-in contract, on CPU) on the sampled rows: every torch row gets
    a kernel row, the torch rows are bit-identical to a capture without the kernel (it never enters the
    model's flow), the kernel agrees with torch over the same codes to bf16 rounding, and its error against
    the reference is the path's quantisation error (same size as torch's)."""
    model = InProcessModel.load(tiny_models[arch])
    spec = "fp8_e4m3:per_head:calibrated"
    plain = _turn(model, spec, "isolated")
    turn = _turn(model, spec, "isolated", kernel="reference")
    torch_rows, kernel_rows = _split(turn)
    assert torch_rows == plain.rows and turn.sampled["kernel"] == "kernel:reference"
    assert _where(kernel_rows) == _where(torch_rows) and {r["attention"] for r in kernel_rows} == {"kernel:reference"}
    s = turn.summary
    assert 0 < s["attn_kernel_vs_torch_max"] < KERNEL_VS_TORCH_MAX and s["attn_kernel_lse_err_max"] < KERNEL_LSE_MAX
    assert 0.5 < s["attn_kernel_out_rel_err_mean"] / s["attn_out_rel_err_mean"] < 2.0
    assert s["attn_kernel_rows"] == len(kernel_rows)


def test_compare_in_small_batches_gives_the_same_rows(tiny_models, monkeypatch):
    """Rows are compared in batches bounded by COMPARE_ELEMENTS (memory); the batch size never changes a row."""
    from harness.replay import attention

    model = InProcessModel.load(tiny_models["gqa"])
    whole = _turn(model, "fp8_e4m3:calibrated", "isolated", kernel="reference")
    monkeypatch.setattr(attention, "COMPARE_ELEMENTS", 1)  # one layer call per batch
    assert _turn(model, "fp8_e4m3:calibrated", "isolated", kernel="reference").rows == whole.rows


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc.get_objects() touches a deprecated torch alias
def test_kernel_capture_leaves_no_cache_behind(tiny_models):
    """Without the cyclic GC, every cache layer of a kernel capture is freed when it returns (a reference
    cycle kept each turn's caches and paged copy alive: on the GPU, +4.5 GiB over 3 turns at 8k context)."""
    import gc

    from harness.kv_paths.cache import QuantizedKVLayer

    model = InProcessModel.load(tiny_models["gqa"])
    gc.collect()
    gc.disable()
    try:
        _turn(model, "fp8_e4m3:calibrated", "isolated", kernel="reference")
        alive = [o for o in gc.get_objects() if isinstance(o, QuantizedKVLayer)]
    finally:
        gc.enable()
    assert not alive


def test_kernel_rows_of_a_raw_prefill_path_are_its_one_token_calls(tiny_models):
    """A raw_prefill prompt attends its own K/V unquantised, which no decode kernel reads: only the one-token
    calls (the reply) get kernel rows; the torch rows stay those of a capture without the kernel."""
    model = InProcessModel.load(tiny_models["gqa"])
    spec = "fp8_e4m3:calibrated:raw_prefill"
    plain = _turn(model, spec, "end-to-end")
    turn = _turn(model, spec, "end-to-end", kernel="reference")
    torch_rows, kernel_rows = _split(turn)
    assert torch_rows == plain.rows
    first = min(r["query_pos"] for r in torch_rows)  # the prompt's last token, in the prompt chunk
    assert _where(kernel_rows) == [w for w in _where(torch_rows) if w[2] > first] and kernel_rows
    assert turn.summary["attn_kernel_vs_torch_max"] < KERNEL_VS_TORCH_MAX


def test_a_broken_kernel_shows_in_its_rows_and_the_healthy_path_stays_quiet(tiny_models):
    model = InProcessModel.load(tiny_models["gqa"])
    spec = "fp8_e4m3:per_tensor:calibrated"
    healthy = _turn(model, spec, "isolated", kernel="reference")
    broken = _turn(model, spec, "isolated", kernel="test_attention_error:forgets_v_scale")
    assert _split(broken)[0] == _split(healthy)[0]  # torch's rows (the quantisation error) do not move
    assert healthy.summary["attn_kernel_vs_torch_max"] < KERNEL_VS_TORCH_MAX
    assert broken.summary["attn_kernel_vs_torch_mean"] > 10  # calibrated v_scale << 1: codes >> values
    assert broken.summary["attn_kernel_lse_err_max"] < KERNEL_LSE_MAX  # V is not in the lse: the bug is after softmax


def test_a_kernel_that_fails_on_the_rows_keeps_torchs_rows_and_is_named(tiny_models):
    """Capture runs the sampled rows as a batch; a plug-in that cannot take one loses its own rows only."""
    model = InProcessModel.load(tiny_models["gqa"])
    spec = "fp8_e4m3:calibrated"
    turn = _turn(model, spec, "isolated", kernel="test_attention_error:one_sequence_only")
    assert _split(turn) == (_turn(model, spec, "isolated").rows, [])
    assert turn.summary["attn_kernel_failed"] == 1.0 and "attn_kernel_rows" not in turn.summary
    assert len(turn.errors) == 1 and "one_sequence_only" in turn.errors[0] and "got a batch of" in turn.errors[0]
    assert "failed: AssertionError" in turn.sampled["kernel"]
    assert not _turn(model, spec, "isolated", kernel="reference").errors


def test_kernel_rows_need_the_models_kernel_and_skip_paths_it_does_not_run(tiny_models):
    from harness.kv_paths.decode_kernels import KernelPluginError

    mla = InProcessModel.load(tiny_models["mla"])
    with pytest.raises(KernelPluginError, match="has no mla_decode"):
        _turn(mla, "fp8_e4m3:calibrated", "isolated", kernel="test_attention_error:forgets_v_scale")
    gqa = InProcessModel.load(tiny_models["gqa"])
    with pytest.raises(KernelPluginError, match="needs a CUDA device"):
        _turn(gqa, "fp8_e4m3:calibrated", "isolated", kernel="triton")
    for spec in ("fp8_e4m3:per_token", "fp8_e4m3:calibrated:fp8_q"):
        turn = _turn(gqa, spec, "isolated", kernel="reference")
        assert not _split(turn)[1] and turn.sampled["kernel"].startswith("not measured"), spec


def test_backend_measures_its_decode_kernel(tiny_models):
    """The in-process backend hands capture the kernel its decode runs through: a `kernel=` path on the CPU
    gets kernel rows; a plain FP8 path on the CPU (torch decode) gets none."""
    model = InProcessModel.load(tiny_models["gqa"])
    messages = [Message("user", "Hello there, what is 7 * 8?")]
    options = AttentionOptions(sample=CaptureSample(2, 3))
    named = model.backend(parse_path("fp8_e4m3:kernel=reference"), "k").attention_error_sync(messages, [5, 6, 7], options)
    plain = model.backend(parse_path("fp8_e4m3"), "p").attention_error_sync(messages, [5, 6, 7], options)
    assert {r["attention"] for r in named.rows} == {"torch", "kernel:reference"}
    assert {r["attention"] for r in plain.rows} == {"torch"} and "attn_kernel_rows" not in plain.summary


# ---------------------------------------------------------------- scale files


def test_exported_files_match_what_vllm_and_sglang_load(tmp_path, tiny_models):
    model = InProcessModel.load(tiny_models["hybrid"])
    config = model.model.config
    for granularity, shape, expect in (("per_tensor", "scalar", ()), ("per_tensor", "one", (1,)),
                                       ("per_head", "scalar", (config.num_key_value_heads,))):
        scales = model.scales_for(parse_path(f"fp8_e4m3:{granularity}:calibrated"))
        out = tmp_path / f"{granularity}-{shape}"
        files = calibration.write_scale_files(out, {"k_scale": scales.k, "v_scale": scales.v}, config, shape=shape)
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt") as handle:
            keys = set(handle.keys())
            attention = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
            assert keys == {f"model.layers.{i}.self_attn.{n}" for i in attention for n in ("k_scale", "v_scale")}
            for key in keys:
                tensor = handle.get_tensor(key)
                assert tensor.dtype == torch.float32 and tuple(tensor.shape) == expect, key
        body = json.loads(files[1].read_text())
        assert body["model_type"] == config.model_type and body["kv_cache"]["dtype"] == "float8_e4m3fn"
        layers = body["kv_cache"]["scaling_factor"]["0"]  # TP rank 0 -> {layer: scale}, every hidden layer
        assert sorted(layers, key=int) == [str(i) for i in range(config.num_hidden_layers)]
        for i in attention:
            assert layers[str(i)] == float(torch.maximum(scales.k[i].max(), scales.v[i].max()))


@pytest.mark.parametrize("arch,granularity", [("gqa", "per_tensor"), ("gqa", "per_head"), ("mla", "per_tensor"),
                                              ("hybrid", "per_head")])
def test_export_then_checkpoint_gives_the_same_scales_bit_for_bit(tmp_path, tiny_models, arch, granularity):
    calibrated = InProcessModel.load(tiny_models[arch])
    scales = calibrated.scales_for(parse_path(f"fp8_e4m3:{granularity}:calibrated"))
    files = calibration.write_scale_files(tmp_path, {"k_scale": scales.k, "v_scale": scales.v},
                                          calibrated.model.config)
    for file in files if granularity == "per_tensor" and arch != "hybrid" else files[:1]:
        loaded = InProcessModel.load(tiny_models[arch])
        loaded.scales_file = file
        back = loaded.scales_for(parse_path(f"fp8_e4m3:{granularity}:checkpoint"))
        assert back.source == "checkpoint" and sorted(back.k) == sorted(scales.k)
        for i in scales.k:
            k, v = scales.k[i], scales.v[i]
            if file.suffix == ".json":  # the quantization-param JSON holds one scale per layer for K and V
                k = v = torch.maximum(k, v)
            assert back.k[i].dtype == k.dtype == torch.float32
            assert torch.equal(back.k[i], k) and torch.equal(back.v[i], v), (file.name, i)


def test_bad_scales_file_is_named(tmp_path, tiny_models):
    bad = tmp_path / "scales.json"
    bad.write_text('{"kv_cache": {}}')
    with pytest.raises(ValueError, match="scales.json"):
        calibration.read_scale_file(bad)
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        calibration.read_scale_file(tmp_path / "missing.safetensors")


# ---------------------------------------------------------------- FP8 attention paths, per-layer maps


def test_attention_fp8_reference_by_hand():
    from kernels.reference import attention_fp8

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    plain, _ = attention_fp8(q.double(), k.double(), v.double(), 0.35, None, None, None)
    mask = torch.arange(5).unsqueeze(0) <= torch.arange(3).unsqueeze(1) + 2  # the 3 queries are keys 2..4
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), attn_mask=mask,
        scale=0.35).transpose(1, 2)
    # fp32 math against fp64 SDPA: a few fp32 ulps of values of order 1
    assert torch.allclose(plain.double(), expect, atol=1e-5, rtol=0)
    # FP8 Q with scale 1/16: q' = fp8(16 q) / 16 exactly; the same attention on q' by hand
    out, used = attention_fp8(q, k, v, 0.35, None, torch.tensor(1 / 16), None)
    q8 = (q * 16).to(torch.float8_e4m3fn).float() / 16
    assert torch.equal(used, q8)
    by_hand = torch.nn.functional.scaled_dot_product_attention(
        q8, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.35).transpose(1, 2)
    assert torch.allclose(out, by_hand, atol=1e-5, rtol=0)
    # FP8 P with scale 1: small probabilities flush to zero, so rows no longer sum to 1
    _, _ = attention_fp8(q, k, v, 0.35, None, None, torch.tensor(1.0))


def test_fp8_attention_paths_show_error_and_keep_bf16_layers_show_none(tiny_models):
    model = InProcessModel.load(tiny_models["gqa"])
    for spec in ("bf16:fp8_q", "bf16:calibrated:fp8_p"):
        turn = _turn(model, spec, "isolated")
        assert max(r["attn_out_rel_err"] for r in turn.rows) > 0, spec
    scales = model.scales_for(parse_path("bf16:calibrated:fp8_q"))
    assert sorted(scales.q) == [0, 1] and all(s.dim() == 0 for s in scales.q.values())
    turn = _turn(model, "fp8_e4m3:calibrated:keep_bf16=0", "isolated")
    assert max(r["attn_out_rel_err"] for r in turn.rows if r["layer"] == 0) == 0.0
    assert max(r["attn_out_rel_err"] for r in turn.rows if r["layer"] == 1) > 0.0


def test_layer_map_option(tmp_path):
    from harness.kv_paths.spec import PathSpecError

    good = tmp_path / "map.json"
    good.write_text(json.dumps({"bf16_layers": [7, 3]}))
    path = parse_path(f"fp8_e4m3:layers={good}")
    assert path.bf16_layers == (3, 7) and path.canonical.endswith(":keep_bf16=3+7")
    assert parse_path("fp8:keep_bf16=7+3").bf16_layers == (3, 7)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for spec, message in ((f"fp8:layers={bad}", "bad.json"), ("fp8:keep_bf16=x", "keep_bf16"),
                          ("fp8:layers=/no/such.json", "does not exist"), ("fp8:shape=3", "unknown option")):
        with pytest.raises(PathSpecError, match=message):
            parse_path(spec)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
def test_capture_on_cuda_matches_cpu_semantics(tiny_models, arch):
    """On CUDA: bf16 shows exactly zero error in both modes, an FP8 path a nonzero one of the size CPU
    measures (bf16 SDPA on either device: same order of magnitude, not bit-equal)."""
    cuda = InProcessModel.load(tiny_models[arch], device="cuda")
    cpu = InProcessModel.load(tiny_models[arch])
    for mode in ("isolated", "end-to-end"):
        zero = _turn(cuda, "bf16", mode)
        assert zero.rows and max(r["attn_out_rel_err"] for r in zero.rows) == 0.0, mode
    on_gpu = _turn(cuda, "fp8_e4m3:per_head:calibrated", "isolated").summary["attn_out_rel_err_mean"]
    on_cpu = _turn(cpu, "fp8_e4m3:per_head:calibrated", "isolated").summary["attn_out_rel_err_mean"]
    assert on_gpu > 0 and 0.25 < on_gpu / on_cpu < 4.0, (on_gpu, on_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
def test_triton_kernel_rows_on_cuda(tiny_models, arch):
    """On CUDA our Triton decode kernels run on the sampled rows beside torch: the same rows as torch's,
    within bf16 rounding of torch over the same codes (the reference kernel's bounds), an lse that agrees,
    the path's quantisation error against the reference; and a run's default FP8 path (which decodes through
    Triton on CUDA) is captured with them."""
    cuda = InProcessModel.load(tiny_models[arch], device="cuda")
    spec = "fp8_e4m3:per_head:calibrated"
    turn = _turn(cuda, spec, "isolated", kernel="triton")
    torch_rows, kernel_rows = _split(turn)
    assert torch_rows == _turn(cuda, spec, "isolated").rows
    assert _where(kernel_rows) == _where(torch_rows) and {r["attention"] for r in kernel_rows} == {"kernel:triton"}
    s = turn.summary
    assert 0 < s["attn_kernel_vs_torch_max"] < KERNEL_VS_TORCH_MAX and s["attn_kernel_lse_err_max"] < KERNEL_LSE_MAX
    assert 0.5 < s["attn_kernel_out_rel_err_mean"] / s["attn_out_rel_err_mean"] < 2.0
    messages = [Message("user", "Hello there, what is 7 * 8?")]
    options = AttentionOptions(sample=CaptureSample(2, 3))
    default = cuda.backend(parse_path(spec), "p").attention_error_sync(messages, [5, 6, 7], options)
    assert {r["attention"] for r in default.rows} == {"torch", "kernel:triton"}
