"""What the OpenAI endpoints answer: whole bodies and stream chunks for
/v1/completions and /v1/chat/completions, with usage, logprobs in OpenAI's two
shapes, tool calls, and llama-server's `timings` (the core's figures, core/events.py).

Nothing here waits or decides: answer.py feeds a shape what the core's
events say and writes what it returns.
"""

from __future__ import annotations

import hashlib
import os
import time
from functools import lru_cache
from importlib import metadata
from typing import Any

from daemon import protocol as p
from daemon.http.core.events import piece_text, timings, token_logprobs

_NO_USAGE: Any = object()  # the body has no "usage" key at all


def usage(done: p.Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def system_fingerprint(model_path: str) -> str:
    """A stable value per model build, as llama-server's "b<build>-<commit>":
    the llama.cpp bindings' version and a digest of the model file (its size
    and first MiB, as the prompt cache's files check it), so it changes when
    either does and not with a restart."""
    try:
        info = os.stat(model_path)
    except OSError:  # not a file (yet): the path names it
        return _fingerprint(model_path, -1, 0)
    return _fingerprint(model_path, info.st_size, info.st_mtime_ns)


@lru_cache(maxsize=256)
def _fingerprint(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.blake2b(digest_size=4)
    if size >= 0:
        from daemon.model.kv_files import model_fingerprint

        try:
            digest.update(f"{size}:{model_fingerprint(path)['head']}".encode())
        except OSError:
            digest.update(path.encode())
    else:
        digest.update(path.encode())
    return f"b{_bindings_version()}-{digest.hexdigest()}"


@lru_cache(maxsize=1)
def _bindings_version() -> str:
    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:  # pragma: no cover - the worker needs it anyway
        return "0"


class _Shape:
    """How one endpoint's responses look."""

    def __init__(self, request_id: str, model: str, include_usage: bool = False, logprobs: bool = False,
                 fingerprint: str | None = None) -> None:
        self.id = request_id
        self.model = model
        self.fingerprint = fingerprint  # system_fingerprint, on every body and chunk (as llama-server)
        self.created = int(time.time())
        self.logprobs = logprobs
        # As OpenAI's: with stream_options.include_usage every chunk carries
        # "usage": null, and the last one (no choices) carries the usage.
        self.chunk_usage = None if include_usage else _NO_USAGE

    def envelope(self, object_name: str, choices: list[dict], usage: dict | None = _NO_USAGE,
                 extra: dict | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                                "choices": choices}
        if self.fingerprint is not None:
            body["system_fingerprint"] = self.fingerprint
        if usage is not _NO_USAGE:
            body["usage"] = usage
        if extra:
            body.update(extra)
        return body


class CompletionShape(_Shape):
    """text_completion; logprobs as the legacy completions API has them."""

    object_name = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}  # per choice: characters of text before its next token (text_offset)

    def logprobs_of(self, entries: list[p.TokenLogprob], index: int = 0) -> dict | None:
        if not self.logprobs:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            token = piece_text(e.piece)
            out["tokens"].append(token)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({piece_text(t.piece): t.logprob for t in e.top})
            out["text_offset"].append(self._offsets.get(index, 0))
            self._offsets[index] = self._offsets.get(index, 0) + len(token)
        return out

    def choice(self, index: int, text: str, reason: str, logprobs: list[p.TokenLogprob]) -> dict:
        return {"index": index, "text": text, "logprobs": self.logprobs_of(logprobs, index), "finish_reason": reason}

    def final(self, choices: list[dict], done: p.Done) -> dict:
        return self.envelope(self.object_name, choices, usage(done), {"timings": timings(done)})

    def chunk(self, text: str, logprobs: list[p.TokenLogprob] = (), reason: str | None = None, index: int = 0) -> dict:
        choice = {"index": index, "text": text, "logprobs": self.logprobs_of(list(logprobs), index),
                  "finish_reason": reason}
        return self.envelope(self.object_name, [choice], self.chunk_usage)

    def first_chunk(self, index: int = 0) -> dict | None:
        return None

    def last_chunk(self, reason: str, done: p.Done | None, index: int = 0) -> dict:
        body = self.chunk("", reason=reason, index=index)
        if done is not None:
            body["timings"] = timings(done)
        return body

    def usage_chunk(self, done: p.Done) -> dict:
        # llama-server's timings ride on a stream's very last chunk: this one, when it is sent
        return self.envelope(self.object_name, [], usage(done), {"timings": timings(done)})


class ChatShape(_Shape):
    """chat.completion and its chunks; logprobs as the chat API has them."""

    def logprobs_of(self, entries: list[p.TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": token_logprobs(entries), "refusal": None}

    def choice(self, index: int, text: str | None, reason: str, logprobs: list[p.TokenLogprob],
               tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:  # as llama-server: only when the answer had thinking
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": self.logprobs_of(logprobs), "finish_reason": reason}

    def final(self, choices: list[dict], done: p.Done) -> dict:
        return self.envelope("chat.completion", choices, usage(done), {"timings": timings(done)})

    def chunk(self, text: str | None, logprobs: list[p.TokenLogprob] = (), reason: str | None = None,
              tool_calls: list[dict] | None = None, index: int = 0, reasoning: str | None = None) -> dict:
        delta: dict[str, Any] = {"content": text} if text else {}  # never empty content (a token with no text yet)
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        entries = list(logprobs)
        choice = {"index": index, "delta": delta, "logprobs": self.logprobs_of(entries) if entries else None,
                  "finish_reason": reason}
        return self.envelope("chat.completion.chunk", [choice], self.chunk_usage)

    def first_chunk(self, index: int = 0) -> dict | None:
        # The role alone, content null (llama-server's first chunk; OpenAI's clients read null or ""): no delta
        # ever carries empty content, which llama-server's own stream checks refuse.
        return self.envelope("chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": None},
                                                         "logprobs": None, "finish_reason": None}], self.chunk_usage)

    def last_chunk(self, reason: str, done: p.Done | None, index: int = 0) -> dict:
        body = self.chunk(None, reason=reason, index=index)
        if done is not None:
            body["timings"] = timings(done)
        return body

    def usage_chunk(self, done: p.Done) -> dict:
        # llama-server's timings ride on a stream's very last chunk: this one, when it is sent
        return self.envelope("chat.completion.chunk", [], usage(done), {"timings": timings(done)})
