"""One forward context (harness/forward_context.py) entered by every model call: each surface that calls the model
returns the numbers of the path's own attention, the engine's teacher-forced scoring of the same tokens, never the
reference's (issue 45: serve's prompt logprobs were the reference's while its generation was the path's).

The paths' attention differs from the reference's (an FP8 query, the K scale on the scores of a BF16 cache, an
arithmetic fault injector), so a surface that lost the context would return numbers these tests tell apart: shown
once by planting the old bug (serve's prefill without the context's cache): all three fail. (fault=scale_off is not
among them: its prompt-logprob numbers did not move without the context.) float32 model: both
sides sum the same products, so equal numbers agree to float32 rounding (1e-4 nats; a lost context moves them by
more than 1e-3, asserted per path)."""

from __future__ import annotations

import threading

import pytest
import torch

from harness.canary.tiny_models import build_tiny_model
from harness.forward_context import current, forward_context, note
from harness.kv_paths import calibration
from harness.kv_paths.spec import parse_path
from harness.replay.batched import BatchedEngine, BatchSettings
from harness.replay.inprocess import InProcessModel
from harness.types import Message

SPECS = ("fp8_e4m3:calibrated:fp8_q", "bf16:calibrated:k_scale_on_scores", "fp8_e4m3:calibrated:fault=exp_poly")
ROUNDING = 1e-4  # float32: the same products summed in another order (nats)
APART = 1e-3  # the path's attention against the reference's, at least (nats)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return InProcessModel.load(build_tiny_model("gqa", tmp_path_factory.mktemp("fc") / "tiny-gqa"), "cpu",
                               torch.float32)


def _prompts(model) -> list[list[int]]:
    return [model.encode_chat([Message("user", text)])
            for text in ("What is 7 * 8? Tell me in a sentence, please.", "Name a colour.")]


def _chosen(rows: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return rows[:len(tokens)].gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("spec", SPECS)
def test_every_surface_returns_the_paths_own_numbers(model, spec):
    backend, reference = model.backend(parse_path(spec)), model.backend(None)
    prompt = _prompts(model)[0]

    # generation (harness run's one sequence, and harness serve's streamed logprobs: the same greedy_ids)
    decoded: list[float] = []
    tokens, _, _ = backend.greedy_ids(prompt, 8, on_step=lambda logits, next_id: decoded.append(
        float(torch.log_softmax(logits.float(), dim=-1)[next_id])))
    # the engine's teacher-forced scoring of the same tokens: the yardstick of every surface below
    [scored] = backend.engine().score([prompt], [tokens])
    engine = _chosen(scored, tokens)
    [ref_scored] = reference.engine().score([prompt], [tokens])
    assert (engine - _chosen(ref_scored, tokens)).abs().max() > APART, "the path's attention is the reference's"
    assert (torch.tensor(decoded) - engine).abs().max() < ROUNDING, "generation"

    # the batched engine: scoring two rows at once, and generating them in one batch and in rows
    prompts = _prompts(model)
    batched = BatchedEngine(backend, BatchSettings(batch_size=2))
    [row0, _] = batched.score(prompts, [tokens, tokens[:3]])
    assert (_chosen(row0, tokens) - engine).abs().max() < ROUNDING, "batched scoring"
    alone = [backend.greedy_ids(p, 6)[0] for p in prompts]
    assert [r.token_ids for r in BatchedEngine(backend, BatchSettings(batch_size=2)).generate(prompts, 6)] == alone
    assert [r.token_ids for r in backend.engine().generate_rows(prompts, [6, 6])] == alone, "rows"

    # harness serve: prompt logprobs of prompt + reply, from one prefill (last: a machine without the '[test]'
    # extra's server skips only this part)
    serve = pytest.importorskip("harness.serve", reason="the '[test]' extra's HTTP server")
    served = serve.ServedModel(backend, "tiny-gqa").prompt_logprobs(prompt + tokens, top_k=1)[len(prompt) - 1:]
    assert (torch.tensor([s.logprob for s in served]) - engine).abs().max() < ROUNDING, "serve prompt logprobs"


def test_attention_capture_sees_the_paths_attention(model):
    """The capture surface (harness attention): its observer is the forward context's, inherited by the model calls
    inside, with the path's cache and attention. An FP8 query moves the captured logits beyond the FP8 cache's own
    error (measured on this model: largest logit error 0.046 against 0.033 for fp8_e4m3:calibrated alone); a lost
    context would capture nothing, or the same logits as the path without fp8_q."""
    from harness.replay.attention import AttentionOptions

    messages = [Message("user", "What is 7 * 8? Tell me in a sentence, please.")]
    tokens, _, _ = model.backend(None).greedy_ids(model.encode_chat(messages), 6)
    found = {spec: model.backend(parse_path(spec)).attention_error_sync(messages, tokens, AttentionOptions())
             for spec in ("fp8_e4m3:calibrated", "fp8_e4m3:calibrated:fp8_q")}
    assert all(turn.rows for turn in found.values()), "nothing captured: the observer did not reach the model"
    fp8, fp8_q = (found[s].summary["attn_logit_err_max"] for s in ("fp8_e4m3:calibrated", "fp8_e4m3:calibrated:fp8_q"))
    assert fp8 > 0 and fp8_q > 1.2 * fp8, (fp8, fp8_q)


def test_calibrations_observer_reaches_a_model_call_entered_inside():
    """calibration.query_amax enters a context with its observer; a model call inside enters its own (its cache):
    the observer is inherited, and gone after."""
    seen = []
    model = torch.nn.Module()
    with calibration.query_amax(model) as found:
        with forward_context(cache="a cache"):
            assert current().cache == "a cache" and current().observe is not None
            module = torch.nn.Module()
            module.layer_idx = 2
            current().observe(module, torch.tensor([[-3.0, 1.0]]), None, None, None)
            seen.append(current().observe)
    assert float(found[2]) == 3.0 and seen[0] is not None
    assert current().observe is None and current().cache is None


def test_contexts_nest_reset_on_error_and_stay_in_their_thread():
    with forward_context(cache="outer", rows="rows"):
        with pytest.raises(RuntimeError):
            with forward_context(cache="inner"):
                assert (current().cache, current().rows) == ("inner", "rows")  # rows inherited
                note("query_tokens", 1)
                assert current().notes == {"query_tokens": 1}
                raise RuntimeError("a model call that fails")
        assert current().cache == "outer" and current().notes == {}  # notes are per call
        other = []
        thread = threading.Thread(target=lambda: other.append(current().cache))
        thread.start()
        thread.join()
        assert other == [None]  # a thread started inside sees no context of this one's
    note("query_tokens", 1)  # outside every model call: nowhere to note, no error
    assert current().notes is None


def test_an_attention_layer_without_a_cache_layer_of_its_own_reads_none():
    """Gemma 3n's KV-sharing layers under transformers 5.17: the cache holds only the layers that store K/V, so the
    sharing layers' indices are past its end (an IndexError ended every Gemma 3n run on the GPU machines); they
    attend over the K/V they are handed, with no cache layer of their own."""
    from types import SimpleNamespace

    from transformers import DynamicCache

    from harness.kv_paths.attention import cache_layer

    cache = DynamicCache()
    for i in range(2):
        cache.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), i)
    assert cache_layer(cache, SimpleNamespace(layer_idx=1)) is cache.layers[1]
    assert cache_layer(cache, SimpleNamespace(layer_idx=3)) is None
    assert cache_layer(None, SimpleNamespace(layer_idx=0)) is None


class _Stream:
    """A CUDA stream's part `on_checks_stream` uses, recording what it is asked: no GPU needed."""

    def __init__(self, name: str, log: list, device: torch.device):
        self.name, self.log, self.device = name, log, device

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(f"{self.name} waits {other.name}")


class _Tensor:
    def __init__(self, name: str, device: torch.device, log: list):
        self.name, self.device, self.log = name, device, log

    def record_stream(self, stream: _Stream) -> None:
        self.log.append(f"{self.name} kept for {stream.name}")


@pytest.mark.parametrize("where", ["beside", "other_gpu", "none"])
def test_checks_beside_a_pass_order_their_streams(monkeypatch, where):
    """`on_checks_stream`: the checks stream first waits for the model's (the check reads what the pass wrote) and
    keeps its inputs from reuse; a layer on another GPU (layer-sharded) is checked where it runs, after the model's
    stream on the batch's GPU has waited for the checks already beside it (both add into the same statistics there);
    without a checks stream the block runs where it is. The GPU test that the numbers are the same either way:
    tests/test_fused_write_gpu.py."""
    import contextlib

    from harness import forward_context as fc

    log: list[str] = []
    home, other = torch.device("cuda", 0), torch.device("cuda", 1)
    side, model_stream = _Stream("checks", log, home), _Stream("model", log, home)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: model_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(log.append(f"on {s.name}")))
    x = _Tensor("x", other if where == "other_gpu" else home, log)
    with forward_context(checks_stream=None if where == "none" else side):
        with fc.on_checks_stream(x):
            log.append("block")
    assert log == {"beside": ["checks waits model", "x kept for checks", "on checks", "block"],
                   "other_gpu": ["model waits checks", "block"], "none": ["block"]}[where]
