"""A run against live servers (OpenAI-compatible endpoints): the reference and candidate servers opened, their
capabilities checked before the manifest is written, scenarios replayed with asyncio concurrency (the servers batch
and shard for themselves), what each server was found to do noted in the manifest."""

from __future__ import annotations

from pathlib import Path

from harness.replay.live import candidate_labels
from harness.replay.runner import Replay
from harness.runs.store import RunStore

ENDPOINT_MODEL = "endpoint"  # the model label of runs against live servers
# What the client knows of an endpoint's route: the server decides kernels and batching, and does not say
ENDPOINT_ROUTE = {"decode_kernel": "the server's (not observable from the client)", "batched": None,
                  "batch_refusal": None, "batch_floor": None, "decode": "the server's", "capture": None}


async def replay_endpoints(config, scenarios, store: RunStore, bar) -> None:
    from harness.replay import live

    reference, candidates = open_endpoints(config, store.directory / "http-cache")
    servers = [b for b in (reference, *candidates) if b is not None]
    _carry_failed_attempts(store.read_manifest(), reference, candidates)
    try:
        await live.preflight(servers)  # capabilities are known before the manifest is written
        _note_endpoints(store, config, reference, candidates, live.degraded(servers))
        await _endpoint_replay(config, reference, candidates, store, bar).run(scenarios,
                                                                             concurrency=config.concurrency)
        _note_endpoints(store, config, reference, candidates, live.degraded(servers))
    finally:
        for backend in servers:
            await backend.aclose()


def _endpoint_replay(config, reference, candidates, store: RunStore, bar) -> Replay:
    """Reference and candidates (each candidate turn also against itself with --self-consistency), or with no
    reference the candidates' self-consistency alone."""
    done = bar.update if bar else None
    if reference is None:
        from harness.replay.runner import SelfConsistencyReplay

        return SelfConsistencyReplay(ENDPOINT_MODEL, candidates, store, on_unit_done=done)
    return Replay(ENDPOINT_MODEL, reference, candidates, store, config.history_mode, on_unit_done=done,
                  self_consistency=config.self_consistency)


async def preflight_endpoints(config) -> None:
    """`PreflightError` (exit 2) naming every server, judge included, that cannot serve the run."""
    from harness.replay import live

    reference, candidates = open_endpoints(config, None)
    servers = [b for b in (reference, *candidates) if b is not None]
    try:
        await live.preflight(servers)
    finally:
        for backend in servers:
            await backend.aclose()
    if config.judge_url:
        key = live.api_key_env_for("judge", config.api_key_envs, config.api_key_env)
        await live.judge_model(config.judge_url, config.judge_model, key, None, config.request_timeout_s)


def open_endpoints(config, cache_dir: Path | None):
    """The reference (None in a self-consistency-only run) and candidate backends, each with its own model name
    and API key variable."""
    from harness.replay.endpoint import open_endpoint
    from harness.replay.live import api_key_env_for, per_label

    labelled = candidate_labels(config.candidate_urls)
    models = per_label(config.candidate_models, [label for label, _ in labelled], "--candidate-model")
    common = dict(tokenizer=config.tokenizer, seed=config.seed, cache_dir=cache_dir,  # per run: --resume reuses it
                  timeout_s=config.request_timeout_s)
    reference = open_endpoint(config.reference_url, label="reference", model=config.reference_model,
                              api_key_env=api_key_env_for("reference", config.api_key_envs, config.api_key_env),
                              **common) if config.reference_url else None
    key = api_key_env_for("candidate", config.api_key_envs, config.api_key_env)
    candidates = [open_endpoint(url, label=label, model=models.get(label), api_key_env=key, **common)
                  for label, url in labelled]
    return reference, candidates


def endpoint_path_entry(label: str, described: dict) -> dict:
    """A candidate server in `manifest.paths[]`, in the shape of an in-process path: name, canonical, kind, a
    one-line description; what the server was found to do under `endpoint`."""
    served = described.get("model") or "the served model"
    return {"name": label, "canonical": label, "kind": "endpoint",
            "description": f"endpoint {described.get('url')} serving {served} (KV cache as the server keeps it)",
            "endpoint": described}


def _carry_failed_attempts(manifest: dict, reference, candidates) -> None:
    """A --resume's servers start from the failed attempts earlier sessions stored: the count accumulates."""
    stored = {p.get("name"): p.get("endpoint") for p in manifest.get("paths") or [] if isinstance(p, dict)}
    stored["reference"] = next((m.get("reference") for m in manifest.get("models") or []
                                if isinstance(m, dict) and m.get("label") == ENDPOINT_MODEL), None)
    for backend in (b for b in (reference, *candidates) if b is not None):  # no reference: --self-consistency alone
        earlier = stored.get(backend.label)
        count = earlier.get("failed_attempts") if isinstance(earlier, dict) else None
        backend.earlier_failed_attempts = count if isinstance(count, int) and count > 0 else 0


def _note_endpoints(store: RunStore, config, reference, candidates, degraded: list[str]) -> None:
    """The servers as detected (model, capabilities, failed attempts) and what they could not measure."""
    from harness.replay.live import with_earlier_capabilities

    def edit(manifest: dict) -> None:  # a --resume keeps what the earlier session found (issue 28, D6)
        earlier = {p.get("name"): p.get("endpoint") for p in manifest.get("paths") or []}
        earlier["reference"] = next((m.get("reference") for m in manifest.get("models") or []
                                     if m.get("label") == ENDPOINT_MODEL), None)
        described = with_earlier_capabilities(earlier["reference"], reference.describe()) if reference else {}
        manifest["models"] = [{"label": ENDPOINT_MODEL, "path": config.reference_url, "sha256": None,
                               "arch": described.get("model") or "endpoint", "random_weights": False,
                               "reference": described}]
        manifest["paths"] = [{**endpoint_path_entry(b.label, with_earlier_capabilities(earlier.get(b.label),
                                                                                        b.describe())),
                              "routes": {ENDPOINT_MODEL: ENDPOINT_ROUTE}} for b in candidates]
        manifest["warnings"] = [w for w in manifest.get("warnings", []) if w not in degraded] + degraded
        manifest["request_timeout_s"] = config.request_timeout_s

    store.edit_manifest(edit)
