"""`harness run --batch-size N`: the batched runner stores the same rows as the one-at-a-time runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main

SCENARIOS = Path(__file__).parent / "data" / "scenarios" / "smoke.yaml"
# the one-at-a-time runs in this process: the CLI's default, a pool of a spawned worker per core, cost ~14 s of CPU a
# run on the 2-core EPYC (importing torch and transformers twice) and is not what these tests compare
IN_PROCESS = ("--jobs", "1")


def _rows(run_dir: Path, table: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"{table}.jsonl").read_text().splitlines() if line.strip()]


def _key(row: dict) -> tuple:
    return row["model"], row["scenario"], row["path"], row["turn"], row.get("metric") or row.get("series")


@pytest.mark.slow  # two whole runs: ~75 s each on the shared 2-core machine
@pytest.mark.parametrize("history", ["reference-history", pytest.param("own-history", marks=pytest.mark.matrix)])
def test_batched_run_stores_the_same_rows(tiny_models, tmp_path, history):
    common = ["--scenarios", str(SCENARIOS), "--paths", "bf16,fp8_e4m3", "--no-progress", *IN_PROCESS,
              "--model", str(tiny_models["gqa"]), "--history-mode", history]
    assert main(["run", "--out", str(tmp_path / "one"), *common]) == 0
    assert main(["run", "--out", str(tmp_path / "batched"), "--batch-size", "3", *common]) == 0
    one, batched = tmp_path / "one", tmp_path / "batched"
    # same replies but for near ties that batched bf16 products may flip (random tiny model: seen on one
    # reply of 20, which then differs after its fifth token)
    texts = {_key(r): r["token_ids"] for r in _rows(one, "texts")}
    batched_texts = {_key(r): r["token_ids"] for r in _rows(batched, "texts")}
    assert texts.keys() == batched_texts.keys()
    flipped = {k[:2] + k[3:4] for k in texts if texts[k] != batched_texts[k]}
    assert len(flipped) <= len(texts) // 4, flipped
    for key, ids in batched_texts.items():  # the bf16 path replies exactly as the reference in the batched run
        if key[2] == "bf16":
            assert ids == batched_texts[key[:2] + ("reference",) + key[3:]]
    # both runs have the implementation check (attn_impl_*; harness/kv_paths/impl_check.py), every row of a batch
    # probed; its ratio's yardstick (SDPA's bf16 error) moves with a row's padding, so its values are not compared here
    # (tests/test_detection.py judges them batched against their limits)
    assert {_key(r) for r in _rows(one, "records") if r["metric"] == "attn_impl_err_ratio"} == \
        {_key(r) for r in _rows(batched, "records") if r["metric"] == "attn_impl_err_ratio"}

    def rows_of(run: Path, table: str) -> list[dict]:
        return [r for r in _rows(run, table) if not str(r.get("metric", "")).startswith("attn_impl_")]

    for table in ("records", "series", "checks"):
        if (one / f"{table}.jsonl").exists():
            assert sorted(map(_key, rows_of(one, table))) == sorted(map(_key, rows_of(batched, table)))
    records = {_key(r): r["value"] for r in _rows(batched, "records")}
    # the batch-invariance floor this run measured: reference log-probs of first-turn replies, batch vs one at a time
    floor = json.loads((batched / "manifest.json").read_text())["batching"]["gqa"]["batch_invariance_floor"]
    for key, value in {_key(r): r["value"] for r in rows_of(one, "records")}.items():
        if key[1] in {f[1] for f in flipped} or value is None:  # a flip changes the scenario's later turns too
            continue
        if key[4].startswith("kl_max_"):  # where the largest KL sits, and the reference there: an argmax over
            continue                      # tokens whose KLs differ by the floor may land on another token
        # teacher-forced metrics are log-prob differences (ref_logprob_delta_*) or p-weighted sums of them (kl_*):
        # each side's log-probs move by the batch-invariance floor (bf16 rounding in batched products), so a metric
        # by about twice it; every other metric is the same number. Measured on the 2-core CPU, both history modes:
        # largest move 2.0e-5 (ref_logprob_delta_min) and 1.1e-7 on KL ~2e-6, against a floor of 2.0e-3.
        assert value == pytest.approx(records[key], rel=0, abs=2 * floor["max_abs_logprob_diff"]), key
    # the bf16 path ran in the reference's batch composition: its noise floor is exactly zero
    bf16 = [r for r in _rows(batched, "records") if r["path"] == "bf16" and r["metric"] in ("kl_mean", "kl_max")]
    assert bf16 and all(r["value"] == 0 for r in bf16)
    manifest = json.loads((batched / "manifest.json").read_text())
    batching = manifest["batching"]["gqa"]
    assert batching["largest_batch"] <= 3 and batching["kernel_check_every"] == 16
    # on the CPU "auto" decodes with the growing cache; every generation batch says so
    assert batching["decode"]["asked"] == "auto" and set(batching["decode"]["batches"]) == {"dynamic"}
    assert batching["decode"]["fallbacks"] == []
    assert batching["batch_invariance_floor"]["sequences"] >= 2
    assert "batching" not in json.loads((one / "manifest.json").read_text())


@pytest.mark.slow  # one whole run: ~75 s on the shared 2-core machine
def test_a_failing_batched_phase_falls_back_and_is_named(tiny_models, tmp_path, monkeypatch):
    from harness.replay import batched

    real = batched.BatchedEngine._generate_batch

    def broken(self, items):
        if self.backend.label == "fp8_e4m3":
            raise RuntimeError("simulated kernel failure")
        return real(self, items)

    monkeypatch.setattr(batched.BatchedEngine, "_generate_batch", broken)
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--paths", "bf16,fp8_e4m3", "--no-progress",
                 "--model", str(tiny_models["gqa"]), "--batch-size", "4"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert any("simulated kernel failure" in f for f in manifest["batching"]["gqa"]["one_at_a_time_fallbacks"])
    assert any("ran one at a time" in w for w in manifest["warnings"])
    paths = {r["path"] for r in _rows(out, "texts")}
    assert paths == {"reference", "bf16", "fp8_e4m3", "fp8_e4m3:calibrated", "fp8_e4m3:calibrated:emulated", "bf16:chunked_prefill"}  # with the yardstick; nothing lost: the path ran one sequence at a time


def test_scale_bench_canary_snippet_is_valid_python():
    """The benchmark runs the canary run from a source string in a fresh process; a quoting slip there (an
    unescaped newline) once cost a whole device call, so parse it here, where it is free."""
    from benchmarks import scale_bench

    compile(scale_bench.CANARY_SNIPPET, "benchmarks/scale_bench.py:CANARY_SNIPPET", "exec")


def test_scale_bench_drops_a_decode_step_that_is_prefill_noise():
    """The difference of two calls' times is the decode measure only where it is positive and within 2x of the
    timed call's median step; session 26's 8k rows read -28,769 tok/s from it."""
    from benchmarks import scale_bench

    assert scale_bench.difference_step(0.0105, 0.0104) == 0.0105
    assert scale_bench.difference_step(0.0105, None) == 0.0105      # too few steps for a median: kept
    assert scale_bench.difference_step(-0.0006, 0.0103) is None
    assert scale_bench.difference_step(0.0012, 0.0105) is None       # 13,220 tok/s at batch 16: 8.7x the median's


def test_decode_profile_lists_the_kernels_one_path_adds_or_saves():
    """decode_profile --prefill's difference table: every kernel of either path, by the size of the change, a kernel
    only one path runs counted against 0 (how session 27 found what an FP8 prefill adds to BF16's)."""
    from benchmarks import decode_profile

    bf16 = [(4768.0, 128, "fmha"), (34.4, 256, "index_copy")]
    fp8 = [(4750.2, 128, "fmha"), (34.4, 256, "index_copy"), (28.4, 256, "_quantize_store_kernel")]
    rows = decode_profile.kernel_differences(bf16, fp8, top=2)
    assert [r[3] for r in rows] == ["_quantize_store_kernel", "fmha"]
    assert rows[0][:3] == (28.4, 0.0, 28.4) and rows[1][0] == pytest.approx(-17.8)


def test_decode_profile_canary_engine_decodes_every_row_to_its_limit():
    """decode_profile --canary times steps of a call over random prompts: a bundled canary's EOS would end rows at
    random steps, so its engines ignore it and every row decodes every step; a scale_bench model keeps its own."""
    from benchmarks import decode_profile, scale_bench
    from harness.replay.batched import BatchSettings
    from harness.replay.inprocess import InProcessModel
    from harness.run_config import CANARY_WEIGHTS

    loaded = InProcessModel.load(CANARY_WEIGHTS / "gqa")
    backend = loaded.backend(None)
    kept = decode_profile.engine(backend, BatchSettings(), canary=False)
    assert kept.eos is not None and kept.eos == loaded.tokenizer.eos_token_id
    made = decode_profile.engine(backend, BatchSettings(), canary=True)
    prompts = scale_bench.prompts(3, 96, loaded.model.config.vocab_size, seed=1)  # 33..96 tokens
    assert made.eos is None
    assert [len(r.token_ids) for r in made.generate(prompts, 12)] == [12, 12, 12]


def test_scale_bench_refuses_an_unknown_config_before_any_work(monkeypatch, capsys):
    """A misspelt `--configs` name (`mla8k`) would run nothing for it and print a table without its rows: refused as
    input (exit 2), before CUDA or a model, naming the known configurations (mla-8k among them)."""
    from benchmarks import scale_bench

    monkeypatch.setenv("HARNESS_IMPL_CHECK", "1")  # main() sets a default of 0 in the process: keep this one's
    monkeypatch.setattr("sys.argv", ["scale_bench.py", "--configs", "mla-1k,mla8k"])
    with pytest.raises(SystemExit) as exited:
        scale_bench.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unknown mla8k" in err and "mla-8k" in err


def test_graph_decode_on_the_cpu_is_refused_before_any_work(tiny_models, tmp_path, capsys):
    """`--decode graph` needs CUDA: refused as input (exit 2, the flag named), nothing run or stored."""
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--paths", "bf16", "--no-progress",
                 "--model", str(tiny_models["gqa"]), "--decode", "graph"]) == 2
    assert "--decode graph" in capsys.readouterr().err
    assert not (out / "records.jsonl").exists()


def test_batched_scoring_applies_the_path_s_attention_options(tmp_path):
    """Class 3 (a BF16 cache with k_scale multiplied into the scores) lives in the attention function, which reads
    it from the active cache: batched teacher-forced scoring must set that cache as generation does. Before, the
    batched scorer left it unset and scored the fault as the reference (kl_mean exactly 0 on every turn, CPU and
    H100), so `harness run --device cuda` could not see class 3; one at a time it reads 6.08 nats here (the
    trained GQA canary: a random tiny model attends almost uniformly, and scaled scores barely move it)."""
    common = ["--select", "id:canary-arith-1", "--no-progress", "--yardstick", "none", "--models", "gqa",
              "--paths", "bf16:calibrated:k_scale_on_scores", "--no-fail-on-verdict", *IN_PROCESS]
    assert main(["run", "--out", str(tmp_path / "one"), *common]) == 0
    assert main(["run", "--out", str(tmp_path / "batched"), "--batch-size", "2", *common]) == 0
    kl = {run: [r["value"] for r in _rows(tmp_path / run, "records")
                if r["path"] == "bf16:calibrated:k_scale_on_scores" and r["metric"] == "kl_mean"]
          for run in ("one", "batched")}
    assert kl["one"] and all(v > 1.0 for v in kl["one"]), kl  # the fault moves the scores: nats, not noise
    # the same forward passes over the same tokens; batched products move values by the batch-invariance floor
    assert kl["batched"] == pytest.approx(kl["one"], rel=0.05), kl


@pytest.fixture
def refuse_per_head(monkeypatch):
    """The route refuses to batch per-head paths (a stand-in for any path the engine cannot batch, so the test
    outlives each real refusal); the route cache is cleared before and after."""
    from harness.replay import route

    real = route._batch_refusal

    def refusing(kv_path, capture):
        if kv_path is not None and kv_path.granularity == "per_head":
            return f"path {kv_path.name}: refused for this test"
        return real(kv_path, capture)

    route._decide.cache_clear()
    monkeypatch.setattr(route, "_batch_refusal", refusing)
    yield
    route._decide.cache_clear()


def test_a_path_refused_batching_runs_alone_and_the_others_stay_batched(tiny_models, tmp_path, refuse_per_head,
                                                                        monkeypatch):
    """One unbatchable path keeps only itself one sequence at a time: every other path's rows are exactly those of
    the same batched run without it (no tolerance: the same batches on the same inputs), and the refused path
    ran through the one-sequence engine (its batches were all of one row)."""
    common = ["--scenarios", str(SCENARIOS), "--select", "id:smoke-arith", "--no-progress", "--batch-size", "3",
              "--model", str(tiny_models["gqa"]), "--no-fail-on-verdict"]
    without, with_refused = tmp_path / "without", tmp_path / "with"
    assert main(["run", "--out", str(without), "--paths", "bf16,fp8_e4m3", *common]) == 0
    from harness.replay import batched

    engines: dict[str, set] = {}  # path label -> {"batch", "alone"}: how its generations ran
    for name, how in (("generate", "batch"), ("generate_one", "alone")):
        def spy(self, *args, _real=getattr(batched.BatchedEngine, name), _how=how, **kwargs):
            engines.setdefault(self.backend.label, set()).add(_how)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(batched.BatchedEngine, name, spy)
    assert main(["run", "--out", str(with_refused), "--paths", "bf16,fp8_e4m3,fp8_e4m3:per_head", *common]) == 0
    assert engines["fp8_e4m3:per_head"] == {"alone"} and engines["fp8_e4m3"] == engines["reference"] == {"batch"}
    for table in ("records", "series", "texts"):
        rows = [r for r in _rows(with_refused, table) if r["path"] != "fp8_e4m3:per_head"]
        assert sorted(map(json.dumps, rows)) == sorted(map(json.dumps, _rows(without, table))), table
    refused = [r for r in _rows(with_refused, "records") if r["path"] == "fp8_e4m3:per_head"]
    assert any(r["metric"] == "kl_mean" for r in refused)
    manifest = json.loads((with_refused / "manifest.json").read_text())
    batching = manifest["batching"]["gqa"]
    assert batching["one_sequence_paths"] == {"fp8_e4m3:per_head": "path fp8_e4m3:per_head: refused for this test"}
    assert batching["largest_batch"] >= 1 and "off" not in batching
    routes = {p["name"]: p["routes"]["gqa"] for p in manifest["paths"]}
    assert routes["fp8_e4m3:per_head"]["batched"] is False and "refused" in routes["fp8_e4m3:per_head"]["batch_refusal"]
    assert routes["fp8_e4m3"]["batched"] is True and routes["fp8_e4m3"]["batch_refusal"] is None


def test_fp8_attention_runs_batched_with_its_own_floor(tiny_models, tmp_path):
    """An FP8-attention path (fp8_q / fp8_p) is batched and bounded by its own batch-invariance floor, measured on
    the path in the run and stored beside the reference's (never the bf16 reference's floor in its place)."""
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--paths", "bf16,fp8_e4m3:fp8_q:fp8_p",
                 "--no-progress", "--model", str(tiny_models["gqa"]), "--batch-size", "4",
                 "--no-fail-on-verdict"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    batching = manifest["batching"]["gqa"]
    assert batching["one_sequence_paths"] == {}
    own = batching["batch_invariance_floors"]
    assert set(own) == {"fp8_e4m3:fp8_q:fp8_p"}  # the other paths are bounded by the reference's floor
    assert own["fp8_e4m3:fp8_q:fp8_p"]["sequences"] >= 2 and "path fp8_e4m3:fp8_q:fp8_p" in own["fp8_e4m3:fp8_q:fp8_p"]["how"]
    assert own["fp8_e4m3:fp8_q:fp8_p"]["max_abs_logprob_diff"] >= 0
    routes = {p["name"]: p["routes"]["gqa"] for p in manifest["paths"]}
    assert routes["fp8_e4m3:fp8_q:fp8_p"]["batched"] and routes["fp8_e4m3:fp8_q:fp8_p"]["batch_floor"] == "own"
    assert routes["bf16"]["batch_floor"] == "reference"


@pytest.mark.slow  # two runs with attention capture: ~40 s on the shared 2-core machine
def test_attention_capture_runs_beside_a_batched_replay(tiny_models, tmp_path):
    """--attention with --batch-size: generation and scoring batched, attention capture's own pass one sequence at a
    time on the reference's replies. Where the batched reference replied as the one-at-a-time one, the captured
    rows are exactly the one-at-a-time run's (the same pass on the same tokens: no tolerance)."""
    common = ["--scenarios", str(SCENARIOS), "--paths", "fp8_e4m3", "--no-progress", "--attention", "isolated",
              "--model", str(tiny_models["gqa"]), "--no-fail-on-verdict", "--yardstick", "none", *IN_PROCESS]
    one, batched = tmp_path / "one", tmp_path / "batched"
    assert main(["run", "--out", str(one), *common]) == 0
    assert main(["run", "--out", str(batched), "--batch-size", "3", *common]) == 0
    manifest = json.loads((batched / "manifest.json").read_text())
    assert "off" not in manifest["batching"]["gqa"] and manifest["batching"]["gqa"]["largest_batch"] > 1
    reference = {run: {(r["scenario"], r["turn"]): r["token_ids"] for r in _rows(run, "texts") if r["path"] == "reference"}
                 for run in (one, batched)}
    same = {key for key, ids in reference[one].items() if reference[batched].get(key) == ids}
    assert len(same) >= len(reference[one]) * 3 // 4, reference  # near-tie flips only (see the test above)

    def captured(run: Path) -> list[str]:
        return sorted(json.dumps(r, sort_keys=True) for r in _rows(run, "attention") if (r["scenario"], r["turn"]) in same)

    assert captured(one) and captured(one) == captured(batched)
