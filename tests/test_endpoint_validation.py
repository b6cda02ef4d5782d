"""What servers return is validated, and what is degraded is named (issue 15, items 4 and 9).

A fault-injecting OpenAI-compatible server of our own, on loopback: a reply whose logprobs drop a
token, a /tokenize one token short, a server without prompt logprobs, a failing /detokenize, 429s with
Retry-After, and a server that hangs for good. Token ids are code points; the chat template is
"role:content\\n" per message."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the '[test]' extra's HTTP server: pip install -e '.[test]'")
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from harness import cli
from harness.replay.endpoint import EndpointError, RequestClient, RequestPolicy, open_endpoint
from harness.replay.runner import Replay
from harness.runs.store import RunStore
from harness.scenarios.load import Scenario, Turn
from harness.serve import running_server
from harness.types import Message

QUIET = "critical"
MESSAGES = [Message("user", "hello there")]


def template(messages: list[dict]) -> list[int]:
    return [ord(c) for c in "".join(f"{m['role']}:{m['content']}\n" for m in messages)]


def fault_app(faults: set[str], log: list | None = None) -> Starlette:
    """Healthy unless `faults` (a set the test may change while the server runs) names a fault:
    drop_logprob, short_tokenize, no_prompt_logprobs, detokenize_500, retry_after, hang, judge_babble,
    flaky (the third chat request answers 500), slow (0.4 s per chat), no_token_info (no logprobs even when
    asked), length (finish_reason "length"), garbled_text (the text's last character changed, ids right),
    score_500 (every /v1/completions answers 500)."""
    log = log if log is not None else []

    def entry(token_id: int, logprob: float = -0.25) -> dict:
        return {"token": f"token_id:{token_id}", "logprob": logprob}

    async def chat(request):
        body = await request.json()
        log.append((time.monotonic(), "chat"))
        if "hang" in faults:
            await asyncio.sleep(3600)
        if "slow" in faults:
            await asyncio.sleep(0.4)
        first = body["messages"][-1]["content"] not in {entry[2] for entry in log[:-1] if len(entry) > 2}
        log[-1] = (*log[-1], body["messages"][-1]["content"])
        if "flaky" in faults and len(log) == 3:  # the run's first turn, after two pre-flight chats
            return JSONResponse({"error": {"message": "injected 500"}}, status_code=500)
        if "retry_after" in faults and first:  # each distinct message is refused once
            return JSONResponse({"error": {"message": "busy"}}, status_code=429, headers={"Retry-After": "0.4"})
        if "judge_babble" in faults and "grade" in json.dumps(body).lower():
            text = "I would rather not say."
        else:
            text = body["messages"][-1]["content"][::-1][: body.get("max_tokens", 16)]
        content = [entry(ord(c)) | {"top_logprobs": [entry(ord(c)), entry(ord(c) + 1, -1.75)]} for c in text]
        if "drop_logprob" in faults:
            content = content[:-1]
        shown = text[:-1] + chr(ord(text[-1]) + 1) if "garbled_text" in faults and text else text
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": shown},
                                          "logprobs": {"content": content} if body.get("logprobs")
                                          and "no_token_info" not in faults else None,
                                          "finish_reason": "length" if "length" in faults else "stop"}],
                             "usage": {"prompt_tokens": len(template(body["messages"])),
                                       "completion_tokens": len(text)}})

    async def completions(request):
        body = await request.json()
        if "score_500" in faults:
            return JSONResponse({"error": {"message": "injected 500"}}, status_code=500)
        if "no_prompt_logprobs" in faults or "prompt_logprobs" not in body:
            return JSONResponse({"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]})
        rows = [None] + [{str(t): {"logprob": -0.25}, str(t + 1): {"logprob": -1.75}} for t in body["prompt"][1:]]
        return JSONResponse({"choices": [{"index": 0, "text": "", "prompt_logprobs": rows,
                                          "finish_reason": "length"}]})

    async def tokenize(request):
        body = await request.json()
        tokens = template(body["messages"]) if "messages" in body else [ord(c) for c in body["prompt"]]
        return JSONResponse({"tokens": tokens[:-1] if "short_tokenize" in faults else tokens})

    async def detokenize(request):
        if "detokenize_500" in faults:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        return JSONResponse({"prompt": "".join(chr(t) for t in (await request.json())["tokens"])})

    async def models(request):
        return JSONResponse({"data": [{"id": "fake"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/tokenize", tokenize, methods=["POST"]),
                             Route("/detokenize", detokenize, methods=["POST"]), Route("/v1/models", models)])


def fast(**overrides) -> RequestPolicy:
    return RequestPolicy(**({"retries": 1, "timeout_s": 5.0, "backoff_s": 0.01, "max_backoff_s": 1.0} | overrides))


def endpoint(url: str, **options):
    backend = open_endpoint(url, **options)
    object.__setattr__(backend.config, "policy", fast())
    backend.client.policy = fast()
    return backend


async def generate_and_score(url: str, **options):
    backend = endpoint(url, **options)
    try:
        generation = await backend.generate(MESSAGES, 8)
        return generation, await backend.score(MESSAGES, generation.token_ids), backend
    finally:
        await backend.aclose()


def test_a_reply_whose_logprobs_drop_a_token_is_not_a_divergence():
    """Before: ids came from the logprobs, one short, so every turn "diverged" from an identical server."""
    with running_server(fault_app(set()), log_level=QUIET) as healthy, \
            running_server(fault_app({"drop_logprob"}), log_level=QUIET) as faulty:
        good, _, _ = asyncio.run(generate_and_score(healthy))
        bad, _, backend = asyncio.run(generate_and_score(faulty))
    assert bad.token_ids == good.token_ids == [ord(c) for c in "ereht ol"]  # re-tokenised from the text
    assert bad.top_logprobs is None  # the short logprobs are not used
    assert "the logprobs list 7 tokens where usage.completion_tokens is 8" in backend.capabilities["chat_reply_invalid"]


def test_a_short_tokenize_is_refused_and_never_cached(tmp_path):
    """Before: a /tokenize one token short gave wrong values, and the cache kept them for every --resume."""
    faults = {"short_tokenize"}
    with running_server(fault_app(faults), log_level=QUIET) as url:
        _, scores, _ = asyncio.run(generate_and_score(url, cache_dir=tmp_path))
        cached = [json.loads(f.read_text())["url"] for f in tmp_path.rglob("*.json")]
        faults.clear()  # the server is fixed: the next run (a --resume) asks again and gets it right
        _, healed, _ = asyncio.run(generate_and_score(url, cache_dir=tmp_path))
    assert scores.top_logprobs is None
    assert "/tokenize gave 16 tokens for a prompt the server counted as 17" in scores.unavailable
    assert not any(u.endswith("/tokenize") for u in cached)
    assert healed.unavailable is None and len(healed.top_logprobs) == 8


def scenario() -> Scenario:
    return Scenario(id="s", kind="chat", turns=(Turn(user="hello there"), Turn(user="and again")),
                    max_new_tokens=6, source="inline")


def test_missing_prompt_logprobs_are_recorded_per_turn_with_the_reason(tmp_path):
    """Before: the run said "complete" with 126 metrics silently missing."""
    store = RunStore.create(tmp_path / "run", {"status": "running", "warnings": []})

    async def run(reference_url, candidate_url):
        reference = endpoint(reference_url, label="reference")
        candidate = endpoint(candidate_url, label="candidate")
        try:
            await Replay("endpoint", reference, [candidate], store).run([scenario()])
        finally:
            await reference.aclose()
            await candidate.aclose()
        return candidate.degraded()

    with running_server(fault_app(set()), log_level=QUIET) as healthy, \
            running_server(fault_app({"no_prompt_logprobs"}), log_level=QUIET) as faulty:
        degraded = asyncio.run(run(healthy, faulty))
    rows = [r for r in store.read("records") if r["path"] == "candidate"]
    kl = [r for r in rows if r["metric"] == "kl_mean"]
    assert len(kl) == 2 and all(r["value"] is None for r in kl)
    assert all("candidate: unavailable: teacher-forced scoring needs" in r["unavailable"] for r in kl)
    assert {r["metric"] for r in rows} >= {"exact_match", "first_divergent_token"}  # free-running kept
    assert not store.read("errors")
    assert degraded and degraded[0].startswith("teacher-forced metrics unavailable for candidate:")


def write_scenarios(directory: Path) -> Path:
    path = directory / "s.yaml"
    path.write_text("scenarios:\n- id: echo\n  kind: chat\n  generation:\n    max_new_tokens: 6\n"
                    "  turns:\n  - user: hello there\n  - user: and again\n")
    return path


def test_manifest_records_capabilities_and_failures_once_known(tmp_path, capsys):
    """Before: capabilities {} and failed_attempts 0 in every run (written before any request)."""
    with running_server(fault_app(set()), log_level=QUIET) as healthy, \
            running_server(fault_app({"no_prompt_logprobs", "flaky"}), log_level=QUIET) as faulty:
        code = cli.main(["run", "--reference", healthy, "--candidate", f"fp8={faulty}", "--out",
                         str(tmp_path / "run"), "--scenarios", str(write_scenarios(tmp_path)), "--no-progress"])
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    described = manifest["paths"][0]["endpoint"]
    assert code == 0
    assert described["capabilities"]["chat_logprobs"] == "token ids"
    assert described["capabilities"]["scoring"].startswith("unavailable")
    assert described["failed_attempts"] == 1  # the injected 500, retried
    assert manifest["models"][0]["reference"]["capabilities"]["scoring"] == "prompt_logprobs"
    warning = "teacher-forced metrics unavailable for fp8: teacher-forced scoring needs"
    assert any(w.startswith(warning) for w in manifest["warnings"])
    assert f"warning: {warning}" in capsys.readouterr().out


def test_preflight_names_the_dead_server_and_exits_2(tmp_path, capsys):
    with running_server(fault_app(set()), log_level=QUIET) as healthy:
        code = cli.main(["run", "--reference", healthy, "--candidate", "http://127.0.0.1:9", "--out",
                         str(tmp_path / "run"), "--scenarios", str(write_scenarios(tmp_path)), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "candidate http://127.0.0.1:9: " in err and "connection error" in err
    assert not (tmp_path / "run").exists()  # refused before any work: nothing to block the same --out


def test_a_judge_without_usable_verdicts_exits_3_naming_it(tmp_path, capsys):
    with running_server(fault_app({"judge_babble"}), log_level=QUIET) as url:
        code = cli.main(["run", "--reference", url, "--candidate", url, "--judge", url, "--judge-turns", "all",
                         "--out", str(tmp_path / "run"), "--scenarios", str(write_scenarios(tmp_path)),
                         "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3 and f"LLM judge {url} (model 'fake') produced no usable verdict" in err


# ---------------------------------------------------------------- item 9


def test_retry_after_waits_are_jittered_never_shorter():
    """Before: every client told "Retry-After: 0.4" came back at the same instant."""
    log: list = []
    with running_server(fault_app({"retry_after"}, log), log_level=QUIET) as url:
        async def one(i: int):
            client = RequestClient(url, policy=fast(retries=2))
            try:
                await client.post("/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {i}"}]})
            finally:
                await client.aclose()

        async def many():
            await asyncio.gather(*(one(i) for i in range(8)))

        asyncio.run(many())
    policy = fast()
    waits = [RequestClient("http://x", policy=policy)._wait_s(0, 0.4) for _ in range(200)]
    assert min(waits) >= 0.4 and max(waits) <= 0.4 * (1 + policy.retry_after_jitter)
    assert statistics.pstdev(waits) > 0.02  # spread, not one instant
    assert len(log) == 16  # every client was refused once, then served
    first, retried = {}, {}
    for at, _, content in log:
        (retried if content in first else first)[content] = at
    gaps = [retried[c] - first[c] for c in first]
    assert min(gaps) >= 0.4 and max(gaps) - min(gaps) > 0.01  # the 8 clients came back spread out


def test_a_failed_detokenize_costs_only_the_display_strings():
    """Before: a /detokenize failure (display strings only) lost the whole unit."""
    with running_server(fault_app({"detokenize_500"}), log_level=QUIET) as url:
        generation, scores, backend = asyncio.run(generate_and_score(url))
    assert generation.token_ids == [ord(c) for c in "ereht ol"]
    assert generation.tokens == [f"token_id:{ord(c)}" for c in "ereht ol"]
    assert backend.capabilities["detokenize"].startswith("failed: HTTP 500")
    assert scores.unavailable is None


def test_a_hanging_server_fails_within_the_overall_deadline():
    """Before: 5 attempts x 120 s per request, with no overall deadline."""
    with running_server(fault_app({"hang"}), log_level=QUIET) as url:
        async def post():
            client = RequestClient(url, policy=fast(timeout_s=0.5, retries=50, deadline_s=1.5))
            try:
                await client.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
            finally:
                await client.aclose()

        started = time.monotonic()
        with pytest.raises(EndpointError, match="overall deadline of 1.5 s reached"):
            asyncio.run(post())
        assert time.monotonic() - started < 3.0


def test_models_and_api_keys_per_endpoint(monkeypatch, tmp_path):
    from harness import job
    from harness.executor.endpoints import open_endpoints

    monkeypatch.setenv("KEY_ALL", "k-all")
    monkeypatch.setenv("KEY_CAND", "k-cand")
    config = job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, reference_url="http://127.0.0.1:1",
                           candidate_urls=("a=http://127.0.0.1:2", "b=http://127.0.0.1:3"), api_key_env="KEY_ALL",
                           api_key_envs=(("candidate", "KEY_CAND"),), reference_model="ref",
                           candidate_models=("gqa", "b=other"))
    reference, candidates = open_endpoints(config, None)
    assert reference.client._headers["POST"]["Authorization"] == "Bearer k-all" and reference._model == "ref"
    assert [c.client._headers["POST"]["Authorization"] for c in candidates] == ["Bearer k-cand"] * 2
    assert [c._model for c in candidates] == ["gqa", "other"]
    with pytest.raises(ValueError, match="no candidate is labelled 'c'"):
        open_endpoints(job.RunConfig(**{**{f: getattr(config, f) for f in config.__slots__},
                                        "candidate_models": ("c=x",)}), None)


def test_waiting_behind_the_concurrency_gate_is_not_counted_against_the_deadline():
    """Eight requests through one slot, 0.4 s each (3.2 s in all), with a 1 s deadline per request: all succeed."""
    with running_server(fault_app({"slow"}), log_level=QUIET) as url:
        async def many():
            client = RequestClient(url, policy=fast(concurrency=1, deadline_s=1.0, retries=0))
            try:
                return await asyncio.gather(*(client.post("/v1/chat/completions",
                                                          {"messages": [{"role": "user", "content": f"hi {i}"}]})
                                              for i in range(8)))
            finally:
                await client.aclose()

        replies = asyncio.run(many())
    assert [r["choices"][0]["message"]["content"] for r in replies] == [f"{i} ih" for i in range(8)]
