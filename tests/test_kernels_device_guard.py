"""The kernel launchers run on the device of their tensors (issue 30): Triton launches on the current device's
stream, so without the guard a cuda:1 call made while cuda:0 is current would run on the wrong GPU. On a CPU
machine the guard is checked with a stand-in tensor that reports a CUDA device; the real check is a run with
`--device cuda:1` on a 2-GPU machine."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

pytest.importorskip("triton")

from kernels import decode_attention as da  # noqa: E402
from kernels import mla_decode as md  # noqa: E402
from kernels import store_kv as sk  # noqa: E402
from kernels import write_check as wc  # noqa: E402


@pytest.mark.parametrize("launcher", [da.decode_attention, da.merge_splits, md.mla_decode, sk.store_kv,
                                      sk.store_latent, sk.quantize_store, wc.square_error_sums],
                         ids=lambda f: f.__name__)
def test_every_launcher_is_guarded(launcher):
    assert getattr(launcher, "on_tensor_device", False), f"{launcher.__name__} does not switch to its tensors' device"


def _fake_cuda_tensor(index: int):
    t = mock.MagicMock(spec=torch.Tensor)
    t.device = torch.device("cuda", index)
    return t


def test_guard_makes_the_first_tensors_device_current():
    entered = []

    @contextlib.contextmanager
    def fake_device(device):
        entered.append(device)
        yield

    seen = []
    guarded = da.on_tensor_device(lambda *args, **kwargs: seen.append((args, kwargs)) or "result")
    with mock.patch.object(torch.cuda, "device", fake_device):
        assert guarded(3, _fake_cuda_tensor(1), x=_fake_cuda_tensor(0)) == "result"
        assert entered == [torch.device("cuda", 1)]   # the first tensor, positional before keyword
        guarded(q=_fake_cuda_tensor(2))
        assert entered[-1] == torch.device("cuda", 2)
        guarded(torch.zeros(2))                         # CPU tensors: no device switch (the launcher refuses them)
        guarded()
    assert len(entered) == 2 and len(seen) == 4


def test_guard_leaves_cpu_calls_to_the_launchers_own_errors():
    with pytest.raises(AssertionError, match="CUDA"):
        md.mla_decode(torch.zeros(1, 16, 512, dtype=torch.bfloat16), torch.zeros(1, 16, 64, dtype=torch.bfloat16),
                      torch.zeros(1, 64, 576, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
                      torch.ones(1, dtype=torch.int32), None, 0.1)
