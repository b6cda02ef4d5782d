"""Tensor parallel (`harness run --device cuda:0,1 --shard tensor`): a rank per device through transformers'
tensor-parallel plan, every rank replaying every unit, rank 0 writing.

CPU: refusals (by name, before any model loads), and two gloo ranks on the CPU (`--device cpu,cpu`): the tiny
gqa canary at TP=2 against TP=1 (tokens, teacher-forced KL, and the calibrated scales, which must be a one-device
run's: per-head amax gathered over the ranks, per-tensor the max over every head), a random-weights directory
made the same on every rank, and a `harness run` that stores every unit with its layout. Multi-GPU hosts
(`multigpu`): the three canaries at TP=2 against one GPU, and a run over two GPUs.

The TP=2 vs TP=1 noise is measured and printed, not asserted to be zero: splitting o_proj / down_proj / the LM
head over ranks changes bf16 rounding. On the CPU (gloo, two ranks, gqa canary, one prompt, 8 greedy tokens) session
8 measured: tokens identical; KL(TP1 || TP2) mean 3.7e-4 (max 2.8e-3) for the reference, 1.4e-3 (max 7.5e-3) for
fp8_e4m3:calibrated and fp8_e4m3:per_head:calibrated; calibrated scales equal to the one-device run's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from harness import job
from harness.replay import sharding, tensor_parallel
from harness.run_config import build_run_config

ROOT = Path(__file__).resolve().parents[1]
CANARIES = ROOT / "harness" / "canary" / "weights"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import tp_compare  # noqa: E402 - after the path

# the noise a two-rank split may add on the tiny canaries (measured ~1e-3 mean KL; a wrong head order, scale
# or missing all-reduce gives KL of order 1)
KL_MEAN_LIMIT = 0.02


@pytest.mark.parametrize("devices, message", [
    (["cuda:0"], "runs a process per GPU"),
    (["cpu"], "runs a process per GPU"),
    (["cuda:0", "cpu"], "runs a process per GPU"),
])
def test_devices_that_cannot_hold_ranks_are_refused_by_name(devices, message):
    with pytest.raises(sharding.ShardError, match=message):
        sharding.check_shard("tensor", devices)


def test_a_family_without_a_plan_or_with_heads_that_do_not_split_is_refused():
    from transformers import AutoConfig, StableLmConfig

    assert "no tensor-parallel plan" in tensor_parallel.refusal(StableLmConfig(), 2)
    assert "use --shard layers" in tensor_parallel.refusal(StableLmConfig(), 2)
    gqa = AutoConfig.from_pretrained(str(CANARIES / "gqa"))
    assert tensor_parallel.refusal(gqa, 2) is None
    assert "num_attention_heads = 8 does not split over 3 ranks" in tensor_parallel.refusal(gqa, 3)
    assert "num_key_value_heads = 2 does not split over 4 ranks" in tensor_parallel.refusal(gqa, 4)


def test_the_cli_refuses_a_family_without_a_plan_before_the_run(tmp_path, capsys):
    from transformers import StableLmConfig

    from harness.cli import main

    model = tmp_path / "stablelm"
    StableLmConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                   intermediate_size=64).save_pretrained(str(model))
    code = main(["run", "--out", str(tmp_path / "run"), "--model", str(model), "--device", "cpu,cpu",
                 "--shard", "tensor"])
    err = capsys.readouterr().err
    assert code == 2 and "no tensor-parallel plan" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_several_cpu_ranks_are_for_tensor_parallel_only(tmp_path):
    with pytest.raises(ValueError, match="for --shard tensor"):
        job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, device="cpu,cpu")
    config = job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, device="cpu,cpu", shard="tensor")
    assert config.shard_devices == ["cpu", "cpu"] and not config.batched


def test_the_layout_names_the_world_and_the_writer():
    layout = tensor_parallel.layout(["cuda:0", "cuda:1"], {})
    assert layout["kind"] == "tensor-parallel" and layout["world_size"] == 2 and layout["backend"] == "nccl"
    assert tensor_parallel.layout(["cpu", "cpu"], {})["backend"] == "gloo"


def test_tp2_on_two_cpu_ranks_replays_what_one_device_replays_within_the_noise_floor():
    specs = (None, "fp8_e4m3:calibrated", "fp8_e4m3:per_head:calibrated")
    one, many, rows = _compare(CANARIES / "gqa", ["cpu", "cpu"], specs)
    print("\nTP=2 (gloo, cpu) vs TP=1:", json.dumps(rows, indent=1))
    for spec, row in rows.items():
        assert row["kl_mean"] < KL_MEAN_LIMIT, (spec, row)
        assert row["scales_max_rel_diff"] is not None, (spec, "scale layers or shapes differ from a one-device run")
    # the calibrated scales are a one-device run's: per tensor the max over every rank's heads, per head the
    # whole vector; each rank's caches take its own heads' block
    for spec in specs[1:]:
        assert rows[spec]["scales_max_rel_diff"] < 0.02, (spec, rows[spec])
    stated, rank0 = many[("fp8_e4m3:per_head:calibrated", 0)]["scales"], \
        many[("fp8_e4m3:per_head:calibrated", 0)]["rank_scales"]
    assert all(stated[k].numel() == 2 and torch.equal(rank0[k], stated[k][:1]) for k in stated)
    tensor = many[("fp8_e4m3:calibrated", 0)]["scales"]
    assert all(tensor[k].numel() == 1 for k in tensor)


def test_tensor_parallel_ranks_replay_the_paths_own_attention():
    """The forward context on tensor-parallel ranks (issue 45): a path whose attention is not the reference's
    (class 3, the K scale on a BF16 cache's scores) replays at TP=2 what it replays on one device, and not what
    the reference replays. The first next-token distribution after the prompt has the same context on every side:
    at TP=2 the path sits far from the reference there (KL above 0.05 nats) and within the TP noise of its own
    one-device run (the KL_MEAN_LIMIT above)."""
    spec = "bf16:calibrated:k_scale_on_scores"
    one, many, rows = _compare(CANARIES / "gqa", ["cpu", "cpu"], (None, spec))
    assert rows[spec]["kl_mean"] < KL_MEAN_LIMIT, rows[spec]
    path, reference = many[(spec, 0)]["logprobs"][0], many[(None, 0)]["logprobs"][0]
    apart = float((reference.exp() * (reference - path)).sum())
    print(f"\nTP=2: KL(reference || {spec}) at the first position = {apart:.4f} nats; TP=2 vs TP=1: {rows[spec]}")
    assert apart > 0.05, "the ranks replayed the reference's attention under the path's name"


def _compare(model: Path, devices: list[str], specs):
    from harness.replay.inprocess import InProcessModel

    prompts = tp_compare.PROMPTS[:1]
    loaded = InProcessModel.load(model, device=devices[0] if devices[0] != "cpu" else "cpu")
    one = tp_compare.replay(loaded, specs, prompts, 8)
    continuations = {str(model): {k: v["tokens"] for k, v in one.items()}}
    many = tp_compare.run_ranks(devices, [str(model)], specs, prompts, 8, continuations)[str(model)]
    return one, many, tp_compare.noise(one, many)


def test_random_weights_without_files_are_the_same_seeded_model_on_every_rank(tmp_path):
    from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER, tiny_config
    from harness.canary.tokenizer import save_tokenizer

    tiny_config("gqa").save_pretrained(str(tmp_path))
    save_tokenizer(tmp_path)
    (tmp_path / RANDOM_WEIGHTS_MARKER).write_text("random\n")
    found = tp_compare.check_random_weights(str(tmp_path), ["cpu", "cpu"])
    assert found["sharded"] > 0 and found["mismatched"] == [], found


def test_a_tensor_parallel_run_on_two_cpu_ranks_stores_every_unit_and_its_layout(tmp_path):
    config = build_run_config(command=["pytest", "tp"], out=tmp_path / "run", device="cpu,cpu", shard="tensor",
                              models=[CANARIES / "gqa"], select=("id:canary-arith-1",), paths="fp8_e4m3:calibrated")
    run_dir = job.run_job(config, warn=lambda message: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete", manifest.get("warnings")
    parallel = manifest["parallel"]
    assert parallel["kind"] == "tensor-parallel" and parallel["world_size"] == 2 and parallel["backend"] == "gloo"
    assert parallel["models"]["gqa"]["kv_heads_per_rank"] == 1
    assert manifest["batching"]["gqa"] == {"off": job.TENSOR_PARALLEL_ONE_AT_A_TIME}
    verdicts = [json.loads(line) for line in (run_dir / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    assert {v["path"] for v in verdicts} >= {"bf16", "fp8_e4m3:calibrated"}
    done = (run_dir / "done.jsonl").read_text().splitlines() if (run_dir / "done.jsonl").exists() else None
    assert done is None or len(done) == len(set(done)), "a unit stored twice (only rank 0 writes)"


# ---------------------------------------------------------------- multi-GPU hosts


# Two H100s (session 8): gqa and mla at TP=2 give TP=1's tokens, reference kl_mean 2.5e-4 / 2.2e-4. The hybrid
# does not: its reference reads kl_mean 0.60 on this prompt's 2 tokens (0/2 agree) and 0.049 over 25 tokens
# (benchmarks/tp_compare.py), well past the limit. On the CPU a plain transformers forward of the hybrid at TP=2 vs
# TP=1 reads KL 2.2e-2 in bf16 and 1e-8 in float32 (the split is right; its gated-delta layers amplify bf16
# reduction order), but the float32 check has not run on a GPU: strict, so a change either way is seen.
HYBRID_TP = pytest.param("hybrid", marks=pytest.mark.xfail(strict=True, reason="hybrid canary at TP=2 on two "
                         "H100s: reference kl_mean 0.60 against TP=1 (bf16; float32 agrees on the CPU), measured"))


@pytest.mark.multigpu
@pytest.mark.parametrize("family", ["gqa", "mla", HYBRID_TP])
def test_tp2_on_two_gpus_replays_what_one_gpu_replays_within_the_noise_floor(family):
    """The canaries at TP=2 (NCCL, our Triton decode kernels on each rank's heads) against one GPU."""
    specs = (None, "bf16", "fp8_e4m3", "fp8_e4m3:per_head:calibrated")
    one, many, rows = _compare(CANARIES / family, ["cuda:0", "cuda:1"], specs)
    print(f"\n{family} TP=2 (nccl) vs TP=1:", json.dumps(rows, indent=1))
    for spec, row in rows.items():
        assert row["kl_mean"] < KL_MEAN_LIMIT, (spec, row)
    assert rows["fp8_e4m3:per_head:calibrated"]["scales_max_rel_diff"] is not None


@pytest.mark.multigpu
def test_a_tensor_parallel_run_on_two_gpus_stores_every_unit(tmp_path):
    config = build_run_config(command=["pytest", "tp"], out=tmp_path / "run", device="cuda:0,1", shard="tensor",
                              select=("id:canary-arith-*",))
    run_dir = job.run_job(config)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete", manifest.get("warnings")
    assert manifest["parallel"]["kind"] == "tensor-parallel" and manifest["parallel"]["backend"] == "nccl"
    assert set(manifest["parallel"]["models"]) == {m["label"] for m in manifest["models"]}
    verdicts = [json.loads(line) for line in (run_dir / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    assert verdicts and all(v["verdict"] in ("pass", "warn", "fail") for v in verdicts)


def test_rank_device_lists_parse_in_both_spellings():
    """`--device cuda:0,1` and the `cuda:0,cuda:1` the rank processes are handed name the same ranks (an H100 pair
    failed on the second spelling: every rank read one device)."""
    from harness.replay.tensor_parallel import split_world

    assert split_world("cuda:0,1") == split_world("cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    assert split_world("cpu,cpu") == ["cpu", "cpu"] and split_world("cuda:1") == ["cuda:1"]
