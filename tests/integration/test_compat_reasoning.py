"""llama-server's chat template and reasoning surface (issue 17, item 7),
with llama-server-shaped requests through the real HTTP app:

- reasoning: `reasoning_format` (none, auto, deepseek, deepseek-legacy), the
  thinking in `message.reasoning_content` and streamed as
  `delta.reasoning_content`, a block the prompt opened (reasoning_open),
  tool calls read after the thinking; `chat_template_kwargs` and an
  assistant's `reasoning_content` reach the worker;
- templates: assistant prefill (`continue_final_message`, by default for a
  final assistant message), `add_generation_prompt` on /apply-template and
  chat, hostile values refused naming the field;
- a real worker (the tiny GGUF) refusing a template that does not compile at
  load with code "chat_template", and rendering one that uses break,
  continue and {% generation %}, with prefill and kwargs.

The worker's side is scripted token by token where the HTTP layer is what
matters (as tests/integration/test_trust_tools_answers.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import pytest

from daemon import protocol as p
from daemon.model.jobs import Job
from tests.integration.scripted import scripted  # noqa: F401 (a fixture)
from tests.integration.test_http_hardening import daemon, error_of

ASK = [{"role": "user", "content": "2+2?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture
def queries(monkeypatch):
    """Records the p.Query of each new_query, then lets the fake worker answer it."""
    made: list[p.Query] = []

    def install(controller):
        original = controller.new_query

        def new_query(endpoint, kind, **fields):
            job = original(endpoint, kind, **fields)
            made.append(job.submit)
            return job

        monkeypatch.setattr(controller, "new_query", new_query)
        return made

    return install


def answer(job: Job, pieces: list[str], reason: str = "stop", reasoning_open: bool = False) -> None:
    for i, piece in enumerate(pieces):
        job.put(p.Tokens(job.id, piece, i + 1, n_prompt_tokens=3 if i == 0 else 0,
                         reasoning_open=reasoning_open and i == 0))
    job.put(p.Done(job.id, reason, prompt_tokens=3, completion_tokens=len(pieces)))


async def new_job(jobs: list[Job], before: int) -> Job:
    while len(jobs) <= before:
        await asyncio.sleep(0.005)
    return jobs[-1]


async def chat(client, jobs, body: dict, pieces: list[str], reason: str = "stop", reasoning_open: bool = False):
    before = len(jobs)
    request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    answer(await asyncio.wait_for(new_job(jobs, before), 30), pieces, reason, reasoning_open)
    return await request


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def deltas(text: str) -> tuple[str, str, list[dict]]:
    """(reasoning, content, the deltas) of a chat stream."""
    out = [choice["delta"] for event in events(text) for choice in event["choices"]]
    return ("".join(d.get("reasoning_content") or "" for d in out), "".join(d.get("content") or "" for d in out), out)


THINKING = ["<th", "ink>\nThe user", " asks 2+2.", "\n</th", "ink>\n\n", "It is ", "4."]


# -- reasoning_content ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [None, "auto", "deepseek"])
async def test_thinking_goes_to_reasoning_content(scripted, fmt):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {"messages": ASK} | ({"reasoning_format": fmt} if fmt else {})
        response = await chat(client, jobs, body, THINKING)
        assert response.status == 200, await response.text()
        message = (await response.json())["choices"][0]["message"]
        assert message["reasoning_content"] == "The user asks 2+2."
        assert message["content"] == "It is 4."


async def test_reasoning_format_none_leaves_it_in_the_content(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        response = await chat(client, jobs, {"messages": ASK, "reasoning_format": "none"}, THINKING)
        message = (await response.json())["choices"][0]["message"]
        assert "reasoning_content" not in message
        assert message["content"] == "".join(THINKING)


async def test_deepseek_legacy_fills_both(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        response = await chat(client, jobs, {"messages": ASK, "reasoning_format": "deepseek-legacy"}, THINKING)
        message = (await response.json())["choices"][0]["message"]
        assert message["reasoning_content"] == "The user asks 2+2."
        assert message["content"] == "".join(THINKING)


async def test_an_answer_without_thinking_has_no_reasoning_content(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        response = await chat(client, jobs, {"messages": ASK}, ["Four", "."])
        message = (await response.json())["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "Four."}


async def test_a_block_opened_by_the_prompt(scripted):
    """DeepSeek R1's generation prompt ends in <think>: the answer starts inside it."""
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        pieces = ["Two and", " two.", "</think>", "Four."]
        response = await chat(client, jobs, {"messages": ASK}, pieces, reasoning_open=True)
        message = (await response.json())["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Two and two.", "Four.")
        response = await chat(client, jobs, {"messages": ASK, "stream": True}, pieces, reasoning_open=True)
        reasoning, content, _ = deltas(await response.text())
        assert (reasoning, content) == ("Two and two.", "Four.")


async def test_cut_short_thinking_is_all_reasoning(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        response = await chat(client, jobs, {"messages": ASK, "max_tokens": 3}, THINKING[:3], reason="length")
        choice = (await response.json())["choices"][0]
        assert choice["message"]["reasoning_content"] == "The user asks 2+2."
        assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
async def test_streamed_thinking_is_delta_reasoning_content(scripted, size):
    text = "".join(THINKING)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        response = await chat(client, jobs, {"messages": ASK, "stream": True}, pieces)
        body = await response.text()
        reasoning, content, out = deltas(body)
        assert (reasoning, content) == ("The user asks 2+2.", "It is 4.")
        assert not any("<" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in out)
        assert body.rstrip().endswith("data: [DONE]")
        if size == 1:  # the thinking streams as it is generated, not at the end
            first_content = next(i for i, d in enumerate(out) if d.get("content"))
            assert sum(1 for d in out[:first_content] if d.get("reasoning_content")) > 5


async def test_streamed_legacy_and_none_stay_inline(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        for fmt in ("none", "deepseek-legacy"):
            response = await chat(client, jobs, {"messages": ASK, "stream": True, "reasoning_format": fmt}, THINKING)
            reasoning, content, _ = deltas(await response.text())
            assert (reasoning, content) == ("", "".join(THINKING))


async def test_tool_calls_are_read_after_the_thinking(scripted):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = ["<think>I should call", " the tool.</think>\n", call[:20], call[20:]]
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {"messages": ASK, "tools": [WEATHER]}
        response = await chat(client, jobs, body, pieces)
        choice = (await response.json())["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning_content"] == "I should call the tool."
        assert choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        response = await chat(client, jobs, body | {"stream": True}, pieces)
        text = await response.text()
        reasoning, content, out = deltas(text)
        assert reasoning == "I should call the tool." and "tool_call" not in content
        calls = [c for d in out for c in d.get("tool_calls", ())]
        assert calls[0]["function"]["name"] == "get_weather"


async def test_logprobs_still_come_with_thinking(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(client.post("/v1/chat/completions", json={
            "messages": ASK, "stream": True, "logprobs": True}))
        job = await new_job(jobs, 0)
        for i, piece in enumerate(["<think>a</think>", "b"]):
            job.put(p.Tokens(job.id, piece, i + 1, logprobs=[p.TokenLogprob(i, piece.encode(), -0.5)]))
        job.put(p.Done(job.id, "stop", prompt_tokens=3, completion_tokens=2))
        response = await request
        entries = [e for event in events(await response.text()) for c in event["choices"]
                   for e in ((c.get("logprobs") or {}).get("content") or [])]
        assert [e["token"] for e in entries] == ["<think>a</think>", "b"]


# -- what reaches the worker ---------------------------------------------------------------------


async def test_chat_template_kwargs_and_reasoning_content_reach_the_worker(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        messages = [*ASK, {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"},
                    {"role": "user", "content": "3+3?"}]
        body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False, "custom": {"a": [1, "x"]}}}
        await chat(client, jobs, body, ["6"])
        submit = jobs[-1].submit
        assert submit.chat_template_kwargs == {"enable_thinking": False, "custom": {"a": [1, "x"]}}
        assert submit.messages[1].reasoning_content == "2 and 2"
        assert (submit.add_generation_prompt, submit.continue_final) == (True, False)


async def test_a_final_assistant_message_is_prefilled(scripted):
    """llama-server's default: the answer continues the assistant's text."""
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        await chat(client, jobs, {"messages": [*ASK, {"role": "assistant", "content": "The answer is"}]}, [" 4."])
        assert (jobs[-1].submit.continue_final, jobs[-1].submit.add_generation_prompt) == (True, False)
        # asked otherwise: a new turn
        for extra in ({"continue_final_message": False}, {"add_generation_prompt": True}):
            await chat(client, jobs, {"messages": [*ASK, {"role": "assistant", "content": "x"}]} | extra, ["y"])
            assert (jobs[-1].submit.continue_final, jobs[-1].submit.add_generation_prompt) == (False, True)


async def test_apply_template_honours_its_options(queries):
    async with daemon() as (controller, client):
        made = queries(controller)
        body = {"messages": [*ASK, {"role": "assistant", "content": "Sure"}], "chat_template_kwargs": {"k": 1}}
        response = await client.post("/apply-template", json=body)
        assert response.status == 200 and "prompt" in await response.json()
        assert (made[-1].continue_final, made[-1].add_generation_prompt, made[-1].chat_template_kwargs) == (
            True, False, {"k": 1})
        response = await client.post("/apply-template", json={"messages": ASK, "add_generation_prompt": False})
        assert response.status == 200
        assert (made[-1].continue_final, made[-1].add_generation_prompt) == (False, False)


# -- hostile values ------------------------------------------------------------------------------


def deep(levels: int):
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/apply-template"])
@pytest.mark.parametrize("extra,field", [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {str(i): i for i in range(65)}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"x": "a" * 20000}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"x": deep(40)}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"x": [0] * 100_000}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"continue_final_message": 3}, "continue_final_message"),
    ({"continue_final_message": True}, "continue_final_message"),  # the last message is the user's
    ({"messages": [*ASK, {"role": "assistant", "content": "a"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message"),
    ({"messages": [*ASK, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "continue_final_message"),
    ({"messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
      "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 7}]}, "messages.0.reasoning_content"),
])
async def test_hostile_template_options_are_400_naming_the_field(path, extra, field):
    async with daemon() as (_, client):
        response = await client.post(path, json={"messages": ASK} | extra)
        error = await error_of(response, 400)
        assert error["param"] == field, error
        assert error["message"].startswith(field), error


@pytest.mark.parametrize("value", ["bogus", 1, None, ["auto"]])
async def test_reasoning_format_is_checked(scripted, value):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        if value is None:  # null means unset: the default
            response = await chat(client, jobs, {"messages": ASK, "reasoning_format": None}, THINKING)
            assert (await response.json())["choices"][0]["message"]["reasoning_content"]
            return
        error = await error_of(await client.post("/v1/chat/completions",
                                                 json={"messages": ASK, "reasoning_format": value}), 400)
        assert error["param"] == "reasoning_format"


# -- a real worker: load-time refusal and rendering -----------------------------------------------


class RealWorker:
    """`python -m daemon.worker` on a socketpair, spoken to directly."""

    def __init__(self) -> None:
        self.sock, child = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "daemon.worker", "--fd", str(child.fileno())],
                                     pass_fds=(child.fileno(),), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        child.close()
        self.sock.settimeout(120)
        assert isinstance(self.receive(), p.Hello)

    def send(self, message: p.Message) -> None:
        self.sock.sendall(p.encode(message))

    def receive(self) -> p.Message:
        head = self._exact(p.HEADER.size)
        return p.decode_for_daemon(self._exact(p.HEADER.unpack(head)[0]))

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, "the worker closed its channel"
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tests.fixtures.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def spec(model: str, template: str) -> p.ModelSpec:
    return p.ModelSpec(model=model, ctx_size=256, parallel=1, threads=1, n_gpu_layers=0, batch_size=64,
                       chat_template=template, warmup=False)


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m.content }}", "{% bogus %}", "{{ x | nofilter }}"])
def test_a_template_that_does_not_compile_fails_the_load_permanently(tiny, template):
    worker = RealWorker()
    try:
        worker.send(p.Load(spec(tiny, template)))
        message = worker.receive()
        while isinstance(message, p.LoadProgress):
            message = worker.receive()
        assert isinstance(message, p.Error), message
        assert message.code == "chat_template" and message.message.startswith("chat template:")
        assert message.during == "load"
    finally:
        worker.close()
    assert worker.proc.returncode == 3


TEMPLATE = (
    "{% for m in messages %}{% if m.content == 'SKIP' %}{% continue %}{% endif %}"
    "{% if m.role == 'assistant' %}<a>{% generation %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{{ m.content }}{% endgeneration %}</a>{% else %}<{{ m.role }}>{{ m.content }}{% endif %}"
    "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% if not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def test_a_real_worker_renders_loop_controls_generation_prefill_and_kwargs(tiny):
    worker = RealWorker()
    try:
        worker.send(p.Load(spec(tiny, TEMPLATE)))
        message = worker.receive()
        while isinstance(message, p.LoadProgress):
            message = worker.receive()
        assert isinstance(message, p.Ready), message

        def render(**fields) -> str:
            worker.send(p.Query("q", "apply_template", **fields))
            got = worker.receive()
            while not isinstance(got, p.Answer):
                got = worker.receive()
            assert got.error is None, got.error
            return got.text

        user, skip = p.ChatMessage("user", "Hi"), p.ChatMessage("user", "SKIP")
        said = p.ChatMessage("assistant", "Hello", reasoning_content="greet")
        assert render(messages=[user, skip, said, user]) == "<user>Hi<a><think>greet</think>Hello</a><user>Hi<a>"
        assert render(messages=[user], chat_template_kwargs={"enable_thinking": False}) == "<user>Hi<a><think></think>"
        assert render(messages=[user, p.ChatMessage("assistant", "The answer")], continue_final=True,
                      add_generation_prompt=False) == "<user>Hi<a><think></think>The answer"
        assert render(messages=[user], add_generation_prompt=False) == "<user>Hi"
    finally:
        worker.send(p.Sleep())
        worker.close()


def test_a_real_worker_takes_a_builtin_template_name_and_folds_a_refused_system_role(tiny):
    """--chat-template chatml (one of llama.cpp's names) renders as llama.cpp's; a template that refuses
    the system role (Gemma 2's) gets the system message folded into the first user turn, not an error."""
    from tests.unit.test_chat_templates import GEMMA2

    for template, messages, expected in (
            ("chatml", [p.ChatMessage("user", "Hi")], "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
            (GEMMA2, [p.ChatMessage("system", "Be brief."), p.ChatMessage("user", "Hi")],
             "<start_of_turn>user\nBe brief.\nHi<end_of_turn>\n<start_of_turn>model\n")):
        worker = RealWorker()
        try:
            worker.send(p.Load(spec(tiny, template)))
            message = worker.receive()
            while isinstance(message, p.LoadProgress):
                message = worker.receive()
            assert isinstance(message, p.Ready), message
            worker.send(p.Query("q", "apply_template", messages=messages))
            got = worker.receive()
            while not isinstance(got, p.Answer):
                got = worker.receive()
            assert got.error is None and got.text.endswith(expected), (got.error, got.text)
        finally:
            worker.send(p.Sleep())
            worker.close()


async def test_the_chat_template_setting_reaches_the_worker(tmp_path):
    own = tmp_path / "own.jinja"
    own.write_text("{{ messages[0].content }}")
    async with daemon(chat_template="chatml") as (controller, _):
        assert controller._model_spec(False).chat_template == "chatml"
    async with daemon(chat_template="chatml", chat_template_file=str(own)) as (controller, _):
        assert controller._model_spec(False).chat_template == "{{ messages[0].content }}"  # the file comes first
