"""Project-wide pytest options: `--gpu` enables CUDA tests (and is an error without a CUDA device: the
harness plugin refuses to start), `--slow` enables slow CPU tests, `--peer` tests against real servers (vLLM,
transformers serve), `--matrix` the full matrices (every family replayed, every format fault on every canary, every
pool, rank and Ray fault; CI runs a sample of each, the nightly all). `pytest harness` comes from the plugin."""

from __future__ import annotations

import os
import random

import pytest

# The plugins this checkout's tests need (harness.pytest_plugin: `pytest harness`, and it owns --gpu; pytester: the
# plugin's own end-to-end tests) are named in pyproject.toml's addopts, not in `pytest_plugins` here: `pytest harness`
# run from another directory loads this file late, as the package's parent, where pytest refuses `pytest_plugins`.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="run tests marked slow")
    parser.addoption("--matrix", action="store_true",
                     help="run tests marked matrix: the full matrices (every family transformers ships, every format "
                          "fault x canary, every pool / rank / Ray fault); CI runs a sample of each (CPU: ~90 min, 2 "
                          "cores, with --slow)")
    parser.addoption("--peer", action="store_true",
                     help="run tests marked peer: real vLLM / transformers serve on loopback (minutes; tests/test_peer.py)")


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker gets its share of the cores as torch intra-op threads (and so do the `harness`
    processes its tests start, through OMP_NUM_THREADS). With torch's default, one thread per core in every
    worker, 2 workers on 2 cores ran 4 spinning OpenMP threads: each small op's barrier waited for a thread the
    scheduler had parked, and the batched CPU detection test took 727 s in the suite against 43 s alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


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
        if "matrix" in item.keywords and not config.getoption("--matrix"):
            item.add_marker(pytest.mark.skip(reason="full-matrix test: pass --matrix to run it (the nightly does; CI "
                                                    "runs a sample)"))
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
