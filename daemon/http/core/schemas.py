"""Request bodies, validated with pydantic, and their mapping onto the
worker protocol: the bounds, the body decoding and the sampling fields every
dialect shares (the conversation: daemon/http/core/conversation.py).
Unknown top-level fields are accepted and ignored (clients send extras), and
named in one warning line per request (`request.ignored_fields`, as vLLM logs
them: a misspelt `max_token` is seen in the log); OpenAI fields Dormouse
cannot honour are refused by name. `null` on a field
that may be left out means "left out" (OpenAI's semantics, which clients rely
on: the openai SDK and LangChain send explicit nulls): every model here is a
RequestModel.

Bounds: every integer that reaches llama.cpp fits its int32 (ctypes wraps
silently), and every container a client sizes is counted before pydantic
validates its items, so an 8 MiB body of tiny items is refused at the cost
of a len(), not of a validator per item.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationInfo, field_validator, model_validator

from config.sampling import (SAMPLING_KEYS, MinP, Penalty, RepeatLastN, RepeatPenalty, Temperature, TopK,
                             TopP)
from daemon import protocol as p
from daemon.logs import get_logger

INT32_MAX = 2**31 - 1
MAX_STOPS = 16
MAX_STOP_CHARS = 512  # the worker matches every stop against held-back text per token
MAX_LOGIT_BIAS = 1024
MAX_BIAS_TEXT_CHARS = 256  # a logit_bias key that is text (llama-server's): the worker tokenizes it
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024  # per message
MAX_PROMPT_TOKENS = 1_048_576  # token ids in one prompt when no ctx_size is given
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # in one assistant message sent back
MAX_TOP_LOGPROBS = 20  # as OpenAI's
MAX_CHOICES = 16  # n; also bounded by the model's slots
MAX_TEMPLATE_KWARGS = 64  # chat_template_kwargs entries
MAX_TEMPLATE_KWARG_BYTES = 16384  # one value, as JSON
MAX_TEMPLATE_KWARG_DEPTH = 16
# Template variables the server sets itself (daemon/worker/chat.py RESERVED_VARIABLES).
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})

# The constraints in the types document the bounds (OpenAPI); the "before"
# validators below enforce them first, with messages that name the limit.
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
MAX_CACHE_SALT_CHARS = 1024
# vLLM's cache_salt: the prompt cache shares entries only between requests with the same salt (and the same
# named key). A non-empty string, as vLLM takes it; every dialect whose body has it validates it with this.
CacheSalt = Annotated[StrictStr, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS,
                                       description="prompt-cache isolation: only requests with the same salt (and "
                                                   "the same key) share cached prompts (vLLM's field)")]


def _at_most(value: Any, limit: int, what: str) -> Any:
    """Refuse a list or object longer than `limit` before its items are validated."""
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise ValueError(f"at most {limit} {what}, got {len(value)}")
    return value


def _json_within(value: Any, budget: int, depth: int) -> int:
    """What is left of `budget` bytes once `value` is written as JSON (roughly:
    separators counted once); negative once over, which stops the walk early.
    ValueError when nested deeper than `depth`."""
    if depth < 0:
        raise ValueError("nested too deeply")
    if isinstance(value, dict):
        budget -= 2
        for key, item in value.items():
            budget = _json_within(item, budget - len(str(key)) - 4, depth - 1)
            if budget < 0:
                break
        return budget
    if isinstance(value, list):
        budget -= 2
        for item in value:
            budget = _json_within(item, budget - 1, depth - 1)
            if budget < 0:
                break
        return budget
    return budget - len(msgspec.json.encode(value))


class BodyError(ValueError):
    """A field refused before it is decoded; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@cache
def _envelope(model: type[BaseModel], strict: bool = False) -> msgspec.json.Decoder:
    # The model's fields as undecoded JSON: the decoder skips every other key
    # without building it (an 8 MiB object of unknown keys costs a scan).
    # strict: stops at the first unknown key instead, its name in the error.
    fields = [(name, msgspec.Raw, msgspec.Raw()) for name in model.model_fields]
    return msgspec.json.Decoder(msgspec.defstruct(f"{model.__name__}Envelope", fields, forbid_unknown_fields=strict))


MAX_IGNORED_NAMES = 10  # named in the warning; more are "and more"
MAX_IGNORED_NAME_CHARS = 64  # each name as logged
_UNKNOWN_FIELD = "Object contains unknown field `"  # msgspec's message for a key a strict struct lacks
_UNRENAMABLE = re.compile(r'[\\"\x00-\x1f]')  # what msgspec refuses in a renamed field's name
_log = get_logger()


def ignored_fields(raw: bytes, model: type[BaseModel]) -> tuple[list[str], bool]:
    """The first MAX_IGNORED_NAMES top-level keys of the body that `model`
    does not know, in body order, and whether there are more. Each strict
    decode stops at the next unknown key (msgspec names it), so a body costs
    at most MAX_IGNORED_NAMES + 1 scans of its top level, whatever its number
    of keys (more: the list stopped before the body's end): decoding all keys to learn their names took 0.46 s for 9 MB of
    tiny ones, on the event loop. A body with no unknown key costs one scan."""
    names: list[str] = []
    decoder = _envelope(model, strict=True)
    while True:
        try:
            decoder.decode(raw)
            return names, False
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            message = str(exc)
            if not (isinstance(exc, msgspec.ValidationError) and message.startswith(_UNKNOWN_FIELD)
                    and message.endswith("`")):
                return names, False  # not an object, or not JSON: decode_body's own decode says so
        if len(names) == MAX_IGNORED_NAMES:
            return names, True
        names.append(message[len(_UNKNOWN_FIELD):-1])
        if _UNRENAMABLE.search(names[-1]):  # msgspec cannot match such a key by name: the list stops at it
            return names, True
        # The same fields plus the names found so far (under Python-safe attribute names), so the next
        # decode stops at the next unknown key.
        fields = [(name, msgspec.Raw, msgspec.Raw()) for name in model.model_fields]
        fields += [(f"ignored_{i}", msgspec.Raw, msgspec.Raw()) for i in range(len(names))]
        decoder = msgspec.json.Decoder(msgspec.defstruct(
            "IgnoredEnvelope", fields, forbid_unknown_fields=True,
            rename={f"ignored_{i}": name for i, name in enumerate(names)}))


def _warn_ignored(raw: bytes, model: type[BaseModel]) -> None:
    names, more = ignored_fields(raw, model)
    if names:  # one bounded line per request: a body of 10,000 unknown keys logs ten names
        _log.warning("request.ignored_fields", body=model.__name__, more=more,
                     fields=[name if len(name) <= MAX_IGNORED_NAME_CHARS else name[:MAX_IGNORED_NAME_CHARS] + "..."
                             for name in names])


def decode_body(raw: bytes, model: type[BaseModel], max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> dict[str, Any]:
    """The fields of a JSON object body that `model` knows, decoded; unknown
    top-level fields are accepted and ignored (clients send extras), and the
    first of them named in one warning line (vLLM's convention). Raises
    msgspec.ValidationError for a body that is not an object,
    msgspec.DecodeError for one that is not JSON, RecursionError for one nested
    too deeply, BodyError for a field refused by its size alone."""
    try:
        envelope = _envelope(model, strict=True).decode(raw)  # no unknown key: one scan, as before
    except msgspec.ValidationError as exc:
        if not str(exc).startswith(_UNKNOWN_FIELD):
            raise
        envelope = _envelope(model).decode(raw)  # raises for a body that is not JSON past that key
        _warn_ignored(raw, model)
    out = {}
    for name in model.model_fields:
        value = getattr(envelope, name)
        if not len(value):
            continue  # absent
        if name == "logit_bias":
            _logit_bias_bound(bytes(value))
        elif name in ("prompt", "tokens", "input"):
            _token_list_bound(bytes(value), max_prompt_tokens, name)
        out[name] = msgspec.json.decode(value)
    return out


# Two fields whose valid values have one separator per item outside any
# string, so counting bytes bounds them before millions of objects are built.
# A count that a string inflates belongs to a value that is invalid anyway.

def _logit_bias_bound(raw: bytes) -> None:
    # An object has one colon per entry, a list of pairs one "[" per pair (and
    # one around them). Text keys may hold either character, so the count is
    # only trusted far past the limit: up to 16x is decoded and counted exactly.
    head = raw.lstrip()[:1]
    entries = raw.count(b":") if head == b"{" else raw.count(b"[") - 1 if head == b"[" else 0
    if entries > 16 * MAX_LOGIT_BIAS:
        raise BodyError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries (token id or text: bias), got {entries}",
                        "logit_bias")


def _token_list_bound(raw: bytes, limit: int, name: str = "prompt") -> None:
    head = raw.lstrip()
    first = head[1:].lstrip()[:1]
    if head.startswith(b"[") and first and first in b"-0123456789":  # token ids, not a list of one string
        items = raw.count(b",") + 1
        if items > limit:
            raise BodyError(f"{name}: at most {limit} {name} token ids (ctx_size), got {items}", name)


_SIGNED_NUMBER = re.compile(r"[+-][0-9]+")


def _bias_key(key: str) -> bool:
    """Whether an object key of logit_bias is a token id (True) or text (False); raises for one that is neither."""
    if key.isascii() and key.isdigit():  # ASCII: str.isdigit() alone also takes '²' and other scripts' digits
        if len(key) > 10 or int(key) > INT32_MAX:
            raise ValueError(f"logit_bias keys that are numbers are token ids (0..{INT32_MAX}), got {key[:32]!r}")
        return True
    if key.isdigit() or _SIGNED_NUMBER.fullmatch(key):  # a number, but not a token id: neither id nor text
        raise ValueError(f"logit_bias key {key[:32]!r}: token ids are written in ASCII digits (0..{INT32_MAX}); "
                         "other keys are text")
    if not 1 <= len(key) <= MAX_BIAS_TEXT_CHARS:
        raise ValueError(f"logit_bias text keys have 1 to {MAX_BIAS_TEXT_CHARS} characters, got {len(key)}")
    return False


class RequestModel(BaseModel):
    """A request object whose optional fields take null as "not given"."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        # Only optional fields: a null required one is still refused by its type.
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}


class StreamOptions(RequestModel):
    include_usage: bool = False


# The sampling fields a request may leave to the server's settings (llama-server's --temp, --top-k, ...: same names;
# n_predict is the token limit each route reads on its own).
SERVER_DEFAULTED = tuple(name for name in SAMPLING_KEYS if name != "n_predict")


class SamplingFields(RequestModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: Temperature = 0.8  # the bounds the server's defaults have (config/sampling.py)
    top_p: TopP = 0.95
    top_k: TopK = 40
    min_p: MinP = 0.05
    seed: int | None = Field(None, ge=-1, le=2**63 - 1, description="-1: a random seed")
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repeat_penalty: RepeatPenalty = 1.0
    repeat_last_n: RepeatLastN = Field(64, description="the last tokens, prompt then answer, the penalties count; -1: the slot's context")
    logit_bias: (Annotated[dict[str, float | Literal[False]], Field(max_length=MAX_LOGIT_BIAS)]
                 | Annotated[list[tuple[TokenId | Annotated[str, Field(min_length=1, max_length=MAX_BIAS_TEXT_CHARS)],
                                        float | Literal[False]]], Field(max_length=MAX_LOGIT_BIAS)]
                 | None) = Field(None, description="token id (or a text: each of its tokens) -> bias in "
                                                   "[-100, 100], or false to ban it; an object or a list of pairs")
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices from one prompt; at most the model's slots")
    user: str | None = None
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name", "schema", "strict"}}: enforced by a grammar on the sampler')
    json_schema: dict[str, Any] | None = Field(None, description="the output matches this JSON schema")
    grammar: str | None = Field(None, description="a GBNF grammar (root rule `root`) the output matches")
    cache_salt: CacheSalt | None = None
    # llama-server's stream telemetry (a stream's chunks; a whole answer has its timings anyway)
    return_progress: StrictBool = Field(False, description="stream: a chunk with prompt_progress {total, cache, "
                                        "processed, time_ms} as the prompt's read begins and after each chunk of it")
    timings_per_token: StrictBool = Field(False, description="stream: llama.cpp's timings block on every chunk, not "
                                          "only on the last")

    @property
    def wants_progress(self) -> bool:
        return self.stream and self.return_progress

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_bounds(cls, value: Any) -> Any:
        _at_most(value, MAX_STOPS, "stop strings")
        for stop in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
            if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(stop)}")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_size(cls, value: Any) -> Any:
        _at_most(value, MAX_LOGIT_BIAS, "logit_bias entries")
        pairs = value.items() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for pair in pairs:
            if isinstance(value, list) and not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError("logit_bias as a list holds [token id or text, bias] pairs")
            key, bias = pair
            if isinstance(key, bool) or isinstance(bias, bool) and bias:
                raise ValueError(f"logit_bias for {key!r}: a bias is a number in [-100, 100], or false to ban")
            if isinstance(value, dict):
                _bias_key(key)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: Any) -> Any:
        for key, bias in value.items() if isinstance(value, dict) else value or ():
            if bias is not False and not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias for {str(key)[:32]!r} must be within [-100, 100] (or false to ban)")
        return value

    def logit_biases(self) -> tuple[dict[int, float], list[tuple[str, float]]]:
        """(token id -> bias, [(text, bias)]) as llama-server reads logit_bias:
        an object's keys that are numbers are token ids, other keys are text;
        a list's pairs are [id, bias] or [text, bias]; false bans (-inf)."""
        ids: dict[int, float] = {}
        texts: list[tuple[str, float]] = []
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        for key, bias in pairs:
            value = float("-inf") if bias is False else float(bias)
            if isinstance(key, int) or (isinstance(self.logit_bias, dict) and _bias_key(key)):
                token = int(key)
                ids[token] = ids.get(token, 0.0) + value  # as llama.cpp, which applies every entry
            else:
                texts.append((key, value))
        return ids, texts

    def sampling(self, max_tokens: int, grammar: str | None = None, logprobs: int | None = None,
                 defaults: Any = None) -> p.SamplingParams:
        """defaults: the server's sampling defaults (the settings of SERVER_DEFAULTED's names), for the fields
        this request left out (pydantic's defaults are static; model_fields_set says what was sent)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        biases = self.logit_biases()
        sent = self.model_fields_set
        value = {name: getattr(self if defaults is None or name in sent else defaults, name)
                 for name in SERVER_DEFAULTED}
        seed = value.pop("seed")
        return p.SamplingParams(
            max_tokens=max_tokens,
            seed=None if seed is None or seed < 0 else seed,
            **value,
            logit_bias=biases[0],
            logit_bias_text=biases[1],
            stop=stop,
            ignore_eos=self.ignore_eos,
            grammar=grammar,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int = Field(256, ge=1, le=1_000_000)
    echo: Literal[False] = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="the chosen token's log-probability and this many most likely ones")
    best_of: Literal[1] | None = None
    suffix: str | None = Field(None, description="fill in the middle: the text after the gap, the prompt being the "
                                                 "text before it (a model with FIM tokens; worker/fim.py)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_size(cls, value: Any, info: ValidationInfo) -> Any:
        # No slot holds more than the whole context (the HTTP layer passes ctx_size).
        limit = (info.context or {}).get("max_prompt_tokens", MAX_PROMPT_TOKENS)
        return _at_most(value, limit, "prompt token ids (ctx_size)")

    @field_validator("suffix")
    @classmethod
    def _suffix_needs_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        prompt = info.data.get("prompt")
        if value is not None and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            raise ValueError("suffix fills in after a text prompt (the text before the gap), not token ids")
        return value

    def prompt_value(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


# What pydantic puts in an error's location besides field names and indexes:
# the member of a union that failed ('str', 'list[constrained-int]',
# "literal['none','auto']", 'function-after[...]', a model's class name).
_UNION_MEMBER = re.compile(r"[a-z][a-z-]*\[.*\]|constrained-[a-z-]+|str|int|float|bool|bytes|none|dict|list"
                           r"|[A-Z][A-Za-z0-9]*", re.DOTALL)


def field_name(loc: tuple[Any, ...]) -> str:
    """'messages.0.content' from pydantic's error location: every part but the
    labels of union members (matched whole: 'stream' and 'strict' are fields)."""
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and _UNION_MEMBER.fullmatch(part)))


MAX_EMBEDDING_INPUTS = 256


def _prompt_limit(value: Any, info: ValidationInfo, what: str) -> Any:
    return _at_most(value, (info.context or {}).get("max_prompt_tokens", MAX_PROMPT_TOKENS), what)
