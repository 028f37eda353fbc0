"""Unknown request fields (issue 30): still accepted and ignored, but named in
one warning line per request, as vLLM logs them, so a misspelt `max_token` is
seen. The line is bounded whatever the body holds, and finding its names costs
a bounded number of scans of the body (counted, not timed)."""

from __future__ import annotations

import json

import msgspec
import pytest
from structlog.testing import capture_logs

from daemon.http.core import schemas
from daemon.http.dialects.openai.body import ChatCompletionRequest
from daemon.http.core.schemas import MAX_IGNORED_NAME_CHARS, MAX_IGNORED_NAMES, CompletionRequest, decode_body
from daemon.http.dialects.ollama.request import OllamaChatRequest

ASK = [{"role": "user", "content": "hi"}]


def warnings(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "request.ignored_fields"]


def decoded(body, model=ChatCompletionRequest) -> tuple[dict, list[dict]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with capture_logs() as logs:
        data = decode_body(raw, model)
    return data, warnings(logs)


def test_a_misspelt_field_is_named_and_the_rest_is_decoded():
    data, [line] = decoded({"model": "m", "messages": ASK, "max_token": 5})
    assert data == {"model": "m", "messages": ASK} and "max_token" not in data
    assert line["fields"] == ["max_token"] and line["more"] is False and line["log_level"] == "warning"
    assert line["body"] == "ChatCompletionRequest"


def test_known_fields_only_log_nothing():
    assert decoded({"model": "m", "messages": ASK, "max_tokens": 5})[1] == []
    assert decoded({"prompt": "x", "max_tokens": 5}, CompletionRequest)[1] == []


@pytest.mark.parametrize("model, body", [
    (CompletionRequest, {"prompt": "x", "max_token": 5}),
    (OllamaChatRequest, {"model": "m", "messages": ASK, "max_token": 5}),  # every dialect decodes through here
])
def test_every_dialects_body_names_its_ignored_fields(model, body):
    assert decoded(body, model)[1][0]["fields"] == ["max_token"]


def test_ten_thousand_unknown_keys_log_one_bounded_line():
    body = {**{f"k{i}": i for i in range(10_000)}, "model": "m", "messages": ASK}
    data, [line] = decoded(body)
    assert data == {"model": "m", "messages": ASK}
    assert line["fields"] == [f"k{i}" for i in range(MAX_IGNORED_NAMES)] and line["more"] is True
    assert len(json.dumps(line)) < 1000


def test_a_huge_or_odd_name_is_cut_in_the_line():
    huge = "x" * 1_000_000
    _, [line] = decoded({huge: 1, "quote\"back\\slash\nnewline": 2, "after": 3, "messages": ASK})
    assert line["fields"][0] == "x" * MAX_IGNORED_NAME_CHARS + "..."
    # msgspec cannot match a name with quotes, backslashes or control characters again: the list stops there
    assert line["fields"][1] == "quote\"back\\slash\nnewline" and line["more"] is True


def test_finding_the_names_costs_a_bounded_number_of_scans(monkeypatch):
    """One scan when no key is unknown; at most MAX_IGNORED_NAMES + 1 more (each strict decode stops at the next
    unknown key) whatever the number of keys: 10 and 100,000 unknown keys cost the same count."""
    scans = 0
    real = msgspec.json.Decoder

    class Counting:
        def __init__(self, *args, **kwargs):
            self._decoder = real(*args, **kwargs)

        def decode(self, raw):
            nonlocal scans
            scans += 1
            return self._decoder.decode(raw)

    monkeypatch.setattr(schemas.msgspec.json, "Decoder", Counting)
    schemas._envelope.cache_clear()
    try:
        counts = []
        for n in (0, 1, 10, 100_000):
            scans = 0
            decoded({**{f"k{i}": i for i in range(n)}, "messages": ASK})
            counts.append(scans)
    finally:
        monkeypatch.undo()
        schemas._envelope.cache_clear()
    # 0: the strict decode alone. n > 0: strict, lenient, then one per name found and one to learn there is more.
    assert counts == [1, 2 + 2, 2 + MAX_IGNORED_NAMES + 1, 2 + MAX_IGNORED_NAMES + 1]


def test_a_body_that_is_not_json_past_an_unknown_key_is_still_refused():
    with pytest.raises(msgspec.DecodeError):
        decoded(b'{"max_token": 1, garbage')
    with pytest.raises(msgspec.ValidationError):
        decoded(b"[1, 2]")
