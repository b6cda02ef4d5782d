"""One model's replay in this process: load it, note what the run needs to know of it (model, family, scales,
routes, layout), and replay a task's units into a store. Every executor runs a task through here, whichever
process, GPU or Ray actor it lands on (`harness/executor`).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

from harness.kv_paths.spec import KVPath
from harness.replay.route import LAYERS_GRAPH, TENSOR_DECODE
from harness.replay.runner import REFERENCE, Replay
from harness.runs.store import RunStore
from harness.types import Scores

SHARDED_DECODE = f"batched; graph decode records {LAYERS_GRAPH}"
TENSOR_PARALLEL_DECODE = f"batched in lockstep, dynamic decode (static and graph decode refused: {TENSOR_DECODE})"


def model_label(directory: Path) -> str:
    return Path(directory).name


def say_on_stderr(message: str) -> None:
    """A worker's warnings: the parent's terminal, not its progress bar."""
    print(message, file=sys.stderr)


def load_model(config, directory: Path, calibration_chats, cache: dict | None = None):
    """`directory`'s model on `config.device` (laid out as `config.shard`), with the run's calibration chats and
    scales file; kept in `cache` (by directory) when given, so a warm worker loads each model once."""
    from harness.replay.inprocess import InProcessModel

    loaded = cache.get(str(directory)) if cache is not None else None
    if loaded is None:
        if config.device.startswith("cuda:") and config.shard != "tensor":  # a rank set its own GPU (init_rank)
            from harness.replay.devices import device_list

            torch.cuda.set_device(device_list(config.device)[0])  # a sharded model: its first GPU (each layer: its own)
        loaded = InProcessModel.load(directory, device=config.device, shard=config.shard)
        if cache is not None:
            cache[str(directory)] = loaded
    loaded.calibration_chats = calibration_chats
    loaded.scales_file = config.scales_file
    return loaded


def replay_model(config, directory: Path, scenarios, calibration_chats, store: RunStore, on_unit_done, warn,
                 cache: dict | None = None) -> None:
    """Every unit of `directory`'s model over `scenarios`: its reference and each of its paths (`model_paths`)."""
    loaded = load_model(config, directory, calibration_chats, cache)
    label = model_label(directory)
    note_model(store, label, loaded, warn)
    if loaded.shard_plan is not None:
        note_shards(store, label, loaded.shard_plan, warn)
    if loaded.tensor_parallel:
        note_tensor_parallel(store, label, loaded, warn, config.batched)
    paths = model_paths(config, directory)
    backends = [loaded.backend(path) for path in paths]
    note_scales(store, label, backends)
    note_family(store, label, loaded, paths)
    reference, routes = note_routes(store, config, label, loaded, paths)
    unbatchable = reference.batch_refusal if config.batched else None
    if unbatchable:  # the whole model (its reference too): said, and recorded beside the batch settings
        warn(f"{label}: replayed one sequence at a time: {unbatchable}")
        store.edit_manifest(lambda m: m.setdefault("batching", {}).__setitem__(label, {"off": unbatchable}))
    elif config.batched:
        for path, route in zip(paths, routes):  # only these paths: the rest of the model runs batched
            if route.batch_refusal:
                warn(f"{label}: path {path.name} replayed one sequence at a time: {route.batch_refusal}")
        _replay_batched(config, label, loaded, backends, scenarios, store, on_unit_done)
        return
    reference = loaded.backend(None)
    if config.shard is None:  # the CPU: generations in rows where the routes say so
        reference, replies = in_rows(config, store, label, loaded, None, scenarios)
        replies = {**stored_replies(store, label, scenarios), **(replies or {})}
        backends = [in_rows(config, store, label, loaded, path, scenarios, replies)[0] for path in paths]
    replay = Replay(label, reference, backends, store, config.history_mode, on_unit_done=on_unit_done,
                    attention=config.attention)
    asyncio.run(replay.run(scenarios))


def note_shards(store: RunStore, label: str, plan, warn) -> None:
    """`manifest.parallel` of a layer-sharded run (each model's layer blocks per GPU); how its batches decoded is the
    manifest's `batching[label].decode`."""
    from harness.replay.sharding import layout

    def edit(manifest: dict) -> None:
        parallel = manifest.get("parallel") or layout({})
        parallel["devices"] = list(plan.devices)
        parallel.setdefault("models", {})[label] = plan.describe()
        manifest["parallel"] = parallel

    store.edit_manifest(edit)
    blocks = ", ".join(f"{d}: layers {span}" for d, span in plan.describe()["layers"].items())
    warn(f"{label}: layer-sharded ({blocks}); {SHARDED_DECODE}")


def note_tensor_parallel(store: RunStore, label: str, loaded, warn, batched: bool) -> None:
    """`manifest.parallel.models[label]` of a tensor-parallel rank's model (its heads a rank); batched: its batches
    (the manifest's `batching[label]`, written after the replay) decode dynamically, every rank in lockstep."""
    from harness.replay.tensor_parallel import ONE_AT_A_TIME_RANKS, describe_model, world

    rank, size = world()
    described = describe_model(loaded.model, size)
    store.edit_manifest(lambda manifest: manifest["parallel"].setdefault("models", {}).__setitem__(label, described))
    warn(f"{label}: tensor parallel over {size} ranks ({described['kv_heads_per_rank']} KV heads a rank); "
         f"{TENSOR_PARALLEL_DECODE if batched else ONE_AT_A_TIME_RANKS}")


def note_routes(store: RunStore, config, label: str, loaded, paths: list[KVPath]) -> tuple:
    """The reference's route and each path's on this model (`harness.replay.route`), the paths' stored in the
    manifest's `paths[].routes`. A refusal of the reference's (attention capture) keeps the whole model one
    sequence at a time; a path's own refusal keeps only that path so (`BatchedReplay`)."""
    from harness.replay.route import decide

    def route_of(path: KVPath | None, batched: bool):
        return decide(path, loaded.model.config, loaded.device.type, loaded.use_kernels, batched=batched,
                      decode=config.decode, capture=config.attention is not None, rows=True, shard=config.shard,
                      facts=loaded.facts)

    reference = route_of(None, config.batched)
    whole_model = reference.batch_refusal if config.batched else None
    routes = [route_of(path, config.batched and whole_model is None) for path in paths]
    described = {path.name: {**route.describe(), "batch_refusal": route.batch_refusal or whole_model}
                 for path, route in zip(paths, routes)}

    def edit(manifest: dict) -> None:
        for entry in manifest["paths"]:
            if entry["name"] in described:
                entry.setdefault("routes", {})[label] = described[entry["name"]]

    store.edit_manifest(edit)
    return reference, routes


def _replay_batched(config, label: str, loaded, backends, scenarios, store: RunStore, on_unit_done) -> None:
    from harness.replay.batched import BatchSettings
    from harness.replay.batched_runner import BatchedReplay

    settings = BatchSettings(config.batch_size, config.kernel_check_every, config.decode)
    replay = BatchedReplay(label, loaded.backend(None), backends, store, config.history_mode, settings, on_unit_done,
                           attention=config.attention)
    batching = replay.run(scenarios)

    def edit(manifest: dict) -> None:
        manifest.setdefault("batching", {})[label] = batching
        for fallback in batching["one_at_a_time_fallbacks"]:
            manifest["warnings"].append(f"model {label}: batched replay failed, ran one at a time: {fallback}")

    store.edit_manifest(edit)


def model_paths(config, directory: Path) -> list[KVPath]:
    wanted = dict(config.paths_by_model).get(str(directory))
    return [path for path in config.paths if wanted is None or path.name in wanted]


def note_model(store: RunStore, label: str, loaded, warn) -> None:
    described = {"label": label, **loaded.describe()}
    message = f"model {label} has RANDOM WEIGHTS ({loaded.directory}): its answers are noise"

    def edit(manifest: dict) -> None:
        manifest["models"] = [m for m in manifest["models"] if m["label"] != label] + [described]
        if loaded.random_weights and message not in manifest["warnings"]:
            manifest["warnings"].append(message)

    store.edit_manifest(edit)
    if loaded.random_weights:
        warn(f"warning: {message}")


def note_family(store: RunStore, label: str, loaded, paths: list[KVPath]) -> None:
    """Per layer: FP8, kept in BF16 (and why) or a linear/SSM state; attention kinds; kernels (replay/families.py)."""
    from harness.replay.families import route_facts

    facts = route_facts(loaded.model.config, paths)
    store.edit_manifest(lambda m: m.setdefault("families", {}).__setitem__(label, facts))


def note_scales(store: RunStore, label: str, backends) -> None:
    store.edit_manifest(lambda m: m["scales"].__setitem__(label, {b.label: b.describe().get("scales")
                                                                  for b in backends}))


_WORKER_MODELS: dict = {}  # a unit worker's loaded models, by directory (each is loaded once per process)


def unit_task(config, directory: Path, path_name: str | None, scenarios, calibration_chats,
              shared_scores: dict | None = None) -> dict | None:
    """One task of the CPU's process pool (`local.CpuTasks`): the model's reference (path_name None; returns its
    teacher-forced scores), or one path of it on the stored reference and those scores (scenarios whose reference
    failed stay unfinished, as `Replay` leaves them)."""
    from harness.replay.batched_runner import PrecomputedBackend

    store = RunStore.attach(config.out)
    label = model_label(directory)
    loaded = load_model(config, directory, calibration_chats, _WORKER_MODELS)
    if path_name is None:
        note_model(store, label, loaded, say_on_stderr)
        note_family(store, label, loaded, model_paths(config, directory))
        reference, _ = in_rows(config, store, label, loaded, None, scenarios)
        asyncio.run(Replay(label, reference, [], store, config.history_mode).run(scenarios))
        # scored by the backend that generated: each turn's prefill, kept for scoring its prompt, is reused
        inner = getattr(reference, "inner", reference)
        return as_arrays(reference_scores(RunStore.attach(config.out), label, inner, scenarios))
    path = next(p for p in config.paths if p.name == path_name)
    note_routes(store, config, label, loaded, [path])
    ready = [s for s in scenarios if store.is_done(label, s.id, REFERENCE)]
    backend, _ = in_rows(config, store, label, loaded, path, ready, stored_replies(store, label, ready))
    store.edit_manifest(lambda m: m["scales"].setdefault(label, {}).__setitem__(backend.label,
                                                                               backend.describe().get("scales")))
    reference = PrecomputedBackend(loaded.backend(None), REFERENCE)
    reference.scores = as_scores(shared_scores or {})
    asyncio.run(Replay(label, reference, [backend], store, config.history_mode,
                       attention=config.attention).run(ready))
    return None


def in_rows(config, store: RunStore, label: str, loaded, path: KVPath | None, scenarios,
            reference_replies: dict | None = None) -> tuple:
    """(backend, its replies or None): `loaded`'s backend of `path` (None: the reference) for a replay that is not
    batched. Where the route says rows (`route.ROWS`: the CPU), the turns of `scenarios` not yet stored are generated
    first in rows (`batched_runner.rows_replies`: one sequence's bits, decode steps batched) and `Replay` reads them
    from the returned `PrecomputedBackend`; reference_replies: the reference's, for a path on the reference's history.
    If the rows engine fails, the run names why and `Replay` generates what is missing one sequence at a time."""
    from harness.replay.batched_runner import PrecomputedBackend, rows_replies
    from harness.replay.route import ROWS, decide
    from harness.replay.runner import end_in_lockstep, in_lockstep

    inner = loaded.backend(path)
    route = decide(path, loaded.model.config, loaded.device.type, loaded.use_kernels, decode=config.decode,
                   capture=config.attention is not None, rows=True, shard=config.shard, facts=loaded.facts)
    history = None if path is None or config.history_mode == "own-history" else reference_replies
    if route.decode != ROWS or (path is not None and config.history_mode != "own-history" and history is None):
        return inner, None
    backend = PrecomputedBackend(inner, inner.label)
    name = REFERENCE if path is None else inner.label
    todo = [s for s in scenarios if not store.is_done(label, s.id, name) and (history is None or s.id in history)]
    try:
        return backend, rows_replies(backend, todo, history)
    except Exception as error:  # noqa: BLE001 - named in the run; what was generated stays, Replay makes the rest
        if in_lockstep():  # a tensor-parallel rank: the others wait in this rank's collectives (runner.in_lockstep)
            end_in_lockstep(error)
        why = f"model {label}: {name} replayed one sequence at a time, rows failed: {type(error).__name__}: {error}"
        store.edit_manifest(lambda m: m["warnings"].append(why[:300]))
        return backend, None


def stored_replies(store: RunStore, label: str, scenarios) -> dict:
    """{scenario id: [TurnReply]} of the reference's stored turns."""
    from harness.replay.runner import TurnReply

    texts = [r for r in store.read("texts") if r["model"] == label and r["path"] == REFERENCE]
    replies = {s.id: [] for s in scenarios}
    for r in sorted(texts, key=lambda r: r["turn"]):
        if r["scenario"] in replies:
            replies[r["scenario"]].append(TurnReply(r["turn"], r["user"], r["token_ids"], r["text"],
                                                    r.get("fixed", False)))
    return replies


def as_arrays(scores: dict) -> dict:
    """Scores as numpy arrays for the trip between processes: a torch tensor crosses a process pool through shared
    memory and a file descriptor handed over by `multiprocessing.resource_sharer`, whose thread printed a traceback
    when the run was interrupted mid-handover (a flaky Ctrl-C test); an array is pickled by value, same bits."""
    return {key: (None if s.logprobs is None else s.logprobs.numpy(), s.top_logprobs, s.unavailable)
            for key, s in scores.items()}


def as_scores(arrays: dict) -> dict:
    return {key: Scores(None if logprobs is None else torch.from_numpy(logprobs), top, unavailable)
            for key, (logprobs, top, unavailable) in arrays.items()}


# Reference log-probs a reference task hands its path tasks (float32 [T, V] per turn): a memory bound, not a tuning
# knob (the canaries' whole default run holds ~1 MB; past the bound a path task scores the rest itself, as before)
SHARED_SCORE_BYTES = 1 << 30


def reference_scores(store: RunStore, label: str, reference, scenarios) -> dict:
    """{(prompt ids, reply ids): Scores} of every generated reference turn, keyed as `PrecomputedBackend` asks:
    what `Replay` computes once per turn for all of a model's paths (`reference.score_sync`, same inputs)."""
    from harness.replay.runner import _messages

    done = [s for s in scenarios if store.is_done(label, s.id, REFERENCE)]
    stored = stored_replies(store, label, done)
    scores, held = {}, 0
    for scenario in done:
        replies = stored[scenario.id]
        for turn, reply in enumerate(replies):
            if reply.fixed or held >= SHARED_SCORE_BYTES:
                continue
            messages = _messages(scenario, replies, turn)
            scored = reference.score_sync(messages, reply.token_ids)
            scores[(tuple(reference.owner.encode_chat(messages)), tuple(reply.token_ids))] = scored
            held += scored.logprobs.numel() * 4
    return scores
