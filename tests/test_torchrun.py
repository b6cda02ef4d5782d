"""Tensor parallel with ranks that torchrun started (`torchrun ... -m harness.cli run --shard tensor --device cuda`),
the way past one host: every process one rank, global rank 0 runs the job and writes the run, and hands the other
ranks its scenarios, calibration chats and run directory (`harness.executor.sharded`).

Two hosts are not available here, so the ranks are two processes of one machine, as torchrun starts them for two
hosts (`--standalone --nproc-per-node 2`: the same environment, rendezvous and process group; gloo on the CPU). The
run must be the run the harness's own ranks make (`--device cpu,cpu`, this process starting them): both split the
model over the same two gloo ranks, so the rounding is the same and the stored rows must be equal, not close."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.replay import sharding, tensor_parallel
from harness.run_config import build_run_config

ROOT = Path(__file__).resolve().parents[1]
GQA = ROOT / "harness" / "canary" / "weights" / "gqa"
SMOKE = ROOT / "tests" / "data" / "scenarios" / "smoke.yaml"
ARGS = ["run", "--shard", "tensor", "--model", str(GQA), "--scenarios", str(SMOKE), "--select", "id:smoke-chat",
        "--paths", "fp8_e4m3:per_head:calibrated", "--yardstick", "none", "--batch-size", "4", "--no-progress"]
TORCHRUN_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "fp8"}


def _rows(run: Path, table: str) -> list[str]:
    return sorted(json.dumps(json.loads(line), sort_keys=True)
                  for line in (run / f"{table}.jsonl").read_text().splitlines() if line.strip())


def _torchrun_and_own(tmp_path: Path, device: str, ranks: str) -> list[Path]:
    """The run under `torch.distributed.run --standalone --nproc-per-node 2 ... --device DEVICE` and the same run
    with the ranks the harness starts (`--device RANKS`); checks both completed and that only rank 0 wrote (rank
    1's private copy gone from its temporary directory)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "harness.cli", *ARGS, "--device", device, "--out", str(tmp_path / "torchrun")],
                              cwd=ROOT, env={**env, "TMPDIR": str(scratch)}, capture_output=True, text=True,
                              timeout=600)
    assert torchrun.returncode == 0, torchrun.stdout[-2000:] + torchrun.stderr[-3000:]
    own = subprocess.run([sys.executable, "-m", "harness.cli", *ARGS, "--device", ranks, "--out", str(tmp_path / "own")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert own.returncode == 0, own.stderr[-3000:]
    runs = [tmp_path / "torchrun", tmp_path / "own"]
    manifest = json.loads((runs[0] / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["parallel"]["launcher"].startswith("torchrun") and len(manifest["parallel"]["devices"]) == 2
    # torch keeps its own temporary directories there
    assert [p.name for p in scratch.iterdir() if p.name.startswith("tp-rank")] == []
    return runs


@pytest.mark.slow
def test_ranks_torchrun_started_replay_what_the_harness_ranks_replay(tmp_path):
    """Two gloo ranks started by torchrun against the harness's own two: the same units, texts, records and
    verdicts, row for row."""
    runs = _torchrun_and_own(tmp_path, "cpu", "cpu,cpu")
    for table in ("done", "texts", "records", "verdicts"):
        mine, theirs = (_rows(run, table) for run in runs)
        assert mine and mine == theirs, table


@pytest.mark.multigpu
def test_ranks_torchrun_started_on_two_gpus_replay_what_the_harness_ranks_replay(tmp_path):
    """The same over NCCL on two GPUs (`--device cuda`: each rank LOCAL_RANK's GPU), our decode kernels on each
    rank's heads: the same units, verdicts, texts and teacher-forced kl_mean. Both runs cut the same batches over
    the same two ranks, so a difference is a rank replaying something else (records that time kernels are left
    out: they are wall clock)."""
    runs = _torchrun_and_own(tmp_path, "cuda", "cuda:0,1")
    for table in ("done", "texts", "verdicts"):
        mine, theirs = (_rows(run, table) for run in runs)
        assert mine and mine == theirs, table
    kls = [[row for row in _rows(run, "records") if '"metric": "kl_mean"' in row] for run in runs]
    assert kls[0] and kls[0] == kls[1]


def test_under_torchrun_only_tensor_parallel_runs_and_each_rank_takes_its_gpu(tmp_path, monkeypatch):
    """Under torchrun's environment: a run that is not --shard tensor would replay once per process, and a GPU list
    would fight LOCAL_RANK: both refused by name. Every global rank's device: LOCAL_RANK's GPU of its host, the
    second host's named node1/..., which the shard check takes as distinct GPUs."""
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    common = dict(command=["pytest"], out=tmp_path / "run", models=[GQA], scenario_paths=[SMOKE])
    with pytest.raises(ValueError, match="only --shard tensor runs as torchrun's ranks"):
        build_run_config(device="cpu", **common)
    with pytest.raises(ValueError, match="takes its GPU from LOCAL_RANK"):
        build_run_config(device="cpu,cpu", shard="tensor", **common)
    assert tensor_parallel.torchrun_launch() == (1, 1, 4)
    devices = tensor_parallel.torchrun_devices("cuda")
    assert devices == ["cuda:0", "cuda:1", "node1/cuda:0", "node1/cuda:1"]
    sharding.check_devices(devices)  # four distinct GPUs of two hosts
    assert tensor_parallel.torchrun_devices("cpu") == ["cpu"] * 4
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # the ranks the harness starts itself set the rest, not this
    assert tensor_parallel.torchrun_launch() is None
