"""The write check (harness/kv_paths/cache.py `_check_write`, verdict metric `kv_write_err_ratio`): on each prefill
write, the cache's read-back error over the format definition's on the same values and scales, the larger of K and
V. A healthy write of every format reads exactly 1 (the cache's torch write is the definition: the same bits); each
cache-format fault reads above the default fail level however little the model's outputs move (the hybrid canary's
one attention layer hid v_scale_first_blocks from every output check: issue 41)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.analysis.verdicts import default_threshold
from harness.kv_paths import format_faults as FF
from harness.kv_paths import formats as F
from harness.kv_paths.cache import KVWriteStats, QuantizedKVLayer, write_err_ratio
from harness.kv_paths.spec import parse_path

HEALTHY = ("fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_4over6", "mxfp8", "mxfp4", "fp4_mx_block16",
           "int8_per_token_head", "int4_per_token_head", "fp8_per_token_head", "int8_per_token_head_asym",
           "k=fp8_e4m3/v=nvfp4")
FAULTS = ("nvfp4:fault=scale_layout", "nvfp4:fault=v_scale_first_blocks", "mxfp8:fault=e8m0_bias",
          "nvfp4:fault=nibble_swap")


def _kv(tokens: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, 2, tokens, 32] K and V, the gqa canary's shape; channels and heads of different sizes, as real K/V have
    (a block's scale differs from its neighbours', so a scale read from the wrong slot shows)."""
    torch.manual_seed(0)
    channels = torch.linspace(0.1, 4.0, 32)
    heads = torch.tensor([1.0, 6.0]).view(1, 2, 1, 1)
    return ((torch.randn(1, 2, tokens, 32) * channels * heads).bfloat16(),
            (torch.randn(1, 2, tokens, 32) * channels.flip(0) * heads.flip(1)).bfloat16())


def _ratio(spec: str, tokens: int = 7) -> float | None:
    layer = QuantizedKVLayer(parse_path(spec), torch.tensor(1.0), torch.tensor(1.0), KVWriteStats())
    layer.update(*_kv(tokens))
    return layer.stats.as_record().get("kv_write_err_ratio")


@pytest.mark.parametrize("spec", HEALTHY)
def test_a_healthy_write_is_the_formats_own(spec):
    assert _ratio(spec) == 1.0


@pytest.mark.parametrize("spec", FAULTS)
def test_each_format_fault_fails_the_write_check(spec):
    threshold = default_threshold("kv_write_err_ratio")
    ratio = _ratio(spec)
    assert ratio is not None and ratio > threshold.fail, (spec, ratio)


def test_a_decode_step_is_not_checked():
    """One token a row (a decode step) costs the loop nothing: no ratio from such writes alone."""
    assert _ratio("nvfp4:fault=scale_layout", tokens=1) is None


def test_the_ratio_takes_the_worse_side_and_names_an_exact_format_broken():
    # [K path, K format, V path, V format] squared errors
    assert write_err_ratio([4.0, 1.0, 9.0, 1.0]) == 3.0
    assert write_err_ratio([0.0, 0.0, 0.0, 0.0]) is None
    assert math.isinf(write_err_ratio([1.0, 0.0, 0.0, 0.0]))


def test_pads_of_a_batch_count_nowhere():
    """A padded row's pad tokens hold garbage the cache never reads: a read of them that differs from the format's
    must not count (the batched engine's step marks real tokens)."""
    from types import SimpleNamespace

    x = torch.randn(2, 1, 4, 16)
    read = x.clone()
    read[1, :, 2:] += 5.0  # row 1's last two tokens are pads
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    step = SimpleNamespace(row_masks=lambda device: (valid[:, None, :, None], valid.sum(1)))
    stats = KVWriteStats(rows=2, step=step)
    stats.live = torch.arange(2)
    reference = F.get_format("e4m3").round_trip(x, torch.tensor(1.0))[0]
    stats.check_write("k", x, reference, reference)
    stats.check_write("v", x, read, x)  # V: the format exact here (reference = x), the read off only on pads
    assert [r.get("kv_write_err_ratio") for r in stats.row_records()] == [1.0, 1.0]


def test_the_fault_injectors_apply_where_the_check_looks():
    """Every cache-format fault but the dummy pass's (its scales need the dummy pass: tests/test_format_zoo.py) is
    covered above."""
    assert set(FF.FORMAT_FAULTS) - {s.split("fault=")[1] for s in FAULTS} == set(FF.DUMMY_PASS_FAULTS)
