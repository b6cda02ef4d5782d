"""Free text (scenarios/free) through random-weight models of three families built from configs, with the healthy
paths: `harness run` gives 0 failing cells at the default verdicts, and the implementation check answers every
generated turn of every path near 1.

Families: Llama (GQA), DeepSeek-V3 (MLA latent cache), Qwen3-MoE (GQA with routed experts), each from a
transformers config with random bf16 weights (harness/canary/tiny_models.py's sizes). Random weights give noise
text, which is what free text is to the canaries: high-entropy continuations with many near-ties.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.analysis.verdicts import DEFAULT_THRESHOLDS
from harness.cli import main
from harness.runs.gate import run_verdicts
from harness.runs.summary import records_frame

ROOT = Path(__file__).resolve().parents[1]
HEALTHY = "bf16,fp8_e4m3,fp8_e4m3:calibrated,fp8_e4m3:per_head:calibrated,fp8_e4m3:calibrated:fp8_q:fp8_p"
# a sales chat with a long system prompt (4 turns), mixed scripts, code, a fixed assistant reply in the history
SELECT = "id:free-sales-crm,id:free-lang-cjk,id:free-code-bug,id:free-chat-cooking"
IMPL = next(t for t in DEFAULT_THRESHOLDS if t.metric == "attn_impl_err_ratio")


def _qwen3_moe(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER
    from harness.canary.tokenizer import VOCAB_SIZE, save_tokenizer

    config = Qwen3MoeConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_hidden_layers=2, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=4096,
                            bos_token_id=None, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(str(out))
    save_tokenizer(out)
    (out / RANDOM_WEIGHTS_MARKER).write_text("random weights, seed 0: outputs are noise\n")
    return out


@pytest.fixture(scope="module")
def free_run(tiny_models, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("free")
    models = [tiny_models["gqa"], tiny_models["mla"], _qwen3_moe(root / "qwen3moe")]
    out = root / "run"
    argv = ["run", "--out", str(out), "--scenarios", str(ROOT / "scenarios" / "free"), "--select", SELECT,
            "--paths", HEALTHY, "--no-progress", "--jobs", "1"]
    for model in models:
        argv += ["--model", str(model)]
    assert main(argv) == 0, "a healthy path failed its default verdict on free text"
    return out


@pytest.mark.slow
@pytest.mark.matrix
def test_no_failing_cell_on_free_text(free_run):
    verdicts = run_verdicts(free_run)
    assert {v["model"] for v in verdicts} == {"gqa", "mla", "qwen3moe"}
    failing = [v for v in verdicts if v["verdict"] == "fail"]
    assert not failing, failing[:3]


@pytest.mark.slow
@pytest.mark.matrix
def test_implementation_check_answers_every_turn_near_one(free_run):
    frame = records_frame(free_run)
    impl = frame[frame["metric"] == "attn_impl_err_ratio"]
    # the yardstick's twin writes its cache outside the engine (kv_paths/emulated.py): no engine code to check there
    generated = frame[(frame["metric"] == "reply_tokens") & (frame["path"] != "reference")
                      & ~frame["path"].str.endswith(":emulated")]
    assert len(impl) == len(generated) > 0  # every generated turn of every path
    assert impl["value"].max() <= IMPL.warn, impl.sort_values("value").tail(3)
