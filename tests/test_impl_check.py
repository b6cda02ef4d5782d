"""The implementation check and the attention-arithmetic fault injectors.

Faults (harness/kv_paths/faults.py) are judged as every low-precision result here is: their error against an
fp64 reference relative to torch's own error (SDPA in bf16 on the same inputs). Each must be a real fault
(clearly above torch's error) and a small one (a few percent at most), and with no fault the injector's
arithmetic is exactly the declared computation (`kernels.reference.attention_fp8`).

The probe (harness/kv_paths/impl_check.py) is tested on the bundled canaries: a healthy path, FP8 attention
included, sits near 1; each fault sits above the default fail limit.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.analysis.verdicts import DEFAULT_THRESHOLDS
from harness.job import CANARY_WEIGHTS
from harness.kv_paths import impl_check
from harness.kv_paths.cache import AttentionQuant
from harness.kv_paths.faults import FAULTS, bf16_accumulated, faulty_attention, poly_exp
from harness.kv_paths.spec import PathSpecError, parse_path
from harness.types import Message
from kernels.reference import amax_scale, attention_fp8

IMPL = next(t for t in DEFAULT_THRESHOLDS if t.metric == "attn_impl_err_ratio")
CHAT = [Message("system", "You are a helpful sales assistant for a SaaS product."),
        Message("user", "What pricing plans do you offer? I really like olive, it is my favourite colour.")]


def _inputs(seed: int = 0, heads: int = 4, kv_heads: int = 2, length: int = 37, dim: int = 32):
    """Awkward length (37) and GQA grouping; logits spread like a trained model's (std ~3 after scaling)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, length, dim, generator=g) * 2.0).bfloat16()
    k = (torch.randn(1, kv_heads, length, dim, generator=g) * 1.5).bfloat16()
    v = torch.randn(1, kv_heads, length, dim, generator=g).bfloat16()
    return q, k, v


def _exact(q, k, v, scaling):
    group = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = (q.double() @ k64.transpose(-1, -2)) * scaling
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return (torch.softmax(logits.masked_fill(~causal, -math.inf), -1) @ v64).transpose(1, 2)


def _torch_error(q, k, v, scaling):
    group = q.shape[1] // k.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                                            v.repeat_interleave(group, 1), is_causal=True,
                                                            scale=scaling).transpose(1, 2)
    exact = _exact(q, k, v, scaling)
    return (sdpa.double() - exact).norm().item(), exact


def test_no_fault_is_the_declared_computation_bit_for_bit():
    q, k, v = _inputs()
    scaling = q.shape[-1] ** -0.5
    quant = AttentionQuant(amax_scale(q.float().abs().amax(), "e4m3"), amax_scale(torch.tensor(1.0), "e4m3"))
    for declared in (None, quant):
        expected, _ = attention_fp8(q, k, v, scaling, None, *(declared and (declared.q_scale, declared.prob_scale)
                                                                or (None, None)))
        assert torch.equal(faulty_attention("", q, k, v, scaling, None, declared), expected)


# Each fault's error / torch's (SDPA bf16) error on the same inputs, and its relative output error. Measured on
# these inputs (seeds 0-2, 37 keys): scores_bf16 2.3-2.6x, scale_off 2.5-2.8x, exp_poly 2.8-2.9x, pv_bf16 1.9-2.2x
# (grows with the keys summed), k_scale_swap 19-22x, p_e5m2 34-37x; relative errors 0.33%-6.2%. The lower
# bound (about 80% of the smallest measured) says torch's own rounding cannot explain it; the cap (10% relative)
# says it is a small fault, not a broken path.
@pytest.mark.parametrize("fault, min_ratio", [("scores_bf16", 1.8), ("scale_off", 2.0), ("exp_poly", 2.2),
                                              ("pv_bf16", 1.5), ("k_scale_swap", 15.0), ("p_e5m2", 25.0)])
def test_each_fault_is_real_and_small(fault, min_ratio):
    q, k, v = _inputs(seed=1)
    scaling = q.shape[-1] ** -0.5
    torch_err, exact = _torch_error(q, k, v, scaling)
    quant, k_scale = None, None
    if fault == "p_e5m2":  # measured against the declared e4m3 P in fp64: the e4m3 rounding itself is no fault
        quant = AttentionQuant(None, amax_scale(torch.tensor(1.0), "e4m3"))
        group = q.shape[1] // k.shape[1]
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        exact = impl_check._attention_fp8_64(q[0], k[0].double().repeat_interleave(group, 0),
                                             v[0].double().repeat_interleave(group, 0), causal, scaling,
                                             quant).transpose(0, 1).unsqueeze(0)
    if fault == "k_scale_swap":
        k_scale = torch.tensor([0.010, 0.011])  # neighbouring heads' scales 10% apart
    out = faulty_attention(fault, q, k, v, scaling, None, quant, k_scale).double()
    error = (out - exact).norm().item()
    assert error / torch_err >= min_ratio, f"{fault}: {error / torch_err:.2f}x torch's error"
    assert error / exact.norm().item() < 0.10, f"{fault}: {error / exact.norm().item():.3f} relative"


def test_poly_exp_and_bf16_accumulator():
    x = torch.linspace(-30, 0, 10001, dtype=torch.float64)
    rel = (poly_exp(x) / torch.exp(x) - 1).abs()
    assert 0.03 < rel.max() < 0.034  # 1 - (1 + f + f^2/2)/e^f at f -> ln 2 = 3.33%
    assert poly_exp(torch.tensor([-math.inf]))[0] == 0 and poly_exp(torch.tensor([0.0]))[0] == 1
    p = torch.softmax(torch.randn(3, 4, 50, dtype=torch.float32), -1)
    v = torch.randn(3, 50, 8)
    exact = p.double() @ v.double()
    acc = bf16_accumulated(p, v).double()
    # 50 bf16 roundings of the running sum, each <= 2^-9 relative: a random walk of ~sqrt(50) x 2^-9 / sqrt(3)
    assert (acc - exact).abs().max() < 8 * 2 ** -9 * exact.abs().max() + 1e-6
    assert not torch.equal(acc, (p @ v).double())


def test_fault_specs_are_validated():
    assert parse_path("fp8_e4m3:calibrated:fault=exp_poly").fault == "exp_poly"
    assert "fault=pv_bf16" in parse_path("bf16:fault=pv_bf16").canonical
    assert "fault injector" in parse_path("fp8_e4m3:fault=scale_off").describe()
    assert not parse_path("fp8_e4m3:calibrated").fault  # never a default
    for spec, message in (("fp8_e4m3:fault=nope", "unknown fault 'nope'"),
                          ("fp8_e4m3:calibrated:fault=p_e5m2", "add fp8_p"),
                          ("fp8_e4m3:calibrated:fault=k_scale_swap", "per_head"),
                          ("bf16:fault=k_scale_swap", "per_head"),
                          ("fp8_e4m3:fault=exp_poly:fault=scale_off", "sets fault twice"),
                          ("fp8_e4m3:per_token:fault=scale_dropped", "per_tensor or per_head"),
                          ("bf16:fault=scale_dropped", "per_tensor or per_head")):
        with pytest.raises(PathSpecError, match=message):
            parse_path(spec)
    from harness.kv_paths.format_faults import FORMAT_FAULTS

    assert set(FAULTS) - set(FORMAT_FAULTS) == {"scores_bf16", "scale_off", "exp_poly", "pv_bf16", "k_scale_swap",
                                               "p_e5m2", "scale_dropped"}


def test_probe_samples_decode_steps_and_skips_batched_calls():
    class Module:
        layer_idx = 0

    probe = impl_check.ImplProbe(options=impl_check.ProbeOptions(rows=2, max_heads=2, decode_every=4))
    q, k, v = _inputs(length=9)
    scaling = q.shape[-1] ** -0.5
    out = _exact(q, k, v, scaling).to(torch.bfloat16)
    probe.observe(Module(), q, k, v, None, scaling, out)  # prefill chunk: 2 rows x 2 heads
    for step in range(9):  # decode steps 0 and 4 and 8 are probed
        probe.observe(Module(), q[:, :, -1:], k, v, None, scaling, out[:, -1:])
    probe.observe(Module(), q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), None,
                  scaling, out.expand(2, -1, -1, -1))
    record = probe.as_record()
    assert record["attn_impl_rows"] == 2 * 2 + 3 * 1 * 2 and probe.skipped_batched == 1
    # the output here is fp64 attention rounded once to bf16: no worse than SDPA's own
    assert record["attn_impl_err_ratio"] < 1.5


def test_a_batch_is_probed_row_by_row_each_on_its_own_real_tokens():
    """Two sequences in one left-padded batch (row 0 padded by 5): each row is judged on its own real queries under
    its own mask row, pooled into its own ratio. Row 1's output carries a 1% error (a fault), row 0's is exact
    attention rounded once to bf16: row 0 stays healthy, row 1 fails; rows that leave the batch keep their row."""
    from types import SimpleNamespace

    class Module:
        layer_idx = 0

    pad, length = 5, 37
    q, k, v = (torch.cat([t, t.roll(1, dims=2)]) for t in _inputs(length=length))  # [2, H, L, D], rows differ
    scaling = q.shape[-1] ** -0.5
    real = torch.ones(2, length, dtype=torch.long)
    real[0, :pad] = 0
    keys = torch.arange(length)
    mask = (keys[None, :] <= keys[:, None])[None, None].repeat(2, 1, 1, 1)  # [2, 1, L, L] causal
    mask[0, :, :, :pad] = False  # row 0 attends to none of its pads
    mask[0, :, :pad, :pad] = torch.eye(pad, dtype=torch.bool)  # a pad query attends to itself (none left empty)
    out = torch.empty(2, length, q.shape[1], v.shape[-1], dtype=torch.bfloat16)
    row0 = _exact(q[:1, :, pad:], k[:1, :, pad:], v[:1, :, pad:], scaling)  # row 0's real tokens alone
    out[0, pad:] = row0[0].to(torch.bfloat16)
    out[0, :pad] = float("nan")  # pad queries: never read
    out[1] = (_exact(q[1:], k[1:], v[1:], scaling)[0] * 1.01).to(torch.bfloat16)
    step = SimpleNamespace(valid=real)
    probe = impl_check.ImplProbe(options=impl_check.ProbeOptions(rows=4, max_heads=4), step=step, live=[0, 1])
    probe.observe(Module(), q, k, v, mask, scaling, out)  # prefill: 4 real queries of each row
    probe.select(torch.tensor([1]))  # row 0 leaves the batch; the batch's position 0 is now row 1
    step.valid = torch.ones(1, 1, dtype=torch.long)
    probe.observe(Module(), q[1:, :, -1:], k[1:], v[1:], mask[1:, :, -1:], scaling, out[1:, -1:])  # decode step 0
    healthy, faulty = probe.row_records(2)
    assert healthy["attn_impl_rows"] == 4 * 4 and faulty["attn_impl_rows"] == (4 + 1) * 4
    # exact attention rounded once to bf16 sits at or below SDPA's own error (ratio ~1); a 1% error is ~100x it
    assert healthy["attn_impl_err_ratio"] < IMPL.warn, healthy
    assert faulty["attn_impl_err_ratio"] > IMPL.fail, faulty


@pytest.fixture(scope="module")
def canaries():
    from harness.replay.inprocess import InProcessModel

    return {name: InProcessModel.load(CANARY_WEIGHTS / name) for name in ("gqa", "mla", "hybrid")}


# On the hybrid canary's short chat (140 tokens) the faults that perturb the probabilities slightly read 1.45
# (scores_bf16) and 1.44 (exp_poly) on the CPU, 1.72 (scores_bf16) on an H100, in the warn band: its two attention
# layers attend broadly there, and a small error per probability averages out over the keys. They fail at 684
# tokens on the CPU (2.31, 2.08; a README excerpt as the user turn) and exp_poly fails in the zoo's canary run.
# Strict: when the check starts to separate them on the short chat, this test says so.
HYBRID = pytest.param("hybrid", marks=pytest.mark.xfail(strict=True, reason="scores_bf16 and exp_poly read "
                      "1.44-1.45 on the hybrid canary's short chat, below the fail limit (measured)"))
HEALTHY = ("bf16", "fp8_e4m3", "fp8_e4m3:per_head:calibrated", "fp8_e5m2", "fp8_e4m3:calibrated:fp8_q:fp8_p")
FAULT_PATHS = {"scores_bf16": "fp8_e4m3:calibrated:fault=scores_bf16", "scale_off": "fp8_e4m3:calibrated:fault=scale_off",
               "exp_poly": "fp8_e4m3:calibrated:fault=exp_poly", "pv_bf16": "fp8_e4m3:calibrated:fault=pv_bf16",
               "k_scale_swap": "fp8_e4m3:per_head:calibrated:fault=k_scale_swap",
               "p_e5m2": "fp8_e4m3:calibrated:fp8_p:fault=p_e5m2"}


def _ratio(model, spec: str) -> float:
    backend = model.backend(parse_path(spec))
    _, _, metrics = backend.greedy_ids(model.encode_chat(CHAT), 17)
    return metrics["attn_impl_err_ratio"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
def test_canary_healthy_paths_pass_the_default(canaries, arch):
    # every healthy path, the FP8-attention one included, below the warn limit: the check's yardstick is the larger
    # of SDPA's error and the rounding of the declared output to bf16 (healthy 0.95-1.10 on the three canaries)
    _healthy_pass(canaries[arch], arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gqa", "mla", HYBRID])
def test_canary_faults_fail_the_default(canaries, arch):
    _faults_fail(canaries[arch], arch)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
def test_canary_check_on_gpu_with_our_decode_kernels(arch):
    """On CUDA the FP8 paths decode through our Triton kernels (one sequence at a time, as greedy_ids runs); those
    decode steps are judged by kernel_err_ratio, so the check sees prefill and torch-served steps: a healthy path
    must sit below the warn limit there too."""
    from harness.replay.inprocess import InProcessModel

    _healthy_pass(InProcessModel.load(CANARY_WEIGHTS / arch, device="cuda"), arch)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gqa", "mla", HYBRID])
def test_canary_faults_fail_on_gpu(arch):
    """The fault injectors run torch attention (no kernel) on CUDA: above the fail limit there too."""
    from harness.replay.inprocess import InProcessModel

    _faults_fail(InProcessModel.load(CANARY_WEIGHTS / arch, device="cuda"), arch)


def _healthy_pass(model, arch: str) -> None:
    for spec in HEALTHY:
        assert _ratio(model, spec) <= IMPL.warn, f"{arch} {spec}: healthy path above the warn limit {IMPL.warn}"


def _faults_fail(model, arch: str) -> None:
    for fault, spec in FAULT_PATHS.items():
        if fault == "k_scale_swap" and arch == "mla":
            continue  # one latent scale per MLA cache: no other head's scale to take
        assert _ratio(model, spec) > IMPL.fail, f"{arch} {spec}: fault below the fail limit {IMPL.fail}"


def test_check_can_be_switched_off(canaries, monkeypatch):
    monkeypatch.setenv("HARNESS_IMPL_CHECK", "0")
    backend = canaries["gqa"].backend(parse_path("fp8_e4m3"))
    _, _, metrics = backend.greedy_ids(canaries["gqa"].encode_chat(CHAT), 3)
    assert "attn_impl_err_ratio" not in metrics


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows, heads, length, dim", [(12, 8, 96, 32), (32, 8, 700, 32), (5, 8, 300, 128)])
def test_sdpa_of_a_group_of_rows_is_each_rows_own(device, rows, heads, length, dim):
    """A GPU group's rows take SDPA in one call of torch's math backend (`_sdpa_rows`); the yardstick stays each
    row's own SDPA (its 3-D call, what one row alone gets), padded queries 0. The bound, 2 bf16 steps at the
    output's largest magnitude: cuBLAS may pick another GEMM for another batch count, which rounds elsewhere
    (measured on an H200: bit for bit at 4 of 5 shapes, 2^-12 at most at the 5th, 32 rows x 700 keys)."""
    g = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(rows, heads, n, dim, generator=g).bfloat16().to(device) for n in (4, length, length))
    valid = (torch.rand(rows, 1, 4, length, generator=g) > 0.2).to(device)
    valid[..., 0] = True
    real_queries = [1 + i % 4 for i in range(rows)]  # 1-4 real queries a row, the rest padding
    sampled = torch.tensor([[j < n for j in range(4)] for n in real_queries], device=device)[:, None, :]
    together = impl_check._sdpa_rows(q, k, v, valid, 0.17, sampled)
    alone = torch.cat([torch.nn.functional.pad(impl_check._sdpa_rows(  # each row alone, at its own width
        q[i:i + 1, :, :n], k[i:i + 1], v[i:i + 1], valid[i:i + 1, :, :n], 0.17), (0, 0, 0, 4 - n))
        for i, n in enumerate(real_queries)])
    assert together.dtype == alone.dtype == torch.float64 and together.shape == (rows, heads, 4, dim)
    assert (together.masked_select(~sampled[..., None]) == 0).all()
    step = 2.0 ** (math.floor(math.log2(alone.abs().max().item())) - 7)
    assert (together - alone).abs().max().item() <= 2 * step
