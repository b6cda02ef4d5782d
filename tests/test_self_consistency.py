"""A server checked against itself (`harness run --candidate URL --self-consistency`, no reference): its decode's
logprobs against its prefill of the same tokens, and a repeated decode. Real `harness serve` processes on loopback:
a healthy one, and one whose decode kernel drops the cache scales (tests/faulty_decode.py); servers that cannot
give the measurement get a named reason, never a traceback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the '[test]' extra's HTTP server: pip install -e '.[test]'")
import torch

from harness import cli
from harness.analysis.self_consistency import (GATED, SELFCONS_DELTA_FAIL, decode_vs_prefill, repeat_decode,
                                               self_consistency_reasons, turn_reasons)
from harness.canary.tiny_models import build_tiny_model
from harness.kv_paths.spec import parse_path
from harness.replay.inprocess import InProcessModel
from harness.serve import ServedModel, build_app, free_port, running_server, serve_in_subprocesses

FAULTY = "fp8_e4m3:calibrated:kernel=tests.faulty_decode:decode"  # the scale never reaches the decode kernel
HEALTHY = "fp8_e4m3:calibrated"
# two turns: the second's prompt holds the first (the multi-turn variant)
SCENARIO = """
scenarios:
  - id: chat-two-turns
    kind: chat
    turns:
      - user: "What is 17 + 25? Explain step by step."
      - user: "And 17 + 26?"
    generation: {max_new_tokens: 12}
"""


def _rows(run: Path, name: str) -> list[dict]:
    stored = run / f"{name}.jsonl"
    return [json.loads(line) for line in stored.read_text().splitlines() if line.strip()] if stored.exists() else []


def _run(tmp_path: Path, candidates: list[str], *extra: str) -> tuple[int, Path]:
    scenarios = tmp_path / "two_turns.yaml"
    scenarios.write_text(SCENARIO)
    out = tmp_path / "run"
    argv = ["run", "--self-consistency", "--scenarios", str(scenarios), "--out", str(out), "--no-progress",
            "--request-timeout", "60", *extra]
    for candidate in candidates:
        argv += ["--candidate", candidate]
    return cli.main(argv), out


# ---------------------------------------------------------------- the statistics (pure)


def test_identical_decode_and_prefill_agree_exactly():
    rows = [{1: -0.1, 2: -2.5}, {3: -0.01, 1: -5.0}]
    values = decode_vs_prefill(rows, rows, [1, 3])
    assert values["selfcons_kl_mean"] == values["selfcons_logprob_delta_max"] == values["selfcons_flips"] == 0.0
    assert values["selfcons_tokens"] == 2.0


def test_a_decode_that_reads_the_cache_wrong_disagrees():
    prefill = [{1: -0.05, 2: -3.0}, {5: -0.1, 3: -2.5}]
    decode = [{1: -0.05, 2: -3.0}, {3: -0.3, 5: -1.4}]  # step 2: greedy picked 3, which the prefill ranks second
    values = decode_vs_prefill(decode, prefill, [1, 3])
    assert values["selfcons_logprob_delta_max"] == pytest.approx(2.2)
    assert values["selfcons_kl_max"] > 0.9 and values["selfcons_kl_mean"] == pytest.approx(values["selfcons_kl_max"] / 2)
    assert values["selfcons_flips"] == 1.0  # the prefill leads with 5 by 2.4 nats: a confident flip


def test_rows_and_tokens_must_line_up():
    with pytest.raises(ValueError, match="one of each per position"):
        decode_vs_prefill([{1: 0.0}], [], [1])


def test_repeat_compares_the_shared_prefix_and_names_a_divergence():
    same = repeat_decode([1, 2], [{1: -0.1}, {2: -0.2}], [1, 2], [{1: -0.1}, {2: -0.2}])
    assert same == {"selfcons_repeat_delta_max": 0.0, "selfcons_repeat_diverged": 0.0}
    apart = repeat_decode([1, 2, 5], [{1: -0.1}, {2: -0.2, 7: -3.0}, {5: -9.0}],
                          [1, 7, 6], [{1: -0.1}, {7: -0.1, 2: -2.5}, {6: 0.0}])
    assert apart == {"selfcons_repeat_delta_max": pytest.approx(2.9), "selfcons_repeat_diverged": 1.0}


@pytest.mark.parametrize("value, verdict", [(0.2, None), (SELFCONS_DELTA_FAIL * 0.9, "warn"),
                                            (SELFCONS_DELTA_FAIL * 2, "fail"), (math.inf, "fail")])
def test_the_limit_answers_the_implementation_question(value, verdict):
    reasons = self_consistency_reasons({GATED: value, "selfcons_repeat_delta_max": 0.0})
    assert [r["severity"] for r in reasons] == ([verdict] if verdict else [])
    assert all(r["question"] == "implementation" and r["metric"] == GATED for r in reasons)


def test_unmeasured_self_consistency_warns_and_a_run_without_reference_is_not_blamed_for_it():
    unmeasured = {"check": "unmeasured", "metric": "kl_max", "severity": "warn", "question": None}
    reasons = turn_reasons([unmeasured], {GATED: None, "selfcons_history_turns": 0.0}, reference={})
    assert [(r["check"], r["severity"]) for r in reasons] == [("self-consistency", "warn")]
    assert "could not give it" in reasons[0]["message"]
    assert turn_reasons([unmeasured], {"kl_mean": 0.1}, reference={"reply_tokens": 3.0}) == [unmeasured]


# ---------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def faulty_and_healthy():
    with serve_in_subprocesses([FAULTY, HEALTHY]) as urls:
        yield urls


def test_planted_decode_fault_fails_and_the_healthy_server_passes(faulty_and_healthy, tmp_path):
    faulty, healthy = faulty_and_healthy
    code, run = _run(tmp_path, [f"faulty={faulty}", f"healthy={healthy}"])
    assert code == 1  # a verdict failed: the faulty server's
    verdicts = {(r["path"], r["turn"]): r for r in _rows(run, "verdicts")}
    for turn in (0, 1):
        failed = verdicts[("faulty", turn)]
        assert failed["questions"]["implementation"] == "fail"
        assert any(r["check"] == "self-consistency" and r["metric"] == GATED and r["severity"] == "fail"
                   for r in failed["reasons"])
        assert verdicts[("healthy", turn)]["verdict"] == "pass", verdicts[("healthy", turn)]
    values = {(r["path"], r["turn"], r["metric"]): r["value"] for r in _rows(run, "records")}
    assert values[("healthy", 1, "selfcons_history_turns")] == 1.0  # multi-turn: turn 1 holds turn 0
    assert values[("healthy", 0, "selfcons_repeat_delta_max")] == 0.0  # harness serve decodes deterministically
    assert values[("faulty", 0, GATED)] > 5 * SELFCONS_DELTA_FAIL
    assert values[("healthy", 0, GATED)] < SELFCONS_DELTA_FAIL / 3
    assert not _rows(run, "errors")


def test_self_consistency_beside_a_reference(faulty_and_healthy, tmp_path):
    faulty, healthy = faulty_and_healthy
    code, run = _run(tmp_path, [f"faulty={faulty}"], "--reference", healthy)
    assert code == 1
    metrics = {r["metric"] for r in _rows(run, "records") if r["path"] == "faulty"}
    assert {"kl_mean", GATED, "selfcons_repeat_delta_max"} <= metrics  # teacher-forced and against itself
    failed = [r for r in _rows(run, "verdicts") if r["path"] == "faulty"]
    assert all(any(x["check"] == "self-consistency" for x in r["reasons"]) for r in failed)


# ---------------------------------------------------------------- servers that cannot give it


def _without(app, route: str, fields: tuple[str, ...] = (), refuse: bool = False):
    """`app` with requests to `route` refused (404), or with `fields` taken out of their JSON bodies."""
    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != route:
            return await app(scope, receive, send)
        if refuse:
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
            return await send({"type": "http.response.body", "body": b"Not Found"})
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        trimmed = json.dumps({k: v for k, v in json.loads(body).items() if k not in fields}).encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = dict(scope, headers=headers + [(b"content-length", str(len(trimmed)).encode())])

        async def replay():
            return {"type": "http.request", "body": trimmed, "more_body": False}

        return await app(scope, replay, send)

    return wrapped


@pytest.fixture(scope="module")
def tiny_served(tmp_path_factory):
    directory = build_tiny_model("gqa", tmp_path_factory.mktemp("tiny-gqa"))
    model = InProcessModel.load(directory, "cpu", torch.float32)
    return ServedModel(model.backend(parse_path("fp8_e4m3")), "tiny-gqa")


@pytest.mark.parametrize("shape, expected", [
    ("no /v1/completions", "teacher-forced scoring needs /v1/completions"),
    ("no chat logprobs", "gave no per-token logprobs by token id with its replies"),
])
def test_a_server_without_the_logprobs_gets_a_named_reason(tiny_served, tmp_path, shape, expected):
    app = build_app(tiny_served)
    app = (_without(app, "/v1/completions", refuse=True) if shape == "no /v1/completions" else
           _without(app, "/v1/chat/completions", ("logprobs", "top_logprobs")))  # token ids, no logprobs
    with running_server(app) as url:
        code, run = _run(tmp_path, [f"odd={url}"])
    assert code == 0 and not _rows(run, "errors")  # degraded, not failed, no traceback
    unmeasured = [r for r in _rows(run, "records") if r["metric"] == GATED]
    assert len(unmeasured) == 2 and all(r["value"] is None and expected in r["unavailable"] for r in unmeasured)
    assert all(url in r["unavailable"] for r in unmeasured)  # the reason names the server
    manifest = json.loads((run / "manifest.json").read_text())
    assert any(w.startswith(f"self-consistency unavailable: odd ({url})") and expected in w
               for w in manifest["warnings"])
    verdicts = _rows(run, "verdicts")
    assert all(v["verdict"] == "warn" and any("self-consistency unmeasured" in r["message"] for r in v["reasons"])
               for v in verdicts)


def test_a_dead_server_is_refused_before_the_run_naming_it(tmp_path, capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    code, run = _run(tmp_path, [f"dead={dead}"])
    assert code == 2 and not run.exists()
    assert f"dead {dead}" in capsys.readouterr().err


def test_self_consistency_needs_a_server(tmp_path, capsys):
    assert cli.main(["run", "--self-consistency", "--out", str(tmp_path / "run")]) == 2
    assert "--candidate" in capsys.readouterr().err
