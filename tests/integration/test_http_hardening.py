"""One request must never hurt everyone (issue 9, the HTTP layer), against the
fake worker: who may call what (Content-Type, Origin, Host, keys), bounds on
what reaches llama.cpp, bodies that are cheap to refuse however big, images
checked by their header before the worker sees them, and honest answers
(/wake past wake_timeout, a log line for every rejection, usage: null)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from contextlib import asynccontextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.http.errors import ApiError
from daemon.logs import configure_logging
from statemachine import ServerState
from tests.conftest import fake_daemon
from tests.metrics_text import value
from tests.unit.test_images import bmp, gif, jpeg, png

COMPLETION = {"prompt": "hi", "max_tokens": 2}


async def ready(controller, timeout=10):
    assert await controller.wait_for(lambda s: s is ServerState.READY, timeout), controller.state


@asynccontextmanager
async def daemon(**overrides):
    """fake_daemon, once its worker is loaded (its answers are then the ready ones)."""
    async with fake_daemon(**overrides) as (controller, client):
        await ready(controller)
        yield controller, client


async def error_of(response, status: int) -> dict:
    assert response.status == status, await response.text()
    return (await response.json())["error"]


async def raw_http(client, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written byte for byte (headers aiohttp's client would not send)."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(head.replace(b"\n", b"\r\n") + b"Connection: close\r\n\r\n" + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


# -- A. access ---------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/octet-stream"])
async def test_a_body_not_declared_json_is_415(content_type):
    """A web page can POST these cross-origin without a preflight."""
    async with daemon() as (controller, client):
        response = await client.post("/v1/completions", data=json.dumps(COMPLETION), headers={"Content-Type": content_type})
        error = await error_of(response, 415)
        assert error["code"] == "unsupported_media_type" and error["type"] == "invalid_request_error"
        assert content_type.split(";")[0].lower() in error["message"] and "application/json" in error["message"]
        assert controller.state is ServerState.READY


async def test_json_with_parameters_is_accepted_and_no_content_type_is_not():
    async with daemon() as (controller, client):
        for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            response = await client.post("/v1/chat/completions", headers={"Content-Type": content_type},
                                         data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
            assert response.status == 200, (content_type, await response.text())
        body = json.dumps(COMPLETION).encode()
        status, answer = await raw_http(client, b"POST /v1/completions HTTP/1.1\nHost: localhost\nContent-Length: %d\n" % len(body), body)
        assert status == 415 and b"no Content-Type" in answer


async def test_sleep_and_wake_take_no_body_without_content_type_but_refuse_other_types():
    async with daemon() as (controller, client):
        # curl -XPOST localhost:8080/sleep: no body, no Content-Type.
        status, _ = await raw_http(client, b"POST /sleep HTTP/1.1\nHost: localhost\n")
        assert status == 200 and controller.state is ServerState.SLEEPING
        status, _ = await raw_http(client, b"POST /wake HTTP/1.1\nHost: localhost\nContent-Length: 0\n")
        assert status == 200 and controller.state is ServerState.READY
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            response = await client.post("/sleep", headers={"Content-Type": content_type})
            assert (await error_of(response, 415))["code"] == "unsupported_media_type"
        status, _ = await raw_http(client, b"POST /sleep HTTP/1.1\nHost: localhost\nContent-Length: 2\n", b"{}")  # a body, no type
        assert status == 415
        assert controller.state is ServerState.READY
        assert (await client.post("/sleep", json={})).status == 200
        assert (await client.post("/wake")).status == 200  # aiohttp's client: empty body, application/octet-stream


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1",
                                    "http://127.0.0.1.evil.example", "garbage:://"])
async def test_cross_origin_post_is_403(origin):
    """Browsers send Origin on every cross-origin POST, no-cors fetches included."""
    async with daemon() as (controller, client):
        response = await client.post("/v1/completions", json=COMPLETION, headers={"Origin": origin})
        assert (await error_of(response, 403))["code"] == "cross_origin"
        response = await client.post("/sleep", headers={"Origin": origin})
        assert (await error_of(response, 403))["type"] == "permission_error"
        assert controller.state is ServerState.READY


async def test_same_origin_post_and_cross_origin_get_pass():
    async with daemon(allowed_hosts=["dormouse.lan"]) as (controller, client):
        port = client.server.port
        for origin, host in ((f"http://127.0.0.1:{port}", None), ("http://localhost:8080", "localhost:8080"),
                             ("https://dormouse.lan", "dormouse.lan"), ("http://[::1]:8080", "[::1]:8080"),
                             ("HTTP://LocalHost:8080", "localhost:8080")):
            headers = {"Origin": origin, **({"Host": host} if host else {})}
            response = await client.post("/v1/completions", json=COMPLETION, headers=headers)
            assert response.status == 200, (origin, await response.text())
        assert (await client.get("/health", headers={"Origin": "http://evil.example"})).status == 200


async def test_allowed_hosts_refuses_other_host_names():
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example."""
    async with daemon(allowed_hosts=["localhost", "[::1]", "Dormouse.LAN"]) as (controller, client):
        for host in ("localhost", "localhost:8080", "LOCALHOST.:8080", "[::1]:8080", "[0:0::1]", "dormouse.lan",
                     "127.0.0.1"):  # a loopback address is always served (it cannot be rebound)
            assert (await client.get("/health", headers={"Host": host})).status == 200, host
        assert (await client.post("/v1/completions", json=COMPLETION, headers={"Host": "localhost:1"})).status == 200
        for host in ("evil.example", "localhost:http", "[::1", "localhost.evil.example", "[::2]:8080"):
            response = await client.get("/health", headers={"Host": host})
            assert (await error_of(response, 403))["code"] == "host_not_allowed", host
        response = await client.post("/v1/completions", json=COMPLETION, headers={"Host": "evil.example"})
        assert response.status == 403
        status, _ = await raw_http(client, b"GET /health HTTP/1.0\n")  # no Host at all
        assert status == 403
    async with daemon() as (controller, client):  # default: on (tests/integration/test_host_check.py)
        assert (await client.get("/health", headers={"Host": "evil.example"})).status == 403
    async with daemon(allowed_hosts=["*"]) as (controller, client):  # "*": any host
        assert (await client.get("/health", headers={"Host": "evil.example"})).status == 200


async def test_api_key_guards_props_and_slots_and_stands_in_for_a_missing_admin_key():
    async with daemon(api_key="k1") as (controller, client):
        for path in ("/props", "/slots"):
            assert (await error_of(await client.get(path), 401))["code"] == "invalid_api_key"
            assert (await client.get(path, headers={"Authorization": "Bearer k1"})).status == 200
        assert (await client.post("/sleep")).status == 401
        assert (await client.post("/sleep", headers={"Authorization": "Bearer k1"})).status == 200
        assert (await client.get("/health")).status == 200 and (await client.get("/metrics")).status == 200
    async with daemon(api_key="k1", admin_key="k2") as (controller, client):
        assert (await client.get("/props", headers={"Authorization": "Bearer k2"})).status == 200  # admin sees props
        assert (await client.post("/sleep", headers={"Authorization": "Bearer k1"})).status == 401
        assert (await client.post("/sleep", headers={"Authorization": "Bearer k2"})).status == 200
    async with daemon(admin_key="k2") as (controller, client):
        assert (await client.get("/props")).status == 200  # no api_key: props stay open


async def test_metrics_key_guards_health_and_metrics():
    async with daemon(metrics_key="m1") as (controller, client):
        for path in ("/health", "/metrics"):
            error = await error_of(await client.get(path), 401)
            assert "metrics key" in error["message"]
            assert (await client.get(path, headers={"Authorization": "Bearer m1"})).status == 200
            assert (await client.get(path, headers={"Authorization": "Bearer m2"})).status == 401
        assert (await client.get("/props")).status == 200


@pytest.mark.parametrize("header", [b"Authorization: Bearer \xc3\xa9t\xc3\xa9", b"Authorization: Bearer \xff\xfe\x80",
                                    b"Authorization: \xe2\x82\xac", b"X-Api-Key: \xff"])
async def test_non_ascii_authorization_is_401(header):
    async with daemon(api_key="k1", metrics_key="m1") as (controller, client):
        for path in (b"/v1/models", b"/metrics", b"/sleep"):
            method = b"POST" if path == b"/sleep" else b"GET"
            status, body = await raw_http(client, method + b" " + path + b" HTTP/1.1\nHost: localhost\n" + header + b"\n")
            assert status == 401, body
            assert json.loads(body)["error"]["code"] == "invalid_api_key"


async def test_deeply_nested_json_is_400():
    async with daemon() as (controller, client):
        for body in (b"[" * 100_000, b'{"prompt": ' + b"[" * 100_000, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                     b'{"prompt": "x", "extra": ' + b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000 + b"}"):
            response = await client.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
            assert (await error_of(response, 400))["code"] == "invalid_json"
        assert (await client.post("/v1/completions", json=COMPLETION)).status == 200


# -- B. bounds on what reaches llama.cpp ---------------------------------------


@pytest.mark.parametrize(
    "fields,param,needle",
    [
        ({"top_k": 2**31}, "top_k", "2147483647"),
        ({"top_k": 2**64}, "top_k", "2147483647"),
        ({"top_k": -2}, "top_k", "-1"),
        ({"repeat_last_n": 2**31}, "repeat_last_n", "2147483647"),
        ({"repeat_last_n": -2}, "repeat_last_n", "-1"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
        ({"logit_bias": {"²": 1}}, "logit_bias", "token ids"),  # str.isdigit() says yes
        ({"logit_bias": {"١٢": 1}}, "logit_bias", "token ids"),  # Arabic-Indic digits: int() would take them
        ({"logit_bias": {"1" * 5000: 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"2147483648": 1}}, "logit_bias", "token ids"),
        ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
        ({"stop": "s" * 513}, "stop", "at most 512 characters"),
        ({"stop": ["a", "s" * 513]}, "stop", "at most 512 characters"),
        ({"prompt": list(range(257))}, "prompt", "at most 256 prompt token ids"),
    ],
)
async def test_sampling_fields_are_bounded(fields, param, needle):
    async with daemon(ctx_size=256) as (controller, client):
        response = await client.post("/v1/completions", json={**COMPLETION, **fields})
        error = await error_of(response, 400)
        assert error["param"] == param and needle in error["message"], error


async def test_the_largest_accepted_values_pass():
    async with daemon(ctx_size=256) as (controller, client):
        accepted = {"top_k": 2**31 - 1, "repeat_last_n": -1, "logit_bias": {str(i): -1.5 for i in range(1024)},
                    "stop": ["s" * 512] * 16}
        assert (await client.post("/v1/completions", json={**COMPLETION, **accepted})).status == 200
        assert (await client.post("/v1/completions", json={**COMPLETION, "repeat_last_n": 2**31 - 1})).status == 200
        assert (await client.post("/v1/completions", json={**COMPLETION, "prompt": list(range(256))})).status == 200
        # A list of one string is text, however many commas it holds.
        assert (await client.post("/v1/completions", json={**COMPLETION, "prompt": ["a," * 1000]})).status == 200


async def test_message_and_part_counts_are_bounded():
    async with daemon() as (controller, client):
        message = {"role": "user", "content": "x"}
        response = await client.post("/v1/chat/completions", json={"messages": [message] * 4097})
        error = await error_of(response, 400)
        assert error["param"] == "messages" and "at most 4096 messages, got 4097" in error["message"]
        parts = [{"type": "text", "text": "x"}] * 1025
        response = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
        assert "at most 1024 content parts" in (await error_of(response, 400))["message"]


class _Body:
    """What parse_body reads from a request."""

    def __init__(self, app, raw: bytes) -> None:
        self.app, self.raw = app, raw

    async def read(self) -> bytes:
        return self.raw


def _huge_bodies():
    mib = 1 << 20
    yield "logit_bias 500k entries", "completions", {"prompt": "x", "logit_bias": {str(i): 0 for i in range(500_000)}}, "at most 1024"
    yield "prompt of 8 MB", "completions", {"prompt": "a" * (8 * mib - 64)}, None
    yield "token ids 4M", "completions", {"prompt": [1] * 4_000_000}, "at most 4096 prompt token ids"
    yield "messages 100k", "chat", {"messages": [{"role": "user", "content": "x"}] * 100_000}, "at most 4096 messages"
    yield "content parts 200k", "chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 200_000}]}, "at most 1024 content parts"
    yield "unknown fields 500k", "completions", {"prompt": "x", **{f"k{i}": 0 for i in range(500_000)}}, None
    yield "stop 1M strings", "completions", {"prompt": "x", "stop": [""] * 1_000_000}, "at most 16"


async def test_huge_bodies_are_refused_or_parsed_without_holding_the_loop(capsys):
    """Prints how long parse_body held the event loop for each body (shown with -s);
    asserts only what each body gets."""
    from daemon.http.core.job import parse_body
    from daemon.http.dialects.openai.body import ChatCompletionRequest
    from daemon.http.core.schemas import CompletionRequest

    async with daemon(max_body_bytes=8 * 1024 * 1024) as (controller, client):
        app = client.server.app
        models = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
        timings = []
        for name, kind, body, refusal in _huge_bodies():
            raw = json.dumps(body, separators=(",", ":")).encode()
            assert len(raw) <= 8 * 1024 * 1024, name
            start = time.perf_counter()
            try:
                await parse_body(_Body(app, raw), models[kind])
                outcome = None
            except ApiError as exc:
                assert exc.status == 400
                outcome = exc.message
            timings.append(f"{name} ({len(raw) / 2**20:.1f} MiB): {1000 * (time.perf_counter() - start):.1f} ms")
            if refusal is None:
                assert outcome is None, (name, outcome)
            else:
                assert outcome is not None and refusal in outcome, (name, outcome)
        print("\n[parse_body] " + "; ".join(timings))
        # And through HTTP: the daemon answers the next request as usual.
        raw = json.dumps({"prompt": "x", "logit_bias": {str(i): 0 for i in range(500_000)}})
        response = await client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        assert "at most 1024" in (await error_of(response, 400))["message"]
        await ready(controller)
        assert (await client.post("/v1/completions", json=COMPLETION)).status == 200


# -- C. images -----------------------------------------------------------------


def image_url(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def chat_with(*images: bytes) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, *map(image_url, images)]}],
            "max_tokens": 1}


async def test_images_are_counted_and_sized_before_the_worker_sees_them():
    async with daemon() as (controller, client):
        small = [png(4, 4), jpeg(8, 8), gif(3, 3), bmp(2, 2)] * 2
        response = await client.post("/v1/chat/completions", json=chat_with(*small))
        assert response.status == 200, await response.text()  # 8 images: the default limit
        response = await client.post("/v1/chat/completions", json=chat_with(*small, png(1, 1)))
        error = await error_of(response, 400)
        assert error["param"] == "messages" and error["code"] == "too_many_images"
        assert "9 images" in error["message"] and "at most 8" in error["message"]
        # The declared size counts, not the bytes sent: a 100-byte PNG header saying 5000x5000.
        response = await client.post("/v1/chat/completions", json=chat_with(png(1, 1), png(5000, 5000, pixels=False)))
        error = await error_of(response, 400)
        assert error["code"] == "image_too_large" and error["param"] == "messages"
        assert "image 2 is 5000x5000" in error["message"] and "16777216" in error["message"]
        response = await client.post("/v1/chat/completions", json=chat_with(jpeg(65535, 65535)))
        assert (await error_of(response, 400))["code"] == "image_too_large"
        for data, needle in ((b"RIFF\0\0\0\0WEBPVP8 " + bytes(32), "PNG, JPEG, GIF, BMP"),
                             (png(4, 4)[:20], "truncated"), (png(0, 4), "empty image"), (b"", "not a supported")):
            response = await client.post("/v1/chat/completions", json=chat_with(data))
            error = await error_of(response, 400)
            assert error["code"] == "invalid_image" and needle in error["message"] and "image 1" in error["message"]


async def test_image_limits_follow_the_settings():
    async with daemon(max_image_pixels=100, max_images_per_request=2) as (controller, client):
        assert (await client.post("/v1/chat/completions", json=chat_with(png(10, 10), bmp(10, 10)))).status == 200
        response = await client.post("/v1/chat/completions", json=chat_with(png(10, 10), bmp(11, 10)))
        assert "image 2 is 11x10 = 110 pixels; at most 100" in (await error_of(response, 400))["message"]
        response = await client.post("/v1/chat/completions", json=chat_with(*[png(1, 1)] * 3))
        assert "at most 2" in (await error_of(response, 400))["message"]
    async with daemon(max_images_per_request=0) as (controller, client):
        response = await client.post("/v1/chat/completions", json=chat_with(png(1, 1)))
        assert (await error_of(response, 400))["code"] == "too_many_images"


def media_prompt(*images: bytes | str, text: str | None = None) -> dict:
    data = [i if isinstance(i, str) else base64.b64encode(i).decode() for i in images]
    text = "what is <__media__> here? " * len(images) if text is None else text
    return {"prompt": {"prompt_string": text, "multimodal_data": data}, "n_predict": 1}


async def test_completions_multimodal_data_is_checked_before_the_worker_sees_it(tmp_path):
    # llama-server's /completion object prompt with images: each image is counted, decoded from base64 and
    # its header read here, by its number, as a chat message's images are; the worker sees only good ones.
    projector = tmp_path / "mmproj.gguf"
    projector.write_bytes(b"GGUF")  # a path the settings accept; the fake worker reads no file
    async with daemon(mmproj=str(projector), max_images_per_request=3) as (controller, client):
        response = await client.post("/completion", json=media_prompt(png(4, 4), jpeg(8, 8)))
        assert response.status == 200, await response.text()
        data_url = "data:image/png;base64," + base64.b64encode(png(2, 2)).decode()
        assert (await client.post("/completion", json=media_prompt(data_url))).status == 200
        for body, code, needle in (
            (media_prompt(*[png(1, 1)] * 4), "too_many_images", "4 images in one request; at most 3"),
            (media_prompt("data:image/png,abc"), "invalid_image", "data: URL without base64 content"),
            (media_prompt("data:"), "invalid_image", "data: URL without base64 content"),
            (media_prompt(png(1, 1), text="no marker"), "invalid_request", "0 <__media__> markers and 1 images"),
            (media_prompt(png(1, 1), text="two <__media__><__media__> x"), "invalid_request", "2 <__media__> markers"),
            (media_prompt(png(1, 1), text="ends with <__media__>"), "invalid_request", "ends with an image"),
            (media_prompt(png(1, 1), png(5000, 5000, pixels=False)), "image_too_large", "image 2 is 5000x5000"),
            (media_prompt("not base64!"), "invalid_image", "multimodal_data[0] is not valid base64"),
            (media_prompt(b"GIF"), "invalid_image", "image 1 cannot be decoded"),
            (media_prompt(b""), "invalid_image", "not a supported image format"),
        ):
            error = await error_of(await client.post("/completion", json=body), 400)
            assert error["code"] == code and needle in error["message"] and error["param"] == "prompt", error
        # Several prompts: every prompt's images are checked before the first is answered.
        async def generated() -> float:
            return value(await (await client.get("/metrics")).text(), "dormouse_generated_tokens_total")

        before = await generated()
        body = {"prompt": ["a text first", media_prompt(png(1, 1))["prompt"], media_prompt(b"xx")["prompt"]],
                "n_predict": 1}
        error = await error_of(await client.post("/completion", json=body), 400)
        assert error["message"].startswith("prompt[2]: image 1 cannot be decoded"), error
        assert await generated() == before  # prompt[0] was not answered first
        body["prompt"][2] = media_prompt(gif(3, 3), text="no marker")["prompt"]
        error = await error_of(await client.post("/completion", json=body), 400)
        assert error["message"].startswith("prompt[2]: the prompt has 0 <__media__> markers"), error
        body["prompt"][2] = media_prompt(gif(3, 3))["prompt"]
        answers = await (await client.post("/completion", json=body)).json()
        assert [a["index"] for a in answers] == [0, 1, 2]
        assert await generated() == before + 3
        # max_images_per_request counts the request's prompts together (3 here): 2 + 2 is one too many.
        two = media_prompt(png(1, 1), png(1, 1))["prompt"]
        error = await error_of(await client.post("/completion", json={"prompt": [two, two], "n_predict": 1}), 400)
        assert error["code"] == "too_many_images" and "4 images in one request" in error["message"]
        assert await generated() == before + 3
        # Refused before the model wakes: a sleeping model stays asleep.
        assert (await client.post("/sleep")).status == 200
        error = await error_of(await client.post("/completion", json=media_prompt(png(1, 1), text="x")), 400)
        assert "markers" in error["message"]
        assert (await (await client.get("/health")).json())["state"] == "sleeping"
        # Hostile shapes: refused by the schema, by field, before any decode.
        for multimodal_data, needle in ((["AAAA"] * 65, "at most 64"), ([], "non-empty list"), ("iVBOR", "list"),
                                        ([3], "base64 string"), (None, "list"), ({"a": "b"}, "list")):
            body = {"prompt": {"prompt_string": "x <__media__>", "multimodal_data": multimodal_data}}
            error = await error_of(await client.post("/completion", json=body), 400)
            assert needle in error["message"], (multimodal_data, error)
        error = await error_of(await client.post("/completion", json={"prompt": {"prompt_string": 7,
                                                                                  "multimodal_data": ["AAAA"]}}), 400)
        assert "prompt_string" in error["message"]


async def test_completions_multimodal_data_without_a_projector_names_the_option():
    async with daemon() as (controller, client):
        error = await error_of(await client.post("/completion", json=media_prompt(png(1, 1))), 400)
        assert "no multimodal projector" in error["message"] and "--mmproj" in error["message"]
        assert error["param"] == "prompt"


# -- D. honest answers -----------------------------------------------------------


async def test_wake_past_wake_timeout_is_503_with_retry_after(monkeypatch):
    async with daemon(wake_timeout=0.3) as (controller, client):
        assert (await client.post("/sleep")).status == 200
        monkeypatch.setenv("FAKE_LOAD_SECONDS", "1.5")
        response = await client.post("/wake")
        error = await error_of(response, 503)
        assert error["code"] == "wake_timeout" and "wake_timeout" in error["message"]
        assert int(response.headers["Retry-After"]) >= 1
        await ready(controller)  # the wake went on
        assert (await client.post("/wake")).status == 200


class _CapturedLogs:
    def __enter__(self):
        self.stream = io.StringIO()
        configure_logging("json", "info", stream=self.stream)
        return self

    def __exit__(self, *exc):
        configure_logging("json", "warning")

    def requests(self) -> list[dict]:
        events = [json.loads(line[line.index("{"):]) for line in self.stream.getvalue().splitlines() if "{" in line]
        return [e for e in events if e["event"] == "request"]


async def test_every_answered_request_gets_one_log_line_with_its_code():
    async with daemon(api_key="k", max_body_bytes=2048) as (controller, client):
        key = {"Authorization": "Bearer k"}
        with _CapturedLogs() as logs:
            await client.post("/v1/completions", json=COMPLETION)  # 401
            await client.post("/v1/completions", data="{}", headers={**key, "Content-Type": "text/plain"})  # 415
            await client.post("/v1/completions", json={"prompt": 5}, headers=key)  # 400
            await client.post("/v1/completions", json={"prompt": "x" * 5000}, headers=key)  # 413
            await client.post("/v1/chat/completions", json=COMPLETION, headers={**key, "Origin": "http://evil.example"})  # 403
            await client.get("/nope")  # 404
            await client.get("/health")  # an answer to a probe: at debug level
            await client.get("/metrics")  # a scrape: at debug level too
            await client.post("/v1/completions", json=COMPLETION, headers=key)  # 200, logged by the job
        seen = [(e["endpoint"], e["status"], e.get("code")) for e in logs.requests()]
        assert seen == [("completions", 401, "invalid_api_key"),
                        ("completions", 415, "unsupported_media_type"),
                        ("completions", 400, "invalid_value"),
                        ("completions", 413, "request_too_large"),
                        ("chat.completions", 403, "cross_origin"),
                        ("/nope", 404, None),
                        ("completions", 200, None)], seen
        metrics = await (await client.get("/metrics")).text()
        counted = {(s.labels["endpoint"], s.labels["status"]): s.value
                   for family in text_string_to_metric_families(metrics) for s in family.samples
                   if s.name == "dormouse_requests_total"}
        assert counted[("completions", "415")] == 1 and counted[("chat.completions", "403")] == 1
        assert "/nope" not in metrics  # a client's path never becomes a label


async def test_streamed_chunks_carry_usage_null_until_the_usage_chunk():
    async with daemon() as (controller, client):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        for path, body in (("/v1/completions", {**COMPLETION, "max_tokens": 3, "stream": True}), ("/v1/chat/completions", chat)):
            for include in (True, False):
                response = await client.post(path, json={**body, "stream_options": {"include_usage": include}})
                events = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                if include:
                    *streamed, last = chunks
                    assert all("usage" in c and c["usage"] is None for c in streamed), streamed
                    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
                    assert last["timings"]["predicted_n"] == 3  # llama-server's timings on the stream's last chunk
                else:
                    assert all("usage" not in c for c in chunks)


# -- E. the OpenAPI document -------------------------------------------------------


async def test_openapi_lists_403_and_415():
    async with daemon() as (controller, client):
        paths = (await (await client.get("/openapi.json")).json())["paths"]
        for path in ("/v1/completions", "/v1/chat/completions", "/sleep", "/wake"):
            assert {"401", "403", "415"} <= set(paths[path]["post"]["responses"]), path
        for path in ("/health", "/metrics", "/props", "/slots", "/v1/models"):
            assert {"401", "403"} <= set(paths[path]["get"]["responses"]), path
