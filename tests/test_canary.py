"""Canary models: corpus and chat template agree, training runs, shipped weights load offline and answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from harness.canary import corpus, train
from harness.canary.tokenizer import VOCAB_SIZE, build_tokenizer

WEIGHTS = Path(__file__).resolve().parents[1] / "harness" / "canary" / "weights"
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios" / "canary"
ARCHS = ("gqa", "mla", "hybrid")
ARCH_CLASSES = {"gqa": "LlamaForCausalLM", "mla": "DeepseekV3ForCausalLM", "hybrid": "Qwen3NextForCausalLM"}


def _weights(arch: str) -> Path:
    path = WEIGHTS / arch
    if not (path / "model.safetensors").exists():
        pytest.skip(f"canary weights not present at {path}: train them with harness/canary/train_all.sh")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# --- corpus and template --------------------------------------------------------------------------


def test_chat_template_round_trips_multi_turn(tokenizer):
    messages = [
        {"role": "system", "content": "You are a librarian. End every answer with the word Thanks."},
        {"role": "user", "content": "Tell me about books."},
        {"role": "assistant", "content": "Books keep stories and ideas for later readers, Thanks."},
        {"role": "user", "content": "What is 7 * 8 + 3 * 4?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert text == corpus.render_chat(messages, add_generation_prompt=True)
    assert ids == corpus.encode_text_with_specials(text)


@pytest.mark.parametrize("kind", corpus.KINDS)
def test_corpus_renders_like_the_tokenizer(tokenizer, kind):
    rng = corpus.split_rng(0, "train")
    for _ in range(5):
        dialogue = corpus.sample(rng, kind, "train", max_chars=400)
        text = tokenizer.apply_chat_template(dialogue.messages(), tokenize=False)
        ids, mask = corpus.encode_dialogue(dialogue)
        assert ids == tokenizer(text, add_special_tokens=False).input_ids
        assert max(ids) < VOCAB_SIZE
        trained = "".join(tokenizer.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m]))
        assert trained == "".join(t.reply + "<|end|>" for t in dialogue.turns)


@pytest.mark.parametrize("kind", corpus.KINDS)
def test_gold_replies_pass_the_harness_checks(kind, tmp_path):
    """The replies the canaries learn keep every rule and contain every answer, by the harness's checks."""
    checks = pytest.importorskip("harness.scenarios.checks")
    scenarios = pytest.importorskip("harness.scenarios.sources")
    chars = {"chars": 300} if kind == "long_context" else {}
    dialogues = corpus.heldout_set(kind, 20, 5, **chars)
    entries = [corpus.to_scenario(d, f"gold-{n}") for n, d in enumerate(dialogues)]
    (tmp_path / "gold.yaml").write_text(yaml.safe_dump({"scenarios": entries}, sort_keys=False))
    for dialogue, scenario in zip(dialogues, scenarios.load_scenarios([tmp_path / "gold.yaml"])):
        assert [t.user for t in scenario.turns] == [t.user for t in dialogue.turns]
        for turn, gold in zip(scenario.turns, dialogue.turns):
            assert checks.check_rules(scenario, gold.reply) in (None, True), (scenario.rules, gold.reply)
            assert checks.check_answer(scenario, turn, gold.reply) in (None, True), (turn.expect, gold.reply)
            assert train.rules_kept(dialogue.rules, gold.reply)
        if kind != "chat":
            assert train.answer_correct(kind, dialogue.turns[-1].reply, scenario.turns[-1].expect)


def test_scenario_files_compile_to_the_training_text():
    scenarios = pytest.importorskip("harness.scenarios.sources")
    loaded = scenarios.load_scenarios([SCENARIOS])
    assert {s.kind for s in loaded} == set(corpus.KINDS)
    needle = next(s for s in loaded if s.kind == "long_context" and s.id.startswith("canary-acc-"))
    dialogue = corpus.heldout_set("long_context", 1, 3, chars=corpus.MAX_NEEDLE_CHARS)[0]
    assert needle.turns[0].user == dialogue.turns[0].user


def test_train_and_heldout_never_share_arithmetic_problems():
    train_rng, heldout_rng = corpus.split_rng(0, "train"), corpus.split_rng(0, "heldout")
    seen = {corpus.arithmetic(train_rng, "train").spec["prompt"] for _ in range(2000)}
    held = {corpus.arithmetic(heldout_rng, "heldout").spec["prompt"] for _ in range(200)}
    assert not seen & held


# --- training ------------------------------------------------------------------------------------


def test_training_delta_rule_matches_transformers_fallback():
    from transformers.models.qwen3_next import modeling_qwen3_next

    from harness.canary import delta_rule

    batch, length, k_heads, v_heads, dim = 2, 301, 2, 4, 16  # 301: not a multiple of any chunk size
    query, key = torch.randn(2, batch, length, k_heads, dim)
    value = torch.randn(batch, length, v_heads, dim)
    g, beta = -torch.rand(batch, length, v_heads) * 0.5, torch.rand(batch, length, v_heads)
    kwargs = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    expected, expected_state = modeling_qwen3_next.torch_chunk_gated_delta_rule(query, key, value, **kwargs)
    got, state = delta_rule.chunk_gated_delta_rule(query, key, value, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)  # fp32; chunking reorders sums
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-4)


def test_training_smoke(tmp_path):
    """Five CPU steps of the smallest arch, no evaluation: the script runs end to end and saves."""
    out = tmp_path / "gqa"
    train.main(["--arch", "gqa", "--steps", "5", "--seed", "0", "--out", str(out), "--device", "cpu",
                "--short-batch", "2", "--long-batch", "1", "--needle-chars", "120", "--eval-per-kind", "0"])
    summary = json.loads((out / "training.json").read_text())
    assert summary["steps"] == 5 and summary["steps_done"] == 5
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert "Steps: 5" in (out / "README.md").read_text()


def test_continued_run_card_repeats_every_stage(tmp_path):
    """--init continues a saved run; the card gives the command for this stage and for the one before."""
    common = ["--arch", "gqa", "--steps", "2", "--device", "cpu", "--short-batch", "2", "--long-batch", "1",
              "--needle-chars", "120", "--eval-per-kind", "0"]
    train.main([*common, "--seed", "0", "--out", str(tmp_path / "first")])
    train.main([*common, "--seed", "1", "--out", str(tmp_path / "second"), "--init", str(tmp_path / "first"),
                "--mix", "arithmetic=3,recall=1"])
    card = (tmp_path / "second" / "README.md").read_text()
    assert "--steps 2 --seed 1 --out DIR " in card and card.count("--init DIR_1") == 1
    assert "(arithmetic 75%, recall 25%)" in card and card.count("--mix arithmetic=3,recall=1") == 1
    assert "- DIR_1: 2 steps" in card and "--steps 2 --seed 0 --out DIR_1 " in card
    with pytest.raises(AssertionError, match="holds a gqa model"):
        train.main([*common, "--arch", "mla", "--out", str(tmp_path / "third"), "--init", str(tmp_path / "first")])


def test_retrain_repeats_every_stage_to_the_same_weights_on_cpu(tmp_path):
    """retrain replays a two-stage card (seeds, steps, mix, init chain) and lands on the same weights:
    on the CPU, same seed and options give bit-identical training."""
    from safetensors.torch import load_file

    from harness.canary import retrain

    common = ["--arch", "gqa", "--steps", "3", "--device", "cpu", "--short-batch", "2", "--long-batch", "1",
              "--needle-chars", "120", "--eval-per-kind", "0", "--widths", "128,448"]
    train.main([*common, "--seed", "4", "--out", str(tmp_path / "first"), "--lr", "0.01"])
    train.main([*common, "--seed", "5", "--out", str(tmp_path / "shipped"), "--init", str(tmp_path / "first"),
                "--mix", "arithmetic=1,recall=1"])
    stages = retrain.plan(tmp_path / "shipped", tmp_path / "again", "cpu")
    assert [argv[argv.index("--seed") + 1] for argv in stages] == ["4", "5"]
    assert "--init" not in stages[0] and stages[1][stages[1].index("--init") + 1] == str(tmp_path / "again" / "stage1")
    assert retrain.main([str(tmp_path / "shipped"), str(tmp_path / "again"), "--device", "cpu"]) == 0
    shipped, again = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("shipped", "again/stage2"))
    first = load_file(str(tmp_path / "first" / "model.safetensors"))
    assert any(not torch.equal(first[k], shipped[k]) for k in first)  # the second stage changed the weights
    assert all(torch.equal(shipped[k], again[k]) for k in shipped)


def test_retrain_compare_flags_more_than_one_point():
    from harness.canary import retrain

    table, within = retrain.compare({"accuracy": {"arithmetic": 0.99, "recall": 1.0}},
                                    {"accuracy": {"arithmetic": 0.98, "recall": 1.0}})
    assert within and "-1.0 points" in table
    assert not retrain.compare({"accuracy": {"arithmetic": 0.99}}, {"accuracy": {"arithmetic": 0.97}})[1]
    assert not retrain.compare({"accuracy": {"arithmetic": 0.99}}, {"accuracy": {}})[1]


def test_mix_sets_the_kinds_drawn_and_rejects_bad_specs(monkeypatch):
    kinds = []
    sample = corpus.sample
    monkeypatch.setattr(corpus, "sample", lambda rng, kind, *args: kinds.append(kind) or sample(rng, kind, *args))
    batches = train.StepBatches(0, short=16, long=0, needle_chars=120, widths=(128, 448, 256),
                                mix=train.parse_mix("recall=3,echo=0,chat=1"))
    kinds.clear()  # the constructor's probe draws too
    rng = corpus.split_rng(0, "train")
    for _ in range(200):
        batches._draw(rng)
    assert set(kinds) == {"recall", "chat"} and 0.65 < kinds.count("recall") / 200 < 0.85  # 3:1 -> 75%
    for spec, message in [("sums=1", "unknown kind 'sums'"), ("recall=x", "must be a number"),
                          ("recall=-1", "negative"), ("recall=0", "every share is 0")]:
        with pytest.raises(SystemExit):
            train.parse_args(["--arch", "gqa", "--steps", "1", "--out", "x", "--mix", spec])
        with pytest.raises(Exception, match=message):
            train.parse_mix(spec)


@pytest.mark.parametrize("arch", ARCHS)
def test_training_attention_is_causal_sdpa_without_a_mask(arch, monkeypatch):
    """Training attention (causal SDPA, no mask tensor, K/V repeated for GQA) gives the logits transformers'
    sdpa path gives on whole rows, and is the function the model calls while switched on."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    train.register_training_attention()
    model = AutoModelForCausalLM.from_config(train.model_config(arch)).eval()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k) or sdpa(*a, **k))
    ids = torch.randint(5, VOCAB_SIZE, (2, 40))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        calls.clear()
        with train.attention_implementation(model, train.TRAIN_ATTENTION):
            got = model(input_ids=ids).logits
    assert model.config._attn_implementation == "sdpa"  # switched back
    assert calls and all(k.get("is_causal") and k.get("attn_mask") is None for k in calls)
    # fp32 on the CPU: the same kernel on the same operands; only the GQA repeat differs from enable_gqa
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


def test_needle_min_chars_draws_only_long_fillers_and_the_card_repeats_it():
    batches = train.StepBatches(0, short=1, long=4, needle_chars=3000, widths=(448, 3136), needle_min_chars=2500)
    rng = corpus.split_rng(0, "train")
    drawn = [batches._draw(rng) for _ in range(60)]
    needles = [len(ids) for ids, _, needle in drawn if needle]
    assert len(needles) > 30 and all(2500 < n <= 3000 + 112 for n in needles)
    assert train.bucket_widths(3000, (448,)) == (448, 3136) and batches.rows[3136] >= 4  # every needle is long
    args = train.parse_args(["--arch", "gqa", "--steps", "1", "--out", "x", "--needle-chars", "3000",
                             "--needle-min-chars", "2500", "--eval-every-kinds", "long_context,chat"])
    assert args.eval_every_kinds == ["long_context", "chat"]
    summary = {"arch": "gqa", "steps": 1, "seed": 0, "args": vars(args)}
    argv = train.stage_argv(summary)
    assert argv[argv.index("--needle-min-chars") + 1] == "2500"
    default = {"arch": "gqa", "steps": 1, "seed": 0, "args": vars(train.parse_args(["--arch", "gqa", "--steps", "1",
                                                                                    "--out", "x"]))}
    assert "--needle-min-chars" not in train.stage_argv(default)  # earlier cards (no such key) repeat as they ran
    for bad in (["--needle-min-chars", "5000", "--needle-chars", "3000"], ["--eval-every-kinds", "sums"]):
        with pytest.raises(SystemExit):
            train.parse_args(["--arch", "gqa", "--steps", "1", "--out", "x", *bad])


# --- shipped weights -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_canary_loads_offline(arch, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _weights(arch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert type(model).__name__ == ARCH_CLASSES[arch]
    assert tokenizer.eos_token == "<|end|>" and tokenizer.chat_template
    assert all(f.stat().st_size < 16 * 2**20 for f in path.iterdir())  # each file travels easily
    assert (path / "README.md").exists()


def test_canary_weights_fit_the_budget():
    sizes = [(WEIGHTS / arch / "model.safetensors") for arch in ARCHS]
    if not all(p.exists() for p in sizes):
        pytest.skip("canary weights not all present")
    assert sum(p.stat().st_size for p in sizes) <= 25_000_000


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("arch", ARCHS)
def test_canary_answers_heldout_scenarios_in_bf16(arch):
    """A handful of the default scenarios' dialogues, replayed greedily in bf16 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_weights(arch), dtype=torch.bfloat16)
    dialogues = [*corpus.heldout_set("arithmetic", 3, 2), *corpus.heldout_set("recall", 2, 2),
                 *corpus.heldout_set("chat", 2, 2), *corpus.heldout_set("long_context", 2, 2, chars=600)]
    results = [train.replay(model, [d], "cpu")[0] for d in dialogues]
    missed = [r for r in results if not r["correct"]]
    # The targets are 90-95%, not 100%: one miss in these 9 is within them.
    assert len(missed) <= 1, f"{arch}: {len(missed)} of {len(results)} wrong: {missed}"


def test_record_accuracy_writes_one_section_per_card(tmp_path):
    """A rule chat counts only if every reply keeps its rules; the reference's rows are the ones counted;
    writing twice replaces the section instead of adding a second table."""
    from harness.canary import record_accuracy
    from harness.runs.store import RunStore

    store = RunStore.create(tmp_path / "run", {"command": "harness run --paths bf16", "device": "cpu",
                                               "started_at": "2026-11-22T06:00:00", "versions": {}})
    rows = [("reference", "arith-1", "arithmetic", 0, "answer_correct", 1.0),
            ("reference", "arith-2", "arithmetic", 0, "answer_correct", 0.0),
            ("reference", "chat-1", "chat", 0, "rules_followed", 1.0),
            ("reference", "chat-1", "chat", 1, "rules_followed", 0.0),  # second reply broke a rule
            ("reference", "chat-2", "chat", 0, "rules_followed", 1.0),
            ("fp8_e4m3", "arith-2", "arithmetic", 0, "answer_correct", 1.0)]  # a path's rows: not counted
    store.append("records", [{"model": "gqa", "scenario": s, "path": p, "turn": t, "kind": k, "metric": m,
                              "value": v} for p, s, k, t, m, v in rows])
    cards = tmp_path / "weights"
    (cards / "gqa").mkdir(parents=True)
    (cards / "gqa" / "README.md").write_text("# card\n")
    record_accuracy.main([str(tmp_path / "run"), "--weights", str(cards)])
    record_accuracy.main([str(tmp_path / "run"), "--weights", str(cards)])
    text = (cards / "gqa" / "README.md").read_text()
    assert text.startswith("# card\n") and text.count(record_accuracy.BEGIN) == 1
    assert "| arithmetic | 1/2 (50%) | >= 95% | **no** |" in text
    assert "| rule chats | 1/2 (50%) | >= 90% | **no** |" in text


def test_record_accuracy_gives_each_run_its_table(tmp_path):
    """Two runs (a stress set and another) give two tables in one section; the needle row names the filler
    length its scenario file holds."""
    from harness.canary import record_accuracy
    from harness.runs.store import RunStore

    def stored(name: str, files: list[str], rows: list[tuple]) -> str:
        store = RunStore.create(tmp_path / name, {"command": f"harness run {name}", "device": "cuda",
                                                  "started_at": "2026-11-23T00:00:00", "versions": {},
                                                  "scenario_files": [{"file": f} for f in files]})
        store.append("records", [{"model": "gqa-long16k", "scenario": s, "path": "reference", "turn": 0,
                                  "kind": k, "metric": "answer_correct", "value": v} for s, k, v in rows])
        return str(tmp_path / name)

    stress = stored("stress", ["scenarios/canary/stress/long_context_16k.yaml"],
                    [("n1", "long_context", 1.0), ("n2", "long_context", 1.0), ("n3", "long_context", 0.0)])
    short = stored("short", ["scenarios/canary/accuracy/arithmetic.yaml"], [("a1", "arithmetic", 1.0)])
    cards = tmp_path / "weights"
    (cards / "gqa-long16k").mkdir(parents=True)
    (cards / "gqa-long16k" / "README.md").write_text("# card\n")
    record_accuracy.main([stress, short, "--weights", str(cards)])
    text = (cards / "gqa-long16k" / "README.md").read_text()
    assert text.count(record_accuracy.BEGIN) == 1 and text.count("| task | correct |") == 2
    assert "| needle (16000 filler chars) | 2/3 (67%) | >= 90% | **no** |" in text
    assert "`harness run stress`" in text and "`scenarios/canary/stress/long_context_16k.yaml` (held-out seeds)" in text
    assert "on `scenarios/canary/accuracy/` (held-out seeds, never in training)" in text
