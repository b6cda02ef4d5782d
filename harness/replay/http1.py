"""A lean HTTP/1.1 transport for httpx on asyncio streams: the wire under `RequestClient`.

httpx's default transport (httpcore over anyio, h11 for parsing) costs about 0.6 ms of Python work
per request on a 2-core machine: cancel scopes and sniffio look-ups around every read and write,
h11's event machinery, pool bookkeeping, and headers and body sent in two system calls. A replay
against a local server is bound by that client CPU. This transport implements httpx's one-method
transport interface with one write per request (head and body together), the status line and headers
read with one `readuntil`, and the body framed by Content-Length, chunks or connection close
(RFC 9112 section 6.3), refused once it is over `MAX_BODY_BYTES` (`ReplyTooLarge`, before it is read when its
Content-Length says so). Content decoding (gzip) stays httpx's, in `Response`; `decode_content` is the bounded
decoding `RequestClient` reads a reply with.

Deadlines are the caller's (`RequestClient` wraps each request in `asyncio.timeout`). A request that
fails or is cancelled closes its connection; only a connection whose response was read whole is kept
for the next request. Failures are raised as httpx's transport errors, as httpcore raises them.
"""

from __future__ import annotations

import asyncio
import select
import ssl
import time
import zlib

import httpx

NO_BODY_STATUS = frozenset({204, 304})
MAX_HEADER_BYTES = 64 * 1024  # the stream's buffer limit: a longer status line + headers is refused
KEEPALIVE_EXPIRY_S = 4.0  # idle connections older than this are not reused (uvicorn closes them at 5 s)
# A reply body, raw or decoded: 256 MiB, ~30x the largest reply we measured (32k-token prompt logprobs, top 20)
MAX_BODY_BYTES = 256 << 20
READ_BYTES = 1 << 16  # one read of a body that ends at close


class ReplyTooLarge(httpx.TransportError):
    """A reply whose body (as sent, or decoded) is over `MAX_BODY_BYTES`: the request fails, never retried."""

    def __init__(self, what: str):
        super().__init__(f"reply body {what} is over the limit of {MAX_BODY_BYTES:,} bytes")


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.idle_since = time.monotonic()

    def is_reusable(self, now: float) -> bool:
        """False once idle too long, or once the server has closed its side (or sent anything unasked)
        while idle. The socket itself is polled: the event loop may not have read its EOF yet."""
        if now - self.idle_since > KEEPALIVE_EXPIRY_S or self.writer.is_closing() or self.reader.at_eof():
            return False
        poller = select.poll()
        poller.register(self.writer.get_extra_info("socket").fileno(), select.POLLIN)
        return not poller.poll(0) and not self.reader._buffer  # _buffer: bytes read, not asked for

    def close(self) -> None:
        self.writer.close()


class Http11Transport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 connections, opened on demand; idle ones are kept in a stack, so the warmest
    is reused first. Requests in flight at once each hold their own connection (callers bound them)."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None):
        self._ssl_context = ssl_context  # made on the first https connection when not given
        self._idle: list[_Connection] = []
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        head = _request_head(request, body)
        connection = await self._connection(request.url)
        try:
            connection.writer.write(head + body)
            status, reason, headers, content, reusable = await _read_response(connection.reader, request.method)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as error:
            connection.close()
            raise _transport_error(error) from None
        except BaseException:  # cancelled (the caller's deadline): the response was not read whole
            connection.close()
            raise
        if reusable and not self._closed and request.headers.get("connection", "").lower() != "close":
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(content),
                              extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason})

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    async def _connection(self, url: httpx.URL) -> _Connection:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.is_reusable(now):
                return connection
            connection.close()
        secure = url.scheme == "https"
        if secure and self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context()
        try:
            reader, writer = await asyncio.open_connection(  # asyncio sets TCP_NODELAY on TCP sockets
                url.host, url.port or (443 if secure else 80), ssl=self._ssl_context if secure else None,
                server_hostname=url.host if secure else None, limit=MAX_HEADER_BYTES)
        except OSError as error:  # refused, unreachable, name not resolved, TLS handshake failed
            raise httpx.ConnectError(f"{type(error).__name__}: {error}") from None
        return _Connection(reader, writer)


def _request_head(request: httpx.Request, body: bytes) -> bytes:
    """Request line and headers; the body's length is stated, since it is sent whole, never chunked."""
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    for name, value in request.headers.raw:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            continue
        if b"\r" in value or b"\n" in value:
            raise httpx.LocalProtocolError(f"header {name.decode(errors='replace')!r} holds a line break")
        lines.append(name + b": " + value)
    if body or request.method in ("POST", "PUT", "PATCH"):
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _read_response(reader: asyncio.StreamReader,
                         method: str) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes, bool]:
    """(status, reason, headers, body, whether the connection can carry another request)."""
    status, reason, version, headers = _parse_head(await reader.readuntil(b"\r\n\r\n"))
    while 100 <= status < 200:  # interim responses (103 Early Hints) come before the final one
        status, reason, version, headers = _parse_head(await reader.readuntil(b"\r\n\r\n"))
    fields = {name.lower(): value for name, value in headers}
    connection = fields.get(b"connection", b"").lower()
    keep_alive = b"close" not in connection and (version == b"HTTP/1.1" or b"keep-alive" in connection)
    if method == "HEAD" or status in NO_BODY_STATUS:
        return status, reason, headers, b"", keep_alive
    if b"transfer-encoding" in fields:
        if fields[b"transfer-encoding"].lower().rsplit(b",", 1)[-1].strip() != b"chunked":
            return status, reason, headers, await _read_until_close(reader), False
        return status, reason, headers, await _read_chunked(reader), keep_alive
    if b"content-length" in fields:
        length = int(fields[b"content-length"])
        if length < 0:
            raise ValueError(f"negative Content-Length {length}")
        if length > MAX_BODY_BYTES:
            raise ReplyTooLarge(f"of {length:,} bytes (its Content-Length)")
        return status, reason, headers, await reader.readexactly(length), keep_alive
    return status, reason, headers, await _read_until_close(reader), False


async def _read_until_close(reader: asyncio.StreamReader) -> bytes:
    """A body that ends when the server closes the connection, up to `MAX_BODY_BYTES`."""
    body = bytearray()
    while chunk := await reader.read(READ_BYTES):
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ReplyTooLarge("ending at close")
    return bytes(body)


def _parse_head(head: bytes) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
    status_line, *lines = head[:-4].split(b"\r\n")
    version, status, reason = (status_line.split(b" ", 2) + [b""])[:3]
    if not version.startswith(b"HTTP/1.") or len(status) != 3 or not status.isdigit():
        raise ValueError(f"malformed status line {status_line[:80]!r}")
    headers = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise ValueError(f"malformed header line {line[:80]!r}")
        headers.append((name, value.strip()))
    return int(status), reason, version, headers


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks, total = [], 0
    while size := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
        total += size
        if total > MAX_BODY_BYTES:
            raise ReplyTooLarge(f"of more than {total - size:,} bytes in chunks")
        chunks.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, ignored
        pass
    return b"".join(chunks)


def decode_content(body: bytes, content_encoding: str) -> bytes:
    """`body` decoded as its Content-Encoding says (gzip, deflate, identity; as `DEFAULT_HEADERS` accept), up to
    `MAX_BODY_BYTES`: a reply that inflates beyond it (a few kB of gzip can hold gigabytes) is `ReplyTooLarge`."""
    for coding in reversed([c.strip().lower() for c in content_encoding.split(",") if c.strip()]):
        if coding == "identity":
            continue
        if coding not in ("gzip", "x-gzip", "deflate"):
            raise httpx.DecodingError(f"Content-Encoding {coding!r} is not one the request accepted")
        body = _inflate(body, zlib.MAX_WBITS | 16 if coding != "deflate" else zlib.MAX_WBITS)
    return body


def _inflate(body: bytes, wbits: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    try:
        decoded = inflater.decompress(body, MAX_BODY_BYTES + 1)
    except zlib.error as error:
        if wbits != zlib.MAX_WBITS:
            raise httpx.DecodingError(f"gzip body: {error}") from None
        return _inflate(body, -zlib.MAX_WBITS)  # "deflate" sent raw, without its zlib header (as httpx accepts)
    if len(decoded) > MAX_BODY_BYTES:
        raise ReplyTooLarge(f"decoded from {len(body):,} bytes")
    return decoded


def _transport_error(error: BaseException) -> httpx.TransportError:
    if isinstance(error, asyncio.IncompleteReadError):
        return httpx.RemoteProtocolError("server disconnected without sending a complete response")
    if isinstance(error, (asyncio.LimitOverrunError, ValueError)):
        return httpx.RemoteProtocolError(f"malformed response: {error}")
    return httpx.ReadError(f"{type(error).__name__}: {error}")
