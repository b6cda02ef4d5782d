"""Adding a KV format touches one place: a toy format declared in this file alone (a 6-bit integer with an fp32
scale per 8 values) registers, parses as a path spec, and runs end to end through `harness run` on a tiny model,
each of its turns getting a verdict."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.cli import main
from harness.kv_paths import formats
from harness.kv_paths.spec import parse_path

SCENARIOS = Path(__file__).parent / "data" / "scenarios" / "smoke.yaml"

INT6 = formats.ElementType("int6", 6, 31.0, lambda scaled: scaled.nan_to_num(nan=0.0).round().clamp(-31, 31).to(torch.int8),
                           lambda codes: codes.float(), -31.0)
TOY = formats.register_format(formats.KVFormat(
    "toy_int6_block8", ("toy_int6",), INT6, block_size=8, block_scale="fp32", block_targets=(31.0,),
    scale_floor=1e-6, description="toy: int6 values, an fp32 scale per 8 values"))


def test_toy_format_parses_and_round_trips():
    path = parse_path("toy_int6")
    assert path.fmt == "toy_int6_block8" and path.canonical == "toy_int6" and path.scale_source == "dynamic"
    assert parse_path("k=fp8_e4m3/v=toy_int6").v_format is TOY
    x = torch.randn(1, 2, 3, 20)
    read, ratio = TOY.round_trip(x)
    assert (read - x).abs().max() <= x.abs().max() / 31 / 2 + 1e-6 and ratio.max() <= 1 + 1e-6
    assert TOY.bytes_per_token(64) == 64 * 6 / 8 + 8 * 4


def test_toy_format_runs_end_to_end(tiny_models, tmp_path):
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--paths", "bf16,toy_int6",
                 "--no-progress", "--model", str(tiny_models["gqa"]), "--no-fail-on-verdict"])
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    entry = next(p for p in manifest["paths"] if p["name"] == "toy_int6")
    assert "toy: int6 values" in entry["description"]
    routes = json.dumps(entry.get("routes", {}))
    assert "torch round trip" in routes  # no kernel or C write serves it: the route says so
    verdicts = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    toy = [v for v in verdicts if v.get("path") == "toy_int6"]
    assert toy and all(v.get("verdict") in ("pass", "warn", "fail") for v in toy)
    records = (out / "records.jsonl").read_text()
    assert '"toy_int6"' in records and "kv_clipped_frac" in records
