"""Each real server's reply shapes, replayed from recorded fixtures (tests/data/endpoint_replies/, made
with tests/capture_replies.py against the real servers) through a loopback server: vLLM (float32 and
bf16), `transformers serve`, and SGLang's documented shapes (it does not run on these machines)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the '[test]' extra's HTTP server: pip install -e '.[test]'")
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from harness.analysis.metrics import teacher_forced_topk
from harness.replay.endpoint import (EndpointConfig, EndpointBackend, PreflightError, RequestPolicy,
                                     _scores_from_reply)
from harness.serve import running_server
from harness.types import Message

REPLIES = Path(__file__).parent / "data" / "endpoint_replies"
GQA = Path(__file__).parents[1] / "harness" / "canary" / "weights" / "gqa"
CHAT = [Message("system", "Answer briefly."), Message("user", "What is 2+3?")]
VALUES = {"model", "messages", "prompt", "max_tokens", "temperature", "seed", "n"}  # not part of the shape


def recorded(name: str) -> list[dict]:
    return json.loads((REPLIES / name).read_text())["exchanges"]


def signature(method: str, path: str, body: dict | None) -> tuple:
    body = body or {}
    shape = method, path, tuple(sorted(set(body) - VALUES)), type(body.get("prompt")).__name__
    # /detokenize's answer depends on the ids asked for: a recorded answer for other ids is no answer
    return shape + (tuple(body.get("tokens") or ()),) if path == "/detokenize" else shape


def replay_app(exchanges: list[dict]) -> Starlette:
    """Answers each request with the recorded reply of the same route and shape (extra fields, prompt
    type); a shape never recorded is a 404, as a route the server does not have."""
    table: dict[tuple, dict] = {}
    for exchange in exchanges:
        table.setdefault(signature(exchange["method"], exchange["path"], exchange["request"]), exchange)

    async def answer(request):
        body = await request.json() if request.method == "POST" else None
        exchange = table.get(signature(request.method, request.url.path, body))
        if exchange is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if isinstance(exchange["reply"], str):
            return PlainTextResponse(exchange["reply"], status_code=exchange["status"])
        return JSONResponse(exchange["reply"], status_code=exchange["status"])

    paths = sorted({e["path"] for e in exchanges})
    return Starlette(routes=[Route(p, answer, methods=["GET", "POST"]) for p in paths])


def backend(url: str, **config) -> EndpointBackend:
    return EndpointBackend(EndpointConfig(url=url, policy=RequestPolicy(retries=0, timeout_s=10), **config))


async def _generate(url: str, **config):
    b = backend(url, **config)
    try:
        return await b.generate(CHAT, 16), b.capabilities
    finally:
        await b.aclose()


@pytest.mark.parametrize("name", ["vllm-float32.json", "vllm-bfloat16.json"])
def test_vllm_reply_uses_returned_token_ids_and_drops_the_eos_it_lists(name):
    exchanges = recorded(name)
    raw = next(e for e in exchanges if "return_token_ids" in (e["request"] or {}))["reply"]
    assert raw["choices"][0]["token_ids"][-1] == 2 and raw["choices"][0]["stop_reason"] is None  # EOS listed
    with running_server(replay_app(exchanges)) as url:
        generation, capabilities = asyncio.run(_generate(url))
    assert generation.token_ids == raw["choices"][0]["token_ids"][:-1]  # "22": the EOS left out, as in-process
    assert generation.text == "22" and generation.finish_reason == "eos"
    assert generation.tokens == ["2", "2"]  # from each token's bytes: no /detokenize needed
    assert len(generation.top_logprobs) == len(generation.token_ids)
    assert capabilities["chat_logprobs"] == "token ids"


@pytest.mark.parametrize("name", ["vllm-float32.json", "vllm-bfloat16.json"])
def test_vllm_prompt_logprobs_parse_and_are_finite(name):
    exchanges = recorded(name)
    exchange = next(e for e in exchanges if "prompt_logprobs" in (e["request"] or {}))
    prompt = exchange["request"]["prompt"]
    scores = _scores_from_reply("prompt_logprobs", exchange["reply"], 1, prompt[1:], None)
    assert scores.unavailable is None and len(scores.top_logprobs) == len(prompt) - 1
    assert all(token in row for token, row in zip(prompt[1:], scores.top_logprobs))


def test_topk_kl_of_vllm_float32_vs_bf16_is_finite_and_small():
    """The issue's infinite KL: a bf16 server's rounding made the listed mass exceed 1. On the real
    replies KL is finite, and the noise of bf16 against float32 is small."""
    rows = {}
    for name in ("vllm-float32.json", "vllm-bfloat16.json"):
        exchange = next(e for e in recorded(name) if "prompt_logprobs" in (e["request"] or {}))
        prompt = exchange["request"]["prompt"]
        rows[name] = _scores_from_reply("prompt_logprobs", exchange["reply"], 1, prompt[1:], None).top_logprobs
    result = teacher_forced_topk(rows["vllm-float32.json"], rows["vllm-bfloat16.json"], prompt[1:])
    assert all(math.isfinite(v) for v in result.series["kl"])
    assert result.summary["kl_max"] < 0.05  # bf16 weights vs float32 on a 4M-parameter canary


def test_transformers_serve_shapes_are_detected_and_named():
    """`transformers serve`: /v1/models answers 500, chat logprobs are silently dropped, 422 for unknown
    fields, no /tokenize. With the model named and a local tokenizer the run goes on; scoring is
    reported unavailable with the server's own words, never faked."""
    exchanges = recorded("transformers-serve.json")
    with running_server(replay_app(exchanges)) as url:
        with pytest.raises(PreflightError, match=r"/v1/models.*HTTP 500.*--reference-model"):
            asyncio.run(backend(url, label="reference").preflight())
        b = backend(url, model="harness/canary/weights/gqa", tokenizer=str(GQA))

        async def run():
            try:
                generation = await b.generate(CHAT, 16)
                return generation, await b.score(CHAT, generation.token_ids)
            finally:
                await b.aclose()

        generation, scores = asyncio.run(run())
    assert scores.unavailable == b.capabilities["scoring"]
    assert generation.text == "22" and generation.token_ids == [25, 25]  # from the local tokenizer
    assert b.capabilities["chat_logprobs"] == "token text"  # after a 422 naming return_tokens_as_token_ids
    assert b.capabilities["tokenize_text"].startswith("unavailable: /tokenize answered HTTP 404")
    scoring = b.capabilities["scoring"]
    assert scoring.startswith("unavailable") and "prompt_logprobs" in scoring and "422" in scoring
    assert b.describe()["failed_attempts"] == 0  # detection's refusals (422, 404) are answers, not failures
    why = scoring.removeprefix("unavailable: ")
    assert b.degraded() == [f"teacher-forced metrics unavailable for {b.label}: {why}"]


def sglang_app() -> Starlette:
    """SGLang's documented shapes: /detokenize answers {"text"}; return_tokens_as_token_ids and
    prompt_logprobs are not fields it knows (ignored); logprobs name tokens by text."""
    vocab = {"2": 25, "+": 18, "3": 26}

    async def chat(request):
        entry = {"token": "2", "logprob": -0.1, "top_logprobs": [{"token": "2", "logprob": -0.1}]}
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": "22"},
                                          "logprobs": {"content": [entry, entry]}, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 34, "completion_tokens": 2}})

    async def completions(request):
        return JSONResponse({"choices": [{"index": 0, "text": "2", "logprobs": None, "finish_reason": "length"}]})

    async def tokenize(request):
        body = await request.json()
        tokens = [vocab.get(c, 7) for c in body.get("prompt", "")] if "prompt" in body else list(range(34))
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})

    async def detokenize(request):
        return JSONResponse({"text": "".join({25: "2"}.get(t, "?") for t in (await request.json())["tokens"])})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "gqa"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/tokenize", tokenize, methods=["POST"]),
                             Route("/detokenize", detokenize, methods=["POST"]), Route("/v1/models", models)])


def test_sglang_shapes_text_detokenize_and_ignored_fields():
    with running_server(sglang_app()) as url:
        b = backend(url)

        async def run():
            try:
                await b.preflight()
                return await b.generate(CHAT, 16), await b._token_strings([25])
            finally:
                await b.aclose()

        generation, strings = asyncio.run(run())
    assert generation.token_ids == [25, 25] and generation.tokens == ["2", "2"]  # by /tokenize of the text
    assert strings == ["2"]  # {"text"}, not silently ""
    assert "echo reply has no per-prompt-token logprobs" in b.capabilities["scoring"]
