"""The status page at / and /ui: one HTML file, its script and its style,
served from the package (daemon/http/status/static/), no build step.

The page is open (it holds no data); what it shows it fetches with GETs from
the same JSON as everyone else (/v1/models, then /props?model=ID for each), so
it follows the same keys: with `api_key` set the page asks for the key, keeps
it in the tab's sessionStorage and sends it as Bearer. No key is ever written
into what is served here. The Content-Security-Policy allows scripts, styles
and fetches from this origin only (no inline script), no framing and no forms."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).resolve().parent / "static"
PAGE = "status.html"
ASSETS = {"status.js": "text/javascript", "status.css": "text/css", "favicon.svg": "image/svg+xml"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


@cache
def _file(directory: Path, name: str) -> bytes:
    return (directory / name).read_bytes()


def _read(name: str) -> bytes:
    return _file(STATIC, name)  # STATIC looked up at each call: a test may serve another directory


async def page(request: web.Request) -> web.Response:
    return web.Response(body=_read(PAGE), content_type="text/html", charset="utf-8", headers=HEADERS)


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in ASSETS:  # only the named files: no path ever reaches the file system
        raise web.HTTPNotFound()
    return web.Response(body=_read(name), content_type=ASSETS[name], charset="utf-8", headers=HEADERS)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", page)
    app.router.add_get("/ui", page)
    app.router.add_get("/ui/{name}", asset)
