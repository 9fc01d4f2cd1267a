"""The exporter's status page: ``/`` (one self-contained HTML document) and ``/status.json``,
through real HTTP requests to a monitor served on port 0, and in a real headless chromium."""

from __future__ import annotations

import base64
import http.client
import json
import math
import re

import pytest
import torch
import yaml
from conftest import require_binary, require_module

from lossbeat import Monitor, MonitorConfig
from lossbeat.exposition.metrics import HEALTH_CHECKS
from lossbeat.exposition.state import LAYER_HISTORY_STEPS, RECENT_STEPS
from lossbeat.exposition.status import _quantise, heatmap_matrix, level_norm, page_html

EVIL = "<script>alert(1)</script>"


def request(port, path="/status.json", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def strict_json(body: bytes):
    def refuse(name):
        raise AssertionError(f"non-JSON constant {name} in /status.json")

    return json.loads(body, parse_constant=refuse)


def status(port):
    code, headers, body = request(port)
    assert code == 200 and headers["Content-Type"] == "application/json"
    return strict_json(body), body


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module(EVIL, torch.nn.Linear(4, 4))
    model.add_module("head", torch.nn.Linear(4, 1))
    return model


def train(monitor, model, steps, start=0, nan_at=()):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(start, start + steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        monitor.observe(step, loss=float("nan") if step in nan_at else loss, model=model, optimizer=opt)
        opt.step()
    monitor.flush()


@pytest.fixture
def served():
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", run_name=f"run {EVIL}", log_status_changes=False)) as m:
        yield m, make_model()


def test_status_json_follows_the_run(served):
    monitor, model = served
    train(monitor, model, 20)
    doc, body = status(monitor.port)
    assert doc["run"]["step"] == 19 and doc["run"]["rank"] == "0" and doc["run"]["world_size"] == "1"
    assert doc["run"]["name"] == f"run {EVIL}" and doc["run"]["profile"] == monitor.thresholds.profile.name
    assert doc["series"]["step"] == list(range(20))
    assert doc["series"]["loss"][-1] == pytest.approx(monitor.state.loss)
    assert doc["series"]["learning_rate"] == [0.01] * 20
    assert doc["current"]["grad_norm_ceiling"] == monitor.thresholds.gradients.explosion
    # The diagnosis: one line per check of the last judgment (step 19 is judged: every 10 steps).
    # The router and policy checks speak only for runs with expert loads or the rl profile.
    judged = set(HEALTH_CHECKS) - {"memory", "throughput", "lr_schedule", "moe_router", "rl_entropy", "rl_kl"}
    assert {f["check"] for f in doc["findings"]} >= judged
    assert [(f["check"], f["message"]) for f in doc["findings"]] == [(f.check, f.message) for f in monitor.findings]
    assert [i["number"] for i in doc["checklist"]] == list(range(1, 9))

    # Heatmap: one row per exported layer, one column per measured step; the names come back
    # as JSON strings, and the raw body holds no markup at all.
    exported = list(monitor.state.layer_norms)
    assert doc["layers"]["names"] == exported and EVIL in exported
    rows = heatmap_matrix(doc["layers"])
    assert len(rows) == len(exported) and all(len(r) == 20 for r in rows)
    # Levels of an absolute log scale, 0.1 decade apart: within 13 % of the norm.
    assert rows[0][-1] == pytest.approx(monitor.state.layer_norms[EVIL], rel=0.13)
    assert b"<" not in body and b">" not in body

    train(monitor, model, 15, start=20)
    later, _ = status(monitor.port)
    assert later["run"]["step"] == 34 and later["counters"]["steps"] == 35


def test_a_nan_turns_the_nonfinite_line_red_and_counts(served):
    monitor, model = served
    train(monitor, model, 10)
    before, _ = status(monitor.port)
    assert {f["check"]: f["status"] for f in before["findings"]}["nonfinite"] == "good"
    # Non-finite from step 15 on, still at the diagnosis of step 19: danger at once (an isolated
    # NaN the run recovered from is a warning, what fp16 overflow skips look like).
    train(monitor, model, 10, start=10, nan_at=range(15, 20))
    doc, _ = status(monitor.port)
    assert {f["check"]: f["status"] for f in doc["findings"]}["nonfinite"] == "danger"
    assert doc["counters"]["nonfinite_loss"] == 5 and doc["last_event_step"]["nonfinite_loss"] == 19
    assert doc["series"]["loss"][15] is None  # a gap in the curve, never a NaN in the JSON
    assert next(i for i in doc["checklist"] if i["number"] == 6)["status"] == "danger"


def test_eval_curve_and_bounded_windows():
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", log_status_changes=False)) as monitor:
        for step in range(RECENT_STEPS + 30):
            monitor.observe(step, loss=1.0 / (1 + step), grad_norm=1.0)
        monitor.observe_eval(RECENT_STEPS, 0.25)
        doc, _ = status(monitor.port)
    assert len(doc["series"]["step"]) == RECENT_STEPS and doc["series"]["step"][-1] == RECENT_STEPS + 29
    assert doc["eval"] == {"step": [RECENT_STEPS], "loss": [0.25]}
    assert doc["layers"]["names"] == []  # no model: no heatmap on this rank


def test_layer_history_is_bounded(served):
    monitor, _ = served
    model = torch.nn.Linear(2, 1)
    for step in range(LAYER_HISTORY_STEPS + 5):
        model.weight.grad = torch.ones_like(model.weight)
        model.bias.grad = torch.ones_like(model.bias)
        monitor.observe(step, loss=1.0, model=model)
    monitor.flush()
    doc, _ = status(monitor.port)
    assert doc["layers"]["steps"] == list(range(5, LAYER_HISTORY_STEPS + 5))


def test_heatmap_levels_and_layers_that_come_and_go(served):
    _, hexes = _quantise({"a": 1.0, "b": 0.0, "c": float("nan"), "d": 1e-20, "e": 1e30, "f": 0.05})
    levels = [int(hexes[i : i + 2], 16) for i in range(0, len(hexes), 2)]
    assert levels[1:5] == [0, 0, 1, 255]
    assert level_norm(levels[0]) == pytest.approx(1.0) and level_norm(levels[5]) == pytest.approx(0.05, rel=0.13)
    monitor, _ = served
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    for step in range(3):
        for i, layer in enumerate(model):
            used = not (step == 1 and i == 0)  # layer 0 has no gradient at step 1
            layer.weight.grad = torch.full_like(layer.weight, 1.0) if used else None
            layer.bias.grad = torch.full_like(layer.bias, 1.0) if used else None
        monitor.observe(step, loss=1.0, model=model)
    monitor.flush()
    doc, _ = status(monitor.port)
    rows = heatmap_matrix(doc["layers"])
    assert doc["layers"]["names"] == ["0", "1"] and len(doc["layers"]["sets"]) == 2
    assert rows[0][1] is None and rows[0][0] == pytest.approx(6**0.5, rel=0.13) and None not in rows[1]


def test_the_page_is_self_contained_and_never_injects_html(served):
    monitor, _ = served
    code, headers, body = request(monitor.port, "/")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert body == page_html()
    page = body.decode()
    # No CDN, no external font or script: the only URLs are the SVG namespace and relative links.
    assert re.findall(r"https?://[^\"' ]+", page) == ["http://www.w3.org/2000/svg"]
    assert "<script src" not in page and "@import" not in page and "url(" not in page
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in page, sink
    assert page.count("textContent") >= 5
    assert 'fetch("status.json"' in page  # polls the JSON, not a reload
    assert "http-equiv" not in page.lower()


def write_config(tmp_path, doc):
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_status_json_is_behind_basic_auth(tmp_path):
    bcrypt = require_module("bcrypt")
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    config = write_config(
        tmp_path,
        {"basic_auth_users": {"prometheus": hashed}, "http_server_config": {"headers": {"Cache-Control": "private"}}},
    )
    good = {"Authorization": "Basic " + base64.b64encode(b"prometheus:s3cret").decode()}
    bad = {"Authorization": "Basic " + base64.b64encode(b"prometheus:wrong").decode()}
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", web_config=config, run_name="secret-run")) as m:
        m.observe(7, loss=1.5)
        for path in ("/status.json", "/"):
            for headers in ({}, bad):
                code, resp_headers, body = request(m.port, path, headers)
                assert code == 401 and resp_headers["WWW-Authenticate"].startswith("Basic")
                assert b"secret-run" not in body and b"fetch(" not in body
        code, _, body = request(m.port, "/status.json", good)
        assert code == 200 and strict_json(body)["run"]["step"] == 7
        assert request(m.port, "/", good)[0] == 200
        conn = http.client.HTTPConnection("127.0.0.1", m.port, timeout=30)
        conn.request("GET", "/status.json", headers=good)
        resp = conn.getresponse()
        resp.read()
        conn.close()
        assert resp.msg.get_all("Cache-Control") == ["private"]  # the web config's header, not ours too


def test_non_finite_current_values_are_strings():
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", log_status_changes=False)) as m:
        m.observe(0, loss=float("inf"), grad_norm=float("nan"))
        m.flush()
        doc, _ = status(m.port)
    assert doc["current"]["loss"] == "NaN" or doc["current"]["loss"] == "Inf"
    assert doc["current"]["grad_norm"] == "NaN"
    assert doc["series"]["loss"] == [None] and doc["series"]["grad_norm"] == [None]
    assert not any(isinstance(x, float) and not math.isfinite(x) for x in doc["current"].values())


# --- a real browser -------------------------------------------------------------------------


@pytest.fixture
def browser():
    require_binary("chromium", "chromium-browser", install="apt-get install chromium chromium-driver")
    driver_path = require_binary("chromedriver", install="apt-get install chromium chromium-driver")
    webdriver = require_module("selenium.webdriver")
    options = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1300,1600",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, timeout=30):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The page redraws its rows on every poll, so an element found a moment ago may be gone.
    return WebDriverWait(
        driver, timeout, poll_frequency=0.2, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
    ).until(lambda d: condition(d))


def test_in_a_real_browser(served, browser):
    from selenium.webdriver.common.by import By

    monitor, model = served
    train(monitor, model, 20)
    browser.get(f"http://127.0.0.1:{monitor.port}/")
    wait_for(browser, lambda d: d.find_element(By.ID, "run-step").text == "19")
    assert browser.find_element(By.ID, "run-name").text == f"run {EVIL}"

    # The heatmap: one row per exported layer, the <script> name shown as text, not run.
    labels = [e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR, "#heat-names div")]
    assert labels == list(monitor.state.layer_norms) and EVIL in labels
    assert browser.execute_script("return document.querySelectorAll('script').length") == 1
    assert (
        browser.execute_script(
            "return document.querySelectorAll('#heat-names div *, #findings *:not(tr):not(td):not(div)').length"
        )
        == 0
    )

    # The step advances between two looks (the page polls; no reload).
    browser.execute_script("window.__same_page = true")
    train(monitor, model, 10, start=20)
    wait_for(browser, lambda d: d.find_element(By.ID, "run-step").text == "29")
    assert browser.execute_script("return window.__same_page === true")

    nonfinite = 'tr[data-check="nonfinite"]'
    assert wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, nonfinite).get_attribute("class")) == "good"
    train(monitor, model, 10, start=30, nan_at=range(33, 40))  # still non-finite when judged: danger
    wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, nonfinite).get_attribute("class") == "danger")
    # Read in one script: a row found first could be redrawn before its colour is read.
    red = browser.execute_script(
        "return getComputedStyle(document.querySelector(arguments[0])).color", nonfinite + " td.st"
    )
    assert red in ("rgba(207, 34, 46, 1)", "rgb(207, 34, 46)")
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-loss path")  # the curves are drawn
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []


# --- lossbeat analyze --html -----------------------------------------------------------------


@pytest.fixture(scope="module")
def static_page(tmp_path_factory):
    """``lossbeat analyze LOG --html OUT`` and ``--json`` on a real log, in this process."""
    import argparse
    import contextlib
    import io

    from conftest import REAL_LOGS

    from lossbeat.analyze import add_arguments, run

    log = REAL_LOGS / "hf-t5-small-summarization-gradspike-trainer_state.json"
    out = tmp_path_factory.mktemp("html") / "run.html"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    outputs = []
    for extra in (["--html", str(out)], ["--json"]):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert run(parser.parse_args([str(log), *extra])) in (0, 1)
        outputs.append(buffer.getvalue())
    page = out.read_text()
    match = re.search(r"<script>window\.LOSSBEAT_STATUS = (.*?);</script>", page)
    return out, strict_json(match.group(1).encode()), json.loads(outputs[1])[0]


def test_analyze_html_writes_the_page_for_a_finished_log(static_page):
    out, doc, analysed = static_page
    assert doc["run"]["step"] == analysed["last_step"]
    assert len(doc["series"]["step"]) == analysed["read"]["train"] > 0
    assert [(f["check"], f["status"]) for f in doc["findings"]] == [
        (f["check"], f["status"] if f["known"] else "unknown") for f in analysed["findings"]
    ]
    assert {k: doc["counters"][k] for k in analysed["events"]} == analysed["events"]
    for kind, steps in analysed["event_steps"].items():
        assert doc["last_event_step"][kind] == (steps[-1] if steps else None)
    page = out.read_text()
    assert page.count("<script") == 2 and "fetch(" in page  # the data, then the live page's script


def test_analyze_html_in_a_real_browser(static_page, browser):
    from selenium.webdriver.common.by import By

    out, doc, _ = static_page
    browser.get(out.as_uri())
    wait_for(browser, lambda d: d.find_element(By.ID, "run-step").text == str(doc["run"]["step"]))
    rows = browser.find_elements(By.CSS_SELECTOR, "#findings tr")
    assert [r.get_attribute("data-check") for r in rows] == [f["check"] for f in doc["findings"]]
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-loss path")
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []


def test_the_heatmap_keeps_the_window_around_the_first_non_finite_step(served):
    """The latest window moves on; the moment that matters stays: the per-layer norms of the steps
    around the first non-finite loss, next to the latest ones."""
    monitor, model = served
    train(monitor, model, 40, nan_at=(30,))
    train(monitor, model, LAYER_HISTORY_STEPS + 40, start=40)
    doc, _ = status(monitor.port)
    first = doc["layers_first_event"]
    assert first["step"] == 30 and first["names"] == doc["layers"]["names"]
    assert first["steps"] == list(range(5, 56))  # 25 steps on each side of it
    assert len(heatmap_matrix(first)[0]) == 51
    assert doc["layers"]["steps"][0] > 55  # the latest window alone no longer holds it


def test_a_nan_loss_is_shown_as_not_judged_never_good(served):
    monitor, model = served
    train(monitor, model, 30)
    train(monitor, model, 10, start=30, nan_at=range(30, 40))
    doc, _ = status(monitor.port)
    statuses = {f["check"]: f["status"] for f in doc["findings"]}
    for check in ("loss_range", "loss_trend", "loss_volatility", "learning"):
        assert statuses[check] == "unknown", (check, statuses[check])
    items = {i["number"]: i["status"] for i in doc["checklist"]}
    assert items[1] != "good" and items[2] != "good" and items[3] != "good"
    assert doc["current"]["loss"] == "NaN"
