"""The request layer under faults, on loopback: 500s, 429 with Retry-After, responses slower than the
timeout, malformed JSON, connection resets, refused requests, and a server killed mid-run (then
`resume` completes the run). Each request either succeeds or fails with every attempt recorded."""

from __future__ import annotations

import asyncio
import inspect
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("starlette", reason="the '[test]' extra's HTTP server: pip install -e '.[test]'")

from harness.replay.endpoint import EndpointError, RequestClient, RequestPolicy, open_endpoint
from harness.replay.runner import Replay
from harness.runs.store import RunStore
from harness.scenarios.load import Scenario, Turn
from harness.serve import running_server

QUIET = "critical"  # uvicorn logs the handlers it cancels at shutdown (the injected slow ones)
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def fake_openai_app(plan: list[str], kill_after: int | None = None):
    """A deterministic OpenAI-compatible server (no model) that misbehaves on cue.

    Each request takes the next action from `plan` ("ok" once it is empty): "500", "503", "400",
    "429:<seconds>" (with Retry-After), "slow:<seconds>", "malformed" (HTTP 200, broken JSON).
    With `kill_after`, the process SIGKILLs itself on that request. Replies: the last user message
    reversed, one token per character (id = code point), with vLLM-style token-id logprobs.
    Self-contained (only its own imports): tests run its source in a subprocess."""
    import asyncio
    import os
    import signal

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    served = [0]

    async def misbehave():
        served[0] += 1
        if kill_after is not None and served[0] >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        action = plan.pop(0) if plan else "ok"
        name, _, arg = action.partition(":")
        if name in ("500", "503", "400"):
            return JSONResponse({"error": {"message": f"injected {name}"}}, status_code=int(name))
        if name == "429":
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429, headers={"Retry-After": arg})
        if name == "malformed":
            return Response(b'{"choices": [{"message": ', media_type="application/json")
        if name == "slow":
            await asyncio.sleep(float(arg))
        return None

    def entry(token_id: int) -> dict:
        return {"token": f"token_id:{token_id}", "logprob": -0.5, "bytes": []}

    async def chat(request):
        fault, body = await misbehave(), await request.json()
        if fault is not None:
            return fault
        text = body["messages"][-1]["content"][::-1][: body.get("max_tokens", 16)]
        content = [entry(ord(c)) | {"top_logprobs": [entry(ord(c)), entry(ord(c) + 1) | {"logprob": -1.5}]}
                   for c in text]
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "logprobs": {"content": content}, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": len(text)}})

    async def completions(request):
        fault, body = await misbehave(), await request.json()
        if fault is not None:
            return fault
        rows = [None] + [{str(t): {"logprob": -0.5, "rank": 1}} for t in body["prompt"][1:]]
        return JSONResponse({"choices": [{"index": 0, "text": "", "prompt_logprobs": rows,
                                          "finish_reason": "length"}]})

    async def tokenize(request):
        body = await request.json()
        text = "".join(f"{m['role']}:{m['content']}\n" for m in body.get("messages", []))
        return JSONResponse({"tokens": [ord(c) for c in text or body.get("prompt", "")]})

    async def models(request):
        return JSONResponse({"data": [{"id": "fake"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/tokenize", tokenize, methods=["POST"]), Route("/v1/models", models)])


def policy(**overrides) -> RequestPolicy:
    return RequestPolicy(**({"concurrency": 4, "timeout_s": 5.0, "retries": 3, "backoff_s": 0.01,
                             "max_backoff_s": 1.0} | overrides))


async def post_chat(url: str, request_policy: RequestPolicy, cache_dir=None) -> tuple[dict | EndpointError, list]:
    client = RequestClient(url, policy=request_policy, cache_dir=cache_dir)
    try:
        return await client.post("/v1/chat/completions", CHAT), client.failures
    except EndpointError as error:
        return error, client.failures
    finally:
        await client.aclose()


@pytest.mark.parametrize("plan, failures", [
    (["500", "503"], ["HTTP 500", "HTTP 503"]),
    (["malformed"], ["malformed JSON"]),
    (["slow:3"], ["timed out after 0.4 s"]),
])
def test_transient_faults_are_retried_and_recorded(plan, failures):
    with running_server(fake_openai_app(list(plan)), log_level=QUIET) as url:
        started = time.monotonic()
        reply, recorded = asyncio.run(post_chat(url, policy(timeout_s=0.4)))
        elapsed = time.monotonic() - started
    assert reply["choices"][0]["message"]["content"] == "olle"  # "hello" reversed, max_tokens 4
    assert [f["attempt"] for f in recorded] == list(range(len(failures)))
    assert all(want in got["error"] for want, got in zip(failures, recorded))
    assert elapsed < 2.5


def test_429_waits_for_retry_after():
    with running_server(fake_openai_app(["429:0.5"])) as url:
        started = time.monotonic()
        reply, recorded = asyncio.run(post_chat(url, policy(backoff_s=0.0)))
        elapsed = time.monotonic() - started
    assert elapsed >= 0.5 and "choices" in reply
    assert len(recorded) == 1 and "HTTP 429" in recorded[0]["error"]


@pytest.mark.parametrize("plan, message", [
    (["500"] * 10, "failed after 3 attempt(s): HTTP 500"),
    (["slow:5"] * 10, "timed out after 0.3 s"),
    (["malformed"] * 10, "malformed JSON"),
    (["400"], "failed after 1 attempt(s): HTTP 400"),  # the client's fault: not retried
])
def test_persistent_faults_fail_cleanly_with_every_attempt(plan, message):
    with running_server(fake_openai_app(list(plan)), log_level=QUIET) as url:
        started = time.monotonic()
        error, recorded = asyncio.run(post_chat(url, policy(retries=2, timeout_s=0.3)))
        elapsed = time.monotonic() - started
    assert isinstance(error, EndpointError) and message in str(error)
    assert len(error.attempts) == len(recorded) == (1 if plan == ["400"] else 3)
    assert elapsed < 3


@pytest.fixture
def resetting_server():
    """A TCP server on loopback that answers every connection with a reset (RST)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            connection.recv(1024)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            connection.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(timeout=2)
    listener.close()


def test_connection_reset_fails_cleanly(resetting_server):
    error, recorded = asyncio.run(post_chat(resetting_server, policy(retries=2)))
    assert isinstance(error, EndpointError) and len(recorded) == 3
    assert all("connection error" in f["error"] for f in recorded)


def test_cached_replies_survive_the_server(tmp_path):
    with running_server(fake_openai_app([])) as url:
        first, _ = asyncio.run(post_chat(url, policy(), tmp_path))
    again, recorded = asyncio.run(post_chat(url, policy(retries=0), tmp_path))  # server gone: cache answers
    assert again == first and recorded == []


# ---------------------------------------------------------------- a server killed mid-run, then resume

SERVE_SNIPPET = """
import sys, uvicorn, socket
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP: asyncio sets NODELAY
sock.bind(("127.0.0.1", 0))
sock.listen(64)
print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
kill_after = int(sys.argv[1]) if len(sys.argv) > 1 else None
uvicorn.Server(uvicorn.Config(fake_openai_app([], kill_after), log_level="error")).run(sockets=[sock])
"""
SCENARIOS = [Scenario(id=f"s{i}", kind="chat", turns=(Turn(user=f"question {i}"), Turn(user=f"and {i}?")),
                      max_new_tokens=6) for i in range(6)]


def start_fake_server(kill_after: int | None) -> tuple[subprocess.Popen, str]:
    source = textwrap.dedent(inspect.getsource(fake_openai_app)) + SERVE_SNIPPET
    args = [sys.executable, "-c", source] + ([str(kill_after)] if kill_after else [])
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    return process, process.stdout.readline().strip()


async def replay_against(url: str, store: RunStore) -> None:
    fast = dict(retries=1, timeout_s=2.0)
    reference = open_endpoint(url, label="reference", **fast)
    candidate = open_endpoint(url, label="fp8", **fast)
    try:
        await Replay("fake", reference, [candidate], store).run(SCENARIOS, concurrency=1)
    finally:
        await reference.aclose(), await candidate.aclose()


def test_server_killed_mid_run_then_resume_completes(tmp_path):
    process, url = start_fake_server(kill_after=14)  # dies part-way through the third scenario
    try:
        store = RunStore.create(tmp_path / "run", {"run_id": "killed"})
        started = time.monotonic()
        asyncio.run(replay_against(url, store))
        assert time.monotonic() - started < 20
    finally:
        process.kill()
        process.wait(timeout=10)
    first_done = store.read("done")
    errors = store.read("errors")
    assert 0 < len(first_done) < 2 * len(SCENARIOS)
    assert errors and all("connection error" in e["error"] or "ConnectError" in e["error"] for e in errors)
    units_failed = {(e["scenario"], e["path"]) for e in errors}
    assert units_failed.isdisjoint({(d["scenario"], d["path"]) for d in first_done})
    texts_before = [t for t in store.read("texts") if (t["scenario"], t["path"]) in
                    {(d["scenario"], d["path"]) for d in first_done}]

    process, url = start_fake_server(kill_after=None)
    try:
        resumed = RunStore.resume(tmp_path / "run")
        asyncio.run(replay_against(url, resumed))
    finally:
        process.kill()
        process.wait(timeout=10)
    done = resumed.read("done")
    assert sorted((d["scenario"], d["path"]) for d in done) == sorted(
        (s.id, p) for s in SCENARIOS for p in ("reference", "fp8"))
    assert resumed.read("errors") == errors  # the first run's failures stay in the run
    assert all(t in resumed.read("texts") for t in texts_before)  # nothing finished was lost or redone
    assert len(resumed.read("texts")) == len(SCENARIOS) * 2 * 2
