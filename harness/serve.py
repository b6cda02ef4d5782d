"""`harness serve`: an OpenAI-compatible HTTP server over the in-process backend (one model, one KV path).

Routes: /v1/chat/completions (with logprobs), /v1/completions (prompt as text or token ids; echo,
logprobs, vLLM's prompt_logprobs and return_tokens_as_token_ids), /v1/models, /tokenize, /detokenize,
/health. Decoding is greedy only (temperature 0); n > 1 is refused with a 400. `stream: true` answers
with server-sent events in OpenAI's chunk format (`chat.completion.chunk` / `text_completion` chunks, one
per token, logprobs per chunk where asked, a usage chunk with `stream_options.include_usage`, then
`data: [DONE]`); the reply is decoded whole first, so its chunks carry exactly the non-streamed reply.

Generation goes token by token through the path's cache exactly as `InProcessBackend.generate_sync`
does, so a chat reply over HTTP has the same token ids as in-process. Teacher-forced scoring of a
completion prompt prefills the whole prompt in one chunk, as an engine does (a `raw_prefill` path
therefore attends to the prompt's raw K/V there, where in-process scoring feeds the continuation as
decode steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from harness import model_layers
from harness.forward_context import forward_context
from harness.kv_paths.cache import cache_kwargs
from harness.types import Message

MAX_TOP_LOGPROBS = 20  # the OpenAI API's limit
DEFAULT_MAX_TOKENS = 256
TOKEN_ID_PREFIX = "token_id:"
# A request body larger than this is refused (413) before it is read whole: a full 4096-token context is
# at most ~40 KB of JSON at 10 bytes per token (escapes included); 100x that leaves room for long chats
# while a 10 MB body (which took 100 s and 4.4 GB before this limit) is refused at once.
MAX_BODY_BYTES = 4 * 1024 * 1024


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # highest first
    rank: int  # 1 = the most likely token (vLLM's convention)


class ServedModel:
    """An in-process backend at token-id level: greedy decoding and prompt scoring, one call at a time."""

    def __init__(self, backend, name: str):
        self.backend, self.name = backend, name
        self.model, self.tokenizer = backend.owner.model, backend.owner.tokenizer
        self.device = backend.owner.device
        self.max_model_len = int(model_layers.field(self.model.config, "max_position_embeddings", 4096) or 4096)
        self._lock = threading.Lock()  # one forward at a time: the model and its observers are shared

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        return list(self.backend.owner.encode_chat(messages))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, top_k: int,
               client_gone: threading.Event | None = None) -> tuple[list[StepLogprobs], str]:
        """The backend's own greedy decoding (`InProcessBackend.greedy_ids`), with each step's logprobs. As
        vLLM: a reply that stopped on end-of-sequence lists that token too (its text leaves it out). Once
        `client_gone` is set, the next step raises `ClientGone`: nobody is left to read the reply."""
        steps: list[StepLogprobs] = []

        def record(logits: torch.Tensor, next_id: int) -> None:
            if client_gone is not None and client_gone.is_set():
                raise ClientGone(f"client left after {len(steps)} of {max_new_tokens} tokens")
            steps.append(_step(torch.log_softmax(logits.float(), dim=-1), next_id, top_k))

        with self._lock:
            _, finish_reason, _ = self.backend.greedy_ids(prompt_ids, max_new_tokens, on_step=record)
        return steps, {"eos": "stop"}.get(finish_reason, finish_reason)

    @torch.inference_mode()
    def prompt_logprobs(self, ids: list[int], top_k: int) -> list[StepLogprobs]:
        """log p(ids[i] | ids[:i]) for i = 1..len(ids)-1, from one prefill of the whole prompt."""
        if len(ids) < 2:
            return []
        cache = self.backend.new_cache()
        with self._lock:
            # the path's attention-side options (fp8_q / fp8_p, faults, k_scale_on_scores) come from the forward
            # context's cache: without it the prefill was the reference's attention over the path's cache (issue 45)
            with forward_context(cache=cache):
                logits = self.model(input_ids=torch.tensor([ids], device=self.device),
                                    **cache_kwargs(self.model, cache), use_cache=True).logits[0, :-1]
        rows = torch.log_softmax(logits.float(), dim=-1)  # [N-1, V]
        return [_step(rows[i], ids[i + 1], top_k) for i in range(len(ids) - 1)]


class ClientGone(Exception):
    """The request's client disconnected: its generation is stopped, not finished for nobody."""


DISCONNECT_POLL_S = 0.05  # how often a generating request checks that its client is still there


async def _greedy_while_connected(request: Request, served: "ServedModel", prompt: list[int], max_new: int,
                                  top_k: int) -> tuple[list["StepLogprobs"], str]:
    """`served.greedy` in a worker thread, stopped at its next step once the client has disconnected (the
    model is shared under one lock: a generation for a client that left delays every later request)."""
    gone = threading.Event()

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        gone.set()

    watcher = asyncio.create_task(watch())
    try:
        return await run_in_threadpool(served.greedy, prompt, max_new, top_k, gone)
    finally:
        watcher.cancel()


def _step(row: torch.Tensor, token_id: int, top_k: int) -> StepLogprobs:
    values, indices = torch.topk(row, top_k) if top_k else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
    own = float(row[token_id])
    return StepLogprobs(token_id, own, list(zip(indices.tolist(), values.tolist())), int((row > own).sum()) + 1)


# ---------------------------------------------------------------- request parsing


def _messages(body: dict) -> list[Message]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(raw):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str) or message.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}] needs role system|user|assistant and text content", "messages")
        out.append(Message(message["role"], content))
    return out


def _check_common(body: dict) -> None:
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise BadRequest(f"stream must be true or false, got {body['stream']!r}", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise BadRequest("stream_options must be an object with a boolean include_usage", "stream_options")
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    if (body.get("temperature") or 0) != 0:
        raise BadRequest("harness serve decodes greedily only; temperature must be 0", "temperature")


def _max_tokens(body: dict, prompt_len: int, limit: int, default: int) -> int:
    """The reply's token budget. As vLLM: a prompt that fills the context, or a max_tokens beyond what
    the context leaves, is a 400 naming both numbers; without max_tokens, the default within the context."""
    if prompt_len >= limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                         f"{prompt_len} input tokens.", "messages" if "messages" in body else "prompt")
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return min(default, limit - prompt_len)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"max_tokens must be a non-negative integer, got {value!r}", "max_tokens")
    if prompt_len + value > limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                         f"{prompt_len + value} tokens ({prompt_len} in the prompt, {value} for the completion).",
                         "max_tokens")
    return value


def _check_model(served: "ServedModel", body: dict) -> None:
    name = body.get("model")
    if name is not None and name != served.name:
        raise BadRequest(f"The model `{name}` does not exist. Served: {served.name}.", "model", status=404)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them", "stop")
    return stop


def _apply_stop(served: "ServedModel", steps: list["StepLogprobs"], finish: str,
                stop: list[str]) -> tuple[list["StepLogprobs"], str, str, str | None]:
    """(steps, text, finish_reason, stop_reason) after the first stop string, as vLLM cuts: the text ends
    before the stop string; the tokens end with the one that completed it."""
    eos = finish == "stop" and steps and steps[-1].token_id == served.tokenizer.eos_token_id
    shown = steps[:-1] if eos else steps
    text = served.tokenizer.decode([s.token_id for s in shown])
    for n in range(1, len(shown) + 1 if stop else 0):
        partial = served.tokenizer.decode([s.token_id for s in shown[:n]])
        hits = [(partial.find(s), s) for s in stop if s in partial]
        if hits:
            at, which = min(hits)
            return shown[:n], partial[:at], "stop", which
    return steps, text, finish, None


def _top_k(value, name: str) -> int:
    if value is None or value is False:
        return 0
    if value is True:
        return 0
    if not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{name} must be an integer in 0..{MAX_TOP_LOGPROBS}, got {value!r}", name)
    return value


def _known_ids(served: "ServedModel", tokens, param: str) -> list[int]:
    vocab = int(model_layers.field(served.model.config, "vocab_size"))
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest(f"'{param}' must be a list of token ids", param)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"{param} token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param)
    return tokens


def _prompt_ids(served: ServedModel, prompt) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return list(served.tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        vocab = int(model_layers.field(served.model.config, "vocab_size"))
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
        return list(prompt)
    raise BadRequest("prompt must be a string or a non-empty list of token ids (batches are not supported)", "prompt")


# ---------------------------------------------------------------- response building


def _token_name(served: ServedModel, token_id: int, as_ids: bool) -> str:
    return f"{TOKEN_ID_PREFIX}{token_id}" if as_ids else served.token_text(token_id)


def _chat_logprobs(served: ServedModel, steps: list[StepLogprobs], as_ids: bool) -> dict:
    def entry(token_id: int, logprob: float) -> dict:  # bytes: the token's own text, named by id or not (vLLM)
        return {"token": _token_name(served, token_id, as_ids), "logprob": logprob,
                "bytes": list(served.token_text(token_id).encode())}

    return {"content": [entry(s.token_id, s.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in s.top]}
                        for s in steps]}


def _legacy_logprobs(served: ServedModel, first_id: int | None, steps: list[StepLogprobs], as_ids: bool) -> dict:
    """The /v1/completions logprobs object; with echo, the first prompt token has no logprob."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    if first_id is not None:
        tokens.append(_token_name(served, first_id, as_ids))
        token_logprobs.append(None)
        top.append(None)
    for step in steps:
        tokens.append(_token_name(served, step.token_id, as_ids))
        token_logprobs.append(step.logprob)
        row = {_token_name(served, t, as_ids): lp for t, lp in step.top}
        row.setdefault(tokens[-1], step.logprob)
        top.append(row)
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _vllm_prompt_logprobs(served: ServedModel, steps: list[StepLogprobs]) -> list:
    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": served.token_text(token_id)}

    rows: list = [None]
    for step in steps:
        row = {str(t): entry(t, lp, i + 1) for i, (t, lp) in enumerate(step.top)}
        row.setdefault(str(step.token_id), entry(step.token_id, step.logprob, step.rank))
        rows.append(row)
    return rows


def _usage(prompt_len: int, completion_len: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_len,
            "total_tokens": prompt_len + completion_len}


# ---------------------------------------------------------------- routes


def build_app(served: ServedModel) -> Starlette:
    """The ASGI app; `serve` runs it under uvicorn, tests mount it on a loopback port."""

    async def chat_completions(request: Request) -> JSONResponse:
        body = await _json_body(request)
        _check_common(body)
        _check_model(served, body)
        stop = _stop_strings(body)
        prompt = served.encode_chat(_messages(body))
        top_k = _top_k(body.get("top_logprobs"), "top_logprobs") if body.get("logprobs") else 0
        max_new = _max_tokens(body, len(prompt), served.max_model_len, DEFAULT_MAX_TOKENS)
        steps, finish = await _greedy_while_connected(request, served, prompt, max_new, top_k)
        steps, text, finish, stop_reason = _apply_stop(served, steps, finish, stop)
        ids = [s.token_id for s in steps]  # the end-of-sequence token included, as vLLM lists it
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": _chat_logprobs(served, steps, bool(body.get("return_tokens_as_token_ids")))
                  if body.get("logprobs") else None,
                  "finish_reason": finish}
        reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                 "model": served.name, "choices": [choice], "usage": _usage(len(prompt), len(ids))}
        choice["stop_reason"] = stop_reason  # None: stopped on end-of-sequence (listed last) or on length
        if body.get("return_token_ids"):  # vLLM's and SGLang's extension: the exact ids, prompt and reply
            choice["token_ids"], reply["prompt_token_ids"] = ids, prompt
        if body.get("stream"):
            return _event_stream(_chat_chunks(served, body, reply, steps, text))
        return JSONResponse(reply)

    async def completions(request: Request) -> JSONResponse:
        body = await _json_body(request)
        _check_common(body)
        _check_model(served, body)
        prompt = _prompt_ids(served, body.get("prompt"))
        top_k = _top_k(body.get("logprobs"), "logprobs")
        wants_logprobs = body.get("logprobs") is not None
        prompt_top_k = _top_k(body.get("prompt_logprobs"), "prompt_logprobs")
        max_new = _max_tokens(body, len(prompt), served.max_model_len, 16)
        steps, finish = await _greedy_while_connected(request, served, prompt, max_new, top_k)
        echo = bool(body.get("echo"))
        scored = []
        if echo and wants_logprobs or body.get("prompt_logprobs") is not None:
            scored = await run_in_threadpool(served.prompt_logprobs, prompt, max(top_k, prompt_top_k))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        steps, text, finish, _ = _apply_stop(served, steps, finish, [])
        choice = {"index": 0, "text": (served.tokenizer.decode(prompt) if echo else "") + text,
                  "logprobs": None, "finish_reason": finish}
        if wants_logprobs:
            first, prompt_steps = (prompt[0], _trim(scored, top_k)) if echo else (None, [])
            choice["logprobs"] = _legacy_logprobs(served, first, prompt_steps + steps, as_ids)
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(served, _trim(scored, prompt_top_k))
        reply = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                 "model": served.name, "choices": [choice], "usage": _usage(len(prompt), len(steps))}
        if body.get("stream"):
            return _event_stream(_completion_chunks(served, body, reply, steps, text, as_ids))
        return JSONResponse(reply)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": 0, "owned_by": "fp8-harness",
             "max_model_len": served.max_model_len, "kv_path": served.backend.label}]})

    async def tokenize(request: Request) -> JSONResponse:
        body = await _json_body(request)
        if "messages" in body:
            ids = served.encode_chat(_messages(body))
        elif isinstance(body.get("prompt"), str):
            ids = list(served.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
                       ["input_ids"])
        else:
            raise BadRequest("/tokenize needs 'prompt' (text) or 'messages'", "prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len})

    async def detokenize(request: Request) -> JSONResponse:
        body = await _json_body(request)
        tokens = _known_ids(served, body.get("tokens"), "tokens")
        return JSONResponse({"prompt": served.tokenizer.decode(tokens)})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/tokenize", tokenize, methods=["POST"]),
              Route("/detokenize", detokenize, methods=["POST"]),
              Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={BadRequest: _bad_request, ClientGone: _client_gone,
                                                          Exception: _server_error})


# ---------------------------------------------------------------- streaming (server-sent events)


def _text_deltas(served: ServedModel, steps: list[StepLogprobs], text: str) -> list[str]:
    """One text piece per step, joining to exactly `text`: each step reveals what the decoded prefix adds,
    held back while it ends inside a multi-byte character (U+FFFD) or runs past a stop string's cut."""
    deltas, shown = [], 0
    for n in range(1, len(steps) + 1):
        prefix = served.tokenizer.decode([s.token_id for s in steps[:n]])
        if n == len(steps):
            upto = len(text)
        elif prefix.endswith("\ufffd"):
            upto = shown
        else:
            upto = max(shown, len(os.path.commonprefix([prefix, text])))
        deltas.append(text[shown:upto])
        shown = upto
    return deltas


def _chunk(reply: dict, choices: list[dict], usage: bool) -> dict:
    chunk = {"id": reply["id"], "object": reply["object"] + (".chunk" if reply["object"] == "chat.completion" else ""),
             "created": reply["created"], "model": reply["model"], "choices": choices}
    return chunk | ({"usage": None} if usage else {})


def _wants_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _chat_chunks(served: ServedModel, body: dict, reply: dict, steps: list[StepLogprobs], text: str) -> Iterator[dict]:
    """The chat reply as OpenAI streams it: a role chunk, one chunk per token (its text, its logprobs and,
    with return_token_ids, its id), a finish chunk, and the usage chunk when asked."""
    final, usage = reply["choices"][0], _wants_usage(body)
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    yield _chunk(reply, [first], usage) | ({"prompt_token_ids": reply["prompt_token_ids"]}
                                          if "prompt_token_ids" in reply else {})
    for step, delta in zip(steps, _text_deltas(served, steps, text)):
        choice = {"index": 0, "delta": {"content": delta}, "finish_reason": None,
                  "logprobs": _chat_logprobs(served, [step], as_ids) if body.get("logprobs") else None}
        if "token_ids" in final:
            choice["token_ids"] = [step.token_id]
        yield _chunk(reply, [choice], usage)
    yield _chunk(reply, [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": final["finish_reason"],
                          "stop_reason": final["stop_reason"]}], usage)
    if usage:
        yield _chunk(reply, [], False) | {"usage": reply["usage"]}


def _completion_chunks(served: ServedModel, body: dict, reply: dict, steps: list[StepLogprobs], text: str,
                       as_ids: bool) -> Iterator[dict]:
    """The completion as vLLM streams it: the echoed prompt (and its logprobs, prompt_logprobs) first when
    asked, then one chunk per generated token, the finish, and the usage chunk when asked."""
    final, usage = reply["choices"][0], _wants_usage(body)
    legacy = final["logprobs"]
    echoed = len(legacy["tokens"]) - len(steps) if legacy else 0
    head = final["text"][: len(final["text"]) - len(text)]
    if head or "prompt_logprobs" in final:
        choice = {"index": 0, "text": head, "finish_reason": None,
                  "logprobs": {name: values[:echoed] for name, values in legacy.items()} if legacy else None}
        if "prompt_logprobs" in final:
            choice["prompt_logprobs"] = final["prompt_logprobs"]
        yield _chunk(reply, [choice], usage)
    for i, delta in enumerate(_text_deltas(served, steps, text)):
        at = echoed + i
        yield _chunk(reply, [{"index": 0, "text": delta, "finish_reason": None,
                              "logprobs": {name: values[at:at + 1] for name, values in legacy.items()}
                              if legacy else None}], usage)
    yield _chunk(reply, [{"index": 0, "text": "", "logprobs": None, "finish_reason": final["finish_reason"]}], usage)
    if usage:
        yield _chunk(reply, [], False) | {"usage": reply["usage"]}


def _event_stream(chunks: Iterator[dict]) -> StreamingResponse:
    async def events():
        for chunk in chunks:
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _trim(steps: list[StepLogprobs], top_k: int) -> list[StepLogprobs]:
    return [StepLogprobs(s.token_id, s.logprob, s.top[:top_k], s.rank) for s in steps]


async def _json_body(request: Request) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BadRequest(f"request body of {int(declared)} bytes is over the {MAX_BODY_BYTES}-byte limit", status=413)
    raw = bytearray()
    async for chunk in request.stream():  # chunked bodies declare no length: count as they arrive
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise BadRequest(f"request body is over the {MAX_BODY_BYTES}-byte limit", status=413)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except ValueError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


async def _bad_request(request: Request, error: Exception) -> JSONResponse:
    status = getattr(error, "status", 400)
    kind = {404: "NotFoundError", 413: "RequestTooLargeError"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": str(error), "type": kind, "param": getattr(error, "param", None),
                                   "code": status}}, status_code=status)


async def _client_gone(request: Request, error: Exception) -> JSONResponse:
    """Nobody reads it: 499, nginx's "client closed request"."""
    return JSONResponse({"error": {"message": str(error), "type": "client_closed_request"}}, status_code=499)


async def _server_error(request: Request, error: Exception) -> JSONResponse:
    """Any other failure: an OpenAI-style 500 naming the error, never a traceback in the reply."""
    return JSONResponse({"error": {"message": f"internal error: {type(error).__name__}: {str(error)[:200]}",
                                   "type": "InternalServerError", "param": None, "code": 500}}, status_code=500)


# ---------------------------------------------------------------- running it


def load_served_model(model_dir: str | Path | None = None, path_spec: str = "bf16", device: str = "cpu",
                      name: str | None = None) -> ServedModel:
    """Load `model_dir` (default: the first bundled canary) with KV path `path_spec` ("reference" for
    the model's own, untouched cache)."""
    from harness.kv_paths.spec import parse_path
    from harness.replay.inprocess import InProcessModel

    if model_dir is None:
        from harness.job import default_models

        models, warning = default_models()  # the bundled canaries, else tiny random-weight models
        if warning:
            print(f"harness serve: {warning}")
        model_dir = models[0]
    directory = Path(model_dir)
    kv_path = None if path_spec == "reference" else parse_path(path_spec)
    backend = InProcessModel.load(directory, device).backend(kv_path)
    return ServedModel(backend, name or directory.name)


def serve(model_dir: str | Path | None = None, path_spec: str = "bf16", host: str = "127.0.0.1",
          port: int = 8000, device: str = "cpu") -> None:
    """`harness serve`: block, serving the model over HTTP until interrupted."""
    import uvicorn

    served = load_served_model(model_dir, path_spec, device)
    print(f"harness serve: model {served.name!r} ({served.backend.owner.directory}), KV path {path_spec!r}, "
          f"http://{host}:{port}/v1")
    uvicorn.run(build_app(served), host=host, port=port, log_level="info")


@contextlib.contextmanager
def running_server(app, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 10.0,
                   log_level: str = "warning") -> Iterator[str]:
    """Run an ASGI app under uvicorn in a background thread; yield its base URL; stop it on exit."""
    import uvicorn

    # proto given explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is
    # IPPROTO_TCP, and with Nagle on every keep-alive response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on {host}:{sock.getsockname()[1]} in {startup_timeout_s} s")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout_s)
        sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's pick; another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serve_in_subprocess(path_spec: str, model_dir: str | Path | None = None, startup_timeout_s: float = 300.0,
                        host: str = "127.0.0.1") -> Iterator[str]:
    """`harness serve --path SPEC` as a child process on a free loopback port: yields its base URL once /health
    answers, and stops that process (by its pid) on exit. A server that exits or stays silent first raises
    RuntimeError with the path spec and the tail of its log."""
    with serve_in_subprocesses([path_spec], model_dir, startup_timeout_s, host) as urls:
        yield urls[0]


@contextlib.contextmanager
def serve_in_subprocesses(path_specs: Sequence[str], model_dir: str | Path | None = None,
                          startup_timeout_s: float = 300.0, host: str = "127.0.0.1") -> Iterator[list[str]]:
    """`serve_in_subprocess` for several path specs, started together (each loads and calibrates at once)."""
    with contextlib.ExitStack() as stack:
        started = []
        for spec in path_specs:
            port = free_port(host)
            args = [sys.executable, "-m", "harness.cli", "serve", "--path", spec, "--host", host, "--port", str(port)]
            args += ["--model", str(model_dir)] if model_dir is not None else []
            log = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
            stack.callback(_stop, process)
            started.append((spec, f"http://{host}:{port}", process, log))
        deadline = time.monotonic() + startup_timeout_s
        for spec, url, process, log in started:
            _wait_for_health(process, url, deadline, spec, log)
        yield [url for _, url, _, _ in started]


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=20)


def _wait_for_health(process: subprocess.Popen, url: str, deadline: float, path_spec: str, log) -> None:
    import httpx

    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    log.seek(0)
    tail = " | ".join(log.read().strip().splitlines()[-5:])
    state = f"exited with {process.returncode}" if process.poll() is not None else "not up in time"
    raise RuntimeError(f"harness serve --path {path_spec} on {url}: {state}; its log ends: {tail}")
