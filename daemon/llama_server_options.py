"""Every option of llama-server's `--help`, and what Dormouse does with it.

The list is that of llama.cpp's common/arg.cpp at the commit llama-cpp-python
0.3.36 vendors (the options for LLAMA_EXAMPLE_SERVER and the common ones):
each option's spellings, its LLAMA_ARG_* variable, what it takes, and its
Handling (daemon/llama_server_handling.py). tests/fixtures/
llama_server_options.json is the snapshot parsed from arg.cpp, and a unit test
holds this table to it, spelling for spelling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from config.llama_options import KV_CACHE_TYPES, LAZY_MODES, ROPE_SCALING, SPLIT_MODES
from daemon import llama_server_handlers as handlers
from config.template_kwargs import check_template_kwargs
from daemon.llama_server_handling import (Handling, LlamaServerArgsError, accepted, by_value, choice, comma_list, const,
                                          custom, llama, parse_float, refused, setting, switch, truthy_word)

# The llama.cpp this table was taken from: the one llama-cpp-python 0.3.36 vendors.
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"


@dataclass(frozen=True)
class Option:
    spellings: tuple[str, ...]
    env: str | None
    takes: str  # "flag", "switch" (has --no- forms), "int", "string" or "two" (two values)
    does: Handling
    negative: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None  # the value's parser; default: parse_int for "int", none for "string"
    env_does: Handling | None = None  # where the variable is handled otherwise than the option


def opt(spellings: str, env: str | None, takes: str, does: Handling, negative: str = "", **more: Any) -> Option:
    return Option(tuple(spellings.split()), env, takes, does, tuple(negative.split()), **more)


# -- shared reasons --

PER_REQUEST = ("no server-wide default for it: send it in each request (the defaults Dormouse has: -n, -s, --temp, "
               "--top-k, --top-p, --min-p, --repeat-penalty, --repeat-last-n, --presence-penalty, --frequency-penalty)")
NO_SAMPLER = ("Dormouse's sampler chain is penalties, top-k, top-p, min-p, temperature, in that order: no other sampler "
              "and no other order")
AFFINITY = ("CPU affinity and priority are not set by the worker; use taskset, numactl or systemd's CPUAffinity= "
            "and Nice=")
COMMAND = "a command, not a server option"
TENSOR_OVERRIDES = "tensor and metadata overrides are not supported (llama_options takes scalar parameters only)"
ADAPTERS = "LoRA adapters and control vectors are not supported"
DOWNLOADS = "Dormouse downloads nothing from a URL; download the file and give its path, or use -hf"
PRESET = "a preset downloads a model from Hugging Face; give -hf REPO and the options you need"
NO_UI = "Dormouse has no chat web UI (its status page at / is turned off by --no-ui)"
REASONING = ("no server-wide setting for it: send reasoning_format or chat_template_kwargs in each request (-rea off "
             "and --chat-template-kwargs set template variables server-wide)")
DRAFT_TUNING = "the draft model runs with the main model's threads and llama.cpp's default context parameters"
NGRAM = "n-gram and lookup speculation are not implemented: Dormouse drafts with a draft model (-md)"
FIT = "Dormouse's memory budget (memory_budget) plans what fits; llama.cpp's fitting is not used"
CHECKPOINTS = "Dormouse places sliding-window checkpoints by its own rule (cache_checkpoint_every)"
MEDIA = "not a setting; max_image_pixels and max_images_per_request bound images"
TIMINGS = "Dormouse reports its own timings in each answer"
LOG_FORMAT = "Dormouse's log lines carry a timestamp and level in its own format (log_format)"

def _template_variables(values: dict[str, Any], spelling: str, out: Any) -> None:
    """Server-wide template variables, merged over those an earlier option set (the last one given wins)."""
    merged = {**out.settings.get("chat_template_kwargs", {}), **values}
    try:
        out.settings["chat_template_kwargs"] = check_template_kwargs(merged)
    except ValueError as exc:
        raise LlamaServerArgsError(f"{spelling}: {exc}") from None
    out.origins["chat_template_kwargs"] = spelling


def _mcp_servers(text: str, spelling: str, out: Any) -> None:
    """llama-server's MCP config, {"mcpServers": {NAME: {command, args, env, timeout_ms}}}; `mcp_servers`
    checks each entry (an entry without "command" is skipped, as llama-server skips it)."""
    def one_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:  # json.loads would keep the last of two
        names = [name for name, _ in pairs]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            raise LlamaServerArgsError(f'{spelling}: "{twice[:80]}" is given twice')
        return dict(pairs)

    try:
        config = json.loads(text, object_pairs_hook=one_each)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, LlamaServerArgsError):
            raise
        raise LlamaServerArgsError(f"{spelling}: not JSON: {str(exc)[:120]}") from None
    if not isinstance(config, dict) or not isinstance(config.get("mcpServers", {}), dict):
        raise LlamaServerArgsError(f'{spelling}: must be {{"mcpServers": {{NAME: {{"command": ...}}}}}}')
    servers = {name: entry for name, entry in config.get("mcpServers", {}).items()
               if not isinstance(entry, dict) or "command" in entry}
    out.settings["mcp_servers"] = servers
    out.origins["mcp_servers"] = spelling


def _mcp_servers_file(path: str, spelling: str, out: Any) -> None:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read(1024 * 1024 + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise LlamaServerArgsError(f"{spelling} {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") \
            from None
    if len(text) > 1024 * 1024:
        raise LlamaServerArgsError(f"{spelling} {path}: larger than 1 MiB")
    _mcp_servers(text, f"{spelling} {path}", out)


def _chat_template_kwargs(text: str, spelling: str, out: Any) -> None:
    try:
        values = check_template_kwargs(text)
    except ValueError as exc:
        raise LlamaServerArgsError(f"{spelling}: {exc}") from None
    _template_variables(values, spelling, out)


def _reasoning(text: str, spelling: str, out: Any) -> None:
    """llama-server's -rea on|off|auto: off renders every chat prompt with enable_thinking = false, which the
    templates of thinking models read (Qwen 3's closes an empty think block, DeepSeek R1's opens and closes one)."""
    try:
        word = truthy_word(text)
    except ValueError as exc:
        raise LlamaServerArgsError(f"{spelling}: {exc}") from None
    if word == "off":
        _template_variables({"enable_thinking": False}, spelling, out)
    else:
        # the last option given wins: an earlier enable_thinking = false (-rea off, --chat-template-kwargs) is
        # undone, and the templates render as by default
        out.settings.get("chat_template_kwargs", {}).pop("enable_thinking", None)
        out.notes.append(f"{spelling}: accepted; {word}: chat templates render with enable_thinking = true unless a "
                         "request's chat_template_kwargs say otherwise")


def _reasoning_budget(value: int, spelling: str, out: Any) -> None:
    if value == 0:
        _template_variables({"enable_thinking": False}, spelling, out)
    elif value == -1:
        out.notes.append(f"{spelling}: accepted; -1: thinking has no budget, as by default")
    else:
        raise LlamaServerArgsError(f"{spelling} {value} is not supported: Dormouse does not count thinking tokens "
                                   "(0 turns thinking off, -1 leaves it unbounded)")


def _spec_type(text: str, spelling: str, out: Any) -> None:
    """llama-server's speculation types: draft-simple (a draft model proposes, the model verifies) is what
    Dormouse does with -md, none is no speculation (a -md beside it is not used); the n-gram, lookup and
    model-specific heads are not implemented. Checked against -md once the whole line is read."""
    types = comma_list(text)
    others = [name for name in types if name not in ("none", "draft-simple")]
    if not types or others:
        raise LlamaServerArgsError(f"{spelling} {(others or [text])[0][:40]!r} is not supported: Dormouse's "
                                   "speculation is draft-simple, with a draft model (-md); the n-gram, lookup and "
                                   "model-specific types are not implemented")
    out.speculation = "draft-simple" if "draft-simple" in types else "none"
    out.origins["speculation"] = spelling
    out.notes.append(f"{spelling}: accepted; {out.speculation}: " + (
        "Dormouse drafts with the draft model (-md), as draft-simple does" if out.speculation == "draft-simple"
        else "no speculation"))


OPTIONS: tuple[Option, ...] = (
    opt("-h --help --usage", None, "flag", custom("dormouse", "Dormouse's own help (dormouse serve --help)",
        handlers.dormouse_help)),
    opt("--version", None, "flag", refused("prints llama.cpp's build; `dormouse --version` prints Dormouse's")),
    opt("-cl --cache-list", None, "flag", refused(COMMAND)),
    opt("--completion-bash", None, "flag", refused(COMMAND)),
    opt("-t --threads", "LLAMA_ARG_THREADS", "int",
        setting("threads", handlers.threads, "mapped to `threads` (<= 0: all cores)")),
    opt("-tb --threads-batch", None, "int", llama("n_threads_batch", handlers.threads_batch)),
    opt("-C --cpu-mask", None, "string", refused(AFFINITY)),
    opt("-Cr --cpu-range", None, "string", refused(AFFINITY)),
    opt("--cpu-strict", None, "string", refused(AFFINITY)),
    opt("--prio", None, "int", refused(AFFINITY)),
    opt("--poll", None, "string", refused(AFFINITY)),
    opt("-Cb --cpu-mask-batch", None, "string", refused(AFFINITY)),
    opt("-Crb --cpu-range-batch", None, "string", refused(AFFINITY)),
    opt("--cpu-strict-batch", None, "int", refused(AFFINITY)),
    opt("--prio-batch", None, "int", refused(AFFINITY)),
    opt("--poll-batch", None, "int", refused(AFFINITY)),
    opt("-lcs --lookup-cache-static", None, "string", refused(NGRAM)),
    opt("-lcd --lookup-cache-dynamic", None, "string", refused(NGRAM)),
    opt("-c --ctx-size", "LLAMA_ARG_CTX_SIZE", "int",
        custom("mapped", "mapped to `ctx_size` (0: the model's trained context, read from the GGUF)",
            handlers.context_size)),
    opt("--kv-unified-per-slot", "LLAMA_ARG_KV_UNIFIED_PER_SLOT", "int",
        refused("a slot of the shared pool (-kvu) may grow to all of -c; no cap per slot")),
    opt("-n --predict --n-predict", "LLAMA_ARG_N_PREDICT", "int",
        setting("n_predict", handlers.n_predict, "mapped to `n_predict` (-2: -1)")),
    opt("-b --batch-size", "LLAMA_ARG_BATCH", "int", setting("batch_size")),
    opt("-ub --ubatch-size", "LLAMA_ARG_UBATCH", "int", llama("n_ubatch"), parse=handlers.positive_int),
    opt("--keep", None, "int", refused("Dormouse never shifts a context, so no tokens are kept across a shift")),
    opt("--swa-full", "LLAMA_ARG_SWA_FULL", "flag",
        accepted("the sliding-window cache is always full-size in Dormouse")),
    opt("-ctxcp --ctx-checkpoints --swa-checkpoints", "LLAMA_ARG_CTX_CHECKPOINTS", "int", refused(CHECKPOINTS)),
    opt("-cms --checkpoint-min-step", "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", "int", refused(CHECKPOINTS)),
    opt("-cram --cache-ram", "LLAMA_ARG_CACHE_RAM", "int",
        setting("prompt_cache_ram_bytes",
            handlers.cache_ram_bytes, "mapped to `prompt_cache_ram_bytes` (MiB; -1 refused)")),
    opt("-kvu --kv-unified", "LLAMA_ARG_KV_UNIFIED", "switch", switch(
        setting("kv_unified", doc="mapped to `kv_unified` (true): the slots share one pool of -c tokens"),
        setting("kv_unified", doc="mapped to `kv_unified` (false): each slot has -c / -np")),
        negative="-no-kvu --no-kv-unified"),
    opt("--cache-idle-slots", "LLAMA_ARG_CACHE_IDLE_SLOTS", "switch", switch(
        accepted("a slot's prompt goes to the host-RAM tier when the slot is reused (prompt_cache_ram_bytes)"),
        refused("give -cram 0 to turn the host-RAM tier of the prompt cache off")),
        negative="--no-cache-idle-slots"),
    opt("--context-shift", "LLAMA_ARG_CONTEXT_SHIFT", "switch", switch(
        refused("Dormouse never shifts a context: a full slot ends the answer with finish_reason length"),
        accepted("Dormouse never shifts a context")), negative="--no-context-shift"),
    opt("-fa --flash-attn", "LLAMA_ARG_FLASH_ATTN", "string",
        llama("flash_attn_type", handlers.flash_attn_type, "passed to llama.cpp: `llama_options.flash_attn_type` "
              "(on 1, off 0, auto -1; alone, as older llama-server took it: on)")),
    opt("--perf", "LLAMA_ARG_PERF", "switch", switch(accepted(TIMINGS), accepted(TIMINGS)), negative="--no-perf"),
    opt("-e --escape", None, "switch", switch(accepted("prompts arrive as JSON; there is nothing to unescape"),
                                              accepted("prompts arrive as JSON; there is nothing to unescape")),
        negative="--no-escape"),
    opt("-r --reverse-prompt", None, "string", refused("send `stop` in each request")),
    opt("-sp --special", None, "flag", refused("no server-wide switch to print special tokens")),
    opt("--warmup", None, "switch", setting("warmup"), negative="--no-warmup"),
    opt("--spm-infill", None, "flag", refused("/infill builds its prompt in the model's own FIM order")),
    opt("--samplers", None, "string", refused(NO_SAMPLER)),
    opt("-s --seed", None, "string", setting("seed", handlers.seed, "mapped to `seed` (-1 or 4294967295: random)")),
    opt("--sampler-seq --sampling-seq", None, "string", refused(NO_SAMPLER)),
    opt("--ignore-eos", None, "flag", refused(PER_REQUEST)),
    opt("--temp --temperature", "LLAMA_ARG_TEMPERATURE", "string", setting("temperature", parse_float)),
    opt("--top-k", "LLAMA_ARG_TOP_K", "int", setting("top_k")),
    opt("--top-p", "LLAMA_ARG_TOP_P", "string", setting("top_p", parse_float)),
    opt("--min-p", "LLAMA_ARG_MIN_P", "string", setting("min_p", parse_float)),
    opt("--top-nsigma --top-n-sigma", None, "string", refused(NO_SAMPLER)),
    opt("--xtc-probability", None, "string", refused(NO_SAMPLER)),
    opt("--xtc-threshold", None, "string", refused(NO_SAMPLER)),
    opt("--typical --typical-p", None, "string", refused(NO_SAMPLER)),
    opt("--repeat-last-n", None, "int", setting("repeat_last_n")),
    opt("--repeat-penalty", "LLAMA_ARG_REPEAT_PENALTY", "string", setting("repeat_penalty", parse_float)),
    opt("--presence-penalty", "LLAMA_ARG_PRESENCE_PENALTY", "string", setting("presence_penalty", parse_float)),
    opt("--frequency-penalty", "LLAMA_ARG_FREQUENCY_PENALTY", "string", setting("frequency_penalty", parse_float)),
    opt("--dry-multiplier", None, "string", refused(NO_SAMPLER)),
    opt("--dry-base", None, "string", refused(NO_SAMPLER)),
    opt("--dry-allowed-length", None, "int", refused(NO_SAMPLER)),
    opt("--dry-penalty-last-n", None, "int", refused(NO_SAMPLER)),
    opt("--dry-sequence-breaker", None, "string", refused(NO_SAMPLER)),
    opt("--adaptive-target", None, "string", refused(NO_SAMPLER)),
    opt("--adaptive-decay", None, "string", refused(NO_SAMPLER)),
    opt("--dynatemp-range", None, "string", refused(NO_SAMPLER)),
    opt("--dynatemp-exp", None, "string", refused(NO_SAMPLER)),
    opt("--mirostat", None, "int", refused(NO_SAMPLER)),
    opt("--mirostat-lr", None, "string", refused(NO_SAMPLER)),
    opt("--mirostat-ent", None, "string", refused(NO_SAMPLER)),
    opt("-l --logit-bias", None, "string", refused(PER_REQUEST)),
    opt("--grammar", None, "string", refused(PER_REQUEST)),
    opt("--grammar-file", None, "string", refused(PER_REQUEST)),
    opt("-j --json-schema", None, "string", refused(PER_REQUEST)),
    opt("-jf --json-schema-file", None, "string", refused(PER_REQUEST)),
    opt("-bs --backend-sampling", "LLAMA_ARG_BACKEND_SAMPLING", "flag",
        refused("sampling runs in the worker, not on the backend")),
    opt("--pooling", "LLAMA_ARG_POOLING", "string",
        custom("mapped", "mapped to `pooling` (none: a vector per token, on llama-server's /embeddings)",
               handlers.pooling)),
    opt("--rope-scaling", "LLAMA_ARG_ROPE_SCALING_TYPE", "string", llama("rope_scaling_type", choice(ROPE_SCALING))),
    opt("--rope-scale", "LLAMA_ARG_ROPE_SCALE", "string",
        llama("rope_freq_scale", handlers.rope_scale, "passed to llama.cpp: `llama_options.rope_freq_scale` = 1/N")),
    opt("--rope-freq-base", "LLAMA_ARG_ROPE_FREQ_BASE", "string", llama("rope_freq_base", parse_float)),
    opt("--rope-freq-scale", "LLAMA_ARG_ROPE_FREQ_SCALE", "string", llama("rope_freq_scale", parse_float)),
    opt("--yarn-orig-ctx", "LLAMA_ARG_YARN_ORIG_CTX", "int", llama("yarn_orig_ctx"), parse=handlers.non_negative_int),
    opt("--yarn-ext-factor", "LLAMA_ARG_YARN_EXT_FACTOR", "string", llama("yarn_ext_factor", parse_float)),
    opt("--yarn-attn-factor", "LLAMA_ARG_YARN_ATTN_FACTOR", "string", llama("yarn_attn_factor", parse_float)),
    opt("--yarn-beta-slow", "LLAMA_ARG_YARN_BETA_SLOW", "string", llama("yarn_beta_slow", parse_float)),
    opt("--yarn-beta-fast", "LLAMA_ARG_YARN_BETA_FAST", "string", llama("yarn_beta_fast", parse_float)),
    opt("-kvo --kv-offload", "LLAMA_ARG_KV_OFFLOAD", "switch", llama("offload_kqv"), negative="-nkvo --no-kv-offload"),
    opt("--repack", "LLAMA_ARG_REPACK", "switch", setting("cpu_repack"), negative="-nr --no-repack"),
    opt("--no-host", "LLAMA_ARG_NO_HOST", "flag", llama("no_host")),
    opt("-ctk --cache-type-k", "LLAMA_ARG_CACHE_TYPE_K", "string", llama("type_k", choice(KV_CACHE_TYPES))),
    opt("-ctv --cache-type-v", "LLAMA_ARG_CACHE_TYPE_V", "string", llama("type_v", choice(KV_CACHE_TYPES))),
    opt("-dt --defrag-thold", "LLAMA_ARG_DEFRAG_THOLD", "string", llama("defrag_thold", parse_float)),
    opt("-np --parallel", "LLAMA_ARG_N_PARALLEL", "int",
        custom("mapped", "mapped to `parallel` (-1: Dormouse's default)", handlers.parallel_slots)),
    opt("-cb --cont-batching", "LLAMA_ARG_CONT_BATCHING", "switch", switch(
        accepted("Dormouse always batches its slots continuously"),
        refused("Dormouse always batches its slots continuously")), negative="-nocb --no-cont-batching"),
    opt("-mm --mmproj", "LLAMA_ARG_MMPROJ", "string", setting("mmproj")),
    opt("-mmu --mmproj-url", "LLAMA_ARG_MMPROJ_URL", "string", refused(DOWNLOADS)),
    opt("--mmproj-auto", "LLAMA_ARG_MMPROJ_AUTO", "switch", switch(
        refused("Dormouse loads a projector only from --mmproj"),
        accepted("Dormouse loads a projector only from --mmproj")), negative="--no-mmproj --no-mmproj-auto"),
    opt("--mmproj-offload", "LLAMA_ARG_MMPROJ_OFFLOAD", "switch", switch(
        accepted("the projector is on the GPU whenever layers are (-ngl other than 0)"),
        refused("the projector is on the GPU whenever layers are (-ngl other than 0)")),
        negative="--no-mmproj-offload"),
    opt("-mmdev --mmproj-device", "MTMD_BACKEND_DEVICE", "string",
        refused("the projector runs where the model's layers do")),
    opt("--image-min-tokens", "LLAMA_ARG_IMAGE_MIN_TOKENS", "int", refused(MEDIA)),
    opt("--image-max-tokens", "LLAMA_ARG_IMAGE_MAX_TOKENS", "int", refused(MEDIA)),
    opt("--mtmd-batch-max-tokens", "LLAMA_ARG_MTMD_BATCH_MAX_TOKENS", "int", refused(MEDIA)),
    opt("--video-fps", "LLAMA_ARG_VIDEO_FPS", "string", refused("video input is not supported")),
    opt("--video-timestamp-interval", "LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL", "int",
        refused("video input is not supported")),
    opt("--video-ffmpeg-dir", "LLAMA_ARG_VIDEO_FFMPEG_DIR", "string", refused("video input is not supported")),
    opt("--rpc", "LLAMA_ARG_RPC", "string", refused("remote (RPC) backends are not supported")),
    opt("-lm --load-mode", "LLAMA_ARG_LOAD_MODE", "string",
        setting("load_mode", handlers.load_mode, "mapped to `load_mode` (dio: direct_io)")),
    opt("-lzm --lazy-mode", "LLAMA_ARG_LAZY_MODE", "string", llama("lazy_mode", choice(LAZY_MODES))),
    opt("--numa", "LLAMA_ARG_NUMA", "string", refused("run the daemon under numactl instead")),
    opt("-dev --device", "LLAMA_ARG_DEVICE", "string",
        refused("choose devices with CUDA_VISIBLE_DEVICES (or HIP_/GGML_VK_VISIBLE_DEVICES)")),
    opt("--list-devices", None, "flag", refused(COMMAND)),
    opt("-ot --override-tensor", "LLAMA_ARG_OVERRIDE_TENSOR", "string", refused(TENSOR_OVERRIDES)),
    opt("-cmoe --cpu-moe", "LLAMA_ARG_CPU_MOE", "flag", refused(TENSOR_OVERRIDES)),
    opt("-ncmoe --n-cpu-moe", "LLAMA_ARG_N_CPU_MOE", "int", refused(TENSOR_OVERRIDES)),
    opt("-ncffn --n-cpu-ffn", "LLAMA_ARG_N_CPU_FFN", "int", refused(TENSOR_OVERRIDES)),
    opt("-ngl --gpu-layers --n-gpu-layers", "LLAMA_ARG_N_GPU_LAYERS", "string",
        setting("n_gpu_layers", handlers.gpu_layers, "mapped to `n_gpu_layers` (auto, all: -1, every layer)")),
    opt("-sm --split-mode", "LLAMA_ARG_SPLIT_MODE", "string", llama("split_mode", choice(SPLIT_MODES))),
    opt("-ts --tensor-split", "LLAMA_ARG_TENSOR_SPLIT", "string",
        refused("a list of proportions cannot pass through llama_options (scalars only); choose GPUs with "
                "CUDA_VISIBLE_DEVICES")),
    opt("-mg --main-gpu", "LLAMA_ARG_MAIN_GPU", "int", llama("main_gpu")),
    opt("-fit --fit", "LLAMA_ARG_FIT", "string", by_value(
        {"on": refused(FIT), "off": accepted(FIT), "auto": refused(FIT)}, f"off accepted, on refused: {FIT}")),
    opt("-fitt --fit-target", "LLAMA_ARG_FIT_TARGET", "string", refused(FIT)),
    opt("-fitc --fit-ctx", "LLAMA_ARG_FIT_CTX", "int", refused(FIT)),
    opt("--check-tensors", None, "flag", llama("check_tensors")),
    opt("--override-kv", None, "string", refused(TENSOR_OVERRIDES)),
    opt("--op-offload", None, "switch", llama("op_offload"), negative="--no-op-offload"),
    opt("--lora", None, "string", refused(ADAPTERS)),
    opt("--lora-scaled", None, "string", refused(ADAPTERS)),
    opt("--control-vector", None, "string", refused(ADAPTERS)),
    opt("--control-vector-scaled", None, "string", refused(ADAPTERS)),
    opt("--control-vector-layer-range", None, "two", refused(ADAPTERS)),
    opt("-a --alias", "LLAMA_ARG_ALIAS", "string", custom(
        "mapped", "mapped to `models`: the first name is the model's id, the others its aliases",
            handlers.model_aliases)),
    opt("--tags", "LLAMA_ARG_TAGS", "string", setting("tags", comma_list,
        "mapped to `tags` (labels /v1/models and /models show; informational, as in llama-server)")),
    opt("-m --model", "LLAMA_ARG_MODEL", "string", setting("model")),
    opt("-mu --model-url", "LLAMA_ARG_MODEL_URL", "string", refused(DOWNLOADS)),
    opt("-dr --docker-repo", "LLAMA_ARG_DOCKER_REPO", "string", refused(DOWNLOADS)),
    opt("-hf -hfr --hf-repo", "LLAMA_ARG_HF_REPO", "string", setting("hf_repo")),
    opt("-hff --hf-file", "LLAMA_ARG_HF_FILE", "string", setting("hf_file")),
    opt("-hft --hf-token", "HF_TOKEN", "string",
        refused("a token on a command line is visible to every user (ps); set HF_TOKEN in the environment"),
        env_does=accepted("HF_TOKEN is read by the Hugging Face client when -hf downloads")),
    opt("--embd-normalize", None, "int", refused("Dormouse's embeddings are always L2-normalized")),
    opt("--host", "LLAMA_ARG_HOST", "string", custom("mapped", "mapped to `host` (a .sock path refused)",
        handlers.bind_host)),
    opt("--port", "LLAMA_ARG_PORT", "int", setting("port")),
    opt("--reuse-port", "LLAMA_ARG_REUSE_PORT", "flag", refused("one daemon serves a port (use systemd socket "
                                                                "activation to hand one over)")),
    opt("--path", "LLAMA_ARG_STATIC_PATH", "string", refused("Dormouse serves no static files")),
    opt("--cors-origins", "LLAMA_ARG_CORS_ORIGINS", "string", setting("cors_origins", comma_list)),
    opt("--cors-methods", "LLAMA_ARG_CORS_METHODS", "string",
        refused("CORS answers are Dormouse's own; only the origins (--cors-origins) are a setting")),
    opt("--cors-headers", "LLAMA_ARG_CORS_HEADERS", "string",
        refused("CORS answers are Dormouse's own; only the origins (--cors-origins) are a setting")),
    opt("--cors-credentials", "LLAMA_ARG_CORS_CREDENTIALS", "switch", switch(
        refused("Dormouse does not allow credentialed cross-origin requests"),
        accepted("Dormouse does not allow credentialed cross-origin requests")), negative="--no-cors-credentials"),
    opt("--api-prefix", "LLAMA_ARG_API_PREFIX", "string",
        refused("routes are served at the root; add a prefix in the proxy in front")),
    opt("--ui-config --webui-config", "LLAMA_ARG_UI_CONFIG", "string", refused(NO_UI)),
    opt("--ui-config-file --webui-config-file", "LLAMA_ARG_UI_CONFIG_FILE", "string", refused(NO_UI)),
    opt("--ui-mcp-proxy --webui-mcp-proxy", "LLAMA_ARG_UI_MCP_PROXY", "switch", setting("cors_proxy"),
        negative="--no-ui-mcp-proxy --no-webui-mcp-proxy"),
    opt("--tools", "LLAMA_ARG_TOOLS", "string", setting("tools", comma_list)),
    opt("--tools-runtime", "LLAMA_ARG_TOOLS_RUNTIME", "string", setting("tools_runtime")),
    opt("--mcp-servers-config", "LLAMA_ARG_MCP_SERVERS_CONFIG", "string", custom(
        "mapped", "mapped to `mcp_servers`, read from the file at start", _mcp_servers_file)),
    opt("--mcp-servers-json", "LLAMA_ARG_MCP_SERVERS_JSON", "string", custom(
        "mapped", "mapped to `mcp_servers`", _mcp_servers)),
    opt("-ag --agent", "LLAMA_ARG_AGENT", "switch", switch(
        const({"tools": ["all"], "cors_proxy": True}, "mapped to `tools = [\"all\"]` and `cors_proxy = true`"),
        const({"tools": [], "cors_proxy": False}, "mapped to `tools = []` and `cors_proxy = false`")),
        negative="-no-ag --no-agent"),
    opt("--ui --webui", "LLAMA_ARG_UI", "switch", setting(
        "status_page", doc="mapped to `status_page` (Dormouse's status page at /, not llama-server's chat UI)"),
        negative="--no-ui --no-webui"),
    opt("--embedding --embeddings", "LLAMA_ARG_EMBEDDINGS", "flag", const({"embeddings": True},
                                                                          "mapped to `embeddings` = true")),
    opt("--rerank --reranking", "LLAMA_ARG_RERANKING", "flag", const(
        {"embeddings": True, "pooling": "rank"}, "mapped to `embeddings` = true, `pooling` = rank")),
    opt("--api-key", "LLAMA_API_KEY", "string",
        custom("mapped", "mapped to `api_key` (several, comma-separated: `api_keys` key1, key2, ...)",
            handlers.api_key_list)),
    opt("--api-key-file", "LLAMA_ARG_API_KEY_FILE", "string", custom(
        "mapped", "mapped to `api_key` / `api_keys`: the file's keys, read at start", handlers.api_key_file)),
    opt("--ssl-key-file", "LLAMA_ARG_SSL_KEY_FILE", "string", refused("terminate TLS in a proxy in front (deploy/)")),
    opt("--ssl-cert-file", "LLAMA_ARG_SSL_CERT_FILE", "string", refused("terminate TLS in a proxy in front (deploy/)")),
    opt("--chat-template-kwargs", "LLAMA_ARG_CHAT_TEMPLATE_KWARGS", "string", custom(
        "mapped", "mapped to `chat_template_kwargs` (a JSON object; a request's own chat_template_kwargs win)",
        _chat_template_kwargs)),
    opt("-to --timeout", "LLAMA_ARG_TIMEOUT", "int",
        refused("Dormouse has no server-wide read/write timeout; set one in the proxy in front")),
    opt("--sse-ping-interval", "LLAMA_ARG_SSE_PING_INTERVAL", "int", refused("Dormouse sends no SSE pings")),
    opt("--threads-http", "LLAMA_ARG_THREADS_HTTP", "int",
        accepted("Dormouse serves HTTP on one event loop: there is no thread pool to size")),
    opt("--cache-prompt", "LLAMA_ARG_CACHE_PROMPT", "switch", switch(
        accepted("Dormouse always caches prompts"),
        refused("send cache_prompt: false in a request that must not reuse the cache")),
        negative="--no-cache-prompt"),
    opt("--cache-reuse", "LLAMA_ARG_CACHE_REUSE", "int",
        accepted("Dormouse reuses shared prefixes by its own rule (cache_deterministic)")),
    opt("--metrics", "LLAMA_ARG_ENDPOINT_METRICS", "flag", custom(
        "mapped", "mapped to `metrics_endpoint` = true and `metrics_compat` = llamacpp: /metrics carries "
                  "llama-server's `llamacpp:` names beside Dormouse's own (without --metrics it is served too, "
                  "unless metrics_endpoint = false)", handlers.llamacpp_metrics)),
    opt("--props", "LLAMA_ARG_ENDPOINT_PROPS", "flag", refused("POST /props cannot change Dormouse's settings")),
    opt("--slots", "LLAMA_ARG_ENDPOINT_SLOTS", "switch", setting("slots_endpoint"), negative="--no-slots"),
    opt("--slot-save-path", None, "string", setting("slot_save_path")),
    opt("--media-path", None, "string", refused("local media files are not read: send images in the request")),
    opt("--models-dir", "LLAMA_ARG_MODELS_DIR", "string", setting("models_dir")),
    opt("--models-preset", "LLAMA_ARG_MODELS_PRESET", "string", custom(
        "mapped", "read: each section becomes a `[models.ID]` table, its options translated as on the command "
                  "line", handlers.models_preset)),
    opt("--models-max", "LLAMA_ARG_MODELS_MAX", "int", setting("models_max")),
    opt("--models-autoload", "LLAMA_ARG_MODELS_AUTOLOAD", "switch", setting("models_autoload"),
        negative="--no-models-autoload"),
    opt("--jinja", "LLAMA_ARG_JINJA", "switch", switch(
        accepted("Dormouse always renders the Jinja chat template"),
        # llama-server without --jinja picks a built-in template by name; Dormouse renders the GGUF's own, which a
        # built-in one only imitates. Accepted (llama-server's test suite passes --no-jinja on every start).
        accepted("Dormouse always renders the model's Jinja chat template")), negative="--no-jinja"),
    opt("--reasoning-format", "LLAMA_ARG_THINK", "string", refused(REASONING)),
    opt("-rea --reasoning", "LLAMA_ARG_REASONING", "string", custom(
        "mapped / accepted", "off: mapped to `chat_template_kwargs` enable_thinking = false (a request's own "
        "chat_template_kwargs win); on, auto: accepted (templates render with enable_thinking = true, the default)",
        _reasoning)),
    opt("--reasoning-effort", "LLAMA_ARG_REASONING_EFFORT", "string", refused(REASONING)),
    opt("--reasoning-budget", "LLAMA_ARG_THINK_BUDGET", "int", custom(
        "mapped / accepted / refused", "0: mapped to `chat_template_kwargs` enable_thinking = false (as older "
        "llama-server); -1: accepted (no budget, the default); other budgets refused (Dormouse does not count "
        "thinking tokens)", _reasoning_budget)),
    opt("--reasoning-budget-message", "LLAMA_ARG_THINK_BUDGET_MESSAGE", "string", refused(REASONING)),
    opt("--reasoning-preserve", "LLAMA_ARG_REASONING_PRESERVE", "switch", refused(REASONING),
        negative="--no-reasoning-preserve"),
    opt("--chat-template", "LLAMA_ARG_CHAT_TEMPLATE", "string", setting("chat_template")),
    opt("--chat-template-file", "LLAMA_ARG_CHAT_TEMPLATE_FILE", "string", setting("chat_template_file")),
    opt("--skip-chat-parsing", "LLAMA_ARG_SKIP_CHAT_PARSING", "switch", switch(
        refused("Dormouse always parses tool calls and reasoning out of an answer"),
        accepted("Dormouse always parses tool calls and reasoning out of an answer")),
        negative="--no-skip-chat-parsing"),
    opt("--prefill-assistant", "LLAMA_ARG_PREFILL_ASSISTANT", "switch", switch(
        accepted("a conversation ending with an assistant message is continued by default"),
        refused("send continue_final_message: false in the request instead")), negative="--no-prefill-assistant"),
    opt("-sps --slot-prompt-similarity", None, "string",
        refused("Dormouse chooses a slot by its prompt cache, not by a similarity threshold")),
    opt("--lora-init-without-apply", None, "flag", refused(ADAPTERS)),
    opt("--sleep-idle-seconds", None, "int", setting("sleep_idle_seconds"), parse=parse_float),
    opt("--log-disable", None, "flag", const({"log_level": "error"}, "mapped to `log_level` = error")),
    opt("--log-file", "LLAMA_ARG_LOG_FILE", "string",
        refused("Dormouse logs to stderr (the journal, docker logs); redirect it there")),
    opt("--log-jsonl", "LLAMA_ARG_LOG_JSONL", "switch", switch(
        const({"log_format": "json"}, "mapped to `log_format` = json"),
        const({"log_format": "console"}, "mapped to `log_format` = console")), negative="--no-log-jsonl"),
    opt("--log-prompts-dir", None, "string", refused("Dormouse does not write prompts to files")),
    opt("--log-colors", "LLAMA_ARG_LOG_COLORS", "string",
        accepted("the console format colours its lines when stderr is a terminal")),
    opt("-v --verbose --log-verbose", None, "flag",
        const({"log_level": "debug", "verbose_answers": True},
              "mapped to `log_level` = debug and `verbose_answers` = true (`__verbose` in chat answers)")),
    opt("--offline", "LLAMA_ARG_OFFLINE", "flag", accepted("Dormouse downloads nothing unless -hf names a model")),
    opt("-lv --verbosity --log-verbosity", "LLAMA_ARG_LOG_VERBOSITY", "int",
        setting("log_level",
            handlers.log_verbosity, "mapped to `log_level` (<= 1 error, 2 warning, 3 info, more debug)")),
    opt("--log-prefix", "LLAMA_ARG_LOG_PREFIX", "switch", switch(accepted(LOG_FORMAT), accepted(LOG_FORMAT)),
        negative="--no-log-prefix"),
    opt("--log-timestamps", "LLAMA_ARG_LOG_TIMESTAMPS", "switch", switch(accepted(LOG_FORMAT), accepted(LOG_FORMAT)),
        negative="--no-log-timestamps"),
    opt("--spec-draft-hf -hfd -hfrd --hf-repo-draft", "LLAMA_ARG_SPEC_DRAFT_HF_REPO", "string",
        refused("give the draft model as a file (-md)")),
    opt("--spec-draft-threads -td --threads-draft", None, "int", refused(DRAFT_TUNING)),
    opt("--spec-draft-threads-batch -tbd --threads-batch-draft", None, "int", refused(DRAFT_TUNING)),
    opt("--spec-draft-cpu-mask -Cd --cpu-mask-draft", None, "string", refused(AFFINITY)),
    opt("--spec-draft-cpu-range -Crd --cpu-range-draft", None, "string", refused(AFFINITY)),
    opt("--spec-draft-cpu-strict --cpu-strict-draft", None, "int", refused(AFFINITY)),
    opt("--spec-draft-prio --prio-draft", None, "int", refused(AFFINITY)),
    opt("--spec-draft-poll --poll-draft", None, "int", refused(AFFINITY)),
    opt("--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft", None, "string", refused(AFFINITY)),
    opt("--spec-draft-cpu-strict-batch --cpu-strict-batch-draft", None, "int", refused(AFFINITY)),
    opt("--spec-draft-prio-batch --prio-batch-draft", None, "int", refused(AFFINITY)),
    opt("--spec-draft-poll-batch --poll-batch-draft", None, "int", refused(AFFINITY)),
    opt("--spec-draft-type-k -ctkd --cache-type-k-draft", "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K", "string",
        refused(DRAFT_TUNING)),
    opt("--spec-draft-type-v -ctvd --cache-type-v-draft", "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V", "string",
        refused(DRAFT_TUNING)),
    opt("--spec-draft-override-tensor -otd --override-tensor-draft", None, "string", refused(TENSOR_OVERRIDES)),
    opt("--spec-draft-cpu-moe -cmoed --cpu-moe-draft", "LLAMA_ARG_SPEC_DRAFT_CPU_MOE", "flag",
        refused(TENSOR_OVERRIDES)),
    opt("--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft", "LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE", "int",
        refused(TENSOR_OVERRIDES)),
    opt("--spec-draft-n-max", "LLAMA_ARG_SPEC_DRAFT_N_MAX", "int", setting("draft_max")),
    opt("--spec-draft-n-min", "LLAMA_ARG_SPEC_DRAFT_N_MIN", "int", setting("draft_min")),
    opt("--spec-synth-len", "LLAMA_ARG_SPEC_SYNTH_LEN", "string", refused(NGRAM)),
    opt("--spec-synth-rates", "LLAMA_ARG_SPEC_SYNTH_RATES", "string", refused(NGRAM)),
    opt("--spec-draft-p-split --draft-p-split", "LLAMA_ARG_SPEC_DRAFT_P_SPLIT", "string",
        refused("Dormouse drafts one sequence per slot: there is no tree to split")),
    opt("--spec-draft-p-min --draft-p-min", "LLAMA_ARG_SPEC_DRAFT_P_MIN", "string",
        setting("draft_p_min", parse_float)),
    opt("--spec-draft-backend-sampling", "LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING", "switch", switch(
        refused("sampling runs in the worker, not on the backend"),
        accepted("sampling runs in the worker, not on the backend")), negative="--no-spec-draft-backend-sampling"),
    opt("--spec-draft-device -devd --device-draft", None, "string", refused(DRAFT_TUNING)),
    opt("--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft", "LLAMA_ARG_N_GPU_LAYERS_DRAFT", "string",
        refused("the draft model is offloaded as the main model is (-ngl)")),
    opt("--spec-draft-model -md --model-draft", "LLAMA_ARG_SPEC_DRAFT_MODEL", "string", setting("model_draft")),
    opt("--spec-type", "LLAMA_ARG_SPEC_TYPE", "string", custom(
        "accepted", "draft-simple accepted (Dormouse drafts with the draft model, -md, at llama-server's p-min "
                    "of 0 unless --spec-draft-p-min is given), none accepted (a -md beside it is not loaded); the "
                    "n-gram, lookup and model-specific types refused",
        _spec_type)),
    *(opt(spelling, None, "int", refused(NGRAM)) for spelling in (
        "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max", "--spec-ngram-mod-n-match", "--spec-ngram-simple-size-n",
        "--spec-ngram-simple-size-m", "--spec-ngram-simple-min-hits", "--spec-ngram-map-k-size-n",
        "--spec-ngram-map-k-size-m", "--spec-ngram-map-k-min-hits", "--spec-ngram-map-k4v-size-n",
        "--spec-ngram-map-k4v-size-m", "--spec-ngram-map-k4v-min-hits")),
    opt("--draft --draft-n --draft-max", "LLAMA_ARG_DRAFT_MAX", "int", setting("draft_max")),
    opt("--draft-min --draft-n-min", "LLAMA_ARG_DRAFT_MIN", "int", setting("draft_min")),
    *(opt(spelling, None, "int", refused(NGRAM))
      for spelling in ("--spec-ngram-size-n", "--spec-ngram-size-m", "--spec-ngram-min-hits")),
    *(opt(spelling, None, "flag", refused(PRESET)) for spelling in (
        "--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default", "--fim-qwen-7b-default",
        "--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--fim-qwen-30b-default", "--gpt-oss-20b-default",
        "--gpt-oss-120b-default", "--vision-gemma-4b-default", "--vision-gemma-12b-default", "--spec-default")),
)


# Spellings of older llama-server versions that scripts still carry (llama.cpp replaced them with
# --load-mode); not in this commit's --help, so not in the snapshot.
LEGACY: tuple[Option, ...] = (
    opt("--mlock", "LLAMA_ARG_MLOCK", "flag",
        custom("mapped", "mapped to `load_mode` = mmap+mlock (mlock with --no-mmap)", handlers.legacy_mlock)),
    opt("--mmap", "LLAMA_ARG_MMAP", "switch",
        custom("mapped", "mapped to `load_mode`: mmap; off: none (mlock with --mlock)",
            handlers.legacy_mmap), negative="--no-mmap"),
)


def by_spelling() -> dict[str, tuple[Option, bool]]:
    """Each spelling -> its option and whether it is the positive one."""
    out: dict[str, tuple[Option, bool]] = {}
    for option in OPTIONS + LEGACY:
        for spelling in option.spellings:
            out[spelling] = (option, True)
        for spelling in option.negative:
            out[spelling] = (option, False)
    return out


def by_env() -> dict[str, tuple[Option, bool]]:
    """Each LLAMA_ARG_* variable (and the LLAMA_ARG_NO_* form of a switch's) -> its option, and positive or not."""
    out: dict[str, tuple[Option, bool]] = {}
    for option in OPTIONS + LEGACY:
        if option.env:
            out[option.env] = (option, True)
            if option.negative:
                out[option.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)] = (option, False)
    return out

