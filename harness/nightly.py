"""`harness nightly`: the nightly job's local twin, on the CPU with the canaries.

Each call is one night: a run stored under `HISTORY/nights/<night>`, compared with the previous night
(`<night>/compare/compare.html`), and the trend page `HISTORY/trend/index.html` re-rendered from every night
kept: each path's verdicts and key metrics over nights, as matplotlib plots. Exit 1 when tonight a path fails
its verdicts or compare finds a regression against last night; exit 3 when tonight's run or the night it is
compared with did not finish every unit (docs/CONTRACTS.md exit codes).

`--suite stress` (or `all`) runs the stress suites of `harness/zoo.py` (`STRESS_SUITES`: the outlier-key and
latent-scale variants on the default canary scenarios, the long-context canary on its 16k-token needles), each
a night of its own history `HISTORY/stress/<suite>`, judged the same way. Their paths are the ones measured
healthy on those models. On the CPU the long-context suite replays its first needle only (114 s with four
paths on the shared 2-core machine, where the 10 needles in bf16 alone took 647 s; all 10 with four paths take
31 s on an H100).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.files import file_kind

TREND_METRICS = {"kl_max": "KL max (mean over turns)", "kl_mean": "KL mean (mean over turns)",
                 "answer_correct": "answer accuracy"}
SUITES = ("default", "stress", "all")
STRESS_HISTORY = "stress"  # HISTORY/stress/<suite name>: one history per stress suite


@dataclass(frozen=True, slots=True)
class NightResult:
    run_dir: Path
    failing: list[tuple[str, str]]  # (model, path) with a failing verdict tonight
    compare_line: str | None  # compare's summary line against the previous night; None on the first night
    regressed: bool
    trend_page: Path
    incomplete: str | None = None  # tonight's run or the night compared with did not finish: what is missing

    @property
    def exit_code(self) -> int:
        return 3 if self.incomplete else 1 if self.failing or self.regressed else 0


def night_name() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def nights(history: Path) -> list[Path]:
    """Stored nights, oldest first (night names sort by time)."""
    from harness.runs.read import MANIFEST

    root = history / "nights"
    return sorted(p for p in root.iterdir() if (p / MANIFEST).exists()) if root.exists() else []


def run_night(history: Path, config_fields: dict, night: str | None = None) -> NightResult:
    """Run tonight (RunConfig fields other than `out`), compare with the last night, re-render the trend."""
    from harness.analysis.verdicts import failing_paths
    from harness.run_config import build_run_config
    from harness.runs.gate import run_matrix
    from harness.runs.read import read_run

    previous = nights(history)
    name = night or night_name()
    out = history / "nights" / name
    if out.exists():
        raise ValueError(f"night {out} already exists; choose another --night")
    from harness import job

    job.run_job(build_run_config(out=out, **config_fields))
    failing = failing_paths(run_matrix(out))
    if not previous:
        return NightResult(out, failing, None, False, render_trend(history), read_run(out).incomplete())
    compare_line, regressed, incomplete = compare_nights(previous[-1], out)
    return NightResult(out, failing, compare_line, regressed, render_trend(history), incomplete)


def compare_nights(last: Path, tonight: Path) -> tuple[str, bool, str | None]:
    """(compare's summary line, regressed, what is missing when either night is incomplete) of tonight against
    the last night; tonight's run stays stored and judged when the comparison cannot be made."""
    from harness.runs.compare import compare_runs
    from harness.runs.read import IncompleteRunError, RunReadError

    try:
        result = compare_runs(last, tonight, out_dir=tonight / "compare")
    except IncompleteRunError as error:
        return f"NOT COMPARED with {last.name}: {error}", False, str(error)
    except RunReadError as error:
        return f"NOT COMPARED with {last.name}: {error}", False, None
    return result.summary_line, result.regressed, None


def stress_fields(suite, device: str, command: str) -> dict:
    """RunConfig fields (other than `out`) of one stress suite tonight."""
    from harness import job

    return dict(models=tuple(job.CANARY_WEIGHTS / m for m in suite.models),
                scenario_paths=tuple(job.REPO_ROOT / s for s in suite.scenarios),
                paths=job.parse_kv_paths(",".join(suite.paths)), device=device, command=command,
                select=suite.select(device))


def check_history(history: Path) -> None:
    """ValueError naming the part of a history (the history, nights/, trend/, trend/index.html, stress/) that is
    there but of the wrong type, before tonight's run: a night must be able to be stored and its trend drawn."""
    for directory in (history, history / "nights", history / "trend", history / STRESS_HISTORY):
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"--history {history}: {directory} is not a directory (a {file_kind(directory)})")
    page = history / "trend" / "index.html"
    if page.exists() and not page.is_file():
        raise ValueError(f"--history {history}: {page} is not a regular file (a {file_kind(page)})")


def check_night_name(night: str) -> None:
    """A night is one directory of HISTORY/nights: a plain name, never a path that leaves it (`../x`)."""
    if not night or night in (".", "..") or Path(night).name != night or "\\" in night:
        raise ValueError(f"--night {night!r}: a night's name is one plain directory name (e.g. 2026-01-02), "
                         f"not a path")


def run_nights(history: Path, default_fields: dict, suite: str = "default",
               night: str | None = None) -> list[tuple[str, NightResult]]:
    """Tonight's runs of `suite` (default, stress or all), each (name, result); one night name for all."""
    from harness.zoo import STRESS_SUITES

    if suite not in SUITES:
        raise ValueError(f"--suite {suite!r}: expected one of {', '.join(SUITES)}")
    if night is not None:
        check_night_name(night)
    name = night or night_name()
    histories = ([history] if suite in ("default", "all") else []) + \
        ([history / STRESS_HISTORY / stress.name for stress in STRESS_SUITES] if suite in ("stress", "all") else [])
    for kept in histories:
        check_history(kept)
    results = []
    if suite in ("default", "all"):
        results.append(("default", run_night(history, default_fields, name)))
    if suite in ("stress", "all"):
        for stress in STRESS_SUITES:
            fields = stress_fields(stress, default_fields["device"], default_fields.get("command", ""))
            results.append((f"stress/{stress.name}", run_night(history / STRESS_HISTORY / stress.name, fields, name)))
    return results


# ---------------------------------------------------------------- trend


def trend_table(history: Path) -> pd.DataFrame:
    """One row per (night, model, path): verdict counts and the mean of each trend metric."""
    return trend_nights(history)[0]


def trend_nights(history: Path) -> tuple[pd.DataFrame, list[str]]:
    """The trend table of every readable night, and one line per night that could not be read (named with the
    file and line): a broken night is left off the plot, never drawn as zeros."""
    from harness.runs.read import RunReadError, read_run

    rows, unreadable = [], []
    for night in nights(history):
        try:
            run = read_run(night)
            matrix, frame = run.matrix, run.records_frame
        except RunReadError as error:
            unreadable.append(f"{night.name}: {error}")
            continue
        means = frame[frame["metric"].isin(list(TREND_METRICS))].groupby(["model", "path", "metric"])["value"].mean()
        for model, paths in matrix.items():
            for path, cell in paths.items():
                metrics = {m: means.get((model, path, m), float("nan")) for m in TREND_METRICS}
                rows.append({"night": night.name, "model": model, "path": path, "pass": cell["pass"],
                             "warn": cell["warn"], "fail": cell["fail"]} | metrics)
    return pd.DataFrame(rows, columns=["night", "model", "path", "pass", "warn", "fail", *TREND_METRICS]), unreadable


def render_trend(history: Path) -> Path:
    """HISTORY/trend/index.html: a plot per model and the verdict table of every night (self-contained dir)."""
    from harness.runs.report import environment, write_page
    from reports.plots import trend_figure

    out = history / "trend"
    out.mkdir(parents=True, exist_ok=True)
    table, unreadable = trend_nights(history)
    panels = [("fail", "failing turns"), *TREND_METRICS.items()]
    images = [trend_figure(table, model, out / f"trend-{model}.png", panels).name
              for model in dict.fromkeys(table["model"])]
    rows = [{"verdict": "bad" if r["fail"] else "warn" if r["warn"] else "good", **r}  # _style.css classes
            for r in table.to_dict("records")]
    return write_page(environment(), out, "index.html", "trend.html", nights=len(set(table["night"])),
                      images=images, rows=rows, unreadable=unreadable)
