"""The bit-exact CPU shortcuts (harness/replay/cpu_exact.py): every comparison here is bit for bit (torch.equal),
since the shortcuts promise the model's own bits, not bits within a tolerance."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness.replay import cpu_exact
from harness.replay.inprocess import InProcessModel
from harness.types import Message

ROOT = Path(__file__).resolve().parent.parent
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # what a CPU without AVX-512 BF16 dispatches


def _latent_rows_linear(rows_in=64, rows_out=512) -> torch.nn.Linear:
    linear = torch.nn.Linear(rows_in, rows_out, bias=False).to(torch.bfloat16)
    if not cpu_exact._rows_are_independent(linear.weight):
        pytest.skip("this machine's bf16 GEMM gives a row different bits alone and among others: install refuses")
    linear.__class__ = cpu_exact.LatentRowsLinear
    linear.exact_dtype = torch.bfloat16
    return linear


@torch.inference_mode()
def test_latent_rows_give_the_plain_linears_bits_as_the_cache_grows_and_changes():
    linear = _latent_rows_linear()
    latent = cpu_exact._spread((1, 1, 40, 64), torch.bfloat16, seed=3)
    for length in range(1, 41):  # decode: one more cached row each step
        assert torch.equal(linear(latent[:, :, :length]), F.linear(latent[:, :, :length], linear.weight))
    other = latent.clone()
    other[:, :, 25] = -other[:, :, 25]  # another sequence sharing 25 rows: rows from 25 on are multiplied again
    assert cpu_exact._same_leading_rows(latent, other) == 25
    assert torch.equal(linear(other), F.linear(other, linear.weight))
    batch = cpu_exact._spread((3, 1, 12, 64), torch.bfloat16, seed=4)  # a different shape: nothing kept applies
    assert torch.equal(linear(batch), F.linear(batch, linear.weight))
    twin = copy.deepcopy(linear).float()  # the fp32 path's copy of the model: rows checked in bf16 only
    assert twin._kept is not None and torch.equal(twin(batch.float()), F.linear(batch.float(), twin.weight))


@torch.inference_mode()
def test_a_callers_edit_of_the_output_does_not_reach_the_kept_rows():
    linear = _latent_rows_linear()
    latent = cpu_exact._spread((1, 1, 9, 64), torch.bfloat16, seed=5)
    linear(latent[:, :, :8]).zero_()
    assert torch.equal(linear(latent), F.linear(latent, linear.weight))


def _replies(model: InProcessModel, spec):
    from harness.kv_paths.spec import parse_path

    backend = model.backend(parse_path(spec) if spec else None)
    chat = [Message("user", "what is seven plus five? and then what is it times three?")]
    generation = backend.generate_sync(chat, 24)
    return generation.token_ids, backend.score_sync(chat, generation.token_ids).logprobs


def test_mla_replay_is_bit_identical_with_the_latent_rows_kept(tiny_models):
    model = InProcessModel.load(tiny_models["mla"])
    assert model.cpu_shortcuts["mla_latent_rows"].startswith("installed"), model.cpu_shortcuts
    with_rows = [_replies(model, spec) for spec in (None, "fp8_e4m3")]
    kept = [m._kept for m in model.model.modules() if isinstance(m, cpu_exact.LatentRowsLinear)]
    assert kept and all(k is not None for k in kept)  # decode went through the kept rows
    for module in model.model.modules():
        if isinstance(module, cpu_exact.LatentRowsLinear):
            module.__class__ = torch.nn.Linear
    without = [_replies(model, spec) for spec in (None, "fp8_e4m3")]
    for (ids, logprobs), (plain_ids, plain_logprobs) in zip(with_rows, without):
        assert ids == plain_ids and torch.equal(logprobs, plain_logprobs)


def test_conv_with_a_bias_or_other_taps_is_torchs_own_call():
    """A bias is added first by oneDNN's kernel and last by torch's AVX2 fallback (measured): never taken over."""
    exact = cpu_exact._ExactConvFunctional(frozenset({4}))
    x = cpu_exact._spread((1, 32, 20), torch.bfloat16, seed=6)
    weight, bias = cpu_exact._spread((32, 1, 4), torch.bfloat16, seed=7), torch.ones(32, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(exact.conv1d(x, weight, bias, padding=3, groups=32),
                           F.conv1d(x, weight, bias, padding=3, groups=32))
        taps5 = cpu_exact._spread((32, 1, 5), torch.bfloat16, seed=8)
        assert torch.equal(exact.conv1d(x, taps5, None, padding=4, groups=32),
                           F.conv1d(x, taps5, None, padding=4, groups=32))
    assert exact.silu is F.silu  # every other name is torch's


def test_conv_shortcut_is_refused_where_onednn_has_bf16(tiny_models):
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bf16: the AVX2 test below covers it")
    model = InProcessModel.load(tiny_models["hybrid"])
    assert model.cpu_shortcuts["depthwise_conv1d_fp32"].startswith("not installed: oneDNN has bf16")


AVX2_CHECK = """
import sys, torch, torch.nn.functional as F
from harness.replay.inprocess import InProcessModel
from harness.types import Message
model = InProcessModel.load(sys.argv[1])
note = model.cpu_shortcuts["depthwise_conv1d_fp32"]
assert note.startswith("installed"), note
module = sys.modules[type(model.model).__module__]
chat = [Message("user", "recall the number 4417 and then count to ten")]
def replies():
    backend = model.backend(None)
    generation = backend.generate_sync(chat, 24)
    return generation.token_ids, backend.score_sync(chat, generation.token_ids).logprobs
(ids, logprobs), shortcut = replies(), module.F
module.F = F
plain_ids, plain_logprobs = replies()
module.F = shortcut
assert ids == plain_ids and torch.equal(logprobs, plain_logprobs), "the shortcut changed the bits"
print("bit-identical", len(ids), "tokens")
"""


def test_conv_shortcut_is_bit_identical_under_avx2_dispatch(avx2_dispatch):
    """Run as a CPU without AVX-512 BF16 runs (oneDNN capped at AVX2: no bf16 kernels): the shortcut installs,
    and a generation and its scores are the same bits with it and with torch's bf16 conv1d."""
    assert avx2_dispatch["conv"].startswith("bit-identical"), avx2_dispatch["conv"][-3000:]


# -- bf16 linear layers in torch's fallback order (kernels/cpu_kernels.py) -------------------------------------------

def _in_order_library():
    from kernels import cpu_kernels

    lib = cpu_kernels.library()
    if isinstance(lib, str):
        pytest.skip(f"no in-order linear kernel on this machine: {lib}")
    return cpu_kernels


def _documented_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The order kernels/cpu_bf16_linear.c documents, in float32 torch ops: 8 registers x 8 lanes of running sums over
    64-product chunks (each product exact in float32), registers added pairwise (r + r+4, r + r+2, r + r+1), then the
    last register's lanes likewise, rounded to bf16."""
    products = x.float()[:, None, :] * weight.float()[None, :, :]  # [m, n, k], exact
    chunks = products.view(x.shape[0], weight.shape[0], -1, 8, 8)  # [m, n, chunk, register, lane]
    sums = chunks[:, :, 0]
    for c in range(1, chunks.shape[2]):
        sums = sums + chunks[:, :, c]
    for axis in (2, 3):  # registers, then lanes: the first half plus the second, until one is left
        while sums.shape[axis] > 1:
            half = sums.shape[axis] // 2
            sums = sums.narrow(axis, 0, half) + sums.narrow(axis, half, half)
    return sums[:, :, 0, 0].to(torch.bfloat16)


@pytest.mark.parametrize("k, n", [(64, 512), (256, 80), (384, 13), (512, 256)])
def test_in_order_kernel_sums_in_its_documented_order(k, n):
    """Machine-independent (AVX2 + FMA and a C compiler): the C kernel against its own documented order, bit for bit,
    for every row-block remainder (1-5 rows), a larger batch and outputs that do not fill the last block of 8."""
    cpu_kernels = _in_order_library()
    weight = cpu_exact._spread((n, k), torch.bfloat16, seed=k + n)
    packed = cpu_kernels.pack(weight)
    for rows in (1, 2, 3, 4, 5, 67):
        x = cpu_exact._spread((rows, k), torch.bfloat16, seed=rows)
        assert torch.equal(cpu_kernels.linear(x, packed, n).view(torch.int16),
                           _documented_order(x, weight).view(torch.int16)), (rows, k, n)


def test_in_order_kernel_refuses_what_it_cannot_take():
    cpu_kernels = _in_order_library()
    assert "not a multiple of 64" in cpu_kernels.supports(torch.zeros(8, 100, dtype=torch.bfloat16))
    assert "not a 2-d bf16 CPU matrix" in cpu_kernels.supports(torch.zeros(8, 64))
    assert cpu_kernels.supports(torch.zeros(8, 128, dtype=torch.bfloat16)) is None


def test_a_weight_changed_after_the_probe_goes_back_to_torch():
    cpu_kernels = _in_order_library()
    linear = torch.nn.Linear(64, 24, bias=False, dtype=torch.bfloat16)
    linear._packed, linear._packed_version = cpu_kernels.pack(linear.weight), linear.weight._version
    linear._one_row = True
    linear.__class__ = cpu_exact.InOrderLinear
    x = cpu_exact._spread((3, 64), torch.bfloat16, seed=9)
    with torch.no_grad():
        linear.weight.mul_(2)  # a new weight: the packed copy is stale, the version counter says so
        assert torch.equal(linear(x), F.linear(x, linear.weight))


def test_linear_shortcut_names_why_not_without_a_compiler(monkeypatch, tmp_path):
    from kernels import cpu_kernels

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FP8_HARNESS_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_kernels.library.cache_clear()
    try:
        why = cpu_kernels.library()
    finally:
        cpu_kernels.library.cache_clear()
    assert isinstance(why, str) and "no-such-cc" in why


AVX2_LINEAR_CHECK = """
import sys, torch
from harness.replay import cpu_exact
from harness.replay.inprocess import InProcessModel
from harness.types import Message
model = InProcessModel.load(sys.argv[1])
note = model.cpu_shortcuts["bf16_linear_in_order"]
assert note.startswith("installed"), note
chat = [Message("user", "recall the number 4417 and then count to ten")]
def replies():
    out = []
    for spec in (None, "fp8_e4m3"):
        from harness.kv_paths.spec import parse_path
        backend = model.backend(parse_path(spec) if spec else None)
        generation = backend.generate_sync(chat, 24)
        out.append((generation.token_ids, backend.score_sync(chat, generation.token_ids).logprobs))
    return out
shortcut = replies()
swapped = []
for module in model.model.modules():
    if isinstance(module, cpu_exact.InOrderLinear):
        swapped.append((module, module.__class__))
        module.__class__ = (cpu_exact.LatentRowsLinear if isinstance(module, cpu_exact.LatentRowsLinear)
                            else torch.nn.Linear)
assert swapped
plain = replies()
for (ids, logprobs), (plain_ids, plain_logprobs) in zip(shortcut, plain):
    assert ids == plain_ids and torch.equal(logprobs, plain_logprobs), "the shortcut changed the bits"
print("bit-identical", len(swapped), "layers", note)
"""


# The checks above, each in a fresh namespace (sys.argv[1]: its model), one after another in one process: each process
# started under AVX2 dispatch imports torch, transformers and the harness (a process per check: 64.8 s of CPU for the
# four on the 2-core EPYC; one process: 32.9 s).
AVX2_RUNNER = """
import json, sys, traceback
for name, script, model in json.loads(sys.argv[1]):
    sys.argv = ["-c", model]
    print(f"=== {name}", flush=True)
    try:
        exec(script, {"__name__": "__main__"})
    except BaseException:
        print("FAILED", traceback.format_exc(), sep="\\n", flush=True)
"""
LINEAR_ARCHS = ("gqa", "mla", "hybrid")


@pytest.fixture(scope="module")
def avx2_dispatch(tiny_models) -> dict[str, str]:
    """{check: what it printed} for the conv shortcut on the tiny hybrid and, where the in-order kernel builds, the
    linear shortcut on each bundled canary, all run in one process as a CPU without AVX-512 BF16 runs."""
    from kernels import cpu_kernels

    checks = [("conv", AVX2_CHECK, str(tiny_models["hybrid"]))]
    if not isinstance(cpu_kernels.library(), str):
        checks += [(arch, AVX2_LINEAR_CHECK, str(ROOT / "harness" / "canary" / "weights" / arch))
                   for arch in LINEAR_ARCHS]
    env = {**os.environ, **AVX2, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", AVX2_RUNNER, json.dumps(checks)], env=env, cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = dict(part.split("\n", 1) for part in done.stdout.split("=== ")[1:])
    assert set(printed) == {name for name, _, _ in checks}, done.stdout[-3000:] + done.stderr[-3000:]
    return printed


@pytest.mark.parametrize("arch", LINEAR_ARCHS)
def test_linear_shortcut_is_bit_identical_under_avx2_dispatch(arch, avx2_dispatch):
    """As a CPU without AVX-512 BF16 runs (torch's own bf16 fallback): the shortcut installs on the bundled canary's
    linear layers (the MLA canary's kv_b_proj with its kept latent rows too), and the reference's and an FP8 path's
    generation and scores are the same bits with it and without."""
    _in_order_library()
    assert avx2_dispatch[arch].startswith("bit-identical"), avx2_dispatch[arch][-3000:]


def test_only_plain_linear_layers_are_offered_to_the_in_order_kernel(monkeypatch):
    """A subclass of nn.Linear may have its own forward (the MoE routers of qwen3_moe, phimoe, llama4 return
    (logits, weights, experts)): swapping its class broke those families under AVX2 dispatch. Only plain layers go."""

    class Router(torch.nn.Linear):
        def forward(self, x):
            logits = super().forward(x)
            return logits, logits.softmax(-1), logits.argmax(-1)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), Router(64, 8, bias=False),
                                torch.nn.Linear(64, 64, bias=True)).to(torch.bfloat16)
    offered = []
    monkeypatch.setattr(cpu_exact, "_install_linear", lambda linears: offered.extend(linears) or "recorded")
    cpu_exact.install(model)
    assert offered == [model[0]]


def test_the_fp32_twin_keeps_no_packed_weights(monkeypatch):
    """The `fp32` path's copy of the model has float32 weights: its linear layers are plain again, with no packed
    bf16 copy held, and give torch's float32 results."""
    cpu_kernels = _in_order_library()
    linear = torch.nn.Linear(64, 24, bias=False, dtype=torch.bfloat16)
    linear._packed, linear._packed_version = cpu_kernels.pack(linear.weight), linear.weight._version
    linear._one_row = True
    linear.__class__ = cpu_exact.InOrderLinear
    model = torch.nn.Sequential(linear)
    twin = copy.deepcopy(model).float()
    cpu_exact.drop_packed(twin)
    assert type(twin[0]) is torch.nn.Linear and not hasattr(twin[0], "_packed")
    assert type(model[0]) is cpu_exact.InOrderLinear and hasattr(model[0], "_packed")  # the bf16 model keeps its own
    x = torch.randn(3, 64)
    assert torch.equal(twin[0](x), F.linear(x, twin[0].weight))
