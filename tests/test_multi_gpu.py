"""One model over several GPUs of a host (`harness run --device cuda:0,1 --shard layers`).

CPU: the shard plan of every family's tiny model (every tensor placed, layers contiguous), the manifest layout,
and the refusals of specs that cannot shard (said by name, before any model loads). Multi-GPU hosts
(`multigpu`, `--gpu` with at least 2 GPUs): a layer-sharded model replays bit for bit what it replays on one GPU,
and a sharded `harness run` stores every unit with the layout in its manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import job
from harness.canary.registry import build_model, tiny_config
from harness.replay import sharding
from harness.run_config import build_run_config
from harness.runs.store import RunStore

CANARIES = Path(__file__).resolve().parent.parent / "harness" / "canary" / "weights"
# one family of each kind (dense, sliding window, MLA, MoE, hybrids with linear / SSM layers), tiny from the registry
SHARDED_FAMILIES = ["llama", "qwen3", "gemma2", "gemma3_text", "cohere2", "deepseek_v3", "glm4_moe_lite", "mixtral",
                    "qwen3_moe", "gpt_oss", "llama4_text", "qwen3_next", "falcon_h1", "lfm2", "nemotron_h"]


def meta_model(family: str | None = None, directory: Path | None = None):
    """A family's tiny model (or a model directory's), built on the meta device: shapes only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        if family:
            return build_model(family, tiny_config(family))
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(directory)))


@pytest.mark.parametrize("layers, gpus, sizes", [(80, 2, [40, 40]), (6, 4, [2, 2, 1, 1]), (7, 3, [3, 2, 2]),
                                                  (2, 3, [1, 1, 0])])
def test_layer_blocks_are_contiguous_and_as_equal_as_possible(layers, gpus, sizes):
    blocks = sharding.layer_blocks(layers, [f"cuda:{i}" for i in range(gpus)])
    assert [len(b) for b in blocks] == sizes
    assert [i for b in blocks for i in b] == list(range(layers))


@pytest.mark.parametrize("family", SHARDED_FAMILIES)
@pytest.mark.parametrize("gpus", [2, 3])
def test_every_tensor_of_every_family_gets_a_gpu(family, gpus):
    """Embeddings and rotary tables on the first GPU, final norm and LM head on the last, each decoder layer
    on the GPU of its block; nothing left out (accelerate refuses a map that misses a tensor)."""
    model = meta_model(family)
    devices = [f"cuda:{i}" for i in range(gpus)]
    plan = sharding.plan_for(model, devices)
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        device = sharding._module_device(plan.device_map, name)
        if name.startswith(plan.layers_prefix + "."):
            assert device == plan.layer_device(int(name.split(".")[len(plan.layers_prefix.split("."))]))
    assert sharding._module_device(plan.device_map, "lm_head.weight") == devices[-1]
    embed = next(name for name, _ in model.named_parameters() if "embed" in name)
    assert sharding._module_device(plan.device_map, embed) == devices[0]
    described = plan.describe()
    assert list(described["layers"]) == devices and described["num_layers"] == model.config.num_hidden_layers


@pytest.mark.parametrize("shard, devices, message", [
    ("layers", ["cuda:0"], "splits one model over several GPUs"),
    ("layers", ["cpu"], "splits one model over several GPUs"),
    ("layers", ["cuda"], "e.g. --device cuda:0,1"),
    ("tensor", ["cuda:0"], "runs a process per GPU"),
    ("pipes", ["cuda:0", "cuda:1"], "unknown"),
])
def test_specs_that_cannot_shard_are_refused_by_name(shard, devices, message):
    with pytest.raises(sharding.ShardError, match=message):
        sharding.check_shard(shard, devices)


def test_a_shard_needs_no_check_without_shard():
    sharding.check_shard(None, ["cpu"])  # no --shard: nothing to refuse
    sharding.check_shard("layers", ["cuda:0", "cuda:1"])


@pytest.mark.parametrize("fields, message", [
    (dict(device="cuda:0"), "splits one model over several GPUs"),
    (dict(device="cuda:0,1", reference_url="http://127.0.0.1:1"), "endpoint run"),
    (dict(device="cuda:0,1", decode="graph", shard="tensor"), "tensor-parallel ranks"),
    (dict(device="cuda:0,1", decode="static", shard="tensor"), "tensor-parallel ranks"),
])
def test_run_configs_that_cannot_shard_are_refused(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, **{"shard": "layers", **fields})


@pytest.mark.parametrize("decode", ["graph", "static", "dynamic"])
def test_a_layer_sharded_run_takes_every_decode_mode(tmp_path, decode):
    config = job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, device="cuda:0,1", shard="layers",
                           decode=decode)
    assert config.batched and config.decode == decode


def test_the_fp32_reference_noise_path_is_refused_with_shard(tmp_path):
    from harness.kv_paths.spec import parse_paths

    with pytest.raises(ValueError, match="fp32 path replays a float32 copy"):
        job.RunConfig(models=(), scenario_paths=(), paths=tuple(parse_paths("bf16,fp32")), out=tmp_path,
                      device="cuda:0,1", shard="layers")


def test_a_layer_sharded_run_config_is_batched_and_decodes_by_graph(tmp_path):
    from transformers import LlamaConfig

    from harness.replay.route import decide

    config = job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, device="cuda:0,1", shard="layers")
    assert config.batched
    assert job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, device="cuda:0,1", shard="layers",
                         batch_size=8).batched
    gqa = json.loads((CANARIES / "gqa" / "config.json").read_text())
    route = decide(None, LlamaConfig(**{k: v for k, v in gqa.items() if k != "architectures"}), "cuda", True,
                   batched=True, shard="layers")
    assert route.batch_refusal is None and route.decode == "graph"
    tensor = decide(None, LlamaConfig(**{k: v for k, v in gqa.items() if k != "architectures"}), "cuda", True,
                    batched=True, shard="tensor")
    assert tensor.decode.startswith("dynamic (graph decode refused for this model: tensor-parallel ranks")


def test_a_gpu_the_host_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"torch sees 2 CUDA device\(s\) \(cuda:0..cuda:1\)"):
        job.resolve_device("cuda:5")


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--shard", "layers"], "--shard layers splits one model over several GPUs"),
    (["--device", "cpu", "--shard", "tensor"], "--shard tensor runs a process per GPU"),
])
def test_the_cli_refuses_a_bad_shard_without_a_traceback(tmp_path, capsys, argv, message):
    from harness.cli import main

    code = main(["run", "--out", str(tmp_path / "run"), "--model", str(CANARIES / "gqa"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_manifest_records_each_models_layer_blocks(tmp_path):
    from harness.executor.model_replay import note_shards

    store = RunStore.create(tmp_path / "run", {"models": [], "warnings": [], "scales": {}})
    said = []
    for label in ("gqa", "mla"):
        plan = sharding.plan_for(meta_model(directory=CANARIES / label), ["cuda:0", "cuda:1"])
        note_shards(store, label, plan, said.append)
    manifest = store.read_manifest()
    parallel = manifest["parallel"]
    assert parallel["kind"] == "layer-sharded" and parallel["devices"] == ["cuda:0", "cuda:1"]
    assert set(parallel["models"]) == {"gqa", "mla"}
    layers = parallel["models"]["gqa"]["layers"]
    assert layers == {"cuda:0": "0-2", "cuda:1": "3-5"}  # the gqa canary has 6 layers
    assert "off" not in (manifest.get("batching") or {}).get("gqa", {})
    assert said and "cuda:1: layers 3-5" in said[0] and job.SHARDED_DECODE in said[0]


def test_without_accelerate_the_refusal_says_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_accelerate(name, *args, **kwargs):
        if name == "accelerate" or name.startswith("accelerate."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_accelerate)
    with pytest.raises(sharding.ShardError, match="pip install accelerate"):
        sharding._need_accelerate()


# ---------------------------------------------------------------- the route on the CPU (accelerate's hooks, 2 "cpu" devices)


@pytest.fixture
def cpu_stand_in_gpus(monkeypatch):
    """--shard layers over two "cpu" devices: the same accelerate dispatch and harness route as on GPUs, minus the
    device hop (the GPU tests below check that part)."""
    pytest.importorskip("accelerate", reason="the test extras install accelerate (pip install -e '.[test]')")
    monkeypatch.setattr(sharding, "split_devices", lambda device: ["cpu", "cpu"])
    monkeypatch.setattr(sharding, "check_shard", lambda shard, devices: None)


def test_a_sharded_model_on_stand_in_devices_replays_what_the_plain_model_replays(cpu_stand_in_gpus):
    from harness.kv_paths.spec import parse_path
    from harness.replay.inprocess import InProcessModel
    from harness.types import Message

    plain = InProcessModel.load(CANARIES / "gqa")
    sharded = InProcessModel.load(CANARIES / "gqa", device="cpu", shard="layers")
    assert sharded.shard_plan is not None and sharded.shard_plan.describe()["num_layers"] == 6
    messages = [Message("user", "What is 2 + 3?")]
    for spec in (None, "fp8_e4m3:calibrated"):
        path = parse_path(spec) if spec else None
        ids, metrics, logprobs = _generate_and_score(plain, path, messages)
        ids_s, metrics_s, logprobs_s = _generate_and_score(sharded, path, messages)
        assert ids_s == ids and metrics_s == metrics and torch.equal(logprobs_s, logprobs), spec


def test_random_weights_without_files_are_made_on_their_devices_seeded(tmp_path, cpu_stand_in_gpus):
    """A config + tokenizer + marker directory (no weight files) builds seeded random weights straight on each
    module's device: matrices normal(0, initializer_range), norms ones; the same seed, the same weights."""
    import shutil

    from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER
    from harness.replay.inprocess import ATTENTION_NAME  # noqa: F401 - importing registers the "harness" function

    for f in (CANARIES / "gqa").iterdir():
        if f.name.startswith("tokenizer") or f.name in ("config.json", "chat_template.jinja"):
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / RANDOM_WEIGHTS_MARKER).write_text("random\n")
    assert not sharding.has_weight_files(tmp_path)
    first, _ = sharding.load_sharded(tmp_path, ["cpu", "cpu"], torch.bfloat16, "harness", random_weights=True)
    second, _ = sharding.load_sharded(tmp_path, ["cpu", "cpu"], torch.bfloat16, "harness", random_weights=True)
    params = dict(first.named_parameters())
    assert all(torch.equal(p, dict(second.named_parameters())[n]) for n, p in params.items())
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in params.values())
    assert torch.all(params["model.norm.weight"] == 1)
    assert abs(float(params["model.layers.0.mlp.up_proj.weight"].detach().float().std()) - 0.02) < 0.002
    with pytest.raises(FileNotFoundError, match="no weight files"):
        sharding.load_sharded(tmp_path, ["cpu", "cpu"], torch.bfloat16, "harness", random_weights=False)


def test_a_sharded_run_on_stand_in_devices_stores_its_layout_and_verdicts(tmp_path, cpu_stand_in_gpus):
    config = build_run_config(command=["pytest", "sharded"], out=tmp_path / "run", device="cpu", shard="layers",
                              models=[CANARIES / "gqa"], select=("id:canary-arith-1",), paths="fp8_e4m3")
    assert not config.batched  # the CPU's default: one sequence at a time (--batch-size batches it, below)
    run_dir = job.run_job(config, warn=lambda message: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["parallel"]["kind"] == "layer-sharded" and set(manifest["parallel"]["models"]) == {"gqa"}
    verdicts = [json.loads(line) for line in (run_dir / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    assert {v["path"] for v in verdicts} >= {"bf16", "fp8_e4m3"}


def _records(run_dir: Path) -> list[tuple]:
    """A run's metric records, in order, without wall times (they differ between any two runs)."""
    def timed(metric: str) -> bool:
        return "ms" in metric.split("_") or metric.endswith(("_s", "seconds"))

    rows = [(r["model"], r["scenario"], r["path"], r["turn"], r["kind"], r["metric"], json.dumps(r["value"]))
            for r in RunStore(run_dir).read("records") if not timed(str(r["metric"]))]
    return sorted(rows)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_a_layer_sharded_model_replays_in_batches_what_the_plain_model_replays(tmp_path, cpu_stand_in_gpus, decode):
    """--shard layers with --batch-size: the model's batches (several rows) through accelerate's hooks store the records
    the same batches store on the plain model, decoding dynamically or on static storage (the GPU tests below add the
    device hop and graph decode)."""
    common = dict(command=["pytest", "sharded"], models=[CANARIES / "gqa"], select=("id:canary-arith-*",),
                  paths="fp8_e4m3", batch_size=4, decode=decode)
    plain = build_run_config(out=tmp_path / "plain", device="cpu", **common)
    sharded = build_run_config(out=tmp_path / "sharded", device="cpu", shard="layers", **common)
    assert plain.batched and sharded.batched
    runs = [job.run_job(config, warn=lambda message: None) for config in (plain, sharded)]
    manifests = [json.loads((run / "manifest.json").read_text()) for run in runs]
    assert all(m["status"] == "complete" for m in manifests)
    assert manifests[1]["parallel"]["kind"] == "layer-sharded"
    assert manifests[1]["batching"]["gqa"]["largest_batch"] > 1, manifests[1]["batching"]
    assert all(m["batching"]["gqa"]["decode"]["batches"].keys() == {decode} for m in manifests), manifests
    assert _records(runs[0]) and _records(runs[1]) == _records(runs[0])


# ---------------------------------------------------------------- multi-GPU hosts


def _generate_and_score(loaded, path, messages):
    backend = loaded.backend(path)
    generated = backend.generate_sync(messages, 24)
    scored = backend.score_sync(messages, generated.token_ids)
    return generated.token_ids, generated.metrics, scored.logprobs


@pytest.mark.multigpu
@pytest.mark.parametrize("family", ["gqa", "mla", "hybrid"])
def test_a_layer_sharded_model_replays_bit_for_bit_what_one_gpu_replays(family):
    """The same ops on the same weights, only on another GPU: tokens, FP8 write statistics, kernel agreement and
    teacher-forced log-probs are identical (reference, bf16 and an FP8 path through our Triton kernel)."""
    from harness.kv_paths.spec import parse_path
    from harness.replay.inprocess import InProcessModel
    from harness.types import Message

    torch.cuda.set_device(0)
    one = InProcessModel.load(CANARIES / family, device="cuda:0")
    sharded = InProcessModel.load(CANARIES / family, device="cuda:0,1", shard="layers")
    placed = {p.device for p in sharded.model.parameters()}
    assert placed == {torch.device("cuda:0"), torch.device("cuda:1")}
    messages = [Message("user", "What is 17 + 25? Answer with the number.")]
    for spec in (None, "bf16", "fp8_e4m3", "fp8_e4m3:calibrated"):
        path = parse_path(spec) if spec else None
        ids_one, metrics_one, logprobs_one = _generate_and_score(one, path, messages)
        ids_sharded, metrics_sharded, logprobs_sharded = _generate_and_score(sharded, path, messages)
        assert ids_sharded == ids_one, spec
        keep = lambda m: {k: v for k, v in (m or {}).items() if "ms_per" not in k}  # noqa: E731 - wall time
        assert keep(metrics_sharded) == keep(metrics_one), spec
        assert torch.equal(logprobs_sharded, logprobs_one), spec


def _sharded_batches_store_what_one_gpu_stores(tmp_path, devices: str, decode: str, models=None) -> dict:
    """The manifests' `batching` of the sharded run, after checking its records against one GPU's in the same
    decode mode (graph: each step's graphs against one graph; a graph replays the ops the eager pass ran)."""
    common = dict(command=["pytest", "sharded"], select=("id:canary-arith-*", "id:canary-recall-*"),
                  paths="bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated", batch_size=8, decode=decode)
    if models is not None:
        common["models"] = models
    one = build_run_config(out=tmp_path / "one", device="cuda:0", **common)
    sharded = build_run_config(out=tmp_path / "sharded", device=devices, shard="layers", **common)
    runs = [job.run_job(config, warn=lambda message: None) for config in (one, sharded)]
    manifests = [json.loads((run / "manifest.json").read_text()) for run in runs]
    assert all(m["status"] == "complete" for m in manifests), [m.get("warnings") for m in manifests]
    for batching in (m["batching"] for m in manifests):
        assert all(b["largest_batch"] > 1 and b["decode"]["batches"].keys() == {decode}
                   and not b["decode"]["fallbacks"] for b in batching.values()), batching
    assert _records(runs[0]) and _records(runs[1]) == _records(runs[0])
    return manifests[1]["batching"]


@pytest.mark.multigpu
@pytest.mark.parametrize("decode", ["dynamic", "graph"])
def test_a_layer_sharded_batched_run_stores_what_one_gpu_stores(tmp_path, decode):
    """The model's batches over two GPUs (each layer's cache, paged copy and Triton kernel on its GPU) store the
    records the same batches store on one GPU in the same decode mode: the same ops on the same weights. A graph
    step is a graph per GPU: the first GPU's layers, the second's, then the first's again (the logits brought back
    and the step's lengths advanced)."""
    batching = _sharded_batches_store_what_one_gpu_stores(tmp_path, "cuda:0,1", decode)
    if decode == "graph":
        assert {tuple(b["decode"]["graph_segments"]) for b in batching.values()} == {("cuda:0 > cuda:1 > cuda:0",)}


@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["dynamic", "graph"])
def test_a_layer_sharded_batched_run_on_one_gpu_stand_in_stores_what_one_gpu_stores(tmp_path, monkeypatch, decode):
    """The same on one GPU named twice (accelerate's hooks, the sharded route and our Triton kernels on CUDA, minus
    the hop between GPUs, which the multigpu test above adds): a graph step records as one segment."""
    pytest.importorskip("accelerate", reason="the test extras install accelerate (pip install -e '.[test]')")
    monkeypatch.setattr(sharding, "split_devices", lambda device: ["cuda:0", "cuda:0"])
    monkeypatch.setattr(sharding, "check_shard", lambda shard, devices: None)
    batching = _sharded_batches_store_what_one_gpu_stores(tmp_path, "cuda:0", decode)
    if decode == "graph":
        assert {tuple(b["decode"]["graph_segments"]) for b in batching.values()} == {("cuda:0",)}


@pytest.mark.multigpu
def test_a_sharded_run_stores_every_unit_and_its_layout(tmp_path):
    devices = f"cuda:0,{torch.cuda.device_count() - 1}"
    config = build_run_config(command=["pytest", "sharded"], out=tmp_path / "run", device=devices, shard="layers",
                              select=("id:canary-arith-*",))
    run_dir = job.run_job(config)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete", manifest.get("warnings")
    assert manifest["parallel"]["kind"] == "layer-sharded"
    assert set(manifest["parallel"]["models"]) == {m["label"] for m in manifest["models"]}
    verdicts = [json.loads(line) for line in (run_dir / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    assert verdicts and all(v["verdict"] in ("pass", "warn", "fail") for v in verdicts)
