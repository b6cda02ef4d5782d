"""Project-wide pytest options: `--gpu` enables CUDA tests (and is an error without a CUDA device: the
harness plugin refuses to start), `--slow` enables slow CPU tests. `pytest harness` comes from the plugin."""

from __future__ import annotations

import random

import pytest

pytest_plugins = ["harness.pytest_plugin", "pytester"]  # pytester: the plugin's own tests; `pytest harness`; also owns --gpu (installed: a pytest11 entry point)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords:
            if not config.getoption("--gpu"):
                item.add_marker(pytest.mark.skip(reason="GPU test: pass --gpu on a CUDA machine to run it"))
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(pytest.mark.skip(reason="slow test: pass --slow to run it"))


@pytest.fixture(autouse=True)
def _seed_everything():
    import torch

    random.seed(0)
    torch.manual_seed(0)
    yield
