"""Several models replayed at once on one GPU, a thread each (`harness/executor/local.py` `ModelThreads`).

What must hold: each model's records and replies are those of a replay one after another (on the CPU here: the
threads' Python, store and manifest; on CUDA, `--gpu`: the streams, captures and SDPA flags as well), the executor is
chosen only where its conditions hold, one model's error is raised after the other models' units are stored, and
torch's process-wide SDPA backend flags set by one thread never reach another thread's call.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness import job
from harness.executor import executor_for, local
from harness.forward_context import sdpa_only
from harness.kv_paths.spec import parse_paths
from tests.test_executor_faults import comparable, config_for, expected_units, rows

CANARIES = [job.CANARY_WEIGHTS / name for name in ("gqa", "mla", "hybrid")]


def chosen(tmp_path: Path, **fields) -> object:
    config = job.RunConfig(**{"models": tuple(CANARIES), "scenario_paths": (), "paths": parse_paths("fp8_e4m3"),
                              "out": tmp_path, "device": "cuda", "jobs": 16, **fields})
    return executor_for(config, [])


def test_models_replay_at_once_only_where_the_conditions_hold(tmp_path):
    at_once = chosen(tmp_path)
    assert at_once.strategy == "models-at-once" and at_once.threads == 3
    assert chosen(tmp_path, jobs=2).threads == 2
    for fields in ({"jobs": 1}, {"models": tuple(CANARIES[:1])}, {"device": "cpu"},
                   {"paths": parse_paths("fp8_e4m3:kernel=dequant")},
                   {"paths": parse_paths("fp8_e4m3:fault=scale_off")},
                   {"models": (Path("a"), Path("b"))}):  # no weight files: random weights, size unknown
        assert chosen(tmp_path, **fields).strategy in ("in-process", "cpu-tasks"), fields
    _, why = local.models_at_once(job.RunConfig(models=(Path("a"), Path("b")), scenario_paths=(), paths=(),
                                                 out=tmp_path, device="cuda", jobs=4))
    assert "unknown size" in why


@pytest.fixture(scope="module")
def one_after_another(tiny_models, tmp_path_factory) -> Path:
    config = replace(config_for(tiny_models, tmp_path_factory.mktemp("threads") / "serial"), jobs=2, batch_size=4)
    return job.run_job(config, warn=lambda message: None, executor=local.InProcess())


def test_models_at_once_store_what_one_after_another_stores(tiny_models, tmp_path, one_after_another):
    config = replace(config_for(tiny_models, tmp_path / "threads"), jobs=2, batch_size=4)
    job.run_job(config, warn=lambda message: None, executor=local.ModelThreads(2))
    assert comparable(config.out) == comparable(one_after_another)
    manifest = json.loads((config.out / "manifest.json").read_text())
    assert manifest["executor"] == {"strategy": "models-at-once", "threads": 2} and manifest["status"] == "complete"
    labels = [m.name for m in config.models]
    assert [m["label"] for m in manifest["models"]] == labels and list(manifest["batching"]) == labels


def test_one_models_error_is_raised_after_the_others_units_are_stored(tiny_models, tmp_path, monkeypatch):
    config = replace(config_for(tiny_models, tmp_path / "failing"), jobs=2, batch_size=4)
    replay = local.replay_model

    def failing(config, directory, *args, **kwargs):
        if directory.name == "gqa":
            raise RuntimeError("planted: gqa's replay failed")
        return replay(config, directory, *args, **kwargs)

    monkeypatch.setattr(local, "replay_model", failing)
    with pytest.raises(RuntimeError, match="planted: gqa's replay failed"):
        job.run_job(config, warn=lambda message: None, executor=local.ModelThreads(2))
    done = {(r["model"], r["scenario"], r["path"]) for r in rows(config.out, "done")}
    assert done == {unit for unit in expected_units(config) if unit[0] == "mla"}


def flags() -> tuple[bool, bool, bool]:
    return (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled())


def test_one_threads_sdpa_choice_is_held_until_its_block_ends():
    """Thread A holds MATH alone across a pause; thread B, asking for flash, efficient and math meanwhile, waits for
    A's block to end: A's flags never change under it, and B sees its own choice."""
    from torch.nn.attention import SDPBackend

    entered, seen = threading.Event(), {}

    def math_alone() -> None:
        with sdpa_only(SDPBackend.MATH):
            entered.set()
            seen["a_first"] = flags()
            time.sleep(0.3)
            seen["a_last"] = flags()
        seen["a_left"] = time.perf_counter()

    def three() -> None:
        entered.wait()
        with sdpa_only([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            seen["b_entered"] = time.perf_counter()
            seen["b"] = flags()

    threads = [threading.Thread(target=math_alone), threading.Thread(target=three)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen["a_first"] == seen["a_last"] == (False, False, True)
    assert seen["b"] == (True, True, True) and seen["b_entered"] >= seen["a_left"]


@pytest.mark.parametrize("cudnn", ["0", "1"])
def test_a_cuda_attention_calls_sdpa_choice_is_held_for_its_thread(monkeypatch, cudnn):
    """`attention.sdpa_backends` of a CUDA query sets its backends and holds the flags' lock for its thread, with
    HARNESS_SDPA_CUDNN=1 too (cuDNN then among them): a choice set without the lock would reach, and be reached by,
    another thread's call. (The flags are torch's global context, so the CPU build shows them.)"""
    from types import SimpleNamespace

    from harness import forward_context as context
    from harness.kv_paths import attention

    monkeypatch.setenv("HARNESS_SDPA_CUDNN", cudnn)
    free = {}

    def other_thread() -> None:
        free["other"] = context._SDPA_FLAGS.acquire(blocking=False)
        if free["other"]:
            context._SDPA_FLAGS.release()

    with attention.sdpa_backends(SimpleNamespace(is_cuda=True)):
        inside = (*flags(), torch.backends.cuda.cudnn_sdp_enabled())
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert inside == (True, True, True, cudnn == "1") and free["other"] is False


@pytest.mark.gpu
def test_a_prefill_pass_asks_whether_flash_takes_it_under_its_own_sdpa_choice(monkeypatch):
    """A static prefill pass's full-attention call asks whether flash attention takes its lower-right causal bias
    (`attention._causal_prefix`), and torch's answer reads the process-wide SDPA flags. While another thread holds
    MATH alone (the implementation check's yardstick, `impl_check._sdpa_rows`), the call waits for that block to end
    and then runs as it does alone: the same bits. Asked outside the lock, it read flash as off and took the masked
    memory-efficient call instead, another rounding of the same attention (the canaries' bf16 path under
    `ModelThreads(3)` stored another attn_impl_err_ratio in 3 of 8 runs, BENCHMARKS.md session 50)."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend
    from transformers import AttentionInterface

    from harness import forward_context as context
    from harness.forward_context import CausalPrefix, forward_context
    from harness.kv_paths import attention
    from tests.test_batched import _causal_prefix_inputs

    class Watched:
        """The flags' lock, telling when the pass's thread first waits for it."""

        def __init__(self, lock) -> None:
            self.lock, self.tried = lock, threading.Event()

        def __enter__(self):
            if threading.current_thread().name == "pass-beside":
                self.tried.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    attention.register()
    call = AttentionInterface()[attention.ATTENTION_NAME]
    starts, dim = (0, 5), 64
    query, key, value, mask, _ = _causal_prefix_inputs(starts, 8, 2, 64, 64, dim, "cuda", torch.bfloat16)
    module = SimpleNamespace(layer_idx=None, scaling=dim ** -0.5, num_key_value_groups=4, is_causal=True)

    def prefill(causal: bool) -> torch.Tensor:
        with forward_context(causal_prefix=CausalPrefix(mask, starts) if causal else None):
            out = call(module, query, key, value, mask)[0]
        torch.cuda.synchronize()
        return out

    alone, masked = prefill(True), prefill(False)
    assert not torch.equal(alone, masked)  # the two routes round differently: a wrong route shows in the bits
    watched = Watched(context._SDPA_FLAGS)
    monkeypatch.setattr(context, "_SDPA_FLAGS", watched)
    entered, got = threading.Event(), {}

    def math_alone() -> None:
        with sdpa_only(SDPBackend.MATH):
            entered.set()
            # held until the pass's thread waits for the lock: a question asked outside it has been answered by then
            got["waited"] = watched.tried.wait(60)

    def pass_beside() -> None:
        entered.wait()
        got["out"] = prefill(True)

    threads = [threading.Thread(target=math_alone), threading.Thread(target=pass_beside, name="pass-beside")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got["waited"] and torch.equal(got["out"], alone)


@pytest.mark.gpu
def test_the_canaries_at_once_on_a_gpu_store_what_one_after_another_stores(tmp_path):
    """The default paths and the gate's controls on the three canaries, two canary scenarios: CUDA streams of their
    own, graph captures and the SDPA flags under threads change no record and no reply."""
    from harness.run_config import build_run_config

    def run(name: str, executor) -> Path:
        config = build_run_config(command=["harness", "run"], out=tmp_path / name, device="cuda")
        config = replace(config, scenario_ids=("canary-arith-1", "canary-recall-1"))
        return job.run_job(config, warn=lambda message: None, executor=executor)

    serial = run("serial", local.InProcess())
    at_once = run("at-once", local.ModelThreads(3))
    assert comparable(at_once) == comparable(serial)
    assert json.loads((at_once / "manifest.json").read_text())["warnings"] == []
