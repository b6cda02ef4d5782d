"""A path that produces NaN/inf (issue 15, item 1) stores every unit: records, series and checks encode
non-finite values as null + text, and the summary and `harness compare` show them.

The fault: the GQA canary with a checkpoint whose k_scale/v_scale are 0.001 read by
`fp8_e4m3:checkpoint:nosat` (|k| / 0.001 passes e4m3's 448 and torch's plain cast gives NaN). The healthy
twin carries scales of 1.0, the default scale, which the canary's K/V fit (see harness/canary/weights/gqa)."""

from __future__ import annotations

import json
import math
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.runs.store import RunStore
from harness.runs.summary import format_summary

GQA = Path(__file__).resolve().parent.parent / "harness" / "canary" / "weights" / "gqa"
PATH = "fp8_e4m3:checkpoint:nosat"
SCENARIOS = """\
    scenarios:
      - id: nf-arith
        kind: arithmetic
        prompt: "What is 7 * 8 + 3 * 4?"
        answer: "68"
        generation: {max_new_tokens: 4}
        thresholds: {kl_max: 0.5}
      - id: nf-chat
        kind: chat
        generation: {max_new_tokens: 4}
        turns:
          - user: "Hello, my name is Alexander."
          - user: "What is my name?"
"""


def checkpoint_with_scales(target: Path, scale: float) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(GQA, target)
    tensors = load_file(str(target / "model.safetensors"))
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    for layer in range(layers):
        for name in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(scale)
    save_file(tensors, str(target / "model.safetensors"))
    return target


def test_encode_and_decode_round_trip_non_finite_values():
    from harness.records import decode_value, decode_values, encode_value, encode_values

    assert encode_value(math.inf) == {"value": None, "value_text": "inf"}
    series = encode_values([0.5, math.nan, -math.inf, None])
    assert series == {"values": [0.5, None, None, None], "values_text": {"1": "nan", "2": "-inf"}}
    decoded = decode_values(series)
    assert decoded[0] == 0.5 and math.isnan(decoded[1]) and decoded[2] == -math.inf and decoded[3] is None
    assert decode_value({"value": None, "value_text": "-inf"}) == -math.inf
    assert encode_values([1.0]) == {"values": [1.0]}


def test_store_never_fails_a_unit_on_an_unencoded_non_finite(tmp_path):
    store = RunStore.create(tmp_path / "run", {"status": "running", "noise_floor": {"m": {"kl_max": math.nan}}})
    store.finish_unit("m", "s", "p", {"series": [{"model": "m", "scenario": "s", "path": "p", "turn": 0,
                                                  "series": "kl", "values": [1.0, math.inf]}]})
    row = store.read("series")[0]
    assert row["values"] == [1.0, None] and row["nonfinite"] == {"values[1]": "inf"}
    assert store.read_manifest()["nonfinite"] == {"noise_floor.m.kl_max": "nan"}
    assert RunStore.resume(tmp_path / "run").is_done("m", "s", "p")


@pytest.fixture(scope="module")
def nonfinite_runs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("nonfinite")
    scenarios = base / "scenarios.yaml"
    scenarios.write_text(textwrap.dedent(SCENARIOS))
    runs = []
    for name, scale in (("healthy", 1.0), ("tiny-scales", 0.001)):
        model = checkpoint_with_scales(base / name / "gqa", scale)
        out = base / f"run-{name}"
        code = main(["run", "--model", str(model), "--paths", f"bf16,{PATH}", "--scenarios", str(scenarios),
                     "--out", str(out), "--no-progress", "--no-fail-on-verdict", "--jobs", "1"])  # no worker pool
        assert code in (0, 1), code  # 1 only if a verdict failed; never 3: no unit may be lost
        runs.append(out)
    return runs[0], runs[1]


@pytest.mark.slow
def test_nan_path_stores_every_unit_and_shows_it(nonfinite_runs):
    _, broken = nonfinite_runs
    store = RunStore(broken)
    assert store.read("errors") == []
    # 2 scenarios x (reference, bf16, the broken path, the verdicts' yardstick fp8_e4m3:calibrated)
    assert len(store.read("done")) == 2 * 6  # + the yardstick's twin and the control arm
    assert store.read_manifest()["status"] == "complete"
    texts = [t for t in store.read("texts") if t["path"] == PATH]
    assert {t["finish_reason"] for t in texts} == {"nonfinite_logits"}
    kl = [r for r in store.read("records") if r["path"] == PATH and r["metric"] == "kl_max"]
    assert kl and all(r["value"] is None and r["value_text"] in ("inf", "nan") for r in kl)
    nonfinite = [r for r in store.read("records") if r["path"] == PATH and r["metric"] == "kv_nonfinite"]
    assert nonfinite and max(r["value"] for r in nonfinite) > 0
    series = [s for s in store.read("series") if s["path"] == PATH and s["series"] == "kl"]
    assert series and all(s.get("values_text") for s in series)
    check = [c for c in store.read("checks") if c["path"] == PATH][0]
    assert check["passed"] is False and check["value_text"] in ("inf", "nan")
    summary = format_summary(broken)
    assert "KV non-finite" in summary and "inf" in summary.split(PATH)[-1].splitlines()[0]
    assert "KV non-finite" not in format_summary(nonfinite_runs[0])  # healthy: no column to read past


@pytest.mark.slow
def test_compare_shows_the_non_finite_kl(nonfinite_runs, tmp_path):
    healthy, broken = nonfinite_runs
    assert main(["compare", str(healthy), str(broken), "--out", str(tmp_path / "cmp")]) == 1
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert 'data-sort="inf">inf<' in page and "kl_max inf &gt; 0.5" in page  # the metric table and the check
