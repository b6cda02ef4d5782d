"""`harness calibrate`, `harness sensitivity`, `harness attention` on tiny random-weight models: files written,
maps a path can take, and a run whose attention table, records and views are there."""

from __future__ import annotations

import json

import pytest

from harness import cli
from harness.kv_paths.spec import parse_path
from harness.replay import sensitivity as scan
from harness.replay.inprocess import InProcessModel
from harness.scenarios.sources import load_scenarios

SCENARIO = """\
scenarios:
- id: tiny-chat
  kind: chat
  generation: {max_new_tokens: 6, greedy: true}
  turns:
  - user: Hello there, tell me about the plans you offer and the prices.
  - user: And which one is the cheapest?
"""


@pytest.fixture()
def scenario_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(SCENARIO)
    return path


def test_sensitivity_scan_ranks_layers_and_budget_zero_keeps_all_in_bf16(tiny_models, scenario_file):
    model = InProcessModel.load(tiny_models["gqa"])
    path = parse_path("fp8_e4m3:per_tensor:calibrated:keep_bf16=0")  # the scan overrides the map
    turns = scan.reference_turns(model, load_scenarios([scenario_file]), 2)
    assert len(turns) == 2
    seen = []
    ranking = scan.scan(model, path, turns, bisect_above=1, floor=-1.0, on_measured=seen.append)
    assert [m.fp8_layers for m in seen][0] == (0, 1)  # bisection: the whole group first, then halves
    assert sorted(m.fp8_layers for m in ranking) == [(0,), (1,)]
    assert ranking[0].kl_mean >= ranking[1].kl_mean
    bf16, mixed = scan.recommend(model, path, turns, ranking, budget=0.0)
    assert bf16 == [0, 1] and mixed.kl_mean == 0.0 and mixed.fp8_layers == ()  # all bf16 = the reference
    bf16, mixed = scan.recommend(model, path, turns, ranking, budget=float("inf"))
    assert bf16 == [] and mixed.fp8_layers == (0, 1)


def test_the_precision_map_names_each_layers_format_and_the_engines_flags(capsys):
    """The map says, per layer, bf16 or the path's format, and the engines' launch flags for the same map: vLLM's
    --kv-cache-dtype-skip-layers takes the kept layers; SGLang has no per-layer flag, and the map says so."""
    from harness.attention_cli import _print_sensitivity

    mixed = scan.Measured((1, 3), 0.01, 0.1, None, 0, 2)
    body = scan.precision_map("m", parse_path("nvfp4:calibrated"), 0.02, [0, 2], [0, 1, 2, 3], mixed, mixed, [mixed],
                              "--budget")
    assert body["layers"] == {"0": "bf16", "1": "nvfp4", "2": "bf16", "3": "nvfp4"}
    assert body["engine_flags"]["vllm"] == "--kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers 0 2"
    assert "no per-layer KV dtype flag" in body["engine_flags"]["sglang"]
    assert "no vllm --kv-cache-dtype value stores mxfp8" in scan.engine_flags(parse_path("mxfp8"), [])["vllm"]
    assert scan.engine_flags(parse_path("fp8"), [])["sglang"] == "--kv-cache-dtype fp8_e4m3"
    _print_sensitivity(body, 2)
    printed = capsys.readouterr().out
    assert "per-layer format: 0 bf16, 1 nvfp4, 2 bf16, 3 nvfp4" in printed
    assert "vllm: --kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers 0 2" in printed


@pytest.mark.slow
def test_calibrate_and_sensitivity_commands(tiny_models, scenario_file, tmp_path, capsys):
    out = tmp_path / "cal"
    assert cli.main(["calibrate", "--model", str(tiny_models["gqa"]), "--out", str(out), "--granularity",
                     "per_head"]) == 0
    printed = capsys.readouterr().out
    assert "kv_scales.safetensors" in printed and "kv_cache_scales.json" in printed
    assert (out / "kv_scales.safetensors").is_file() and (out / "kv_cache_scales.json").is_file()
    sens = tmp_path / "sens"
    assert cli.main(["sensitivity", "--model", str(tiny_models["gqa"]), "--scenarios", str(scenario_file),
                     "--max-turns", "1", "--out", str(sens), "--no-progress",
                     "--path", "fp8_e4m3:checkpoint", "--scales", str(out / "kv_scales.safetensors")]) == 0
    body = json.loads((sens / "sensitivity.json").read_text())
    assert set(body["layers"]) == {"0", "1"} and len(body["ranking"]) == 2
    assert set(body["layers"].values()) <= {"bf16", "fp8_e4m3"}
    assert body["engine_flags"]["vllm"].startswith("--kv-cache-dtype fp8_e4m3")
    assert (sens / "sensitivity_layers.png").is_file()
    # the map is a path option
    assert parse_path(f"fp8_e4m3:layers={sens / 'sensitivity.json'}").bf16_layers == tuple(body["bf16_layers"])
    # bad input: exit 2 with the reason
    assert cli.main(["sensitivity", "--model", str(tiny_models["gqa"]), "--path", "bf16"]) == 2
    assert "quantises nothing" in capsys.readouterr().err
    assert cli.main(["calibrate", "--model", str(tmp_path / "nope"), "--out", str(out)]) == 2


@pytest.mark.slow
def test_attention_command_stores_table_records_and_views(tiny_models, scenario_file, tmp_path, capsys):
    run = tmp_path / "run"
    code = cli.main(["attention", "--model", str(tiny_models["mla"]), "--scenarios", str(scenario_file),
                     "--paths", "fp8_e4m3,fp8_e4m3:kernel=reference", "--out", str(run), "--no-progress",
                     "--attention-heads", "2", "--attention-rows", "3"])
    assert code in (0, 1)  # 1: a verdict failed on random weights; the run itself completed
    printed = capsys.readouterr().out
    assert "attention-score error" in printed and "fp8_e4m3" in printed and "its decode kernel" in printed
    rows = [json.loads(line) for line in (run / "attention.jsonl").read_text().splitlines()]
    kernel_path = "fp8_e4m3:kernel=reference"
    assert {r["path"] for r in rows} == {"bf16", "fp8_e4m3", kernel_path, "fp8_e4m3:calibrated", "fp8_e4m3:calibrated:emulated", "bf16:chunked_prefill"} and {r["head"] for r in rows} <= {0, 3}
    assert all(r["attn_out_rel_err"] == 0.0 for r in rows if r["path"] == "bf16")
    # the kernel=reference path decodes through the plug-in on the CPU: its rows are in the same table,
    # named as the kernel's; the CPU's plain fp8_e4m3 decodes in torch and has none
    kinds = {(r["path"], r["attention"]) for r in rows}
    assert kinds == {("bf16", "torch"), ("fp8_e4m3", "torch"), (kernel_path, "torch"), (kernel_path, "kernel:reference"),
                     ("fp8_e4m3:calibrated", "torch"), ("fp8_e4m3:calibrated:emulated", "torch"),
                     ("bf16:chunked_prefill", "torch")}  # the verdicts' yardstick path, its twin, the control arm
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert {"attn_out_rel_err_max", "attn_worst_layer", "attn_rows_sampled"} <= {r["metric"] for r in records}
    kernel_metrics = {r["path"] for r in records if r["metric"] == "attn_kernel_vs_torch_max"}
    assert kernel_metrics == {kernel_path}
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["attention"]["mode"] == "isolated" and manifest["attention"]["max_heads"] == 2
    assert (run / "attention" / "attention_heatmap.png").is_file()
    assert (run / "attention" / "attention_by_key_position.png").is_file()
    from harness.runs.summary import summary_table

    columns = summary_table(run).columns
    assert "attn out err max" in columns and "kernel attn vs torch" in columns
    assert (run / "report" / "attention_by_layer.png").is_file()
    assert "not written" not in printed  # the report renders the attention views with every other figure
    assert 'src="attention_by_layer.png"' in (run / "report" / "index.html").read_text()
