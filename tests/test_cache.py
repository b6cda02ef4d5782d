"""The FP8 cache layer inside real transformers models, against the torch quantisation reference."""

import pytest
import torch

from harness.kv_paths.cache import QuantizedKVLayer, attention_layer_indices, build_cache, unit_scales
from harness.kv_paths.spec import parse_path
from harness.replay.inprocess import InProcessModel
from harness.types import Message
from kernels import reference as fp8

CHAT = [Message("system", "End every answer with the word Thanks."), Message("user", "What is 7 * 8 + 3 * 4?")]


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return {arch: InProcessModel.load(path) for arch, path in tiny_models.items()}


def test_only_full_attention_layers_are_replaced(loaded):
    assert attention_layer_indices(loaded["gqa"].model.config) == [0, 1]
    assert attention_layer_indices(loaded["hybrid"].model.config) == [3]  # 3 linear-attention layers stay
    cache = build_cache(loaded["hybrid"].model.config, parse_path("fp8"), unit_scales(loaded["hybrid"].model.config))
    assert [type(layer).__name__ for layer in cache.layers] == ["LinearAttentionLayer"] * 3 + ["QuantizedKVLayer"]


@pytest.mark.parametrize("spec", ["fp8_e4m3", "fp8_e5m2:per_head:calibrated", "fp8_e4m3:per_token"])
def test_layer_stores_exactly_the_reference_round_trip(spec):
    # What the layer hands to attention must equal dequantize(quantize(x)) of the reference, bit for bit.
    path = parse_path(spec)
    key = torch.randn(1, 2, 5, 16, dtype=torch.bfloat16) * 30
    value = torch.randn(1, 2, 5, 16, dtype=torch.bfloat16)
    k_scale, v_scale = (torch.tensor([0.5, 0.25]), torch.tensor([0.01, 0.02])) if path.granularity == "per_head" \
        else (torch.tensor(1.0), torch.tensor(1.0))
    from harness.kv_paths.cache import KVWriteStats

    layer = QuantizedKVLayer(path, k_scale, v_scale, KVWriteStats())
    keys, values = layer.update(key, value)
    if path.granularity == "per_token":
        k_scale, v_scale = fp8.per_token_scale(key, path.fmt), fp8.per_token_scale(value, path.fmt)
    elif path.granularity == "per_head":
        k_scale, v_scale = k_scale.view(-1, 1, 1), v_scale.view(-1, 1, 1)
    expected_k = fp8.dequantize(fp8.quantize(key, k_scale, path.fmt), k_scale, torch.bfloat16)
    expected_v = fp8.dequantize(fp8.quantize(value, v_scale, path.fmt), v_scale, torch.bfloat16)
    assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)


def test_raw_prefill_reads_the_chunk_raw_and_history_quantised():
    path = parse_path("fp8_e4m3:raw_prefill")
    from harness.kv_paths.cache import KVWriteStats

    layer = QuantizedKVLayer(path, torch.tensor(1.0), torch.tensor(1.0), KVWriteStats())
    first = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16) * 3
    keys, _ = layer.update(first, first)
    assert torch.equal(keys, first)  # the prefill chunk attends to itself unquantised
    second = torch.randn(1, 1, 3, 8, dtype=torch.bfloat16) * 3
    keys, _ = layer.update(second, second)
    assert torch.equal(keys[..., :4, :], fp8.dequantize(fp8.quantize(first, 1.0, "e4m3"), 1.0, torch.bfloat16))
    assert torch.equal(keys[..., 4:, :], second)
    step = torch.randn(1, 1, 1, 8, dtype=torch.bfloat16) * 3
    keys, _ = layer.update(step, step)  # a decode step reads everything, itself included, from the cache
    assert torch.equal(keys[..., -1:, :], fp8.dequantize(fp8.quantize(step, 1.0, "e4m3"), 1.0, torch.bfloat16))


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
def test_bf16_path_is_bit_identical_even_with_scales(loaded, arch):
    # Failure class 3: scales present on a BF16 cache must change nothing.
    model = loaded[arch]
    reference = model.backend(None).score_sync(CHAT, [30, 31, 32, 33])
    for spec in ("bf16", "bf16:calibrated", "bf16:warmup"):
        scored = model.backend(parse_path(spec)).score_sync(CHAT, [30, 31, 32, 33])
        assert torch.equal(scored.logprobs, reference.logprobs), spec


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
def test_fp8_path_changes_logits_a_little(loaded, arch):
    model = loaded[arch]
    reference = model.backend(None).score_sync(CHAT, [30, 31, 32, 33]).logprobs
    scored = model.backend(parse_path("fp8_e4m3")).score_sync(CHAT, [30, 31, 32, 33]).logprobs
    difference = (scored - reference).abs().max().item()
    # e4m3 keeps 3 mantissa bits (relative step 2^-3); on these random models that moves logprobs
    # by far less than 1 nat, and it must move them at all, or the cache layer was bypassed.
    assert 0 < difference < 1.0


def test_calibrated_scales_are_amax_over_max(loaded):
    model = loaded["gqa"]
    scales = model.scales_for(parse_path("fp8_e4m3:per_head:calibrated"))
    assert set(scales.k) == {0, 1} and scales.k[0].shape == (2,)  # 2 KV heads
    per_tensor = model.scales_for(parse_path("fp8_e4m3:calibrated"))
    assert torch.equal(per_tensor.k[0], scales.k[0].max())
    e5m2 = model.scales_for(parse_path("fp8_e5m2:calibrated"))
    torch.testing.assert_close(e5m2.k[0] * 57344, per_tensor.k[0] * 448)  # same amax, other format max


def test_checkpoint_scales_are_read_and_missing_ones_named(loaded, tmp_path, tiny_models):
    import shutil

    from safetensors.torch import save_file

    model_dir = tmp_path / "with-scales"
    shutil.copytree(tiny_models["gqa"], model_dir)
    tensors = {f"model.layers.{i}.self_attn.{n}": torch.tensor(0.05 * (i + 1)) for i in (0, 1) for n in ("k_scale", "v_scale")}
    save_file(tensors, str(model_dir / "kv_scales.safetensors"))
    model = InProcessModel.load(model_dir)
    scales = model.scales_for(parse_path("fp8_e4m3:checkpoint"))
    assert scales.k[1].item() == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"has no k_scale/v_scale for attention layers \[0, 1\]"):
        loaded["gqa"].scales_for(parse_path("fp8_e5m2:checkpoint"))


@pytest.mark.parametrize("spec, expect_nan", [("fp8_e4m3", False), ("fp8_e4m3:nosat", True)])
def test_overflow_saturates_or_turns_to_nan(spec, expect_nan):
    from harness.kv_paths.cache import KVWriteStats

    stats = KVWriteStats()
    layer = QuantizedKVLayer(parse_path(spec), torch.tensor(1e-3), torch.tensor(1.0), stats)
    key = torch.full((1, 1, 2, 4), 1.0, dtype=torch.bfloat16)  # 1.0 / 1e-3 = 1000 > 448
    keys, _ = layer.update(key, key)
    record = stats.as_record()  # 8 key values written, all clipped; the value side (scale 1.0) clips none
    # the ratio is computed in fp32 from exact inputs (1.0 in bf16; the scale fp32(1e-3)): two fp32 roundings, the
    # division by the scale and by 448, so rel=2^-22. Measured on the CPU: 7.6e-8.
    assert record["kv_clipped_frac"] == 8 / 16 and record["kv_amax_over_max"] == pytest.approx(1000 / 448, rel=2.0 ** -22)
    if expect_nan:  # torch's plain cast: e4m3fn has no inf, overflow becomes NaN
        assert keys.isnan().all() and record["kv_nonfinite"] == 8
    else:  # saturating cast: 448 * 1e-3 read back, rounded to the cache's bf16: within half a bf16 ulp, 2^-9
        # relative (measured: 0.447265625, 1.6e-3 from 0.448)
        assert torch.allclose(keys.float(), torch.full_like(keys.float(), 0.448), rtol=2.0 ** -9, atol=0)
        assert record["kv_nonfinite"] == 0


def test_generation_reports_cast_statistics(loaded):
    generation = loaded["gqa"].backend(parse_path("fp8_e4m3")).generate_sync(CHAT, 4)
    assert generation.metrics["kv_clipped_frac"] == 0.0  # scale 1.0 on these small activations: nothing clips
    assert generation.prompt_tokens == len(loaded["gqa"].encode_chat(CHAT))
    assert loaded["gqa"].backend(None).generate_sync(CHAT, 4).metrics is None  # reference: no cast


def test_the_cache_goes_in_under_the_keyword_the_forward_declares(loaded):
    """transformers renamed `past_key_values` to `cache` (deprecated in 5.2x, gone in 5.40; 5.17 on the GPU machines
    has only the old name, where `cache=` would be swallowed by **kwargs). Whichever the installed version declares,
    the model must write into our cache layers, and without the rename's deprecation warning."""
    import warnings

    from harness.kv_paths.cache import cache_kwargs

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    assert list(cache_kwargs(Renamed(), "c")) == ["cache"]
    assert list(cache_kwargs(Old(), "c")) == ["past_key_values"]
    for arch in ("gqa", "mla", "hybrid"):
        model = loaded[arch].model
        cache = build_cache(model.config, parse_path("fp8_e4m3"), unit_scales(model.config))
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            model(input_ids=torch.tensor([[1, 2, 3, 4]]), **cache_kwargs(model, cache), use_cache=True)
        assert cache.get_seq_length(attention_layer_indices(model.config)[0]) == 4, arch


# -- the one-sequence CPU write in one C call (kernels/cpu_kv_round_trip.c) ------------------------------------------

def _c_round_trip_or_skip():
    from kernels import cpu_kernels

    lib = cpu_kernels.library()
    if isinstance(lib, str):
        pytest.skip(f"no CPU kernels on this machine: {lib}")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("scales", [[1.0], [0.0123], [3.7e-5], [1234.5], [1e-12], [0.5, 0.25, 7 / 448]])
def test_c_round_trip_is_the_reference_on_every_bf16_input(fmt, saturate, scales):
    """The probe itself, run here on scales that put every bf16 value (NaN, inf, subnormals, ties) at different
    places of the fp8 grid, saturating and not: read-back bits, ratio bits, counts and max all equal the torch ops."""
    from harness.kv_paths import cache

    _c_round_trip_or_skip()
    assert cache._round_trip_agrees(torch.tensor(scales), fmt, saturate)


@pytest.mark.parametrize("spec", ["fp8_e4m3", "fp8_e5m2:per_head", "fp8_e4m3:nosat"])
def test_one_sequence_write_in_c_stores_and_counts_as_the_torch_ops(spec, monkeypatch):
    """A layer writing through the C call and one forced onto the torch ops store the same bits and count the
    same statistics, over writes with values past the format's max, NaN and inf."""
    from harness.kv_paths import cache
    from harness.kv_paths.cache import KVWriteStats

    _c_round_trip_or_skip()
    path = parse_path(spec)
    heads = 2
    scales = (torch.tensor([0.5, 0.03]), torch.tensor([0.01, 2.0])) if path.granularity == "per_head" \
        else (torch.tensor(0.02), torch.tensor(1.5))
    writes = []
    for tokens in (7, 1, 1, 3):
        key = torch.randn(1, heads, tokens, 16) * 40
        key[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -1e6])
        writes.append((key.to(torch.bfloat16), (torch.randn(1, heads, tokens, 16) * 900).to(torch.bfloat16)))

    def replay(c_call: bool):
        monkeypatch.setattr(cache, "cpu_round_trip_exact", lambda *args: c_call)
        calls = []
        real = cache.cpu_kernels.kv_round_trip
        monkeypatch.setattr(cache.cpu_kernels, "kv_round_trip", lambda *a, **k: calls.append(1) or real(*a, **k))
        stats = KVWriteStats()
        layer = QuantizedKVLayer(path, *scales, stats)
        stored = [layer.update(k, v) for k, v in writes][-1]
        return stored, stats.counts.clone(), stats.amax_over_max.clone(), len(calls)

    (c_keys, c_values), c_counts, c_amax, c_calls = replay(True)
    (keys, values), counts, amax, calls = replay(False)
    assert c_calls == 2 * len(writes) and calls == 0  # the C call served every write, then none
    assert torch.equal(c_keys.view(torch.int16), keys.view(torch.int16))
    assert torch.equal(c_values.view(torch.int16), values.view(torch.int16))
    assert torch.equal(c_counts, counts) and torch.equal(c_amax, amax)
    assert counts[0, 1] > 0 and counts[0, 2] > 0  # the writes clipped and read back NaN: the counts were exercised


def test_a_refused_probe_keeps_the_torch_ops(monkeypatch):
    from harness.kv_paths import cache
    from harness.kv_paths.cache import KVWriteStats

    monkeypatch.setattr(cache, "_EXACT_ROUND_TRIPS", {})
    monkeypatch.setattr(cache, "_round_trip_agrees", lambda *args: False)
    monkeypatch.setattr(cache.cpu_kernels, "kv_round_trip", lambda *a, **k: pytest.fail("C call after a refusal"))
    layer = QuantizedKVLayer(parse_path("fp8_e4m3"), torch.tensor(1.0), torch.tensor(1.0), KVWriteStats())
    key = torch.randn(1, 2, 3, 16, dtype=torch.bfloat16)
    keys, _ = layer.update(key, key)
    assert torch.equal(keys, fp8.dequantize(fp8.quantize(key, 1.0, "e4m3"), 1.0, torch.bfloat16))


# -- a prefill format distinct from the cache's (`prefill=FORMAT`) ---------------------------------------------------

def _prefill_layer(spec: str, scale: float = 1.0):
    from harness.kv_paths.cache import KVWriteStats

    return QuantizedKVLayer(parse_path(spec), torch.tensor(scale), torch.tensor(scale), KVWriteStats())


def test_a_prefill_chunk_attends_in_its_format_and_decode_reads_the_caches():
    """nvfp4 cache, fp8 prefill: the first chunk reads itself in fp8_e4m3; the next chunk reads the first from the
    cache (nvfp4) and itself in fp8; a decode step reads everything, itself included, as nvfp4. Bits: the formats'
    own round trips (formats.py, tested against their definitions in test_formats.py)."""
    nvfp4, e4m3 = (parse_path(s).k_format for s in ("nvfp4", "fp8_e4m3"))
    layer = _prefill_layer("nvfp4:prefill=fp8_e4m3")
    first, second, step = (torch.randn(1, 2, n, 16, dtype=torch.bfloat16) * 3 for n in (5, 3, 1))
    keys, values = layer.update(first, first * 2)
    assert torch.equal(keys, e4m3.round_trip(first, 1.0)[0]) and torch.equal(values, e4m3.round_trip(first * 2, 1.0)[0])
    keys, _ = layer.update(second, second)
    assert torch.equal(keys[..., :5, :], nvfp4.round_trip(first, 1.0)[0])
    assert torch.equal(keys[..., 5:, :], e4m3.round_trip(second, 1.0)[0])
    keys, _ = layer.update(step, step)
    assert torch.equal(keys[..., -1:, :], nvfp4.round_trip(step, 1.0)[0])
    assert torch.equal(keys[..., 5:8, :], nvfp4.round_trip(second, 1.0)[0])
    # the write statistics are the cache's: K and V of 9 tokens x 2 heads x 16 values counted once (no prefill copy)
    assert layer.stats.counts[0, 0].item() == 2 * 9 * 2 * 16


def test_a_prefill_format_takes_its_static_scale_from_the_calibrated_amax():
    """The cache's calibrated nvfp4 scale s stands for amax = s x 448 x 6; the fp8 prefill scale is amax / 448."""
    from harness.kv_paths.cache import prefill_static_scale

    path = parse_path("nvfp4:calibrated:prefill=fp8_e4m3")
    scale = prefill_static_scale(torch.tensor(0.01), path.k_format, path.prefill_format, torch.device("cpu"))
    assert scale.item() == pytest.approx(0.01 * 6, rel=2 ** -23)
    per_head = prefill_static_scale(torch.tensor([0.01, 0.02]), path.k_format, path.prefill_format, "cpu")
    assert per_head.shape == (2, 1, 1)
    mx = parse_path("mxfp8:calibrated:prefill=fp8_e4m3")  # no static scale of its own: e4m3 scales, as calibrated
    assert prefill_static_scale(torch.tensor(0.5), mx.k_format, mx.prefill_format, "cpu").item() == 0.5


def test_a_prefill_format_on_static_storage_fills_this_passs_columns():
    """The batched engine's static storage (CUDA graphs): the prefill chunk's own columns hold the prefill
    format's read-back, the cache keeps the cache format's."""
    from harness.kv_paths.cache import StaticColumns

    nvfp4, e4m3 = (parse_path(s).k_format for s in ("nvfp4", "fp8_e4m3"))
    layer = _prefill_layer("nvfp4:prefill=fp8_e4m3")
    layer.static = StaticColumns(8)
    layer.static.columns, layer.static.length = torch.arange(4), 4   # as BatchedEngine._prefill_static sets them
    chunk = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16) * 3
    keys, _ = layer.update(chunk, chunk)
    assert torch.equal(keys[..., :4, :], e4m3.round_trip(chunk, 1.0)[0]) and not keys[..., 4:, :].any()
    assert torch.equal(layer.keys[..., :4, :], nvfp4.round_trip(chunk, 1.0)[0])  # what decode will read


@pytest.mark.parametrize("begin, end", [(0, 5), (3, 7), (2, 3), (0, 8)])
def test_a_pass_attends_to_the_stored_columns_with_its_own_raw(begin, end):
    """`StaticColumns.with_raw` against its definition: the stored buffer with the pass's columns (a prefill pass's
    [length - chunk, length)) replaced by the raw chunk, every other column (earlier passes', the unwritten rest)
    as stored, bit for bit; the stored buffer itself unchanged."""
    from harness.kv_paths.cache import StaticColumns

    static = StaticColumns(8)
    static.columns, static.length = torch.arange(begin, end), end
    stored = torch.randn(2, 3, 8, 16, dtype=torch.bfloat16)
    stored[0, 1, 7, 2] = float("nan")   # a stale value: copied as it is, never read as another
    raw = torch.randn(2, 3, end - begin, 16, dtype=torch.bfloat16)
    before = stored.clone()
    expected = stored.clone().index_copy_(2, static.columns, raw)
    got = static.with_raw(stored, raw)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(stored.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("begin, end", [(0, 5), (3, 7), (2, 3), (0, 8)])
def test_a_pass_attending_to_its_columns_only_reads_them_and_its_own_raw(begin, end):
    """An eager prefill pass on CUDA (`StaticColumns.attended`): the layer's storage is handed over as its columns
    [0, end) (a view: no copy), and `with_raw` as those columns with the pass's own raw, bit for bit what the whole
    buffer's view gives in them: the first pass is its raw chunk itself, a later one the stored columns before it
    and then the raw."""
    from harness.kv_paths.cache import StaticColumns, StaticKVLayer

    static = StaticColumns(8)
    static.columns, static.length, static.attended = torch.arange(begin, end), end, end
    layer = StaticKVLayer(static)
    keys = torch.randn(2, 3, end - begin, 16, dtype=torch.bfloat16)
    stored, _ = layer.update(keys, keys.clone())
    assert stored.shape[2] == end and stored.data_ptr() == layer.keys.data_ptr()   # a view of the storage
    raw = torch.randn(2, 3, end - begin, 16, dtype=torch.bfloat16)
    got = static.with_raw(stored, raw)
    static.attended = None
    whole = static.with_raw(layer.keys, raw)
    assert torch.equal(got.view(torch.int16), whole[:, :, :end].view(torch.int16))
    assert (got is raw) == (begin == 0)


def test_prefill_bf16_is_raw_prefill_and_the_caches_own_format_is_no_prefill_format(loaded):
    assert parse_path("fp8_e4m3:prefill=bf16").canonical == parse_path("fp8_e4m3:raw_prefill").canonical
    assert parse_path("nvfp4:prefill=nvfp4").canonical == parse_path("nvfp4").canonical
    assert parse_path("sglang:nvfp4:prefill=fp8_e4m3").canonical == "nvfp4:per_tensor:default:prefill=fp8_e4m3"
    model = loaded["gqa"]
    raw = model.backend(parse_path("nvfp4:prefill=bf16")).score_sync(CHAT, [30, 31, 32])
    assert torch.equal(raw.logprobs, model.backend(parse_path("nvfp4:raw_prefill")).score_sync(CHAT, [30, 31, 32]).logprobs)


# -- keep_bf16=sliding_window (vLLM's --kv-cache-dtype-skip-layers sliding_window) ------------------------------------

# tiny configs of the families the sliding-window tests read (hidden 64, 4 layers, a 16-token window)
_SLIDING_FULL = ["sliding_attention", "full_attention"] * 2
SLIDING_FAMILIES = {
    "gemma2": ("gemma2", dict(sliding_window=16, layer_types=_SLIDING_FULL, query_pre_attn_scalar=16)),
    "cohere2": ("cohere2", dict(sliding_window=16, layer_types=_SLIDING_FULL)),
    "mistral_sliding": ("mistral", dict(sliding_window=16)),
    "llama4_text": ("llama4_text", dict(attention_chunk_size=16, num_local_experts=4, num_experts_per_tok=1,
                                        intermediate_size_mlp=128, no_rope_layers=[1, 1, 1, 0],
                                        layer_types=["chunked_attention"] * 3 + ["full_attention"])),
    "llama": ("llama", {}),
    "qwen3_next": ("qwen3_next", dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                      linear_value_head_dim=16, num_experts=4, shared_expert_intermediate_size=32,
                                      num_experts_per_tok=2, moe_intermediate_size=32)),
}


def family_config(family: str):
    from transformers import AutoConfig

    from harness.canary.tokenizer import VOCAB_SIZE

    model_type, overrides = SLIDING_FAMILIES[family]
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_hidden_layers=4, max_position_embeddings=4096,
                  bos_token_id=None, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, **{**common, **overrides})


@pytest.mark.parametrize("family, sliding", [("gemma2", [0, 2]), ("cohere2", [0, 2]), ("mistral_sliding", [0, 1, 2, 3]),
                                             ("llama4_text", []), ("llama", []), ("qwen3_next", [])])
def test_sliding_window_layers_are_read_per_layer(family, sliding):
    """From the cache transformers builds for each layer: llama4's chunked attention keeps a window cache too, but
    it is not a sliding-window layer (vLLM's chunked local attention has no sliding_window)."""
    from harness.kv_paths.cache import sliding_window_layers

    assert sliding_window_layers(family_config(family)) == sliding


def test_keep_bf16_sliding_window_leaves_those_layers_and_is_refused_without_them():
    from harness.replay.families import refusals, route_facts

    config, path = family_config("gemma2"), parse_path("fp8_e4m3:keep_bf16=sliding_window")
    cache = build_cache(config, path, unit_scales(config))
    assert [isinstance(layer, QuantizedKVLayer) for layer in cache.layers] == [False, True, False, True]
    assert refusals(config, [path]) == []
    assert set(route_facts(config, [path])["kept_bf16"]) >= {"0 (fp8_e4m3:keep_bf16=sliding_window)"}
    llama = family_config("llama")
    problem = "keep_bf16=sliding_window keeps the sliding-window attention layers in BF16"
    assert any(problem in p and "'llama' has none" in p for p in refusals(llama, [path]))
    with pytest.raises(ValueError, match="'llama' has none"):
        build_cache(llama, path, unit_scales(llama))


def test_our_cache_layers_leave_transformers_registries_as_they_were():
    """Issue 44: DeepSeek-V4's compressed-sparse cache layers register themselves in transformers' global layer-type
    mapping when its modelling module is imported (`_layer_type`, `CacheLayerMixin.__init_subclass__`). Our
    observer / FP8 / emulated layers are built over such a kind by subclassing it, and inherited `_layer_type`:
    building them re-registered our class under the family's layer type, so every later DeepSeek-V4 cache in the
    process (another model, the reference) was made of our layers. After building every kind of cache of ours for
    family A, transformers' layer-type and attention-function registries hold what they held, and a fresh cache of
    family A (a second model) and of family B (Llama) is transformers' own."""
    from transformers import DynamicCache
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from harness.canary.registry import tiny_config
    from harness.kv_paths import attention
    from harness.kv_paths.cache import observer_cache
    from harness.replay.families import model_cache

    family_a, family_b = tiny_config("deepseek_v4"), tiny_config("llama")
    own_a = [type(layer) for layer in model_cache(family_a).layers]  # imports the modelling module: registers
    assert any(kind.__module__.endswith("modeling_deepseek_v4") for kind in own_a), own_a
    registries = {"dynamic": dict(DYNAMIC_LAYER_TYPE_MAPPING), "static": dict(STATIC_LAYER_TYPE_MAPPING),
                  "attention": dict(ALL_ATTENTION_FUNCTIONS._global_mapping),
                  "mask": dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)}
    attention.register()  # ours: a name of its own, added once
    observer_cache(family_a)
    for spec in ("fp8_e4m3", "fp8_e4m3:per_head", "fp8_e4m3:emulated"):
        build_cache(family_a, parse_path(spec), None if "emulated" in spec else unit_scales(family_a))
    assert dict(DYNAMIC_LAYER_TYPE_MAPPING) == registries["dynamic"]
    assert dict(STATIC_LAYER_TYPE_MAPPING) == registries["static"]
    for name, registry in (("attention", ALL_ATTENTION_FUNCTIONS), ("mask", ALL_MASK_ATTENTION_FUNCTIONS)):
        now = dict(registry._global_mapping)
        assert {k: v for k, v in now.items() if k != attention.ATTENTION_NAME} == \
               {k: v for k, v in registries[name].items() if k != attention.ATTENTION_NAME}, name
    assert [type(layer) for layer in DynamicCache(config=family_a).layers] == own_a
    assert all(type(layer).__module__.startswith("transformers.") for layer in DynamicCache(config=family_b).layers)


@pytest.mark.parametrize("spec", ["nvfp4", "mxfp8", "mxfp4", "int4_per_token_head"])
def test_an_mla_row_with_a_block_scaled_latent_takes_the_fused_write_for_the_latent_alone(spec):
    """On MLA a block-scaled latent is written by the fused kernel and k_pe, kept in bf16, is stored as given: its
    side has no layout (a None format once reached `block_layout.refusal` and raised on CUDA only, session 19)."""
    from harness.kv_paths.cache import KVWriteStats, QuantizedKVLayer

    layer = QuantizedKVLayer(parse_path(spec), None, None, KVWriteStats(), mla=True)
    assert layer.v_format is None
    layouts = layer._block_layouts(64, 16)  # the canary's latent 64, rope 16
    assert layouts is not None and layouts[1] is None and layouts[0].kv_format is layer.k_format


def test_writes_on_another_device_count_there_and_fold_into_the_records():
    """A layer-sharded model's layers on another GPU add their write counts into that GPU's own buffers (no op
    across GPUs inside a decode step's graph); the records sum the counts and take the larger maximum. "meta" stands
    in for the other GPU (its buffers are made there, the home ones untouched); the fold's arithmetic runs on CPU
    buffers put in its place."""
    from harness.kv_paths.cache import KVWriteStats

    stats = KVWriteStats(rows=2, device="cpu")
    counts, amax = stats._on(torch.device("meta"))  # noqa: SLF001
    assert counts.device.type == amax.device.type == "meta" and stats.counts.device.type == "cpu"
    assert stats._on(torch.device("cpu"))[0] is stats.counts  # noqa: SLF001
    stats.counts += torch.tensor([[10, 1, 0], [20, 0, 0]])
    stats.amax_over_max += torch.tensor([0.5, 2.0])
    stats.away = {torch.device("meta"): (torch.tensor([[6, 2, 1], [0, 0, 0]]), torch.tensor([1.5, 0.25]))}
    first, second = stats.row_records()
    assert (first["kv_clipped_frac"], first["kv_nonfinite"], first["kv_amax_over_max"]) == (3 / 16, 1.0, 1.5)
    assert (second["kv_clipped_frac"], second["kv_amax_over_max"]) == (0.0, 2.0)
    assert stats.away == {}
