"""Tensor parallel (`harness run --device cuda:0,1 --shard tensor`): a rank per device through transformers'
tensor-parallel plan, every rank replaying every unit, rank 0 writing.

CPU: refusals (by name, before any model loads), and two gloo ranks on the CPU (`--device cpu,cpu`): the tiny
gqa canary at TP=2 against TP=1 (tokens, teacher-forced KL, and the calibrated scales, which must be a one-device
run's: per-head amax gathered over the ranks, per-tensor the max over every head), a random-weights directory
made the same on every rank, the auto batch size agreed over the ranks (a stand-in collective), and a `harness run` replayed in batches
(--batch-size 4, dynamic decode, a fault path among its paths) against the same ranks one sequence at a time.
Multi-GPU hosts (`multigpu`): the three canaries at TP=2 against one GPU, a batched run over two GPUs, and its
batches against batches of one.

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
    assert config.shard_devices == ["cpu", "cpu"] and not config.batched  # as on one CPU: one sequence at a time
    assert job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, device="cpu,cpu", shard="tensor",
                         batch_size=4).batched
    assert job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, device="cuda:0,1",
                         shard="tensor").batched  # GPUs: batched by default, as on one GPU


@pytest.mark.parametrize("device, decode", [("cpu,cpu", "static"), ("cuda:0,1", "static"), ("cuda:0,1", "graph")])
def test_static_and_graph_decode_are_refused_by_name_with_tensor_parallel(tmp_path, device, decode):
    with pytest.raises(ValueError, match=rf"--shard tensor --decode {decode}: refused for tensor-parallel ranks"):
        job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, device=device, shard="tensor",
                      decode=decode, batch_size=4)


def test_the_cli_refuses_graph_decode_with_tensor_parallel_by_name(tmp_path, capsys):
    from harness.cli import main

    code = main(["run", "--out", str(tmp_path / "run"), "--model", str(CANARIES / "gqa"), "--device", "cpu,cpu",
                 "--shard", "tensor", "--batch-size", "4", "--decode", "static"])
    err = capsys.readouterr().err
    assert code == 2 and "--decode static: refused for tensor-parallel ranks" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_tensor_parallel_route_decodes_its_batches_dynamically():
    from transformers import AutoConfig

    from harness.replay.route import TENSOR_DECODE, decide

    gqa = AutoConfig.from_pretrained(str(CANARIES / "gqa"))
    route = decide(None, gqa, "cuda", True, batched=True, shard="tensor")
    assert route.batch_refusal is None
    assert route.decode == f"dynamic (graph decode refused for this model: {TENSOR_DECODE})"
    assert decide(None, gqa, "cpu", False, batched=True, shard="tensor").decode == "dynamic"


def test_the_layout_names_the_world_the_writer_and_the_batches():
    layout = tensor_parallel.layout(["cuda:0", "cuda:1"], {})
    assert layout["kind"] == "tensor-parallel" and layout["world_size"] == 2 and layout["backend"] == "nccl"
    assert layout["batch_composition"] == tensor_parallel.IN_LOCKSTEP_BATCHES
    alone = tensor_parallel.layout(["cpu", "cpu"], {}, batched=False)
    assert alone["backend"] == "gloo" and alone["batch_composition"] == tensor_parallel.ONE_AT_A_TIME_RANKS


def test_tp2_on_two_cpu_ranks_replays_what_one_device_replays_within_the_noise_floor(tmp_path):
    """TP=2 against TP=1, one pair of spawned ranks for every check (each spawn imports torch and transformers in
    two processes: ~15 s of CI's two cores):
    - the reference and two calibrated FP8 paths within the noise floor (KL_MEAN_LIMIT), their calibrated scales a
      one-device run's, each rank's per-head scales its own heads' block;
    - the forward context on tensor-parallel ranks (issue 45): a path whose attention is not the reference's (class
      3, the K scale on a BF16 cache's scores) replays at TP=2 what it replays on one device, and not what the
      reference replays. The first next-token distribution after the prompt has the same context on every side: at
      TP=2 the path sits far from the reference there (KL above 0.05 nats) and within the TP noise of its own
      one-device run;
    - then, in the same ranks, a random-weights directory without weight files: the same seeded model on every rank
      (each rank's slices, gathered, are the whole model made from that seed on one device)."""
    own = "bf16:calibrated:k_scale_on_scores"
    specs = (None, "fp8_e4m3:calibrated", "fp8_e4m3:per_head:calibrated", own)
    random_weights = _random_weights_directory(tmp_path)
    one, many, rows, found = _compare_then_random_weights(CANARIES / "gqa", ["cpu", "cpu"], specs, random_weights)
    assert found["sharded"] > 0 and found["mismatched"] == [], found
    print("\nTP=2 (gloo, cpu) vs TP=1:", json.dumps(rows, indent=1))
    for spec, row in rows.items():
        assert row["kl_mean"] < KL_MEAN_LIMIT, (spec, row)
    for spec in ("reference", *specs[1:3]):
        assert rows[spec]["scales_max_rel_diff"] is not None, (spec, "scale layers or shapes differ from one device's")
    # the calibrated scales are a one-device run's: per tensor the max over every rank's heads, per head the
    # whole vector; each rank's caches take its own heads' block
    for spec in specs[1:3]:
        assert rows[spec]["scales_max_rel_diff"] < 0.02, (spec, rows[spec])
    stated, rank0 = many[("fp8_e4m3:per_head:calibrated", 0)]["scales"], \
        many[("fp8_e4m3:per_head:calibrated", 0)]["rank_scales"]
    assert all(stated[k].numel() == 2 and torch.equal(rank0[k], stated[k][:1]) for k in stated)
    tensor = many[("fp8_e4m3:calibrated", 0)]["scales"]
    assert all(tensor[k].numel() == 1 for k in tensor)
    path, reference = many[(own, 0)]["logprobs"][0], many[(None, 0)]["logprobs"][0]
    apart = float((reference.exp() * (reference - path)).sum())
    print(f"\nTP=2: KL(reference || {own}) at the first position = {apart:.4f} nats")
    assert apart > 0.05, "the ranks replayed the reference's attention under the path's name"


def _compare(model: Path, devices: list[str], specs):
    from harness.replay.inprocess import InProcessModel

    prompts = tp_compare.PROMPTS[:1]
    loaded = InProcessModel.load(model, device=devices[0] if devices[0] != "cpu" else "cpu")
    one = tp_compare.replay(loaded, specs, prompts, 8)
    continuations = {str(model): {k: v["tokens"] for k, v in one.items()}}
    many = tp_compare.run_ranks(devices, [str(model)], specs, prompts, 8, continuations)[str(model)]
    return one, many, tp_compare.noise(one, many)


def _random_weights_directory(tmp_path: Path) -> Path:
    from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER, tiny_config
    from harness.canary.tokenizer import save_tokenizer

    directory = tmp_path / "random-weights"
    tiny_config("gqa").save_pretrained(str(directory))
    save_tokenizer(directory)
    (directory / RANDOM_WEIGHTS_MARKER).write_text("random\n")
    return directory


def _compare_then_random_weights(model: Path, devices: list[str], specs, random_weights: Path):
    """`_compare`'s replay at TP=2, then `tp_compare.check_random_weights` on `random_weights`, in one pair of spawned
    ranks (two pairs cost ~20 s more of CI's CPU: each rank process imports torch and transformers)."""
    from harness.replay.inprocess import InProcessModel
    from harness.replay.tensor_parallel import free_port

    prompts = tp_compare.PROMPTS[:1]
    one = tp_compare.replay(InProcessModel.load(model), specs, prompts, 8)
    continuations = {str(model): {k: v["tokens"] for k, v in one.items()}}
    replay_args = ([str(model)], specs, prompts, 8, continuations)
    found = tp_compare._spawn_ranks(devices, _replay_then_random_weights_rank,
                                    (free_port(), replay_args, str(random_weights)), 600)
    many = found["replay"][str(model)]
    return one, many, tp_compare.noise(one, many), found["random_weights"]


def _replay_then_random_weights_rank(rank: int, devices: list[str], port: int, random_port: int, replay_args: tuple,
                                     random_weights: str, queue) -> None:
    """One rank: tp_compare's replay rank, then its random-weights rank in a second process group; rank 0 hands both
    results over at once, any rank its first error."""
    import types

    said: list[bytes] = []
    here = types.SimpleNamespace(put=said.append)
    try:
        tp_compare._rank(rank, devices, port, *replay_args, here)
        tp_compare._random_rank(rank, devices, random_port, random_weights, 0, here)
    finally:
        found = [tp_compare._from_bytes(item) for item in said]
        errors = [f for f in found if "error" in f]
        if errors:
            queue.put(tp_compare._as_bytes(errors[0]))
        elif rank == 0:
            queue.put(tp_compare._as_bytes({"replay": found[0], "random_weights": found[1]} if len(found) == 2 else
                                            {"error": f"rank 0: {len(found)} results of 2"}))


SMOKE = ROOT / "tests" / "data" / "scenarios" / "smoke.yaml"
# smoke-chat (two generated turns of 6 tokens, one fixed) and smoke-arith (EOS after 2 tokens) in one batch: a row
# leaves its batch mid-decode on every rank. A healthy per-head calibrated path (amax gathered over the ranks, each
# rank's caches cut to its heads) and the zoo's dropped-scales fault beside the reference, bf16 and its control.
BATCHED_PATHS = "fp8_e4m3:per_head:calibrated,fp8_e4m3:calibrated:fault=scale_dropped"


def _tensor_parallel_runs(tmp_path: Path, device: str, batched: dict, alone: dict) -> list[Path]:
    """The same tensor-parallel run replayed in batches (`batched`'s fields) and one sequence at a time (`alone`'s)."""
    common = dict(command=["pytest", "tp"], device=device, shard="tensor", models=[CANARIES / "gqa"],
                  scenario_paths=[SMOKE], select=("id:smoke-chat", "id:smoke-arith"), paths=BATCHED_PATHS,
                  yardstick="none")
    return [job.run_job(build_run_config(out=tmp_path / name, **common, **fields), warn=lambda message: None)
            for name, fields in (("batched", batched), ("alone", alone))]


def _assert_batches_replay_what_one_at_a_time_replays(runs: list[Path], exact_faults: bool = True) -> None:
    """Every unit stored once in both runs, the batched run's batches several rows and dynamic, and its records those
    of one sequence at a time: the same verdicts, the same texts, each turn's teacher-forced kl_mean within
    KL_MEAN_LIMIT. exact_faults False: a fault path's texts and kl_mean are left out (its verdict still compared).

    Why that tolerance: both runs split the model over the same ranks, so the TP rounding is common to both and
    only the batch composition differs (left padding changes the reduction order of attention and GEMMs: the
    batch-invariance floor the batched run measures). The TP tests' own floor, KL_MEAN_LIMIT, is the least KL
    this file calls noise; a lockstep slip (ranks in different batches, one rank's rows dropped at another step,
    two sequences' partials summed) gives KLs of order 1 and other tokens. Measured on the CPU (two gloo ranks):
    texts 20 of 20 identical, kl_mean moved by <= 3e-6 (per-head path) and 8e-6 (the fault's, ~7 nats). A fault
    path amplifies rounding (dropped scales saturate the softmax: its tokens are noise and its kl_mean moved by
    3 nats between a TP=2 and a one-device run of the same batches), so where batches of other shapes may round
    otherwise (cuBLAS on GPUs) only its verdict is compared."""
    manifests = [json.loads((run / "manifest.json").read_text()) for run in runs]
    assert all(m["status"] == "complete" for m in manifests), [m.get("warnings") for m in manifests]
    batched = manifests[0]
    assert batched["parallel"]["kind"] == "tensor-parallel"
    assert batched["parallel"]["batch_composition"] == tensor_parallel.IN_LOCKSTEP_BATCHES
    for label, batching in batched["batching"].items():
        assert batching["largest_batch"] > 1 and batching["decode"]["batches"].keys() == {"dynamic"}, (label, batching)
        assert batching["one_at_a_time_fallbacks"] == [] and batching["one_sequence_paths"] == {}, (label, batching)
    done = [_rows(run, "done") for run in runs]
    assert all(len(d) == len(set(d)) for d in done), "a unit stored twice (only rank 0 writes)"
    assert set(done[0]) == set(done[1]) and len(done[0]) == 10 * len(batched["batching"])  # 2 scenarios x 5
    verdicts = [{(v["model"], v["scenario"], v["path"], v["turn"]): v["verdict"] for v in _read(run, "verdicts")}
                for run in runs]
    assert verdicts[0] == verdicts[1]
    assert {verdict for (_, _, path, _), verdict in verdicts[0].items() if "fault=" in path} == {"fail"}

    def compared(row: dict) -> bool:
        return exact_faults or "fault=" not in row["path"]

    texts = [{_key(r): r["token_ids"] for r in _read(run, "texts") if compared(r)} for run in runs]
    assert texts[0] == texts[1]
    kls = [{_key(r): r["value"] for r in _read(run, "records") if r["metric"] == "kl_mean" and compared(r)}
           for run in runs]
    assert kls[0].keys() == kls[1].keys() and kls[0]
    moved = {key: abs(kls[0][key] - kls[1][key]) for key in kls[0]}
    print("\nTP batched vs one at a time, |kl_mean moved|:", {"/".join(map(str, k)): v for k, v in moved.items()})
    assert max(moved.values()) < KL_MEAN_LIMIT, moved


def _key(row: dict) -> tuple:
    return row["model"], row["scenario"], row["path"], row["turn"]


def _read(run_dir: Path, table: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"{table}.jsonl").read_text().splitlines() if line.strip()]


def _rows(run_dir: Path, table: str) -> list[tuple]:
    return [(r["model"], r["scenario"], r["path"]) for r in _read(run_dir, table)]


def test_a_tensor_parallel_run_on_two_cpu_ranks_replays_in_batches_what_it_replays_one_at_a_time(tmp_path):
    """Two gloo ranks, --batch-size 4, against the same ranks one sequence at a time (the CPU ranks' default)."""
    runs = _tensor_parallel_runs(tmp_path, "cpu,cpu", dict(batch_size=4), {})
    batched, alone = [json.loads((run / "manifest.json").read_text()) for run in runs]
    assert batched["parallel"]["models"]["gqa"]["kv_heads_per_rank"] == 1 and batched["parallel"]["backend"] == "gloo"
    assert "batching" not in alone and alone["parallel"]["batch_composition"] == tensor_parallel.ONE_AT_A_TIME_RANKS
    _assert_batches_replay_what_one_at_a_time_replays(runs)


class _StandIn:
    """What `auto_batch_size` reads of a model: its config (the gqa canary's)."""

    def __init__(self):
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(str(CANARIES / "gqa"))


def _auto_batch_size(free: int, total: int) -> int:
    """`auto_batch_size` at 4096 tokens for 1000 sequences on a stand-in CUDA device with `free` bytes free."""
    from harness.replay.batched import auto_batch_size

    torch.cuda.mem_get_info = lambda device: (free, total)
    return auto_batch_size(_StandIn(), torch.device("cuda"), 4096, 1000)


def test_the_auto_batch_size_is_the_same_on_every_rank(monkeypatch):
    """Each rank reads its own free memory; every rank cuts the batches the least free rank affords (one
    all_reduce MIN), so no rank runs a batch the others do not. Rank 0 of two with 256 MiB free, the other rank
    64 MiB: rank 0 takes the 64 MiB size, fewer sequences than its own 256 MiB affords. The other rank is a stand-in
    collective in this process (torch's gloo MIN is not what is tested, and two spawned ranks cost ~28 s of CI's
    two cores): without the all_reduce, rank 0 would cut its own 256 MiB batches."""
    import torch.distributed as dist

    free = [256 << 20, 64 << 20]
    monkeypatch.setattr(torch.cuda, "mem_get_info", torch.cuda.mem_get_info)  # restored after this test's calls
    least, most = _auto_batch_size(free[1], free[0]), _auto_batch_size(free[0], free[0])
    assert least < most, (least, most)
    reduced = []

    def all_reduce(tensor, op=None):  # the other rank's value met by a MIN, as gloo's all_reduce would
        assert op == dist.ReduceOp.MIN, op
        reduced.append(int(tensor.item()))
        tensor.copy_(torch.minimum(tensor, torch.tensor([free[1]], dtype=tensor.dtype)))

    monkeypatch.setattr(tensor_parallel, "world", lambda: (0, 2))
    monkeypatch.setattr(tensor_parallel, "_collective_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert _auto_batch_size(free[0], free[0]) == least, "rank 0 cut batches of its own free memory"
    assert reduced == [free[0]], reduced  # one collective, of this rank's own free memory


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
    """The three canaries at TP=2 on GPUs, batched by default (the batch size from the least free memory of the
    two GPUs, agreed over NCCL; graph decode refused, so dynamic)."""
    from harness.replay.route import TENSOR_DECODE

    config = build_run_config(command=["pytest", "tp"], out=tmp_path / "run", device="cuda:0,1", shard="tensor",
                              select=("id:canary-arith-*",))
    assert config.batched
    run_dir = job.run_job(config)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete", manifest.get("warnings")
    assert manifest["parallel"]["kind"] == "tensor-parallel" and manifest["parallel"]["backend"] == "nccl"
    assert set(manifest["parallel"]["models"]) == {m["label"] for m in manifest["models"]}
    for label, batching in manifest["batching"].items():  # 3 arith scenarios: one batch of 3 rows at least
        assert batching["largest_batch"] > 1 and batching["decode"]["batches"].keys() == {"dynamic"}, (label, batching)
        assert any(TENSOR_DECODE in why for why in batching["decode"]["fallbacks"]), (label, batching)
    verdicts = [json.loads(line) for line in (run_dir / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    assert verdicts and all(v["verdict"] in ("pass", "warn", "fail") for v in verdicts)


@pytest.mark.multigpu
def test_a_tensor_parallel_run_on_two_gpus_replays_in_batches_what_batches_of_one_replay(tmp_path):
    """As the CPU test above over NCCL, our Triton decode kernels on each rank's heads: auto-sized batches against
    batches of one row (a GPU run is batched by default)."""
    runs = _tensor_parallel_runs(tmp_path, "cuda:0,1", {}, dict(batch_size=1))
    _assert_batches_replay_what_one_at_a_time_replays(runs, exact_faults=False)


def test_rank_device_lists_parse_in_both_spellings():
    """`--device cuda:0,1` and the `cuda:0,cuda:1` the rank processes are handed name the same ranks (an H100 pair
    failed on the second spelling: every rank read one device)."""
    from harness.replay.tensor_parallel import split_world

    assert split_world("cuda:0,1") == split_world("cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    assert split_world("cpu,cpu") == ["cpu", "cpu"] and split_world("cuda:1") == ["cuda:1"]
