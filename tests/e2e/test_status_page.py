"""The status page (/ and /ui) in a real browser: Debian's chromium driven by
Playwright's Python API (no browser download: executable_path=/usr/bin/chromium).

On the real bundled model: the page loads, shows the model sleeping, a request
wakes it and the page shows it ready with a wake on its timeline within its
refresh, with no console error; with an api_key the data is refused without
the key and shown with it. And the same checks, run against a broken page,
fail: the browser test can catch a broken page.

DORMOUSE_SCREENSHOT=docs/status-page.png writes a screenshot of the page after
the wake (how docs/status-page.png was made)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is absent (apt-get install chromium; .ci/run does)"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the `test` extra)")

REFRESH = 2.0  # the page's own refresh (status.js REFRESH_MS)
KEY = "page-test-key-5f1c"


@pytest.fixture(scope="module")
def browser():
    pw = sync_api.sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
    yield b
    b.close()
    pw.stop()


class Watched:
    """A page and what its console and script errors said."""

    def __init__(self, browser) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(browser):
    pages: list[Watched] = []

    def open_() -> Watched:
        pages.append(Watched(browser))
        return pages[-1]

    yield open_
    for w in pages:
        w.close()


def wait_for(condition, what: str, timeout: float, page=None):
    """Poll `condition` until it is truthy (bounded); fail naming what it waited for."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = condition()
        except sync_api.Error as exc:  # the page navigating or reloading
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.1)
    shown = page.inner_text("body")[:1500] if page is not None else ""
    raise AssertionError(f"page did not show {what} within {timeout:g}s (last {last!r}); page says:\n{shown}")


def model_state(page, model_id: str) -> str | None:
    card = page.locator(f'#models article.model[data-model="{model_id}"]')
    if card.count() != 1:
        return None
    return card.locator(".state").inner_text()


def wakes(page, model_id: str) -> int:
    return page.locator(f'#timeline li.event[data-kind="wake"][data-model="{model_id}"]').count()


def check_shows_state(w: Watched, model_id: str, state: str, timeout: float) -> None:
    wait_for(lambda: model_state(w.page, model_id) == state, f"{model_id} {state}", timeout, w.page)


def check_no_errors(w: Watched) -> None:
    assert not w.errors, f"the page logged errors: {w.errors}"


def check_page_loads(w: Watched, base: str) -> None:
    response = w.page.goto(base + "/")
    assert response is not None and response.status == 200, response and response.status
    assert w.page.title() == "Dormouse status"


def test_page_shows_a_sleeping_model_then_its_wake(start_daemon, watched):
    d = start_daemon("--sleep-idle-seconds", "-1")
    d.wait_state("ready", timeout=180)
    assert d.http.post("/sleep").status_code == 200
    d.wait_state("sleeping")
    model_id = d.props()["id"]

    w = watched()
    check_page_loads(w, d.url)
    check_shows_state(w, model_id, "sleeping", timeout=4 * REFRESH)
    # Asleep: no slot rows (no worker holds any), and why and when it fell asleep.
    card = w.page.locator(f'article[data-model="{model_id}"]')
    assert card.locator("tr.slot").count() == 0, card.inner_text()
    assert "no worker holds slots" in card.locator(".slots").inner_text()
    asleep = card.locator("dl.facts dt", has_text="asleep")
    assert asleep.count() == 1, card.inner_text()
    why = card.locator("dl.facts dt:text-is('asleep') + dd").inner_text()
    slept_at = d.props()["last_sleep"]["at"]
    assert why.startswith("asked to (POST /sleep)") and " ago)" in why, why
    shown_clock = w.page.evaluate("at => new Date(at * 1000).toLocaleTimeString()", slept_at)
    assert f"at {shown_clock}" in why, (why, shown_clock)  # the sleep's own time, as the page's clock writes it
    seen_wakes = wakes(w.page, model_id)  # the start's load is a wake too, if the page saw one
    assert w.page.locator("#timeline li.event[data-kind='sleep']").count() >= 1, "the sleep is on the timeline"

    r = d.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})  # wakes it
    assert r.status_code == 200, r.text
    check_shows_state(w, model_id, "ready", timeout=4 * REFRESH)
    wait_for(lambda: wakes(w.page, model_id) > seen_wakes, "a new wake on the timeline", 4 * REFRESH, w.page)
    event = w.page.locator(f'#timeline li.event[data-kind="wake"][data-model="{model_id}"]').first
    assert "reason request" in event.inner_text()
    assert "model" in event.locator(".legend").inner_text()  # the wake's phases
    memory = w.page.locator("#memory").inner_text()
    assert "model" in memory and "context" in memory and "Budget" in memory
    assert w.page.locator(f'article[data-model="{model_id}"] tr.slot').count() == d.props()["total_slots"]
    assert "Prompt cache" in w.page.locator(f'article[data-model="{model_id}"]').inner_text()
    check_no_errors(w)
    if os.environ.get("DORMOUSE_SCREENSHOT"):
        card = w.page.locator(f'article[data-model="{model_id}"]')
        wait_for(lambda: "0 in flight" in card.inner_text(), "the request done", 4 * REFRESH, w.page)
        w.page.screenshot(path=os.environ["DORMOUSE_SCREENSHOT"], full_page=True)


def test_with_an_api_key_the_data_needs_the_key(start_daemon, watched):
    d = start_daemon("--sleep-idle-seconds", "-1", "--api-key", KEY)
    d.wait_state("ready", timeout=180)
    model_id = d.http.get("/props", headers={"Authorization": f"Bearer {KEY}"}).json()["id"]

    w = watched()
    check_page_loads(w, d.url)  # the page itself is open
    assert KEY not in w.page.content()
    wait_for(lambda: w.page.locator("body[data-status='refused']").count() == 1, "the refusal", 4 * REFRESH, w.page)
    assert "API key" in w.page.locator("#notice").inner_text()
    assert model_state(w.page, model_id) is None, "no model is shown without the key"
    # The browser's 401s are console errors of their own; what matters here is the page's script.
    assert w.errors and all("401" in e for e in w.errors), w.errors  # the refused fetches, nothing else

    w.page.fill("#key", KEY)
    w.page.click("#key-form button[type=submit]")
    check_shows_state(w, model_id, "ready", timeout=4 * REFRESH)
    assert KEY not in w.page.content(), "the key is never written into the page"
    w.errors.clear()
    w.page.reload()  # kept for the tab (sessionStorage)
    check_shows_state(w, model_id, "ready", timeout=4 * REFRESH)
    check_no_errors(w)  # with the key, nothing is refused

    w.page.fill("#key", "wrong")
    w.page.click("#key-form button[type=submit]")
    wait_for(lambda: w.page.locator("body[data-status='refused']").count() == 1, "the refusal of a wrong key",
             4 * REFRESH, w.page)
    assert model_state(w.page, model_id) is None and w.page.locator("#timeline li.event").count() == 0


# ---- the checks above can fail ------------------------------------------------

class FakeDaemon:
    """The in-process fleet (tests.conftest.fake_fleet, fake worker speaking the real
    protocol) on its own event loop in a thread, so the sync browser API can drive it."""

    def __init__(self, **overrides) -> None:
        self.overrides = overrides
        self.ready = threading.Event()
        self.stop = None
        self.url = ""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        from tests.conftest import fake_fleet

        self.stop = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        try:
            async with fake_fleet(**self.overrides) as (fleet, client):
                self.fleet = fleet
                self.url = str(client.make_url("")).rstrip("/")
                self.ready.set()
                await self.stop.wait()
        except BaseException as exc:
            self.error = exc
            self.ready.set()

    def __enter__(self) -> FakeDaemon:
        self.thread.start()
        assert self.ready.wait(60), "the fake daemon did not start"
        if self.error:
            raise self.error
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@pytest.fixture
def broken_static(tmp_path, monkeypatch):
    """A copy of the page's files that the test may break; the daemon serves it."""
    from daemon.http.status import page as ui

    copy = tmp_path / "static"
    shutil.copytree(ui.STATIC, copy)
    monkeypatch.setattr(ui, "STATIC", copy)
    return copy


def _fake_shows_ready(browser, **fake) -> None:
    """The same checks as above, on the fake daemon: loads, shows `fake` ready, no errors."""
    with FakeDaemon(**fake) as d:
        model_id = d.fleet.default_model.id
        wait_for(lambda: str(d.fleet.default_model.controller.state) == "ready", "fake ready", 30)
        w = Watched(browser)
        try:
            check_page_loads(w, d.url)
            check_shows_state(w, model_id, "ready", timeout=2 * REFRESH)
            check_no_errors(w)
        finally:
            w.close()


def test_the_checks_pass_on_the_fake_daemon(browser, broken_static):
    _fake_shows_ready(browser)  # the unbroken copy: the control for the two below


def test_the_checks_catch_a_script_error(browser, broken_static):
    script = broken_static / "status.js"
    script.write_text(script.read_text().replace('"use strict";', '"use strict";\nundefinedFunctionOfTheTest();', 1))
    with pytest.raises(AssertionError, match="did not show|logged errors"):
        _fake_shows_ready(browser)


def test_the_checks_catch_a_missing_element(browser, broken_static):
    page = broken_static / "status.html"
    page.write_text(page.read_text().replace('<div id="models"></div>', ""))
    with pytest.raises(AssertionError, match="did not show|logged errors"):
        _fake_shows_ready(browser)


def test_untrusted_text_is_shown_as_text(browser):
    hostile = '<img src=x onerror="window.pwned=1">'
    with FakeDaemon(models={hostile: {}}) as d:
        wait_for(lambda: str(d.fleet.default_model.controller.state) == "ready", "fake ready", 30)
        w = Watched(browser)
        try:
            check_page_loads(w, d.url)
            wait_for(lambda: w.page.locator("article.model .model-id").count() == 1, "the model", 2 * REFRESH, w.page)
            assert w.page.locator("article.model .model-id").inner_text() == hostile
            assert w.page.locator("#models img").count() == 0
            assert w.page.evaluate("window.pwned") is None
            check_no_errors(w)
        finally:
            w.close()


def test_a_failed_model_shows_its_cause_as_text(browser, monkeypatch):
    cause = '<b id="injected">no such tensor</b> & "quoted"'
    monkeypatch.setenv("FAKE_LOAD_ERROR", cause)  # the fake worker answers the load with this error
    with FakeDaemon() as d:
        model_id = d.fleet.default_model.id
        wait_for(lambda: str(d.fleet.default_model.controller.state) == "failed", "fake failed", 30)
        w = Watched(browser)
        try:
            check_page_loads(w, d.url)
            check_shows_state(w, model_id, "failed", timeout=2 * REFRESH)
            wait_for(lambda: cause in w.page.locator("#errors").inner_text(), "the cause in the errors", 2 * REFRESH,
                     w.page)
            assert cause in w.page.locator(f'article[data-model="{model_id}"]').inner_text()
            assert w.page.locator("#injected").count() == 0
            check_no_errors(w)
        finally:
            w.close()
