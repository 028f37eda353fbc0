"""Ollama's API (/api/*) through the real app, controller and protocol on a
fake worker: shapes, the options mapping, keep_alive moving the real idle
timer, load and unload, listing without waking, and hostile input answered in
Ollama's error shape ({"error": "..."}) with the field named."""

from __future__ import annotations

import base64
import json
import time
from datetime import datetime

import pytest

from daemon.http.dialects.ollama.request import parse_keep_alive
from daemon.http.dialects.ollama.models import human_number
from daemon.http.dialects.ollama.answer import ChatLines
from daemon.tools.parse import ParsedCall
from statemachine import ServerState
from tests.conftest import fake_daemon, fake_fleet
from tests.unit.test_images import png

pytestmark = pytest.mark.timeout(120)

ASK = [{"role": "user", "content": "hi"}]
CHAT = {"model": "fake", "messages": ASK, "stream": False, "options": {"num_predict": 3}}
GENERATE = {"model": "fake", "prompt": "hi", "stream": False, "options": {"num_predict": 3}}


async def ready(controller, timeout: float = 20) -> None:
    assert await controller.wait_for(lambda s: s is ServerState.READY, timeout)


async def asleep(client, controller) -> None:
    assert (await client.post("/sleep")).status == 200
    assert controller.state is ServerState.SLEEPING


async def ollama_error(response, status: int) -> str:
    """The message of an error in Ollama's shape: one string, nothing else."""
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]


async def lines_of(response) -> list[dict]:
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"] == "application/x-ndjson"
    text = await response.text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def seconds_until(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - time.time()


# -- shapes ---------------------------------------------------------------------------------


async def test_chat_whole_and_streamed_in_ollamas_shapes():
    async with fake_daemon() as (controller, client):
        await ready(controller)
        body = await (await client.post("/api/chat", json=CHAT)).json()
        assert body["message"] == {"role": "assistant", "content": "t0 t1 t2 "}
        assert body["done"] is True and body["done_reason"] == "length" and body["model"] == "fake"
        assert body["eval_count"] == 3 and body["prompt_eval_count"] == 3
        for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
            assert isinstance(body[key], int) and body[key] >= 0, key
        assert body["total_duration"] > 1_000_000  # nanoseconds: three fake steps of 10 ms are more than 1 ms
        datetime.fromisoformat(body["created_at"].replace("Z", "+00:00"))

        streamed = await client.post("/api/chat", json={**CHAT, "stream": None})  # Ollama streams by default
        lines = await lines_of(streamed)
        assert [line["done"] for line in lines] == [False, False, False, True]
        assert "".join(line["message"]["content"] for line in lines) == "t0 t1 t2 "
        assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 3
        assert "done_reason" not in lines[0]


async def test_generate_templated_and_raw_and_the_name_the_client_used():
    async with fake_daemon() as (controller, client):
        await ready(controller)
        body = await (await client.post("/api/generate", json={**GENERATE, "model": "llama3:latest",
                                                               "system": "be brief"})).json()
        assert body["response"] == "t0 t1 t2 " and body["model"] == "llama3:latest"  # a fleet of one serves any name
        lines = await lines_of(await client.post("/api/generate", json={**GENERATE, "raw": True, "stream": True}))
        assert "".join(line["response"] for line in lines) == "t0 t1 t2 " and lines[-1]["done"] is True


async def test_num_predict_maps_onto_max_tokens_and_minus_one_runs_to_the_end_of_the_slot():
    async with fake_daemon(ctx_size=64, parallel=4) as (controller, client):
        await ready(controller)
        body = await (await client.post("/api/chat", json={**CHAT, "options": {"num_predict": 5}})).json()
        assert body["eval_count"] == 5
        for unlimited in (-1, -2, None):
            body = await (await client.post("/api/chat", json={**CHAT, "options": {"num_predict": unlimited}})).json()
            assert body["eval_count"] == 16 and body["done_reason"] == "length", unlimited  # 64 / 4: the slot


async def test_accepted_options_and_off_values_pass():
    async with fake_daemon() as (controller, client):
        await ready(controller)
        options = {"num_predict": 2, "temperature": 0, "top_k": 1, "top_p": 0.5, "min_p": 0.1, "seed": -1,
                   "stop": ["x"], "repeat_penalty": 1.1, "repeat_last_n": -1, "presence_penalty": 0.5,
                   "frequency_penalty": 0.5, "mirostat": 0, "typical_p": 1.0, "tfs_z": 1, "num_ctx": 1024,
                   "num_gpu": None}
        response = await client.post("/api/chat", json={**CHAT, "options": options})
        assert response.status == 200, await response.text()
        assert (await client.post("/api/generate", json={**GENERATE, "format": "json"})).status == 200
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        assert (await client.post("/api/chat", json={**CHAT, "format": schema})).status == 200
        assert (await client.post("/api/chat", json={**CHAT, "format": "", "think": False})).status == 200


async def test_tools_are_offered_and_an_answer_without_a_call_is_content():
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    async with fake_daemon() as (controller, client):
        await ready(controller)
        body = await (await client.post("/api/chat", json={**CHAT, "messages": history, "tools": [tool]})).json()
        assert body["message"]["content"] == "t0 t1 t2 " and "tool_calls" not in body["message"]
        lines = await lines_of(await client.post("/api/chat", json={**CHAT, "stream": True, "tools": [tool]}))
        assert "".join(line["message"]["content"] for line in lines) == "t0 t1 t2 "


def test_tool_calls_carry_their_arguments_as_an_object():
    lines = ChatLines("m", controller=None)
    message = lines.text("", [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("now", "{}")])["message"]
    assert [c["function"] for c in message["tool_calls"]] == [
        {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
        {"index": 1, "name": "now", "arguments": {}}]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])


async def test_logprobs_are_given_when_asked():
    async with fake_daemon() as (controller, client):
        await ready(controller)
        body = await (await client.post("/api/chat", json={**CHAT, "logprobs": True, "top_logprobs": 2})).json()
        assert body["logprobs"] == []  # the fake worker sends none; the key is there because they were asked
        assert "logprobs" not in await (await client.post("/api/chat", json=CHAT)).json()


async def test_images_go_through_the_image_checks():
    image = base64.b64encode(png(2, 2)).decode()
    async with fake_daemon(max_images_per_request=2, max_image_pixels=10_000) as (controller, client):
        await ready(controller)
        with_images = {**CHAT, "messages": [{"role": "user", "content": "what?", "images": [image]}]}
        assert (await client.post("/api/chat", json=with_images)).status == 200
        assert (await client.post("/api/generate", json={**GENERATE, "images": [image]})).status == 200
        many = {**CHAT, "messages": [{"role": "user", "content": "x", "images": [image] * 3}]}
        assert "3 images in one request" in await ollama_error(await client.post("/api/chat", json=many), 400)
        big = base64.b64encode(png(5000, 5000, pixels=False)).decode()
        message = await ollama_error(await client.post("/api/generate", json={**GENERATE, "images": [big]}), 400)
        assert message.startswith("images:") and "max_image_pixels" in message
        not_image = base64.b64encode(b"GIF? no, text").decode()
        message = await ollama_error(await client.post("/api/generate", json={**GENERATE, "images": [not_image]}), 400)
        assert "cannot be decoded" in message
        raw = await client.post("/api/generate", json={**GENERATE, "raw": True, "images": [image]})
        assert "images: raw: true" in await ollama_error(raw, 400)


async def test_an_error_after_the_stream_began_is_an_error_line(monkeypatch):
    monkeypatch.setenv("FAKE_CRASH_AFTER_TOKENS", "2")
    async with fake_daemon() as (controller, client):
        await ready(controller)
        response = await client.post("/api/chat", json={**CHAT, "stream": True, "options": {"num_predict": 50}})
        lines = await lines_of(response)
        assert lines[0]["done"] is False and set(lines[-1]) == {"error"} and "worker" in lines[-1]["error"]


async def test_a_worker_refusal_before_any_token_is_a_status_in_ollamas_shape():
    async with fake_daemon() as (controller, client):
        await ready(controller)
        response = await client.post("/api/generate", json={**GENERATE, "raw": True, "prompt": "FAIL"})
        assert "prompt too long" in await ollama_error(response, 400)


# -- keep_alive and the real sleep ----------------------------------------------------


@pytest.mark.parametrize("given, seconds", [
    (0, 0.0), ("0", 0.0), ("0s", 0.0), (300, 300.0), (2.5, 2.5), ("5m", 300.0), ("1h30m", 5400.0), ("1.5h", 5400.0),
    ("300ms", 0.3), ("-1", -1.0), (-5, -1.0), ("-1m", -1.0), ("90", 90.0), (None, None)])
def test_keep_alive_forms(given, seconds):
    assert parse_keep_alive(given) == seconds


async def test_keep_alive_zero_puts_the_model_to_sleep_after_its_answer():
    async with fake_daemon(sleep_idle_seconds=600) as (controller, client):
        await ready(controller)
        assert (await client.post("/api/chat", json={**CHAT, "keep_alive": 0})).status == 200
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10)
        assert controller.last_sleep["reason"] == "idle"
        # The next request without keep_alive wakes it and the model's own idle time applies again.
        assert (await client.post("/api/generate", json=GENERATE)).status == 200
        props = await (await client.get("/props")).json()
        assert props["keep_alive"] is None and props["idle_seconds"] == 600


async def test_keep_alive_moves_the_idle_deadline_and_ps_agrees_with_props():
    async with fake_daemon(sleep_idle_seconds=60) as (controller, client):
        await ready(controller)
        for keep_alive, idle in (("1h", 3600), (5, 60), (None, 60)):  # at least the model's own 60 s
            assert (await client.post("/api/chat", json={**CHAT, "keep_alive": keep_alive})).status == 200
            props = await (await client.get("/props")).json()
            assert props["idle_seconds"] == idle, keep_alive
            [shown] = (await (await client.get("/api/ps")).json())["models"]
            remaining = props["idle_timer_remaining"]
            assert 0 < remaining <= idle
            assert abs(seconds_until(shown["expires_at"]) - remaining) < 5  # the same timer, read twice
        assert (await client.post("/api/embed", json={"model": "fake", "input": []})).status == 400  # not an embedder
        assert (await client.post("/api/generate", json={"model": "fake", "keep_alive": -1})).status == 200
        props = await (await client.get("/props")).json()
        assert props["idle_seconds"] == -1 and props["idle_timer_remaining"] is None
        [shown] = (await (await client.get("/api/ps")).json())["models"]
        assert datetime.fromisoformat(shown["expires_at"].replace("Z", "+00:00")).year > 2300  # Ollama's "for ever"


async def test_load_and_unload_as_ollama_does():
    async with fake_daemon() as (controller, client):
        await ready(controller)
        await asleep(client, controller)
        body = await (await client.post("/api/generate", json={"model": "fake"})).json()
        assert body["done"] is True and body["done_reason"] == "load" and body["response"] == ""
        assert controller.state is ServerState.READY
        body = await (await client.post("/api/chat", json={"model": "fake", "messages": [], "keep_alive": 0})).json()
        assert body["done_reason"] == "unload" and body["message"] == {"role": "assistant", "content": ""}
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10)
        last_wake = controller.last_wake  # unloading a sleeping model does not wake it
        body = await (await client.post("/api/generate", json={"model": "fake", "keep_alive": "0s"})).json()
        assert body["done_reason"] == "unload" and controller.state is ServerState.SLEEPING
        assert controller.last_wake is last_wake


# -- tags, ps, show, version, and what is not here ----------------------------------------


async def test_listing_and_showing_never_wake_a_sleeping_model(tmp_path):
    from tests.fixtures.tiny_model import write_tiny_model

    tiny = write_tiny_model(tmp_path / "tiny.gguf")
    async with fake_fleet({"tiny": {}, "embedder": {"embeddings": True}}) as (fleet, client):
        tiny_model = fleet.models["tiny"]
        tiny_model.controller.model_path = str(tiny)
        await ready(tiny_model.controller)
        await asleep(client, tiny_model.controller)
        tags = (await (await client.get("/api/tags")).json())["models"]
        assert [m["name"] for m in tags] == ["tiny", "embedder"]
        shown = tags[0]
        assert shown["size"] == tiny.stat().st_size and len(shown["digest"]) == 64
        assert shown["details"]["format"] == "gguf" and shown["details"]["family"] == "llama"
        assert shown["details"]["quantization_level"] == "F32" and shown["details"]["parameter_size"].endswith("K")
        assert (await (await client.get("/api/ps")).json())["models"] == []
        show = await (await client.post("/api/show", json={"model": "tiny:latest"})).json()
        assert show["model_info"]["general.architecture"] == "llama"
        assert show["model_info"]["llama.context_length"] == 2048 and show["model_info"]["general.parameter_count"] > 0
        assert show["model_info"]["tokenizer.ggml.tokens"] is None  # the vocabulary is walked past, never read
        assert show["capabilities"] == ["completion", "tools"] and "num_ctx" in show["parameters"]
        legacy = await (await client.post("/api/show", json={"name": "embedder"})).json()
        assert legacy["capabilities"] == ["embedding"] and legacy["details"]["family"] == ""  # no such file: no facts
        assert tiny_model.controller.state is ServerState.SLEEPING
        assert (await client.post("/api/chat", json={**CHAT, "model": "tiny"})).status == 200
        ps = (await (await client.get("/api/ps")).json())["models"]
        assert [m["name"] for m in ps] == ["tiny"] and ps[0]["context_length"] == 1024 and ps[0]["size_vram"] == 0
        missing = await client.post("/api/show", json={"model": "nope"})
        assert "'nope' does not exist" in await ollama_error(missing, 404)
        assert "does not exist" in await ollama_error(await client.post("/api/chat", json={**CHAT, "model": "x"}), 404)


async def test_show_gives_the_template_the_model_is_served_with(tmp_path):
    """The configured template (chat_template_file, then chat_template) over the GGUF's, as the worker picks."""
    from tests.fixtures.tiny_model import CHAT_TEMPLATE, write_tiny_model

    tiny = write_tiny_model(tmp_path / "tiny.gguf")
    own = tmp_path / "own.jinja"
    own.write_text("{{ messages[0].content }}")
    async with fake_fleet({"gguf": {}, "named": {"chat_template": "chatml"},
                           "file": {"chat_template_file": str(own), "chat_template": "llama3"}}) as (fleet, client):
        for model in fleet.models.values():
            model.controller.model_path = str(tiny)
        shown = {name: (await (await client.post("/api/show", json={"model": name})).json())["template"]
                 for name in fleet.models}
    assert shown == {"gguf": CHAT_TEMPLATE, "named": "chatml", "file": "{{ messages[0].content }}"}


async def test_version_and_the_management_endpoints_that_are_not_here():
    async with fake_daemon() as (controller, client):
        version = await (await client.get("/api/version")).json()
        assert version["version"].count(".") == 2 and "dormouse" in version
        for method, path in (("POST", "/api/push"), ("POST", "/api/create"),
                             ("POST", "/api/copy"), ("DELETE", "/api/delete"), ("POST", "/api/blobs/sha256:abc")):
            response = await client.request(method, path, json={"model": "x"})
            assert "configuration" in await ollama_error(response, 501), path


async def test_the_api_key_guards_every_ollama_route():
    async with fake_daemon(api_key="k") as (controller, client):
        for method, path in (("GET", "/api/tags"), ("GET", "/api/ps"), ("POST", "/api/chat"), ("POST", "/api/show")):
            response = await client.request(method, path, json={"model": "fake"})
            assert "API key" in await ollama_error(response, 401), path
        response = await client.get("/api/tags", headers={"Authorization": "Bearer k"})
        assert response.status == 200


def test_parameter_sizes_read_as_ollamas():
    assert [human_number(n) for n in (268_098_176, 7_615_616_512, 8_000_000_000, 1_500, 12)] == [
        "268.10M", "7.6B", "8B", "2K", "12"]


# -- embeddings -----------------------------------------------------------------------


async def test_embed_and_the_older_embeddings():
    async with fake_daemon(embeddings=True) as (controller, client):
        await ready(controller)
        body = await (await client.post("/api/embed", json={"model": "fake", "input": ["a", "b c"]})).json()
        assert body["embeddings"] == [[1.0], [1.0]] and body["model"] == "fake" and body["prompt_eval_count"] == 2
        assert isinstance(body["total_duration"], int)
        one = await (await client.post("/api/embed", json={"model": "fake", "input": "a", "dimensions": 1})).json()
        assert one["embeddings"] == [[1.0]]
        loaded = await (await client.post("/api/embed", json={"model": "fake", "input": []})).json()
        assert loaded["embeddings"] == []
        assert (await (await client.post("/api/embeddings", json={"model": "fake", "prompt": "a"})).json()) == {
            "embedding": [1.0]}
        assert (await (await client.post("/api/embeddings", json={"model": "fake", "prompt": ""})).json()) == {
            "embedding": []}
        response = await client.post("/api/embed", json={"model": "fake", "input": "a", "dimensions": 2})
        assert "dimensions: at most 1" in await ollama_error(response, 400)
        response = await client.post("/api/chat", json=CHAT)
        assert "embeddings only" in await ollama_error(response, 400)
        body = await (await client.post("/api/embed", json={"model": "fake", "input": "a", "keep_alive": 0})).json()
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10)


# -- hostile input -------------------------------------------------------------------------


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


def deep_list(depth: int) -> str:
    """JSON text of lists nested `depth` deep (too deep for json.dumps to write)."""
    return "[" * depth + "]" * depth


HOSTILE = [
    # huge
    ("/api/chat", {"options": {"num_predict": 10**12}}, "options.num_predict"),
    ("/api/chat", {"options": {"top_k": 2**64}}, "options.top_k"),
    ("/api/chat", {"options": {"stop": ["s"] * 17}}, "options.stop"),
    ("/api/chat", {"options": {"num_ctx": 10**6}}, "options.num_ctx"),
    ("/api/chat", {"options": {f"o{i}": 1 for i in range(65)}}, "options"),
    ("/api/chat", {"keep_alive": 10**12}, "keep_alive"),
    ("/api/chat", {"keep_alive": "9999999h"}, "keep_alive"),
    ("/api/chat", {"keep_alive": "1" * 65 + "s"}, "keep_alive"),
    ("/api/chat", {"messages": ASK * 4097}, "messages"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["AAAA"] * 1024}]}, "messages.0.images"),
    ("/api/chat", {"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools"),
    ("/api/chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}] * 129}]},
     "messages.0.tool_calls"),
    ("/api/generate", {"options": {"num_predict": 10**7}}, "options.num_predict"),
    ("/api/embed", {"input": ["x"] * 257}, "input"),
    ("/api/embed", {"input": "x", "dimensions": 10**9}, "dimensions"),
    # negative
    ("/api/chat", {"options": {"num_predict": -3}}, "options.num_predict"),
    ("/api/chat", {"options": {"num_predict": 0}}, "options.num_predict"),
    ("/api/chat", {"options": {"temperature": -1}}, "options.temperature"),
    ("/api/chat", {"options": {"top_k": -2}}, "options.top_k"),
    ("/api/chat", {"options": {"seed": -2}}, "options.seed"),
    ("/api/chat", {"options": {"repeat_last_n": -2}}, "options.repeat_last_n"),
    ("/api/chat", {"options": {"num_ctx": -1}}, "options.num_ctx"),
    ("/api/generate", {"options": {"top_p": -0.5}}, "options.top_p"),
    ("/api/embed", {"input": "x", "dimensions": -1}, "dimensions"),
    ("/api/chat", {"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
    # wrong type
    ("/api/chat", {"messages": "hi"}, "messages"),
    ("/api/chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/api/chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": [5]}]}, "messages.0.images.0"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["data:image/png;base64,AAAA"]}]},
     "messages.0.images"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["not base64!"]}]}, "messages.0.images"),
    ("/api/chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ("/api/chat", {"options": []}, "options"),
    ("/api/chat", {"options": {"temperature": "hot"}}, "options.temperature"),
    ("/api/chat", {"options": {"num_predict": True}}, "options.num_predict"),
    ("/api/chat", {"options": {"stop": 5}}, "options.stop"),
    ("/api/chat", {"keep_alive": True}, "keep_alive"),
    ("/api/chat", {"keep_alive": [1]}, "keep_alive"),
    ("/api/chat", {"keep_alive": "soon"}, "keep_alive"),
    ("/api/chat", {"format": "yaml"}, "format"),
    ("/api/chat", {"format": 5}, "format"),
    ("/api/chat", {"stream": "yes"}, "stream"),
    ("/api/chat", {"think": True}, "think"),
    ("/api/chat", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ("/api/chat", {"tools": "all"}, "tools"),
    ("/api/chat", {"model": 5}, "model"),
    ("/api/generate", {"prompt": ["a"]}, "prompt"),
    ("/api/generate", {"raw": "yes"}, "raw"),
    ("/api/generate", {"system": "s", "raw": True}, "system"),
    ("/api/generate", {"suffix": "end"}, "suffix"),
    ("/api/generate", {"template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"context": [1, 2, 3]}, "context"),
    ("/api/embed", {"input": 5}, "input"),
    ("/api/embed", {"input": ["a", ""]}, "input"),
    ("/api/embed", {"input": "a", "truncate": "yes"}, "truncate"),
    ("/api/embed", {"input": "a", "truncate": 1}, "truncate"),
    ("/api/embed", {"input": "a", "options": {"temperature": 0.1}}, "options.temperature"),
    ("/api/embed", {"input": "a", "options": {"num_predict": 3}}, "options.num_predict"),
    ("/api/embeddings", {"prompt": 5}, "prompt"),
    ("/api/embeddings", {"prompt": "a", "keep_alive": "forever"}, "keep_alive"),
    ("/api/show", {"model": ["x"]}, "model"),
    ("/api/show", {}, "model"),
    ("/api/show", {"model": "fake", "verbose": True}, "verbose"),
    # refused by name: would be ignored otherwise
    ("/api/chat", {"options": {"num_gpu": 99}}, "options.num_gpu"),
    ("/api/chat", {"options": {"num_thread": 4}}, "options.num_thread"),
    ("/api/chat", {"options": {"mirostat": 2}}, "options.mirostat"),
    ("/api/chat", {"options": {"typical_p": 0.5}}, "options.typical_p"),
    ("/api/chat", {"options": {"num_keep": 5}}, "options.num_keep"),
    ("/api/chat", {"options": {"made_up": 1}}, "options.made_up"),
    # deep nesting
    ("/api/chat", {"format": nested(200)}, "format"),
    ("/api/chat", '"options": {"stop": ' + deep_list(5000) + "}", ""),
    ("/api/chat", '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": ' + deep_list(5000)
     + "}}}]", ""),
    ("/api/chat", '"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": '
     + deep_list(5000) + "}}}]}]", ""),
    ("/api/embed", '"input": ' + deep_list(100_000), ""),
]


def _hostile_id(case) -> str:
    path, fields, _ = case
    return f"{path}-{(fields if isinstance(fields, str) else json.dumps(fields))[:60]}"


@pytest.mark.parametrize("path, fields, named", HOSTILE, ids=[_hostile_id(c) for c in HOSTILE])
async def test_hostile_input_is_a_400_in_ollamas_shape_naming_the_field(path, fields, named):
    base = {"/api/chat": CHAT, "/api/generate": GENERATE, "/api/embed": {"model": "fake", "input": "x"},
            "/api/embeddings": {"model": "fake", "prompt": "x"}, "/api/show": {}}[path]
    embeddings = path in ("/api/embed", "/api/embeddings")
    async with fake_daemon(embeddings=embeddings, ctx_size=4096, parallel=4, max_body_bytes=32 << 20) as (c, client):
        await ready(c)
        await asleep(client, c)  # beside a sleep: a refusal wakes nothing
        if isinstance(fields, str):  # raw JSON text: nested deeper than json.dumps writes
            raw = json.dumps(base)[:-1] + (", " if base else "") + fields + "}"
            response = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        else:
            response = await client.post(path, json={**base, **fields})
        message = await ollama_error(response, 400)
        assert message.startswith(named) if named else message, (named, message)
        assert c.state is ServerState.SLEEPING


async def test_bodies_that_are_not_json_objects_or_not_declared_json():
    async with fake_daemon() as (controller, client):
        for path in ("/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show"):
            for raw in (b"[1, 2]", b"{", b'"x"', b"[" * 100_000):
                response = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
                assert "request body" in await ollama_error(response, 400), (path, raw[:5])
            response = await client.post(path, data=b"{}", headers={"Content-Type": "text/plain"})
            assert "application/json" in await ollama_error(response, 415), path
        huge = b'{"model": "fake", "prompt": "' + b"a" * (9 << 20) + b'"}'
        response = await client.post("/api/generate", data=huge, headers={"Content-Type": "application/json"})
        assert "max_body_bytes" in await ollama_error(response, 413)
        assert (await client.post("/api/generate", json=GENERATE)).status == 200  # and it still serves
