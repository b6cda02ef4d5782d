"""Open the run and compare reports in headless Chromium (Debian's, driven by Playwright for Python).

Set-up (see README): `apt-get install -y chromium` and `pip install playwright`; never `playwright
install` (it downloads its own browsers). Screenshots go to test-artifacts/reports/.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

from harness.runs.compare import compare_runs
from harness.runs.report import render_run_report, scenario_page_name

CHROMIUM = Path("/usr/bin/chromium")
DATA = Path(__file__).parent / "data"
RUNS = DATA / "runs"
assert (RUNS / "baseline" / "manifest.json").is_file(), (
    f"{RUNS} is missing: regenerate it with `python tests/data/make_runs.py`, and make sure .gitignore's "
    "`runs/` does not hide it (anchor that rule as `/runs/`)")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "reports"
XSS = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>']

if not CHROMIUM.exists():
    pytest.skip(f"browser tests need Debian's chromium at {CHROMIUM}: apt-get install -y chromium",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need Playwright: pip install playwright")


def load_make_runs():
    spec = importlib.util.spec_from_file_location("make_runs", DATA / "make_runs.py")
    sys.modules.setdefault("make_runs", importlib.util.module_from_spec(spec))  # dataclasses need the module
    spec.loader.exec_module(sys.modules["make_runs"])
    return sys.modules["make_runs"]


make_runs = load_make_runs()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("browser")
    result = compare_runs(RUNS / "baseline", RUNS / "regressed", out_dir=root / "compare",
                          thresholds=["kl_max:+0.02"], n_boot=500)
    index = render_run_report(RUNS / "baseline", root / "run")
    # KL inf on the turn: a new failure, so compare shows the case (one lost rule alone is no finding: issue 40)
    chat = {("chat-xss-0001", "fp8_e4m3:per_head:calibrated", 3): make_runs.Divergence(4, XSS[1] + " !!!", math.inf)}
    chat_run = make_runs.write_run(root / "chat-run", "chat-run", divergences=make_runs.baseline_divergences() | chat)
    chat_compare = compare_runs(RUNS / "baseline", chat_run, out_dir=root / "chat-compare", n_boot=200)
    return {"index": index, "chat": index.parent / scenario_page_name("canary-mla", "chat-xss-0001"),
            "compare": result.report_path, "chat_compare": chat_compare.report_path}


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield chromium
        chromium.close()


class Watched:
    """A page that records console errors, page errors, dialogs and every request it makes."""

    def __init__(self, browser):
        self.context = browser.new_context(viewport={"width": 1400, "height": 900})
        self.errors, self.dialogs, self.requests = [], [], []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def _route(self, route):
        if route.request.url.startswith(("file://", "data:")):
            route.continue_()
        else:
            route.abort()

    def open(self, path: Path):
        self.page.goto(path.as_uri())
        self.page.wait_for_load_state("load")
        return self.page

    def check_clean(self) -> None:
        assert self.errors == []
        assert self.dialogs == []
        assert [u for u in self.requests if not u.startswith(("file://", "data:"))] == []

    def screenshot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / name), full_page=True)


@pytest.fixture
def watched(browser):
    page = Watched(browser)
    yield page
    page.context.close()


def images_loaded(page) -> list[tuple[str, int]]:
    return page.eval_on_selector_all("img", "els => els.map(e => [e.getAttribute('src'), e.naturalWidth])")


def column(page, table: str, header: str) -> list[str]:
    index = page.eval_on_selector_all(f"#{table} thead th", f"ths => ths.findIndex(t => t.textContent === '{header}')")
    return page.eval_on_selector_all(f"#{table} tbody tr:not([hidden])",
                                     f"rows => rows.map(r => r.cells[{index}].getAttribute('data-sort'))")


def test_run_report_loads_clean_with_plots(reports, watched):
    page = watched.open(reports["index"])
    images = images_loaded(page)
    assert len(images) == 5 and all(width > 0 for _, width in images), images  # 5th: KL by reply position
    assert page.locator("#headline").is_visible()
    watched.screenshot("run-index.png")
    watched.check_clean()
    assert any(u.endswith(".png") for u in watched.requests)


def test_summary_table_sorts_and_filters(reports, watched):
    page = watched.open(reports["index"])
    page.click("#summary-table th:text-is('kl_max')")
    values = [float(v) for v in column(page, "summary-table", "kl_max") if v]
    assert values == sorted(values) and len(values) == 9
    page.click("#summary-table th:text-is('kl_max')")
    values = [float(v) for v in column(page, "summary-table", "kl_max") if v]
    assert values == sorted(values, reverse=True)
    page.fill("input[data-filter-for='summary-table']", "recall fp8")
    rows = page.locator("#summary-table tbody tr:not([hidden])")
    assert rows.count() == 2
    assert all("recall-0001" in text for text in rows.all_inner_texts())
    assert page.inner_text("[data-count-for='summary-table']") == "2 of 12 rows"
    watched.check_clean()


def test_scenario_page_escapes_and_highlights(reports, watched):
    page = watched.open(reports["chat"])
    body = page.inner_text("body")
    for raw in XSS:
        assert raw in body  # shown as text
    assert page.locator("img[src='x']").count() == 0
    block = page.locator("#turn-2 details.pathblock[data-path='fp8_e4m3']")
    assert block.locator(".cand .tok.first-div").inner_text() == " a"
    assert block.locator(".ref .tok.first-div").inner_text() == "script"
    assert block.locator(".cand .tok.first-div").is_visible()
    # KL sits under the very reference token it was measured on, and the per-token charts are drawn
    assert block.locator(".ref .tok.kl").count() == len(block.locator(".ref .tok").all()) > 0
    assert block.locator(".sparks svg polyline").count() == 3
    watched.screenshot("run-scenario-chat-xss.png")
    watched.check_clean()


def test_compare_report(reports, watched):
    page = watched.open(reports["compare"])
    assert page.inner_text("#summary-line").startswith("REGRESSION")
    images = images_loaded(page)
    assert images and all(width > 0 for _, width in images), images
    case = page.locator("section.case", has_text="turn 2").first
    assert case.locator(".cand .tok.first-div").inner_text() == "I"
    assert case.locator(".ref .tok.first-div").inner_text() == "Your"
    page.fill("input[data-filter-for='metrics-table']", "regressed")
    assert page.locator("#metrics-table tbody tr:not([hidden])").count() >= 1
    page.fill("input[data-filter-for='metrics-table']", "")
    page.click("#metrics-table th:text-is('delta B − A')")
    deltas = [float(v) for v in column(page, "metrics-table", "delta B − A")]
    assert deltas == sorted(deltas)
    # every plot: drawn at its declared size, with no label or legend box outside the image
    figures = page.eval_on_selector_all("figure img", "els => els.map(e => [e.naturalWidth, e.naturalHeight, "
                                        "e.getAttribute('width'), e.getAttribute('height'), "
                                        "e.closest('figure').dataset.outside])")
    assert len(figures) == 2 and all([str(w), str(h), "0"] == [dw, dh, out] for w, h, dw, dh, out in figures), figures
    # few scenarios: an unsettled change says so, with its scenarios and the sample size that would decide
    row = page.locator("#metrics-table tbody tr", has_text="kl_mean").first
    assert "inconclusive (n=3)" in row.inner_text() and "scenarios at this spread would decide" in row.inner_text()
    assert "recall-0001" in row.locator("td.evidence .worse").first.inner_text()
    assert not page.locator("#settled-metrics").get_attribute("open") is not None  # the settled rows are folded
    watched.screenshot("compare.png")
    watched.check_clean()


def test_compare_report_shows_model_markup_as_text(reports, watched):
    page = watched.open(reports["chat_compare"])
    case = page.locator("section.case", has_text="chat-xss-0001").first
    assert XSS[1] in case.locator(".cand .text").inner_text()
    assert page.locator("img[src='x']").count() == 0
    watched.screenshot("compare-chat-xss.png")
    watched.check_clean()


def test_artifacts_dir_is_ignored_by_git():
    gitignore = Path(__file__).resolve().parents[1] / ".gitignore"
    assert "test-artifacts/" in gitignore.read_text().split()  # screenshots are artifacts, never committed


# ---------------------------------------------------------------- a real stored run (tests/data/make_real_run.py)

REAL = RUNS / "real"


@pytest.fixture(scope="module")
def real_report(tmp_path_factory) -> Path:
    return render_run_report(REAL, tmp_path_factory.mktemp("real") / "run")


def real_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (REAL / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def test_real_run_headline_shows_every_model_and_path_on_the_first_screen(real_report, watched):
    page = watched.open(real_report)
    verdicts = real_rows("verdicts")
    expected = {(r["model"], r["path"]) for r in verdicts}
    cells = page.locator("#verdict-matrix td[data-model]")
    shown = {(c.get_attribute("data-model"), c.get_attribute("data-path")) for c in cells.all()}
    assert shown == expected and len(expected) >= 6
    for cell in cells.all():
        box = cell.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 1400 and box["y"] + box["height"] <= 900, box
    failing = {(r["model"], r["path"]) for r in verdicts if r["verdict"] == "fail"}
    for model, path in failing:  # coloured by verdict, with the reason
        cell = page.locator(f"#verdict-matrix td[data-model='{model}'][data-path='{path}']")
        assert "bad" in cell.get_attribute("class") and cell.locator("a.why").count() == 1
    watched.check_clean()


def test_real_run_has_plots_per_model_inside_their_images(real_report, watched):
    page = watched.open(real_report)
    models = {m["label"] for m in json.loads((REAL / "manifest.json").read_text())["models"]}
    per_model = page.eval_on_selector_all("figure[data-model] img", "els => els.map(e => [e.closest('figure')"
                                          ".dataset.model, e.naturalWidth, e.getAttribute('width')])")
    assert {m for m, _, _ in per_model} == models
    assert all(width > 0 and str(width) == declared for _, width, declared in per_model), per_model
    assert page.eval_on_selector_all("figure", "fs => fs.map(f => f.dataset.outside)") == \
        ["0"] * page.locator("figure").count()
    watched.check_clean()


def test_real_run_scenario_pages_show_the_judges_reasons(real_report, watched):
    judged = [r for r in real_rows("judgements") if r["path"] != "reference" and r.get("reason")]
    row = next(r for r in judged if r["metric"] == "judge_rule" and r["value"] is not None and r["value"] < 5)
    page = watched.open(real_report.parent / scenario_page_name(row["model"], row["scenario"]))
    block = page.locator(f"#turn-{row['turn']} details.pathblock[data-path='{row['path']}']")
    judges = block.locator(".judge").all_inner_texts()
    assert any(row["reason"] in text and text.startswith(row["metric"]) for text in judges), judges
    assert page.locator(".judge").count() >= len({(r["path"], r["turn"], r["metric"]) for r in judged
                                                  if (r["model"], r["scenario"]) == (row["model"], row["scenario"])})
    watched.check_clean()


def test_real_run_tables_hold_no_raw_json_and_fit_the_screen(real_report, watched):
    page = watched.open(real_report)
    cells = page.eval_on_selector_all("td", "tds => tds.map(t => t.innerText.trim())")
    raw = [c for c in cells if re.match(r"^[\[{].*[\]}]$", c, re.DOTALL) or '{"' in c or '":' in c]
    assert raw == []
    last = page.locator("#summary-table thead th").last.bounding_box()
    assert last["x"] + last["width"] <= 1400  # the judge_rule column is not cut off
    assert page.locator("#kv-table tbody tr").count() >= 4  # K/V diagnostics of every FP8 path
    watched.check_clean()


def test_real_run_shows_the_candidates_at_the_first_divergent_token(real_report, watched):
    row = next(r for r in real_rows("texts") if r.get("candidates_at_divergence"))
    stored = row["candidates_at_divergence"]
    page = watched.open(real_report.parent / scenario_page_name(row["model"], row["scenario"]))
    block = page.locator(f"#turn-{row['turn']} details.pathblock[data-path='{row['path']}']")
    tables = block.locator("table.cands")
    assert tables.count() == 2 and f"at token {stored['position']}" in block.locator(".candidates").inner_text()
    assert block.locator("table.cands").nth(1).locator("tr.is-path").count() == 1  # the path's own token is listed
    assert block.locator("table.cands tbody tr").count() == len(stored["reference"]) + len(stored["path"])
    watched.check_clean()
