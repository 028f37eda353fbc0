"""The llama-server options whose handling is more than a line: values parsed as llama-server
parses them (-c 0, -np -1, -ngl all, -s 4294967295) and turned into Dormouse's settings.
daemon/llama_server_options.py names each in its table."""

from __future__ import annotations

import csv
import os
from typing import Any

from config.llama_options import FLASH_ATTN, UINT32
from daemon.llama_server_handling import LlamaServerArgsError, Translation, choice, comma_list, parse_float, \
    parse_int, truthy_word

MAX_KEY_FILE_BYTES = 1 << 20


def threads(value: int) -> int | None:
    return value if value > 0 else None  # llama.cpp: <= 0 means every core, as Dormouse's default does


def threads_batch(value: int) -> int:
    return value if value > 0 else (os.cpu_count() or 1)


def context_size(value: int, spelling: str, out: Translation) -> None:
    if value < 0:
        raise LlamaServerArgsError(f"{spelling}: must be 0 (the model's trained context) or more, got {value}")
    if value == 0:
        out.context_from_model = True  # resolved once -m is known (daemon/llama_server_args.py)
        out.settings.pop("ctx_size", None)
    else:
        out.context_from_model = False
        out.settings["ctx_size"] = value
    out.origins["ctx_size"] = spelling


def parallel_slots(value: int, spelling: str, out: Translation) -> None:
    if value == -1:
        out.settings.pop("parallel", None)
        out.notes.append(f"{spelling} -1: 'auto' is Dormouse's default number of slots")
        return
    if value < 1:
        raise LlamaServerArgsError(f"{spelling}: must be 1 or more, or -1 for auto, got {value}")
    out.settings["parallel"] = value
    out.origins["parallel"] = spelling


def gpu_layers(text: str) -> int:
    if text in ("auto", "all"):
        return -1  # Dormouse offloads every layer; its memory budget, not llama.cpp's fitting, decides what fits
    value = parse_int(text)
    if value < -2:
        raise ValueError(f"expects a number of layers, 'auto' or 'all', got {text[:40]!r}")
    return -1 if value < 0 else value


def seed(text: str) -> int:
    value = parse_int(text, -1, UINT32[1])
    return -1 if value in (-1, UINT32[1]) else value  # LLAMA_DEFAULT_SEED (0xFFFFFFFF) is "random"


def n_predict(value: int) -> int:
    if value < -2:
        raise ValueError(f"expects a number of tokens, -1 (no limit) or -2, got {value}")
    return -1 if value == -2 else value  # -2 (until the context fills) is what -1 does in Dormouse


def pooling(text: str, spelling: str, out: Translation) -> None:
    if text not in ("none", "mean", "cls", "last", "rank"):
        raise LlamaServerArgsError(f"{spelling}: expects none, mean, cls, last or rank, got {text[:40]!r}")
    out.settings["pooling"] = text
    out.origins["pooling"] = spelling


def cache_ram_bytes(value: int) -> int:
    if value < 0:
        raise ValueError("-1 (no limit) is not supported: give a size in MiB (0 turns the host-RAM tier off)")
    return value * 2**20


def bind_host(text: str, spelling: str, out: Translation) -> None:
    if any(host.strip().endswith(".sock") for host in text.split(",")):
        raise LlamaServerArgsError(f"{spelling} {text[:80]}: a unix socket is not supported; use systemd socket "
                                   "activation (systemd/) or an address")
    out.settings["host"] = text
    out.origins["host"] = spelling


def model_aliases(text: str, spelling: str, out: Translation) -> None:
    names = comma_list(text)
    if not names:
        raise LlamaServerArgsError(f"{spelling}: expects one or more names separated by commas")
    # The first name becomes the model's id (what /v1/models lists), the others its aliases; beside a preset's
    # models (--models-preset, before or after it), not over them.
    models = dict(out.settings.get("models", {}))
    models[names[0]] = {**models.get(names[0], {}), "aliases": names[1:]}
    out.settings["models"] = models
    out.origins["models"] = spelling


def llamacpp_metrics(value: object, spelling: str, out: Translation) -> None:
    """--metrics: /metrics served (over a metrics_endpoint = false of the config file or the environment),
    with llama-server's `llamacpp:` names."""
    out.settings["metrics_endpoint"] = True
    out.origins["metrics_endpoint"] = spelling
    out.settings["metrics_compat"] = ["llamacpp"]
    out.origins["metrics_compat"] = spelling
    out.notes.append(f"{spelling}: metrics_compat = llamacpp, over a metrics_compat of the config file or the "
                     "environment: to keep others, drop it and list every family in metrics_compat (e.g. llamacpp,vllm)")


def _add_keys(keys: list[str], spelling: str, out: Translation) -> None:
    known = []
    if "api_key" in out.settings:
        known.append(out.settings.pop("api_key"))
    known.extend(out.settings.pop("api_keys", {}).values())
    known.extend(key for key in keys if key not in known)
    if len(known) == 1:
        out.settings["api_key"] = known[0]
    elif known:  # several: named key1, key2, ... (a name scopes the prompt cache)
        out.settings["api_keys"] = {f"key{i}": key for i, key in enumerate(known, 1)}
    out.origins["api_key" if len(known) == 1 else "api_keys"] = spelling


def api_key_list(text: str, spelling: str, out: Translation) -> None:
    if len(text) > MAX_KEY_FILE_BYTES:
        raise LlamaServerArgsError(f"{spelling}: longer than {MAX_KEY_FILE_BYTES} bytes")
    keys = [key for row in csv.reader([text]) for key in row if key]  # llama.cpp: a CSV row, quotes allowed
    _add_keys(keys, spelling, out)


def api_key_file(text: str, spelling: str, out: Translation) -> None:
    try:
        with open(text, "rb") as file:
            data = file.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise LlamaServerArgsError(f"{spelling}: cannot read {text[:200]}: {exc.strerror}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise LlamaServerArgsError(f"{spelling}: {text[:200]} is larger than {MAX_KEY_FILE_BYTES} bytes")
    try:
        lines = data.decode().splitlines()
    except UnicodeDecodeError:
        raise LlamaServerArgsError(f"{spelling}: {text[:200]} is not UTF-8 text") from None
    keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    _add_keys(keys, spelling, out)


def log_verbosity(value: int) -> str:
    return "error" if value <= 1 else "warning" if value == 2 else "info" if value == 3 else "debug"


def load_mode(text: str) -> str:
    modes = {"auto": "auto", "none": "none", "mmap": "mmap", "mlock": "mlock", "mmap+mlock": "mmap+mlock",
             "dio": "direct_io", "direct_io": "direct_io"}  # direct_io: Dormouse's own name for dio
    return choice(modes)(text)


def rope_scale(text: str) -> float:
    value = parse_float(text)
    if value == 0:
        raise ValueError("must not be 0 (it divides the RoPE frequency)")
    return 1.0 / value


def positive_int(text: str) -> int:
    value = parse_int(text)
    if value < 1:
        raise ValueError(f"must be 1 or more, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = parse_int(text, 0, UINT32[1])
    return value


def flash_attn_type(text: str) -> int:
    return FLASH_ATTN[truthy_word(text)]


def dormouse_help(value: Any, spelling: str, out: Translation) -> None:
    out.rest.append("--help")


def legacy_mlock(value: Any, spelling: str, out: Translation) -> None:
    # Older llama.cpp: --mlock locks what is read, mmap'd (the default) or not (--no-mmap).
    out.settings["load_mode"] = "mlock" if out.settings.get("load_mode") == "none" else "mmap+mlock"
    out.origins["load_mode"] = spelling


def legacy_mmap(value: bool, spelling: str, out: Translation) -> None:
    locked = out.settings.get("load_mode") in ("mlock", "mmap+mlock")
    out.settings["load_mode"] = ("mmap+mlock" if locked else "mmap") if value else ("mlock" if locked else "none")
    out.origins["load_mode"] = spelling


def models_preset(text: str, spelling: str, out: Translation) -> None:
    """--models-preset FILE.ini: each section a [models.ID] table (daemon/llama_server_preset.py)."""
    from daemon.llama_server_preset import models_from_preset

    tables, common = models_from_preset(text, spelling, out.notes)
    # [*] is the router's command line, under the real one: an option given there too wins.
    for key, value in common.settings.items():
        out.settings.setdefault(key, value)
        out.origins.setdefault(key, f"{spelling} [*]")
    for key, value in common.llama_options.items():
        out.llama_options.setdefault(key, value)
        out.origins.setdefault(key, f"{spelling} [*]")
    out.notes.extend(common.notes)
    out.settings["models"] = {**tables, **out.settings.get("models", {})}
    out.origins["models"] = spelling
