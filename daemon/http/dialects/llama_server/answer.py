"""llama-server's answer to a generation job (/completion, /infill): `content`
and `stop` instead of choices, its `generation_settings`, `tokens`,
post-sampling probabilities and timings, whole or streamed as `data:` lines;
and its context-overflow error, in llama-server's own shape."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.errors import ApiError
from daemon.http.core.events import (ChoiceReader, End, Event, Failure, Progress, TextDelta, Whole, piece_text,
                                     read_events, timings, whole_answer)
from daemon.http.core.run import failure_error, first_item, is_failure, open_event_stream, overflow_counts, tracked
from daemon.http.core.schemas import SamplingFields
from daemon.http.dialects.llama_server.schemas import NativeCompletionRequest
from daemon.model.jobs import Job


_STOP_TYPES = {"stop": "eos", "length": "limit"}


# The sampler chain's order (daemon/worker/sampling.py), in llama-server's names; temperature 0 is greedy.
_SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]


def generation_settings(params: p.SamplingParams, n_predict: int, stream: bool = False, n_probs: int = 0,
                        post_sampling_probs: bool = False, eog_tokens: list[int] = ()) -> dict:
    """llama-server's generation settings (its /props default_generation_settings.params and
    /completion's generation_settings), with the fields Dormouse honours; seed -1: random.
    logit_bias: a bias of -inf (a token never drawn; `false` in the request) is null, as llama-server
    writes it; with ignore_eos, the model's end-of-generation tokens (eog_tokens) are there at -inf."""
    biases = dict(params.logit_bias)
    if params.ignore_eos and params.grammar is None:  # as the worker's sampler (sampling.py) applies it
        biases.update(dict.fromkeys(eog_tokens, -math.inf))
    return {"seed": -1 if params.seed is None else params.seed, "temperature": params.temperature,
            "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "repeat_last_n": params.repeat_last_n, "repeat_penalty": params.repeat_penalty,
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "max_tokens": n_predict, "n_predict": n_predict, "ignore_eos": params.ignore_eos, "stream": stream,
            "n_probs": n_probs, "post_sampling_probs": post_sampling_probs, "stop": list(params.stop),
            "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in biases.items()],
            "samplers": _SAMPLERS}


def default_generation_settings(settings, n_ctx_slot: int) -> dict:
    """What a /completion that sends no sampling field gets, as /props shows it."""
    n_predict = -1 if settings.n_predict is None else settings.n_predict
    return {"params": generation_settings(SamplingFields().sampling(n_predict, defaults=settings), n_predict),
            "n_ctx": n_ctx_slot}


class ContextExceeded(ApiError):
    """llama-server's answer to a prompt its slot cannot hold: type
    exceed_context_size_error, the status as its code, and the two counts
    (clients read them to trim the prompt)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int, at_least: bool) -> None:
        shown = f"more than {n_prompt_tokens - 1}" if at_least else str(n_prompt_tokens)
        super().__init__(400, f"request ({shown} tokens) exceeds the available context size ({n_ctx} tokens), try "
                              "increasing it (ctx_size / parallel)", "context_length_exceeded", param="prompt")
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    def body(self, dialect="openai") -> dict:
        return {"error": {"code": self.status, "message": self.message, "type": "exceed_context_size_error",
                          "n_prompt_tokens": self.n_prompt_tokens, "n_ctx": self.n_ctx}}


def _native_error(item, body: NativeCompletionRequest, model: FleetModel) -> ApiError:
    error = failure_error(item)
    if error.code != "context_length_exceeded":
        return error
    c = model.controller
    n_ctx = c.n_ctx_slot or c.settings.slot_context
    counts = overflow_counts(getattr(item, "error", None))
    if counts is not None:
        return ContextExceeded(*counts)
    if isinstance(body.prompt, list):
        return ContextExceeded(len(body.prompt), n_ctx, False)
    return ContextExceeded(n_ctx + 1, n_ctx, True)  # the worker said it overflows, not by how much


def _settings_end(model: FleetModel, params, n_predict: int, stream: bool, n_probs: int, post_sampling: bool) -> dict:
    """The answer's generation_settings, read once the worker has taken the request: a request that woke
    the model finds its end-of-generation tokens (model_info) there only then."""
    return {"generation_settings": generation_settings(params, n_predict, stream, n_probs, post_sampling,
                                                       model.controller.model_info.get("eog_tokens", []))}


async def native_answer(request: web.Request, model: FleetModel, job: Job, body, params, n_predict: int,
                        post_sampling: bool, pick: Callable[[dict], dict] | None = None) -> web.StreamResponse:
    """/completion's answer to a job, whole or streamed; /infill's too (`pick`: its response_fields,
    applied to a whole answer only, as llama-server does)."""
    if not body.stream:
        answer = await native_whole(request, model, job, body, params, n_predict, post_sampling)
        return web.json_response(pick(answer) if pick is not None else answer)
    async with tracked(request, model, job, body.stream):
        item = await first_item(request, model, job)
        if is_failure(item):
            raise _native_error(item, body, model)
        end = _settings_end(model, params, n_predict, True, body.n_probs, post_sampling)
        response = await open_event_stream(request, job)
        reader = ChoiceReader()
        writer = NativeChunks(response.write, model.id, body, end, reader)
        async for event in read_events(job, item, [reader]):
            await writer.on(event)
        await response.write_eof()
        return response


async def native_whole(request: web.Request, model: FleetModel, job: Job, body, params, n_predict: int,
                       post_sampling: bool) -> dict:
    """/completion's whole answer to one job (one prompt), as a dict."""
    async with tracked(request, model, job, False):
        item = await first_item(request, model, job)
        if is_failure(item):
            raise _native_error(item, body, model)
        end = _settings_end(model, params, n_predict, False, body.n_probs, post_sampling)
        whole = await whole_answer(job, item)
        if whole.failure is not None:
            raise _native_error(whole.failure.item, body, model)
        return native_body(whole, model.id, body, end)


def native_body(whole: Whole, model: str, body, end: dict) -> dict:
    """/completion's whole answer; end: its generation_settings."""
    choice = whole.choices[0]
    content, probs = choice.text, choice.logprobs
    answer = {"index": 0, "content": content, "tokens": [e.token for e in probs] if body.return_tokens else [],
              **_native_end(whole.done, model), **end, "has_new_line": "\n" in content}
    if body.n_probs:
        answer["completion_probabilities"] = _native_probs(probs, end["generation_settings"]["post_sampling_probs"])
    return answer


def _native_end(done: p.Done, model: str) -> dict:
    stop_type = "word" if done.stopping_word else _STOP_TYPES.get(done.finish_reason, done.finish_reason)
    return {"stop": True, "model": model, "stop_type": stop_type, "stopping_word": done.stopping_word,
            "tokens_predicted": done.completion_tokens, "tokens_evaluated": done.prompt_tokens,
            "tokens_cached": done.cached_tokens, "truncated": False, "timings": timings(done)}


def _native_probs(entries: list[p.TokenLogprob], post_sampling: bool = False) -> list[dict]:
    """llama-server's completion_probabilities: log-probabilities of the model's
    own distribution, or (post_sampling_probs) probabilities of the one the
    sampler chain drew from, under its other names (prob, top_probs)."""
    if post_sampling:
        return [{"id": e.token, "token": piece_text(e.piece), "bytes": list(e.piece), "prob": math.exp(e.logprob),
                 "top_probs": [{"id": t.token, "token": piece_text(t.piece), "bytes": list(t.piece),
                                "prob": math.exp(t.logprob)} for t in e.top]} for e in entries]
    return [{"id": e.token, "token": piece_text(e.piece), "bytes": list(e.piece), "logprob": e.logprob,
             "top_logprobs": [{"id": t.token, "token": piece_text(t.piece), "bytes": list(t.piece), "logprob": t.logprob}
                              for t in e.top]} for e in entries]


class NativeChunks:
    """The events as llama-server streams /completion: `data: {...}` lines, each
    step's text with its tokens and probabilities, the last with stop: true (no [DONE])."""

    def __init__(self, write: Callable[[bytes], Awaitable], model: str, body: NativeCompletionRequest,
                 end: dict, reader: ChoiceReader | None = None) -> None:
        self.write = write
        self.model = model
        self.body = body
        self.end = end  # generation_settings
        self.post_sampling = end["generation_settings"]["post_sampling_probs"]
        self.reader = reader  # its timings so far (timings_per_token)

    async def send(self, body: dict) -> None:
        await self.write(b"data: " + msgspec.json.encode(body) + b"\n\n")

    async def on(self, event: Event) -> None:
        if isinstance(event, TextDelta):  # a plain reader's: the step's text, or its logprobs alone
            chunk = {"index": 0, "content": event.text, "stop": False,
                     "tokens": [e.token for e in event.logprobs] if self.body.return_tokens else []}
            if self.body.n_probs:
                chunk["completion_probabilities"] = _native_probs(list(event.logprobs), self.post_sampling)
            if self.body.timings_per_token and self.reader is not None:
                chunk["timings"] = self.reader.timings_so_far()
            await self.send(chunk)
        elif isinstance(event, Progress):
            chunk = {"index": 0, "content": "", "tokens": [], "stop": False,
                     "prompt_progress": event.prompt_progress()}
            if self.body.timings_per_token:
                chunk["timings"] = event.timings()
            await self.send(chunk)
        elif isinstance(event, Failure):
            await self.send(failure_error(event.item).body())
        elif isinstance(event, End):
            await self.send({"index": 0, "content": "", "tokens": [], **_native_end(event.done, self.model),
                             **self.end})
