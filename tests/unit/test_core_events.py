"""The core's events (daemon/http/core/events.py): the reader that turns the
worker's items into typed events, and every dialect's answer half driven by
the same events, with no worker and no app.

The reader's tests feed p.Tokens and a p.Done; the dialects' tests feed one
event sequence (the prompt's counts, thinking, text with its logprobs, a
forced tool call as it streams, the end) to each stream writer and read its
output back in the dialect's own shape; the whole bodies are made from one
gathered answer the same way."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from daemon import protocol as p
from daemon.http.core.events import (ChoiceReader, End, Failure, Progress, ReasoningDelta, Start, TextDelta,
                                     ToolCallDelta, gather, piece_text, read_events, timings, token_logprobs,
                                     whole_answer)
from daemon.http.core.job import ToolMode
from daemon.http.dialects.anthropic.answer import BlockStream, MessageShape
from daemon.http.dialects.anthropic.answer import whole_body as anthropic_body
from daemon.http.dialects.llama_server.answer import NativeChunks, native_body
from daemon.http.dialects.ollama.answer import ChatLines, LineWriter
from daemon.http.dialects.ollama.answer import whole_body as ollama_body
from daemon.http.dialects.openai.answer import ChunkWriter
from daemon.http.dialects.openai.answer import whole_body as openai_body
from daemon.http.dialects.openai.shapes import ChatShape, CompletionShape
from daemon.http.dialects.responses.answer import OutputStream, ResponseShape, _Events
from daemon.http.dialects.responses.answer import whole_body as responses_body
from daemon.model.jobs import JobFailure
from daemon.tools.parse import ParsedCall

WEATHER = ("get_weather",)
AUTO = ToolMode(WEATHER, forced=False, parallel=True)
FORCED = ToolMode(WEATHER, forced=True, parallel=True)
ARGUMENTS = '{"city": "Paris"}'
DONE = p.Done("r", "stop", prompt_tokens=7, completion_tokens=5, cached_tokens=2, prompt_seconds=0.5,
              generation_seconds=1.0)


def logprob(piece: bytes, value: float = -0.5) -> p.TokenLogprob:
    return p.TokenLogprob(1, piece, value, [p.TopLogprob(2, piece, value)])


def tokens(text: str, **fields) -> p.Tokens:
    return p.Tokens("r", text, 1, **fields)


class Script:
    """A job's items as the worker would send them, one per next()."""

    def __init__(self, items: list) -> None:
        self.items = list(items)

    async def next(self, wake_limit):
        return self.items.pop(0)


def read(items: list, readers: list[ChoiceReader]) -> list:
    async def run():
        job = Script(items[1:])
        return [event async for event in read_events(job, items[0], readers)]
    return asyncio.run(run())


# -- the reader: pieces -> events --------------------------------------------------------------

def test_prompt_progress_comes_before_the_start_and_timings_so_far_follow_the_workers_clock():
    reader = ChoiceReader()
    begun = p.PromptProgress("r", total=70, cache=6, processed=6, seconds=0.001)
    halfway = p.PromptProgress("r", total=70, cache=6, processed=38, seconds=0.25)
    events = read([begun, halfway, tokens("Hi", n_prompt_tokens=70, n_cached_tokens=6, prompt_seconds=0.5),
                   p.Tokens("r", "!", 3, prompt_seconds=0.5, generation_seconds=0.2), DONE], [reader])
    assert events[:3] == [Progress(0, 70, 6, 6, 0.001), Progress(0, 70, 6, 38, 0.25), Start(0, 70, 6, False)]
    assert events[0].prompt_progress() == {"total": 70, "cache": 6, "processed": 6, "time_ms": 1}
    assert (events[0].timings()["prompt_n"], events[0].timings()["prompt_ms"]) == (0, 0.0)  # nothing read: no time
    assert (events[1].timings()["prompt_n"], events[1].timings()["prompt_ms"]) == (32, 250.0)
    so_far = reader.timings_so_far()
    assert (so_far["cache_n"], so_far["prompt_n"], so_far["predicted_n"], so_far["predicted_ms"]) == (6, 64, 3, 200.0)
    assert ChoiceReader().timings_so_far() is None  # before its first token


def test_a_whole_answer_reads_past_progress():
    begun = p.PromptProgress("r", total=7, cache=2, processed=2)
    whole = asyncio.run(whole_answer(Script([tokens("b"), DONE]), begun))
    assert whole.choices[0].text == "b" and whole.done is DONE


def test_a_plain_answer_is_its_start_its_text_with_logprobs_and_its_end():
    first = logprob(b"Hel")
    events = read([tokens("Hel", n_prompt_tokens=7, n_cached_tokens=2, logprobs=[first]), tokens("lo"), DONE],
                  [ChoiceReader()])
    assert events == [Start(0, 7, 2, False), TextDelta(0, "Hel", (first,)), TextDelta(0, "lo"), End(0, "stop", DONE)]


def test_a_character_split_across_pieces_keeps_its_bytes_and_its_logprobs_ride_alone():
    """The worker sends text only once a character is whole; the half that came first is
    logprobs with no text, and its bytes say exactly what was generated."""
    head, tail = logprob("é".encode()[:1]), logprob("é".encode()[1:])
    events = read([tokens("", logprobs=[head]), tokens("é", logprobs=[tail]), DONE], [ChoiceReader()])
    assert events[1:3] == [TextDelta(0, "", (head,)), TextDelta(0, "é", (tail,))]
    shaped = token_logprobs([head, tail])
    assert bytes(shaped[0]["bytes"] + shaped[1]["bytes"]).decode() == "é"
    assert shaped[0]["token"] == piece_text(head.piece) == "\ufffd"  # half a character is not text
    assert shaped[0]["top_logprobs"] == [{"token": "\ufffd", "logprob": -0.5, "bytes": [0xC3]}]


def test_thinking_is_read_apart_and_a_steps_logprobs_ride_on_its_first_delta():
    lp = logprob(b"x")
    events = read([tokens("<think>plan</think>Hi", logprobs=[lp]), DONE], [ChoiceReader(reasoning=True)])
    deltas = [e for e in events if isinstance(e, (ReasoningDelta, TextDelta))]
    assert "".join(e.text for e in deltas if isinstance(e, ReasoningDelta)) == "plan"
    assert "".join(e.text for e in deltas if isinstance(e, TextDelta)) == "Hi"
    assert deltas[0].logprobs == (lp,) and all(e.logprobs == () for e in deltas[1:])


def test_without_reasoning_the_markers_are_text():
    events = read([tokens("<think>plan</think>Hi"), DONE], [ChoiceReader()])
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["<think>plan</think>Hi"]


def test_a_forced_call_streams_as_tool_call_deltas_and_ends_announced():
    events = read([tokens('[{"name": "get_weather", "arguments": {"city": '), tokens('"Paris"}}]'), DONE],
                  [ChoiceReader(tools=FORCED)])
    deltas = [d for e in events if isinstance(e, ToolCallDelta) for d in e.deltas]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Paris"}
    assert not any(isinstance(e, TextDelta) for e in events)  # a forced answer is never content
    end = events[-1]
    assert (end.reason, end.announced, [c.name for c in end.calls]) == ("tool_calls", 1, ["get_weather"])


def test_a_forced_calls_ids_come_from_the_dialect():
    events = read([tokens('[{"name": "get_weather", "arguments": {}}]'), DONE],
                  [ChoiceReader(tools=FORCED, call_id=lambda: "toolu_1")])
    first = next(e for e in events if isinstance(e, ToolCallDelta))
    assert first.deltas[0]["id"] == "toolu_1"


def test_a_call_in_the_models_format_is_held_back_and_read_at_the_end():
    call = f'<tool_call>{{"name": "get_weather", "arguments": {ARGUMENTS}}}</tool_call>'
    events = read([tokens("Sure."), tokens(" " + call[:12]), tokens(call[12:]), DONE], [ChoiceReader(tools=AUTO)])
    end = events[-1]
    said = "".join(e.text for e in events if isinstance(e, TextDelta)) + end.rest
    assert "<tool_call" not in said and said.strip() == "Sure."
    assert end.reason == "tool_calls" and end.announced == 0
    assert [(c.name, json.loads(c.arguments)) for c in end.calls] == [("get_weather", {"city": "Paris"})]


def test_text_that_only_looked_like_a_call_comes_back_at_the_end():
    events = read([tokens("see <tool_"), DONE], [ChoiceReader(tools=AUTO)])
    said = "".join(e.text for e in events if isinstance(e, TextDelta)) + events[-1].rest
    assert said == "see <tool_" and events[-1].calls == () and events[-1].reason == "stop"


def test_a_call_cut_short_is_length_whatever_it_holds():
    events = read([tokens('[{"name": "get_weather", "arguments": {"ci'), p.Done("r", "length")],
                  [ChoiceReader(tools=FORCED)])
    assert events[-1].reason == "length"


def test_with_two_choices_the_first_to_end_ends_without_the_done():
    items = [tokens("a", index=0), tokens("b", index=1), tokens("", index=0, finish_reason="length"),
             tokens("c", index=1, finish_reason="stop"), DONE]
    events = read(items, [ChoiceReader(0), ChoiceReader(1)])
    ends = [e for e in events if isinstance(e, End)]
    assert [(e.index, e.reason, e.done) for e in ends] == [(0, "length", None), (1, "stop", DONE)]
    whole = gather(events, 2)
    assert [c.text for c in whole.choices] == ["a", "bc"] and whole.done is DONE


@pytest.mark.parametrize("end, status", [(p.Done("r", "error", error="boom", error_code="x"), 500),
                                         (p.Done("r", "error", error="bad", error_code="invalid_request"), 400),
                                         (JobFailure(503, "worker_exited", "gone"), 503)])
def test_a_failure_after_the_start_is_one_failure_event(end, status):
    events = read([tokens("partial"), end], [ChoiceReader()])
    assert isinstance(events[-1], Failure) and events[-1].item is end and events[-1].error.status == status
    assert not any(isinstance(e, End) for e in events)


def test_gather_is_the_text_the_logprobs_and_whether_thinking_was_open():
    lp = logprob(b"a")
    whole = asyncio.run(whole_answer(Script([tokens("b"), DONE]), tokens("a", reasoning_open=True, logprobs=[lp])))
    choice = whole.choices[0]
    assert (choice.text, choice.logprobs, choice.reasoning_open, choice.reason) == ("ab", [lp], True, "stop")
    assert whole.done is DONE and whole.failure is None


def test_timings_are_the_figures_of_the_done():
    figures = timings(DONE)
    assert (figures["cache_n"], figures["prompt_n"], figures["predicted_n"]) == (2, 5, 5)
    assert figures["prompt_per_second"] == 10.0 and figures["predicted_per_second"] == 4.0
    assert "draft_n" not in figures and "cache_tier" not in figures


def test_timings_rates_skip_the_first_token_and_agree_with_the_reported_milliseconds():
    # The first token costs no decode step of its own: 5 tokens in 1 s are 4 steps of 250 ms.
    assert timings(DONE)["predicted_per_token_ms"] == 250.0
    one = timings(p.Done("r", "length", prompt_tokens=3, completion_tokens=1, generation_seconds=0.0004))
    assert (one["predicted_per_token_ms"], one["predicted_per_second"]) == (0.0, 0.0)
    odd = timings(p.Done("r", "length", prompt_tokens=3, completion_tokens=16, prompt_seconds=0.0123456,
                         generation_seconds=0.123456789))
    assert odd["predicted_ms"] == 123.457 and odd["predicted_per_second"] == 1e3 / odd["predicted_ms"] * 15
    assert odd["prompt_per_second"] == 1e3 / odd["prompt_ms"] * 3


# -- every dialect's stream from the same events ---------------------------------------------

LP = logprob(b"Hello")
CALL_START = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
CALL_ARGS = {"index": 0, "function": {"arguments": ARGUMENTS}}
CALLED = p.Done("r", "stop", prompt_tokens=7, completion_tokens=5, cached_tokens=2)
EVENTS = [Start(0, 7, 2, False), ReasoningDelta(0, "plan"), TextDelta(0, "Hello", (LP,)),
          ToolCallDelta(0, [CALL_START]), ToolCallDelta(0, [CALL_ARGS]),
          End(0, "tool_calls", CALLED, calls=(ParsedCall("get_weather", ARGUMENTS),), announced=1)]
TEXT_ONLY = [Start(0, 7, 2, False), TextDelta(0, "Hello", (LP,)), End(0, "stop", CALLED)]


def drive(writer, events, begin: bool = False) -> bytes:
    """The writer's output for these events, gathered from its write()."""
    async def run():
        if begin:
            await writer.begin()
        for event in events:
            await writer.on(event)
        if isinstance(writer, ChunkWriter):  # its usage and [DONE] come after the events
            await writer.close()
    asyncio.run(run())
    return b"".join(writer.written)


def collecting(cls, *args, **kwargs):
    written: list[bytes] = []

    async def write(data: bytes) -> None:
        written.append(data)

    writer = cls(write, *args, **kwargs)
    writer.written = written
    return writer


def sse_data(raw: bytes) -> list:
    return [line[6:] if line[6:] == b"[DONE]" else json.loads(line[6:])
            for line in raw.split(b"\n") if line.startswith(b"data: ")]


def sse_types(raw: bytes) -> list[str]:
    return [line[7:].decode() for line in raw.split(b"\n") if line.startswith(b"event: ")]


def test_openai_chat_streams_thinking_text_the_call_its_end_usage_and_done():
    shape = ChatShape("chatcmpl-1", "m", include_usage=True, logprobs=True)
    chunks = sse_data(drive(collecting(ChunkWriter, shape, 1, True, FORCED), EVENTS, begin=True))
    assert chunks[-1] == b"[DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks[:-2]]
    assert deltas[0] == {"role": "assistant", "content": None}  # llama-server's first chunk: no empty content
    assert deltas[1] == {"reasoning_content": "plan"}
    assert deltas[2] == {"content": "Hello"} and chunks[2]["choices"][0]["logprobs"]["content"][0]["token"] == "Hello"
    assert [d["tool_calls"] for d in deltas[3:5]] == [[CALL_START], [CALL_ARGS]]  # the streamed call, not again
    assert chunks[-3]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-3]["timings"]["prompt_n"] == 5
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["total_tokens"] == 12
    assert {c["object"] for c in chunks[:-1]} == {"chat.completion.chunk"}


def test_openai_chat_sends_calls_read_from_the_whole_answer_at_the_end():
    end = End(0, "tool_calls", CALLED, calls=(ParsedCall("get_weather", ARGUMENTS),))
    chunks = sse_data(drive(collecting(ChunkWriter, ChatShape("c", "m"), 1, False, AUTO), [end]))
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[:-2]]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == ARGUMENTS


def test_openai_completions_streams_text_and_its_end():
    """Completions read no thinking and no calls (no tools, no reasoning_format): text and the end."""
    chunks = sse_data(drive(collecting(ChunkWriter, CompletionShape("cmpl-1", "m", logprobs=True), 1, False, None),
                            TEXT_ONLY, begin=True))
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hello", ""]
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["Hello"]
    assert chunks[1]["choices"][0]["finish_reason"] == "stop" and chunks[-1] == b"[DONE]"
    assert chunks[0]["object"] == "text_completion"


def responses_shape() -> ResponseShape:
    body = SimpleNamespace(max_tool_calls=None, wants_logprobs=True, format=None, instructions=None,
                           max_output_tokens=None, metadata=None, top_logprobs=None, tool_choice=None, tools=None,
                           safety_identifier=None)
    chat = SimpleNamespace(parallel_tool_calls=True, user=None, timings_per_token=False)
    return ResponseShape("job-1", "m", body, chat, SimpleNamespace(temperature=0.8, top_p=0.95))


def test_responses_streams_the_message_item_the_call_item_and_completed():
    written: list[bytes] = []

    async def write(data: bytes) -> None:
        written.append(data)

    output = OutputStream(responses_shape(), _Events(write), FORCED)
    output.written = written
    raw = drive(output, EVENTS, begin=True)
    types = sse_types(raw)
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in types and "response.function_call_arguments.delta" in types
    assert types[-1] == "response.completed"
    final = sse_data(raw)[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][0]["content"][0]["logprobs"][0]["token"] == "Hello"
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Paris"}
    assert final["usage"]["input_tokens"] == 7
    numbers = [body["sequence_number"] for body in sse_data(raw)]
    assert numbers == list(range(len(numbers)))


def test_anthropic_streams_thinking_text_and_tool_use_blocks():
    raw = drive(collecting(BlockStream, MessageShape("job-1", "m", None)), EVENTS)
    types, bodies = sse_types(raw), sse_data(raw)
    assert types[0] == "message_start" and bodies[0]["message"]["usage"]["cache_read_input_tokens"] == 2
    starts = [b["content_block"]["type"] for b in bodies if b["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    partial = [b["delta"]["partial_json"] for b in bodies if b.get("delta", {}).get("type") == "input_json_delta"]
    assert json.loads("".join(partial)) == {"city": "Paris"}
    assert bodies[-2]["delta"]["stop_reason"] == "tool_use" and types[-1] == "message_stop"
    assert types.count("content_block_start") == types.count("content_block_stop")


def test_ollama_streams_lines_the_calls_in_one_line_and_the_last_with_timings():
    lines = ChatLines("m", SimpleNamespace(last_wake=None), logprobs=True)
    job = SimpleNamespace(accepted_at=time.monotonic(), cold=False)
    raw = drive(collecting(LineWriter, lines, job), EVENTS)
    objects = [json.loads(line) for line in raw.splitlines()]
    assert [o["done"] for o in objects] == [False, False, True]
    assert objects[0]["message"]["content"] == "Hello" and objects[0]["logprobs"][0]["token"] == "Hello"
    call = objects[1]["message"]["tool_calls"][0]["function"]
    assert (call["name"], call["arguments"]) == ("get_weather", {"city": "Paris"})  # an object, as Ollama's
    assert objects[2]["done_reason"] == "stop" and objects[2]["eval_count"] == 5  # a call ends with "stop"


def test_llama_server_streams_text_chunks_and_the_last_with_stop():
    body = SimpleNamespace(return_tokens=True, n_probs=1, timings_per_token=False)
    end = {"generation_settings": {"post_sampling_probs": False}}
    chunks = sse_data(drive(collecting(NativeChunks, "m", body, end), EVENTS))
    assert [c["content"] for c in chunks] == ["Hello", ""] and [c["stop"] for c in chunks] == [False, True]
    assert chunks[0]["tokens"] == [1] and chunks[0]["completion_probabilities"][0]["token"] == "Hello"
    assert chunks[1]["tokens_cached"] == 2 and chunks[1]["timings"]["prompt_n"] == 5


@pytest.mark.parametrize("make, error_of", [
    (lambda: collecting(ChunkWriter, ChatShape("c", "m"), 1, True, None),
     lambda raw: sse_data(raw)[-1]["error"]["message"]),
    (lambda: collecting(BlockStream, MessageShape("j-1", "m", None)),
     lambda raw: sse_data(raw)[-1]["error"]["message"]),
    (lambda: collecting(NativeChunks, "m", SimpleNamespace(return_tokens=False, n_probs=0, timings_per_token=False),
                        {"generation_settings": {"post_sampling_probs": False}}),
     lambda raw: sse_data(raw)[-1]["error"]["message"]),
    (lambda: collecting(LineWriter, ChatLines("m", SimpleNamespace(last_wake=None)), SimpleNamespace()),
     lambda raw: json.loads(raw.splitlines()[-1])["error"]),
])
def test_a_failure_is_the_dialects_error_and_nothing_after_it(make, error_of):
    raw = drive(make(), [Start(0), TextDelta(0, "par"), Failure(p.Done("r", "error", error="boom"))])
    assert error_of(raw) == "boom"
    assert b"[DONE]" not in raw and b"message_stop" not in raw


# -- every dialect's whole body from the same gathered answer ---------------------------------

WHOLE_TEXT = f'<think>plan</think>Hello <tool_call>{{"name": "get_weather", "arguments": {ARGUMENTS}}}</tool_call>'


def whole(text: str = WHOLE_TEXT):
    return gather([Start(0, 7, 2), TextDelta(0, text, (LP,)), End(0, "stop", CALLED)])


def test_openai_chat_whole_body():
    body = openai_body(whole(), ChatShape("c", "m"), AUTO, "auto")
    message, choice = body["choices"][0]["message"], body["choices"][0]
    assert (message["reasoning_content"], message["content"]) == ("plan", "Hello")
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    assert choice["finish_reason"] == "tool_calls" and body["usage"]["prompt_tokens"] == 7 and "timings" in body


def test_openai_completions_whole_body():
    body = openai_body(whole("Hello"), CompletionShape("c", "m"), None, None)
    assert body["choices"][0]["text"] == "Hello" and body["object"] == "text_completion"


def test_responses_whole_body():
    body = responses_body(whole(WHOLE_TEXT.removeprefix("<think>plan</think>")), responses_shape(), AUTO)
    assert [i["type"] for i in body["output"]] == ["message", "function_call"] and body["status"] == "completed"


def test_anthropic_whole_body():
    body = anthropic_body(whole(), MessageShape("job-1", "m", None), AUTO)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][2]["input"] == {"city": "Paris"} and body["stop_reason"] == "tool_use"
    assert body["usage"] == {"input_tokens": 5, "output_tokens": 5, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 2}


def test_ollama_whole_body():
    lines = ChatLines("m", SimpleNamespace(last_wake=None))
    job = SimpleNamespace(accepted_at=time.monotonic(), cold=False)
    body = ollama_body(whole(WHOLE_TEXT.removeprefix("<think>plan</think>")), lines, job, AUTO)
    assert body["message"]["content"] == "Hello" and body["done"] and body["done_reason"] == "stop"
    assert body["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_llama_server_whole_body():
    body = native_body(whole("Hello\nthere"), "m", SimpleNamespace(return_tokens=True, n_probs=1),
                       {"generation_settings": {"post_sampling_probs": True}})
    assert body["content"] == "Hello\nthere" and body["has_new_line"] and body["stop_type"] == "eos"
    assert body["completion_probabilities"][0]["prob"] == pytest.approx(0.6065, abs=1e-3)


def test_hidden_cache_counts_leave_only_the_prompts_last_progress_and_no_cache_in_it():
    """report_cached_tokens = false: the progress reports begin at the cached count and move by chunks from
    it; only the last (all read) is passed on, its cache and clock zeroed."""
    from daemon.http.core.run import _without_cache_counts

    items = [p.PromptProgress("r", total=90, cache=40, processed=40, seconds=0.1),
             p.PromptProgress("r", total=90, cache=40, processed=72, seconds=0.2),
             p.PromptProgress("r", total=90, cache=40, processed=90, seconds=0.3),
             tokens("a", n_prompt_tokens=90, n_cached_tokens=40), DONE]
    job = SimpleNamespace(next=Script(items).next)
    _without_cache_counts(job)

    async def drain():
        return [await job.next(None) for _ in range(3)]

    last, first_tokens, done = asyncio.run(drain())
    assert last == p.PromptProgress("r", total=90, cache=0, processed=90, seconds=0.0)
    assert first_tokens.n_cached_tokens == 0 and done.cached_tokens == 0
