"""Host-side work of the in-process backend kept once instead of redone: chat encodings, token texts, and the
calibration passes that compute only the last position's logits. Each must give exactly what the plain
computation gives."""

import dataclasses

import pytest
import torch

from harness.kv_paths.spec import parse_path
from harness.replay.inprocess import EncodingCache, InProcessModel
from harness.types import Message

CHATS = [
    [Message("system", "Answer briefly."), Message("user", "What is 7 * 8?")],
    [Message("user", "What is 7 * 8?")],
    [Message("system", "Answer briefly."), Message("user", "What is 7 * 8?"), Message("assistant", "56"),
     Message("user", "And 9 * 9?")],
    [Message("user", "")],  # an awkward one: empty content
]


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return {arch: InProcessModel.load(path) for arch, path in tiny_models.items()}


def plain_encode(model: InProcessModel, messages) -> list[int]:
    text = model.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                               add_generation_prompt=True, tokenize=False)
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_encode_chat_kept_equals_a_fresh_encoding(loaded):
    model = loaded["gqa"]
    for _ in range(2):  # the second round is answered from the cache
        for chat in CHATS:
            assert model.encode_chat(chat) == plain_encode(model, chat)
    assert len(model._encodings.chats) == len(CHATS)  # one entry per distinct chat
    first = model.encode_chat(CHATS[0])
    first.append(-1)  # callers get their own list: changing it changes nothing kept
    assert model.encode_chat(CHATS[0]) == plain_encode(model, CHATS[0])


def test_token_texts_equal_decoding_each_token(loaded):
    model = loaded["mla"]
    ids = list(range(model.model.config.vocab_size)) + [5, 5, 0]  # every id, and repeats
    assert model.token_texts(ids) == [model.tokenizer.decode([t]) for t in ids]
    assert model.token_texts([]) == []


def test_encoding_cache_is_bounded_and_per_tokenizer():
    calls = []

    def encode(n):
        def run():
            calls.append(n)
            return list(range(n))
        return run

    cache = EncodingCache(max_tokens=10).bound_to("tokenizer A")
    assert cache.chat_ids(("a",), encode(4)) == [0, 1, 2, 3]
    assert cache.chat_ids(("b",), encode(5)) == list(range(5))
    assert cache.chat_ids(("a",), encode(4)) == [0, 1, 2, 3] and calls == [4, 5]  # kept, and now the newest
    assert cache.chat_ids(("c",), encode(3)) == [0, 1, 2]  # 12 ids > 10: the oldest ("b") goes
    assert list(cache.chats) == [("a",), ("c",)] and cache.held == 7
    assert cache.chat_ids(("d",), encode(20)) == list(range(20))  # larger than the bound: kept alone
    assert list(cache.chats) == [("d",)] and cache.held == 20
    cache.bound_to("tokenizer B")  # another tokenizer: nothing of A's is answered
    assert not cache.chats and cache.held == 0
    cache.chat_ids(("d",), encode(20))
    assert calls == [4, 5, 3, 20, 20]


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
@pytest.mark.parametrize("spec", ["fp8_e4m3:per_head:calibrated", "fp8_e5m2:warmup"])
def test_calibration_scales_equal_full_logit_passes(loaded, arch, spec, monkeypatch):
    # The observer passes skip the LM head at all but the last position; the K/V they observe, so the scales,
    # must be exactly those of a pass that computes every position's logits (bit for bit: same ops on K/V).
    model = loaded[arch]
    path = parse_path(spec)
    fast = model._compute_scales(path)
    monkeypatch.setattr(InProcessModel, "_observe", lambda self, ids, cache: self._forward(ids, cache))
    full = dataclasses.replace(model, _scales={})._compute_scales(path)
    for side in ("k", "v"):
        found, expected = getattr(fast, side), getattr(full, side)
        assert found.keys() == expected.keys()
        for layer in expected:
            assert torch.equal(found[layer], expected[layer]), (arch, spec, side, layer)


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
@pytest.mark.parametrize("source", ["calibrated", "warmup"])
def test_paths_of_one_scale_source_share_its_passes_and_get_their_own_scales(loaded, arch, source, monkeypatch):
    """A per-tensor and a per-head path (and another format) of one scale source run its observer passes once; each
    path's scales equal, bit for bit, those of a model that computed that path's alone (amax is exact: per tensor
    is the max over heads). A hadamard path observes rotated K: passes of its own."""
    model = dataclasses.replace(loaded[arch], _scales={})
    passes = []
    real = InProcessModel._observe
    monkeypatch.setattr(InProcessModel, "_observe", lambda self, ids, cache: passes.append(1) or real(self, ids, cache))
    specs = [f"fp8_e4m3:{source}", f"fp8_e4m3:per_head:{source}", f"fp8_e5m2:{source}"]
    shared = {spec: model._compute_scales(parse_path(spec)) for spec in specs}
    one_set = len(passes)
    assert one_set >= 1
    for spec in specs:
        alone = dataclasses.replace(loaded[arch], _scales={})._compute_scales(parse_path(spec))
        for side in ("k", "v"):
            found, expected = getattr(shared[spec], side), getattr(alone, side)
            assert found.keys() == expected.keys() and found
            for layer in expected:
                assert torch.equal(found[layer], expected[layer]), (arch, spec, side, layer)
    assert len(passes) == one_set * (1 + len(specs))  # the shared set once, then each path alone
    model._compute_scales(parse_path(f"fp8_e4m3:{source}:hadamard"))
    assert len(passes) == one_set * (2 + len(specs))


def test_phase_timeline_lists_each_thread_in_time_without_the_store_writers():
    """phase_time --timeline (how session 40 found which model's thread a GPU run waits for): per thread, each phase
    and path once, its first start and last end from the process's start, summed seconds and calls; the store's
    writer threads overlap everything and are left out, as in the phase table."""
    from benchmarks import phase_time

    events = [("model-replay-1", "candidate_waves", "fp8_e4m3", 12.0, 12.5),
              ("model-replay-0", "reference_waves", "", 11.0, 11.6),
              ("asyncio_0", "store_writes", "", 11.2, 11.3),
              ("model-replay-0", "candidate_waves", "fp8_e4m3", 11.6, 12.0),
              ("model-replay-1", "candidate_waves", "fp8_e4m3", 13.0, 13.25),
              ("MainThread", "verdicts", "", 14.0, 14.5)]
    lines = phase_time.timeline(events, started=10.0).splitlines()
    assert lines[2:] == ["| model-replay-0 | reference_waves |  | 1.00 | 1.60 | 0.60 | 1 |",
                         "| model-replay-0 | candidate_waves | fp8_e4m3 | 1.60 | 2.00 | 0.40 | 1 |",
                         "| model-replay-1 | candidate_waves | fp8_e4m3 | 2.00 | 3.25 | 0.75 | 2 |",
                         "| MainThread | verdicts |  | 4.00 | 4.50 | 0.50 | 1 |"]


def test_phase_timeline_refuses_a_cpu_run(monkeypatch, capsys):
    """A CPU run replays in worker processes, which the timer in this process does not see: refused as input."""
    from benchmarks import phase_time

    monkeypatch.setattr(phase_time.sys, "argv", ["phase_time.py", "--timeline"])
    with pytest.raises(SystemExit) as stopped:
        phase_time.main()
    assert stopped.value.code == 2 and "no --device cpu" in capsys.readouterr().err


def test_phase_timer_names_functions_that_exist_and_nests():
    # benchmarks/phase_time.py skips a phase whose function an older tree lacks: in this tree none may be missing
    from benchmarks import phase_time

    for name, owner, attribute in phase_time.PHASES:
        assert (attribute in owner.__dict__) if isinstance(owner, type) else hasattr(owner, attribute), name
    clock = phase_time.PhaseClock()
    ticks = iter([0.0, 1.0, 3.0, 3.0, 3.5, 4.0, 4.0, 10.0])  # outer 0..10; inner 1..3, then 3..4 with itself inside

    def fake_clock():
        return next(ticks)

    original, phase_time.time.perf_counter = phase_time.time.perf_counter, fake_clock
    try:
        outer = clock.enter("outer")
        inner = clock.enter("inner")
        clock.leave(inner)
        again = clock.enter("inner")
        nested = clock.enter("inner")  # a phase inside itself counts once
        clock.leave(nested)
        clock.leave(again)
        clock.leave(outer)
    finally:
        phase_time.time.perf_counter = original
    assert clock.inclusive == {"inner": 3.0, "outer": 10.0} and clock.exclusive == {"inner": 3.0, "outer": 7.0}


def test_pass_count_names_each_pass_by_model_path_and_how_it_ran(monkeypatch):
    """`phase_time.py --passes`: a generation's passes under its path, a pass outside any engine call under
    "(outside)"; one prefill and one pass per decode step after the first token (the CPU decodes eagerly)."""
    from benchmarks import phase_time
    from harness.replay.batched import BatchedEngine
    from harness.run_config import CANARY_WEIGHTS

    count = phase_time.PassCount()
    count.install(monkeypatch.setattr)
    model = InProcessModel.load(CANARY_WEIGHTS / "gqa")
    rows = BatchedEngine(model.backend(parse_path("fp8_e4m3"))).generate([[5, 6, 7], [8, 9]], 4)
    model.model(input_ids=torch.tensor([[5, 6]]))
    steps = max(len(row.token_ids) for row in rows)
    assert count.counts == {("gqa", "fp8_e4m3", "eager"): steps, ("gqa", "(outside)", "eager"): 1}, count.counts
    assert "| gqa | fp8_e4m3 | " + str(steps) + " | 0 | 0 |" in count.table()


def test_encoding_cache_from_threads_keeps_its_bound_and_answers():
    from concurrent.futures import ThreadPoolExecutor

    cache = EncodingCache(max_tokens=20).bound_to("tokenizer")  # 28 ids asked for in all: evictions happen

    def ask(i: int) -> bool:
        n = 1 + i % 7
        return cache.chat_ids((n,), lambda: list(range(n))) == list(range(n))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(ask, range(2000)))
    assert cache.held == sum(len(ids) for ids in cache.chats.values()) <= 20


@pytest.mark.parametrize("arch", ["gqa", "mla", "hybrid"])
@pytest.mark.parametrize("spec", [None, "bf16", "fp8_e4m3:per_head:calibrated", "fp8_e5m2:raw_prefill",
                                  "fp8_e4m3:per_token"])
def test_scoring_after_generation_reuses_the_prefill_bit_for_bit(loaded, arch, spec):
    """`score_sync` on the prompt `generate_sync` just decoded from starts from the kept post-prefill cache and
    logits: the log-probs must equal a scoring from scratch exactly (the same forward pass on the same input),
    on every cache kind (GQA, MLA latent, the hybrid's linear-attention state) and FP8 write mode."""
    model = loaded[arch]
    backend = model.backend(parse_path(spec) if spec else None)
    messages, continuation = CHATS[2], [5, 6, 7, 8]
    fresh = backend.score_sync(messages, continuation)
    backend.generate_sync(messages, 6)
    assert list(backend.prefills.entries) == [tuple(model.encode_chat(messages))]
    kept = backend.score_sync(messages, continuation)
    assert not backend.prefills.entries and backend.prefills.held == 0  # used once, then dropped
    assert torch.equal(fresh.logprobs, kept.logprobs)


def test_prefill_memo_keeps_its_byte_bound():
    from harness.replay.inprocess import PrefillMemo

    memo = PrefillMemo(max_bytes=10)
    for i in range(4):
        memo.put((i,), [torch.zeros(1)], torch.zeros(1, 3), size=4)
    assert list(memo.entries) == [(2,), (3,)] and memo.held == 8  # oldest dropped first
    memo.put((9,), [torch.zeros(1)], torch.zeros(1, 3), size=11)  # larger than the bound: not kept
    assert (9,) not in memo.entries and memo.take((9,)) == (None, None)
    cache, last = memo.take((3,))
    assert cache == [torch.zeros(1)] and last.shape == (1, 3) and memo.held == 4


def test_a_model_directory_is_hashed_again_only_when_a_file_changed(tmp_path, monkeypatch):
    """`sha256_of_dir` is asked by every path's description: the digest of unchanged files is kept, and a file whose
    bytes (so its size or modification time) changed is read again; the digest is sha256 over names and bytes."""
    import hashlib
    import os

    from harness.replay import inprocess

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "notes.txt").write_text("not hashed")
    reads = []
    real = type(tmp_path).read_bytes
    monkeypatch.setattr(type(tmp_path), "read_bytes", lambda self: reads.append(self.name) or real(self))
    want = hashlib.sha256(b"config.json{}model.safetensors" + b"\0" * 64).hexdigest()
    assert inprocess.sha256_of_dir(tmp_path) == want and len(reads) == 2
    assert inprocess.sha256_of_dir(tmp_path) == want and len(reads) == 2  # kept
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 64)  # same size: the modification time tells
    stat = (tmp_path / "model.safetensors").stat()
    os.utime(tmp_path / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = hashlib.sha256(b"config.json{}model.safetensors" + b"\1" * 64).hexdigest()
    assert inprocess.sha256_of_dir(tmp_path) == changed and len(reads) == 4
