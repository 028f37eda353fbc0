"""The `dormouse` command: `serve`, `check-config`, and `status`, `sleep`,
`wake` for a running daemon."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from config import ConfigError, load_settings

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
    ("--state-dir", {"help": "where the bundled model is written"}),
    ("--agent-port", {"type": int, "help": "answer HAProxy's agent check on this port (default off)"}),
    ("--drain-grace-seconds", {"type": float, "help": "with --agent-port: after SIGTERM, answer weight 0 and keep "
                                                      "serving this long (default 2)"}),
    ("--memory-budget", {"help": "bytes the models may hold together, e.g. 20GiB (default: GPU total less 1 GiB, "
                                 "or 75%% of available RAM)"}),
    ("--default-model", {"help": "the [models.ID] that requests naming no model go to"}),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dormouse", description="A GGUF model server that sleeps when idle.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("status", "print the running daemon's state and every model's (never wakes one)"),
                            ("sleep", "put a model to sleep now (without --model: every idle model)"),
                            ("wake", "wake a model (without --model: the default) and wait until it is ready")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--model", help="a model id or alias (see status)")
        sub.add_argument("--url", default="http://127.0.0.1:8080", help="the daemon (default http://127.0.0.1:8080)")
        sub.add_argument("--admin-key", default=os.environ.get("DORMOUSE_ADMIN_KEY"),
                         help="admin key, if one is set (also DORMOUSE_ADMIN_KEY)")
        sub.add_argument("--api-key", default=os.environ.get("DORMOUSE_API_KEY"),
                         help="API key, if one is set: status needs it (or the admin key), and so do sleep and "
                              "wake when no admin key is set (also DORMOUSE_API_KEY)")
    for name, help_text in (("serve", "run the daemon"), ("check-config", "print the effective settings and exit")):
        sub = commands.add_parser(name, help=help_text, argument_default=argparse.SUPPRESS)
        sub.add_argument("--config", help="TOML settings file (also DORMOUSE_CONFIG)")
        for flag, options in _FLAGS:
            sub.add_argument(flag, **options)
        sub.add_argument("--spawn-ahead", dest="spawn_ahead", action=argparse.BooleanOptionalAction,
                         help="start the next worker as soon as one exits (default on)")
        sub.add_argument("--warmup", dest="warmup", action=argparse.BooleanOptionalAction,
                         help="one decode after load (default on)")
    return parser


def _remote(command: str, url: str, admin_key: str | None, api_key: str | None = None, model: str | None = None) -> int:
    """status / sleep / wake against a running daemon, with the standard library only."""
    import urllib.error
    import urllib.parse
    import urllib.request

    path, method = {"status": ("/props", "GET"), "sleep": ("/sleep", "POST"), "wake": ("/wake", "POST")}[command]
    if model is not None:
        path += "?" + urllib.parse.urlencode({"model": model})
    # A POST declares JSON: the daemon refuses other bodies (urllib would send a form type).
    request = urllib.request.Request(url.rstrip("/") + path, method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Content-Type": "application/json"} if method == "POST" else {})
    key = (api_key or admin_key) if command == "status" else (admin_key or api_key)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read() or b"{}").get("error", {}).get("message", exc.reason)
        except (ValueError, AttributeError):  # not the daemon's JSON error (a proxy's page, say)
            detail = exc.reason
        print(f"dormouse: {command} refused ({exc.code}): {detail}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"dormouse: cannot reach {url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    if command == "status":
        keys = ("id", "state", "is_sleeping", "failure", "sleep_idle_seconds", "idle_timer_remaining",
                "requests_in_flight", "requests_waiting", "last_wake", "last_sleep")
        fleet = body.get("fleet") or {}
        body = {k: body.get(k) for k in keys}
        if fleet:  # every model, one line each: what `ollama ps` shows, and what sleeps
            body["models"] = {m["id"]: {"status": m["status"], "pinned": m["pinned"], "default": m["default"],
                                        "footprint_bytes": m["footprint_bytes"]} for m in fleet.get("models", [])}
            body["memory"] = {"budget_bytes": fleet.get("budget_bytes"), "planned_bytes": fleet.get("planned_bytes")}
    print(json.dumps(body, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    command = args.pop("command")
    if command in ("status", "sleep", "wake"):
        return _remote(command, args["url"], args["admin_key"], args["api_key"], args["model"])
    config_file = args.pop("config", None)
    try:
        settings = load_settings(config_file, args)
    except ConfigError as exc:
        print(f"dormouse: {exc}", file=sys.stderr)
        return 2

    from daemon.fleet.plans import add_footprints, footprint_store, model_plans
    from daemon.model.files import ModelFileError

    try:
        plans = model_plans(settings)
    except ModelFileError as exc:
        print(f"dormouse: {exc}", file=sys.stderr)
        return 2
    if command == "check-config":
        return _check_config(settings, plans)

    from daemon.logs import configure_logging, get_logger
    from daemon.server import run

    configure_logging(settings.log_format, settings.log_level)  # the footprints' warnings go to the log
    add_footprints(plans, footprint_store(settings, get_logger()))
    return run(settings, plans, reload_settings=lambda: load_settings(config_file, args))


def _check_config(settings, plans) -> int:
    """Print the effective settings, the fleet with each model's footprint, the
    memory budget and the stop budget; exit 2 if a model can never fit."""
    from daemon.fleet.plans import add_footprints, footprint_store, memory_budget
    from daemon.model.footprint import plausible
    from daemon.server import stop_budget

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
        }
    print(json.dumps({"settings": settings.public_dict(), "models": models,
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
