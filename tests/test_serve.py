"""`harness serve` on a loopback port, driven by the official `openai` client and plain httpx."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("starlette", reason="the '[test]' extra's HTTP server: pip install -e '.[test]'")
openai = pytest.importorskip("openai", reason="the '[test]' extra's client: the official client must work against us")
import torch

from harness.canary.tiny_models import build_tiny_model
from harness.kv_paths.spec import parse_path
from harness.replay.inprocess import InProcessModel
from harness.serve import ServedModel, build_app, running_server
from harness.types import Message


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = build_tiny_model("gqa", tmp_path_factory.mktemp("tiny-gqa"))
    model = InProcessModel.load(directory, "cpu", torch.float32)
    served = ServedModel(model.backend(parse_path("fp8_e4m3")), "tiny-gqa")
    with running_server(build_app(served)) as url:
        yield served, url


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["tiny-gqa"]


def test_chat_completion_matches_in_process_generation(served, client):
    model, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 * 8?"}]
    reply = client.chat.completions.create(model="tiny-gqa", messages=messages, max_tokens=12, temperature=0,
                                           seed=0, logprobs=True, top_logprobs=3)
    expected = model.backend.generate_sync([Message(**m) for m in messages], 12)
    choice = reply.choices[0]
    assert choice.message.content == expected.text
    assert choice.finish_reason == {"eos": "stop", "length": "length"}[expected.finish_reason]
    eos = [model.tokenizer.decode([model.tokenizer.eos_token_id])] if expected.finish_reason == "eos" else []
    assert [entry.token for entry in choice.logprobs.content] == expected.tokens + eos  # EOS listed, as vLLM
    assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
    assert reply.usage.completion_tokens == len(expected.token_ids) + len(eos)
    assert choice.model_extra["stop_reason"] is None


def test_completion_echo_scores_every_prompt_token(served, client):
    model, _ = served
    prompt = model.encode_chat([Message("user", "Hello there")])
    reply = client.completions.create(model="tiny-gqa", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(prompt) and logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(len(top) >= 2 for top in logprobs.top_logprobs[1:])  # top 2, plus the prompt token's own
    assert reply.choices[0].text == model.tokenizer.decode(prompt)


def test_completion_text_prompt_and_vllm_extensions(client):
    reply = client.completions.create(model="tiny-gqa", prompt="Once upon", max_tokens=4, logprobs=1,
                                      extra_body={"prompt_logprobs": 1, "return_tokens_as_token_ids": True})
    choice = reply.choices[0]
    assert len(choice.logprobs.tokens) == reply.usage.completion_tokens <= 4
    assert all(token.startswith("token_id:") for token in choice.logprobs.tokens)
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len("Once upon")
    assert all(any(entry["rank"] >= 1 for entry in row.values()) for row in prompt_logprobs[1:])


@pytest.mark.parametrize("extra, message", [
    ({"stream": "yes"}, "stream must be true or false"),
    ({"temperature": 0.7}, "temperature must be 0"),
    ({"n": 2}, "only n=1"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs must be an integer in 0..20"),
])
def test_unsupported_requests_get_an_openai_style_400(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="tiny-gqa", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, **extra)


def test_tokenize_detokenize_health(served):
    model, url = served
    messages = [{"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        tokens = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()["tokens"]
        assert tokens == model.encode_chat([Message("user", "Hi")])
        assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == model.tokenizer.decode(tokens)
        assert http.post("/tokenize", content=b"{not json").status_code == 400


# ---------------------------------------------------------------- request limits (issue 15, item 7)


def _error(reply: httpx.Response) -> dict:
    assert "Traceback" not in reply.text
    return reply.json()["error"]


def test_oversized_and_deeply_nested_bodies_are_refused_fast(served):
    _, url = served
    with httpx.Client(base_url=url, timeout=30) as http:
        big = {"model": "tiny-gqa", "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
        started = time.monotonic()
        reply = http.post("/v1/chat/completions", json=big)
        assert reply.status_code == 413 and "limit" in _error(reply)["message"]
        assert time.monotonic() - started < 5  # before: 100 s and 4.4 GB for a 10 MB chat
        deep = b"[" * 100_000 + b"]" * 100_000
        reply = http.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "nested too deeply" in _error(reply)["message"]


def test_prompt_and_max_tokens_beyond_the_context_are_400(served):
    model, url = served
    limit = model.max_model_len
    with httpx.Client(base_url=url, timeout=60) as http:
        reply = http.post("/v1/completions", json={"model": "tiny-gqa", "prompt": [5] * (limit + 10), "max_tokens": 1})
        assert reply.status_code == 400 and f"maximum context length is {limit}" in _error(reply)["message"]
        chat = {"model": "tiny-gqa", "messages": [{"role": "user", "content": "hi"}], "max_tokens": limit}
        reply = http.post("/v1/chat/completions", json=chat)
        error = _error(reply)
        assert reply.status_code == 400 and error["param"] == "max_tokens" and "you requested" in error["message"]


def test_bad_detokenize_ids_and_unknown_model_get_json_errors(served):
    _, url = served
    with httpx.Client(base_url=url, timeout=30) as http:
        for tokens in ([10**9], [-1], ["a"], [True]):
            reply = http.post("/detokenize", json={"tokens": tokens})
            assert reply.status_code == 400 and _error(reply)["param"] == "tokens"
        reply = http.post("/v1/chat/completions", json={"model": "other", "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 404 and _error(reply)["param"] == "model"


def test_stop_strings_and_return_token_ids(served):
    model, url = served
    messages = [{"role": "user", "content": "Count: 1 2 3"}]
    with httpx.Client(base_url=url, timeout=60) as http:
        free = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12,
                                                       "return_token_ids": True}).json()
        text, ids = free["choices"][0]["message"]["content"], free["choices"][0]["token_ids"]
        assert free["prompt_token_ids"] == model.encode_chat([Message(**m) for m in messages])
        choice = free["choices"][0]
        if choice["finish_reason"] == "stop" and choice["stop_reason"] is None:  # stopped on EOS: listed last
            assert ids[-1] == model.tokenizer.eos_token_id
            ids = ids[:-1]
        assert model.tokenizer.decode(ids) == text and len(choice["token_ids"]) == free["usage"]["completion_tokens"]
        stop = text[len(text) // 2:][:2] if len(text) > 3 else None
        if stop:  # the random-weight model's own text gives the stop string
            cut = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "stop": [stop],
                                                          "return_token_ids": True}).json()["choices"][0]
            assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
            assert cut["message"]["content"] == text[:text.find(stop)]


# ---------------------------------------------------------------- streaming (issue 28, item 5)


def test_the_openai_client_streams_a_chat_completion_with_logprobs(served, client):
    """What chat front-ends and serving benchmarks do by default: stream=True. The chunks join to exactly
    the non-streamed reply: its text, its tokens and logprobs one per chunk, its finish, its usage."""
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model="tiny-gqa", messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model="tiny-gqa", messages=messages, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(choice.delta.content or "" for choice in streamed) == whole.choices[0].message.content
    entries = [entry for choice in streamed if choice.logprobs for entry in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in entries)
    assert streamed[-1].finish_reason == whole.choices[0].finish_reason
    assert [c.finish_reason for c in streamed].count(None) == len(streamed) - 1
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # stream_options.include_usage


def test_a_streamed_completion_joins_to_the_whole_one(served, client):
    model, _ = served
    prompt = model.encode_chat([Message("user", "Hello there")])
    whole = client.completions.create(model="tiny-gqa", prompt=prompt, max_tokens=6, echo=True, logprobs=2)
    chunks = list(client.completions.create(model="tiny-gqa", prompt=prompt, max_tokens=6, echo=True, logprobs=2,
                                            stream=True))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == whole.choices[0].text
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens and chunks[-1].usage is None  # usage only when asked


def test_stream_fields_are_checked(served):
    _, url = served
    chat = {"model": "tiny-gqa", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, field in (({"stream": "yes"}, "stream"), ({"stream_options": {"include_usage": True}}, "stream_options"),
                         ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options")):
        reply = httpx.post(url + "/v1/chat/completions", json=chat | extra, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    streamed = httpx.post(url + "/v1/chat/completions", json=chat | {"stream": True}, timeout=30)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.endswith("data: [DONE]\n\n")


def stream_only(app):
    """An ASGI wrapper: completions that are not streamed are refused with a 400 naming streaming, as a
    server that only streams answers them."""
    import json as _json

    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in ("/v1/chat/completions", "/v1/completions"):
            return await app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if not _json.loads(body).get("stream"):
            refusal = _json.dumps({"error": {"message": "this server only streams: set stream to true",
                                             "param": "stream"}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})
            return await send({"type": "http.response.body", "body": refusal})
        replayed = [False]

        async def replay():
            if replayed[0]:
                return await receive()
            replayed[0] = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await app(scope, replay, send)

    return wrapped


def test_the_endpoint_client_consumes_a_server_that_only_streams(served):
    """Generation and teacher-forced scoring through a stream-only server equal those of the same server
    answering whole replies; the manifest's capabilities say streaming was required."""
    import asyncio

    from harness.replay.endpoint import open_endpoint

    model, url = served
    messages = [Message("system", "Be brief."), Message("user", "What is 7 * 8?")]

    async def replay(base: str):
        backend = open_endpoint(base, retries=0)
        try:
            generation = await backend.generate(messages, 8)
            return generation, await backend.score(messages, generation.token_ids), backend.describe()
        finally:
            await backend.aclose()

    with running_server(stream_only(build_app(model))) as streaming:
        streamed, streamed_scores, described = asyncio.run(replay(streaming))
    whole, whole_scores, plain = asyncio.run(replay(url))
    assert streamed == whole and streamed.token_ids
    assert streamed_scores == whole_scores and streamed_scores.unavailable is None
    assert described["capabilities"]["stream"].startswith("required: the server refused a reply that is not streamed")
    assert "stream" not in plain["capabilities"]
    assert described["capabilities"]["chat_logprobs"] == plain["capabilities"]["chat_logprobs"] == "token ids"


def test_a_client_that_left_stops_its_generation(served, monkeypatch):
    """Issue 45: generation went on for clients that had disconnected (32 dropped streams delayed the next
    request 24.5 s). The server now stops a generation at its next step once its client has gone."""
    import socket
    import threading

    model, url = served
    steps, ended = [], threading.Event()

    def slow_greedy(prompt_ids, max_new_tokens, on_step=None, remember_prefill=False):
        try:
            for _ in range(2000):  # 2000 x 5 ms: 10 s if nobody stops it
                time.sleep(0.005)
                on_step(torch.zeros(8), 1)
                steps.append(1)
        finally:
            ended.set()
        return [1] * len(steps), "length", None

    monkeypatch.setattr(model.backend, "greedy_ids", slow_greedy)
    host, port = url.removeprefix("http://").split(":")
    body = b'{"model": "tiny-gqa", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": true}'
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)
    assert ended.wait(3), f"generation still running {len(steps)} steps after its client left"
    assert len(steps) < 2000


@pytest.mark.parametrize("spec", ["fp8_e4m3:calibrated:fp8_q", "fp8_e4m3:calibrated:fault=scale_off"])
def test_prompt_logprobs_are_the_paths_own_attention(tmp_path, spec):
    """A path whose attention differs from the reference's (FP8 query, a fault injector): the prompt logprobs serve
    computes are the engine's teacher-forced scores of the same tokens (its own attention), not the reference's.
    Before (issue 45) serve's prefill never set the active cache and returned the reference's attention. float32
    model: both sides sum the same products, so the two agree to float32 rounding (1e-4 nats), while the path moves
    the scores from the reference's by far more (asserted)."""
    directory = build_tiny_model("gqa", tmp_path / "tiny-gqa")
    model = InProcessModel.load(directory, "cpu", torch.float32)
    ids = model.encode_chat([Message("user", "What is 7 * 8? Tell me in a sentence, please.")])
    prompt, reply = ids[:4], ids[4:]
    engine = model.backend(parse_path(spec)).engine().score([prompt], [reply])[0][:len(reply)]
    reference = model.backend(None).engine().score([prompt], [reply])[0][:len(reply)]
    served = ServedModel(model.backend(parse_path(spec)), "tiny-gqa").prompt_logprobs(ids, top_k=1)[len(prompt) - 1:]
    own = torch.tensor([step.logprob for step in served])
    chosen = lambda rows: rows.gather(1, torch.tensor(reply)[:, None])[:, 0]  # noqa: E731 - the reply's log-probs
    assert (own - chosen(engine)).abs().max() < 1e-4
    assert (chosen(engine) - chosen(reference)).abs().max() > 1e-3
