"""`aici-batch report --html` in a real browser: Debian's headless Chromium driven by
selenium, one browser for the module.

The page opens from `file://` with no console error and no request past its own file;
its filters count what `report --json` counts (each expected figure is read from
`--json`'s output, never from the page); a line opens with its validator errors; the
baseline view lists the changed lines; the lines the constraint bent most are listed
lowest first, their text shown as text; 5,000 rows scroll with a few dozen elements.

Without chromium, chromedriver or selenium these tests skip, unless AICI_REQUIRE_BROWSER
is set (as .ci/run does after installing them): then they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from report_pages import input_bytes, results, write_jsonl

from aici_cli.cli.main import main

pytestmark = pytest.mark.subprocess  # it starts chromedriver and chromium
REQUIRE = "AICI_REQUIRE_BROWSER"


def _need(what: str, found: Any) -> Any:
    if not found:
        problem = (f"{what} not found (apt-get install chromium chromium-driver; "
                   "pip install selenium)")
        if os.environ.get(REQUIRE):
            pytest.fail(f"{problem}; {REQUIRE} is set: the browser tests must run")
        pytest.skip(problem)
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    _need("selenium", webdriver)
    binary = _need("chromium", shutil.which("chromium") or shutil.which("chromium-browser"))
    driver_path = _need("chromedriver", shutil.which("chromedriver"))
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.binary_location = binary
    # The console, and the DevTools network events: every request the page makes.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def report(*args: str) -> Any:
    res = CliRunner().invoke(main, ["report", *args], env={"GITHUB_STEP_SUMMARY": ""})
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """report_pages.py's run as a page with its input and baseline, and its --json."""
    root = tmp_path_factory.mktemp("page")
    inputs = root / "eval.jsonl"
    inputs.write_bytes(b"".join(raw + b"\n" for raw in input_bytes()))
    now = write_jsonl(root / "results.jsonl", results())
    before = write_jsonl(root / "prev.jsonl", results(before=True))
    html = root / "report.html"
    res = report(str(now), "--input", str(inputs), "--baseline", str(before), "--html",
                 str(html), "--json")
    return html, json.loads(res.stdout)


def load(driver: Any, page: Path) -> None:
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get_log("performance")
    driver.get(page.as_uri())
    deadline = time.monotonic() + 20
    while driver.execute_script("return document.body.dataset.ready") != "1":
        failure = driver.execute_script("return document.getElementById('failure').textContent")
        assert not failure, failure
        assert time.monotonic() < deadline, "the page never became ready"
        time.sleep(0.02)


def console_errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def requests(driver: Any, page: Path) -> list[str]:
    """Every URL the browser asked for besides the page itself."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    resources = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)")
    return [u for u in urls + resources if u != page.as_uri()]


def click(driver: Any, css: str) -> None:
    driver.execute_script("document.querySelector(arguments[0]).click()", css)


def shown(driver: Any) -> int:
    return int(driver.execute_script("return document.getElementById('shown').dataset.count"))


def test_the_page_loads_from_disk_without_errors_or_requests(browser: Any, run: Any) -> None:
    html, _ = run
    load(browser, html)
    # Everything the page draws on demand too: a line, each filter, the plots.
    click(browser, '.row[data-index="3"]')
    for name in ("errors", "invalid", "closed", "wrong", "changed", "all"):
        click(browser, f'[data-filter="{name}"]')
    browser.execute_script("document.getElementById('plots').scrollIntoView()")
    assert browser.execute_script("return document.querySelectorAll('#plots svg').length") == 2
    assert console_errors(browser) == []
    assert requests(browser, html) == []


def test_a_page_that_reaches_out_is_caught(browser: Any, run: Any, tmp_path: Path) -> None:
    """The checks above can fail: a page that tries to fetch is refused by its policy, and
    the refusal is a console error."""
    html, _ = run
    tampered = tmp_path / "tampered.html"
    tampered.write_text(html.read_text().replace(
        "<script>", "<script>fetch('https://example.invalid/x').catch(() => {});", 1))
    load(browser, tampered)
    time.sleep(0.3)
    assert any("Content Security Policy" in e for e in console_errors(browser))


STATUS = {"errors": "error", "invalid": "invalid", "wrong": "wrong"}


def test_filters_count_what_report_json_counts(browser: Any, run: Any) -> None:
    html, summary = run
    load(browser, html)
    expected_lines = {
        "all": summary["lines"],
        "errors": summary["errors"],
        "wrong": summary["answered"] - round(summary["accuracy"] * summary["answered"]),
        "changed": len(summary["baseline"]["changed"]),
    }
    expected_outputs = {  # counted per sample, as the summary counts them
        "invalid": summary["schema_lines"] - summary["valid"],
        "closed": sum(summary["closed_early"].values()),
    }
    for name, count in {**expected_lines, **expected_outputs}.items():
        click(browser, f'[data-filter="{name}"]')
        button = browser.execute_script(
            f"return document.querySelector('[data-filter=\"{name}\"]').dataset")
        rows = browser.execute_script("return document.querySelectorAll('#rows .row').length")
        assert shown(browser) == rows == int(button["lines"]), name
        if name in expected_outputs:
            assert int(button["outputs"]) == count, name
        else:
            assert shown(browser) == count, name
        statuses = browser.execute_script(
            "return [...document.querySelectorAll('#rows .row .pill')].map(p => p.textContent)")
        if name in STATUS:  # the line's status, as JUnit gives it
            assert set(statuses) == {STATUS[name]}, name


def test_a_line_opens_with_its_validator_errors(browser: Any, run: Any) -> None:
    html, _ = run
    load(browser, html)
    click(browser, '[data-filter="invalid"]')
    click(browser, '.row[data-index="3"]')
    errors = browser.execute_script(
        "return [...document.querySelectorAll('#detail .schema-error')].map(e => e.textContent)")
    assert len(errors) == 2
    assert errors[0].startswith("$.age 150 is greater than the maximum of 120")
    assert errors[1].startswith("$.name 'Alexander the Great' is too long")
    detail = browser.execute_script("return document.getElementById('detail').textContent")
    assert "A person as JSON." in detail and '"age": 150' in detail
    assert browser.execute_script("return location.hash") == "#line=3"
    click(browser, '.row[data-index="5"]')  # the tool call, and the input's tool result
    detail = browser.execute_script("return document.getElementById('detail').textContent")
    assert "calls[0].arguments 'city' is a required property" in detail
    assert "tool result" in detail and '"temp_c": 7' in detail


def test_the_baseline_view_lists_the_changed_lines(browser: Any, run: Any) -> None:
    html, summary = run
    load(browser, html)
    ways = browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#baseline table.changes')]"
        ".map(t => [t.dataset.way, [...t.querySelectorAll('tr.change')]"
        ".map(r => [r.dataset.id, ...[...r.querySelectorAll('pre')].map(p => p.textContent)])]))")
    assert ways == {"right->wrong": [["q2", " Rome", " Milan", " Rome"]],
                    "wrong->right": [["q1", " 5", " 4", " 4"]]}
    text = browser.execute_script("return document.getElementById('baseline').textContent")
    b = summary["baseline"]
    assert f"delta {b['delta']:+.4f}" in text and "McNemar p" in text
    click(browser, '#baseline tr.change[data-id="q2"] a')
    assert browser.execute_script("return document.getElementById('detail').dataset.position") \
        == "1"


# Allowed masses (min, mean) for three of report_pages.py's lines; `person` also writes
# markup that would run if the page ever put a line's text in as HTML.
BENT = {"pair": (0.002, 0.41), "person": (0.03, 0.5), "city": (0.5, 0.9)}
HOSTILE = "<script>window.pwned=1</script><img src=x onerror=\"window.pwned=2\"><b>b</b>"


def test_the_bent_section_lists_the_lines_lowest_first(browser: Any, tmp_path: Path) -> None:
    lines = results()
    for line in lines:
        if line["id"] in BENT:
            low, mean = BENT[line["id"]]
            line["stats"].update(allowed_mass_min=low, allowed_mass_mean=mean,
                                 allowed_mass_steps=4)
        if line["id"] == "person":
            line["text"] = HOSTILE + " " + "x" * 100
        if line["id"] == "city":
            line["id"] = 42  # an integer id: the row holds it as text
    html = tmp_path / "bent.html"
    res = report(str(write_jsonl(tmp_path / "bent.jsonl", lines)), "--html", str(html),
                 "--json")
    bent = json.loads(res.stdout)["bent_most"]
    load(browser, html)
    shown_rows = browser.execute_script(
        "return [...document.querySelectorAll('#bent tr.bent-line')]"
        ".map(r => [...r.querySelectorAll('td')].map(c => c.textContent))")
    assert [b["id"] for b in bent] == ["pair", "person", 42]
    assert [row[1] for row in shown_rows] == ["pair", "person", "42"]
    assert shown_rows[0][:6] == ["8", "pair", "0.00200", "0.410", "stop", "✗"]
    assert shown_rows[2][:6] == ["4", "42", "0.500", "0.900", "stop", "✓"]
    links = "return document.querySelectorAll('#bent tr.bent-line td a').length"
    assert browser.execute_script(links) == 3  # each joined to its row
    excerpt = shown_rows[1][6]
    assert excerpt.startswith(HOSTILE) and excerpt.endswith("…") and len(excerpt) == 80
    assert browser.execute_script("return document.querySelectorAll('#bent script, #bent img, "
                                  "#bent b').length") == 0
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.execute_script("return document.getElementById('nav-bent').hidden") is False
    title = browser.execute_script("return document.querySelector('#bent h2').textContent")
    assert title == "Where the constraint bent the model"
    click(browser, '[data-filter="errors"]')  # the line opens even where a filter hid it
    click(browser, '#bent tr.bent-line[data-id="person"] a')
    assert browser.execute_script("return document.getElementById('detail').dataset.position") \
        == "2"
    assert shown(browser) == 9
    assert console_errors(browser) == []


def test_without_allowed_mass_there_is_no_bent_section(browser: Any, run: Any) -> None:
    html, summary = run
    assert summary["bent_most"] == []
    load(browser, html)
    assert browser.execute_script("return [document.getElementById('bent').hidden, "
                                  "document.getElementById('nav-bent').hidden, "
                                  "document.getElementById('bent').children.length]") \
        == [True, True, 0]


def wait_shown(driver: Any, count: int) -> None:
    """Search runs a moment after the last key (it waits for typing to pause)."""
    deadline = time.monotonic() + 5
    while shown(driver) != count:
        assert time.monotonic() < deadline, (shown(driver), count)
        time.sleep(0.05)


def test_search_and_sort(browser: Any, run: Any) -> None:
    html, _ = run
    load(browser, html)
    browser.find_element("id", "search").send_keys("milan")
    wait_shown(browser, 1)
    assert browser.execute_script("return document.querySelector('#rows .row').dataset.index") \
        == "2"
    browser.find_element("id", "search").clear()
    browser.execute_script("document.getElementById('search').dispatchEvent(new Event('input'))")
    wait_shown(browser, 9)
    click(browser, '[data-sort="tokens"]')
    click(browser, '[data-sort="tokens"]')  # again: descending
    first = browser.execute_script("return document.querySelector('#rows .row').dataset.index")
    assert first == "7"  # `slow`: 30 tokens


def test_a_big_run_keeps_few_row_elements(browser: Any, tmp_path: Path) -> None:
    lines = results()
    rows = [{**lines[n % 9], "id": f"{lines[n % 9]['id']}-{n}", "index": n + 1}
            for n in range(5000)]
    html = tmp_path / "big.html"
    report(str(write_jsonl(tmp_path / "big.jsonl", rows)), "--html", str(html))
    load(browser, html)
    assert shown(browser) == 5000
    count = "return document.querySelectorAll('#rows .row').length"
    assert browser.execute_script(count) < 80
    browser.execute_script("const v = document.getElementById('viewport');"
                           "v.scrollTop = v.scrollHeight;")
    last = "return [...document.querySelectorAll('#rows .row')].at(-1).dataset.index"
    deadline = time.monotonic() + 5  # rows are drawn at the next animation frame
    while browser.execute_script(last) != "5000":
        assert time.monotonic() < deadline, browser.execute_script(last)
        time.sleep(0.05)
    assert browser.execute_script(count) < 80
    assert console_errors(browser) == []
