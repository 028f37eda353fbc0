"""The worker protocol, defined once and imported by both sides.

Messages are msgspec Structs, tagged by type, sent over a socketpair as a
4-byte big-endian length followed by a msgpack body. (Not stdin/stdout:
llama.cpp writes to fds 1 and 2.)

Daemon -> worker: Load, Submit, Cancel, Ping, Sleep, Query.
Worker -> daemon: Hello, LoadProgress, Ready, Tokens, Done, SlotStates, Pong,
SleepReport, Error, Answer.

Submit starts a generation (answered by Tokens then one Done); Query asks for
work that is one step long and needs the loaded model's vocabulary, template
or embeddings context (tokenize, detokenize, apply_template, embed), answered
by one Answer.

Ping/Pong is the liveness check: a serving worker answers at once (its channel
thread, mid-step too) and says how long its current step has run, so a worker
that stops answering (SIGSTOPped, deadlocked) or whose step never ends (hung in
a kernel) is noticed and killed instead of holding its requests forever.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

PROTOCOL_VERSION = 3
HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class Message(msgspec.Struct, tag=True, forbid_unknown_fields=False, omit_defaults=True):
    pass


# -- daemon -> worker --------------------------------------------------------


# Verification decodes at most this many tokens at once: llama.cpp's CPU
# kernels for up to 4 tokens give the same logits as decoding one by one,
# so greedy output with a draft is token for token the output without.
VERIFY_GROUP = 4


class ModelSpec(msgspec.Struct, omit_defaults=True):
    model: str
    model_draft: str | None = None
    mmproj: str | None = None
    ctx_size: int = 4096
    parallel: int = 4
    threads: int | None = None
    n_gpu_layers: int = 0
    batch_size: int = 512
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = {}  # the server's template variables; a request's own win over them
    draft_max: int = 16
    draft_min: int = 0
    draft_p_min: float = 0.75
    warmup: bool = True
    cpu_repack: bool = False
    load_mode: str = "auto"  # auto, mmap, none, mlock, mmap+mlock, direct_io: llama.cpp's llama_load_mode
    seed: int = -1
    kv_dir: str | None = None  # where this model's prompt caches are saved at sleep; None: not saved
    kv_min_tokens: int = 256  # shorter prefixes are not worth a file
    kv_disk_bytes: int = 0  # the files' budget; least recently used go first
    kv_shared_dir: str | None = None  # shared_cache_dir: a disk tier several replicas share (worker/shared_tier.py)
    prompt_cache_ram_bytes: int = 0  # the host-RAM tier of the prompt cache (worker/prompt_cache.py); 0: off
    slot_dir: str | None = None  # POST /slots/{id}?action=save|restore: the named files' directory; None: off
    embeddings: bool = False  # an embeddings model: a pooled context, no generation
    pooling: str = "mean"  # none (a vector per token), mean, cls, last, or rank (a reranker's head) (with embeddings)
    cache_deterministic: bool = False  # True: reuse whole prompt chunks only, the same greedy answer as a fresh read
    kv_unified: bool = False  # True: the slots share one KV pool of ctx_size cells (llama.cpp's kv_unified)
    # A model with sliding-window layers keeps checkpoints of its window (worker/kv_cache.take_checkpoint)
    # at each prompt's end, each turn boundary and every this many prompt tokens (at a chunk's end); 0: not every N.
    cache_checkpoint_every: int = 1024
    # llama.cpp context/model params by field name (config/llama_options.py checked them), for the main model.
    llama_options: dict[str, bool | int | float] = {}

    # What one llama_decode may carry, shared by the worker (which sizes its
    # context with it) and the daemon's footprint prediction (which must match).

    def step_capacity(self) -> int:
        """Tokens in one decode: a prompt chunk (batch_size), one token per
        generating slot, or a verification group; so --parallel 8
        --batch-size 4 works."""
        return max(self.batch_size, self.parallel, VERIFY_GROUP if self.model_draft else 1)

    def outputs_max(self) -> int:
        """Logit rows one decode may ask for: one per generating slot, or one
        per token of a verification group. llama.cpp reserves a vocabulary-wide
        row for each (514 MiB of compute buffer for Gemma 3 if left at the
        batch size; 69 instead of 20 MiB when this was parallel x (draft_max+1))."""
        return max(self.parallel, VERIFY_GROUP) if self.model_draft else self.parallel


class Load(Message):
    spec: ModelSpec


class SamplingParams(msgspec.Struct, omit_defaults=True):
    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    stop: list[str] = []
    ignore_eos: bool = False
    grammar: str | None = None  # llguidance grammar the output must match; daemon/grammar builds and checks it
    logprobs: int | None = None  # None: none; 0: the chosen token's; K: and the K most likely
    # llama-server's text keys of logit_bias: the worker tokenizes each text (no special tokens) and biases its tokens.
    logit_bias_text: list[tuple[str, float]] = []
    post_sampling_probs: bool = False  # logprobs under the sampler chain's distribution, not the model's own


class ChatPart(msgspec.Struct, omit_defaults=True):
    type: str  # "text" or "image"
    text: str | None = None
    image: bytes | None = None  # raw image file bytes (png, jpeg, ...)


class ToolCall(msgspec.Struct, omit_defaults=True):
    """A call the assistant made, as OpenAI's message.tool_calls carries it."""

    id: str
    name: str
    arguments: str  # JSON text, as the client sent it back


class Tool(msgspec.Struct, omit_defaults=True):
    """A function the model may call (OpenAI's tools[].function)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {}  # JSON schema of the arguments


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str  # system, user, assistant, tool
    content: str | list[ChatPart] = ""
    tool_calls: list[ToolCall] = []  # assistant
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None  # tool: the function's name
    reasoning_content: str | None = None  # assistant: its thinking, given to templates that read it


class Infill(msgspec.Struct, omit_defaults=True):
    """Fill-in-the-middle (llama-server's /infill, `suffix` on /v1/completions):
    the worker builds the prompt from the model's FIM tokens (worker/fim.py)."""

    prefix: str = ""  # the text before the gap
    suffix: str = ""  # the text after it
    extra: list[tuple[str, str]] = []  # (filename, text): other files, put before the prefix as repository context
    prompt: str = ""  # what is already typed in the gap (llama-server's `prompt`), after the prefix


class Submit(Message):
    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None  # completions
    # completions: images for the media markers of the prompt text, in order (llama-server's multimodal_data)
    images: list[bytes] = []
    messages: list[ChatMessage] | None = None  # chat completions
    tools: list[Tool] = []  # chat: given to the chat template (or described in a system turn)
    n: int = 1  # choices: the prompt is decoded once and its KV copied to n - 1 more slots
    cache_prompt: bool = True  # False: read the whole prompt, keep nothing cached (llama-server's cache_prompt)
    infill: Infill | None = None  # set: a fill-in-the-middle prompt (prompt and messages are None)
    # chat: template variables (llama-server's chat_template_kwargs, e.g. enable_thinking), and how the prompt ends:
    # with the assistant's turn opened (add_generation_prompt), or the last (assistant) message continued.
    chat_template_kwargs: dict[str, Any] = {}
    add_generation_prompt: bool = True
    continue_final: bool = False
    # Who may share this request's prompt cache: the named key that sent it and its cache_salt
    # (daemon/model/jobs.py request_cache_scope). An entry is restored, and counted as cached,
    # only for a request of the same scope; "" is the scope of requests with neither.
    cache_scope: str = ""
    # llama-server's id_slot: the slot this request must run in (it waits for that slot, first in, first
    # served); -1: the engine chooses (the best cache match).
    slot: int = -1
    # llama-server's return_progress: a PromptProgress when the prompt's read begins and after each chunk of it.
    progress: bool = False


class Cancel(Message):
    request_id: str


class Ping(Message):
    seq: int


class Sleep(Message):
    """Tear everything down in order, send a SleepReport, exit."""


class Doze(Message):
    """The drowsy tier: save the prompt caches (as a sleep does), free the contexts and
    the engine, keep the model, draft model and projector. Answered by DozeReport."""


class Rouse(Message):
    """Create the contexts again after a Doze. Answered by Ready (or Error, then the worker exits)."""


class Query(Message):
    """One-step work on the loaded model, answered by an Answer with the same id.
    kind and args:
      tokenize        text: str, add_special: bool, with_pieces: bool
      detokenize      tokens: list[int]
      apply_template  messages: list[ChatMessage], tools: list[Tool]
      render_chat     as apply_template, images allowed (their markers in the text): a chat request's own prompt
      count_chat      messages, tools: Answer.prompt_tokens is what a chat request with them reads (images included)
      embed           inputs: list[str | list[int]]; truncate: a text input longer than the limit is cut at its end
      rerank          text: the query, inputs: the documents (a model loaded with pooling = "rank")
      slot_save, slot_restore, slot_erase
                      tokens: [slot id], text: the file name; Answer.tokens = [tokens moved, bytes written or read]
    """

    request_id: str
    kind: str
    text: str = ""
    add_special: bool = False
    with_pieces: bool = False
    tokens: list[int] = []
    messages: list[ChatMessage] = []
    tools: list[Tool] = []
    inputs: list[str | list[int]] = []
    truncate: bool = False  # embed: cut each text input to the limit at its end, not refuse it (Ollama's truncate)
    chat_template_kwargs: dict[str, Any] = {}  # apply_template, count_chat: as Submit's
    add_generation_prompt: bool = True
    continue_final: bool = False
    cache_scope: str = ""  # the caller's prompt-cache scope (as Submit's): slot_save and slot_restore honour it


# -- worker -> daemon --------------------------------------------------------


class Hello(Message):
    pid: int
    protocol: int = PROTOCOL_VERSION
    import_seconds: float = 0.0


class Phase(msgspec.Struct):
    name: str
    seconds: float
    bytes: int = 0  # memory the component holds (load) or gave back (teardown)
    skipped: bool = False  # the component was not configured


class LoadProgress(Message):
    phase: str
    seconds: float


class Ready(Message):
    n_slots: int
    n_ctx: int
    n_ctx_slot: int
    phases: list[Phase]
    model_info: dict[str, Any] = {}
    memory: dict[str, int] = {}  # component -> bytes
    kv_rejected: dict[str, int] = {}  # saved prompt caches deleted at load, by reason


class TopLogprob(msgspec.Struct, array_like=True):
    token: int
    piece: bytes  # the token's bytes (a piece may be part of a UTF-8 character)
    logprob: float


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token: its log-probability under the model's own
    distribution (before temperature and the sampler chain), and the most
    likely alternatives at that position. With
    SamplingParams.post_sampling_probs: under the distribution the sampler
    chain drew from (llama-server's post_sampling_probs)."""

    token: int
    piece: bytes
    logprob: float
    top: list[TopLogprob] = []


class Tokens(Message):
    request_id: str
    text: str
    n_tokens: int
    n_prompt_tokens: int = 0  # set on the first Tokens of a request
    n_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = []  # the tokens generated since the last Tokens (SamplingParams.logprobs)
    index: int = 0  # the choice (Submit.n)
    finish_reason: str | None = None  # with n > 1: this choice's last Tokens (stop, length); Done ends the request
    reasoning_open: bool = False  # a choice's first Tokens: the chat prompt ended inside a thinking block
    # The worker's clock so far (llama-server's timings_per_token): the prompt's read (to the first token), and
    # the generation since the first token.
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0


class PromptProgress(Message):
    """How far a request's prompt has been read (Submit.progress): sent as its read begins (processed ==
    cache), then after each chunk (the last: processed == total). seconds: since the request took its slot."""

    request_id: str
    total: int
    cache: int
    processed: int
    seconds: float = 0.0


class Done(Message):
    """The end of a request (of all its choices): one per Submit."""

    request_id: str
    finish_reason: str  # stop, length, cancelled, error (with n > 1: each choice's is on its last Tokens)
    prompt_tokens: int = 0
    completion_tokens: int = 0  # all choices together
    cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None  # e.g. context_length_exceeded, invalid_request
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    restored_tokens: int = 0  # of cached_tokens, restored from a prompt cache saved at a sleep
    restore_seconds: float = 0.0
    kv_lookup: str = ""  # "hit", "miss" (a saved cache was looked for, none fitted), "" (not looked)
    kv_rejected: str | None = None  # a saved file failed its checks at restore (deleted): why
    stopping_word: str = ""  # the stop string that ended the answer (finish_reason stop); "": none did
    cache_tier: str = ""  # where cached_tokens came from: "slot", "ram", "disk"; "": none
    prompt_cache: dict[str, dict[str, Any]] = {}  # the tiers after this request (PromptCache.summary)


class SlotInfo(msgspec.Struct):
    id: int
    state: str
    request_id: str | None = None
    n_cached: int = 0


class SlotStates(Message):
    slots: list[SlotInfo]
    # The engine's work since its last SlotStates (llama-server's decode counters): llama_decode calls of the
    # model, the busy slots summed over them, speculative verification steps; and the longest sequence held.
    decodes: int = 0
    busy_slot_decodes: int = 0
    draft_rounds: int = 0
    tokens_max: int = 0


class Pong(Message):
    seq: int
    # How long the worker's decode loop has been inside its current step (0: between steps).
    # The channel thread answers at once, mid-step: a step older than worker_liveness_timeout
    # is a stuck worker (daemon/model/supervisor.py), however many pings it still answers.
    step_seconds: float = 0.0


class SleepReport(Message):
    phases: list[Phase]
    rss_before: int = 0
    rss_after: int = 0
    devices_before: list[dict[str, Any]] = []  # ggml device free/total before the teardown
    devices_after: list[dict[str, Any]] = []  # ... and before llama_backend_free
    kv_saved_files: int = 0  # prompt caches written before the teardown (phase kv_save has the bytes)
    kv_save_errors: int = 0


class DozeReport(Message):
    phases: list[Phase]  # kv_save (if any), draft_context, context: each timed, with the bytes it freed
    rss_before: int = 0
    rss_after: int = 0
    kv_saved_files: int = 0
    kv_save_errors: int = 0


class Answer(Message):
    """The answer to a Query. error set: the query was refused (error_code says why)."""

    request_id: str
    tokens: list[int] = []  # tokenize
    pieces: list[bytes] = []  # tokenize with_pieces
    text: str = ""  # detokenize, apply_template
    embeddings: list[list[float]] = []  # embed, in input order, normalized; rerank: each document's classifier outputs (the first is its score)
    token_embeddings: list[list[list[float]]] = []  # embed with pooling none: per input, each token's vector, as computed
    prompt_tokens: int = 0  # embed: tokens read; count_chat: tokens the chat prompt takes
    error: str | None = None
    error_code: str | None = None


class Error(Message):
    """A fatal error in the worker (it exits after sending it)."""

    message: str
    during: str = ""
    code: str | None = None  # why, for the daemon to act on: "chat_template" (loading again cannot help)


def engine_modules(embeddings: bool, draft: bool, mmproj: bool) -> tuple[str, ...]:
    """The daemon.worker modules an engine imports when it starts (the prompt cache's numpy, the
    speculator, the projector's bindings), for a model with or without embeddings, a draft and a
    projector: a worker imports them beside the load, or before Hello when spawned with `--import`
    for a model whose wake should be fast (the light tier)."""
    return tuple(name for name, needed in (("prompt_cache", not embeddings), ("speculative", draft),
                                          ("multimodal", mmproj)) if needed)


ENGINE_MODULES = ("prompt_cache", "speculative", "multimodal")  # what `--import` may name


ToWorker = Load | Submit | Cancel | Ping | Sleep | Query | Doze | Rouse
ToDaemon = Hello | LoadProgress | Ready | Tokens | PromptProgress | Done | SlotStates | Pong | SleepReport | Error | Answer | DozeReport

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_to_daemon = msgspec.msgpack.Decoder(ToDaemon)


def encode(message: Message) -> bytes:
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def decode_for_worker(body: bytes) -> ToWorker:
    return _to_worker.decode(body)


def decode_for_daemon(body: bytes) -> ToDaemon:
    return _to_daemon.decode(body)


class FrameTooLarge(ValueError):
    pass


def check_length(n: int) -> int:
    if n > MAX_MESSAGE_BYTES:
        raise FrameTooLarge(f"frame of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
    return n
