"""The HTML report in a real headless Chromium (Debian's chromium + chromedriver, driven by selenium).

.ci/run installs the browser and sets CTROPT_BROWSER_TESTS=required, so there a missing browser fails the
suite; elsewhere these tests skip without one. CTROPT_SCREENSHOT=path keeps the page's screenshot (that is
how docs/report.png is made).
"""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ctropt.cli import app
from ctropt.exporters import zoo

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--window-size=1400,1800"]


def _browser_or_skip():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium")
    if missing:
        if os.environ.get("CTROPT_BROWSER_TESTS") == "required":
            pytest.fail(f"browser test required but missing: {', '.join(missing)}")
        pytest.skip(f"no headless browser: {', '.join(missing)}")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def dien_report(tmp_path_factory):
    """The issue's command: `ctropt optimize <zoo dien> --passes all --report r.html`."""
    tmp = tmp_path_factory.mktemp("report")
    model = tmp / "dien_tf.onnx"
    shutil.copy(zoo.shipped_path("dien", "tf"), model)
    result = CliRunner().invoke(app, ["optimize", str(model), "--passes", "all", "--report", str(tmp / "r.html")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    applied = [line.split()[0] for line in result.output.splitlines() if line.split()[1:2] == ["applied"]]
    return tmp / "r.html", applied


def _errors(driver):
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


def test_page_shows_every_pass_with_before_after_drawings(browser, dien_report):
    from selenium.webdriver.common.by import By

    path, applied = dien_report
    browser.get(path.as_uri())
    assert _errors(browser) == []
    sections = browser.find_elements(By.CSS_SELECTOR, "section.pass")
    chips = browser.find_elements(By.CSS_SELECTOR, ".timeline a")
    assert len(sections) == len(chips) >= 10
    names = [s.find_element(By.TAG_NAME, "h2").text for s in sections]
    assert "fuse-rnn" in " ".join(names) and "lower-rnn-ort" in " ".join(names)
    assert {"fuse-rnn", "fuse-fc", "remove-attention-padding", "lower-rnn-ort"} <= set(applied)
    for section in sections:
        title = section.find_element(By.TAG_NAME, "h2").text
        if not any(f". {name}" in title for name in ("fuse-rnn", "fuse-fc", "remove-attention-padding",
                                                       "dedup-user-side", "lower-rnn-ort")):
            continue
        regions = section.find_elements(By.CSS_SELECTOR, ".region")
        assert regions, title
        for region in regions[:3]:
            sides = region.find_elements(By.CSS_SELECTOR, ".side")
            assert [s.find_element(By.CSS_SELECTOR, ".label").text for s in sides] == ["before", "after"], title
            for side in sides:
                svg = side.find_element(By.CSS_SELECTOR, "svg.graph")
                box = browser.execute_script("var b = arguments[0].getBBox(); return [b.width, b.height];", svg)
                assert box[0] > 40 and box[1] > 20, (title, box)  # laid out and painted, not an empty box
    if os.environ.get("CTROPT_SCREENSHOT"):
        fc = next(s for s in sections if ". fuse-fc" in s.find_element(By.TAG_NAME, "h2").text)
        browser.execute_script("arguments[0].scrollIntoView(); window.scrollBy(0, -110);", fc)
        browser.save_screenshot(os.environ["CTROPT_SCREENSHOT"])
    assert _errors(browser) == []


def test_node_search_highlights_and_filters(browser, dien_report):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    path, _ = dien_report
    browser.get(path.as_uri())
    box = browser.find_element(By.ID, "search")
    box.send_keys("GRUSequence")
    hits = browser.find_element(By.ID, "hits").text
    assert "match" in hits and not hits.startswith("0 ")
    highlighted = browser.find_elements(By.CSS_SELECTOR, "g.node.hit")
    assert highlighted and all("GRUSequence" in h.get_attribute("data-name") for h in highlighted)
    filtered = browser.find_elements(By.CSS_SELECTOR, "section.pass.nomatch")
    kept = browser.find_elements(By.CSS_SELECTOR, "section.pass:not(.nomatch)")
    assert filtered and kept
    assert any("fuse-rnn" in s.find_element(By.TAG_NAME, "h2").text for s in kept)
    assert browser.find_elements(By.CSS_SELECTOR, ".timeline a.hit")
    box.send_keys(Keys.ENTER)  # jumps to the first hit
    first = highlighted[0]
    in_view = browser.execute_script(
        "var r = arguments[0].getBoundingClientRect(); return r.top >= 0 && r.bottom <= window.innerHeight;", first)
    assert in_view
    box.clear()
    box.send_keys("no-such-node-anywhere")
    assert browser.find_element(By.ID, "hits").text.startswith("0 matches")
    box.send_keys(Keys.CONTROL, "a", Keys.BACKSPACE)
    assert not browser.find_elements(By.CSS_SELECTOR, "section.pass.nomatch")
    assert _errors(browser) == []


def test_loop_and_scan_bodies_are_collapsible(browser, dien_report):
    from selenium.webdriver.common.by import By

    path, _ = dien_report
    browser.get(path.as_uri())
    bodies = [d for d in browser.find_elements(By.CSS_SELECTOR, ".side details")
              if "body" in d.find_element(By.TAG_NAME, "summary").text]
    assert bodies  # tf2onnx's Scan bodies, gone with fuse-rnn
    body = bodies[0]
    svg = body.find_element(By.CSS_SELECTOR, "svg.graph")
    assert not svg.is_displayed()
    body.find_element(By.TAG_NAME, "summary").click()
    assert svg.is_displayed() and len(svg.find_elements(By.CSS_SELECTOR, "g.node")) > 5
    scopes = browser.find_elements(By.XPATH, "//details/summary[starts-with(normalize-space(.), 'inside main/')]")
    assert scopes  # changes inside a body are grouped under their scope, which folds
    assert _errors(browser) == []


def test_docs_screenshot_is_in_the_repository():
    png = Path(__file__).parents[1] / "docs" / "report.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "docs/report.png" in (Path(__file__).parents[1] / "README.md").read_text()
