"""Endpoint client benchmark: client overhead per request, and concurrency scaling against a slow server.

    python benchmarks/endpoint_bench.py [--requests N] [--latency-ms 50]

A minimal OpenAI-compatible ASGI server (uvicorn, in a subprocess so its CPU time is not counted)
answers chat completions with 16 tokens of token-id logprobs and prompt-logprob scoring requests,
after a fixed latency (0 ms for the overhead rows). Rows:
- client overhead: CPU time of this (client) process per request at concurrency 64, for the bare
  request layer (`RequestClient.post`) and for a whole `EndpointBackend.generate` (JSON parsing, token
  ids and logprobs included). Target <= 2 ms.
- scaling: throughput at concurrency 32 over concurrency 1 against the fixed-latency server, for the
  request layer and for the replay scheduler (`harness.replay.runner.Replay`, reference + one candidate, one
  two-turn scenario per unit of concurrency). Target >= 25x.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPLY_TOKENS = 16
OVERHEAD_TARGET_MS = 2.0
SCALING_TARGET = 25.0


def minimal_app(latency_s: float):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def entry(token_id: int, logprob: float = -0.5) -> dict:
        return {"token": f"token_id:{token_id}", "logprob": logprob, "bytes": []}

    content = [entry(65 + i) | {"top_logprobs": [entry(65 + i), entry(97 + i, -1.5)]} for i in range(REPLY_TOKENS)]
    chat_reply = {"id": "bench", "object": "chat.completion", "model": "bench",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ABCDEFGHIJKLMNOP"},
                               "logprobs": {"content": content}, "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 8, "completion_tokens": REPLY_TOKENS}}

    async def chat(request):
        await request.body()
        if latency_s:
            await asyncio.sleep(latency_s)
        return JSONResponse(chat_reply)

    async def completions(request):
        prompt = (await request.json())["prompt"]
        if latency_s:
            await asyncio.sleep(latency_s)
        rows = [None] + [{str(t): {"logprob": -0.5, "rank": 1}} for t in prompt[1:]]
        return JSONResponse({"choices": [{"index": 0, "text": "", "prompt_logprobs": rows, "finish_reason": "length"}]})

    async def tokenize(request):
        body = await request.json()
        text = "".join(f"{m['role']}:{m['content']}\n" for m in body.get("messages", [])) or body.get("prompt", "")
        return JSONResponse({"tokens": [ord(c) % 128 for c in text]})

    async def models(request):
        return JSONResponse({"data": [{"id": "bench"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/tokenize", tokenize, methods=["POST"]), Route("/v1/models", models)])


def serve_forever(latency_ms: float) -> None:
    """Serve `minimal_app` on a loopback port (printed first) from several worker processes sharing
    one listening socket, so the server is not what limits the client's numbers."""
    import multiprocessing
    import os
    import signal
    import socket

    # proto IPPROTO_TCP, or asyncio leaves Nagle on (and keep-alive replies wait ~40 ms for an ACK)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    if workers == 1:
        return _uvicorn(sock, latency_ms)
    processes = [multiprocessing.get_context("fork").Process(target=_uvicorn, args=(sock, latency_ms), daemon=True)
                 for _ in range(workers)]
    for process in processes:
        process.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for process in processes:
            process.join()
    finally:
        for process in processes:
            process.terminate()


def _uvicorn(sock, latency_ms: float) -> None:
    import uvicorn

    config = uvicorn.Config(minimal_app(latency_ms / 1000), log_level="error", access_log=False, backlog=1024)
    uvicorn.Server(config).run(sockets=[sock])


class Server:
    def __init__(self, latency_ms: float):
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", str(latency_ms)],
                                        stdout=subprocess.PIPE, text=True)
        self.url = self.process.stdout.readline().strip()

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def _chat_body(i: int) -> dict:
    return {"model": "bench", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": REPLY_TOKENS}


async def _run(concurrency: int, requests: int, one) -> tuple[float, float]:
    """(wall seconds, client CPU seconds) for `requests` calls of `one(i)`, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> None:
        async with gate:
            await one(i)

    await asyncio.gather(*(bounded(i) for i in range(min(concurrency, 8))))  # warm connections up
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(bounded(i) for i in range(requests)))
    return time.perf_counter() - wall, time.process_time() - cpu


async def request_layer(url: str, concurrency: int, requests: int) -> tuple[float, float]:
    from harness.replay.endpoint import RequestClient, RequestPolicy

    client = RequestClient(url, policy=RequestPolicy(concurrency=concurrency, retries=0))
    try:
        return await _run(concurrency, requests, lambda i: client.post("/v1/chat/completions", _chat_body(i)))
    finally:
        await client.aclose()


async def backend_generate(url: str, concurrency: int, requests: int) -> tuple[float, float]:
    from harness.replay.endpoint import open_endpoint
    from harness.types import Message

    backend = open_endpoint(url, concurrency=concurrency, retries=0)
    try:
        return await _run(concurrency, requests,
                          lambda i: backend.generate([Message("user", f"request {i}")], REPLY_TOKENS))
    finally:
        await backend.aclose()


async def replay(url: str, concurrency: int, scenarios: int) -> tuple[float, float]:
    from harness.replay.endpoint import open_endpoint
    from harness.replay.runner import Replay
    from harness.runs.store import RunStore
    from harness.scenarios.load import Scenario, Turn

    cases = [Scenario(id=f"s{i}", kind="chat", turns=(Turn(user=f"q{i}"), Turn(user=f"and {i}?")),
                      max_new_tokens=REPLY_TOKENS) for i in range(scenarios)]
    reference = open_endpoint(url, label="reference", concurrency=64, retries=0)
    candidate = open_endpoint(url, label="fp8", concurrency=64, retries=0)
    with tempfile.TemporaryDirectory() as scratch:
        warmup = [Scenario(id="warmup", kind="chat", turns=(Turn(user="hi"),), max_new_tokens=REPLY_TOKENS)]
        await Replay("bench", reference, [candidate], RunStore.create(Path(scratch) / "warm", {})).run(warmup)
        store = RunStore.create(Path(scratch) / "run", {"run_id": "bench"})
        wall, cpu = time.perf_counter(), time.process_time()
        await Replay("bench", reference, [candidate], store).run(cases, concurrency=concurrency)
        elapsed = time.perf_counter() - wall, time.process_time() - cpu
        assert not store.read("errors"), store.read("errors")[:1]
    await reference.aclose(), await candidate.aclose()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per overhead row")
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--serve", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        return serve_forever(args.serve)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    rows = []
    with Server(0.0) as url:
        for name, layer in (("RequestClient.post", request_layer), ("EndpointBackend.generate", backend_generate)):
            wall, cpu = asyncio.run(layer(url, 64, args.requests))
            per_ms = 1000 * cpu / args.requests
            rows.append((f"client CPU per request, c=64, {name}", f"{per_ms:.3f} ms",
                         f"<= {OVERHEAD_TARGET_MS} ms", per_ms <= OVERHEAD_TARGET_MS,
                         f"{args.requests / wall:.0f} req/s wall"))
    with Server(args.latency_ms) as url:
        serial_n, parallel_n = 40, 32 * 40
        serial_wall, _ = asyncio.run(request_layer(url, 1, serial_n))
        parallel_wall, _ = asyncio.run(request_layer(url, 32, parallel_n))
        ratio = (parallel_n / parallel_wall) / (serial_n / serial_wall)
        rows.append((f"throughput c=32 / c=1, {args.latency_ms:g} ms server, RequestClient", f"{ratio:.1f}x",
                     f">= {SCALING_TARGET:g}x", ratio >= SCALING_TARGET,
                     f"{serial_n / serial_wall:.1f} vs {parallel_n / parallel_wall:.0f} req/s"))
        one_wall, _ = asyncio.run(replay(url, 1, 2))
        many_wall, _ = asyncio.run(replay(url, 32, 64))
        ratio = (64 / many_wall) / (2 / one_wall)
        rows.append((f"throughput c=32 / c=1, {args.latency_ms:g} ms server, Replay scheduler", f"{ratio:.1f}x",
                     f">= {SCALING_TARGET:g}x", ratio >= SCALING_TARGET,
                     f"{2 / one_wall:.2f} vs {64 / many_wall:.1f} scenarios/s"))
    _print_table(rows)


def _print_table(rows) -> None:
    header = ("measurement", "value", "target", "met", "detail")
    table = [header] + [(a, b, c, "yes" if ok else "NO", d) for a, b, c, ok, d in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
        if i == 0:
            print("-+-".join("-" * width for width in widths))


if __name__ == "__main__":
    main()
