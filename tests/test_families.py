"""Coverage matrix: every transformers model family in `harness.canary.tiny_models.FAMILIES` (tiny random-weight
models, hidden 64, 4 layers, the canary tokenizer; no downloads) replays bf16 and the FP8 KV paths with healthy
verdicts, or is refused by `harness run` before any work: exit 2, the reason in the harness's words, no traceback.
FAMILIES holds the 32 of issue 26 (ISSUE_FAMILIES) and 25 further decoder-only families transformers ships.

Tiers: default CI runs the config-level checks of every family and the replay of one family of each attention
kind (FAST); `--slow` (CI) replays every family on the CPU; `--gpu --slow` (an H100) replays every family batched
with graph decode and our kernels. With FAMILIES_RESULTS=DIR each replay writes DIR/<tier>-<family>.json, from
which `python tests/make_families_doc.py` renders docs/FAMILIES.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.canary.tiny_models import FAMILIES, ISSUE_FAMILIES, build_family_model, family_config
from harness.cli import main
from harness.kv_paths.spec import parse_path
from harness.replay import families
from harness.runs.store import RunStore

SCENARIOS = Path(__file__).parent / "data" / "scenarios" / "families.yaml"
PATHS = "bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated,fp8_e5m2"
FP8_PATHS = ("fp8_e4m3", "fp8_e4m3:per_head:calibrated", "fp8_e5m2")

# Families the harness refuses, and a word its reason must contain (the test's own expectation, not read from
# harness/replay/families.py: a family that silently starts working, or stops, fails here).
REFUSED = {"minimax": "MiniMaxCache"}
# One family per attention kind for default CI: GQA, sinks + SWA, soft-capping, MLA, SWA only, SSM hybrid,
# linear-attention hybrid, and a refusal.
FAST = ("llama", "gpt_oss", "gemma2", "deepseek_v3", "mistral_sliding", "jamba", "qwen3_next", "minimax")
# The rest in groups of about 6 per `harness run` (one process start, one report per group); xdist spreads them.
REST = [f for f in ISSUE_FAMILIES if f not in FAST]
EXTRA = [f for f in FAMILIES if f not in ISSUE_FAMILIES]  # further families transformers ships
GROUPS = {**{f"group{i}": tuple(REST[i::4]) for i in range(4)}, **{f"extra{i}": tuple(EXTRA[i::4]) for i in range(4)}}


def _installed(family: str) -> bool:
    from transformers import CONFIG_MAPPING

    return FAMILIES[family][0] in CONFIG_MAPPING


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            built[family] = build_family_model(family, root / family)
        return built[family]

    return build


# -- config level: every family, default CI -----------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_is_routed_or_refused_by_name(family):
    """Route facts name every layer; a family with FP8 paths has at least one FP8 layer, else a refusal."""
    if not _installed(family):
        pytest.skip(f"transformers {__import__('transformers').__version__} has no model type {FAMILIES[family][0]}")
    config = family_config(family)
    paths = [parse_path(p) for p in PATHS.split(",")]
    problems = families.refusals(config, paths)
    if family in REFUSED:
        assert problems and REFUSED[family] in problems[0] and family in problems[0]
        return
    assert problems == []
    facts = families.route_facts(config, paths)
    assert len(facts["layers"]) == config.num_hidden_layers
    assert facts["fp8_layers"], facts
    assert all(row["why"] for row in facts["layers"])
    assert facts["attention"][0] in ("GQA", "MHA", "MLA")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_harness_attention_computes_the_models_own_attention(family):
    """Our registered attention (SDPA, or the model's eager attention for sinks / soft-capping) against the model's
    fp32 eager forward, relative to transformers' own bf16 eager error: dropping gpt-oss's sinks gave 0.28 on
    logits of scale 0.64 (about 70x torch's error), so 4x torch's error plus 1e-3 absolute (a bf16 ulp at 0.25
    is 1e-3) leaves room only for SDPA-vs-eager rounding."""
    if not _installed(family) or family in REFUSED:
        pytest.skip("not installed" if not _installed(family) else "refused family")
    from transformers import AutoModelForCausalLM

    from harness.kv_paths.attention import ATTENTION_NAME, register

    register()
    config = family_config(family)
    torch.manual_seed(0)
    eager32 = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    state = eager32.state_dict()
    ids = torch.randint(3, 90, (1, 40))  # 40 tokens: past the 16-token windows and Mamba chunks
    with torch.inference_mode():
        reference = eager32(input_ids=ids).logits
        eager16 = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        eager16.load_state_dict(state)
        eager16 = eager16.to(torch.bfloat16)
        ours = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME).eval()
        ours.load_state_dict(state)
        ours = ours.to(torch.bfloat16)
        err_torch = (eager16(input_ids=ids).logits.float() - reference).abs().max().item()
        err_ours = (ours(input_ids=ids).logits.float() - reference).abs().max().item()
    assert err_ours <= 4 * err_torch + 1e-3, f"{family}: ours {err_ours:.3g} vs torch bf16 eager {err_torch:.3g}"


def test_mamba2_scan_working_set_counts_in_the_auto_batch(monkeypatch):
    """The 24 GiB a hidden-64 Granite-MoE-hybrid asked for on an H100: transformers' torch Mamba-2 scan with the
    default dims (128 heads, d_state 256, chunk 256) forms an 8 GiB fp32 tensor per 256-token chunk and
    sequence. The auto batch now counts it, so a batch's scan stays within half of free memory."""
    from transformers import AutoConfig

    from harness.replay import batched

    config = AutoConfig.for_model("granitemoehybrid", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, layer_types=["mamba", "attention"] * 2)
    assert families.ssm_scan_bytes(config, 600) == 3 * 8 * 2**30  # 3 chunks of 8 GiB: the H100's 24 GiB
    assert families.ssm_scan_bytes(family_config("llama"), 600) == 0
    free = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))
    model = type("Stub", (), {"config": config})()
    size = batched.auto_batch_size(model, torch.device("cuda"), 600, items=64)
    assert 1 <= size and size * families.ssm_scan_bytes(config, 600) <= free // 2
    assert batched.auto_batch_size(model, torch.device("cuda"), 100, items=64) > size  # proportional to length
    tiny = family_config("granitemoehybrid")  # the matrix's model: 4 heads, d_state 16, chunk 16
    assert families.ssm_scan_bytes(tiny, 600) == 38 * 16 * 16 * 4 * 16 * 4


# -- replay: `harness run` as a user runs it -----------------------------------------------------------------
def _replay(families_: tuple[str, ...], family_models, tmp_path, device: str) -> None:
    wanted = [f for f in families_ if _installed(f)]
    runnable = [f for f in wanted if f not in REFUSED]
    for family in wanted:
        if family in REFUSED:
            _assert_refused(family, family_models(family), tmp_path, device)
    if not runnable:
        return
    out = tmp_path / "run"
    argv = ["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--calibration", str(SCENARIOS), "--paths", PATHS,
            "--no-progress", "--device", device, "--jobs", "1"]
    if device == "cpu":
        argv += ["--attention", "isolated"]  # on CUDA capture would turn batching off: the CPU tier covers it
    else:
        argv += ["--decode", "graph"]
    for family in runnable:
        argv += ["--model", str(family_models(family))]
    code = main(argv)
    rows = _results(out, runnable, device)
    _write_results(rows, "cpu" if device == "cpu" else "cuda")
    assert code == 0, f"harness run exited {code}: {rows}"
    bad = [row for row in rows if row["replay"] != "pass"]
    assert not bad, bad


def _assert_refused(family: str, model: Path, tmp_path: Path, device: str) -> None:
    out = tmp_path / f"refused-{family}"
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--model", str(model), "--scenarios",
                           str(SCENARIOS), "--paths", PATHS, "--out", str(out), "--no-progress", "--device", device],
                          capture_output=True, text=True, timeout=300)
    reason = done.stderr.strip().removeprefix("error: ").replace(str(model), "MODEL")  # no temporary paths
    row = {"family": family, "replay": "refused", "reason": reason,
           "attention": families.attention_kinds(family_config(family), families.layer_routes(family_config(family)))}
    _write_results([row], "cpu" if device == "cpu" else "cuda")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and REFUSED[family] in done.stderr and family in done.stderr
    assert not out.exists(), "refused after the run directory was made"


def _results(out: Path, runnable: list[str], device: str) -> list[dict]:
    """One row per family: pass, or what was unhealthy (status, errors, floor, verdicts, no-op FP8 paths)."""
    store = RunStore(out)
    manifest = json.loads((out / "manifest.json").read_text())
    verdicts, errors = store.read("verdicts"), store.read("errors") if (out / "errors.jsonl").exists() else []
    records, captured = store.read("records"), store.read("attention")
    rows = []
    for family in runnable:
        facts = manifest.get("families", {}).get(family, {})
        problems = [f"errors: {e.get('error', e)}"[:300] for e in errors if e.get("model") == family]
        floor = manifest.get("noise_floor", {}).get(family)
        if not floor or any(value for value in floor.values()):  # bf16 must match the reference bit for bit
            problems.append(f"bf16 noise floor not exactly zero: {floor}")
        failed = [v for v in verdicts if v["model"] == family and v["verdict"] == "fail"]
        problems += [f"verdict fail: {v['path']} turn {v['turn']}: {v['reasons']}"[:300] for v in failed]
        for path in FP8_PATHS:
            kl = [r["value"] for r in records if r["model"] == family and r["path"] == path and r["metric"] == "kl_max"]
            if not kl or not max(v or 0 for v in kl) > 0:
                problems.append(f"{path}: KL to the reference is 0 on every turn (nothing quantised?)")
        row = {"family": family, "model_type": FAMILIES[family][0], "attention": facts.get("attention"),
               "replay": "pass" if not problems else "fail", "problems": problems,
               "kept_bf16": facts.get("kept_bf16"), "decode_kernels": facts.get("decode_kernels", ""),
               "graph_decode": facts.get("graph_decode", "")}
        if device == "cpu":
            row["capture"] = "pass" if all(any(r["model"] == family and r["path"] == p for r in captured)
                                           for p in FP8_PATHS) else "no rows"
        else:
            row.update(_cuda_facts(manifest, records, family))
        rows.append(row)
    return rows


def _cuda_facts(manifest: dict, records: list[dict], family: str) -> dict:
    """Batched, graph decode and kernels as the run recorded them (not as asked)."""
    batching = manifest.get("batching", {}).get(family, {})
    decode = batching.get("decode", {}) if isinstance(batching, dict) else {}
    kernel_steps = sum((r["value"] or 0) for r in records if r["model"] == family and r["metric"] == "kernel_steps")
    return {"batched": "off: " + batching["off"] if "off" in batching else
            ("pass" if not batching.get("one_at_a_time_fallbacks") else
             "fell back: " + "; ".join(batching["one_at_a_time_fallbacks"])),
            "graph": "pass" if decode.get("batches", {}).get("graph") else
            "dynamic: " + "; ".join(decode.get("fallbacks", [])) if decode else "n/a",
            "kernels": "pass" if kernel_steps else "off"}


def _write_results(rows: list[dict], tier: str) -> None:
    where = os.environ.get("FAMILIES_RESULTS")
    if not where:
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    for row in rows:
        (Path(where) / f"{tier}-{row['family']}.json").write_text(json.dumps(row, indent=1) + "\n")


@pytest.mark.parametrize("family", FAST)
def test_family_replays_or_is_refused_on_cpu(family, family_models, tmp_path):
    _replay((family,), family_models, tmp_path, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_every_family_replays_or_is_refused_on_cpu(group, family_models, tmp_path):
    _replay(GROUPS[group], family_models, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("group", ["fast", *GROUPS])
def test_every_family_replays_batched_with_graph_and_kernels_on_cuda(group, family_models, tmp_path):
    _replay(FAST if group == "fast" else GROUPS[group], family_models, tmp_path, "cuda")


def test_matrix_page_is_what_the_stored_results_give():
    """docs/FAMILIES.md is rendered from docs/families/*.json (the CPU tier's results, and the H100's once run):
    every family has a CPU result, and the page is exactly what the generator makes of them."""
    sys.path.insert(0, str(Path(__file__).parent))
    import make_families_doc

    results = Path(__file__).parent.parent / "docs" / "families"
    found = make_families_doc.load_results(results)
    assert set(found["cpu"]) == set(FAMILIES), "rerun the CPU tier with FAMILIES_RESULTS=docs/families"
    assert make_families_doc.main(["--results", str(results), "--check"]) == 0


@pytest.mark.parametrize("family, feature", [("gpt_oss", "attention sinks"), ("gemma2", "soft-capping")])
def test_decode_kernels_stay_off_for_attention_they_do_not_compute(family, feature, family_models, monkeypatch):
    """Our decode kernels compute plain softmax attention: a family with sinks or soft-capping keeps torch's (the
    model's eager) attention, and each FP8 path's route says why; FP8-attention paths are refused by name."""
    from harness.replay.inprocess import InProcessModel

    monkeypatch.setenv("HARNESS_KERNELS", "reference")  # kernels on for any device, as on CUDA
    loaded = InProcessModel.load(family_models(family))
    assert feature in loaded.backend(parse_path("fp8_e4m3")).describe()["decode_kernel"]
    assert loaded.backend(parse_path("bf16")).describe()["decode_kernel"] == "not an FP8 path"
    refused = families.refusals(loaded.model.config, [parse_path("fp8_e4m3:fp8_q")])
    assert len(refused) == 1 and feature in refused[0] and "fp8_q" in refused[0]


@pytest.mark.gpu
def test_granite_hybrid_with_mamba2_default_dims_replays_within_memory(tmp_path):
    """The H100 case of issue 26: hidden 64 but Mamba-2's default dims (128 heads, d_state 256, chunk 256), where
    transformers' torch scan forms 8 GiB per 256-token chunk and sequence. With the scan in the auto batch size,
    every path replays batched (no OOM fallback), and the batches used fit half of the card's memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.canary.tokenizer import VOCAB_SIZE, save_tokenizer
    from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER

    config = AutoConfig.for_model("granitemoehybrid", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  num_local_experts=4, num_experts_per_tok=2, eos_token_id=2, pad_token_id=0,
                                  bos_token_id=None, layer_types=["mamba", "attention"] * 2)
    model_dir = tmp_path / "granitemoehybrid"
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(str(model_dir))
    save_tokenizer(model_dir)
    (model_dir / RANDOM_WEIGHTS_MARKER).write_text("random weights\n")
    out = tmp_path / "run"
    smoke = Path(__file__).parent / "data" / "scenarios" / "smoke.yaml"
    assert main(["run", "--out", str(out), "--model", str(model_dir), "--scenarios", str(smoke), "--paths", PATHS,
                 "--no-progress", "--device", "cuda"]) in (0, 1)  # 1: a verdict failed (random weights)
    manifest = json.loads((out / "manifest.json").read_text())
    batching = manifest["batching"]["granitemoehybrid"]
    assert manifest["status"] == "complete" and not batching["one_at_a_time_fallbacks"], batching
    total = torch.cuda.get_device_properties(0).total_memory
    assert batching["largest_batch"] * families.ssm_scan_bytes(config, 512) <= total, batching


def test_keep_bf16_beyond_the_models_layers_is_refused_before_work(tmp_path, capsys):
    """Issue 45: `keep_bf16=999` on the 6-layer canary was accepted (the path replayed as plain fp8 under a name
    saying otherwise). Refused before work, naming the path, the layer and the model's layer count."""
    from pathlib import Path

    from harness.cli import main

    gqa = Path(__file__).resolve().parents[1] / "harness" / "canary" / "weights" / "gqa"
    code = main(["run", "--model", str(gqa), "--paths", "fp8_e4m3:keep_bf16=2+999", "--out", str(tmp_path / "out"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "fp8_e4m3:keep_bf16=2+999" in err and "layer 999" in err and "6 layers" in err, err
    assert not (tmp_path / "out").exists()
