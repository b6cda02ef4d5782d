"""The fused FP8 cache write (`kernels.store_kv.quantize_store`) against the torch round trip it replaces, and the
write check's sums (`kernels.write_check`) against their torch mirror.

On CUDA a quantised cache layer writes through one Triton launch per tensor: codes = fp8(x / s), the read-back
codes * s, the paged store of the same codes and the cast statistics. Everything here is compared with torch's
own ops on the same GPU (`kernels.reference`), which the CPU runs use: codes and read-back bit for bit, the
statistics exactly (integer counts; the amax is a max, which has no reduction order).
"""

from pathlib import Path

import pytest
import torch

from harness.kv_paths.spec import parse_path
from harness.types import Message
from kernels import reference as fp8

pytestmark = pytest.mark.gpu


def _torch_write(x: torch.Tensor, scale: torch.Tensor | None, fmt: str, saturate: bool):
    """The torch round trip of `QuantizedKVLayer._round_trip` and its ratio, on x's device."""
    s = fp8.per_token_scale(x, fmt) if scale is None else (scale.view(-1, 1, 1) if scale.dim() == 1 else scale)
    codes = fp8.quantize(x, s, fmt, saturate=saturate)
    ratio = (x.float() / s).abs() / fp8.FP8_MAX[fmt]
    return codes, fp8.dequantize(codes, s, out_dtype=x.dtype), ratio


def _inputs(rows: int, heads: int, chunk: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # [rows, chunk, heads, dim] transposed, as transformers hands K/V to the cache; outliers, NaN and inf
    x = torch.randn(rows, chunk, heads, dim, device="cuda", generator=g) * 60
    x[0, 0, 0, :3] = torch.tensor([1e5, float("nan"), float("-inf")])
    x[-1, -1, -1, 0] = 470.0
    return x.to(torch.bfloat16).transpose(1, 2)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_token"])
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("chunk", [1, 37, 300])  # 300: several 64-token programs a row and a partial one
def test_quantize_store_equals_torch(fmt, granularity, saturate, chunk):
    from kernels.store_kv import quantize_store

    rows, heads, dim = 3, 4, 64
    x = _inputs(rows, heads, chunk, dim, seed=chunk)
    scale = {"per_tensor": torch.tensor(0.3, device="cuda"), "per_token": None,
             "per_head": torch.tensor([0.5, 0.02, 1.0, 0.125], device="cuda")}[granularity]
    valid = torch.ones(rows, chunk + 3, dtype=torch.long, device="cuda")[:, 3:]  # a strided slice, as the step's
    valid[1, : max(1, chunk // 2)] = 0  # left padding of row 1
    live = torch.tensor([4, 0, 2], device="cuda")  # stats rows of the live batch rows
    counts = torch.zeros(5, 3, dtype=torch.int64, device="cuda")
    amax = torch.zeros(5, device="cuda")
    pages_per_row = -(-chunk // 16)
    cache = torch.full((rows * pages_per_row, 16, heads, dim), 0xAB, dtype=torch.uint8, device="cuda")
    slots = (torch.arange(rows, device="cuda")[:, None] * pages_per_row * 16 + torch.arange(chunk, device="cuda"))
    slots = torch.where(valid.bool(), slots, -1).reshape(-1)
    out = torch.full(x.shape, -7777.0, dtype=x.dtype, device="cuda")  # poisoned: every element must be written
    quantize_store(x, scale, fmt, saturate, out=out, cache=cache, slots=slots,
                   cache_strides=(cache.stride(0), cache.stride(1), cache.stride(2)), counts=counts, amax=amax,
                   live=live, valid=valid)
    codes, read_back, ratio = _torch_write(x, scale, fmt, saturate)
    # bit for bit (NaN where torch has NaN; NaN payloads are not compared)
    assert torch.equal(out.isnan(), read_back.isnan())
    assert torch.equal(out.masked_fill(out.isnan(), 0).view(torch.int16), read_back.masked_fill(read_back.isnan(), 0).view(torch.int16))
    stored = cache.view(-1, heads, dim)
    expected_codes = codes.view(torch.uint8).transpose(1, 2).reshape(-1, heads, dim)
    written = slots >= 0
    assert torch.equal(stored[slots[written]], expected_codes[written])
    untouched = torch.ones(stored.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots[written]] = False
    assert bool((stored[untouched] == 0xAB).all())  # pads (slot -1) wrote nothing
    real = valid.bool()[:, None, :, None].expand_as(x)
    for r, stats_row in enumerate(live.tolist()):
        values = int(real[r].sum())
        clipped = int(((ratio[r] > 1) & real[r]).sum())
        nonfinite = int(((~read_back[r].isfinite()) & real[r]).sum())
        assert counts[stats_row].tolist() == [values, clipped, nonfinite]
        finite = torch.where(real[r], torch.nan_to_num(ratio[r], nan=0.0, posinf=0.0), 0.0)
        assert float(amax[stats_row]) == float(finite.max())
    assert counts[[1, 3]].abs().sum() == 0 and amax[[1, 3]].abs().sum() == 0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_token"])
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("chunk", [1, 37])
def test_pair_into_static_columns_equals_two_launches(fmt, granularity, saturate, chunk):
    """K and V in one launch, the read-back written at static storage's columns (a decode step's write): the same
    codes, read-back bits and statistics as two launches of the single write checked against torch above."""
    from kernels.store_kv import quantize_store, quantize_store_pair

    rows, heads, dim, max_len = 3, 4, 128, 64
    key, value = _inputs(rows, heads, chunk, dim, seed=chunk), _inputs(rows, heads, chunk, dim, seed=chunk + 7) / 3
    scales = {"per_tensor": (torch.tensor(0.3, device="cuda"), torch.tensor(0.7, device="cuda")),
              "per_token": (None, None),
              "per_head": (torch.tensor([0.5, 0.02, 1.0, 0.125], device="cuda"),
                           torch.tensor([0.25, 0.5, 0.03, 2.0], device="cuda"))}[granularity]
    columns = torch.arange(5, 5 + chunk, device="cuda")
    valid = torch.ones(rows, chunk, dtype=torch.long, device="cuda")
    valid[1, 0] = 0
    slots = torch.where(valid.bool(), torch.arange(rows, device="cuda")[:, None] * max_len + columns, -1).reshape(-1)

    def run(paired: bool):
        out = {s: torch.full((rows, heads, max_len, dim), -7777.0, dtype=key.dtype, device="cuda") for s in "kv"}
        cache = {s: torch.full((rows * max_len // 16, 16, heads, dim), 0xAB, dtype=torch.uint8, device="cuda")
                 for s in "kv"}
        counts, amax = torch.zeros(rows, 3, dtype=torch.int64, device="cuda"), torch.zeros(rows, device="cuda")
        common = dict(slots=slots, cache_strides=cache["k"].stride()[:3], counts=counts, amax=amax,
                      live=torch.arange(rows, device="cuda"), valid=valid)
        if paired:
            quantize_store_pair(key, value, *scales, fmt, saturate, k_out=out["k"], v_out=out["v"],
                                out_columns=columns, k_cache=cache["k"], v_cache=cache["v"], **common)
        else:
            for side, x, scale in (("k", key, scales[0]), ("v", value, scales[1])):
                read = quantize_store(x, scale, fmt, saturate, cache=cache[side], **common)
                out[side][:, :, columns] = read
        return out, cache, counts, amax

    (out, cache, counts, amax), (want_out, want_cache, want_counts, want_amax) = run(True), run(False)
    for side in "kv":
        assert torch.equal(out[side].view(torch.int16), want_out[side].view(torch.int16)), side
        assert torch.equal(cache[side], want_cache[side]), side
    assert torch.equal(counts, want_counts) and torch.equal(amax, want_amax)


def _assert_same_replies_and_statistics(fused, plain) -> None:
    """The fused write's rows against the torch round trip's: the same tokens, write statistics and kernel checks."""
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        for key in ("kv_clipped_frac", "kv_nonfinite", "kv_amax_over_max", "kernel_steps", "kernel_err_ratio",
                    "kv_write_err_ratio"):
            assert a.metrics.get(key) == b.metrics.get(key), key


def test_quantize_store_mla_row_layout():
    """MLA: latent and k_pe of one token go into one cache row ([latent | k_pe]) under one scale."""
    from kernels.store_kv import quantize_store

    latent = _inputs(2, 1, 5, 64, seed=1)
    k_pe = _inputs(2, 1, 5, 16, seed=2)
    scale = torch.tensor(0.05, device="cuda")
    cache = torch.zeros(2, 16, 80, dtype=torch.uint8, device="cuda")
    slots = torch.tensor([0, 1, 2, 3, 4, 16, 17, 18, 19, -1], device="cuda")
    strides = (cache.stride(0), cache.stride(1), 0)
    quantize_store(latent, scale, "e4m3", True, cache=cache, slots=slots, cache_strides=strides)
    quantize_store(k_pe, scale, "e4m3", True, cache=cache, slots=slots, cache_strides=strides, col_offset=64)
    expected = torch.zeros_like(cache)
    fp8.store_latent(latent[:, 0].reshape(10, -1), k_pe[:, 0].reshape(10, -1), expected.view(torch.float8_e4m3fn),
                     slots, scale)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("spec", ["fp8_e4m3", "fp8_e5m2:per_head:calibrated", "fp8_e4m3:per_token",
                                  "fp8_e4m3:raw_prefill", "fp8_e5m2:nosat", "fp8_e4m3:calibrated:prefill=nvfp4",
                                  # block-scaled: kernels/store_kv_block_scaled.py against the formats' torch encode
                                  "nvfp4", "nvfp4:per_head:calibrated", "fp4_mx_block16", "int4_per_token_head",
                                  "int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("arch", ["gqa", pytest.param("mla", id="mla")])
def test_layer_fused_equals_torch_path(tiny_models, monkeypatch, spec, arch):
    """A whole one-sequence reply on CUDA: fused cache writes vs the torch round trip (decode through the
    kernels both times): the same reply and the same write statistics, the write check's included (exactly 1
    both ways: the fused write is held to the format's torch definition). On MLA a block-scaled latent is written
    fused and its k_pe kept in bf16 beside it."""
    import harness.kv_paths.cache as cache
    from harness.replay.inprocess import InProcessModel

    model = InProcessModel.load(tiny_models[arch], device="cuda")
    backend = model.backend(parse_path(spec))
    prompt = model.encode_chat([Message("user", "Name three colours and count to five.")])
    fused = backend.greedy_ids(prompt, 12)
    monkeypatch.setattr(cache, "fused_write_on", lambda x: False)
    plain = backend.greedy_ids(prompt, 12)
    assert fused[0] == plain[0]
    for key in ("kv_clipped_frac", "kv_nonfinite", "kv_amax_over_max", "kernel_err_ratio", "kv_write_err_ratio"):
        assert fused[2].get(key) == plain[2].get(key), key  # per-token paths have no kernel metrics
    assert fused[2].get("kv_write_err_ratio") == 1.0


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
@pytest.mark.parametrize("spec", ["fp8_e4m3", "fp8_e5m2:per_head:calibrated", "fp8_e4m3:per_token", "nvfp4", "mxfp8",
                                  "int4_per_token_head"])
def test_batched_fused_stats_equal_torch_stats(tiny_models, monkeypatch, arch, spec):
    """Batched replay: per-row write statistics from the fused kernel equal the torch per-row counts."""
    import harness.kv_paths.cache as cache
    from harness.replay.batched import BatchedEngine, BatchSettings
    from harness.replay.inprocess import InProcessModel

    model = InProcessModel.load(tiny_models[arch], device="cuda")
    backend = model.backend(parse_path(spec))
    users = ["What is 7 * 8?", "Name three colours, then describe the sea.", "Hi"]
    prompts = [model.encode_chat([Message("user", u)]) for u in users]
    fused = BatchedEngine(backend, BatchSettings(kernel_check_every=3)).generate(prompts, [4, 12, 8])
    monkeypatch.setattr(cache, "fused_write_on", lambda x: False)
    plain = BatchedEngine(backend, BatchSettings(kernel_check_every=3)).generate(prompts, [4, 12, 8])
    _assert_same_replies_and_statistics(fused, plain)


@pytest.mark.parametrize("chunk", [1, 37, 300])
def test_square_error_sums_equal_torch(chunk):
    """The write check's per-row sums in one Triton pass (`kernels.write_check`) against its torch mirror
    (`reference.square_error_sums`, the CPU's) on the same GPU: NaN and +inf squares count 0, pad tokens not at
    all, x transposed as transformers hands it over, b in fp32. Both add the same fp64 terms in different orders,
    hence 1e-12 relative (fp64's ulp is 1.1e-16; a few thousand terms a row); equal again when run twice."""
    from kernels.write_check import square_error_sums

    rows, heads, dim = 3, 4, 64
    x = _inputs(rows, heads, chunk, dim, seed=chunk + 1)
    a = (x.float() + torch.randn(x.shape, device="cuda") * 0.1).to(torch.bfloat16)
    b = x.float() * 1.01                                   # fp32 and contiguous: another dtype and layout
    a[0, 0, -1, 0], b[1, 1, 0, 2] = float("nan"), float("inf")
    valid = torch.ones(rows, chunk + 3, dtype=torch.bool, device="cuda")[:, 3:]
    valid[1, : max(1, chunk // 2)] = False
    got = square_error_sums(x, a, b, valid.view(torch.uint8))
    torch.testing.assert_close(got, fp8.square_error_sums(x, a, b, valid), rtol=1e-12, atol=0)
    assert torch.equal(square_error_sums(x, a, b, valid.view(torch.uint8)), got)  # deterministic
    everything = square_error_sums(x, a, b)
    assert bool((everything >= got).all()) and bool((everything[1] > got[1]).all())  # the pads counted now


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_token"])
def test_square_error_sums_read_fp8_codes_back_as_torch(fmt, granularity):
    """The write check hands the sums the format definition's FP8 codes and scale, not their widened read-back
    (`square_error_sums(..., b_scale)`): the kernel's read-back (fp8 -> fp32, x scale, one rounding to bf16) must be
    `reference.dequantize`'s bit for bit, so the sums are the same terms in the same order: equal, not close. NaN
    codes (x's NaN, and 0x7F written over three codes) count 0 either way; x holds inf and e4m3 overflow."""
    from kernels.write_check import square_error_sums

    rows, heads, chunk, dim = 3, 4, 37, 128
    x = _inputs(rows, heads, chunk, dim, seed=7)
    scale = {"per_tensor": torch.tensor(0.37, device="cuda"),
             "per_head": torch.tensor([0.3, 1.7, 0.05, 2.5], device="cuda").view(-1, 1, 1),
             "per_token": fp8.per_token_scale(x, fmt)}[granularity]
    codes = fp8.quantize(x, scale, fmt)
    codes.view(torch.uint8)[1, 2, 3, :3] = 0x7F
    a = (x.float() * 1.01).to(torch.bfloat16)
    valid = torch.ones(rows, chunk, dtype=torch.uint8, device="cuda")
    valid[2, :5] = 0
    want = square_error_sums(x, a, fp8.dequantize(codes, scale, out_dtype=x.dtype), valid)
    assert torch.equal(square_error_sums(x, a, codes, valid, scale), want)
    assert bool((want[:, 1] > 0).all())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("saturate", [True, False], ids=["saturate", "overflow"])
def test_write_check_rounding_is_torchs_cast_for_every_fp32(fmt, saturate):
    """`kernels.write_check.fp8_value`, the write check's own rounding (integer ops on the bits: it shares no code
    with the cache write's fp8 cast), against torch's cast as `reference.quantize` makes it, for every one of the
    2^32 fp32 bit patterns (16 parts): the same value and sign, NaN where torch's is NaN (a NaN's sign is not
    compared: without saturation the two NaNs of a NaN input differed in sign on an H200, torch 2.11; the sums count
    NaN as 0 either way)."""
    from kernels.write_check import fp8_values

    one = torch.ones((), device="cuda")
    for part in range(16):
        low = -(1 << 31) + part * (1 << 28)
        y = torch.arange(low, low + (1 << 28), dtype=torch.int32, device="cuda").view(torch.float32)
        got, want = fp8_values(y, fmt, saturate), fp8.quantize(y, one, fmt, saturate).float()
        wrong = ~((got == want) & (got.signbit() == want.signbit()) | (got.isnan() & want.isnan()))
        assert not bool(wrong.any()), (part, [(y[i].item(), got[i].item(), want[i].item())
                                              for i in wrong.nonzero()[:5, 0].tolist()])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("saturate", [True, False], ids=["saturate", "overflow"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_token"])
def test_square_error_sums_write_x_by_the_definition_as_torch(fmt, saturate, granularity):
    """The write check's sums writing x by the definition themselves (`square_error_sums(x, a, None, ...,
    b_format)`, no codes made) against the same sums given torch's codes of x: the same fp64 terms (the terms
    themselves are `fp8_value`'s, equal to torch's for every fp32 above), added in the order each compiled variant's
    reduction takes, hence 1e-12 relative (the H200 differed by 2 fp64 ulps of a 1e10 sum: an outlier's square). bf16
    x as transformers hands it over, with outliers past the format's range, NaN and inf."""
    from kernels.write_check import square_error_sums

    rows, heads, chunk, dim = 3, 4, 37, 128
    x = _inputs(rows, heads, chunk, dim, seed=9)
    scale = {"per_tensor": torch.tensor(0.37, device="cuda"),
             "per_head": torch.tensor([0.3, 1.7, 0.05, 2.5], device="cuda").view(-1, 1, 1),
             "per_token": fp8.per_token_scale(x, fmt)}[granularity]
    a = (x.float() * 1.01).to(torch.bfloat16)
    valid = torch.ones(rows, chunk, dtype=torch.uint8, device="cuda")
    valid[2, :5] = 0
    codes = fp8.quantize(x, scale, fmt, saturate)
    want = square_error_sums(x, a, codes, valid, scale)
    got = square_error_sums(x, a, None, valid, scale, b_format=fmt, saturate=saturate)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert torch.equal(square_error_sums(x, a, None, valid, scale, b_format=fmt, saturate=saturate), got)
    assert bool((want[:, 1] > 0).all())


@pytest.mark.parametrize("decode", ["graph", "dynamic"])
@pytest.mark.parametrize("spec", ["fp8_e4m3", "fp8_e5m2:per_head", "fp8_e4m3:per_token", "nvfp4"])
def test_checks_beside_the_prefill_equal_checks_on_its_stream(monkeypatch, decode, spec):
    """The write check and the prompt-end kernel check run on a second stream beside the prefill
    (`forward_context.checks_beside`): the same replies, write statistics and kernel checks, to the bit, as with
    both on the model's stream, twice over (a check that read a tensor before the model's stream wrote it, or after
    the allocator handed its memory on, would move a number or differ between runs). A random-weight Llama big enough
    that the checks overlap the next layers' work: 4 layers of 1024, prompts of 333-1500 tokens."""
    import contextlib

    import harness.kv_paths.cache as cache
    import harness.replay.batched as batched
    from transformers import AutoModelForCausalLM, LlamaConfig

    from harness import forward_context
    from harness.kv_paths import attention
    from harness.replay.batched import BatchedEngine, BatchSettings
    from harness.replay.inprocess import InProcessModel

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=1000, max_position_embeddings=4096, bos_token_id=None,
                         eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                               attn_implementation=attention.ATTENTION_NAME)
    net.eval()
    model = InProcessModel(directory=Path("random"), model=net, tokenizer=None, device=torch.device("cuda"),
                           arch=config.model_type, random_weights=True, use_kernels=True)
    backend = model.backend(parse_path(spec))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (700, 1500, 333, 1024)]
    beside_seen = []
    real = forward_context.on_checks_stream

    def watched(*inputs):
        beside_seen.append(forward_context.current().checks_stream is not None)
        return real(*inputs)

    monkeypatch.setattr(cache, "on_checks_stream", watched)

    def generate():
        return BatchedEngine(backend, BatchSettings(kernel_check_every=3, decode=decode)).generate(prompts, [6, 9, 4, 7])

    beside = [generate(), generate()]
    assert beside_seen and all(beside_seen)
    monkeypatch.setattr(batched, "checks_beside", lambda device: contextlib.nullcontext())
    beside_seen.clear()
    alone = generate()
    assert beside_seen and not any(beside_seen)
    assert all(row.metrics.get("kv_write_err_ratio") == 1.0 for row in alone)
    # a scale per token has no decode kernel (capabilities.DECODE_ATTENTION): no kernel check to run beside
    assert all(bool(row.metrics.get("kernel_steps")) != spec.endswith("per_token") for row in alone)
    for run in beside:
        _assert_same_replies_and_statistics(run, alone)


@pytest.mark.parametrize("spec", ["nvfp4", "mxfp8", "mxfp4", "int4_per_token_head", "fp8_ds_mla"])
def test_wide_mla_latent_fused_write_equals_torch_path(monkeypatch, spec):
    """A DeepSeek-shaped latent (512 + RoPE 64; random 2-layer model): NVFP4 / MX / fp8_ds_mla latents are written by
    the fused write as two heads of 256 (the same bytes: no block, or fp8_ds_mla tile of 128, straddles them)
    straight into the decode kernel's pages (NVFP4 and fp8_ds_mla: one record a token), k_pe beside them as given;
    a scale per token-head keeps the torch round trip (the fused write's launches counted). Either way the replies
    and every write statistic equal the torch path's, and decode steps replay a CUDA graph."""
    import harness.kv_paths.cache as cache
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from harness.kv_paths import attention
    from harness.replay.batched import BatchedEngine, BatchSettings
    from harness.replay.inprocess import InProcessModel

    config = DeepseekV3Config(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=16, num_key_value_heads=16, n_routed_experts=4, num_experts_per_tok=2,
                              n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None,
                              kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                              vocab_size=1000, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attention.ATTENTION_NAME)
    net.eval()
    model = InProcessModel(directory=Path("random"), model=net, tokenizer=None, device=torch.device("cuda"),
                           arch=config.model_type, random_weights=True, use_kernels=True)
    backend = model.backend(parse_path(spec))
    prompts = [list(range(3, 3 + n)) for n in (40, 17, 90)]
    splits, writes = [], []
    real_split = cache.latent_split
    monkeypatch.setattr(cache, "latent_split", lambda f, dim: splits.append(real_split(f, dim)) or splits[-1])
    import kernels.store_kv_block_scaled as store
    real_write = store.quantize_store_block_scaled
    monkeypatch.setattr(store, "quantize_store_block_scaled", lambda *a, **k: writes.append(1) or real_write(*a, **k))
    engine = BatchedEngine(backend, BatchSettings(kernel_check_every=3))
    fused = engine.generate(prompts, [6, 12, 9])
    assert engine.decode_batches == {"graph": 1} and engine.decode_fallbacks == []
    assert max(splits) == (1 if spec == "int4_per_token_head" else 2), splits
    assert bool(writes) == (spec != "int4_per_token_head"), "the fused write ran where it serves the latent, only"
    monkeypatch.setattr(cache, "fused_write_on", lambda x: False)
    plain = BatchedEngine(backend, BatchSettings(kernel_check_every=3)).generate(prompts, [6, 12, 9])
    _assert_same_replies_and_statistics(fused, plain)
