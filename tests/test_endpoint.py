"""The endpoint backend end to end against `harness serve` on loopback: the same scenarios replayed
in-process and over HTTP give the same metrics; capabilities a server lacks are reported, not faked."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest

pytest.importorskip("starlette", reason="the '[test]' extra's HTTP server: pip install -e '.[test]'")
import torch
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from harness.canary.tiny_models import build_tiny_model
from harness.kv_paths.spec import parse_path
from harness.replay.endpoint import EndpointBackend, EndpointConfig, RequestPolicy, open_endpoint, request_key
from harness.replay.inprocess import InProcessModel
from harness.replay.runner import Replay
from harness.runs.store import RunStore
from harness.scenarios.load import Scenario, Turn
from harness.serve import ServedModel, build_app, running_server
from harness.types import Message, Scores

TOP_K = 5
PATHS = ("bf16", "fp8_e4m3")
# float32 weights: prefilling the scored prompt in one chunk (server) or two (in-process) then differs
# only by float32 rounding (seen: 5e-5 relative on KL, 5e-7 absolute on logprob deltas); token-level
# metrics must agree exactly.
RTOL, ATOL = 1e-3, 1e-5
SCENARIOS = [
    Scenario(id="chat-sales", kind="chat", system="You are a helpful sales assistant for a SaaS product.",
             turns=(Turn(user="What pricing plans do you offer?"), Turn(user="And the price?"),
                    Turn(user="Any discount?")), max_new_tokens=10),
    Scenario(id="arith", kind="arithmetic", turns=(Turn(user="What is 7 * 8 + 3 * 4?", expect="68"),),
             max_new_tokens=8),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return InProcessModel.load(build_tiny_model("gqa", tmp_path_factory.mktemp("tiny-gqa")), "cpu", torch.float32)


@pytest.fixture(scope="module")
def servers(model):
    """One `harness serve` app per path (and the reference) on loopback: {label: base URL}."""
    backends = {"reference": model.backend(None)} | {p: model.backend(parse_path(p)) for p in PATHS}
    with contextlib.ExitStack() as stack:
        yield {label: stack.enter_context(running_server(build_app(ServedModel(b, "tiny-gqa"))))
               for label, b in backends.items()}


class TopKInProcess:
    """An in-process backend whose scores are cut to what an endpoint returns: the top-k of each
    position plus the scored token's own logprob. Metrics from it and from HTTP must then agree."""

    def __init__(self, backend, k: int = TOP_K):
        self.backend, self.k, self.label = backend, k, backend.label

    def describe(self) -> dict:
        return self.backend.describe()

    async def generate(self, messages, max_new_tokens):
        return await self.backend.generate(messages, max_new_tokens)

    async def score(self, messages, continuation_ids) -> Scores:
        full = (await self.backend.score(messages, continuation_ids)).logprobs  # [T, V]
        rows = []
        for row, token in zip(full, continuation_ids):
            values, indices = torch.topk(row, self.k)
            rows.append(dict(zip(indices.tolist(), values.tolist())) | {int(token): float(row[token])})
        return Scores(logprobs=None, top_logprobs=rows)

    async def aclose(self) -> None:
        return None


async def replay(reference, candidates, directory) -> dict[tuple, float | None]:
    store = RunStore.create(directory, {"run_id": directory.name})
    await Replay("tiny", reference, candidates, store).run(SCENARIOS, concurrency=2)
    assert store.read("errors") == []
    return {(r["scenario"], r["path"], r["turn"], r["metric"]): r["value"] for r in store.read("records")}


def test_endpoint_metrics_agree_with_in_process(model, servers, tmp_path):
    candidates = [TopKInProcess(model.backend(parse_path(p))) for p in PATHS]
    in_process = asyncio.run(replay(TopKInProcess(model.backend(None)), candidates, tmp_path / "in-process"))

    async def over_http():
        backends = [open_endpoint(servers[label], label=label, top_logprobs=TOP_K) for label in ("reference", *PATHS)]
        try:
            return await replay(backends[0], backends[1:], tmp_path / "endpoint"), [b.describe() for b in backends]
        finally:
            await asyncio.gather(*(b.aclose() for b in backends))

    http, described = asyncio.run(over_http())
    # cast statistics and the implementation check (a probe on the attention function) are in-process only
    expected_keys = {k for k in in_process if not k[3].startswith(("kv_", "attn_impl_"))}
    assert set(http) == expected_keys
    assert {k[3] for k in http} >= {"first_divergent_token", "exact_match", "kl_mean", "top1_agree",
                                    "ref_logprob_delta_mean", "ref_rank_max", "answer_correct"}
    for key in sorted(expected_keys):
        a, b = in_process[key], http[key]
        assert (a is None and b is None) or math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL), \
            f"{key}: in-process {a}, HTTP {b}"
    for description in described:
        assert description["capabilities"]["scoring"] == "prompt_logprobs"
        assert description["capabilities"]["chat_logprobs"] == "token ids"
        assert description["attention_error"] == "not available over HTTP"


def test_echo_scoring_matches_prompt_logprobs(model, servers):
    messages = [Message("user", "Hello there")]
    continuation = model.backend(None).generate_sync(messages, 6).token_ids

    async def both():
        plain = open_endpoint(servers["reference"])
        echo = open_endpoint(servers["reference"])
        echo.capabilities["scoring"] = "echo"  # as on a server without vLLM's prompt_logprobs
        try:
            return await plain.score(messages, continuation), await echo.score(messages, continuation)
        finally:
            await plain.aclose(), await echo.aclose()

    by_prompt_logprobs, by_echo = asyncio.run(both())
    assert by_prompt_logprobs.unavailable is None and by_echo.unavailable is None
    for a, b in zip(by_prompt_logprobs.top_logprobs, by_echo.top_logprobs):
        assert a.keys() == b.keys() and all(math.isclose(a[t], b[t], abs_tol=1e-6) for t in a)


def test_server_without_scoring_or_tokenize_is_reported_not_faked(model, tmp_path):
    """A chat-only server: scoring is unavailable (with the reason), and token ids come from a local
    tokenizer when one is named."""
    chat = build_app(ServedModel(model.backend(None), "tiny-gqa"))
    by_path = {route.path: route for route in chat.routes}
    app = Starlette(routes=[by_path["/v1/chat/completions"], by_path["/v1/models"]])
    model.tokenizer.save_pretrained(str(tmp_path / "tok"))
    messages = [Message("user", "Hi")]

    async def probe(url):
        bare = open_endpoint(url)
        local = open_endpoint(url, tokenizer=str(tmp_path / "tok"))
        try:
            generation = await bare.generate(messages, 4)
            # a chat never generated here: no prompt ids from return_token_ids, and no /tokenize
            other = await bare.score([Message("user", "Other")], [40, 41])
            return generation, other, await local.prompt_ids(messages), bare.describe()
        finally:
            await bare.aclose(), await local.aclose()

    with running_server(app) as url:
        generation, scores, prompt_ids, described = asyncio.run(probe(url))
    assert generation.token_ids == model.backend(None).generate_sync(messages, 4).token_ids
    assert scores.top_logprobs is None and scores.unavailable.startswith("unavailable: the server has no /tokenize")
    assert prompt_ids == model.encode_chat(messages)
    assert described["capabilities"]["tokenize_chat"].startswith("unavailable: /tokenize answered HTTP 404")


def test_completions_without_logprobs_reports_scoring_unavailable(model):
    served = ServedModel(model.backend(None), "tiny-gqa")
    full = build_app(served)

    async def no_logprobs(request):  # the refusals OpenAI-style servers give, naming the field
        body = await request.json()
        field = "prompt_logprobs" if "prompt_logprobs" in body else "echo"
        return JSONResponse({"error": {"message": f"Unrecognized request argument supplied: {field}"}},
                            status_code=400)

    routes = [r for r in full.routes if r.path != "/v1/completions"]
    app = Starlette(routes=routes + [Route("/v1/completions", no_logprobs, methods=["POST"])])

    async def probe(url):
        backend = open_endpoint(url)
        try:
            return await backend.score([Message("user", "Hi")], [40, 41]), backend.describe()
        finally:
            await backend.aclose()

    with running_server(app) as url:
        scores, described = asyncio.run(probe(url))
    assert scores.unavailable.startswith("unavailable: teacher-forced scoring needs /v1/completions")
    assert "HTTP 400" in scores.unavailable and described["capabilities"]["scoring"] == scores.unavailable


def test_cache_key_covers_the_request_not_the_api_key(monkeypatch, tmp_path):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 0}
    assert request_key("http://h/v1/chat/completions", body) == request_key("http://h/v1/chat/completions", dict(body))
    assert request_key("http://h/v1/chat/completions", body) != request_key("http://h/v1/chat/completions",
                                                                            body | {"seed": 1})
    monkeypatch.setenv("FP8_HARNESS_TEST_KEY", "sk-secret-123")
    backend = EndpointBackend(EndpointConfig("http://127.0.0.1:9/v1", api_key_env="FP8_HARNESS_TEST_KEY",
                                             policy=RequestPolicy(retries=0), cache_dir=str(tmp_path)))
    assert "sk-secret-123" not in repr(backend.describe())
    assert backend.describe()["api_key_env"] == "FP8_HARNESS_TEST_KEY"
    monkeypatch.delenv("FP8_HARNESS_TEST_KEY")
    with pytest.raises(ValueError, match="FP8_HARNESS_TEST_KEY"):
        open_endpoint("http://127.0.0.1:9", api_key_env="FP8_HARNESS_TEST_KEY")


@pytest.mark.parametrize("url, message", [
    ("localhost:8000", "must start with http:// or https://"),
    ("http://user:sk-123@localhost:8000/v1", "holds credentials"),
])
def test_endpoint_url_checks(url, message):
    with pytest.raises(ValueError, match=message):
        open_endpoint(url)


def test_request_policy_checks():
    with pytest.raises(ValueError, match="RequestPolicy.concurrency must be >= 1, got 0"):
        RequestPolicy(concurrency=0)
    with pytest.raises(ValueError, match="RequestPolicy.timeout_s must be > 0"):
        RequestPolicy(timeout_s=0)
