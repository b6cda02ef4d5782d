"""`harness run` as CI sees it (issue 15, items 3, 5, 6, 8): one writer per run directory, exit codes and
run statuses as docs/CONTRACTS.md fixes them, no credential written, every bad input refused up front
with a clear error and no traceback, and no directory left behind that blocks the same `--out`."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.cli import main

SMOKE = Path(__file__).parent / "data" / "scenarios" / "smoke.yaml"
GQA_CANARY = Path(__file__).resolve().parent.parent / "harness" / "canary" / "weights" / "gqa"
DEEP = "scenarios:\n  - id: deep\n    kind: chat\n    tags: " + "[" * 50_000 + "]" * 50_000 + "\n"


@contextlib.contextmanager
def refusing_server():
    """A loopback server that passes the endpoint pre-flight (one model listed; the probe "Say OK." answered
    with an empty reply) and answers every other request 400 with an OpenAI-style error: every unit fails at
    once (400 is not retried), so a run against it is a run whose units all fail, in well under a second."""
    probe_reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]}

    class Refuse(http.server.BaseHTTPRequestHandler):
        def _send(self, status: int, payload: dict):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _refuse(self):
            self._send(400, {"error": {"message": "injected 400", "type": "invalid_request_error"}})

        def do_GET(self):
            if self.path != "/v1/models":
                return self._refuse()
            self._send(200, {"object": "list", "data": [{"id": "canary", "object": "model"}]})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/v1/chat/completions" and request.get("messages", [{}])[-1].get("content") == "Say OK.":
                return self._send(200, probe_reply)
            if self.path == "/tokenize" and request.get("prompt") == "":
                return self._send(200, {"tokens": [], "count": 0, "max_model_len": 4096})
            self._refuse()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _run_args(tiny_models, out: Path) -> list[str]:
    # --jobs 1: in one process (the default's pool of a spawned worker per core costs ~14 s of CPU a run here, and
    # the pool is not what these tests check: tests/test_executor_faults.py does)
    return ["run", "--model", str(tiny_models["gqa"]), "--scenarios", str(SMOKE), "--paths", "bf16",
            "--out", str(out), "--no-progress", "--jobs", "1"]


# ---------------------------------------------------------------- item 5: exit codes and statuses


def test_every_unit_failed_exits_3_and_counts_units_not_rows(tmp_path, capsys):
    out = tmp_path / "refused"
    with refusing_server() as url:
        args = ["run", "--out", str(out), "--scenarios", str(SMOKE), "--no-progress",
                "--reference", url, "--candidate", url]
        assert main(args) == 3
        first = capsys.readouterr().out
        assert main([*args, "--resume"]) == 3  # still failing: errors.jsonl now holds both attempts
        again = capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete_with_errors" and manifest["unfinished_units"] == 4 * 2
    for printed in (first, again):  # 4 scenarios x (reference, candidate), however many error rows
        assert "8 unit(s) not finished" in printed, printed


@pytest.mark.slow
def test_resume_that_fills_every_gap_is_complete_and_exits_0(tiny_models, tmp_path, capsys):
    out = tmp_path / "gap"
    assert main(_run_args(tiny_models, out)) == 0
    # Make it the run a failing unit leaves: no done line and no rows for one unit, two failed attempts logged.
    unit = {"model": "gqa", "scenario": "smoke-arith", "path": "bf16"}
    for table in ("done", "records", "series", "texts", "checks"):
        file = out / f"{table}.jsonl"
        if file.exists():
            kept = [line for line in file.read_text().splitlines()
                    if {k: json.loads(line).get(k) for k in unit} != unit]
            file.write_text("".join(line + "\n" for line in kept))
    error = {**unit, "turn": None, "error": "RuntimeError: injected", "traceback": ""}
    (out / "errors.jsonl").write_text((json.dumps(error) + "\n") * 2)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "status": "complete_with_errors"}))
    capsys.readouterr()
    assert main([*_run_args(tiny_models, out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    assert "not finished" not in printed and "failed" not in printed, printed
    assert "run complete in" in printed


# ---------------------------------------------------------------- item 3: one writer per run directory


def _harness(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_writer_is_refused_while_the_first_runs(tiny_models, tmp_path):
    """Two real processes: the first `harness run` is frozen (SIGSTOP) while it holds the run, so the second
    `--resume --out` of the same directory meets it for certain; it is refused, the first then finishes."""
    out = tmp_path / "shared"
    first = _harness(*_run_args(tiny_models, out))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out / "manifest.json").exists():
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = _harness(*_run_args(tiny_models, out), "--resume")
        _, stderr = second.communicate(timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2, stderr
    assert f"being written by another harness run (pid {first.pid})" in stderr and "Traceback" not in stderr
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    done = [tuple(json.loads(line).values()) for line in (out / "done.jsonl").read_text().splitlines()]
    assert len(done) == len(set(done)) == 4 * 5  # nothing written twice (reference, bf16, the yardstick, its twin, the control arm)
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


# ---------------------------------------------------------------- item 6: credentials in URLs


def test_scrub_credentials():
    from harness.records import scrub_credentials

    assert scrub_credentials("harness run --reference http://user:secret@h:8000/v1 x") == \
        "harness run --reference http://***@h:8000/v1 x"
    assert scrub_credentials("https://token@host and http://plain:80") == "https://***@host and http://plain:80"


def test_credential_in_url_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    out = tmp_path / "creds"
    argv = ["run", "--out", str(out), "--scenarios", str(SMOKE), "--no-progress",
            "--reference", "http://user:secret@127.0.0.1:9", "--candidate", "http://127.0.0.1:9"]
    monkeypatch.setattr(sys, "argv", ["harness", *argv])
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "credentials" in captured.err and "secret" not in captured.err + captured.out
    assert not out.exists()


# ---------------------------------------------------------------- item 8: input gaps


@pytest.mark.parametrize("extra, message", [
    (["--device", "tpu"], "--device tpu: unknown device"),
    (["--paths="], "no KV paths given"),
    (["--model", "/nonexistent"], "--model /nonexistent: no such directory"),
])
def test_bad_run_inputs_are_refused_before_any_work(tiny_models, tmp_path, capsys, extra, message):
    out = tmp_path / "refused"
    started = time.perf_counter()
    assert main([*_run_args(tiny_models, out), *extra]) == 2
    assert time.perf_counter() - started < 10  # before any model loads (a replay takes longer)
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["run", "--jobs", "0"], "--jobs: must be at least 1"),
    (["run", "--jobs", "-3"], "--jobs: must be at least 1"),
    (["serve", "--port", "99999"], "--port: must be 1..65535"),
])
def test_bad_numbers_are_usage_errors(tmp_path, capsys, argv, message):
    if argv[0] == "run":  # the smallest run, should the number be accepted
        argv = [*argv, "--model", str(GQA_CANARY), "--scenarios", str(SMOKE), "--paths", "bf16",
                "--out", str(tmp_path / "run"), "--no-progress"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.replace("argument ", "")


def test_out_pointing_at_a_file_is_refused(tiny_models, tmp_path, capsys):
    file = tmp_path / "a-file"
    file.write_text("not a run")
    argv = _run_args(tiny_models, file)
    assert main(argv) == 2
    assert f"--out {file}: is a file" in capsys.readouterr().err and file.read_text() == "not a run"


def test_deep_yaml_is_refused_without_traceback(tiny_models, tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text(DEEP)
    argv = _run_args(tiny_models, tmp_path / "out")
    argv[argv.index("--scenarios") + 1] = str(deep)
    assert main(argv) == 2
    assert "deep.yaml: field 'scenarios[0].tags" in capsys.readouterr().err


def test_bad_endpoint_arguments_leave_nothing_that_blocks_the_same_out(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HARNESS_TEST_UNSET_KEY", raising=False)
    out = tmp_path / "live"
    with refusing_server() as url:
        base = ["run", "--out", str(out), "--scenarios", str(SMOKE), "--no-progress", "--reference", url,
                "--candidate", url]
        assert main([*base, "--tokenizer", "/nonexistent"]) == 2
        assert "--tokenizer /nonexistent: no such directory" in capsys.readouterr().err
        assert main([*base, "--api-key-env", "HARNESS_TEST_UNSET_KEY"]) == 2
        assert "--api-key-env HARNESS_TEST_UNSET_KEY" in capsys.readouterr().err
        assert not out.exists()
        assert main(base) == 3  # the same --out, good arguments: it runs (and its units fail: exit 3)


def test_every_input_is_checked_before_the_first_unit(tiny_models, tmp_path, capsys):
    """A good model then a missing one: refused before the good one's replay, listing the missing one."""
    out = tmp_path / "two"
    argv = [*_run_args(tiny_models, out), "--model", str(tmp_path / "missing-model")]
    started = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - started < 10
    assert "missing-model: no such directory" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("status, verdicts, judgements, fail_on_verdict, code", [
    ("complete", [], [], True, 0),
    ("complete", ["pass", "fail"], [], True, 1),
    ("complete", ["pass", "fail"], [], False, 0),                    # --no-fail-on-verdict
    ("complete_with_errors", ["fail"], [], True, 3),                 # incomplete wins over a failed verdict
    ("complete", ["pass"], [("judge_llm", "failed")], True, 3),      # the LLM judge gave no usable verdict
    ("complete", ["pass"], [("judge_llm", "failed"), ("judge_llm", "ok")], True, 0),  # one usable: degraded, not void
    ("complete", ["pass"], [("judge_llm", "skipped"), ("judge_rule", "ok")], True, 0),
])
def test_exit_code_contract(tmp_path, status, verdicts, judgements, fail_on_verdict, code):
    from harness.runs.status import run_exit_code
    from harness.runs.store import RunStore

    store = RunStore.create(tmp_path / "run", {"status": status, "judge": {"url": "http://127.0.0.1:1", "model": "j"}})
    store.append("verdicts", [{"model": "m", "scenario": "s", "path": "p", "turn": 0, "verdict": v} for v in verdicts])
    store.append("judgements", [{"model": "m", "scenario": "s", "path": "p", "turn": 0, "metric": m, "status": st}
                                for m, st in judgements])
    assert run_exit_code(tmp_path / "run", fail_on_verdict=fail_on_verdict) == code


def test_checkpoint_path_without_scales_is_refused_before_the_model_loads(tiny_models, tmp_path, capsys):
    out = tmp_path / "ckpt"
    argv = _run_args(tiny_models, out)
    argv[argv.index("--paths") + 1] = "bf16,fp8_e4m3:checkpoint"
    assert main(argv) == 2
    assert "has no k_scale/v_scale tensors" in capsys.readouterr().err and not out.exists()


def test_a_scales_file_stands_in_for_checkpoint_scales_in_the_model_directory(tmp_path):
    """`--scales FILE` (harness calibrate's output) feeds `:checkpoint` paths, so a model directory without
    k_scale/v_scale is fine then; a missing FILE is refused up front, naming it."""
    from harness.job import CANARY_WEIGHTS, RunConfig, parse_kv_paths
    from harness.run_inputs import InputError, check_run_inputs

    scales = tmp_path / "kv_scales.safetensors"
    scales.write_bytes(b"")  # existence is what is checked up front; the loader reads the tensors later
    model, paths = (CANARY_WEIGHTS / "gqa",), tuple(parse_kv_paths("bf16,fp8_e4m3:checkpoint"))
    check_run_inputs(RunConfig(models=model, scenario_paths=(), paths=paths, out=tmp_path / "a", scales_file=scales))
    with pytest.raises(InputError, match="no k_scale/v_scale"):
        check_run_inputs(RunConfig(models=model, scenario_paths=(), paths=paths, out=tmp_path / "b"))
    with pytest.raises(InputError, match="--scales .*missing.safetensors: no such file"):
        check_run_inputs(RunConfig(models=model, scenario_paths=(), paths=paths, out=tmp_path / "c",
                                   scales_file=tmp_path / "missing.safetensors"))


# ---------------------------------------------------------------- issue 28: D1-D5 and the request timeout

HUGE_BUDGET = """scenarios:
  - id: endless
    kind: chat
    generation: {max_new_tokens: %d}
    turns:
      - user: "Count to ten."
"""


def test_d1_a_reply_budget_no_context_can_hold_is_refused_by_the_loader(tmp_path):
    """Before: 1,000,000,000 was accepted and the in-process decode looped to it (only an EOS stopped it)."""
    from harness.scenarios.load import ScenarioError
    from harness.scenarios.sources import load_scenarios

    file = tmp_path / "endless.yaml"
    file.write_text(HUGE_BUDGET % 1_000_000_000)
    with pytest.raises(ScenarioError, match=r"endless\.yaml: scenario 'endless': field 'generation\.max_new_tokens': "
                                            r"1000000000 is above the limit of 1048576"):
        load_scenarios([file])


def test_d1_harness_run_refuses_a_budget_beyond_the_models_context_at_once(tiny_models, tmp_path, capsys):
    """As `harness serve` (and vLLM) refuse max_tokens beyond the context with a 400, `harness run` refuses
    before any model loads, naming the file, scenario, field and the model's context. Run in a subprocess
    with a deadline: before the fix the replay decoded until the 4096-token context ran out."""
    file = tmp_path / "endless.yaml"
    file.write_text(HUGE_BUDGET % 4096)
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--model", str(tiny_models["gqa"]),
                           "--scenarios", str(file), "--paths", "bf16", "--out", str(tmp_path / "out"),
                           "--no-progress"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "field 'generation.max_new_tokens': 4096 leaves no room for the prompt" in done.stderr
    assert "context of 4096 tokens (max_position_embeddings)" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


LONG_PROMPTS = """scenarios:
  - id: fits
    kind: chat
    generation: {max_new_tokens: 8}
    turns:
      - user: "Count to ten."
  - id: too-long
    kind: chat
    generation: {max_new_tokens: 8}
    turns:
      - user: "Count to ten."
      - user: "%s"
"""


def test_a_prompt_beyond_the_models_context_is_refused_naming_scenario_and_turn(tmp_path):
    """Issue 45: a 30,000-word prompt on the 4096-token canary ran unchecked (exit 0, no warning). Now
    `harness run` refuses it before work (exit 2), naming the file, scenario, turn, the token counts and the
    model's context; the turn that fits is not named."""
    file = tmp_path / "long.yaml"
    file.write_text(LONG_PROMPTS % ("word " * 30_000))
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--model", str(GQA_CANARY), "--scenarios",
                           str(file), "--paths", "bf16", "--out", str(tmp_path / "out"), "--no-progress"],
                          capture_output=True, text=True, timeout=60)  # before: replayed the 30k-token prompt
    err = done.stderr
    assert done.returncode == 2 and "Traceback" not in err, err
    assert f"{file}: scenario 'too-long': turn 1: prompt of" in err and "'fits'" not in err
    assert "+ generation.max_new_tokens 8" in err and "context of 4096 tokens" in err
    assert not (tmp_path / "out").exists()


def test_a_million_character_filler_is_refused_for_a_4096_token_model_without_tokenising_it(tmp_path):
    """Issue 45: `filler.chars: 1000000` on the 4096-token canary passed 4 GB in 93 s. Its prompt is refused by
    its length alone (a lower bound on its tokens), before any tokenising of a million characters."""
    from harness.run_inputs import scenario_budget_problems
    from harness.scenarios.sources import load_scenarios

    file = tmp_path / "needle.yaml"
    file.write_text("scenarios:\n  - {id: needle-big, kind: long_context, needle: 'The code is 4711.', question: "
                    "'What is the code?', answer: '4711', filler: {chars: 1000000, depth: 0.5, seed: 1}}\n")
    (problem,) = scenario_budget_problems(load_scenarios([file]), [GQA_CANARY])
    assert problem.startswith(f"{file}: scenario 'needle-big': turn 0: prompt of at least ")
    assert "context of 4096 tokens" in problem


def test_d2_a_fifo_named_as_a_scenario_file_is_not_called_missing(tmp_path, capsys):
    fifo = tmp_path / "scenarios.yaml"
    os.mkfifo(fifo)
    assert main(["run", "--scenarios", str(fifo), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{fifo}: not a regular file or directory" in err and "no such file" not in err, err


def test_d3_an_out_directory_that_cannot_be_made_names_the_flag(tmp_path, capsys):
    """/proc is writable by its mode bits for root, yet nothing can be made there: before, a bare [Errno 2]."""
    assert main(["run", "--scenarios", str(SMOKE), "--out", "/proc/harness-x", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out /proc/harness-x: cannot create a directory in /proc"), err


def test_d4_a_missing_calibration_file_names_its_flag(tmp_path, capsys):
    missing = tmp_path / "calibrate.yaml"
    assert main(["run", "--scenarios", str(SMOKE), "--calibration", str(missing), "--out", str(tmp_path / "out"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--calibration {missing}: no such file or directory" in err and "problem in scenario files" not in err, err


def test_d5_a_refused_connection_is_not_told_to_name_the_model(tmp_path, capsys):
    """Nothing listens on the port: the hint asks whether the server runs, not for --reference-model."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    assert main(["run", "--scenarios", str(SMOKE), "--reference", url, "--candidate", url, "--out",
                 str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "connection error" in err and "is the server running, and listening there?" in err, err
    assert "--reference-model" not in err, err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_request_timeout_is_a_usage_error(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["run", "--scenarios", str(SMOKE), "--request-timeout", value, "--out", str(tmp_path / "o")])
    assert exited.value.code == 2
    assert "--request-timeout" in capsys.readouterr().err


def test_the_request_timeout_bounds_a_hanging_server_and_is_in_the_manifest(tmp_path, capsys):
    """A server that passes the pre-flight, then hangs on every turn: each attempt ends at --request-timeout
    (0.5 s here, not 120 s), the units fail and are named, and the manifest records the timeout."""
    hang = threading.Event()
    with refusing_server() as url, hanging_after_preflight(url, hang) as proxy:
        started = time.monotonic()
        code = main(["run", "--out", str(tmp_path / "out"), "--scenarios", str(SMOKE), "--no-progress",
                     "--reference", proxy, "--candidate", proxy, "--request-timeout", "0.5"])
        elapsed = time.monotonic() - started
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert code == 3 and manifest["request_timeout_s"] == 0.5
    assert manifest["models"][0]["reference"]["policy"]["timeout_s"] == 0.5
    errors = (tmp_path / "out" / "errors.jsonl").read_text()
    assert "timed out after 0.5 s" in errors
    assert elapsed < 60, elapsed  # 4 retries x 0.5 s plus backoff per request; at 120 s it would take minutes


@contextlib.contextmanager
def hanging_after_preflight(upstream: str, hang: threading.Event):
    """A loopback proxy to `upstream` that passes the pre-flight's "Say OK." chats and holds every other
    chat request open without answering."""
    import urllib.request

    class Proxy(http.server.BaseHTTPRequestHandler):
        def _forward(self):
            data = self.rfile.read(int(self.headers.get("Content-Length", 0))) if self.command == "POST" else None
            if self.path == "/v1/chat/completions":
                if b"Say OK." not in (data or b""):
                    hang.wait(30)
                    return
            request = urllib.request.Request(upstream + self.path, data=data, method=self.command,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request) as reply:
                    status, body = reply.status, reply.read()
            except urllib.error.HTTPError as error:
                status, body = error.code, error.read()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _forward

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        hang.set()
        server.shutdown()
        server.server_close()
