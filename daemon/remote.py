"""`dormouse status|sleep|wake`: ask a running daemon, with the standard library only.

By default a short answer for a person (which model, its state and tier,
slots busy, memory, why it sleeps); --json prints the daemon's own JSON for
scripts. The daemon is --url, else $DORMOUSE_URL, else 127.0.0.1:8080; a URL
without a scheme ("host:port", as llama-server and curl take it) is http.
Every failure is one line on stderr and exit 1: a daemon that is down, a
refusal, an answer that is not the daemon's JSON.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV = "DORMOUSE_URL"
MAX_ANSWER_BYTES = 64 * 2**20  # a /props is kilobytes: more is not the daemon


class BadUrl(ValueError):
    pass


def daemon_url(given: str | None) -> str:
    """The base URL from --url or $DORMOUSE_URL: "http://h:p", "h:p", ":p" or "p" (a port on 127.0.0.1)."""
    url = (given if given is not None else os.environ.get(URL_ENV) or DEFAULT_URL).strip()
    if url.isdigit():
        url = f"127.0.0.1:{url}"
    elif url.startswith(":"):
        url = "127.0.0.1" + url
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError as exc:
        raise BadUrl(f"{url[:200]!r} is not a daemon address ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment or \
            len(url) > 2048 or any(ch.isspace() for ch in url):
        raise BadUrl(f"{url[:200]!r} is not a daemon address (give host:port or http://host:port)")
    return url.rstrip("/")


def ask(command: str, url: str, key: str | None, model: str | None) -> dict[str, Any]:
    """The daemon's JSON answer; raises RemoteError with one line."""
    path, method = {"status": ("/props", "GET"), "sleep": ("/sleep", "POST"), "wake": ("/wake", "POST")}[command]
    if model is not None:
        path += "?" + urllib.parse.urlencode({"model": model})
    # A POST declares JSON: the daemon refuses other bodies (urllib would send a form type).
    request = urllib.request.Request(url + path, method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Content-Type": "application/json"} if method == "POST" else {})
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            raw = response.read(MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read(MAX_ANSWER_BYTES) or b"{}").get("error", {}).get("message", exc.reason)
        except (ValueError, AttributeError, OSError, http.client.HTTPException):
            detail = exc.reason  # not the daemon's JSON error (a proxy's page, say)
        raise RemoteError(f"{command} refused ({exc.code}): {detail}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise RemoteError(f"cannot reach the daemon at {url}: {reason} (is it running? --url or {URL_ENV} "
                          f"names another)") from None
    try:
        body = json.loads(raw) if len(raw) <= MAX_ANSWER_BYTES else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise RemoteError(f"{url} answered {command} with something that is not Dormouse's JSON")
    return body


class RemoteError(Exception):
    pass


# -- a person's answer ----------------------------------------------------------


def size(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool) or n < 0:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def seconds(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "?"
    if n < 120:
        return f"{n:.1f} s"
    if n < 3600:
        minutes, rest = divmod(round(n), 60)
        return f"{minutes} min" + (f" {rest} s" if rest else "")
    return f"{n / 3600:.1f} h"


def ago(at: Any) -> str:
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        return "?"
    return seconds(max(time.time() - at, 0)) + " ago"


def _state(state: Any, tier: Any, failure: Any = None) -> str:
    text = str(state)
    if tier and state in ("sleeping", "drowsy"):
        text += f" ({tier} tier)"
    if failure:
        text += f": {failure}"
    return text


def _why_asleep(last_sleep: Any) -> str:
    if not isinstance(last_sleep, dict):
        return "not loaded yet"
    reason = last_sleep.get("reason")
    why = {"idle": "idle", "admin": "asked to (POST /sleep)", "evict": "made room for another model",
           "shutdown": "shutting down"}.get(reason, str(reason))
    return f"{why}, {ago(last_sleep.get('at'))}"


def _footprint(model: dict) -> str:
    fp = model.get("footprint_bytes") or {}
    if fp.get("measured"):
        return f"{size(fp['measured'])} measured"
    return f"{size(fp.get('predicted'))} predicted" if fp.get("predicted") else "?"


def status_lines(body: dict) -> list[str]:
    """/props as a few lines: the model asked about, then every model of a fleet."""
    fleet = body.get("fleet") if isinstance(body.get("fleet"), dict) else {}
    models = [m for m in fleet.get("models") or [] if isinstance(m, dict)]
    me = next((m for m in models if m.get("id") == body.get("id")), {})
    state = body.get("state")
    default = " (default)" if me.get("default") else ""
    lines = [f"model    {body.get('id')}{default}  {body.get('model_path') or ''}".rstrip(),
             f"state    {_state(state, body.get('tier'), body.get('failure'))}"]
    if state == "ready":
        slots = body.get("slots") if isinstance(body.get("slots"), list) else []
        busy = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))
        lines.append(f"slots    {busy}/{body.get('total_slots', len(slots))} busy, "
                     f"{body.get('requests_waiting', 0)} waiting")
        idle = body.get("idle_seconds", body.get("sleep_idle_seconds"))
        if isinstance(idle, (int, float)) and idle < 0:
            lines.append("sleeps   never (sleep_idle_seconds = -1)")
        else:
            left = body.get("idle_timer_remaining")
            lines.append(f"sleeps   after {seconds(idle)} idle"
                         + (f" ({seconds(left)} left)" if isinstance(left, (int, float)) else " (busy now)"))
    elif state in ("sleeping", "drowsy"):
        lines.append(f"why      {_why_asleep(body.get('last_sleep'))}")
        prediction = body.get("wake_prediction")
        if isinstance(prediction, dict):
            lines.append(f"wakes    in about {seconds(prediction.get('seconds'))} on the next request")
    memory = f"memory   {_footprint(me)}" if me else "memory   ?"
    if fleet.get("budget_bytes"):
        memory += f"; the fleet plans {size(fleet.get('planned_bytes'))} of a {size(fleet['budget_bytes'])} budget"
    lines.append(memory)
    if len(models) > 1:
        lines.append("models")
        width = max(len(str(m.get("id"))) for m in models)
        for m in models:
            marks = "".join(f"  {mark}" for mark in ("default", "pinned") if m.get(mark))
            lines.append(f"  {str(m.get('id')):<{width}}  {_state(m.get('state'), m.get('tier')):<22} "
                         f"{_footprint(m)}{marks}")
    return lines


def _one_change(answer: dict, command: str) -> str:
    model = answer.get("model", "?")
    if not answer.get("ok", True):
        return f"{model}: not {'put to sleep' if command == 'sleep' else 'woken'}: {answer.get('message')}"
    if command == "wake":
        wake = answer.get("last_wake") if isinstance(answer.get("last_wake"), dict) else None
        took = f" (woke in {seconds(wake.get('seconds'))})" if wake and answer.get("message") != "already ready" else ""
        return f"{model}: {answer.get('state')}{took}"
    return f"{model}: {_state(answer.get('state'), answer.get('tier'))}"


def change_lines(body: dict, command: str) -> list[str]:
    """sleep's and wake's answers: one line per model."""
    if isinstance(body.get("models"), dict):
        return [_one_change(a, command) for a in body["models"].values() if isinstance(a, dict)]
    return [_one_change(body, command)]


def run_remote(command: str, url: str | None, admin_key: str | None, api_key: str | None, model: str | None,
               as_json: bool) -> int:
    try:
        base = daemon_url(url)
    except BadUrl as exc:
        print(f"dormouse: {exc}", file=sys.stderr)
        return 2
    # /props takes the API key first; /sleep and /wake the admin key (the API key opens them without one).
    key = (api_key or admin_key) if command == "status" else (admin_key or api_key)
    try:
        body = ask(command, base, key, model)
    except RemoteError as exc:
        print(f"dormouse: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(body, indent=2))
    else:
        print("\n".join(status_lines(body) if command == "status" else change_lines(body, command)))
    partly = command == "sleep" and body.get("ok") is False  # a fleet's sleep where a model was busy
    return 1 if partly else 0
