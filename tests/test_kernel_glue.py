"""The harness's decode-kernel path (paged FP8 copy + absorbed MLA), exercised with the torch reference
ops standing in for the Triton launchers (HARNESS_KERNELS=reference), so it runs on the CPU; the same
code with the real kernels runs under --gpu in tests/test_harness_gpu.py."""

import pytest

from harness.kv_paths.spec import parse_path
from harness.replay.inprocess import InProcessModel
from harness.types import Message

CHAT = [Message("user", "What is 7 * 8 + 3 * 4? Then tell me more.")]


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
@pytest.mark.parametrize("spec", ["fp8_e4m3", "fp8_e5m2:per_head:calibrated"])
def test_kernel_path_agrees_with_torch(tiny_models, monkeypatch, arch, spec):
    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    model = InProcessModel.load(tiny_models[arch])
    backend = model.backend(parse_path(spec))
    generation = backend.generate_sync(CHAT, 8)
    attention_layers = 1 if arch == "hybrid" else 2
    assert generation.metrics["kernel_steps"] == attention_layers * (len(generation.token_ids) - (
        generation.finish_reason == "length"))  # one kernel call per decode step per attention layer
    # The reference ops round the output to bf16 once, as SDPA does: their error against fp64 must be
    # within a small multiple of SDPA's own (MLA adds the absorbed projections' rounding: hence 4, not 2).
    assert generation.metrics["kernel_err_ratio"] <= 4.0
    assert backend.describe()["decode_kernel"] == "triton (kernels/)"


def test_per_token_paths_say_why_no_kernel(tiny_models, monkeypatch):
    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    backend = InProcessModel.load(tiny_models["gqa"]).backend(parse_path("fp8_e4m3:per_token"))
    assert "per-token" in backend.describe()["decode_kernel"]
    assert "kernel_steps" not in backend.generate_sync(CHAT, 3).metrics


@pytest.mark.parametrize("arch", ["gqa", "mla"])
@pytest.mark.parametrize("spec", ["fp8_e4m3:fp8_q:fp8_p", "fp8_e4m3:per_head:calibrated:fp8_p",
                                  "fp8_e4m3:calibrated:fp8_q"])
def test_fp8_attention_decodes_through_the_kernel_ops(tiny_models, monkeypatch, arch, spec):
    """FP8 attention (q_scale / prob_scale) on a GQA or MLA model: decode steps go to the kernel ops with the
    path's scales (here their torch mirror, which computes the Triton kernels' definition: MLA quantises the
    absorbed query), judged against fp64 attention of the raw query over the stored codes relative to the torch
    reference's FP8 attention error."""
    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    backend = InProcessModel.load(tiny_models[arch]).backend(parse_path(spec))
    assert backend.describe()["decode_kernel"] == "triton (kernels/)"
    generation = backend.generate_sync(CHAT, 8)
    steps = len(generation.token_ids) - (generation.finish_reason == "length")
    assert generation.metrics["kernel_steps"] == 2 * steps   # one kernel call per decode step per attention layer
    # same quantisation steps, rounded at different places (tile-relative vs normalised P): errors of one size
    assert 0.0 < generation.metrics["kernel_err_ratio"] <= 4.0, generation.metrics


@pytest.mark.parametrize("arch, spec", [("mla", "fp8_e4m3:fp8_q:fp8_p:kernel=dequant"),
                                        ("gqa", "fp8_e4m3:fp8_p:kernel=dequant")])
def test_fp8_attention_elsewhere_stays_in_the_torch_reference(tiny_models, monkeypatch, arch, spec):
    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    backend = InProcessModel.load(tiny_models[arch]).backend(parse_path(spec))
    assert "torch reference" in backend.describe()["decode_kernel"]
    assert "kernel_steps" not in backend.generate_sync(CHAT, 3).metrics


@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_fp8_attention_scales_reach_the_kernel(tiny_models, monkeypatch, arch):
    """The path's q_scale / prob_scale arrive at the kernel op unchanged on every decode step (a plain route that
    dropped them would still agree with fp64 and pass the ratio check above)."""
    from kernels import reference

    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    name = "mla_decode" if arch == "mla" else "decode_attention"
    seen, original = [], getattr(reference, name)

    def spy(*args, **kwargs):
        seen.append((kwargs.get("q_scale"), kwargs.get("prob_scale")))
        return original(*args, **kwargs)

    monkeypatch.setattr(reference, name, spy)
    backend = InProcessModel.load(tiny_models[arch]).backend(parse_path("fp8_e4m3:fp8_q:fp8_p"))
    generation = backend.generate_sync(CHAT, 3)
    assert len(seen) == generation.metrics["kernel_steps"] > 0
    for q_scale, prob_scale in seen:   # the default scale source: 1.0 for both (engines' default)
        assert q_scale.shape == () and q_scale.item() == 1.0 and prob_scale.shape == () and prob_scale.item() == 1.0


def test_mla_fp8_attention_kernel_route_keeps_the_torch_routes_tokens(tiny_models, monkeypatch):
    """The MLA canary with fp8_q / fp8_p: decode through the kernel op (its torch mirror here; the absorbed query
    quantised) and the torch-reference route (attention_fp8 on the model's query; HARNESS_KERNELS=off) quantise
    different tensors at the same scales, and give the same greedy tokens (16/16 when written)."""
    tokens = {}
    for mode in ("reference", "off"):
        monkeypatch.setenv("HARNESS_KERNELS", mode)
        generation = InProcessModel.load(tiny_models["mla"]).backend(parse_path("fp8_e4m3:fp8_q:fp8_p")).generate_sync(
            CHAT, 12)
        assert ("kernel_steps" in generation.metrics) == (mode == "reference")
        tokens[mode] = generation.token_ids
    assert tokens["reference"] == tokens["off"]


def test_mla_fp8_attention_with_odd_dims_says_why_no_kernel(tiny_models, monkeypatch):
    """mla_decode refuses q_scale / prob_scale for non-power-of-two latent / RoPE dims (its tile kernel only):
    on such a model the path decodes in the torch reference and says so, rather than failing at the first step."""
    from harness.replay.route import decide

    monkeypatch.delenv("HARNESS_KERNELS", raising=False)  # auto: our Triton kernels, as on CUDA
    model = InProcessModel.load(tiny_models["mla"])
    path = parse_path("fp8_e4m3:fp8_q:fp8_p")
    monkeypatch.setattr(model.model.config, "kv_lora_rank", 24)
    route = decide(path, model.model.config, "cuda", use_kernels=True)
    assert route.kernel is None and "power-of-two latent and RoPE dims (this model: (24, 16))" in route.kernel_label
    monkeypatch.setattr(model.model.config, "kv_lora_rank", 32)
    route = decide(path, model.model.config, "cuda", use_kernels=True)
    assert route.kernel == "triton" and route.kernel_label == "triton (kernels/)"


@pytest.mark.parametrize("arch, spec", [("head32", "nvfp4:per_head:calibrated"), ("head32", "mxfp8"),
                                        ("head32", "int4_per_token_head"), ("hybrid", "int8_per_token_head"),
                                        ("mla", "nvfp4"), ("mla", "mxfp8"), ("mla", "int4_per_token_head")])
def test_block_scaled_paths_decode_through_the_kernel_ops(tiny_models, head32_model, monkeypatch, arch, spec):
    """A block-scaled format's decode steps go to the built-in's block-scaled decode (its torch mirror here) over
    pages in the kernels' layout (harness/kv_paths/block_layout.py), judged against fp64 attention over the stored
    codes (MLA: the latent's, k_pe in bf16 beside it). The mirror computes in fp32 over the exact stored values and
    rounds once; torch's attention reads the read-back rounded to bf16: its error is the larger, so 2x absorbs
    max-abs noise."""
    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    backend = InProcessModel.load(head32_model if arch == "head32" else tiny_models[arch]).backend(parse_path(spec))
    assert backend.describe()["decode_kernel"] == "triton (kernels/)"
    generation = backend.generate_sync(CHAT, 8)
    layers = 1 if arch == "hybrid" else 2
    assert generation.metrics["kernel_steps"] == layers * (len(generation.token_ids) - (
        generation.finish_reason == "length"))
    # MLA adds the absorbed projections' rounding (as test_kernel_path_agrees_with_torch): 4 there
    bound = 4.0 if arch == "mla" else 2.0
    assert 0.0 < generation.metrics["kernel_err_ratio"] <= bound, generation.metrics


@pytest.mark.parametrize("arch, spec, reason", [
    ("mla", "int8_per_token_head_asym", "mla_decode takes e4m3, e5m2, mla_decode_block_scaled nvfp4"),
    ("gqa", "int8_per_token_head_asym", "no decode kernel serves int8_per_token_head_asym (int8_per_token_head_asym: "
                                        "a zero point"),
    ("gqa", "k=nvfp4/v=mxfp8", "reads K and V in one format"),
    ("gqa", "mxfp8", "head size 16"),   # the tiny models' heads hold 16 values: no whole block of 32
    ("gqa", "nvfp4", "heads of 32 values or more"),
])
def test_block_scaled_paths_the_kernels_do_not_serve_say_why(tiny_models, monkeypatch, arch, spec, reason):
    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    backend = InProcessModel.load(tiny_models[arch]).backend(parse_path(spec))
    assert reason in backend.describe()["decode_kernel"], backend.describe()["decode_kernel"]
