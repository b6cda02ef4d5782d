"""The CPU replay's tasks (harness/executor/local.py `CpuTasks`): a model's reference task stores the
reference and scores its turns once; each path task replays one path on the stored reference and those scores."""

from pathlib import Path

from harness import job
from harness.executor.model_replay import unit_task
from harness.replay import inprocess
from harness.runs.store import RunStore
from harness.scenarios.sources import load_scenarios

SCENARIOS = Path(__file__).parent / "data" / "scenarios" / "smoke.yaml"


def test_path_tasks_use_the_reference_tasks_scores(tiny_models, tmp_path, monkeypatch):
    scored, real = [], inprocess.InProcessBackend.score_sync

    def counting(self, messages, continuation_ids):
        scored.append(self.label)
        return real(self, messages, continuation_ids)

    monkeypatch.setattr(inprocess.InProcessBackend, "score_sync", counting)
    model = Path(tiny_models["gqa"])
    config = job.RunConfig(models=(model,), scenario_paths=(SCENARIOS,), paths=job.parse_kv_paths("fp8_e4m3"),
                           out=tmp_path / "run", jobs=2)
    scenarios = load_scenarios([SCENARIOS])
    RunStore.create(config.out, job._manifest(config, scenarios))
    shared = unit_task(config, model, None, scenarios, [])
    generated = sum(1 for s in scenarios for t in s.turns if t.assistant is None)
    assert scored.count("reference") == generated == len(shared)
    scored.clear()
    for path in ("bf16", "fp8_e4m3"):
        unit_task(config, model, path, scenarios, [], shared)
    assert scored == ["bf16"] * generated + ["fp8_e4m3"] * generated  # no reference turn scored again
    store = RunStore.attach(config.out)
    assert all(store.is_done("gqa", s.id, p) for s in scenarios for p in ("reference", "bf16", "fp8_e4m3"))
    manifest = store.read_manifest()
    assert list(manifest["scales"]["gqa"]) == ["bf16", "fp8_e4m3"]
    assert {p["name"]: sorted(p["routes"]) for p in manifest["paths"]} == {"bf16": ["gqa"], "fp8_e4m3": ["gqa"]}
