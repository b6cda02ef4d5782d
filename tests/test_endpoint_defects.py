"""Issue 28, D6-D8: every id list taken from a server is checked against what the server said it produced
(usage.completion_tokens, its text), a disagreement is a named capability problem and the unit is never
scored; and a `--resume` keeps what the first session found about a server.

The servers are `fault_app` (tests/test_endpoint_validation.py): token ids are code points, the chat
template is "role:content\\n" per message, /detokenize joins the code points."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("starlette", reason="the '[test]' extra's HTTP server: pip install -e '.[test]'")

from harness import cli
from harness.replay.endpoint import InvalidReply
from harness.replay.runner import Replay
from harness.runs.store import RunStore
from harness.serve import running_server
from test_endpoint_validation import QUIET, endpoint, fault_app, generate_and_score, scenario, write_scenarios


def test_d8_retokenised_ids_short_of_the_servers_count_are_refused():
    """The issue's wrong numbers: no ids in the reply, /tokenize one token short of usage.completion_tokens.
    Before: the short ids were scored ("diverged" against an identical server, exact_match 1 -> 0)."""
    with running_server(fault_app({"no_token_info", "short_tokenize", "length"}), log_level=QUIET) as url:
        with pytest.raises(InvalidReply, match=r"re-tokenises to 7 tokens where usage\.completion_tokens is 8 "
                                               r"\(finish_reason length\)"):
            asyncio.run(generate_and_score(url))


def test_d8_a_one_short_tokenize_on_an_eos_reply_is_caught_by_its_text():
    """A reply that stopped on end-of-sequence may be one token over its text in the server's count (the
    EOS), so the count alone cannot tell; decoding the ids back (/detokenize) does."""
    with running_server(fault_app({"no_token_info", "short_tokenize"}), log_level=QUIET) as url:
        with pytest.raises(InvalidReply, match=r"7 token ids decode to 'ereht o' but its text is 'ereht ol'"):
            asyncio.run(generate_and_score(url))


def test_d8_healthy_retokenised_ids_still_pass():
    with running_server(fault_app({"no_token_info", "length"}), log_level=QUIET) as url:
        generation, scores, backend = asyncio.run(generate_and_score(url))
    assert generation.token_ids == [ord(c) for c in "ereht ol"] and scores.unavailable is None
    assert backend.capabilities["reply_text_check"] == "server /detokenize of the reply's ids"
    assert "reply_ids_invalid" not in backend.capabilities


def test_d7_a_text_that_disagrees_with_its_ids_is_never_scored(tmp_path):
    """Before: scored on the ids without a note (texts.jsonl and the report disagreed). Now the candidate's
    units fail naming the disagreement, its records are absent, and the run names the server."""
    store = RunStore.create(tmp_path / "run", {"status": "running", "warnings": []})

    async def run(reference_url, candidate_url):
        reference, candidate = endpoint(reference_url, label="reference"), endpoint(candidate_url, label="candidate")
        try:
            await Replay("endpoint", reference, [candidate], store).run([scenario()])
        finally:
            await reference.aclose()
            await candidate.aclose()
        return candidate

    with running_server(fault_app(set()), log_level=QUIET) as healthy, \
            running_server(fault_app({"garbled_text"}), log_level=QUIET) as garbled:
        candidate = asyncio.run(run(healthy, garbled))
    assert not [r for r in store.read("records") if r["path"] == "candidate"]
    errors = [e for e in store.read("errors") if e["path"] == "candidate"]
    assert errors and "the server's detokenisation disagrees with its ids" in errors[0]["error"]
    assert "6 token ids decode to 'ereht' but its text is 'ereht!'" in candidate.capabilities["reply_ids_invalid"]
    assert any(line.startswith("candidate: replies not scored") for line in candidate.degraded())
    assert [r for r in store.read("records") if r["path"] == "reference"]  # the healthy server is scored


def test_d7_a_garbled_server_is_refused_by_the_preflight(tmp_path, capsys):
    with running_server(fault_app(set()), log_level=QUIET) as healthy, \
            running_server(fault_app({"garbled_text"}), log_level=QUIET) as garbled:
        code = cli.main(["run", "--reference", healthy, "--candidate", garbled, "--out", str(tmp_path / "run"),
                         "--scenarios", str(write_scenarios(tmp_path)), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "invalid reply: the reply's 4 token ids decode to '.KO' but its text is '.KO!'" in err, err


def test_d6_resume_keeps_what_the_first_session_found(tmp_path, capsys):
    """The first session's candidate dropped a logprob (its units scored on re-tokenised ids); the server is
    fixed before `--resume`. Before: the resume's capabilities replaced the first's, chat_reply_invalid gone."""
    faults = {"drop_logprob"}
    args = ["--out", str(tmp_path / "run"), "--scenarios", str(write_scenarios(tmp_path)), "--no-progress"]
    with running_server(fault_app(set()), log_level=QUIET) as healthy, \
            running_server(fault_app(faults), log_level=QUIET) as faulty:
        assert cli.main(["run", "--reference", healthy, "--candidate", f"fp8={faulty}", *args]) == 0
        faults.clear()
        assert cli.main(["run", "--reference", healthy, "--candidate", f"fp8={faulty}", *args, "--resume"]) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    capabilities = manifest["paths"][0]["endpoint"]["capabilities"]
    assert "usage.completion_tokens" in capabilities["chat_reply_invalid"]
    assert any("re-tokenised from the text" in w for w in manifest["warnings"])


def test_a_scoring_request_that_failed_for_now_is_redone_by_resume(tmp_path):
    """Found by the endpoint soak (benchmarks/endpoint_soak.py): a scoring request whose retries ran out left
    the unit done with its teacher-forced metrics null for good, so a --resume never asked again and the
    run's records differed from a clean run's. Now the unit fails and the resume completes it."""
    faults = {"score_500"}
    scenarios = [scenario()]

    async def run(reference_url, candidate_url, store):
        reference, candidate = endpoint(reference_url, label="reference"), endpoint(candidate_url, label="candidate")
        try:
            await Replay("endpoint", reference, [candidate], store).run(scenarios)
        finally:
            await reference.aclose()
            await candidate.aclose()

    store = RunStore.create(tmp_path / "run", {"status": "running", "warnings": []})
    clean = RunStore.create(tmp_path / "clean", {"status": "running", "warnings": []})
    with running_server(fault_app(set()), log_level=QUIET) as healthy, \
            running_server(fault_app(faults), log_level=QUIET) as flaky:
        asyncio.run(run(healthy, flaky, store))
        assert not store.is_done("endpoint", "s", "candidate")
        assert "HTTP 500" in [e for e in store.read("errors") if e["path"] == "candidate"][0]["error"]
        faults.clear()
        asyncio.run(run(healthy, flaky, store))  # the resume
        asyncio.run(run(healthy, healthy, clean))
    kept = [{k: r[k] for k in ("scenario", "path", "turn", "metric", "value")} for r in store.read("records")]
    expected = [{k: r[k] for k in ("scenario", "path", "turn", "metric", "value")} for r in clean.read("records")]
    assert sorted(map(json.dumps, kept)) == sorted(map(json.dumps, expected))
    assert not [r for r in store.read("records") if r.get("unavailable")]


def test_a_refused_reply_is_not_cached_so_resume_asks_again(tmp_path):
    """Issue 45: a reply the wrong-reply checks refused (its text disagrees with its ids) was kept in the run's
    HTTP cache, so every `--resume` replayed it and those units never finished. Now the server fixed before
    the resume is asked again and the units complete."""
    faults = {"garbled_text"}
    cache = tmp_path / "run" / "http-cache"
    store = RunStore.create(tmp_path / "run", {"status": "running", "warnings": []})

    async def run(reference_url, candidate_url):
        reference = endpoint(reference_url, label="reference", cache_dir=cache)
        candidate = endpoint(candidate_url, label="candidate", cache_dir=cache)
        try:
            await Replay("endpoint", reference, [candidate], store).run([scenario()])
        finally:
            await reference.aclose()
            await candidate.aclose()

    with running_server(fault_app(set()), log_level=QUIET) as healthy, \
            running_server(fault_app(faults), log_level=QUIET) as garbled:
        asyncio.run(run(healthy, garbled))
        assert not store.is_done("endpoint", "s", "candidate")
        faults.clear()
        asyncio.run(run(healthy, garbled))  # the resume
    assert store.is_done("endpoint", "s", "candidate")
    assert [r for r in store.read("records") if r["path"] == "candidate"]


def test_failed_attempts_accumulate_across_resumes(tmp_path):
    """Issue 45: a --resume replaced the manifest's `failed_attempts` with its own session's count, hiding the
    earlier sessions' failed attempts. The first session's count is planted (a server that fails requests also
    fails the pre-flight); the resume, with no failure of its own, must keep it, through both of its notes."""
    args = ["--out", str(tmp_path / "run"), "--scenarios", str(write_scenarios(tmp_path)), "--no-progress"]
    manifest_file = tmp_path / "run" / "manifest.json"
    with running_server(fault_app(set()), log_level=QUIET) as healthy, \
            running_server(fault_app(set()), log_level=QUIET) as candidate:
        assert cli.main(["run", "--reference", healthy, "--candidate", f"fp8={candidate}", *args]) == 0
        manifest = json.loads(manifest_file.read_text())
        manifest["paths"][0]["endpoint"]["failed_attempts"] = 5
        manifest["models"][0]["reference"]["failed_attempts"] = 2
        manifest_file.write_text(json.dumps(manifest))
        assert cli.main(["run", "--reference", healthy, "--candidate", f"fp8={candidate}", *args, "--resume"]) == 0
    manifest = json.loads(manifest_file.read_text())
    assert manifest["paths"][0]["endpoint"]["failed_attempts"] == 5
    assert manifest["models"][0]["reference"]["failed_attempts"] == 2
