"""Decode-kernel plug-ins (`kernel=` path option): the contract, proven by our kernels, the dequantise-everything
workaround and a user kernel defined in this file, run inside a real (tiny) transformers model on the CPU.
The GPU half (Triton kernel vs workaround vs this file's kernel on CUDA) is tests/test_harness_gpu.py."""

from __future__ import annotations

import types

import pytest
import torch

from harness.kv_paths.decode_kernels import KernelPluginError, resolve
from harness.kv_paths.spec import PathSpecError, parse_path
from harness.replay.inprocess import InProcessModel
from harness.types import Message

CHAT = [Message("user", "What is 7 * 8 + 3 * 4? Then tell me more.")]
CALLS = {"gqa": 0, "mla": 0}


def _gather(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """A user's own page walk: rows of one sequence in token order, fp32 codes."""
    page = cache.shape[1]
    return cache[table_row[: -(-length // page)].long()].flatten(0, 1)[:length].float()


def user_decode_attention(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sm_scale):
    """A user's GQA decode written only from docs/CONTRACTS.md: codes x scale, fp32 softmax, q's dtype out."""
    CALLS["gqa"] += 1
    batch, q_heads, dim = q.shape
    group = q_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(seq_lens[b])
        k = _gather(k_cache, block_table[b], n) * k_scale.float().reshape(-1, 1)   # [L, Hkv, D]; [] or [Hkv]
        v = _gather(v_cache, block_table[b], n) * v_scale.float().reshape(-1, 1)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[b].float(), k) * sm_scale, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", weights, v).to(q.dtype)
    return out


def user_mla_decode(q_latent, q_pe, cache, block_table, seq_lens, scale, sm_scale):
    CALLS["mla"] += 1
    out = torch.empty_like(q_latent)
    dc = q_latent.shape[2]
    for b in range(q_latent.shape[0]):
        rows = _gather(cache, block_table[b], int(seq_lens[b])) * scale.float()
        scores = (q_latent[b].float() @ rows[:, :dc].T + q_pe[b].float() @ rows[:, dc:].T) * sm_scale
        out[b] = (torch.softmax(scores, -1) @ rows[:, :dc]).to(q_latent.dtype)
    return out, None     # a tuple whose first item is the output is accepted too


UserKernel = types.SimpleNamespace(decode_attention=user_decode_attention, mla_decode=user_mla_decode)


def forgets_v_scale(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sm_scale):
    """A plausible bug: V read as raw codes (its scale never applied)."""
    return user_decode_attention(q, k_cache, v_cache, block_table, seq_lens, k_scale, torch.ones_like(v_scale),
                                 sm_scale)


def wrong_shape(q, *args):
    return q[:, :1]


def test_spec_names_a_kernel():
    assert parse_path("fp8_e4m3:kernel=dequant").kernel == "dequant"
    path = parse_path("fp8_e4m3:per_head:kernel=test_decode_plugins:UserKernel:calibrated")
    assert (path.kernel, path.granularity, path.scale_source) == ("test_decode_plugins:UserKernel", "per_head",
                                                                  "calibrated")
    assert path.canonical.endswith(":kernel=test_decode_plugins:UserKernel")
    assert parse_path("fp8_e4m3:kernel=test_decode_plugins.user_decode_attention").kernel.endswith("attention")


@pytest.mark.parametrize("spec, words", [
    ("fp8_e4m3:kernel=no_such_pkg.mod:fn", "cannot import module 'no_such_pkg.mod'"),
    ("fp8_e4m3:kernel=test_decode_plugins:missing", "has no attribute 'missing'"),
    ("fp8_e4m3:kernel=test_decode_plugins:CHAT", "neither a function nor an object"),
    ("fp8_e4m3:kernel=9x", "expected one of triton, dequant, reference"),
    ("bf16:kernel=dequant", "needs an fp8 cache"),
    ("fp8_e5m2:per_token:kernel=dequant", "per_tensor or per_head"),
    ("fp8_e4m3:kernel=dequant:kernel=triton", "sets kernel twice"),
])
def test_bad_kernel_names_are_refused_with_the_reason(spec, words):
    with pytest.raises(PathSpecError, match=".*".join(map(__import__("re").escape, [spec, words]))):
        parse_path(spec)


def test_contract_violations_name_the_kernel(tiny_models):
    backend = InProcessModel.load(tiny_models["gqa"]).backend(parse_path("fp8_e4m3:kernel=test_decode_plugins:wrong_shape"))
    with pytest.raises(KernelPluginError, match=r"wrong_shape.*returned \[1, 1, \d+\].*contract wants \[1, 4, \d+\]"):
        backend.generate_sync(CHAT, 3)
    mla = InProcessModel.load(tiny_models["mla"]).backend(parse_path("fp8_e4m3:kernel=test_decode_plugins:wrong_shape"))
    with pytest.raises(KernelPluginError, match="has no mla_decode"):
        mla.generate_sync(CHAT, 3)


def test_workaround_matches_reference_per_head_on_any_shape():
    from kernels import reference as ref, workaround

    torch.manual_seed(1)
    k = ref.quantize(torch.randn(11, 16, 2, 32), torch.tensor([0.01, 0.03]).view(-1, 1), "e5m2")
    v = ref.quantize(torch.randn(11, 16, 2, 32), torch.tensor(0.02), "e5m2")
    table = torch.randperm(11)[:10].int().view(2, 5)
    lens = torch.tensor([1, 77], dtype=torch.int32)
    q = torch.randn(2, 6, 32).bfloat16()
    args = (q, k, v, table, lens, torch.tensor([0.01, 0.03]), torch.tensor(0.02), 0.17)
    out, truth = workaround.decode_attention(*args), ref.decode_attention(*args)[0]
    # bf16 SDPA over bf16-rounded values vs the fp32 reference: a few bf16 ulps of the output
    assert (out.float() - truth.float()).abs().max() <= 4 * 2 ** -8 * truth.float().abs().max()
    assert resolve("dequant").mla_decode is workaround.mla_decode


@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_three_implementations_give_the_same_replies(tiny_models, monkeypatch, arch):
    """Ours (the torch mirror standing in for Triton on the CPU), the workaround and this file's kernel,
    each through the same contract in the same model: same tokens, every decode step checked against fp64."""
    monkeypatch.setenv("HARNESS_KERNELS", "reference")
    model = InProcessModel.load(tiny_models[arch])
    runs = {}
    for name in ("", ":kernel=dequant", ":kernel=test_decode_plugins:UserKernel"):
        CALLS.update(gqa=0, mla=0)
        backend = model.backend(parse_path("fp8_e4m3:per_head:calibrated" + name))
        generation = backend.generate_sync(CHAT, 8)
        runs[name] = generation
        steps = generation.metrics["kernel_steps"]
        assert steps == 2 * (len(generation.token_ids) - (generation.finish_reason == "length"))
        assert generation.metrics["kernel_err_ratio"] <= 4.0, (name, generation.metrics)
        assert generation.metrics["kernel_ms_per_step"] > 0
        if "UserKernel" in name:
            assert CALLS["mla" if arch == "mla" else "gqa"] == steps
            assert backend.describe()["decode_kernel"] == "plug-in test_decode_plugins:UserKernel (kernel= path option)"
    assert len({tuple(g.token_ids) for g in runs.values()}) == 1, {k: g.text for k, g in runs.items()}


def test_plugin_runs_on_cpu_without_the_env_switch(tiny_models, monkeypatch):
    """A path that names a kernel runs it on the CPU too (stores through the torch reference there)."""
    monkeypatch.delenv("HARNESS_KERNELS", raising=False)
    backend = InProcessModel.load(tiny_models["gqa"]).backend(parse_path("fp8_e4m3:kernel=dequant"))
    assert backend.describe()["decode_kernel"].startswith("plug-in dequant")
    assert backend.generate_sync(CHAT, 4).metrics["kernel_steps"] > 0
    plain = InProcessModel.load(tiny_models["gqa"]).backend(parse_path("fp8_e4m3"))
    assert "kernel_steps" not in plain.generate_sync(CHAT, 2).metrics


def test_a_broken_plugin_is_flagged_and_a_healthy_one_is_not(tiny_models):
    """Detection: the agreement check against fp64 over the stored codes catches a kernel that drops v_scale
    (a calibrated scale far from 1, so the bug matters), and stays quiet on the same kernel done right."""
    model = InProcessModel.load(tiny_models["gqa"])
    healthy = model.backend(parse_path("fp8_e4m3:calibrated:kernel=test_decode_plugins:user_decode_attention"))
    broken = model.backend(parse_path("fp8_e4m3:calibrated:kernel=test_decode_plugins:forgets_v_scale"))
    assert healthy.generate_sync(CHAT, 4).metrics["kernel_err_ratio"] <= 4.0
    assert broken.generate_sync(CHAT, 4).metrics["kernel_err_ratio"] > 100.0
