"""Project-wide pytest options: `--gpu` enables CUDA tests, `--slow` enables slow CPU tests, `--peer` tests
against real servers (vLLM, transformers serve)."""

from __future__ import annotations

import random

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true", help="run tests marked gpu (needs CUDA)")
    parser.addoption("--slow", action="store_true", help="run tests marked slow")
    parser.addoption("--peer", action="store_true",
                     help="run tests marked peer: real vLLM / transformers serve on loopback (minutes; see tests/test_peer.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    for item in items:
        if "gpu" in item.keywords:
            if not config.getoption("--gpu"):
                item.add_marker(pytest.mark.skip(reason="GPU test: pass --gpu on a CUDA machine to run it"))
            elif not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="--gpu given but torch sees no CUDA device"))
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(pytest.mark.skip(reason="slow test: pass --slow to run it"))
        if "peer" in item.keywords and not config.getoption("--peer"):
            item.add_marker(pytest.mark.skip(reason="peer-server test: pass --peer to run it"))


@pytest.fixture(autouse=True)
def _seed_everything():
    import torch

    random.seed(0)
    torch.manual_seed(0)
    yield
