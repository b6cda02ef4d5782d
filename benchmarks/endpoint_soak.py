"""Endpoint soak (opt-in, minutes): `harness run` against `harness serve` behind a fault-injecting proxy.

    nice -n 5 python benchmarks/endpoint_soak.py [--scenarios 150] [--concurrency 32] [--fault-every 5]

One `harness serve` (the bundled GQA canary, bf16 cache, CPU) answers as reference and as candidate. A
loopback proxy in front of it faults every `--fault-every`-th request (5: a steady 20%), cycling through
500, 429 with Retry-After: 1, a connection reset before any reply, a reply cut off halfway, 503, and a
hang (the request is held open until the client's `--request-timeout`, 10 s here, ends the attempt). Three runs of the same
scenarios (one single-turn chat each; a unit is one scenario on one server, so 2 x scenarios units):
1. clean: straight to the server;
2. faulty: through the proxy, `--concurrency N`;
3. `--resume` of run 2, still through the proxy.
Checked: after 3, every unit finished (0 lost) and records.jsonl and texts.jsonl equal run 1's (values,
token ids, texts; row order aside). Measured: client CPU (the `harness run` process: user + sys, from
wait4) per request the proxy saw, most requests in flight at once at the proxy, faults by kind.
Prints a markdown table for BENCHMARKS.md; exit 1 when a unit is lost or a record differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "harness" / "canary" / "weights" / "gqa"
FAULTS = ("500", "429", "reset", "truncated", "503", "hang")
VOLATILE = {"time", "started_at", "finished_at", "elapsed_s", "seconds"}  # none are in records today; kept safe


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_scenarios(directory: Path, count: int) -> Path:
    lines = ["defaults:", "  generation: {max_new_tokens: 8}", "scenarios:"]
    for i in range(count):
        lines += [f"  - id: soak-{i:04d}", "    kind: chat", "    turns:",
                  f"      - user: \"Question {i}: what is {i} plus {i % 7}? Answer in one word.\""]
    path = directory / "soak.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


class FaultProxy:
    """HTTP/1.1 proxy on loopback; one request per client connection (replies say Connection: close)."""

    def __init__(self, upstream_port: int, fault_every: int):
        self.upstream_port, self.fault_every = upstream_port, fault_every
        self.requests, self.in_flight, self.max_in_flight = 0, 0, 0
        self.faults: Counter = Counter()
        self._handlers: set[asyncio.Task] = set()
        self.port = free_port()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(10)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_until_complete(server.serve_forever())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            body = await reader.readexactly(length)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            writer.close()
            return
        # asyncio keeps a handler's task only while its connection is open: a client that gives up on a hang
        # would leave it to the garbage collector mid-await, its in-flight count never taken back
        self._handlers.add(asyncio.current_task())
        self.requests += 1
        index = self.requests
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            fault = FAULTS[(index // self.fault_every) % len(FAULTS)] if index % self.fault_every == 0 else None
            if fault:
                self.faults[fault] += 1
            await self._answer(fault, head, body, reader, writer)
        finally:
            self.in_flight -= 1
            self._handlers.discard(asyncio.current_task())

    async def _answer(self, fault: str | None, head: bytes, body: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if fault in ("500", "503", "429"):
            payload = json.dumps({"error": {"message": f"injected {fault}"}}).encode()
            extra = b"Retry-After: 1\r\n" if fault == "429" else b""
            writer.write(b"HTTP/1.1 %s Injected\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s"
                         b"Connection: close\r\n\r\n%s" % (fault.encode(), len(payload), extra, payload))
        elif fault == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        elif fault == "hang":  # held until the client's --request-timeout gives up and closes the connection
            try:
                await asyncio.wait_for(reader.read(), timeout=30)
            except (TimeoutError, ConnectionError):
                pass

        else:
            reply = await self._forward(head, body)
            writer.write(reply[: len(reply) // 2] if fault == "truncated" else reply)
        try:
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def _forward(self, head: bytes, body: bytes) -> bytes:
        lines = [line for line in head[:-4].split(b"\r\n") if not line.lower().startswith(b"connection:")]
        reader, writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        writer.write(b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n" + body)
        reply = await reader.read()
        writer.close()
        return reply


def start_server(port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "harness.cli", "serve", "--model", str(MODEL), "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("harness serve did not come up in 120 s")


def harness_run(url: str, scenarios: Path, out: Path, concurrency: int, resume: bool, timeout_s: float) -> dict:
    """One `harness run` subprocess: its exit code, wall time and CPU time (user + sys of the reaped child:
    the RUSAGE_CHILDREN difference, `harness serve` being reaped only at the end)."""
    # the candidate named by host name, the reference by address: one server, but two cache keys, so the
    # candidate's requests reach the server (and the proxy) rather than the reference's cached replies
    candidate = url.replace("127.0.0.1", "localhost")
    args = [sys.executable, "-m", "harness.cli", "run", "--reference", url, "--candidate", candidate, "--scenarios",
            str(scenarios), "--out", str(out), "--no-progress", "--concurrency", str(concurrency),
            "--request-timeout", str(timeout_s), "--no-fail-on-verdict"] + (["--resume"] if resume else [])
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True)
    return {"code": done.returncode, "wall_s": time.monotonic() - started, "stderr": done.stderr[-2000:],
            "cpu_s": _child_cpu(before)}


def rows(run: Path, table: str) -> list[str]:
    file = run / f"{table}.jsonl"
    out = []
    for line in file.read_text().splitlines() if file.exists() else []:
        row = {k: v for k, v in json.loads(line).items() if k not in VOLATILE}
        out.append(json.dumps(row, sort_keys=True))
    return sorted(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", type=int, default=150, help="single-turn chat scenarios (units: 2x this)")
    parser.add_argument("--concurrency", type=int, default=32, help="harness run --concurrency")
    parser.add_argument("--request-timeout", type=float, default=10.0,
                        help="harness run --request-timeout: ends each hang; above the server's queueing at this "
                             "concurrency (one CPU model, one forward at a time: 2 s timed healthy requests out)")
    parser.add_argument("--fault-every", type=int, default=5, help="fault every Nth request (5: 20%%)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="endpoint-soak-"))
    scenarios = write_scenarios(work, args.scenarios)
    port = free_port()
    server = start_server(port)
    try:
        counting = FaultProxy(port, fault_every=10 ** 9)  # no faults: counts the clean run's requests
        clean = harness_run(f"http://127.0.0.1:{counting.port}", scenarios, work / "clean", args.concurrency,
                            resume=False, timeout_s=args.request_timeout)
        clean["requests"] = counting.requests
        # nothing left to replay: start-up, pre-flight, judging, report
        idle = harness_run(f"http://127.0.0.1:{counting.port}", scenarios, work / "clean", args.concurrency,
                           resume=True, timeout_s=args.request_timeout)
        proxy = FaultProxy(port, args.fault_every)
        proxied = f"http://127.0.0.1:{proxy.port}"
        faulty = harness_run(proxied, scenarios, work / "faulty", args.concurrency, resume=False,
                             timeout_s=args.request_timeout)
        faulty["requests"] = proxy.requests
        after_first = proxy.requests
        first_manifest = json.loads((work / "faulty" / "manifest.json").read_text())
        resumed = harness_run(proxied, scenarios, work / "faulty", args.concurrency, resume=True,
                              timeout_s=args.request_timeout)
        resumed["requests"] = proxy.requests - after_first
    finally:
        server.terminate()
        server.wait(30)
    manifest = json.loads((work / "faulty" / "manifest.json").read_text())
    same = {table: rows(work / "clean", table) == rows(work / "faulty", table) for table in ("records", "texts")}
    units = 2 * args.scenarios
    lost = manifest.get("unfinished_units", 0)
    print(f"work directory: {work}")
    for name, run in (("clean", clean), ("faulty", faulty), ("resume", resumed)):
        if run["code"] not in (0, 1):
            print(f"{name} exited {run['code']}: {run['stderr']}", file=sys.stderr)
    print(f"fixed cost of one harness run (a --resume with nothing left: start-up, pre-flight, judging, report): "
          f"{idle['cpu_s']:.1f} s CPU, {idle['wall_s']:.1f} s wall")
    print("| run | exit | wall s | client CPU s | requests at proxy | client CPU ms / request, fixed cost "
          "excluded | units unfinished |")
    print("|---|---|---|---|---|---|---|")
    unfinished = (json.loads((work / "clean" / "manifest.json").read_text()).get("unfinished_units", 0),
                  first_manifest.get("unfinished_units", 0), lost)
    for (name, run), left in zip((("clean (no faults)", clean), ("20% faults, first run", faulty),
                                  ("20% faults, --resume", resumed)), unfinished):
        per_request = 1000 * max(run["cpu_s"] - idle["cpu_s"], 0.0) / max(run["requests"], 1)
        print(f"| {name} | {run['code']} | {run['wall_s']:.1f} | {run['cpu_s']:.1f} | {run['requests']} | "
              f"{per_request:.2f} | {left} |")
    print(f"\nunits: {units}; faults injected: {proxy.requests // args.fault_every} of {proxy.requests} requests "
          f"({dict(sorted(proxy.faults.items()))}); most requests in flight at the proxy: {proxy.max_in_flight}")
    print(f"records identical to the clean run: {same['records']}; texts identical: {same['texts']}; "
          f"units lost after the resume: {lost}; status: {manifest['status']}")
    return 0 if lost == 0 and all(same.values()) and manifest["status"] == "complete" else 1


def _child_cpu(before: resource.struct_rusage) -> float:
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


if __name__ == "__main__":
    sys.exit(main())
