"""A GPU run of the harness: FP8 paths decode through our Triton kernels, and agree with torch."""

import pytest

from harness.kv_paths.spec import parse_path
from harness.replay.inprocess import InProcessModel
from harness.types import Message

CHAT = [Message("system", "Answer briefly."), Message("user", "What is 7 * 8 + 3 * 4? Then tell me more.")]
# `kernel_err_ratio` is the kernel's error against fp64 attention over the stored codes over SDPA bf16's own error
# on the same step (the torch reference's FP8 attention error for fp8_q / fp8_p paths), the max over every checked
# decode step and layer of a generation. Measured on an H100 (kernels/BENCHMARKS.md, harness run on the canaries,
# every decode step checked): 1.01-1.07 on GQA paths, 1.53-1.88 on MLA (its kernel sums q.W_uk over the 512
# latent columns, which SDPA over expanded keys does not); FP8 attention kernels (fp8 MMA) 1.86-2.01 in
# `python -m kernels.tune_mla`. The bound is 2x the worst measured, the rule of tests/test_kernels_gpu.py's
# FP8_MMA_K (4.0) for the same fp8-MMA kernels. The kernel tests' 2.0 judges one launch of a kernel without fp8
# MMA on a synthetic case; here the max over every step of a generation on every route, fp8 MMA included.
KERNEL_ERR_RATIO_BOUND = 4.0


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
@pytest.mark.parametrize("spec", ["fp8_e4m3", "fp8_e5m2:per_head:calibrated", "fp8_e4m3:nosat"])
def test_triton_decode_in_the_loop(tiny_models, arch, spec):
    model = InProcessModel.load(tiny_models[arch], device="cuda")
    assert model.use_kernels
    generation = model.backend(parse_path(spec)).generate_sync(CHAT, 16)
    assert generation.metrics["kernel_steps"] > 0
    # Kernel vs fp64 over the same cache, relative to SDPA bf16's own error on the same inputs: both
    # accumulate in fp32 and round the output to bf16 once (KERNEL_ERR_RATIO_BOUND says where 4.0 comes from).
    assert generation.metrics["kernel_err_ratio"] <= KERNEL_ERR_RATIO_BOUND, generation.metrics


@pytest.mark.gpu
def test_bf16_path_stays_bit_identical_on_gpu(tiny_models):
    model = InProcessModel.load(tiny_models["gqa"], device="cuda")
    reference = model.backend(None).score_sync(CHAT, [30, 31, 32])
    scored = model.backend(parse_path("bf16:calibrated")).score_sync(CHAT, [30, 31, 32])
    assert (scored.logprobs == reference.logprobs).all()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_plugins_on_cuda_give_the_same_replies(tiny_models, arch):
    """Our Triton kernel, the dequantise-everything workaround and a user kernel defined in a test file
    (tests/test_decode_plugins.py), each through the decode-kernel contract on CUDA: same tokens, each
    within the agreement bound against fp64 over the stored codes, and each timed."""
    model = InProcessModel.load(tiny_models[arch], device="cuda")
    replies = {}
    for kernel in ("", ":kernel=dequant", ":kernel=test_decode_plugins:UserKernel"):
        generation = model.backend(parse_path("fp8_e4m3:per_head:calibrated" + kernel)).generate_sync(CHAT, 16)
        assert generation.metrics["kernel_steps"] > 0 and generation.metrics["kernel_ms_per_step"] > 0
        assert generation.metrics["kernel_err_ratio"] <= KERNEL_ERR_RATIO_BOUND, (kernel, generation.metrics)
        replies[kernel] = generation.token_ids
    assert len({tuple(ids) for ids in replies.values()}) == 1, replies


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["fp8_e4m3:fp8_q:fp8_p", "fp8_e4m3:per_head:calibrated:fp8_q:fp8_p"])
def test_fp8_attention_decodes_through_triton(tiny_models, spec):
    """FP8 attention (q_scale / prob_scale) on CUDA: decode steps run our Triton kernel with the path's scales,
    judged against fp64 attention of the raw query over the stored codes relative to the torch reference's FP8
    attention on the same step (the same quantisation steps, rounded at other places: errors of one size)."""
    model = InProcessModel.load(tiny_models["gqa"], device="cuda")
    backend = model.backend(parse_path(spec))
    assert backend.describe()["decode_kernel"] == "triton (kernels/)"
    generation = backend.generate_sync(CHAT, 16)
    assert generation.metrics["kernel_steps"] > 0
    assert 0.0 < generation.metrics["kernel_err_ratio"] <= KERNEL_ERR_RATIO_BOUND, generation.metrics


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["fp8_e4m3:fp8_q:fp8_p", "fp8_e4m3:per_head:calibrated:fp8_q:fp8_p"])
def test_mla_fp8_attention_decodes_through_triton(tiny_models, monkeypatch, spec):
    """FP8 attention on the MLA canary: decode runs kernels/mla_decode.py with the path's scales (the absorbed
    query quantised, as engines' MLA kernels do), within the agreement bound relative to the torch reference's
    FP8 attention error, and gives the torch-reference route's tokens (HARNESS_KERNELS=off: attention_fp8 on the
    model's own query) but where the two part at a near tie. The two routes round P at other places (the kernel
    tile-relative, the reference after normalising), so their logits differ by more than bf16 noise: a parting is
    a near tie when the torch route's top-2 gap there is within twice the largest logit difference the two routes
    showed on the kernel steps before it (each top-2 logit may move by that much, in opposite directions). The CPU run
    of the same comparison, through the kernel's torch mirror, matched 16/16; an H100 parted at token 6."""
    model = InProcessModel.load(tiny_models["mla"], device="cuda")
    backend = model.backend(parse_path(spec))
    assert backend.describe()["decode_kernel"] == "triton (kernels/)"
    prompt = model.encode_chat(CHAT)
    kernel_logits = []
    ids, _, metrics = backend.greedy_ids(prompt, 12, on_step=lambda logits, _: kernel_logits.append(logits.float()))
    assert metrics["kernel_steps"] > 0
    assert 0.0 < metrics["kernel_err_ratio"] <= KERNEL_ERR_RATIO_BOUND, metrics
    monkeypatch.setenv("HARNESS_KERNELS", "off")
    torch_route = InProcessModel.load(tiny_models["mla"], device="cuda").backend(parse_path(spec))
    assert "kernels off" in torch_route.describe()["decode_kernel"]
    torch_logits = []
    reference, _, ref_metrics = torch_route.greedy_ids(prompt, 12,
                                                       on_step=lambda logits, _: torch_logits.append(logits.float()))
    assert "kernel_steps" not in ref_metrics
    if ids == reference:
        return
    first = next(i for i, (a, b) in enumerate(zip(ids, reference)) if a != b)
    # step 0 is the prefill (torch attention_fp8 on both routes: the same logits); the kernel serves steps 1 on
    assert first > 1, "the routes part at the first kernel step (no shared kernel step to measure their difference)"
    spread = max(float((k - t).abs().max()) for k, t in zip(kernel_logits[1:first], torch_logits[1:first]))
    top = torch_logits[first].topk(2).values
    gap = float(top[0] - top[1])
    assert gap <= 2 * spread, (first, gap, spread, ids, reference)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:per_head:calibrated", "int4_per_token_head", "mxfp8", "mxfp4",
                                  "fp4_mx_block16", "fp8_per_token_head", "int8_per_token_head"])
def test_cuda_decode_in_the_loop(head64_model, spec, monkeypatch):
    """Every block-scaled format at heads of 64 decodes through the CUDA kernel (kernels/gqa_decode_block_scaled.cu;
    counted, so a refusal that quietly ran the Triton kernel fails) and passes the engine's own check of it against
    fp64."""
    from kernels import gqa_decode_cuda
    calls = []
    real = gqa_decode_cuda.decode
    monkeypatch.setattr(gqa_decode_cuda, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    backend = InProcessModel.load(head64_model, device="cuda").backend(parse_path(spec))
    generation = backend.generate_sync(CHAT, 16)
    assert calls, f"the {spec} decode did not run the CUDA kernel"
    assert generation.metrics["kernel_steps"] > 0
    assert generation.metrics["kernel_err_ratio"] <= KERNEL_ERR_RATIO_BOUND, generation.metrics


@pytest.mark.gpu
@pytest.mark.parametrize(("spec", "layout"), [("fp8_ds_mla", ("e4m3", "fp32", 128)), ("nvfp4", ("e2m1", "e4m3", 16)),
                                              ("nvfp4_ds_mla", ("e2m1", "e4m3", 16)), ("mxfp8", ("e4m3", "e8m0", 32)),
                                              ("mxfp4", ("e2m1", "e8m0", 32))])
def test_mla_latent_decodes_through_the_cuda_kernel_from_records(ds_latent_model, monkeypatch, spec, layout):
    """vLLM's fp8_ds_mla and nvfp4_ds_mla, NVFP4 and MX, on a DeepSeek-V3 at the engine's latent shape (512 + RoPE 64,
    16 heads): decode steps run kernels/mla_decode_block_scaled.cu over pages that hold [codes | block scales | k_pe]
    as one record a token (one copy a row; counted, so a refusal that quietly ran another kernel, or three tensors,
    fails) and pass the engine's own check of it against fp64."""
    from kernels import mla_block_scaled_cuda
    calls = []
    real = mla_block_scaled_cuda.decode

    def counted(*args, **kwargs):
        calls.append((args[-1], mla_block_scaled_cuda.is_record(*args[2:5])))
        return real(*args, **kwargs)

    monkeypatch.setattr(mla_block_scaled_cuda, "decode", counted)
    backend = InProcessModel.load(ds_latent_model, device="cuda").backend(parse_path(spec))
    assert backend.describe()["decode_kernel"] == "triton (kernels/)"
    generation = backend.generate_sync(CHAT, 16)
    assert calls and set(calls) == {(layout, True)}, calls
    assert generation.metrics["kernel_steps"] > 0
    assert 0.0 < generation.metrics["kernel_err_ratio"] <= KERNEL_ERR_RATIO_BOUND, generation.metrics


@pytest.mark.gpu
@pytest.mark.parametrize("arch, spec", [
    ("head32", "nvfp4:per_head:calibrated"), ("head32", "nvfp4"), ("head32", "mxfp8"), ("head32", "mxfp4"),
    ("head32", "int4_per_token_head"), ("head32", "int8_per_token_head"), ("head32", "fp8_per_token_head"),
    ("hybrid", "int8_per_token_head"), ("gqa", "fp8_per_token_head"),
    ("mla", "nvfp4"), ("mla", "mxfp8"), ("mla", "int4_per_token_head")])   # MLA: mla_decode_block_scaled
def test_block_scaled_decode_in_the_loop(tiny_models, head32_model, arch, spec):
    """Block-scaled formats decode through kernels/decode_attention_block_scaled.py over pages the fused write
    stored (a model with heads of 32 values, so MX blocks and 4-bit values fit; the tiny models' 16 for one scale a
    head), judged as the FP8 paths are: its error against fp64 over the stored values, over SDPA's on the
    read-back values."""
    model = InProcessModel.load(head32_model if arch == "head32" else tiny_models[arch], device="cuda")
    backend = model.backend(parse_path(spec))
    assert backend.describe()["decode_kernel"] == "triton (kernels/)"
    generation = backend.generate_sync(CHAT, 16)
    assert generation.metrics["kernel_steps"] > 0
    assert generation.metrics["kernel_err_ratio"] <= KERNEL_ERR_RATIO_BOUND, generation.metrics
