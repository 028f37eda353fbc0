"""The `dormouse` command: `serve`, `check-config`, and `status`, `sleep`,
`wake` for a running daemon."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from config import ConfigError, load_settings
from daemon.pull import add_pull_command, run_pull

# CLI flag -> settings key. Names follow llama-server where both have the option.
_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--host", {"help": "address to bind (default 127.0.0.1)"}),
    ("--port", {"type": int, "help": "port (default 8080)"}),
    ("--model", {"help": "GGUF model file (default: the bundled Gemma 3 270M)"}),
    ("--model-draft", {"help": "draft model for speculative decoding"}),
    ("--mmproj", {"help": "multimodal projector GGUF"}),
    ("--draft-max", {"type": int, "help": "most tokens the draft proposes per step (default 16)"}),
    ("--draft-min", {"type": int, "help": "fewest drafted tokens worth verifying (default 0)"}),
    ("--draft-p-min", {"type": float, "help": "stop drafting below this draft probability (default 0.75)"}),
    ("--ctx-size", {"type": int, "help": "context size shared by the slots (default 4096)"}),
    ("--parallel", {"type": int, "help": "number of slots (default 4)"}),
    ("--threads", {"type": int, "help": "CPU threads (default: all cores)"}),
    ("--n-gpu-layers", {"type": int, "help": "layers to offload to the GPU (-1 all, the default)"}),
    ("--batch-size", {"type": int, "help": "tokens per decode step (default 512)"}),
    ("--chat-template-file", {"help": "Jinja chat template overriding the model's"}),
    ("--chat-template", {"help": "chat template overriding the model's: Jinja text or one of llama.cpp's built-in "
                                 "names (chatml, llama3, gemma, mistral-v7, phi3, ...)"}),
    ("--slot-save-path", {"help": "where POST /slots/{id}?action=save|restore keeps named prompt-cache files "
                                  "(default: those actions are off)"}),
    ("--embeddings", {"action": "store_true",
                      "help": "serve /v1/embeddings (a pooled context; the model then generates no text)"}),
    ("--pooling", {"choices": ["mean", "cls", "last", "rank"],
                 "help": "how --embeddings pools token vectors (default mean; rank: a reranker, /v1/rerank)"}),
    ("--sleep-idle-seconds", {"type": float, "help": "sleep after this many idle seconds (default 300, -1 never)"}),
    ("--drowsy-after", {"type": float, "help": "idle seconds before the worker frees its contexts and keeps the "
                                               "weights (the drowsy tier; default -1: off)"}),
    ("--deep-after", {"type": float, "help": "seconds a sleeping model's file stays warm in the page cache (the "
                                             "light tier) before nothing is held (default 0: deep at once; -1: "
                                             "light until woken)"}),
    ("--load-mode", {"choices": ["auto", "mmap", "none", "mlock", "mmap+mlock", "direct_io"],
                     "help": "how the worker reads the weights (default auto: mmap where every device supports it)"}),
    ("--wake-timeout", {"type": float, "help": "how long a request waits for a wake before 503 (default 120)"}),
    ("--max-queued", {"type": int, "help": "requests accepted beyond the slots (default 128)"}),
    ("--api-key", {"help": "Bearer key required on /v1/*, /api/*, /props and /slots (several named keys: api_keys "
                           "in the config file, or DORMOUSE_API_KEYS=name:key,name:key)"}),
    ("--admin-key", {"help": "Bearer key required on /sleep, /wake, /models/load|unload and for Ollama's load and "
                             "unload (keep_alive); required off loopback"}),
    ("--raw-grammar", {"action": "store_true", "help": "accept llama-server's raw GBNF `grammar` field (trusted clients "
                                                       "only: a grammar can stall every slot)"}),
    ("--n-predict", {"type": int, "help": "tokens a request generates when it names no limit (-1: until the end; "
                                          "default: 256 on the OpenAI routes, -1 on /completion)"}),
    ("--seed", {"type": int, "help": "sampling seed of a request that names none (default -1: random)"}),
    ("--temp", {"type": float, "dest": "temperature", "help": "temperature of a request that names none (default 0.8)"}),
    ("--log-format", {"choices": ["auto", "console", "json"]}),
    ("--log-level", {"choices": ["debug", "info", "warning", "error"]}),
    ("--shutdown-timeout", {"type": float, "help": "seconds SIGTERM lets in-flight requests finish (default 30)"}),
    ("--state-dir", {"help": "state directory: prompt cache, wake history, models by name (default $STATE_DIRECTORY or ~/.cache/dormouse)"}),
    ("--agent-port", {"type": int, "help": "answer HAProxy's agent check on this port (default off)"}),
    ("--drain-grace-seconds", {"type": float, "help": "with --agent-port: after SIGTERM, answer weight 0 and keep "
                                                      "serving this long (default 2)"}),
    ("--memory-budget", {"help": "bytes the models may hold together, e.g. 20GiB (default: GPU total less 1 GiB, "
                                 "or 75%% of available RAM)"}),
    ("--default-model", {"help": "the [models.ID] that requests naming no model go to"}),
]


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("dormouse")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dormouse", description="A GGUF model server that sleeps when idle.")
    parser.add_argument("--version", action="version", version=f"dormouse {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_pull_command(commands)
    for name, help_text in (("status", "print the running daemon's state and every model's (never wakes one)"),
                            ("sleep", "put a model to sleep now (without --model: every idle model)"),
                            ("wake", "wake a model (without --model: the default) and wait until it is ready")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--model", help="a model id or alias (see status)")
        sub.add_argument("--url", default=None, help="the daemon: host:port or http://host:port (default "
                                                     "$DORMOUSE_URL, else 127.0.0.1:8080)")
        sub.add_argument("--json", action="store_true", help="print the daemon's JSON answer, not a summary")
        sub.add_argument("--admin-key", default=os.environ.get("DORMOUSE_ADMIN_KEY"),
                         help="admin key, if one is set (also DORMOUSE_ADMIN_KEY)")
        sub.add_argument("--api-key", default=os.environ.get("DORMOUSE_API_KEY"),
                         help="API key, if one is set: status needs it (or the admin key), and so do sleep and "
                              "wake when no admin key is set (also DORMOUSE_API_KEY)")
    for name, help_text in (("serve", "run the daemon"), ("check-config", "print the effective settings and exit")):
        sub = commands.add_parser(name, help=help_text, argument_default=argparse.SUPPRESS)
        sub.add_argument("--config", help="TOML settings file (default: $DORMOUSE_CONFIG, else the first that exists "
                                          "of ~/.config/dormouse/dormouse.toml and /etc/dormouse/dormouse.toml)")
        for flag, options in _FLAGS:
            sub.add_argument(flag, **options)
        sub.add_argument("--spawn-ahead", dest="spawn_ahead", action=argparse.BooleanOptionalAction,
                         help="start the next worker as soon as one exits (default on)")
        sub.add_argument("--warmup", dest="warmup", action=argparse.BooleanOptionalAction,
                         help="one decode after load (default on)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # `dormouse status | head -1`: the reader left; no traceback. Python's own advice: point
        # stdout at /dev/null so that the flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    translation = None
    if argv[:1] in (["serve"], ["check-config"]):
        # llama-server's spellings and LLAMA_ARG_* variables are aliases (daemon/llama_server_args.py)
        from daemon.llama_server_args import LlamaServerArgsError, translate

        try:
            translation = translate(argv[1:], os.environ)
        except LlamaServerArgsError as exc:
            print(f"dormouse: {exc}", file=sys.stderr)
            return 2
        for note in translation.notes:
            print(f"dormouse: {note}", file=sys.stderr)
        argv = [argv[0], *translation.rest]
    args = vars(_parser().parse_args(argv))
    command = args.pop("command")
    if command == "pull":
        return run_pull(argparse.Namespace(**args))
    if command in ("status", "sleep", "wake"):
        from daemon.remote import run_remote

        code = run_remote(command, args["url"], args["admin_key"], args["api_key"], args["model"], args["json"])
        sys.stdout.flush()  # a closed pipe raises here, inside main's guard, not at exit
        return code
    config_file = args.pop("config", None)
    origins: dict[str, str] = {}  # the llama-server option or LLAMA_ARG_* variable behind a setting, for its errors
    if translation is not None:
        origins = {key: origin for key, origin in translation.origins.items() if args.get(key) is None}
        args = {**translation.serve_settings(), **args}
        from config.vertex_ai import VERTEX_VARIABLES, VertexAIError, vertex_settings

        try:
            vertex, notes = vertex_settings(os.environ)
        except VertexAIError as exc:
            print(f"dormouse: {exc}", file=sys.stderr)
            return 2
        for note in notes:
            print(f"dormouse: {note}", file=sys.stderr)
        args = {**args, **vertex}  # the platform's port wins over the command line's, as in llama-server
        origins.update({key: f"environment {VERTEX_VARIABLES[key]}" for key in vertex})
    try:
        settings = load_settings(config_file, args, origins)
    except ConfigError as exc:
        print(f"dormouse: {exc}", file=sys.stderr)
        return 2

    from daemon.fleet.plans import add_footprints, footprint_store, model_plans
    from daemon.model.files import ModelFileError
    from daemon.model.gguf_check import check_plan_files

    try:
        plans = model_plans(settings, fetch=command != "check-config")  # check-config downloads nothing
        for plan in plans:
            if plan.hub is not None and not plan.files_present:
                continue  # a model by name not fetched yet: serve checks its files once downloaded
            try:
                check_plan_files(plan.model_path, plan.settings)
            except ModelFileError as exc:
                raise ModelFileError(f"[models.{plan.id}]: {exc}" if settings.models else str(exc)) from None
    except ModelFileError as exc:
        print(f"dormouse: {exc}", file=sys.stderr)
        return 2
    if command == "check-config":
        return _check_config(settings, plans, config_file)

    from daemon.logs import configure_logging, get_logger
    from daemon.server import run

    configure_logging(settings.log_format, settings.log_level)  # the footprints' warnings go to the log
    add_footprints(plans, footprint_store(settings, get_logger()))
    return run(settings, plans, reload_settings=lambda: load_settings(config_file, args, origins))


def _check_config(settings, plans, config_file: str | None = None) -> int:
    """Print what was read (the config file, the DORMOUSE_* variables), the effective settings,
    the fleet with each model's footprint, the memory budget and the stop budget; exit 2 if a
    model can never fit. A state directory that cannot be written is said on stderr too."""
    from config import Settings
    from config.sources import environment_used, find_config_file
    from daemon.fleet.plans import add_footprints, footprint_store, memory_budget
    from daemon.model.files import state_dir
    from daemon.model.footprint import plausible
    from daemon.server import stop_budget
    from daemon.state_dir_check import state_dir_warning

    found = find_config_file(config_file)
    read = {"config_file": str(found.path) if found.path else None, "config_file_from": found.how,
            "environment": environment_used(set(Settings.model_fields))}
    for name, what in read["environment"].items():
        if what.startswith("IGNORED"):
            print(f"dormouse: warning: environment variable {name} is not a setting and is ignored", file=sys.stderr)
    warning = state_dir_warning(state_dir(settings))
    if warning:
        print(f"dormouse: warning: {warning}", file=sys.stderr)

    add_footprints(plans, footprint_store(settings))
    budget = memory_budget(settings)
    models = {}
    for plan in plans:
        models[plan.id] = {
            "path": plan.model_path, "aliases": list(plan.aliases), "pinned": plan.pinned, "default": plan.is_default,
            "loads_at_start": plan.load_at_start,
            "predicted_bytes": plan.predicted.components() if plan.predicted else None,
            "predicted_total_bytes": plan.predicted_bytes,
            "prediction_error": plan.predicted_error,
            "measured_bytes": plan.measured,
            "settings": {k: str(v) if hasattr(v, "__fspath__") else v for k, v in plan.overrides.items()},
            "hub": plan.hub,  # a model by name: "found in the cache at ..." or "would download ... into ..."
        }
        if plan.hub is not None:
            print(f"dormouse: model {plan.id}: {plan.hub}", file=sys.stderr)
    print(json.dumps({"read": read, "state_dir": {"path": str(state_dir(settings)), "warning": warning},
                      "settings": settings.public_dict(), "models": models,
                      "memory_budget": {"bytes": budget.bytes, "from": budget.how},
                      "stop_budget_seconds": stop_budget(settings)}, indent=2))
    def believed(plan) -> int:  # a stored figure far from the prediction is not believed (as at serve)
        if plan.measured and (plan.predicted is None or plausible(plan.measured, plan.predicted.total)):
            return sum(plan.measured.values())
        return plan.predicted_bytes

    too_big = [p for p in plans if believed(p) > budget.bytes]
    for plan in too_big:
        print(f"dormouse: model {plan.id} needs {plan.predicted_bytes} bytes, more than the memory budget of "
              f"{budget.bytes} bytes ({budget.how})", file=sys.stderr)
    return 2 if too_big and (len(plans) > 1 or settings.memory_budget is not None) else 0


if __name__ == "__main__":
    sys.exit(main())
