"""pytest plugin: `pytest harness` collects one item per model x scenario x path (`gqa::canary-arith-1::fp8_e4m3`)
and passes or fails each on the run's verdicts (harness/analysis/verdicts.py).

Registered as the `harness.pytest_plugin` pytest11 entry point, so once fp8-harness is installed `pytest harness`
works from any directory (a bare `harness` argument that is no local path means the installed package); in this
repository the root conftest.py loads it. Items are collected only when the harness package directory is named
on the command line, so an ordinary `pytest` (testpaths = tests) never replays scenarios.

Each model is replayed once per process, on its first item, over the selected scenarios and paths, into a part
run; with `pytest -n N` (pytest-xdist) each worker does the same for the models its items belong to, one GPU per
worker with `--gpu` when there are several; the plugin's scheduler sends all items of a model to one worker, so
each model is replayed once. At session end the parts are merged into one stored run, its report written,
and with `--baseline RUN` the compare report too; a regression fails the session (exit 1).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import uuid
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent
RUN_ENV = "FP8_HARNESS_PYTEST_RUN"  # the session's run directory, shared with xdist workers
ENDPOINT_MODEL = "endpoint"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fp8-harness", "fp8-harness (`pytest harness`)")
    group.addoption("--gpu", action="store_true",
                    help="CUDA and our Triton kernels (an error when torch sees no CUDA device); also runs the "
                         "repository's gpu-marked tests")
    group.addoption("--model", action="append", metavar="DIR", help="model directory (repeatable; default: canaries)")
    group.addoption("--scenarios", action="append", metavar="PATH", help="scenario file or directory (repeatable)")
    group.addoption("--paths", metavar="SPECS", help="comma-separated KV path specs (default: the healthy defaults)")
    group.addoption("--yardstick", metavar="SPEC",
                    help="the accepted path the verdicts' divergence ratios divide by, replayed in the same run "
                         "(default: fp8_e4m3:calibrated; 'none': absolute limits only), as harness run's flag")
    group.addoption("--reference-endpoint", metavar="URL", help="OpenAI-compatible server with the BF16 cache")
    group.addoption("--candidate-endpoint", action="append", metavar="[LABEL=]URL", help="server(s) to check")
    group.addoption("--judge-endpoint", metavar="URL", help="OpenAI-compatible server whose model grades replies")
    from harness.cli import _positive_seconds  # the same check as harness run's flag: a usage error, exit 4

    group.addoption("--request-timeout", type=_positive_seconds, default=120.0, metavar="SECONDS",
                    help="endpoints: one HTTP attempt, connect to last byte (default: 120; in the run's manifest)")
    group.addoption("--report-dir", metavar="DIR", default="runs", help="where the stored run goes (default: runs)")
    group.addoption("--baseline", metavar="RUN", help="stored run to compare with; a regression fails the session")
    group.addoption("--threshold", action="append", metavar="METRIC:LIMIT", help="verdict limit override (repeatable)")
    group.addoption("--attention", choices=["isolated", "end-to-end"],
                    help="also capture attention-score error (in-process models); a failure then names the worst "
                         "layer and head")


def pytest_load_initial_conftests(early_config, parser, args: list[str]) -> None:
    """`pytest harness` outside this repository: the bare word means the installed package."""
    for i, arg in enumerate(args):
        if arg.rstrip("/") == "harness" and not os.path.exists(arg):
            args[i] = str(PACKAGE_DIR)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("gpu"):
        import torch

        if not torch.cuda.is_available():
            pytest.exit(f"--gpu given but torch {torch.__version__} sees no CUDA device: refusing to run "
                        "(a GPU job that lost its GPU must not pass)", returncode=2)
    if not _harness_requested(config):
        return
    if not hasattr(config, "workerinput") and RUN_ENV not in os.environ:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        os.environ[RUN_ENV] = str(Path(config.getoption("report_dir")).resolve() / f"pytest-{stamp}-{uuid.uuid4().hex[:6]}")
    config.stash[SESSION] = HarnessSession(config)


def _harness_requested(config: pytest.Config) -> bool:
    base = Path(config.invocation_params.dir)
    return any((base / arg.split("::")[0]).resolve() == PACKAGE_DIR for arg in config.args)


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector):
    if Path(path).resolve() == PACKAGE_DIR and SESSION in parent.config.stash:
        return HarnessDirectory.from_parent(parent, path=path)
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SESSION in config.stash:
        config.stash[SESSION].select([i for i in items if isinstance(i, ScenarioItem)])


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; never called without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `pytest harness -n N`, all items of one model go to one worker, which replays that model once.
    (xdist's `xdist_group` marks cannot do it on pytest 9: its node-id suffix is no longer read back.)"""
    if SESSION not in config.stash or config.getvalue("dist") not in ("load", "loadscope"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModelScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("::")  # .../harness::MODEL::SCENARIO::PATH; other tests keep their module scope
            return f"model {parts[-3]}" if len(parts) >= 4 else super()._split_scope(nodeid)

    return ModelScheduling(config, log)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    harness = session.config.stash.get(SESSION, None)
    if harness is None or hasattr(session.config, "workerinput"):
        return
    if harness.finish(session) and session.exitstatus == 0:
        session.exitstatus = 1
    if harness.incomplete:
        session.exitstatus = 3  # docs/CONTRACTS.md: an incomplete run wins over a failed verdict


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    harness = config.stash.get(SESSION, None)
    if harness is not None and harness.lines:
        terminalreporter.section("fp8-harness")
        for line in harness.lines:
            terminalreporter.write_line(line)


# ---------------------------------------------------------------- the session


class HarnessSession:
    """What the session replays (models, scenarios, paths), the part runs this process made, and the end."""

    def __init__(self, config: pytest.Config):
        from harness import job

        self.config = config
        self.run_dir = Path(os.environ[RUN_ENV])
        self.reference = config.getoption("reference_endpoint")
        self.candidates = tuple(config.getoption("candidate_endpoint") or ())
        if bool(self.reference) != bool(self.candidates):
            raise pytest.UsageError("--reference-endpoint and --candidate-endpoint go together")
        self.models = () if self.reference else tuple(Path(m) for m in config.getoption("model") or ()) \
            or job.default_models()[0]
        self.scenario_paths = tuple(Path(s) for s in config.getoption("scenarios") or ()) or job.default_scenarios()
        self.path_spec = config.getoption("paths") or job.DEFAULT_PATHS
        self.thresholds = tuple(config.getoption("threshold") or ())
        self.selected: dict[str, dict] = {}  # model label -> {"scenarios": [...], "paths": [...]}
        self.parts: dict[str, Path] = {}  # model label -> part run directory (this process)
        self.lines: list[str] = []
        self.incomplete = False  # --baseline (or this session's run) did not finish every unit: exit 3

    def items(self, parent: pytest.Collector):
        from harness import job
        from harness.analysis.verdicts import parse_threshold_overrides
        from harness.run_inputs import candidate_labels
        from harness.scenarios.sources import load_scenarios

        try:
            parse_threshold_overrides(self.thresholds)
            if self.config.getoption("yardstick") not in (None, "none"):
                job.parse_kv_paths(self.config.getoption("yardstick"))  # a bad spec: the same one line as --paths
            scenarios = load_scenarios(list(self.scenario_paths))
            if self.reference:
                targets = [(ENDPOINT_MODEL, None, [label for label, _ in candidate_labels(self.candidates)])]
            else:
                paths = [p.name for p in job.parse_kv_paths(self.path_spec)]
                targets = [(job.model_label(m), m, paths) for m in self.models]
        except Exception as error:  # a bad scenario file, path spec or threshold: one clear line, exit 2
            pytest.exit(f"fp8-harness: {error}", returncode=2)
        for label, directory, paths in targets:
            for scenario in scenarios:
                for path in paths:
                    item = ScenarioItem.from_parent(parent, name=f"{label}::{scenario.id}::{path}", model=label,
                                                    model_dir=directory, scenario=scenario.id, kv_path=path)
                    yield item

    def select(self, items: list["ScenarioItem"]) -> None:
        for item in items:
            chosen = self.selected.setdefault(item.model, {"dir": item.model_dir, "scenarios": [], "paths": []})
            for field, value in (("scenarios", item.scenario), ("paths", item.kv_path)):
                if value not in chosen[field]:
                    chosen[field].append(value)

    def device(self) -> str:
        if not self.config.getoption("gpu"):
            return "cpu"
        import torch

        worker = getattr(self.config, "workerinput", {}).get("workerid", "gw0")
        return f"cuda:{int(worker.lstrip('gw') or 0) % torch.cuda.device_count()}"

    def part(self, model: str) -> Path:
        """Replay `model` over the selected scenarios and paths once in this process; the part's directory."""
        if model not in self.parts:
            from harness import job
            from harness.run_config import build_run_config

            chosen = self.selected[model]
            worker = getattr(self.config, "workerinput", {}).get("workerid", "main")
            out = self.run_dir.with_name(self.run_dir.name + ".parts") / f"{worker}-{model}"
            self.parts[model] = out
            config = build_run_config(
                models=() if self.reference else (Path(chosen["dir"]),), scenario_paths=self.scenario_paths, paths=",".join(chosen["paths"]),
                out=out, device=self.device(), reference_url=self.reference, candidate_urls=self.candidates,
                judge_url=self.config.getoption("judge_endpoint"), thresholds=self.thresholds,
                yardstick=self.config.getoption("yardstick"),
                scenario_ids=tuple(chosen["scenarios"]), attention=self._attention(),
                request_timeout_s=self.config.getoption("request_timeout"),
                command=["pytest", *self.config.invocation_params.args])
            job.run_job(config, warn=lambda message: print(message, file=sys.stderr))
        return self.parts[model]

    def _attention(self):
        mode = self.config.getoption("attention")
        if mode is None:
            return None
        from harness.replay.attention import AttentionOptions

        return AttentionOptions(mode=mode)  # harness run --attention's default sample: 8 heads x 16 rows

    def finish(self, session: pytest.Session) -> bool:
        """Merge the parts into one run, write its report (and compare); True when compare found a regression or a
        per-path check (harness.analysis.verdicts.compute_path_verdicts) failed."""
        parts = sorted(p for p in self.run_dir.with_name(self.run_dir.name + ".parts").glob("*")
                       if (p / "manifest.json").exists())
        if not parts:
            return False
        from harness import job
        from harness.runs.gate import write_verdicts
        from harness.runs.merge import merge_runs

        from harness.run_config import stored_command

        store = merge_runs(parts, self.run_dir, stored_command(["pytest", *self.config.invocation_params.args]))
        matrix = write_verdicts(store, list(self.thresholds))
        self.lines += [f"stored run: {self.run_dir}", f"report: {job.write_report(self.run_dir)}"]
        # per-path checks (pooled KL vs the yardstick, paired recovery, degeneration rate) belong to no item
        whole = [(m, p) for m, paths in matrix.items() for p, cell in paths.items()
                 if (cell.get("path") or {}).get("verdict") == "fail"]
        self.lines += [f"VERDICT FAIL (per-path check): {m} {p}: " + "; ".join(
            r["message"] for r in matrix[m][p]["path"]["reasons"] if r["severity"] == "fail") for m, p in whole]
        baseline = self.config.getoption("baseline")
        if not baseline:
            return bool(whole)
        from harness.runs.compare import compare_runs
        from harness.runs.read import IncompleteRunError

        try:
            result = compare_runs(baseline, self.run_dir, out_dir=self.run_dir / "compare")
        except IncompleteRunError as error:
            self.lines.append(f"NOT COMPARED with {baseline}: {error}")
            self.incomplete = True
            return bool(whole)
        self.lines += [f"compare with {baseline}: {result.summary_line}", f"compare report: {result.report_path}"]
        return result.regressed or bool(whole)


SESSION = pytest.StashKey[HarnessSession]()


# ---------------------------------------------------------------- collectors and items


class HarnessDirectory(pytest.Directory):
    def collect(self):
        yield from self.config.stash[SESSION].items(self)


class VerdictFailure(Exception):
    def __init__(self, diagnoses: list[str]):
        super().__init__("\n\n".join(diagnoses))
        self.diagnoses = diagnoses


class ScenarioItem(pytest.Item):
    def __init__(self, *, model: str, model_dir: Path | None, scenario: str, kv_path: str, **kwargs):
        super().__init__(**kwargs)
        self.model, self.model_dir, self.scenario, self.kv_path = model, model_dir, scenario, kv_path

    def runtest(self) -> None:
        from harness.analysis.verdicts import diagnosis
        from harness.runs.gate import run_verdicts
        from harness.runs.store import RunStore

        part = self.config.stash[SESSION].part(self.model)
        rows = [r for r in run_verdicts(part)
                if (r["model"], r["scenario"], r["path"]) == (self.model, self.scenario, self.kv_path)]
        if not rows:
            raise VerdictFailure([f"{self.name}: no verdict: the unit produced nothing (see {part}/errors.jsonl)"])
        failing = [r for r in rows if r["verdict"] == "fail"]
        if failing:
            store = RunStore(part)
            texts = {(t["model"], t["scenario"], t["path"], t["turn"]): t for t in store.read("texts")
                     if t["model"] == self.model and t["scenario"] == self.scenario}
            turn_metrics: dict[tuple, dict] = {}
            for r in store.read("records"):
                if (r["model"], r["scenario"], r["path"]) == (self.model, self.scenario, self.kv_path):
                    turn_metrics.setdefault((r["model"], r["scenario"], r["path"], r["turn"]), {})[r["metric"]] = r["value"]
            raise VerdictFailure([diagnosis(r, texts, turn_metrics) for r in failing])

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, VerdictFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, self.name
