"""The route object (harness/replay/route.py): every "why not a kernel / a batch / kernel rows" of the in-process
engine, decided from the path, the model's config, the device type, HARNESS_KERNELS and the run's options."""

from types import SimpleNamespace

import pytest

from harness.kv_paths.spec import parse_path
from harness.replay.route import EVERY_CALL_EAGER, ONE_AT_A_TIME, decide

GQA = SimpleNamespace()  # a full-attention model: no MLA dims, no layer types, no sliding window
MLA = SimpleNamespace(kv_lora_rank=64, qk_rope_head_dim=16)


def test_cpu_decodes_in_torch_one_sequence_at_a_time(monkeypatch):
    monkeypatch.delenv("HARNESS_KERNELS", raising=False)
    route = decide(parse_path("fp8_e4m3"), GQA, "cpu", use_kernels=False)
    assert route.kernel is None and route.kernel_label == "kernels off (CPU, or HARNESS_KERNELS=off)"
    assert route.decode == ONE_AT_A_TIME and route.batch_refusal is None and route.capture is None
    assert route.describe()["batched"] is False


@pytest.mark.parametrize("spec, device, use_kernels, kernel, refusal", [
    ("fp8_e4m3", "cuda", True, "triton", None),
    ("bf16", "cuda", True, None, "not an FP8 path"),
    ("fp8_e4m3:per_token", "cuda", True, None, "per-token scales"),
    ("fp8_e4m3:kernel=reference", "cpu", False, "reference", None),  # a named plug-in runs on any device
    ("fp8_e4m3:fp8_q:kernel=dequant", "cuda", True, None, "only our kernels"),
])
def test_kernel_or_the_reason_for_none(monkeypatch, spec, device, use_kernels, kernel, refusal):
    monkeypatch.delenv("HARNESS_KERNELS", raising=False)
    route = decide(parse_path(spec), MLA, device, use_kernels)
    assert route.kernel == kernel
    assert (route.kernel_refusal is None) if refusal is None else (refusal in route.kernel_refusal)


def test_batch_and_decode_mode_and_their_refusals(monkeypatch):
    monkeypatch.delenv("HARNESS_KERNELS", raising=False)
    assert decide(parse_path("fp8_e4m3"), GQA, "cuda", True, batched=True).decode == "graph"
    assert decide(parse_path("fp8_e4m3"), GQA, "cpu", False, batched=True).decode == "dynamic"
    # a sliding window keeps static storage (its mask windows it); a layer kind without it decodes dynamically
    windowed = SimpleNamespace(sliding_window=4096, use_sliding_window=True)
    assert decide(parse_path("fp8_e4m3"), windowed, "cuda", True, batched=True).decode == "graph"
    hybrid_attention = SimpleNamespace(layer_types=["full_attention", "hybrid_sliding"], num_hidden_layers=2)
    assert decide(parse_path("fp8_e4m3"), hybrid_attention, "cuda", True, batched=True, decode="static").decode == \
        "dynamic (static decode refused for this model: layer types ['hybrid_sliding'])"
    # a kernel= plug-in batches with every call judged and timed: eagerly, on static storage, where graphs were asked
    plugin = decide(parse_path("fp8_e4m3:kernel=reference"), GQA, "cuda", True, batched=True)
    assert plugin.batch_refusal is None and plugin.kernel_every_call and plugin.decode == EVERY_CALL_EAGER
    assert decide(parse_path("fp8_e4m3:kernel=dequant"), GQA, "cpu", False, batched=True).decode == "dynamic"
    assert decide(parse_path("fp8_e4m3:kernel=dequant"), hybrid_attention, "cuda", True,
                  batched=True).decode.startswith("dynamic (static decode refused")
    ours = decide(parse_path("fp8_e4m3"), GQA, "cuda", True, batched=True)
    assert ours.kernel == "triton" and not ours.kernel_every_call  # ours: checked every kernel_check_every-th step
    # FP8 attention and fault injectors batch; FP8 attention is bounded by its own measured floor, not the reference's
    fp8_attention = decide(parse_path("fp8_e4m3:fp8_q:fp8_p"), GQA, "cuda", True, batched=True)
    assert fp8_attention.batch_refusal is None and fp8_attention.decode == "graph"
    assert fp8_attention.batch_floor == "own" and fp8_attention.describe()["batch_floor"] == "own"
    fault = decide(parse_path("fp8_e4m3:fault=scale_off"), GQA, "cpu", False, batched=True)
    assert fault.batch_refusal is None and fault.decode == "dynamic" and fault.batch_floor == "reference"
    assert decide(parse_path("fp8_e4m3:fp8_q"), GQA, "cpu", False).batch_floor is None  # not batched: no floor


def test_capture_measures_kernel_rows_only_where_the_kernel_decodes(monkeypatch):
    monkeypatch.delenv("HARNESS_KERNELS", raising=False)
    plain = decide(parse_path("fp8_e4m3"), GQA, "cuda", True, batched=True, capture=True)
    assert plain.capture_kernel == "triton" and plain.capture == "torch rows and kernel:triton rows"
    # capture batches: its own pass runs one sequence at a time beside the batched replay (PrecomputedBackend)
    assert plain.batch_refusal is None and plain.decode == "graph"
    scaled = decide(parse_path("fp8_e4m3:fp8_q:fp8_p"), GQA, "cuda", True, capture=True)
    assert scaled.kernel == "triton" and scaled.capture_kernel is None and "q/prob scales" in scaled.capture
    cpu = decide(parse_path("fp8_e4m3"), GQA, "cpu", False, capture=True)
    assert cpu.capture == "torch rows (no decode kernel)"


def test_the_environment_variable_is_read_and_checked(monkeypatch):
    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    assert decide(parse_path("fp8_e4m3"), GQA, "cpu", use_kernels=True).kernel == "reference"
    monkeypatch.setenv("HARNESS_KERNELS", "on")
    with pytest.raises(ValueError, match="HARNESS_KERNELS='on': expected one of auto, off, reference"):
        decide(parse_path("fp8_e4m3"), GQA, "cpu", use_kernels=True)
