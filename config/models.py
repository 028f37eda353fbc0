"""Several models: one `[models.ID]` table per model, and the memory budget.

A table sets what differs for that model; every key it leaves out takes the
top-level value, so a fleet shares its defaults (threads, ctx_size, ...)
without repeating them. Without any table, the top-level keys describe a
fleet of one, as before the fleet existed.

    memory_budget = "20GiB"
    default_model = "chat"

    [models.chat]
    path = "/models/qwen2.5-7b-instruct-q4_k_m.gguf"
    aliases = ["gpt-4o-mini"]
    pinned = true

    [models.coder]
    hf = "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M"
    ctx_size = 16384
    sleep_idle_seconds = 120

    [models.coder.llama_options]
    flash_attn_type = 1

A table names its model by `path` (a GGUF file) or by `hf` (a Hugging Face
repository, owner/name[:QUANT], as the top-level hf_repo; `hf_file` picks a
file of it), never both; one that names neither takes the top-level model.
Its `llama_options` are laid over the top-level ones, key by key.
"""

from __future__ import annotations

import math
import re
import unicodedata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from config.llama_options import LlamaOptions
from config.sampling import (SAMPLING_KEYS, MinP, NPredict, Penalty, RepeatLastN, RepeatPenalty, Seed, Temperature,
                             TopK, TopP)

# A model's id or alias: what requests name. Parts joined by '/' as llama-server's router names models
# (owner/name:QUANT), each part starting with a letter or digit (no '.' or '..' part, no leading, trailing
# or doubled '/'): the id also names the model's directories (model_dir_name).
MODEL_ID = re.compile(r"^(?=.{1,128}$)[A-Za-z0-9][A-Za-z0-9._:-]*(?:/[A-Za-z0-9][A-Za-z0-9._:-]*)*$")
MODEL_ID_RULE = "1-128 letters, digits, '.', '_', ':' or '-', parts joined by '/' (owner/name:QUANT)"

# A model's tags (llama-server's --tags): labels /v1/models shows, never read for routing.
MAX_TAGS = 32
TAG = re.compile(r"^[^,]{1,64}$")
TAG_RULE = "1-64 characters, no comma and no control or format character"


def check_tags(tags: list[str]) -> list[str]:
    """Each tag once, in the order given; stripped of the spaces around it (as a comma list leaves them)."""
    out: list[str] = []
    for tag in tags:
        if not isinstance(tag, str) or not TAG.fullmatch(tag.strip()) \
                or any(unicodedata.category(ch) in ("Cc", "Cf") for ch in tag.strip()):  # controls, bidi, zero-width
            raise ValueError(f"tag {str(tag)[:80]!r} must be {TAG_RULE}")
        if tag.strip() not in out:
            out.append(tag.strip())
    return out


def model_dir_name(model_id: str) -> str:
    """The one path component a model's own directories are named by (its prompt cache under
    state_dir/kv, its slot files under slot_save_path): '/' written %2F ('%' is in no id, so two ids
    never share a name), so that "a/b" is no directory inside model a's."""
    return model_id.replace("/", "%2F")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# The keys a [models.ID] table may set; the rest of the settings are the daemon's.
PER_MODEL_KEYS = ("model_draft", "mmproj", "ctx_size", "parallel", "threads", "n_gpu_layers", "batch_size",
                  "chat_template_file", "chat_template", "draft_max", "draft_min", "draft_p_min", "cpu_repack", "warmup",
                  "sleep_idle_seconds", "spawn_ahead", "embeddings", "pooling", "cache_deterministic", "kv_unified",
                  "cache_checkpoint_every", "drowsy_after", "deep_after", "load_mode", "llama_options", "tags",
                  *SAMPLING_KEYS)

# llama.cpp's built-in chat templates, by name (its llama_chat_builtin_templates;
# tests/unit/test_chat_templates.py checks this copy against the library).
LLAMA_CPP_CHAT_TEMPLATES = (
    "bailing", "bailing-think", "bailing2", "chatglm3", "chatglm4", "chatml", "command-r", "deepseek",
    "deepseek-ocr", "deepseek2", "deepseek3", "exaone-moe", "exaone3", "exaone4", "falcon3", "gemma", "gigachat",
    "glmedge", "gpt-oss", "granite", "granite-4.0", "granite-4.1", "grok-2", "hunyuan-dense", "hunyuan-moe",
    "hunyuan-vl", "kimi-k2", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "llama3", "llama4",
    "megrez", "minicpm", "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken",
    "monarch", "openchat", "orion", "pangu-embedded", "phi3", "phi4", "rwkv-world", "seed_oss", "smolvlm",
    "solar-open", "vicuna", "vicuna-orca", "yandex", "zephyr",
)


def check_chat_template(value: Any) -> Any:
    """--chat-template: one of llama.cpp's built-in template names, or Jinja text."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or value in LLAMA_CPP_CHAT_TEMPLATES or "{{" in value or "{%" in value:
        return value  # a non-string is refused by the field's type
    raise ValueError(f"{value[:40]!r} is neither a Jinja template nor one of llama.cpp's built-in template names: "
                     + ", ".join(LLAMA_CPP_CHAT_TEMPLATES))


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string: "20GiB", "512 MB", "1.5GiB"."""
    if isinstance(value, bool):
        raise ValueError("a size is a number of bytes or a string such as '20GiB'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("must be more than 0 bytes")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size (use bytes, or a number with B, KB, MB, GB, KiB, MiB, GiB, TiB)")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    if size <= 0:
        raise ValueError("must be more than 0 bytes")
    if size > 2**60:
        raise ValueError(f"{value!r} is larger than any machine")
    return size


class ModelSettings(BaseModel):
    """One `[models.ID]` table. None: the top-level value applies."""

    model_config = ConfigDict(extra="forbid")

    path: Path | None = Field(None, description="GGUF file; empty means the bundled Gemma 3 270M")
    hf: str | None = Field(None, max_length=256, description="a model by name, owner/name[:QUANT] on Hugging Face "
                           "(the top-level hf_repo's rules); not with path")
    hf_file: str | None = Field(None, max_length=1024, description="with hf: this .gguf of the repository")
    llama_options: LlamaOptions | None = Field(None, description="laid over the top-level llama_options")
    aliases: list[str] = Field(default_factory=list, max_length=32, description="other names requests may use")
    tags: list[str] | None = Field(None, max_length=MAX_TAGS, description="labels /v1/models shows beside the model "
                                   "(llama-server's --tags), never read for routing; over the top-level tags")
    pinned: bool = Field(False, description="never put to sleep to make room for another model")
    model_draft: Path | None = None
    mmproj: Path | None = None
    ctx_size: int | None = Field(None, ge=64, le=2**24)
    parallel: int | None = Field(None, ge=1, le=256)
    threads: int | None = Field(None, ge=1, le=1024)
    n_gpu_layers: int | None = Field(None, ge=-1, le=100_000)
    batch_size: int | None = Field(None, ge=1, le=65536)
    chat_template_file: Path | None = None
    chat_template: str | None = None
    draft_max: int | None = Field(None, ge=1, le=1024)
    draft_min: int | None = Field(None, ge=0, le=1024)
    draft_p_min: float | None = Field(None, ge=0.0, le=1.0)
    cpu_repack: bool | None = None
    warmup: bool | None = None
    sleep_idle_seconds: float | None = None
    drowsy_after: float | None = None
    deep_after: float | None = None
    load_mode: Literal["auto", "mmap", "none", "mlock", "mmap+mlock", "direct_io"] | None = None
    spawn_ahead: bool | None = None
    embeddings: bool | None = None
    pooling: Literal["none", "mean", "cls", "last", "rank"] | None = None
    cache_deterministic: bool | None = None
    kv_unified: bool | None = None
    cache_checkpoint_every: int | None = Field(None, ge=0, le=2**24)
    # sampling defaults of a request to this model that names none, over the top level's (config/sampling.py)
    n_predict: NPredict | None = None
    seed: Seed | None = None
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    repeat_penalty: RepeatPenalty | None = None
    repeat_last_n: RepeatLastN | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None

    @field_validator("aliases")
    @classmethod
    def _names(cls, aliases: list[str]) -> list[str]:
        for alias in aliases:
            if not MODEL_ID.fullmatch(alias):
                raise ValueError(f"alias {alias!r} must be {MODEL_ID_RULE}")
        return aliases

    @field_validator("tags")
    @classmethod
    def _tags(cls, tags: list[str] | None) -> list[str] | None:
        return None if tags is None else check_tags(tags)

    @field_validator("sleep_idle_seconds", "drowsy_after", "deep_after")
    @classmethod
    def _idle(cls, value: float | None) -> float | None:
        if value is not None and (not math.isfinite(value) or (value < 0 and value != -1)):
            raise ValueError("must be >= 0, or -1 for never")
        return value

    @field_validator("path", "model_draft", "mmproj", "chat_template_file", mode="before")
    @classmethod
    def _empty_path_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("chat_template", mode="before")
    @classmethod
    def _chat_template(cls, value: Any) -> Any:
        return check_chat_template(value)

    @field_validator("hf")
    @classmethod
    def _hub_name(cls, value: str | None) -> str | None:
        from daemon.model.hub import parse_hf_repo  # plain Python: the syntax only, no request

        return None if value is None else str(parse_hf_repo(value))

    @field_validator("hf_file")
    @classmethod
    def _hub_file(cls, value: str | None) -> str | None:
        from daemon.model.hub import check_repo_file

        return None if value is None else check_repo_file(value)

    @model_validator(mode="after")
    def _one_model(self) -> "ModelSettings":
        if self.path is not None and self.hf is not None:
            raise ValueError(f"path and hf are both set ({str(self.path)[:120]!r} and {self.hf!r}): a table names "
                             "one model, a local GGUF file or a Hugging Face repository to download it from")
        if self.hf_file is not None and self.hf is None:
            raise ValueError("hf_file names a file of the table's hf repository, and the table sets no hf")
        return self

    def overrides(self) -> dict[str, Any]:
        """The settings this table changes, under the top-level names."""
        out = {key: getattr(self, key) for key in PER_MODEL_KEYS if getattr(self, key) is not None}
        if self.path is not None:
            out["model"] = self.path
        if self.hf is not None:
            out["hf_repo"] = self.hf
            if self.hf_file is not None:
                out["hf_file"] = self.hf_file
        return out

    def names_its_own_model(self) -> bool:
        """A path or a model by name: the top-level model and hf_repo do not reach this table."""
        return self.path is not None or self.hf is not None


def check_model_ids(models: dict[str, ModelSettings]) -> None:
    """Ids and aliases are names requests use: valid and unique across the fleet."""
    seen: dict[str, str] = {}
    for model_id, table in models.items():
        if not MODEL_ID.fullmatch(model_id):
            raise ValueError(f"model id {model_id!r} must be {MODEL_ID_RULE}")
        for name in (model_id, *table.aliases):
            if name in seen and seen[name] != model_id:
                raise ValueError(f"the name {name!r} is used by both {seen[name]} and {model_id}")
            seen[name] = model_id
