"""`aici-batch report --html` of a big run: the time to write the page, its size, and the
time a headless Chromium takes from navigation to a usable table.

    python bench/report_html.py --lines 10000 --repeats 3

The run is bench/report_data.py's (the example eval run, repeated, with its input file
for `--input`), written once to out/. "Usable" is the moment the page's own script sets
`window.aiciReadyMs` (`assets/boot.js`): the data unpacked, the run drawn, the table's
first rows on screen; it is read from the page's clock, whose zero is the navigation's
start, so it covers reading the file, parsing the HTML, unpacking and drawing. Each
repeat loads the page afresh in the same browser (Debian's `chromium` and
`chromium-driver`, through selenium, as tests/report/test_page_browser.py drives them).

    python bench/report_html.py --screenshot docs/report-page.png --page report.html --open 3

takes the picture of a written page that docs/ci-reports.md shows instead: the page in
the same browser, line 3 opened.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_data import REPO, write_inputs, write_run  # noqa: E402

OUT = REPO / "out"


def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        raise SystemExit("needs chromium and chromedriver (apt-get install chromium "
                         "chromium-driver) and selenium")
    options.binary_location = binary
    return webdriver.Chrome(service=Service(driver), options=options)


def load_ms(driver: Any, page: Path) -> float:
    """Milliseconds from navigation to the usable table, by the page's clock."""
    driver.get("about:blank")
    driver.get(page.as_uri())
    deadline = time.monotonic() + 60
    while (ready := driver.execute_script("return window.aiciReadyMs ?? null")) is None:
        if time.monotonic() > deadline:
            raise SystemExit("the page never became ready")
        time.sleep(0.01)
    rows = driver.execute_script("return document.querySelectorAll('#rows .row').length")
    if not rows:
        raise SystemExit("the page is ready but shows no rows")
    return float(ready)


def screenshot(page: Path, out: Path, line: int | None) -> None:
    """A PNG of `page` with `line` opened, the window as tall as the page's top part."""
    driver = browser()
    try:
        driver.set_window_size(1400, 1100)
        load_ms(driver, page.resolve())
        if line is not None:
            driver.execute_script(
                "document.querySelector(`.row[data-index='${arguments[0]}']`).click()", line)
        driver.execute_script("window.scrollTo(0, 0)")
        time.sleep(0.3)  # the opened line is drawn at the next frame
        driver.save_screenshot(str(out))
    finally:
        driver.quit()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--screenshot", type=Path, help="write a PNG of --page instead")
    ap.add_argument("--page", type=Path, help="a written page, for --screenshot")
    ap.add_argument("--open", type=int, default=None, help="the line to open, for --screenshot")
    args = ap.parse_args()
    if args.screenshot is not None:
        if args.page is None:
            ap.error("--screenshot needs --page")
        screenshot(args.page, args.screenshot, args.open)
        return 0
    OUT.mkdir(exist_ok=True)
    results = OUT / f"report_run_{args.lines}.jsonl"
    inputs = OUT / f"report_inputs_{args.lines}.jsonl"
    if not results.exists():
        write_run(results, args.lines)
    if not inputs.exists():
        write_inputs(inputs, args.lines)
    page = OUT / f"report_{args.lines}.html"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "aici_cli", "report", str(results), "--input",
                    str(inputs), "--html", str(page), "--json"], check=True,
                   capture_output=True)
    write_s = time.perf_counter() - start
    driver = browser()
    try:
        loads = [load_ms(driver, page) for _ in range(args.repeats)]
        version = driver.capabilities.get("browserVersion", "?")
    finally:
        driver.quit()
    print(f"run: {args.lines:,} lines, results {results.stat().st_size / 1e6:.1f} MB; "
          f"headless Chromium {version}")
    print("| what | value |")
    print("| --- | ---: |")
    print(f"| `report --input --html --json`, wall | {write_s:.2f} s |")
    print(f"| the page's size | {page.stat().st_size / 1e6:.2f} MB |")
    print(f"| navigation to usable table, best of {args.repeats} | {min(loads) / 1000:.2f} s |")
    print(f"| navigation to usable table, median | {statistics.median(loads) / 1000:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
