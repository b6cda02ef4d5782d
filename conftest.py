"""Project-wide pytest options: `--gpu` enables CUDA tests (and is an error without a CUDA device: the
harness plugin refuses to start), `--slow` enables slow CPU tests, `--peer` tests against real servers (vLLM,
transformers serve). `pytest harness` comes from the plugin."""

from __future__ import annotations

import random

import pytest

# harness.pytest_plugin: `pytest harness` from this checkout, and it owns --gpu (installed, it also comes in as a
# pytest11 entry point; pytest registers it once); pytester: the plugin's own end-to-end tests.
pytest_plugins = ["harness.pytest_plugin", "pytester"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="run tests marked slow")
    parser.addoption("--peer", action="store_true",
                     help="run tests marked peer: real vLLM / transformers serve on loopback (minutes; tests/test_peer.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            if not config.getoption("--gpu"):
                item.add_marker(pytest.mark.skip(reason="GPU test: pass --gpu on a CUDA machine to run it"))
            elif "multigpu" in item.keywords and _cuda_devices() < 2:
                item.add_marker(pytest.mark.skip(reason=f"multi-GPU test: needs at least 2 CUDA devices of one "
                                                        f"host, torch sees {_cuda_devices()}"))
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(pytest.mark.skip(reason="slow test: pass --slow to run it"))
        if "peer" in item.keywords and not config.getoption("--peer"):
            item.add_marker(pytest.mark.skip(reason="peer-server test: pass --peer to run it"))


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(autouse=True)
def _seed_everything():
    import torch

    random.seed(0)
    torch.manual_seed(0)
    yield
