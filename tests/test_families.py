"""The family matrix (`harness.families_matrix`): every causal-decoder model type the installed transformers ships
(`harness.canary.registry`), built tiny from its own config class (no downloads), replayed by `harness run` with
healthy verdicts, or refused by `harness run` before any work: exit 2, the family named, the reason in the
harness's words, no traceback.

Tiers: default CI runs the config-level checks of one family of each kind (KINDS) and the replay of the rotating
sample (`rotating_sample`: a few families, shifted daily, so every family runs within len/SAMPLE days) plus the
families whose entries the last commit changed in the registry or the family rules; `--slow` adds the by-name
routing of every family; `--matrix` replays every family on the CPU (the matrix: ~50 min on 2 cores, past CI's
budget); `--gpu --matrix` every family on CUDA (batched, graph decode, our kernels), as the nightly does. The
matrix page (docs/FAMILIES.md) is rendered from the stored results (`python -m harness.families_matrix --slow
--write-doc`).
"""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

import pytest
import torch

from harness import families_matrix
from harness.canary.registry import build_registry_model, causal_model_types, tiny_config
from harness.kv_paths.spec import parse_path
from harness.replay import families

PATHS = "bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated,fp8_e5m2"
ALL = list(causal_model_types())
# One family per kind of attention or of refusal, for default CI: GQA, sinks + SWA, soft-capping, MLA, MLA with an
# indexer (DeepSeek-V3.2), per-layer head sizes (Gemma 4), SSM and linear-attention hybrids, a family without an
# Auto mapping (Mistral 4), and the refusals: its own cache class (MiniMax), state on its modules (RecurrentGemma),
# a forward without a cache (RWKV).
KINDS = ("llama", "gpt_oss", "gemma2", "deepseek_v3", "deepseek_v32", "gemma4_text", "jamba", "qwen3_next",
         "mistral4", "minimax", "recurrent_gemma", "rwkv")
# Families the harness refuses, and a word its reason must contain (the test's own expectation, not read from
# harness/replay/families.py: a family that silently starts working, or stops, fails here).
REFUSED = {"minimax": "MiniMaxCache", "recurrent_gemma": "state on its modules", "rwkv": "takes no cache"}


def _changed_families() -> list[str]:
    """Model types named on the lines the last commit changed in the registry or the family rules (a family's
    override or refusal edited): cheap to find, and run beside the sample."""
    root = Path(__file__).resolve().parent.parent
    try:
        diff = subprocess.run(["git", "diff", "-U0", "HEAD~1", "--", "harness/canary/registry.py",
                               "harness/replay/families.py"], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    changed = [line for line in diff.stdout.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    return [family for family in ALL if any(f'"{family}"' in line for line in changed)]


CI_REPLAY = sorted(set(families_matrix.rotating_sample(ALL, 2)) | set(_changed_families()[:3]))


# -- config level ------------------------------------------------------------------------------------------------
def _routed_or_refused(family: str) -> None:
    config = tiny_config(family)
    paths = [parse_path(p) for p in PATHS.split(",")]
    problems = families.refusals(config, paths)
    if problems:
        assert all(f"model family {family!r}" in p for p in problems), problems
        return
    facts = families.route_facts(config, paths)
    assert len(facts["layers"]) == len(families.model_cache(config).layers)
    assert all(row["why"] for row in facts["layers"])
    assert facts["attention"][0] in ("GQA", "MHA", "MLA")


@pytest.mark.parametrize("family", KINDS)
def test_a_family_of_each_kind_is_routed_or_refused_by_name(family):
    """Route facts name every layer; a refusal names the family (here: MiniMax's own cache class)."""
    _routed_or_refused(family)
    if family == "minimax":
        assert "MiniMaxCache" in families.refusals(tiny_config(family), [parse_path("fp8_e4m3")])[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL)
def test_every_family_is_routed_or_refused_by_name(family):
    _routed_or_refused(family)


def test_the_matrix_enumerates_the_registry():
    """Every model type of AutoModelForCausalLM's mapping is in the matrix, and so are the families that generate
    through a class of their own (no Auto mapping, issue 44: Mistral 4, Mllama's text model)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) <= set(ALL)
    assert {"mistral4", "mllama_text_model"} <= set(ALL) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    new_year, days = datetime.date(2026, 1, 1), -(-len(ALL) // 3)
    sample = families_matrix.rotating_sample(ALL, 3, new_year)
    assert 1 <= len(set(sample)) <= 3 and sample == families_matrix.rotating_sample(ALL, 3, new_year)
    seen = {f for d in range(days) for f in families_matrix.rotating_sample(ALL, 3, new_year + datetime.timedelta(d))}
    assert seen == set(ALL), f"every family runs within {days} days"


def test_a_tiny_config_keeps_each_kind_of_layer_and_per_layer_sizes():
    """Gemma 4: sliding and full-attention layers, the last one full (the family requires it), and the full layers'
    own head size (512 over 256 in the default: 32 over 16 here), read per layer, never globally (which raises)."""
    from harness.model_layers import layer_shapes

    config = tiny_config("gemma4_text")
    shapes = layer_shapes(config)
    assert {s.kind for s in shapes} == {"sliding_attention", "full_attention"} and shapes[-1].kind == "full_attention"
    assert {s.head_dim for s in shapes if s.kind == "full_attention"} == {32}
    assert {s.head_dim for s in shapes if s.kind == "sliding_attention"} == {16}
    with pytest.raises(Exception, match="per-layer attribute"):
        config.head_dim  # noqa: B018 - transformers' own refusal, which the harness must never trigger


def test_per_layer_head_sizes_reach_the_route_and_the_bytes_per_token():
    """Issue 44 item 2: Gemma 4's route asked the kernels' capability about one global head_dim (which raises);
    now about each layer's, and its bytes per token add each layer's own K/V heads x head size."""
    from harness.model_layers import kv_bytes_per_token, layer_shapes
    from harness.replay.route import ModelFacts

    config = tiny_config("gemma4_text")
    assert ModelFacts.of(config).head_dims == (16, 32)
    expected = sum(2 * s.kv_heads * s.head_dim * 2 for s in layer_shapes(config))  # K and V, bf16
    assert kv_bytes_per_token(config) == expected
    uniform = tiny_config("llama")  # its defaults are MHA: 4 layers x 4 KV heads x 16 dims x (K, V) x 2 bytes
    assert kv_bytes_per_token(uniform) == 4 * 4 * 16 * 2 * 2


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "gemma4_text"])
def test_harness_attention_computes_the_models_own_attention(family):
    """Our registered attention (SDPA, or the model's eager attention for sinks / soft-capping) against the model's
    fp32 eager forward, relative to transformers' own bf16 eager error: dropping gpt-oss's sinks gave 0.28 on
    logits of scale 0.64 (about 70x torch's error), so 4x torch's error plus 1e-3 absolute (a bf16 ulp at 0.25
    is 1e-3) leaves room only for SDPA-vs-eager rounding."""
    from transformers import AutoModelForCausalLM

    from harness.kv_paths.attention import ATTENTION_NAME, register

    register()
    config = tiny_config(family)
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
    assert families.ssm_scan_bytes(tiny_config("llama"), 600) == 0
    free = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))
    model = type("Stub", (), {"config": config})()
    size = batched.auto_batch_size(model, torch.device("cuda"), 600, items=64)
    assert 1 <= size and size * families.ssm_scan_bytes(config, 600) <= free // 2
    assert batched.auto_batch_size(model, torch.device("cuda"), 100, items=64) > size  # proportional to length
    tiny = tiny_config("granitemoehybrid")  # the matrix's model: 4 heads, d_state 16, chunk 16
    assert families.ssm_scan_bytes(tiny, 600) == 38 * 16 * 16 * 4 * 16 * 4


# -- replay: `harness run` as a user runs it -----------------------------------------------------------------
def _assert_probed(row: dict) -> None:
    family = row["family"]
    assert row["outcome"] in ("pass", "refused", "not built"), row
    if family in REFUSED:
        assert row["outcome"] == "refused" and REFUSED[family] in row["reason"], row
    elif row["outcome"] == "pass":
        assert row["fp8_layers"], row  # something was quantised


@pytest.mark.parametrize("family", CI_REPLAY)
def test_the_rotating_sample_replays_or_is_refused_on_cpu(family, tmp_path):
    _assert_probed(families_matrix.probe_family(family, "cpu", tmp_path))


@pytest.mark.parametrize("family", ["recurrent_gemma", "mistral4"])
def test_state_on_modules_is_refused_and_a_family_without_auto_mapping_replays(family, tmp_path):
    """Issue 44: RecurrentGemma keeps its recurrent state and its attention K/V on its modules, not in the cache
    the harness builds per path, so its BF16 path differed from the reference: refused now, naming where its state
    is. Mistral 4 has no AutoModelForCausalLM mapping (transformers' own error before): it loads through its own
    class and replays."""
    row = families_matrix.probe_family(family, "cpu", tmp_path)
    if family == "recurrent_gemma":
        assert row["outcome"] == "refused" and "temporal_block" in row["reason"], row
    else:
        assert row["outcome"] == "pass" and row["model_class"] == "Mistral4ForCausalLM", row


@pytest.mark.matrix
@pytest.mark.parametrize("family", ALL)
def test_every_family_replays_or_is_refused_on_cpu(family, tmp_path):
    _assert_probed(families_matrix.probe_family(family, "cpu", tmp_path))


@pytest.mark.gpu
@pytest.mark.matrix
@pytest.mark.parametrize("family", ALL)
def test_every_family_replays_or_is_refused_on_cuda(family, tmp_path):
    _assert_probed(families_matrix.probe_family(family, "cuda", tmp_path))


def test_matrix_page_is_what_the_stored_results_give():
    """docs/FAMILIES.md is rendered from docs/families/*.json, with the installed transformers' families."""
    import transformers

    found = families_matrix.load_results()
    page = families_matrix.render(found, ALL, transformers.__version__)
    stored = families_matrix.DOC.read_text()
    if transformers.__version__ not in stored:
        pytest.skip(f"docs/FAMILIES.md is for another transformers than {transformers.__version__}")
    assert page == stored, "rerun python -m harness.families_matrix --slow --write-doc"


@pytest.mark.parametrize("family, feature", [("gpt_oss", "attention sinks"), ("gemma2", "soft-capping")])
def test_decode_kernels_run_where_they_compute_the_attention_and_stay_off_elsewhere(family, feature, tmp_path,
                                                                                   monkeypatch):
    """Our GQA decode over FP8 pages computes sinks and soft-capping: an FP8 path of such a family decodes through
    it. The decodes that do not (block-scaled pages, a plug-in's contract) keep torch's (the model's eager)
    attention, and the route says why; FP8-attention paths are refused by name."""
    from harness.replay.inprocess import InProcessModel

    monkeypatch.setenv("HARNESS_KERNELS", "reference")  # kernels on for any device, as on CUDA
    loaded = InProcessModel.load(build_registry_model(family, tmp_path / family))
    assert loaded.backend(parse_path("fp8_e4m3")).describe()["decode_kernel"] == "triton (kernels/)"
    for spec in ("nvfp4", "fp8_e4m3:kernel=dequant"):
        assert feature in loaded.backend(parse_path(spec)).describe()["decode_kernel"], spec
    assert loaded.backend(parse_path("bf16")).describe()["decode_kernel"] == "not an FP8 path"
    refused = families.refusals(loaded.model.config, [parse_path("fp8_e4m3:fp8_q")])
    assert len(refused) == 1 and feature in refused[0] and "fp8_q" in refused[0]


@pytest.mark.gpu
def test_granite_hybrid_with_mamba2_default_dims_replays_within_memory(tmp_path):
    """The H100 case of issue 26: hidden 64 but Mamba-2's default dims (128 heads, d_state 256, chunk 256), where
    transformers' torch scan forms 8 GiB per 256-token chunk and sequence. With the scan in the auto batch size,
    every path replays batched (no OOM fallback), and the batches used fit half of the card's memory."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER
    from harness.canary.tokenizer import VOCAB_SIZE, save_tokenizer
    from harness.cli import main

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
    from harness.cli import main

    gqa = Path(__file__).resolve().parents[1] / "harness" / "canary" / "weights" / "gqa"
    code = main(["run", "--model", str(gqa), "--paths", "fp8_e4m3:keep_bf16=2+999", "--out", str(tmp_path / "out"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "fp8_e4m3:keep_bf16=2+999" in err and "layer 999" in err and "6 layers" in err, err
    assert not (tmp_path / "out").exists()
