"""`Http11Transport` against a scripted raw-socket server on loopback: each way RFC 9112 frames a
body, keep-alive reuse and its limits, servers that hang up or answer garbage, and the choice of
transport when the environment names a proxy."""

from __future__ import annotations

import asyncio
import gzip

import httpx
import pytest

from harness.replay import http1
from harness.replay.endpoint import EndpointError, RequestClient, RequestPolicy, default_transport
from harness.replay.http1 import Http11Transport


class Closing(bytes):
    """A reply after which the scripted server closes the connection."""


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'
HANG_UP = Closing(b"")  # the connection closed without an answer


class ScriptedServer:
    """Answers each request with the next raw reply of `replies` (`OK` once they run out), closing the
    connection after a `Closing` reply, or after every reply with `close_after_reply`; the connection
    stays open otherwise, whatever the reply says. Records each request's head and body, and counts
    the connections accepted."""

    def __init__(self, replies: list[bytes] = (), close_after_reply: bool = False):
        self.replies, self.close_after_reply = list(replies), close_after_reply
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:")]
                self.requests.append((head, await reader.readexactly(length[0] if length else 0)))
                reply = self.replies.pop(0) if self.replies else OK
                writer.write(reply)
                await writer.drain()
                if self.close_after_reply or isinstance(reply, Closing):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


async def send(transport: Http11Transport, url: str, method: str = "GET", body: bytes | None = None):
    response = await transport.handle_async_request(httpx.Request(method, url + "/v1/x", content=body))
    await response.aread()
    return response


def requests_in_a_row(server: ScriptedServer, calls: int, method: str = "GET", body: bytes | None = None) -> list:
    """Bodies (or the errors raised) of `calls` requests in a row through one transport."""
    async def run():
        transport, results = Http11Transport(), []
        async with server as url:
            for _ in range(calls):
                try:
                    results.append((await send(transport, url, method, body)).content)
                except httpx.TransportError as error:
                    results.append(error)
                await asyncio.sleep(0.02)  # lets a hang-up reach the client before the next request
            await transport.aclose()
        return results

    return asyncio.run(run())


def test_each_body_framing():
    big = bytes(range(256)) * (12 << 10)  # 3 MiB: many times the stream's buffer limit
    packed = gzip.compress(b'{"a": 1}')
    server = ScriptedServer([
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nabcd\r\nA\r\nefghijklmn\r\n0\r\n"
        b"Trailer-Field: t\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(packed), packed),
        Closing(b"HTTP/1.1 200 OK\r\n\r\nthe body ends at close")])
    assert requests_in_a_row(server, 6) == [big, b"abcdefghijklmn", b"", b'{"a": 1}', b"the body ends at close",
                                            b'{"ok": true}']
    assert server.connections == 2  # only the close-delimited body ended a connection


def test_keep_alive_sends_head_and_body_on_one_connection():
    server = ScriptedServer()
    assert requests_in_a_row(server, 4, "POST", b'{"x": 1}') == [b'{"ok": true}'] * 4
    assert server.connections == 1
    head, body = server.requests[0]
    assert head.startswith(b"POST /v1/x HTTP/1.1\r\n") and b"content-length: 8\r\n" in head.lower()
    assert body == b'{"x": 1}' and all(request == server.requests[0] for request in server.requests)


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi",
    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi",  # HTTP/1.0 without keep-alive
])
def test_connection_ended_by_the_reply_is_not_reused(reply):
    server = ScriptedServer([reply, reply])
    assert requests_in_a_row(server, 3) == [b"hi", b"hi", b'{"ok": true}']
    assert server.connections == 3


def test_idle_connection_the_server_closed_is_replaced_not_failed():
    server = ScriptedServer(close_after_reply=True)  # keep-alive replies, then the server hangs up anyway
    assert requests_in_a_row(server, 3) == [b'{"ok": true}'] * 3
    assert server.connections == 3


def test_idle_connections_expire(monkeypatch):
    monkeypatch.setattr(http1, "KEEPALIVE_EXPIRY_S", 0.0)
    server = ScriptedServer()
    assert requests_in_a_row(server, 3) == [b'{"ok": true}'] * 3
    assert server.connections == 3


@pytest.mark.parametrize("reply, error", [
    (HANG_UP, "server disconnected without sending a complete response"),
    (Closing(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"), "server disconnected"),
    (b"SPDY/3 200 OK\r\n\r\n", "malformed status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed response"),
])
def test_broken_replies_raise_transport_errors_and_the_next_request_reconnects(reply, error):
    server = ScriptedServer([reply])
    failed, recovered = requests_in_a_row(server, 2)
    assert isinstance(failed, httpx.RemoteProtocolError) and error in str(failed)
    assert recovered == b'{"ok": true}' and server.connections == 2


def test_refused_connection_is_a_connect_error():
    async def run():
        async with ScriptedServer() as url:
            pass  # closed again: nothing listens on that port now
        client = RequestClient(url, policy=RequestPolicy(retries=1, backoff_s=0.0))
        with pytest.raises(EndpointError) as raised:
            await client.post("/v1/x", {})
        return raised.value

    error = asyncio.run(run())
    assert len(error.attempts) == 2 and all("connection error: ConnectError" in a for a in error.attempts)


@pytest.mark.parametrize("environment, proxied", [
    ({}, False),
    ({"HTTP_PROXY": "http://proxy.invalid:3128"}, True),
    ({"ALL_PROXY": "proxy.invalid:3128"}, True),
    ({"HTTP_PROXY": "http://proxy.invalid:3128", "NO_PROXY": "example.org"}, False),
    ({"HTTPS_PROXY": "http://proxy.invalid:3128"}, False),  # names a proxy for https URLs only
])
def test_environment_proxies_route_through_httpx(monkeypatch, environment, proxied):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    transport = default_transport("http://example.org:8000")
    assert isinstance(transport, httpx.AsyncHTTPTransport if proxied else Http11Transport)


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 8589934592\r\n\r\n" + b"x" * 4096,  # declares 8 GiB
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"100001\r\n" + b"x" * 0x100001 + b"\r\n",
    Closing(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * (3 << 20)),  # the body ends at close, 3 MiB of it
    b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
    % (len(gzip.compress(b"0" * (3 << 20))), gzip.compress(b"0" * (3 << 20))),  # 3 MiB of JSON in 3 kB
], ids=["content-length", "chunked", "until-close", "gzip"])
def test_a_reply_over_the_size_limit_is_one_clear_error_and_not_retried(reply, monkeypatch):
    """Issue 45: a reply declaring 8 GiB took the run past 3 GB in 10 s. Now a body (raw or decoded) over
    the limit fails its request at once, naming the URL and the limit; nothing is retried."""
    monkeypatch.setattr(http1, "MAX_BODY_BYTES", 1 << 20, raising=False)  # 1 MiB here; the default is far above

    async def run():
        server = ScriptedServer([reply, reply])
        async with server as url:
            client = RequestClient(url, policy=RequestPolicy(retries=2, backoff_s=0.0))
            try:
                with pytest.raises(EndpointError) as raised:
                    await asyncio.wait_for(client.post("/v1/completions", {"prompt": "x"}), 10)
            finally:
                await client.aclose()
        return raised.value, len(server.requests)

    error, requests = asyncio.run(run())
    assert requests == 1
    assert "POST http://127.0.0.1" in str(error) and "/v1/completions" in str(error) and "over the limit of 1,048,576 bytes" in str(error), str(error)
