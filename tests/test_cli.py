"""The CLI's report, compare and export commands on the stored runs in tests/data/runs."""

from pathlib import Path
from types import SimpleNamespace

import pandas as pd

from harness.cli import main

RUNS = Path(__file__).parent / "data" / "runs"


def test_compare_exit_code_is_the_ci_signal(tmp_path, capsys):
    assert main(["compare", str(RUNS / "baseline"), str(RUNS / "noise"), "--out", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.startswith("OK: no regression")
    assert main(["compare", str(RUNS / "baseline"), str(RUNS / "regressed"), "--out", str(tmp_path / "b")]) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("REGRESSION") and "\n" not in line  # one line for the CI log


def test_export_and_report(tmp_path, capsys):
    assert main(["export", str(RUNS / "baseline"), "--out", str(tmp_path / "records.csv")]) == 0
    table = pd.read_csv(tmp_path / "records.csv")
    assert {"model", "scenario", "path", "turn", "metric", "value"} <= set(table.columns)
    assert main(["report", str(RUNS / "baseline"), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "index.html").is_file()


def test_missing_run_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not a stored run" in capsys.readouterr().err


# ---------------------------------------------------------------- issue 16: a CLI that selects, helps and stays quiet

import argparse
import io
import itertools
import logging
import re
import subprocess
import sys
import tomllib

import pytest

import harness
from harness import cli
from harness.kv_paths.spec import DEFAULT_PATHS
from harness.runs.library_log import LOG_NAME, quiet_libraries
from harness.scenarios.select import select_models, select_scenarios
from harness.scenarios.sources import load_scenarios

ROOT = Path(__file__).resolve().parents[1]
CANARY_SCENARIOS = ROOT / "scenarios" / "canary" / "default.yaml"


def test_version_matches_the_package(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out.strip() == f"harness {project['version']}" == f"harness {harness.__version__}"


# The `harness` command's exit (`cli.entry`): the process ends without the interpreter's teardown, but with its
# status, its atexit handlers and its flushed output; a thread still running is joined by the ordinary exit.
ENTRY = """
import atexit, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=False))
if "thread" in sys.argv[1]:
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished"))).start()
sys.argv = ["harness", *sys.argv[2].split()]
from harness.cli import entry
print("buffered, not flushed", end=" ")
entry()
"""


@pytest.mark.parametrize("args, status, printed", [
    ("--version", 0, "harness "),
    ("run --scenarios scenarios/no-such-dir", 2, "scenarios/no-such-dir"),
    ("report", 2, "usage: harness report"),
])
@pytest.mark.parametrize("thread", ["", "thread"])
def test_the_harness_command_exits_with_its_status_output_and_atexit_handlers(args, status, printed, thread):
    done = subprocess.run([sys.executable, "-c", ENTRY, thread or "-", args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == status, done.stderr
    assert "buffered, not flushed" in done.stdout and "atexit ran" in done.stdout
    assert printed in done.stdout + done.stderr
    assert ("thread finished" in done.stdout) == bool(thread)


def test_the_console_script_is_the_entry():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["harness"] == "harness.cli:entry"


def all_actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {a.dest}", a) for a in sub._actions)
        else:
            yield action.dest, action


def test_every_option_and_argument_has_help():
    missing = [name for name, action in all_actions(cli._build_parser())
               if not action.help and not isinstance(action, argparse._SubParsersAction)]
    assert missing == []


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_paths_default_in_help_never_breaks_a_spec(columns, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    words = set(re.findall(r"[\w:]+", text))
    assert set(DEFAULT_PATHS.split(",")) <= words  # each default spec whole on one line


def test_compare_threshold_with_unknown_metric_lists_the_valid_ones(tmp_path, capsys):
    assert main(["compare", str(RUNS / "baseline"), str(RUNS / "noise"), "--out", str(tmp_path),
                 "--threshold", "klmax:0.1"]) == 2
    err = capsys.readouterr().err
    assert "unknown metric 'klmax'" in err
    assert all(name in err for name in ("kl_max", "kl_mean", "top1_agree", "answer_correct"))


@pytest.mark.parametrize("terms, ids", [
    (["kind:recall"], ["canary-recall-1", "canary-recall-2", "canary-recall-3"]),
    (["id:canary-arith-1,id:canary-needle-?"], ["canary-arith-1", "canary-needle-1", "canary-needle-2",
                                                "canary-needle-3"]),
    (["tag:long_context"], ["canary-needle-1", "canary-needle-2", "canary-needle-3"]),
    (["chat", "id:canary-arith-2"], ["canary-arith-2", "canary-chat-1", "canary-chat-2", "canary-chat-3"]),
    ([], None),
])
def test_select_scenarios_by_tag_id_or_kind(terms, ids):
    scenarios = load_scenarios([CANARY_SCENARIOS])
    picked = [s.id for s in select_scenarios(scenarios, terms)]
    assert sorted(picked) == (ids or sorted(s.id for s in scenarios))


@pytest.mark.parametrize("terms, message", [(["kind:recal"], "kind:recal matched no scenario"),
                                            (["colour:red"], "unknown field 'colour'"), (["a,,b"], "empty term")])
def test_a_selection_that_cannot_match_is_refused(terms, message):
    with pytest.raises(ValueError, match=message):
        select_scenarios(load_scenarios([CANARY_SCENARIOS]), terms)


def test_run_refuses_a_selection_matching_nothing_before_any_model_loads(tmp_path, capsys):
    code = main(["run", "--scenarios", str(CANARY_SCENARIOS), "--select", "tag:nope", "--out", str(tmp_path / "r"),
                 "--no-progress", "--paths", "bf16"])
    err = capsys.readouterr().err
    assert code == 2 and "tag:nope matched no scenario" in err and "tags: " in err and "long_context" in err


def test_select_models_by_label(tmp_path, capsys):
    dirs = [tmp_path / "gqa", tmp_path / "mla", tmp_path / "hybrid"]
    assert select_models(dirs, ["mla,hybrid"]) == (dirs[1], dirs[2])
    assert select_models(dirs, []) == tuple(dirs)
    with pytest.raises(ValueError, match="no model labelled mistral; the models are gqa, mla, hybrid"):
        select_models(dirs, ["mistral"])
    assert main(["run", "--models", "mistral", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert "no model labelled mistral" in capsys.readouterr().err


@pytest.fixture
def restore_logging():
    from transformers.utils import logging as hf_logging

    from harness.runs.library_log import LIBRARY_LOGGERS

    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate) for name in LIBRARY_LOGGERS}
    yield
    logging.captureWarnings(False)
    hf_logging.enable_progress_bar()
    for name, (handlers, propagate) in saved.items():
        logging.getLogger(name).handlers, logging.getLogger(name).propagate = handlers, propagate


def test_library_noise_goes_to_the_run_log_not_the_terminal(tmp_path, capsys, restore_logging):
    run_dir = tmp_path / "run"
    quiet_libraries(run_dir)
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers.modeling_utils").warning("falling back to the torch implementation")
    logging.getLogger("py.warnings").warning("a deprecation")  # what warnings.warn becomes
    run_dir.mkdir()  # the store creates it after the first messages
    hf_logging.get_logger("transformers.modeling_utils").warning("loaded")
    assert capsys.readouterr().err == ""
    log = (run_dir / LOG_NAME).read_text()
    assert "falling back to the torch implementation" in log and "a deprecation" in log and "loaded" in log
    assert hf_logging.is_progress_bar_enabled() is False  # no weight-loading bars under ours


def eta_swing(bar, costs: list[float]) -> float:
    """Largest relative jump of the predicted run length between two updates, units costing `costs` seconds."""
    clock = [0.0]
    bar._time = lambda: clock[0]
    bar.start_t = bar.last_print_t = 0.0
    etas = []
    for cost in costs:
        clock[0] += cost
        bar.update(1)
        d = bar.format_dict
        rate = d["rate"] or d["n"] / d["elapsed"]
        etas.append((d["total"] - d["n"]) / rate + d["elapsed"])  # predicted total duration
    bar.close()
    settled = etas[len(costs) // 3:-1]  # once a third of the run is done
    return max(abs(b / a - 1) for a, b in itertools.pairwise(settled))  # largest jump between two updates


def test_eta_uses_the_average_rate_of_the_run(monkeypatch):
    from tqdm import tqdm

    # reference units generate only; path units generate and score; models differ ~2x (BENCHMARKS.md)
    # per model, scenario after scenario: a reference unit, then 5 path units (the last one, a broken path, ends early)
    costs = [c * scale for scale in (1.0, 2.2, 2.4) for _ in range(6) for c in (1.0, 2.0, 2.2, 2.3, 2.3, 0.9)]
    monkeypatch.setattr(cli.sys, "stderr", io.StringIO())
    ours = eta_swing(cli._progress(len(costs)), costs)
    default = eta_swing(tqdm(total=len(costs), file=cli.sys.stderr, mininterval=0), costs)
    assert ours < 0.1 and default > 3 * ours, (ours, default)  # the predicted run length holds steady


@pytest.mark.parametrize("argv, named", [
    (["--models", ","], "--models ','"),            # before: ran no model at all and reported success
    (["--models", "gqa,,mla"], "--models 'gqa,,mla'"),
    (["--yardstick="], "--yardstick ''"),           # before: ran no yardstick, the manifest recorded the default
    (["--yardstick", "  "], "--yardstick '  '"),
])
def test_empty_models_or_yardstick_is_refused_before_work(tmp_path, capsys, argv, named):
    """Issue 45: each exits 2 with one line naming the flag and echoing the value; no run directory."""
    code = main(["run", *argv, "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config", [
    {"model_type": "llama", "hidden_size": "abc"},  # transformers' strict field validation (huggingface_hub)
    {"model_type": "no_such_family_anywhere"},      # a model type transformers does not know
])
def test_a_config_transformers_cannot_read_is_refused_before_work(tmp_path, capsys, config):
    """A model directory whose config.json transformers rejects (musicgen's config under transformers 5.17 ended in
    StrictDataclassFieldValidationError's traceback): exit 2, one line naming the directory and transformers' words."""
    import json

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    code = main(["run", "--model", str(model), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and f"--model {model}: model family '{config['model_type']}': transformers" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists(), err


class FakeFigureWorkers:
    """Stands in for `FigureWorkers` (no process): takes nothing, so the figures are drawn inline."""

    def __init__(self):
        self.handed, self.closed = [], False

    def draw(self, name, args):
        self.handed.append(name)
        return None

    def close(self):
        self.closed = True


def test_run_and_report_hand_their_figures_to_a_worker_and_close_it(tmp_path, capsys, monkeypatch):
    """`harness report` hands its figures to the workers it started, each figure a request, and closes them;
    `harness run` closes its workers also when the run is refused before any work."""
    import json

    from harness import cli

    started: list[FakeFigureWorkers] = []
    monkeypatch.setattr(cli.FigureWorkers, "start", classmethod(lambda cls: started.append(FakeFigureWorkers())
                                                                or started[-1]))
    assert main(["report", str(RUNS / "baseline"), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "index.html").is_file() and started[0].closed
    assert started[0].handed == ["divergence_vs_turn_of", "divergence_vs_context", "sensitivity_ranking",
                                 "attention_error", "kl_by_generation_position"]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no_such_family_anywhere"}))
    assert main(["run", "--model", str(model), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert len(started) == 2 and started[1].handed == [] and started[1].closed


def test_cuda_started_beside_the_checks_leaves_a_failure_to_the_first_cuda_call(monkeypatch):
    """`_start_cuda_beside` starts CUDA in a thread while the inputs are checked; where CUDA cannot start (this CPU
    build of torch), the thread ends quietly and the run's first CUDA call raises as it did before."""
    import threading

    import torch

    from harness import cli

    if torch.cuda.is_available():
        pytest.skip("CUDA starts here: nothing fails to leave to the first call")
    from harness.executor import kernel_ledger
    monkeypatch.setattr(kernel_ledger, "_STARTED", {})   # the ledger it registers stays in this test
    cli._start_cuda_beside(SimpleNamespace(device="cuda", models=(), paths=(), shard=None))
    for thread in [t for t in threading.enumerate() if t.name == "cuda-start"]:
        thread.join(timeout=30)
        assert not thread.is_alive()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_main_refuses_to_run_while_a_worker_imports_the_script_that_calls_it(tmp_path, capsys, monkeypatch):
    """A spawned worker imports its parent's script again while it starts (multiprocessing's `_inheriting`); a
    script that calls `main` unguarded then ran the command again in each CPU worker, which met the parent's run
    lock. `main` says what to fix instead, and does nothing."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    assert main(["report", str(RUNS / "baseline"), "--out", str(tmp_path / "report")]) == 2
    assert 'if __name__ == "__main__":' in capsys.readouterr().err and not (tmp_path / "report").exists()
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", False)
    assert main(["report", str(RUNS / "baseline"), "--out", str(tmp_path / "report")]) == 0
