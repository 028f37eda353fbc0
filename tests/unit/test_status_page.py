"""The status page's routes, without a browser: what is served, under which
headers and keys (the browser test is tests/e2e/test_status_page.py)."""

from __future__ import annotations

import re

from daemon.http.status import page as ui
from tests.conftest import fake_daemon

KEY = "unit-page-key-81d2"


async def test_the_page_is_served_at_root_and_ui_with_its_policy():
    async with fake_daemon() as (_, client):
        for path in ("/", "/ui"):
            r = await client.get(path)
            assert r.status == 200
            assert r.content_type == "text/html"
            csp = r.headers["Content-Security-Policy"]
            assert "script-src 'self'" in csp and "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
            assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            html = await r.text()
            # No inline script: every <script> names its file, and no on* handler attributes.
            assert all('src="/ui/' in tag for tag in re.findall(r"<script[^>]*>", html))
            assert re.search(r"<script[^>]*>\s*[^<\s]", html) is None  # nothing between <script> and </script>
            assert re.search(r"\son[a-z]+\s*=", html) is None and "style=" not in html
        for name, kind in ui.ASSETS.items():
            r = await client.get(f"/ui/{name}")
            assert r.status == 200 and r.content_type == kind, name
        assert (await client.get("/ui/../app.py")).status == 404
        assert (await client.get("/ui/ui.py")).status == 404


async def test_the_script_writes_text_only():
    script = (ui.STATIC / "status.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script.replace("never innerHTML", ""), sink
    assert "fetch(" in script and "method" not in script  # GETs only


async def test_with_an_api_key_the_page_is_open_and_the_data_is_not():
    async with fake_daemon(api_key=KEY) as (_, client):
        r = await client.get("/")
        assert r.status == 200
        assert KEY not in await r.text()
        for name in ui.ASSETS:
            assert KEY not in await (await client.get(f"/ui/{name}")).text()
        assert (await client.get("/props")).status == 401
        assert (await client.get("/v1/models")).status == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert (await client.get("/props", headers=auth)).status == 200


async def test_the_page_keeps_the_host_rule():
    async with fake_daemon(allowed_hosts=["localhost"]) as (_, client):
        assert (await client.get("/", headers={"Host": "evil.example"})).status == 403
        assert (await client.get("/", headers={"Host": "localhost:8080"})).status == 200


async def test_the_page_and_its_files_are_logged_as_quietly_as_a_scrape(monkeypatch):
    """A page left open asks every 2 s; its loads are debug lines, as /props's are, not info."""
    import tests.conftest

    lines: list[tuple[str, str]] = []

    class Recorder:
        def bind(self, **_):
            return self

        def __getattr__(self, level):
            return lambda event, **fields: lines.append((level, fields.get("endpoint", ""))) if event == "request" \
                else None

    monkeypatch.setattr(tests.conftest, "get_logger", lambda *a, **k: Recorder())
    async with fake_daemon() as (_, client):
        for path in ("/", "/ui", "/ui/status.js", "/props", "/nope"):
            await client.get(path)
    levels = dict((endpoint, level) for level, endpoint in lines)
    assert levels["/"] == levels["/ui"] == levels["/ui/status.js"] == levels["/props"] == "debug", lines
    assert levels["/nope"] == "info", lines  # the rest is still worth a line


async def test_status_page_false_leaves_no_page_as_llama_servers_no_ui():
    async with fake_daemon(status_page=False) as (_, client):
        for path in ("/", "/ui", "/ui/status.js"):
            assert (await client.get(path)).status == 404
        assert (await client.get("/v1/models")).status == 200  # the API is all still there
