"""A live OpenAI-compatible server (vLLM, SGLang, `harness serve`, ...) as a backend.

Two layers:
- `RequestClient`: JSON over HTTP with bounded concurrency, a per-request deadline, retries with
  backoff on 429 (Retry-After honoured), 5xx, timeouts, malformed replies and connection errors,
  and an on-disk response cache keyed by the full request, over `Http11Transport` (`http1.py`). API
  keys come from an environment variable named by the user and are never written anywhere.
- `EndpointBackend`: the `Backend` interface over one server. Generation through
  `/v1/chat/completions` (temperature 0, fixed seed, top-k logprobs); teacher-forced scoring through
  `/v1/completions` with vLLM's `prompt_logprobs` or with `echo` + `logprobs`, whichever the server
  has (detected once per server); token ids from `/tokenize` or a local tokenizer. What a server
  cannot do is reported (`Scores.unavailable`, `describe()["capabilities"]`), never faked.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import os
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.replay import http1
from harness.replay.http1 import Http11Transport, ReplyTooLarge, decode_content
from harness.types import Generation, Message, Scores

ATTENTION_ERROR_UNAVAILABLE = "not available over HTTP"
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
TOKEN_ID_PREFIX = "token_id:"  # vLLM's form for tokens when return_tokens_as_token_ids is set
NOT_FOUND_STATUS = frozenset({404, 405, 501})  # the route is not there
REFUSED_STATUS = frozenset({400, 422})  # the request was refused; a capability only if it names the field
DEFAULT_HEADERS = {"Accept": "*/*", "Accept-Encoding": "gzip, deflate",  # what httpx.AsyncClient sends
                   "User-Agent": f"python-httpx/{httpx.__version__}"}
JSON_BODY = {"Content-Type": "application/json"}
STREAMED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
STREAM_FIELDS = {"stream": True, "stream_options": {"include_usage": True}}  # usage: to check the ids against


class EndpointError(RuntimeError):
    """A request that failed for good. `attempts` lists every attempt's failure, in order. `retry_later`:
    the server may answer another time (retries exhausted, a refusal), so a unit that needed it is failed
    and left to `--resume` rather than stored with holes (harness.replay.runner)."""

    retry_later = True

    def __init__(self, url: str, attempts: list[str], status: int | None = None):
        self.url, self.attempts, self.status = url, attempts, status
        super().__init__(f"{url}: failed after {len(attempts)} attempt(s): " + "; ".join(attempts))


def lacks_capability(error: EndpointError, fields: Sequence[str]) -> bool:
    """Whether a failed request shows the server lacks a feature (and is not a real failure): the
    route is missing, or the request was refused with a message naming one of `fields`."""
    if error.status in NOT_FOUND_STATUS:
        return True
    return error.status in REFUSED_STATUS and any(name in str(error) for name in fields)


class InvalidReply(EndpointError):
    """A reply that arrived but failed validation (too few logprobs, a short /tokenize): never cached,
    never retried (a server that drops a token does so every time); the caller degrades what needs it."""

    retry_later = False  # a server that drops a token does so every time

    def __init__(self, url: str, problem: str, reply: dict):
        super().__init__(url, [f"invalid reply: {problem}"])
        self.problem, self.reply = problem, reply


class _DeadlineReached(Exception):
    """The request's overall deadline (RequestPolicy.deadline_s) left no time for another attempt."""


class _RetryableError(Exception):
    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


# ---------------------------------------------------------------- request layer


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    concurrency: int = 16  # requests in flight at once, per server
    timeout_s: float = 120.0  # whole request, connect to last byte
    retries: int = 4  # further attempts after the first
    backoff_s: float = 0.5  # first retry's wait; doubles per attempt, with jitter
    max_backoff_s: float = 30.0  # cap on any wait, Retry-After included
    retry_after_jitter: float = 0.25  # a Retry-After wait is stretched by up to this fraction, at random
    deadline_s: float = 300.0  # one request, all attempts and waits: a server hanging for good fails in this

    def __post_init__(self) -> None:
        for name, low in (("concurrency", 1), ("retries", 0), ("backoff_s", 0.0), ("max_backoff_s", 0.0),
                          ("retry_after_jitter", 0.0)):
            if getattr(self, name) < low:
                raise ValueError(f"RequestPolicy.{name} must be >= {low}, got {getattr(self, name)!r}")
        for name in ("timeout_s", "deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RequestPolicy.{name} must be > 0, got {getattr(self, name)!r}")


def request_policy(timeout_s: float = 120.0, **fields) -> RequestPolicy:
    """The policy for one attempt's timeout (`--request-timeout`): the overall deadline of a request (all
    attempts and waits) stays 300 s, or grows to 2.5 attempts where one attempt may take longer."""
    return RequestPolicy(timeout_s=timeout_s, deadline_s=max(300.0, 2.5 * timeout_s), **fields)


def request_key(url: str, body: dict) -> str:
    """sha256 of the canonical JSON of the request (URL and body; headers, and so keys, excluded)."""
    canonical = json.dumps({"url": url, "body": body}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class ResponseCache:
    """One JSON file per successful response, `<dir>/<key[:2]>/<key>.json`, written atomically."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def _file(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict | None:
        try:
            return json.loads(self._file(key).read_text())["response"]
        except (OSError, ValueError, KeyError):
            return None  # absent, or a torn/foreign file: ask the server again

    def drop(self, key: str) -> None:
        self._file(key).unlink(missing_ok=True)

    def put(self, key: str, url: str, body: dict, response: dict) -> None:
        target = self._file(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_suffix(f".{os.getpid()}.{id(response)}.tmp")
        scratch.write_text(json.dumps({"url": url, "request": body, "response": response}))
        os.replace(scratch, target)


def api_key_from_env(env_var: str | None) -> str | None:
    if env_var is None:
        return None
    key = os.environ.get(env_var)
    if not key:
        raise ValueError(f"API key environment variable {env_var!r} is not set (keys are read from the "
                         f"environment only)")
    return key


class RequestClient:
    """POST/GET JSON against one server: bounded, deadlined, retried, cached. Failures are kept in
    `failures` (one dict per failed attempt) as well as raised as `EndpointError`."""

    def __init__(self, base_url: str, *, policy: RequestPolicy = RequestPolicy(), api_key_env: str | None = None,
                 cache_dir: str | Path | None = None, transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = normalise_base_url(base_url)
        self.policy = policy
        self.cache = ResponseCache(cache_dir) if cache_dir is not None else None
        self.failures: list[dict] = []
        self.cache_hits = 0
        self.stream_only: str | None = None  # why completions are asked for streamed (the server refused others)
        key = api_key_from_env(api_key_env)
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        self._headers = {"GET": DEFAULT_HEADERS | auth, "POST": DEFAULT_HEADERS | auth | JSON_BODY}
        # One transport for all requests, called directly: httpx.AsyncClient's redirect, auth and
        # cookie handling cost more per request than the wire does, and none is needed (redirects
        # were never followed). The gate bounds the requests in flight.
        self._transport = transport or default_transport(self.base_url)
        self._gate = asyncio.Semaphore(policy.concurrency)
        self._extensions = {"timeout": httpx.Timeout(policy.timeout_s).as_dict()}
        self._urls: dict[str, httpx.URL] = {}  # path -> parsed absolute URL: httpx's parsing costs ~0.3 ms

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """The response read whole, decoded, each up to `http1.MAX_BODY_BYTES` (`ReplyTooLarge` beyond)."""
        response = await self._transport.handle_async_request(request)
        try:
            raw = await _raw_body(response)
        finally:
            await response.aclose()  # hands a pooled connection back (httpx's transport, through a proxy)
        decoded = decode_content(raw, response.headers.get("content-encoding", ""))
        headers = [(name, value) for name, value in response.headers.raw
                   if name.lower() not in (b"content-encoding", b"content-length")]
        return httpx.Response(response.status_code, headers=headers, content=decoded, request=request,
                              extensions=response.extensions)

    def _url(self, path: str) -> httpx.URL:
        if path not in self._urls:
            self._urls[path] = httpx.URL(self.base_url + path)
        return self._urls[path]

    async def post(self, path: str, body: dict, *, cache: bool = True,
                   validate: Callable[[dict], str | None] | None = None, probe: bool = False) -> dict:
        """The decoded reply. `validate` names what is wrong with a reply (or None): an invalid reply
        raises `InvalidReply` and is never cached, so a later `--resume` asks the server again. A `probe`
        (capability detection) refused with 4xx is not a failed attempt: it is what detection asks."""
        url = self.base_url + path
        if self.stream_only and path in STREAMED_ROUTES:
            body = body | STREAM_FIELDS
        key = request_key(url, body) if cache and self.cache else None
        if key and (hit := self.cache.get(key)) is not None and (validate is None or validate(hit) is None):
            self.cache_hits += 1
            return hit
        try:
            response = await self._with_retries("POST", path, body, probe)
        except EndpointError as error:
            if path not in STREAMED_ROUTES or body.get("stream") or not _asks_for_streaming(error):
                raise
            self.stream_only = f"required: the server refused a reply that is not streamed ({error.attempts[-1]})"
            return await self.post(path, body, cache=cache, validate=validate, probe=probe)
        if validate is not None and (problem := validate(response)) is not None:
            raise InvalidReply(f"POST {url}", problem, response)
        if key:
            self.cache.put(key, url, body, response)
        return response

    def forget(self, path: str, body: dict) -> None:
        """Drop the cached reply to this POST: a reply that a later check refused (its ids disagree with its
        text, ...) is never replayed from the cache, so a `--resume` asks the server again."""
        if self.cache is not None:
            for sent in (body, body | STREAM_FIELDS):  # as asked, and as streamed where the server wants that
                self.cache.drop(request_key(self.base_url + path, sent))

    async def get(self, path: str) -> dict:
        return await self._with_retries("GET", path, None)

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def _with_retries(self, method: str, path: str, body: dict | None, probe: bool = False) -> dict:
        attempts: list[str] = []
        deadline: list[float] = []  # set when the first attempt gets its turn: queueing behind the gate is free
        for attempt in range(self.policy.retries + 1):
            try:
                return await self._attempt(method, path, body, deadline)
            except _DeadlineReached:
                attempts.append(f"overall deadline of {self.policy.deadline_s:g} s reached")
                break
            except _RetryableError as error:
                attempts.append(str(error))
                self.failures.append({"url": self.base_url + path, "attempt": attempt, "error": str(error),
                                      "time": time.time()})
                wait = self._wait_s(attempt, error.retry_after_s)
                if attempt < self.policy.retries:
                    if time.monotonic() + wait >= deadline[0]:
                        attempts.append(f"overall deadline of {self.policy.deadline_s:g} s reached")
                        break
                    await asyncio.sleep(wait)
            except EndpointError as error:
                if not (probe and error.status is not None and 400 <= error.status < 500):
                    self.failures.append({"url": self.base_url + path, "attempt": attempt,
                                          "error": "; ".join(error.attempts), "time": time.time()})
                raise EndpointError(error.url, attempts + error.attempts, error.status) from None
        raise EndpointError(f"{method} {self.base_url}{path}", attempts)

    def _wait_s(self, attempt: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:  # never sooner than asked; clients told the same spread out
            return min(retry_after_s, self.policy.max_backoff_s) * random.uniform(
                1.0, 1.0 + self.policy.retry_after_jitter)
        backoff = min(self.policy.backoff_s * 2 ** attempt, self.policy.max_backoff_s)
        return backoff * random.uniform(0.5, 1.0)  # jitter: clients retrying together spread out

    async def _attempt(self, method: str, path: str, body: dict | None, deadline: list[float]) -> dict:
        """One request. `deadline` holds the request's overall deadline once its first attempt started."""
        content = None if body is None else json.dumps(body).encode()
        request = httpx.Request(method, self._url(path), headers=self._headers[method], content=content,
                                extensions=self._extensions)
        budget = self.policy.timeout_s
        try:
            async with self._gate:
                if not deadline:
                    deadline.append(time.monotonic() + self.policy.deadline_s)
                budget = min(self.policy.timeout_s, deadline[0] - time.monotonic())
                if budget <= 0:
                    raise _DeadlineReached
                async with asyncio.timeout(budget):
                    response = await self._send(request)
        except TimeoutError:
            if budget < self.policy.timeout_s:
                raise _DeadlineReached from None
            raise _RetryableError(f"timed out after {self.policy.timeout_s:g} s") from None
        except ReplyTooLarge as error:  # the same reply again would be as large: the request fails, the run goes on
            raise EndpointError(f"{method} {self.base_url}{path}", [str(error)]) from None
        except httpx.DecodingError as error:
            raise _RetryableError(f"reply body not decodable: {error}") from None
        except httpx.TimeoutException as error:
            raise _RetryableError(f"timed out ({type(error).__name__})") from None
        except httpx.TransportError as error:
            raise _RetryableError(f"connection error: {type(error).__name__}: {error}") from None
        return _decode(method, self.base_url + path, response)


async def _raw_body(response: httpx.Response) -> bytes:
    """The body as sent (not yet decoded), up to `http1.MAX_BODY_BYTES`: a transport that streams it (httpx's,
    through a proxy) is stopped there; `Http11Transport` stops there itself."""
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > http1.MAX_BODY_BYTES:
            raise ReplyTooLarge(f"of more than {http1.MAX_BODY_BYTES:,} bytes (streamed)")
    return bytes(body)


def default_transport(base_url: str) -> httpx.AsyncBaseTransport:
    """`Http11Transport`, or httpx's own transport through the proxy that the environment names for
    this URL (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY, as httpx.AsyncClient would use it)."""
    ssl_context = httpx.create_ssl_context() if base_url.startswith("https://") else None  # ~30 ms: https only
    proxies = urllib.request.getproxies_environment()
    url = httpx.URL(base_url)
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy is None or urllib.request.proxy_bypass_environment(url.host, proxies):
        return Http11Transport(ssl_context)
    proxy = proxy if "://" in proxy else f"http://{proxy}"
    return httpx.AsyncHTTPTransport(verify=ssl_context or True, proxy=proxy)


def _asks_for_streaming(error: EndpointError) -> bool:
    """A refusal (400/422) of a request that was not streamed, whose message names streaming."""
    return error.status in REFUSED_STATUS and "stream" in str(error).lower()


def _decode(method: str, url: str, response: httpx.Response) -> dict:
    status = response.status_code
    if status in RETRY_STATUS:
        raise _RetryableError(f"HTTP {status}: {_excerpt(response.text)}", _retry_after_s(response))
    if status >= 400:
        raise EndpointError(f"{method} {url}", [f"HTTP {status}: {_excerpt(response.text)}"], status)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            return assemble_event_stream(response.text)
        except ValueError as error:  # cut short, or a chunk that is not JSON: ask again
            raise _RetryableError(f"HTTP {status} with a broken event stream: {error}") from None
    try:
        decoded = response.json()
    except ValueError:
        raise _RetryableError(f"HTTP {status} with malformed JSON: {_excerpt(response.text)!r}") from None
    if not isinstance(decoded, dict):
        raise _RetryableError(f"HTTP {status} with a JSON {type(decoded).__name__}, not an object")
    return decoded


def assemble_event_stream(text: str) -> dict:
    """A streamed completion (server-sent events of OpenAI chunks, `data: [DONE]` last) as the one reply a
    non-streamed request gets: text and token lists joined in order, the last finish_reason, the usage
    chunk's usage. Raises ValueError for a stream cut short (no [DONE]), a chunk that is not a JSON object,
    or an error event."""
    reply: dict = {}
    choice: dict = {"index": 0}
    done = False
    for event in text.replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:"))
        if not data:
            continue
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"a chunk is a JSON {type(chunk).__name__}, not an object")
        if "error" in chunk:
            raise ValueError(f"error event: {_excerpt(json.dumps(chunk['error']))}")
        _add_chunk(reply, choice, chunk)
    if not done:
        raise ValueError("the stream ended without data: [DONE]")
    return reply | {"choices": [choice] if len(choice) > 1 else []}


def _add_chunk(reply: dict, choice: dict, chunk: dict) -> None:
    for name in ("id", "created", "model", "prompt_token_ids"):
        if chunk.get(name) is not None:
            reply.setdefault(name, chunk[name])
    reply.setdefault("object", str(chunk.get("object", "")).removesuffix(".chunk"))
    if isinstance(chunk.get("usage"), dict):
        reply["usage"] = chunk["usage"]
    for part in chunk.get("choices") or []:
        if not isinstance(part, dict) or part.get("index", 0) != 0:
            continue
        delta = part.get("delta")
        if isinstance(delta, dict):
            message = choice.setdefault("message", {"role": "assistant", "content": ""})
            if not isinstance(delta.get("content") or "", str):
                raise ValueError(f"a chunk's delta content is not text: {_excerpt(json.dumps(delta['content']))}")
            message["content"] += delta.get("content") or ""
        if isinstance(part.get("text"), str):
            choice["text"] = choice.get("text", "") + part["text"]
        _add_logprobs(choice, part.get("logprobs"))
        if isinstance(part.get("token_ids"), list):
            choice["token_ids"] = choice.get("token_ids", []) + part["token_ids"]
        if part.get("prompt_logprobs") is not None:
            choice.setdefault("prompt_logprobs", part["prompt_logprobs"])
        for name in ("finish_reason", "stop_reason"):
            if name in part and (part[name] is not None or name not in choice):
                choice[name] = part[name]


def _add_logprobs(choice: dict, logprobs) -> None:
    """Chat logprobs (`content`: entries) or legacy completion logprobs (parallel lists), appended."""
    if not isinstance(logprobs, dict):
        choice.setdefault("logprobs", None)
        return
    joined = choice.get("logprobs") or {}
    for name, values in logprobs.items():
        if isinstance(values, list):
            joined[name] = joined.get(name, []) + values
    choice["logprobs"] = joined


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _excerpt(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def normalise_base_url(url: str) -> str:
    """`http://h:p`, `http://h:p/`, `http://h:p/v1` all name the same server: `http://h:p`."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"endpoint URL {url!r} must start with http:// or https://")
    if "@" in url.split("://", 1)[1].split("/", 1)[0]:
        raise ValueError("endpoint URL holds credentials; name an environment variable holding the API key "
                         "instead (api_key_env), so no key is written to runs or logs")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# ---------------------------------------------------------------- the backend


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    url: str
    model: str | None = None  # served model name; None: the first listed by /v1/models
    label: str | None = None  # the backend's label in runs; default: the URL
    api_key_env: str | None = None  # name of the environment variable holding the key
    tokenizer: str | None = None  # local tokenizer (directory or name) when the server has no /tokenize
    seed: int = 0
    top_logprobs: int = 5
    policy: RequestPolicy = field(default_factory=RequestPolicy)
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        normalise_base_url(self.url)
        if not 1 <= self.top_logprobs <= 20:
            raise ValueError(f"EndpointConfig.top_logprobs must be in 1..20 (the OpenAI limit), "
                             f"got {self.top_logprobs}")


class PreflightError(RuntimeError):
    """A server that cannot serve the run at all (unreachable, no model, no token ids): found before any
    unit starts, named once (`harness run` exits 2)."""


MODEL_HINT = "harness run: --reference-model, --candidate-model [LABEL=]NAME, --judge-model"
PROBE_CHAT = (Message("user", "Say OK."),)  # the pre-flight's one generation and scoring


class EndpointBackend:
    """`Backend` over one OpenAI-compatible server. Capabilities are detected once, by `preflight()`
    (or on first use), and kept in `capabilities` (name -> the form used, or "unavailable: why"),
    which `describe()` reports."""

    def __init__(self, config: EndpointConfig, client: RequestClient | None = None):
        self.config = config
        self.label = config.label or normalise_base_url(config.url)
        self.client = client or RequestClient(config.url, policy=config.policy, api_key_env=config.api_key_env,
                                              cache_dir=config.cache_dir)
        self._tokenizer = _load_tokenizer(config.tokenizer) if config.tokenizer else None
        self._vocab_by_text: dict[str, int] | None = None
        self._model: str | None = config.model
        self._lock = asyncio.Lock()
        self.capabilities: dict[str, str] = {}
        self.earlier_failed_attempts = 0  # counted by earlier sessions of the same run (--resume)
        self._token_text: dict[int, asyncio.Future[str]] = {}  # token id -> its text, from /detokenize
        self._prompt_counts: dict[str, int] = {}  # chat key -> prompt length the server counted (usage)
        self._prompt_ids: dict[str, list[int]] = {}  # chat key -> prompt ids the server returned (return_token_ids)

    # ------------------------------------------------------------ Backend

    def describe(self) -> dict:
        policy = self.config.policy
        return {"kind": "endpoint", "label": self.label, "url": self.client.base_url, "model": self._model,
                "api_key_env": self.config.api_key_env, "local_tokenizer": self.config.tokenizer,
                "seed": self.config.seed, "top_logprobs": self.config.top_logprobs, "temperature": 0.0,
                "capabilities": dict(self.capabilities) | ({"stream": self.client.stream_only}
                                                           if self.client.stream_only else {}),
                "attention_error": ATTENTION_ERROR_UNAVAILABLE,
                "policy": {"concurrency": policy.concurrency, "timeout_s": policy.timeout_s,
                           "retries": policy.retries, "deadline_s": policy.deadline_s},
                "failed_attempts": self.earlier_failed_attempts + len(self.client.failures),
                "cache_hits": self.client.cache_hits}

    def degraded(self) -> list[str]:
        """One line per capability the server lacks that costs the run a metric."""
        lines = [f"teacher-forced metrics unavailable for {self.label}: {why.removeprefix('unavailable: ')}"
                 for why in (self.capabilities.get("scoring", ""), self.capabilities.get("prompt_ids", ""))
                 if why.startswith("unavailable")]
        if "reply_ids_invalid" in self.capabilities:
            lines.append(f"{self.label}: replies not scored, their token ids disagree with what the server said it "
                         f"produced: {self.capabilities['reply_ids_invalid']}")
        if self.capabilities.get("self_consistency", "").startswith("unavailable"):
            lines.append(f"self-consistency {self.capabilities['self_consistency']}")  # it names the server
        if "chat_reply_invalid" in self.capabilities:
            lines.append(f"{self.label}: reply token ids re-tokenised from the text, the server's failed validation: "
                         f"{self.capabilities['chat_reply_invalid']}")
        return lines

    async def preflight(self) -> None:
        """Ask the server once for everything a run needs: its model, a reply with token ids, a scoring.
        Raises `PreflightError` naming the server and what failed; a missing scoring form is a
        capability (recorded), not a failure."""
        try:
            await self.model()
            generation = await self.generate(PROBE_CHAT, 4)
            if generation.token_ids:
                await self.score(PROBE_CHAT, generation.token_ids)
        except EndpointError as error:
            raise PreflightError(f"{self.label} {self.client.base_url}: {error}") from None

    async def generate(self, messages: Sequence[Message], max_new_tokens: int, *, cache: bool = True) -> Generation:
        """`cache=False`: ask the server again even where the run's response cache holds this request (the
        self-consistency check's second, identical decode: a prefix-cache hit on the server, not on us)."""
        chat = [_message_json(m) for m in messages]
        body = {"model": await self.model(), "messages": chat, "max_tokens": max_new_tokens, "temperature": 0.0,
                "seed": self.config.seed, "n": 1}
        reply, problem, sent = await self._chat_with_best_logprobs(body, cache)
        try:
            return await self._generation(chat, reply, problem)
        except EndpointError:  # a refused reply (InvalidReply included) is not kept: a --resume asks again
            self.client.forget("/v1/chat/completions", sent)
            raise

    async def _generation(self, chat: list[dict], reply: dict, problem: str | None) -> Generation:
        """The reply as a `Generation`, its ids checked against the server's own count and its text."""
        choice = _first_choice(reply, "chat completion")
        usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
        self._note_prompt(_chat_key(chat), prompt_tokens, reply.get("prompt_token_ids", choice.get("prompt_token_ids")))
        message = choice.get("message")
        text = (message.get("content") if isinstance(message, dict) else None) or ""
        if not isinstance(text, str):
            raise EndpointError(f"POST {self.client.base_url}/v1/chat/completions",
                                [f"reply's message content is not text: {_excerpt(json.dumps(text))}"])
        reason = choice.get("finish_reason")
        finish = {"stop": "eos", "length": "length"}.get(reason, str(reason)) if isinstance(reason, (str, type(None))) \
            else _excerpt(json.dumps(reason), 40)
        ids, top, strings = (None, None, None) if problem else self._reply_tokens(choice)
        eos_listed = finish == "eos" and "stop_reason" in choice and choice["stop_reason"] is None
        if ids is None:  # no usable ids in the reply: re-tokenise its text
            ids, top, strings = await self._tokenize_text(text), None, None
            self._check_reply_ids(reply, _retokenised_count_problem(len(ids), usage.get("completion_tokens"), finish))
        elif eos_listed and ids:
            # vLLM lists the end-of-sequence token in a reply that stopped on it (stop_reason null);
            # the in-process backend and `harness serve` leave it out: drop it so identical texts match
            ids, top, strings = ids[:-1], top[:-1] if top else top, strings[:-1] if strings else strings
        self._check_reply_ids(reply, await self._text_problem(ids, text))
        if strings is None:
            strings = await self._display_strings(ids)
        return Generation(ids, text, finish, strings, top, prompt_tokens)

    def _check_reply_ids(self, reply: dict, problem: str | None) -> None:
        """A reply whose ids disagree with what the server says it produced (its usage, its text) is
        never scored: the unit fails naming the problem, and the capability is recorded for the run."""
        if problem is not None:
            self.capabilities["reply_ids_invalid"] = problem
            raise InvalidReply(f"POST {self.client.base_url}/v1/chat/completions", problem, reply)

    async def _text_problem(self, ids: list[int], text: str) -> str | None:
        """Whether the reply's ids decode to its text (the local tokenizer, else the server's /detokenize
        of the whole list); None when they do or when nothing can decode them (recorded as unavailable)."""
        if self._tokenizer is not None:  # servers skip special tokens in the text (vLLM's default), or not
            decoded = self._tokenizer.decode(ids)
            if _text_mismatch(decoded, text, len(ids)) is not None:
                decoded = self._tokenizer.decode(ids, skip_special_tokens=True)
        elif self.capabilities.get("reply_text_check", "").startswith("unavailable"):
            return None
        else:
            try:
                reply = await self.client.post("/detokenize", {"model": await self.model(), "tokens": ids},
                                               validate=_detokenize_problem,
                                               probe="reply_text_check" not in self.capabilities)
            except InvalidReply as error:
                self.capabilities["reply_text_check"] = f"unavailable: {error.problem}"
                return None
            except EndpointError as error:
                if not lacks_capability(error, ("tokens", "detokenize")):  # a failing server: this reply unchecked
                    self.capabilities["reply_text_check"] = f"failed: {error.attempts[-1]} (a reply left unchecked)"
                    return None
                self.capabilities["reply_text_check"] = f"unavailable: /detokenize answered {error.attempts[-1]}"
                return None
            decoded = str(reply["prompt"] if "prompt" in reply else reply["text"])
            self.capabilities["reply_text_check"] = "server /detokenize of the reply's ids"
        return _text_mismatch(decoded, text, len(ids))

    async def score(self, messages: Sequence[Message], continuation_ids: Sequence[int]) -> Scores:
        continuation = [int(t) for t in continuation_ids]
        if not continuation:
            return Scores(logprobs=None, top_logprobs=[])
        prompt = await self.prompt_ids(messages)
        if isinstance(prompt, str):
            self.capabilities.setdefault("prompt_ids", prompt)
            return Scores(logprobs=None, top_logprobs=None, unavailable=prompt)
        ids = prompt + continuation
        mode, reply = await self._scoring_mode(ids)
        if mode.startswith("unavailable"):
            return Scores(logprobs=None, top_logprobs=None, unavailable=mode)
        if reply is None:
            try:
                reply = await self.client.post("/v1/completions", self._scoring_body(mode, ids),
                                               validate=lambda r: _scoring_reply_problem(mode, r, len(ids)))
            except InvalidReply as error:
                return Scores(None, None, unavailable=f"unavailable: the scoring reply failed validation: "
                                                      f"{error.problem}")
        return _scores_from_reply(mode, reply, len(prompt), continuation, self._vocab_map())

    async def aclose(self) -> None:
        await self.client.aclose()

    # ------------------------------------------------------------ model and tokens

    async def model(self) -> str:
        """The served model's name: the configured one, else the only one /v1/models lists."""
        if self._model is None:
            async with self._lock:
                if self._model is None:
                    self._model = await self._listed_model()
        return self._model

    async def _listed_model(self) -> str:
        where = f"GET {self.client.base_url}/v1/models"
        try:
            listed = (await self.client.get("/v1/models")).get("data") or []
        except EndpointError as error:
            answered = error.status is not None or any(a.startswith("HTTP ") for a in error.attempts)
            hint = (f"name the served model instead ({MODEL_HINT})" if answered else
                    f"no HTTP answer from {self.client.base_url}: is the server running, and listening there?")
            raise EndpointError(where, error.attempts + [hint], error.status) from None
        names = [str(m.get("id")) for m in listed if isinstance(m, dict) and m.get("id")]
        if len(names) != 1:
            raise EndpointError(where, [f"{len(names)} models listed ({', '.join(names[:5])}); name the served "
                                        f"model ({MODEL_HINT})"])
        return names[0]

    def _note_prompt(self, key: str, count: int | None, ids) -> None:
        if count is not None:
            self._prompt_counts[key] = count
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids) and count in (None, len(ids)):
            self._prompt_ids[key] = list(ids)

    async def prompt_ids(self, messages: Sequence[Message]) -> list[int] | str:
        """Token ids of the chat-templated prompt (generation prompt added), or why there are none.
        In order: the ids the server returned with a reply to these messages (return_token_ids), its
        /tokenize, the local tokenizer. A /tokenize whose length differs from the prompt length the
        server itself counted for these messages is refused (and not cached)."""
        chat = [_message_json(m) for m in messages]
        key = _chat_key(chat)
        if key in self._prompt_ids:
            return self._prompt_ids[key]
        body = {"model": await self.model(), "messages": chat, "add_generation_prompt": True}
        expected = self._prompt_counts.get(key)
        try:
            ids = await self._server_tokenize("tokenize_chat", body, expected)
        except InvalidReply as error:
            return f"unavailable: /tokenize disagrees with the server's own prompt length: {error.problem}"
        if ids is not None:
            return ids
        if self._tokenizer is not None:
            text = self._tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            ids = list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
            if expected is not None and len(ids) != expected:
                return (f"unavailable: the local tokenizer gives {len(ids)} prompt tokens where the server counted "
                        f"{expected} (a different chat template or tokenizer)")
            return ids
        return ("unavailable: the server has no /tokenize for chat messages, returns no prompt token ids and no "
                "local tokenizer was given (--tokenizer), so the continuation cannot be placed after the prompt")

    async def _tokenize_text(self, text: str) -> list[int]:
        body = {"model": await self.model(), "prompt": text, "add_special_tokens": False}
        ids = await self._server_tokenize("tokenize_text", body, None)
        if ids is not None:
            return ids
        if self._tokenizer is not None:
            return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        raise EndpointError(self.client.base_url, ["the reply carries no token ids, the server has no /tokenize "
                                                   "and no local tokenizer was given (--tokenizer)"])

    async def _server_tokenize(self, capability: str, body: dict, expected: int | None) -> list[int] | None:
        if self.capabilities.get(capability, "").startswith("unavailable"):
            return None
        try:
            reply = await self.client.post("/tokenize", body, validate=lambda r: _tokenize_problem(r, expected),
                                           probe=capability not in self.capabilities)
        except InvalidReply:
            raise
        except EndpointError as error:
            if not lacks_capability(error, ("messages", "tokenize", "prompt")):
                raise
            self.capabilities[capability] = f"unavailable: /tokenize answered {error.attempts[-1]}"
            return None
        self.capabilities[capability] = "server /tokenize"
        return [int(t) for t in reply["tokens"]]

    def _vocab_map(self) -> dict[str, int] | None:
        """Token text -> id from the local tokenizer, for servers that name tokens by text only."""
        if self._tokenizer is None:
            return None
        if self._vocab_by_text is None:
            ids_by_text: dict[str, list[int]] = {}
            for token_id in range(len(self._tokenizer)):
                ids_by_text.setdefault(self._tokenizer.decode([token_id]), []).append(token_id)
            # a text several ids decode to names none of them: those replies fall back to /tokenize
            self._vocab_by_text = {text: ids[0] for text, ids in ids_by_text.items() if len(ids) == 1}
        return self._vocab_by_text

    def _reply_tokens(self, choice: dict) -> tuple[list[int] | None, list[dict[int, float]] | None, list[str] | None]:
        """(ids, per-token top-k, display strings) from a reply: the ids from `token_ids`
        (return_token_ids) or from logprobs that name tokens by id (or by text, with a local tokenizer)."""
        content = (choice.get("logprobs") or {}).get("content") or None
        listed = choice.get("token_ids")
        ids = [int(t) for t in listed] if isinstance(listed, list) and all(isinstance(t, int) for t in listed) \
            else None
        top = None
        if content:
            logprob_ids, top = self._ids_from_logprobs(content)
            ids = ids or logprob_ids
            if top is not None and ids != logprob_ids:
                top = None
        if ids is None:
            return None, None, None
        strings = None
        if content and len(content) == len(ids):
            if not str(content[0].get("token", "")).startswith(TOKEN_ID_PREFIX):
                strings = [str(e.get("token", "")) for e in content]
            elif all(isinstance(e.get("bytes"), list) for e in content):  # vLLM: the token's own bytes, by id
                strings = [bytes(e["bytes"]).decode("utf-8", "replace") for e in content]
        return ids, top, strings

    def _ids_from_logprobs(self, content: list[dict]) -> tuple[list[int] | None, list[dict[int, float]] | None]:
        vocab = self._vocab_map()
        ids = [_token_id(str(entry.get("token", "")), vocab) for entry in content]
        if any(t is None for t in ids):
            return None, None
        top = []
        for token_id, entry in zip(ids, content):
            row = {_token_id(str(alt.get("token", "")), vocab): float(alt["logprob"])
                   for alt in entry.get("top_logprobs") or []}
            row.pop(None, None)
            row[token_id] = float(entry["logprob"])
            top.append(row)
        return ids, top

    async def _display_strings(self, ids: list[int]) -> list[str]:
        """Each token's text for display; a failed /detokenize costs only the display (token_id:N)."""
        try:
            return await self._token_strings(ids)
        except EndpointError as error:
            self.capabilities["detokenize"] = f"failed: {error.attempts[-1]} (tokens shown as {TOKEN_ID_PREFIX}N)"
            return [f"{TOKEN_ID_PREFIX}{t}" for t in ids]

    async def _token_strings(self, ids: list[int]) -> list[str]:
        if self._tokenizer is not None:
            return [self._tokenizer.decode([t]) for t in ids]
        for token_id in set(ids) - self._token_text.keys():  # one request per id, however many ask at once
            self._token_text[token_id] = asyncio.ensure_future(self._detokenize_one(token_id))
        texts = [self._token_text[t] for t in ids]
        try:
            if not all(text.done() for text in texts):
                await asyncio.gather(*set(texts))
            return [text.result() for text in texts]
        except EndpointError:
            self._token_text = {t: task for t, task in self._token_text.items()
                                if not task.done() or (not task.cancelled() and task.exception() is None)}
            raise

    async def _detokenize_one(self, token_id: int) -> str:
        if not self.capabilities.get("detokenize", "").startswith("unavailable"):
            try:
                reply = await self.client.post("/detokenize", {"model": await self.model(), "tokens": [token_id]},
                                               validate=_detokenize_problem,
                                               probe="detokenize" not in self.capabilities)
                self.capabilities["detokenize"] = "server /detokenize"
                return str(reply["prompt"] if "prompt" in reply else reply["text"])  # vLLM | SGLang
            except InvalidReply:
                raise
            except EndpointError as error:
                if not lacks_capability(error, ("tokens", "detokenize")):
                    raise
                self.capabilities["detokenize"] = f"unavailable: /detokenize answered {error.attempts[-1]}"
        return f"{TOKEN_ID_PREFIX}{token_id}"

    # ------------------------------------------------------------ capability detection

    async def _chat_with_best_logprobs(self, body: dict, cache: bool = True) -> tuple[dict, str | None, dict]:
        """A chat completion with the richest token information the server accepts: token ids
        (return_token_ids, and vLLM's return_tokens_as_token_ids in the logprobs), plain top-k
        logprobs, or none. The form that works first is remembered for the server. Returns the reply,
        what failed validation in it (its logprobs or ids are then not to be used) or None, and the body sent."""
        k = self.config.top_logprobs
        forms = [("token ids", {"logprobs": True, "top_logprobs": k, "return_tokens_as_token_ids": True,
                                "return_token_ids": True}, ("return_tokens_as_token_ids", "return_token_ids")),
                 ("token text", {"logprobs": True, "top_logprobs": k}, ("logprobs", "top_logprobs")),
                 ("none", {}, ())]
        chosen = self.capabilities.get("chat_logprobs")
        for name, extra, fields in forms:
            if chosen is not None and name != chosen:
                continue
            try:
                reply = await self.client.post("/v1/chat/completions", body | extra, validate=_chat_reply_problem,
                                               probe=chosen is None and bool(fields), cache=cache)
            except InvalidReply as error:
                self.capabilities.setdefault("chat_logprobs", name)
                self.capabilities["chat_reply_invalid"] = error.problem
                return error.reply, error.problem, body | extra
            except EndpointError as error:
                if chosen is not None or not fields or not lacks_capability(error, fields):
                    raise
                continue
            self.capabilities["chat_logprobs"] = name
            return reply, None, body | extra
        raise AssertionError("unreachable: the last form returns or raises")

    async def _scoring_mode(self, ids: list[int]) -> tuple[str, dict | None]:
        """The scoring form for this server, and the detection reply when this call detected it."""
        if "scoring" in self.capabilities:
            return self.capabilities["scoring"], None
        async with self._lock:
            if "scoring" in self.capabilities:
                return self.capabilities["scoring"], None
            mode, reply = await self._detect_scoring(ids)
            self.capabilities["scoring"] = mode
            return mode, reply

    async def _detect_scoring(self, ids: list[int]) -> tuple[str, dict | None]:
        """Each form in turn; a refusal (4xx) or a reply without the logprobs asked for rules a form out,
        with its reason. Forms: vLLM's prompt_logprobs; echo + logprobs with tokens named by id; echo +
        logprobs with tokens named by text (needs a local tokenizer to map them)."""
        reasons = []
        for mode in ("prompt_logprobs", "echo", "echo_text"):
            if mode == "echo_text" and self._vocab_map() is None:
                reasons.append("echo_text: no local tokenizer to map token texts to ids")
                continue
            try:
                reply = await self.client.post("/v1/completions", self._scoring_body(mode, ids), probe=True,
                                               validate=lambda r, m=mode: _scoring_reply_problem(m, r, len(ids)))
            except InvalidReply as error:
                reasons.append(f"{mode}: {error.problem}")
                continue
            except EndpointError as error:
                if error.status is None or not 400 <= error.status < 500:
                    raise
                reasons.append(f"{mode}: {error.attempts[-1]}")
                continue
            return mode, reply
        return ("unavailable: teacher-forced scoring needs /v1/completions with prompt_logprobs or echo+logprobs ("
                + "; ".join(reasons) + ")"), None

    def _scoring_body(self, mode: str, ids: list[int]) -> dict:
        body = {"model": self._model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "seed": self.config.seed}
        if mode == "prompt_logprobs":
            return body | {"prompt_logprobs": self.config.top_logprobs}
        if mode == "echo_text":
            return body | {"echo": True, "logprobs": self.config.top_logprobs}
        return body | {"echo": True, "logprobs": self.config.top_logprobs, "return_tokens_as_token_ids": True}


# ---------------------------------------------------------------- reply validation


def _chat_key(chat: list[dict]) -> str:
    return hashlib.sha256(json.dumps(chat, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _chat_reply_problem(reply: dict) -> str | None:
    """What makes a chat reply's token information unusable: logprobs or token ids that do not cover
    the reply as the server itself counted it (usage.completion_tokens)."""
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return f"reply has no choices: {_excerpt(json.dumps(reply))}"
    if (shape := _token_info_shape_problem(choices[0])) is not None:
        return shape
    usage = reply.get("usage")
    count = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(count, int):
        return None
    content = (choices[0].get("logprobs") or {}).get("content")
    if isinstance(content, list) and content and len(content) != count:
        return f"the logprobs list {len(content)} tokens where usage.completion_tokens is {count}"
    ids = choices[0].get("token_ids")
    if isinstance(ids, list) and len(ids) != count:
        return f"token_ids lists {len(ids)} tokens where usage.completion_tokens is {count}"
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_token_entry(entry) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("token"), str) and _is_number(entry.get("logprob"))


def _token_info_shape_problem(choice: dict) -> str | None:
    """Token ids and logprobs in the shapes the OpenAI API and vLLM give them, or what is not: a
    reply whose token information is malformed is re-tokenised from its text, never parsed."""
    logprobs, ids = choice.get("logprobs"), choice.get("token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in ids)):
        return "token_ids is not a list of integers"
    if logprobs is None:
        return None
    content = logprobs.get("content") if isinstance(logprobs, dict) else "not an object"
    if content is None:
        return None
    if not isinstance(content, list) or not all(
            _is_token_entry(entry) and (entry.get("top_logprobs") is None or (
                isinstance(entry["top_logprobs"], list) and all(map(_is_token_entry, entry["top_logprobs"]))))
            for entry in content):
        return "logprobs.content is not a list of {token, logprob, top_logprobs} entries"
    if any(entry.get("bytes") is not None and not (isinstance(entry["bytes"], list) and all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in entry["bytes"]))
            for entry in content):
        return "a logprobs entry's bytes are not a list of byte values"
    return None


def _retokenised_count_problem(count: int, completion_tokens, finish: str) -> str | None:
    """Re-tokenised reply text against the server's own count (usage.completion_tokens): equal, or one
    fewer where the reply stopped on end-of-sequence, a token servers count and the text leaves out (vLLM,
    `transformers serve` and `harness serve` all count it). A /tokenize one short on such a reply is
    caught by decoding the ids back to the text (`_text_mismatch`) where the server has /detokenize."""
    if not isinstance(completion_tokens, int) or isinstance(completion_tokens, bool):
        return None
    allowed = {completion_tokens, completion_tokens - 1} if finish == "eos" else {completion_tokens}
    if count in allowed:
        return None
    return (f"the reply text re-tokenises to {count} tokens where usage.completion_tokens is {completion_tokens} "
            f"(finish_reason {finish}): /tokenize disagrees with the server's own count")


def _text_mismatch(decoded: str, text: str, count: int) -> str | None:
    """The reply's ids decode to its text. Whitespace is not compared (a tokenizer's clean-up of spaces
    before punctuation differs between batch and incremental detokenisation); anything else is."""
    if decoded == text or "".join(decoded.split()) == "".join(text.split()):
        return None
    return (f"the reply's {count} token ids decode to {_excerpt(decoded, 80)!r} but its text is "
            f"{_excerpt(text, 80)!r}: the server's detokenisation disagrees with its ids")


def _tokenize_problem(reply: dict, expected: int | None) -> str | None:
    tokens = reply.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        return "/tokenize reply has no list of token ids ('tokens')"
    if expected is not None and len(tokens) != expected:
        return (f"/tokenize gave {len(tokens)} tokens for a prompt the server counted as {expected} "
                f"(usage.prompt_tokens)")
    return None


def _detokenize_problem(reply: dict) -> str | None:
    return None if isinstance(reply.get("prompt", reply.get("text")), str) else \
        "/detokenize reply has neither 'prompt' (vLLM) nor 'text' (SGLang)"


# ---------------------------------------------------------------- reply parsing



def _message_json(message: Message) -> dict:
    return {"role": message.role, "content": message.content}


def _first_choice(reply: dict, what: str) -> dict:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EndpointError(what, [f"reply has no choices: {_excerpt(json.dumps(reply))}"])
    return choices[0]


def _token_id(token: str, vocab: dict[str, int] | None) -> int | None:
    if token.startswith(TOKEN_ID_PREFIX):
        try:
            return int(token[len(TOKEN_ID_PREFIX):])
        except ValueError:
            return None
    return vocab.get(token) if vocab is not None else None


def _scoring_reply_problem(mode: str, reply: dict, num_ids: int) -> str | None:
    choices = reply.get("choices") or [{}]
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        return "reply has no choices"
    if mode == "prompt_logprobs":
        rows = choices[0].get("prompt_logprobs")
        if not isinstance(rows, list):
            return "reply has no prompt_logprobs"
        if not all(row is None or isinstance(row, dict) and all(
                key.isdigit() and (_is_number(v) or isinstance(v, dict) and _is_number(v.get("logprob")))
                for key, v in row.items()) for row in rows):
            return "prompt_logprobs rows are not {token id: {logprob}} objects"
        return None if len(rows) == num_ids else f"prompt_logprobs has {len(rows)} rows for {num_ids} prompt tokens"
    logprobs = choices[0].get("logprobs") or {}
    if not isinstance(logprobs, dict):
        return "echo reply's logprobs is not an object"
    rows, tokens, own = logprobs.get("top_logprobs"), logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(rows, list) or not isinstance(tokens, list) or not isinstance(own, list) or not own:
        return "echo reply has no per-prompt-token logprobs"
    if not (all(isinstance(t, str) for t in tokens) and all(v is None or _is_number(v) for v in own)
            and all(row is None or isinstance(row, dict) and all(map(_is_number, row.values())) for row in rows)):
        return "echo reply's logprobs are not lists of tokens, numbers and {token: logprob} rows"
    if len(rows) < num_ids or len(tokens) < num_ids:
        return f"echo reply lists {min(len(rows), len(tokens))} tokens for {num_ids} prompt tokens"
    return None


def _scores_from_reply(mode: str, reply: dict, prompt_len: int, continuation: list[int],
                       vocab: dict[str, int] | None) -> Scores:
    """Per continuation position: the server's top-k logprobs plus the continuation token's own."""
    choice = _first_choice(reply, "completion (scoring)")
    span = slice(prompt_len, prompt_len + len(continuation))
    top = (_prompt_logprobs_rows(choice, span) if mode == "prompt_logprobs"
           else _echo_rows(choice, span, vocab, continuation))
    if isinstance(top, str):
        return Scores(None, None, unavailable=top)
    if len(top) != len(continuation) or any(t not in row for t, row in zip(continuation, top)):
        return Scores(None, None,
                      unavailable="unavailable: the server's logprobs do not cover every continuation token")
    return Scores(logprobs=None, top_logprobs=top)


def _prompt_logprobs_rows(choice: dict, span: slice) -> list[dict[int, float]]:
    """vLLM's prompt_logprobs: per prompt position {"<id>": {"logprob": ...}}, the prompt token included."""
    return [{int(k): float(v["logprob"] if isinstance(v, dict) else v) for k, v in (row or {}).items()}
            for row in (choice.get("prompt_logprobs") or [])[span]]


def _echo_rows(choice: dict, span: slice, vocab: dict[str, int] | None,
               continuation: list[int]) -> list[dict[int, float]] | str:
    """echo + logprobs: the echoed tokens, their own logprobs and per-position top-k dicts."""
    logprobs = choice.get("logprobs") or {}
    tokens = [_token_id(t, vocab) for t in (logprobs.get("tokens") or [])[span]]
    if None in tokens:
        return "unavailable: the server names echoed tokens by text and no local tokenizer maps them to ids"
    if tokens != continuation:
        return "unavailable: the echoed tokens differ from the continuation (the server re-tokenised the prompt)"
    rows = []
    for token_id, own, top in zip(tokens, (logprobs.get("token_logprobs") or [])[span],
                                  (logprobs.get("top_logprobs") or [])[span]):
        row = {_token_id(k, vocab): float(v) for k, v in (top or {}).items()}
        row.pop(None, None)
        rows.append(row | {token_id: float(own)})
    return rows


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


# ---------------------------------------------------------------- entry point for the CLI


def open_endpoint(url: str, *, label: str | None = None, model: str | None = None, api_key_env: str | None = None,
                  tokenizer: str | None = None, cache_dir: str | Path | None = None, seed: int = 0,
                  top_logprobs: int = 5, concurrency: int = 16, timeout_s: float = 120.0,
                  retries: int = 4) -> EndpointBackend:
    """The backend `harness run --reference URL --candidate URL` uses for each URL."""
    policy = request_policy(timeout_s, concurrency=concurrency, retries=retries)
    config = EndpointConfig(url=url, model=model, label=label, api_key_env=api_key_env, tokenizer=tokenizer,
                            seed=seed, top_logprobs=top_logprobs, policy=policy,
                            cache_dir=None if cache_dir is None else str(cache_dir))
    return EndpointBackend(config)
