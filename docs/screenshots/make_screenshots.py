"""Regenerate the report screenshots in docs/screenshots/ (what a reader sees before running anything).

`python docs/screenshots/make_screenshots.py` renders the stored run `tests/data/runs/real` (an actual
`harness run`: see tests/data/make_real_run.py) and the compare of the test runs `baseline` -> `regressed`
(tests/data/make_runs.py), opens them in headless Chromium (Debian's, through Playwright) and saves the
first screen of each page, 1400 x 900, as PNG.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.runs.compare import compare_runs
from harness.runs.report import render_run_report, scenario_page_name

RUNS = ROOT / "tests" / "data" / "runs"
OUT = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
VIEWPORT = {"width": 1400, "height": 900}
SCENARIO = ("hybrid", "canary-recall-1")  # the hybrid's warm-up path breaks here
SCENARIO_PATH = "fp8_e4m3:warmup"


def shoot(browser, page_file: Path, target: Path, anchor: str | None = None) -> None:
    page = browser.new_page(viewport=VIEWPORT)
    page.goto(page_file.as_uri())
    page.wait_for_load_state("load")
    if anchor:
        page.locator(anchor).first.scroll_into_view_if_needed()
    page.screenshot(path=str(target))
    page.close()
    print(f"{target.relative_to(ROOT)}: {target.stat().st_size // 1024} KiB")


def main() -> None:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        index = render_run_report(RUNS / "real", Path(tmp) / "run")
        scenario = index.parent / scenario_page_name(*SCENARIO)
        compare = compare_runs(RUNS / "baseline", RUNS / "regressed", out_dir=Path(tmp) / "compare",
                               thresholds=["kl_max:+0.02"], n_boot=500).report_path
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM)
            shoot(browser, index, OUT / "run-report.png")
            shoot(browser, scenario, OUT / "scenario-page.png", f"details.pathblock[data-path='{SCENARIO_PATH}']")
            shoot(browser, compare, OUT / "compare-report.png")
            browser.close()


if __name__ == "__main__":
    main()
