"""The settings schema and how its layers are put together.

Precedence, lowest first: defaults, the TOML file (--config, DORMOUSE_CONFIG,
or the first of the default paths that exists: config/sources.py),
DORMOUSE_* environment variables, command-line flags. An error names the key
and the layer it came from.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

ENV_PREFIX = "DORMOUSE_"
MAX_NAMED_KEYS = 256
KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

from config.models_dir import with_models_dir  # noqa: E402
from config.network import MAX_HOSTS, admin_key_problem, host_list, is_loopback_host, normalize_host, normalize_origin  # noqa: E402,F401
from config.models import (MAX_TAGS, MODEL_ID, ModelSettings, check_chat_template, check_model_ids, check_tags,  # noqa: E402
                           parse_size)
from config.sources import find_config_file  # noqa: E402
from config.sampling import (MinP, NPredict, Penalty, RepeatLastN, RepeatPenalty, Seed, Temperature,  # noqa: E402
                             TopK, TopP)
from config.llama_options import LlamaOptions  # noqa: E402
from config.template_kwargs import check_template_kwargs  # noqa: E402
from config.host_tools import (CORS_PROXY_DOC, MCP_SERVERS_DOC, TOOLS_DOC, TOOLS_RUNTIME_DOC, McpServer,  # noqa: E402
                               check_host_tools, mcp_servers_json)


class ConfigError(ValueError):
    """Bad configuration; the message names the key and where it came from."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # -- network --
    host: str = Field("127.0.0.1", max_length=1024, description="address to bind, or several separated by commas "
                      "(127.0.0.1,::1); any but a loopback address (127.0.0.0/8, ::1, localhost) requires admin_key, "
                      "and so does a socket that systemd passes")
    port: int = Field(8080, ge=0, le=65535, description="TCP port to serve on (with --host)")

    # -- model --
    model: Path | None = Field(None, description="GGUF file; empty means the bundled Gemma 3 270M")
    hf_repo: str | None = Field(None, max_length=256, description="a Hugging Face repository to take the model from, "
                                "owner/name[:QUANT] (llama-server's -hf): the quant tag picks the .gguf whose name "
                                "holds it; none: Q4_K_M, else the first; a projector (mmproj) comes along. Downloaded "
                                "at start into state_dir/models (huggingface_hub's cache layout; HF_HUB_CACHE or "
                                "HF_HOME, when set, names another cache), or found there (`dormouse pull` fetches "
                                "ahead); HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE apply. Not with `model`")
    hf_file: str | None = Field(None, max_length=1024, description="with hf_repo: this .gguf of the repository "
                                "rather than the one the quant tag picks (llama-server's --hf-file)")
    model_draft: Path | None = Field(None, description="draft model for speculative decoding")
    mmproj: Path | None = Field(None, description="multimodal projector GGUF")
    ctx_size: int = Field(4096, ge=64, description="total context, shared by the slots")
    parallel: int = Field(4, ge=1, le=256, description="slots: requests served at once, each with ctx_size / parallel tokens of context")
    kv_unified: bool = Field(
        False, description="true: the slots share one KV pool of ctx_size tokens (llama-server's -kvu), so one "
                           "conversation may grow to ctx_size while the others are short; when the pool is full, "
                           "idle slots' prompts leave it (for the prompt cache's RAM or disk tier, when on), then "
                           "the request that started last ends (503 context_full) so the others finish. Not with "
                           "cache_deterministic. false: each slot has its own ctx_size / parallel")
    threads: int | None = Field(None, ge=1, description="CPU threads; default: all cores")
    n_gpu_layers: int = Field(-1, ge=-1, description="layers on the GPU; -1 all")
    batch_size: int = Field(512, ge=1, description="tokens per decode step (llama.cpp's n_batch): larger reads long prompts faster and takes more compute memory")
    chat_template_file: Path | None = Field(None, description="Jinja chat template overriding the GGUF's")
    chat_template_kwargs: dict[str, Any] = Field(
        {}, description="template variables every chat prompt gets unless the request's chat_template_kwargs give "
                        "their own (llama-server's --chat-template-kwargs; --reasoning off: enable_thinking = false)")
    chat_template: str | None = Field(None, description="chat template overriding the GGUF's: Jinja text, or one of "
                                      "llama.cpp's built-in names (chatml, llama3, gemma, mistral-v7, phi3, ...); "
                                      "chat_template_file comes first")
    draft_max: int = Field(16, ge=1, description="with model_draft: most tokens the draft model proposes per step")
    draft_min: int = Field(0, ge=0, description="with model_draft: fewest drafted tokens worth verifying; fewer are dropped")
    draft_p_min: float = Field(0.75, ge=0.0, le=1.0,
                               description="with model_draft: drafting stops at a token the draft model gives less than this probability")
    cpu_repack: bool = Field(False, description="repacked CPU weights: batch-size-dependent kernels, so outputs depend on batching")
    warmup: bool = Field(True, description="one decode after a load at start or by POST /wake (a wake for a request skips it: the request warms up)")
    embeddings: bool = Field(False, description="serve /v1/embeddings from this model (a pooled context; it then generates no text)")
    pooling: Literal["none", "mean", "cls", "last", "rank"] = Field("mean", description="how an embeddings model pools its token vectors; rank: a reranker's classifier head scores query and document (/v1/rerank); none: one vector per token, answered by llama-server's /embeddings only (OpenAI's and Ollama's routes answer one vector per input)")
    llama_options: LlamaOptions = Field(
        default_factory=dict, description="llama.cpp's own tuning knobs by llama_context_params / llama_model_params "
        "field name (flash_attn_type, n_ubatch, type_k, rope_freq_base, split_mode, ...: config/llama_options.py), "
        "set on the main model; llama-server's -fa, -ub, -ctk, --rope-*, -sm arrive here")

    # -- sleep --
    sleep_idle_seconds: float = Field(300, description="sleep after this many idle seconds; -1 never")
    drowsy_after: float = Field(-1, description="the drowsy tier: after this many idle seconds the worker frees its "
                                "contexts (KV cache, compute buffers) and keeps the weights, so a wake is a context "
                                "creation (on a GPU the weights stay there: for short pauses); -1 off")
    deep_after: float = Field(0, description="the light tier: a sleep leaves the GGUF warm in the page cache (the "
                              "daemon keeps it, the worker is gone) for this many seconds, then nothing is held; "
                              "0: no light tier, a sleep holds nothing at once (as before); -1: light until woken")
    keeper_mlock_bytes: int = Field(0, description="bytes of a light model's files locked in RAM by the keeper (an int "
                                    "or '8GiB'; needs RLIMIT_MEMLOCK or CAP_IPC_LOCK); 0: advised, not locked")
    keeper_refresh_seconds: float = Field(30, gt=0, le=86400, description="how often the keeper reads back pages the "
                                          "kernel reclaimed from a light model's files")
    load_mode: Literal["auto", "mmap", "none", "mlock", "mmap+mlock", "direct_io"] = Field(
        "auto", description="how the worker reads the weights (llama.cpp's load mode); auto: mmap where every "
                            "device supports it (measured fastest on CPU, bench/wake_tiers.py)")
    spawn_ahead: bool = Field(True, description="start the next worker (imports only) as soon as one exits")
    wake_timeout: float = Field(120, gt=0, description="how long a request waits for a wake before 503")
    load_timeout: float = Field(600, gt=0, description="how long a load may take before it is failed")
    max_queued: int = Field(128, ge=0, description="requests accepted beyond the slots or during a wake")
    retry_max_seconds: float = Field(60, gt=0, description="cap on the backoff between failed loads")
    early_crash_seconds: float = Field(30, ge=0, description="a worker that crashes this soon after a load counts as a failed load (backoff, then failed)")
    worker_liveness_timeout: float = Field(60, ge=0, description="a serving worker that answers no ping for this long is killed as hung; 0 turns the check off")
    teardown_timeout: float = Field(15, gt=0, description="how long an ordered teardown may take before the worker is killed")

    # -- access --
    api_key: SecretStr | None = Field(None, description="Bearer key for /v1/* (one unnamed key; api_keys names several)")
    api_keys: Annotated[dict[str, SecretStr], NoDecode] = Field(
        default_factory=dict, max_length=MAX_NAMED_KEYS,
        description="named Bearer keys for /v1/*, beside api_key: {name = key}. A key's name scopes the prompt "
                    "cache (an entry one key made is never restored or counted for another). In the environment: "
                    "a JSON object, or name:key pairs separated by commas")
    admin_key: SecretStr | None = Field(None, description="Bearer key for /sleep, /wake, /models/load|unload, Ollama's "
                                                          "load and unload (keep_alive); it opens the API routes too")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest request body accepted; a larger one is refused with 413")
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, max_length=256,
        description="Host header names (no port) the daemon answers beside those it always answers (localhost, "
                    "*.localhost, loopback addresses, the address it is bound to; bound to 0.0.0.0 or ::, any IP "
                    "address and this machine's host name); another name gets 403 (a defense against DNS "
                    "rebinding). \"*\": any host (no check). A list, or names separated by commas")
    report_cached_tokens: bool = Field(
        True, description="answers say how many prompt tokens the prompt cache held (usage.prompt_tokens_details."
                          "cached_tokens, timings.cache_n, tokens_cached, Anthropic's cache_read_input_tokens); "
                          "false: they read 0 (and /props, /slots hide the cache's counts from non-admin callers), "
                          "so no answer tells a caller what another request of its scope left in the cache")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, max_length=256,
        description="browser origins (scheme://host[:port]) whose pages may call the daemon: their requests get "
                    "CORS headers and every route answers the OPTIONS preflight; \"*\" allows any origin, \"localhost\" "
                    "every origin on a loopback host (localhost, 127.0.0.1, [::1]) and any port; empty: "
                    "none (a cross-origin POST is 403). A list, or origins separated by commas. Keys still apply")
    tags: Annotated[list[str], NoDecode] = Field(
        default_factory=list, max_length=MAX_TAGS,
        description="labels /v1/models shows beside each model (llama-server's --tags): informational, never read "
                    "for routing; a [models.ID] table's tags replace them. A list, or labels separated by commas")
    metrics_key: SecretStr | None = Field(
        None, description="Bearer key for /health and /metrics; none: both open. Probes and scrapers must then send it")
    max_image_pixels: int = Field(16_777_216, ge=1, le=2**30,
                                  description="largest image (width x height, read from its header) in a chat request")
    max_images_per_request: int = Field(8, ge=0, le=1024, description="most images in one request (a chat's messages, or /completion's prompts together); 0 refuses images")
    raw_grammar: bool = Field(
        True, description="accept llama-server's raw `grammar` (GBNF) field, read by llguidance's GBNF reader under the "
                          "same per-token limits as json_schema (a grammar past them ends its own request with an "
                          "error, never stalls the others); false refuses the field")
    status_page: bool = Field(True, description="the status page at / and /ui; false: 404 there (llama-server's --no-ui)")
    tools: Annotated[list[str], NoDecode] = Field(default_factory=list, max_length=8, description=TOOLS_DOC)
    tools_runtime: str = Field("", description=TOOLS_RUNTIME_DOC)
    mcp_servers: dict[str, McpServer] = Field(default_factory=dict, description=MCP_SERVERS_DOC)
    cors_proxy: bool = Field(False, description=CORS_PROXY_DOC)
    metrics_endpoint: bool = Field(True, description="false: GET /metrics answers 501, as llama-server's without "
                                   "--metrics (metrics_key guards it instead, when scrapes are wanted)")
    slots_endpoint: bool = Field(True, description="false: GET /slots answers 501, as llama-server's --no-slots "
                                 "(/props and the status page still show the slots)")
    predict_route: str | None = Field(
        None, pattern=r"^/[A-Za-z0-9._~/:@-]{0,255}$",
        description="Vertex AI's prediction route (a custom container's AIP_PREDICT_ROUTE; AIP_MODE=PREDICTION sets it, "
                    "/predict by default): a POST of {\"instances\": [...]} runs each instance as the request its "
                    "@requestFormat names (chatCompletions, completion, embeddings...) and answers {\"predictions\": "
                    "[...]}; none: not served")
    predict_health_route: str | None = Field(
        None, pattern=r"^/[A-Za-z0-9._~/:@-]{0,255}$",
        description="another path /health answers on (Vertex AI's AIP_HEALTH_ROUTE), under the same metrics_key")
    verbose_answers: bool = Field(
        False, description="every whole answer of /v1/chat/completions carries llama-server's `__verbose` object (the "
                           "prompt as the chat template rendered it); a request's own `verbose` asks for it alone. "
                           "llama-server's -v sets it")

    # -- several models (config/models.py) --
    models: dict[str, ModelSettings] = Field(
        default_factory=dict, max_length=64,
        description="one [models.ID] table per model; none: the top-level keys describe a fleet of one")
    default_model: str | None = Field(None, description="the model for requests that name none; default: the first table")
    memory_budget: int | None = Field(
        None, description="bytes the models may hold together (an int, or '20GiB'); default: the GPU's total less "
                          "1 GiB, or on CPU 75% of the RAM available at start (dormouse check-config prints it)")
    models_dir: Path | None = Field(None, description="a directory of GGUF files, each (or each folder of one model "
                                    "and its mmproj*.gguf) a model named after it, as llama-server's router reads "
                                    "--models-dir; a [models.ID] table of the same id wins")
    models_max: int = Field(0, ge=0, le=64, description="at most this many models hold memory at once (the least "
                            "recently used idle one sleeps for another); 0: the memory budget alone decides. Set "
                            "without a top-level model, it makes the daemon a router: model names must match")
    models_autoload: bool = Field(True, description="false: a request for a model that is not loaded (never yet, or "
                                  "unloaded or evicted since) is refused until POST /models/load; one that fell "
                                  "asleep when idle still wakes. Set without a top-level model, it makes the daemon a "
                                  "router: model names must match")

    # -- sampling defaults: for a request that leaves the field out (llama-server's -n, -s, --temp, --top-k...) --
    n_predict: NPredict | None = Field(
        None, description="tokens a request generates when it names no limit (max_tokens, max_completion_tokens, "
                          "n_predict); -1: until the end of generation or of the slot's context; none: 256 on the "
                          "OpenAI routes, -1 on /completion")
    seed: Seed = Field(-1, description="sampling seed of a request that names none; -1: random")
    temperature: Temperature = Field(0.8, description="temperature of a request that names none; 0: greedy")
    top_k: TopK = Field(40, description="top_k of a request that names none; 0 or -1: off")
    top_p: TopP = Field(0.95, description="top_p of a request that names none; 1: off; 0: the most probable token only")
    min_p: MinP = Field(0.05, description="min_p of a request that names none; 0: off")
    repeat_penalty: RepeatPenalty = Field(1.0, description="repeat_penalty of a request that names none")
    repeat_last_n: RepeatLastN = Field(64, description="repeat_last_n of a request that names none; -1: the slot's "
                                                       "context")
    presence_penalty: Penalty = Field(0.0, description="presence_penalty of a request that names none")
    frequency_penalty: Penalty = Field(0.0, description="frequency_penalty of a request that names none")

    # -- the prompt cache: what it may change --
    cache_deterministic: bool = Field(
        False, description="true: reuse and restore cached prompt tokens only in whole prompt chunks (batch_size) "
                           "counted from position 0, so a greedy answer is token for token the one a fresh read "
                           "gives (python -m bench.cache_rule prints the cost: more of each turn is read again); "
                           "false: reuse every shared token that llama.cpp still holds (answers may differ from a "
                           "fresh read in later tokens, as llama.cpp's kernels differ by batch size)")

    cache_checkpoint_every: int = Field(
        1024, ge=0, le=2**24,
        description="on a model with sliding-window layers, a checkpoint of the window every this many prompt "
                    "tokens, besides each prompt's end and each turn boundary (a window can be extended, never cut "
                    "back: a checkpoint is where a regenerate or an edit can start again); 0: only those")

    # -- the prompt cache across sleeps --
    kv_cache_min_tokens: int = Field(256, ge=1, le=2**24,
                                     description="a slot's cached prefix at least this long is saved at sleep")
    kv_cache_disk_bytes: int = Field(
        4 * 2**30, description="bytes of saved prompt caches per model (an int, or '4GiB'); least recently used go "
                               "first; 0 turns saving off")
    shared_cache_dir: Path | None = Field(
        None, description="a directory several replicas mount (a ReadWriteMany volume, NFS): the disk tier of the "
                          "prompt cache is written there too, under kv/<the model's content and context layout>, and "
                          "any replica of the same model and layout restores from it (a conversation's next turn on "
                          "another replica); kv_cache_disk_bytes is its budget per model too. A replica that cannot "
                          "reach it serves from its own state_dir; none: off")
    slot_save_path: Path | None = Field(
        None, description="POST /slots/{id}?action=save|restore writes and reads named prompt-cache files in "
                          "<slot_save_path>/<model id>/ (llama-server's --slot-save-path); none: those actions are off")
    prompt_cache_ram_bytes: int = Field(
        default_factory=lambda: default_prompt_cache_ram(), ge=0, le=2**60,
        description="bytes of host RAM per model for prompts whose slot went to another prompt (an int, or "
                    "'2GiB'); least recently used spill to the disk tier; 0 off; default 5% of the machine's RAM, "
                    "at most 8 GiB (llama-server's --cache-ram)")

    # -- scale-out --
    agent_port: int | None = Field(None, ge=1, le=65535,
                                   description="answer HAProxy's agent check on this port (weight by state); none: off")
    drain_grace_seconds: float = Field(
        2.0, ge=0, le=60, description="with agent_port: after SIGTERM the agent answers weight 0 for this long while "
                                      "the daemon still serves, so the balancer stops first; 0: off")

    # -- operations --
    log_format: Literal["auto", "console", "json"] = Field(
        "auto", description="log lines as JSON (one object a line) or for people (console); auto: console on a terminal "
        "or journald, JSON otherwise; to journald either carries its <N> priority prefix, which journald strips")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="the least severe log level written")
    shutdown_timeout: float = Field(30, ge=0, description="how long SIGTERM lets in-flight requests finish; with teardown_timeout it must fit systemd's TimeoutStopSec")
    state_dir: Path | None = Field(None, description="the daemon's own files: models by name (models/), saved prompt "
                                   "caches (kv/), footprints, wake history, the lock; default $STATE_DIRECTORY or "
                                   "~/.cache/dormouse. The bundled model is one shared copy beside, not in it: "
                                   "$CACHE_DIRECTORY/bundled or ~/.cache/dormouse/bundled")
    worker_module: str = Field("daemon.worker", description="module run as the worker (tests use a fake)")
    metrics_compat: Annotated[list[Literal["llamacpp", "vllm", "otel"]], NoDecode] = Field(
        default_factory=list,
        description="/metrics also carries the names other tools read, mapped from Dormouse's own: llamacpp "
                    "(llama-server's `llamacpp:` series), vllm (vLLM's `vllm:` series: the Gateway API Inference "
                    "Extension's endpoint picker, vLLM's Grafana dashboard), otel (OpenTelemetry GenAI's "
                    "`gen_ai_server_*` histograms); empty: Dormouse's own only. A list, or names separated by commas; "
                    "read at start")

    @field_validator("sleep_idle_seconds", "drowsy_after", "deep_after")
    @classmethod
    def _idle(cls, value: float) -> float:
        if not math.isfinite(value) or (value < 0 and value != -1):
            raise ValueError("must be >= 0, or -1 for never")
        return value

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None or value == "" else parse_size(value)

    @field_validator("kv_cache_disk_bytes", "prompt_cache_ram_bytes", "keeper_mlock_bytes", mode="before")
    @classmethod
    def _disk_size(cls, value: Any) -> Any:
        return 0 if value in (0, "0") else parse_size(value)

    @model_validator(mode="before")
    @classmethod
    def _models_dir(cls, data: Any) -> Any:
        return with_models_dir(data)

    @model_validator(mode="after")
    def _fleet_names(self) -> "Settings":
        check_model_ids(self.models)
        if self.default_model is not None and self.default_model not in self.models:
            raise ValueError(f"default_model {self.default_model!r} is not one of the [models.ID] tables "
                             f"({', '.join(self.models) or 'there are none'})")
        return self

    @model_validator(mode="after")
    def _unified_kv_is_not_deterministic(self) -> "Settings":
        # A shared pool puts a slot's cells wherever they are free, among the other slots' cells: llama.cpp's
        # attention then sums them in another order than a fresh read, so no answer is promised bit for bit.
        def effective(table: ModelSettings | None, key: str) -> Any:  # a table's value, or the top level's
            own = getattr(table, key) if table is not None else None
            return getattr(self, key) if own is None else own

        tables = [(f"[models.{model_id}]: ", table) for model_id, table in self.models.items()] or [("", None)]
        for where, table in tables:
            if effective(table, "kv_unified") and effective(table, "cache_deterministic"):
                raise ValueError(f"{where}kv_unified and cache_deterministic cannot both be true: in a shared KV "
                                 "pool a slot's cells sit among the others', and a fresh read's answer is not "
                                 "promised bit for bit")
        return self

    @field_validator("host")
    @classmethod
    def _hosts(cls, value: str) -> str:
        hosts = host_list(value)
        if len(hosts) > MAX_HOSTS or (hosts == [""] and value != ""):
            raise ValueError(f"give one address, or up to {MAX_HOSTS} separated by commas (\"\": every interface)")
        return ",".join(hosts)

    @property
    def hosts(self) -> list[str]:
        return host_list(self.host)

    @property
    def slot_context(self) -> int:
        """A slot's context until a worker reports llama.cpp's own: the shared pool, or the slot's share."""
        return self.ctx_size if self.kv_unified else self.ctx_size // self.parallel

    @model_validator(mode="after")
    def _admin_key_off_loopback(self) -> "Settings":
        # Off loopback, whoever reaches the port could put every model to sleep,
        # wake or load them (POST /sleep, /wake, /models/load): refuse to
        # start open rather than trust the network around the daemon. Only an
        # address literal or "localhost" counts as loopback; a host name is not
        # resolved here (it may resolve elsewhere tomorrow). A socket systemd
        # passes (socket activation) is judged the same way when the daemon
        # starts (daemon/server.py): the address it really serves counts.
        problem = admin_key_problem(self.host, self.port, self)
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("api_keys", mode="before")
    @classmethod
    def _named_keys(cls, value: Any) -> Any:
        # From the environment: a JSON object, or name:key pairs separated by commas.
        if isinstance(value, str):
            if value.lstrip().startswith("{"):
                try:
                    return json.loads(value)
                except ValueError:
                    raise ValueError("is neither a JSON object nor name:key pairs separated by commas") from None
            pairs = {}
            for part in (part.strip() for part in value.split(",")):
                if not part:
                    continue
                name, colon, key = part.partition(":")
                if not colon:
                    raise ValueError("give name:key pairs separated by commas (or a JSON object)")
                if name.strip() in pairs:
                    raise ValueError(f"the name {name.strip()[:64]!r} is given twice")
                pairs[name.strip()] = key.strip()
            return pairs
        if isinstance(value, dict) and len(value) > MAX_NAMED_KEYS:
            raise ValueError(f"at most {MAX_NAMED_KEYS} named keys, got {len(value)}")
        return value

    @field_validator("api_keys")
    @classmethod
    def _named_keys_valid(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for name, key in value.items():
            if not KEY_NAME.fullmatch(name):
                raise ValueError(f"key name {name[:80]!r} must be 1-64 letters, digits, '.', '_' or '-' (starting "
                                 "with a letter or digit)")
            try:
                cls._header_safe_key(key)
            except ValueError as exc:
                raise ValueError(f"key {name!r}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _distinct_keys(self) -> "Settings":
        # A key names one caller: two callers with one key would share a cache scope, and an API key
        # equal to the admin key would make every API caller an admin.
        seen: dict[str, str] = {}
        keys = [("api_key", self.api_key)] + [(f"api_keys.{n}", k) for n, k in self.api_keys.items()]
        for where, key in ((w, k) for w, k in keys if k is not None):
            secret = key.get_secret_value()
            if secret in seen:
                raise ValueError(f"{where} is the same key as {seen[secret]}: every key must be different")
            seen[secret] = where
        if self.admin_key is not None and self.admin_key.get_secret_value() in seen:
            raise ValueError(f"admin_key is the same key as {seen[self.admin_key.get_secret_value()]}: the admin key "
                             "must differ from every API key (or leave admin_key out: the API key then opens /sleep "
                             "and /wake)")
        return self

    _mcp_servers_json = field_validator("mcp_servers", mode="before")(mcp_servers_json)
    _host_tools = model_validator(mode="after")(check_host_tools)  # config/host_tools.py

    @field_validator("allowed_hosts", "tags", "tools", "cors_origins", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        # An environment variable gives one string: names separated by commas, or a JSON list.
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                try:
                    return json.loads(value)
                except ValueError:
                    raise ValueError("is neither a JSON list nor names separated by commas") from None
            return [name for name in (part.strip() for part in value.split(",")) if name]
        return value

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        return check_tags(value)

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        return [normalize_origin(origin) for origin in value]

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, value: list[str]) -> list[str]:
        # "*": any host at all (the Host check off); else names, normalised as the check compares them.
        return [name.strip() if name.strip() == "*" else normalize_host(name, strict=True) for name in value]

    @field_validator("metrics_compat", mode="before")
    @classmethod
    def _compat_list(cls, value: Any) -> Any:
        # From the environment: names separated by commas, or a JSON list; each once.
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise ValueError("is neither a JSON list nor names separated by commas") from None
            else:
                value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list) and all(isinstance(name, str) for name in value):
            return list(dict.fromkeys(value))
        return value

    @field_validator("metrics_key")
    @classmethod
    def _header_safe_key(cls, value: SecretStr | None) -> SecretStr | None:
        # A key travels in an HTTP header: visible ASCII only, no spaces (the Bearer value is stripped).
        if value is not None:
            key = value.get_secret_value()
            if not key:
                raise ValueError("must not be empty (leave it out for no key)")
            if len(key) > 4096 or not all("!" <= ch <= "~" for ch in key):
                raise ValueError("must be 1-4096 visible ASCII characters (no spaces)")
        return value

    @field_validator("max_image_pixels", "max_images_per_request", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # TOML `true` would otherwise count as 1
            raise ValueError("must be an integer, not a boolean")
        return value

    @field_validator("model", "model_draft", "mmproj", "chat_template_file", "state_dir", "shared_cache_dir",
                     mode="before")
    @classmethod
    def _empty_path_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("chat_template", mode="before")
    @classmethod
    def _chat_template(cls, value: Any) -> Any:
        return check_chat_template(value)

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _chat_template_kwargs(cls, value: Any) -> Any:
        return check_template_kwargs(value)

    toml_file: ClassVar[Path | None] = None  # set on a per-load subclass by load_settings

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls.toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls.toml_file))
        return tuple(sources)

    def public_dict(self) -> dict[str, Any]:
        """The effective settings, secrets masked, ready to print."""
        out = self.model_dump(mode="json")
        for key in ("api_key", "admin_key", "metrics_key"):
            out[key] = "********" if getattr(self, key) else None
        out["api_keys"] = {name: "********" for name in self.api_keys}
        return out


def default_prompt_cache_ram() -> int:
    """5% of physical RAM, at most 8 GiB (llama-server's --cache-ram default)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 16 * 2**30
    return min(8 * 2**30, ram // 20)


def _where(key: str, cli: dict[str, Any], toml_file: Path | None, toml_data: dict[str, Any],
           origins: Mapping[str, str]) -> str:
    if key in cli:  # the llama-server spelling or LLAMA_ARG_* variable that set it, when one did
        origin = origins.get(key, f"--{key.replace('_', '-')}")
        return f"command line {origin}" if origin.startswith("-") else origin
    env_name = ENV_PREFIX + key.upper()
    if env_name in os.environ:
        return f"environment {env_name}"
    if key in toml_data:
        return f"config file {toml_file}"
    return "default"


def load_settings(config_file: str | Path | None = None, cli: dict[str, Any] | None = None,
                  origins: Mapping[str, str] | None = None) -> Settings:
    """Build the effective settings; raise ConfigError naming the key and its source. origins: for keys of
    `cli` that came from llama-server's spellings, the option or variable that set each (its error names it)."""
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    origins = origins or {}
    found = find_config_file(config_file)  # --config, DORMOUSE_CONFIG, or a default path (config/sources.py)
    toml_file = found.path
    toml_data: dict[str, Any] = {}
    if toml_file is not None:
        try:
            toml_data = tomllib.loads(toml_file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {toml_file} (from {found.how}) does not exist") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {toml_file} (from {found.how}) cannot be read: {exc}") from None

    # A subclass carries the TOML path, so concurrent loads do not share it.
    layered = type("LayeredSettings", (Settings,), {"toml_file": toml_file})
    try:
        layered_settings = layered(**cli)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else "?"
            if not err["loc"]:  # a check across keys (the fleet's names): its message names them
                problems.append(err["msg"].removeprefix("Value error, "))
                continue
            where = ".".join(str(part) for part in err["loc"])  # models.chat.ctx_size
            problems.append(f"{where}: {err['msg']} (from {_where(key, cli, toml_file, toml_data, origins)})")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems)) from None
    settings = Settings.model_construct(**dict(layered_settings))
    _check_top_level_model(settings, lambda key: _where(key, cli, toml_file, toml_data, origins))
    return settings


def _check_top_level_model(settings: Settings, where) -> None:
    """A top-level `model` (or `hf_repo`, `hf_file`) beside [models.ID] tables is the model the tables that
    name none inherit. When every table names its own (path or hf) nothing serves it: refused, not dropped
    without a word. (Not made a model of the fleet on its own: the same line would then mean two things,
    the tables' shared default and a model with an id nobody chose.) `where(key)` names a key's layer."""
    if not settings.models or not all(table.names_its_own_model() for table in settings.models.values()):
        return
    if settings.model is not None:
        stem = Path(settings.model).stem
        model_id = stem if MODEL_ID.fullmatch(stem) else "main"
        raise ConfigError(f"model = {str(settings.model)!r} (from {where('model')}) is served by no model: every "
                          f"[models.ID] table sets its own path or hf. Move it into a table of its own "
                          f"([models.{model_id}] path = {json.dumps(str(settings.model))}), or remove it")
    for key in ("hf_repo", "hf_file"):
        value = getattr(settings, key)
        if value:
            table_key = "hf" if key == "hf_repo" else key
            repo = str(value).partition(":")[0].rsplit("/", 1)[-1]
            model_id = repo if MODEL_ID.fullmatch(repo) else "main"
            raise ConfigError(f"{key} = {str(value)[:120]!r} (from {where(key)}) is served by no model: every "
                              f"[models.ID] table sets its own path or hf. Move it into a table of its own "
                              f"([models.{model_id}] {table_key} = {json.dumps(str(value)[:256])}), or remove it")
