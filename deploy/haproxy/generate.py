#!/usr/bin/env python3
"""Write deploy/haproxy/haproxy.cfg from deploy/haproxy/fleet.toml.

    python3 deploy/haproxy/generate.py                      # fleet.toml -> haproxy.cfg, beside this script
    python3 deploy/haproxy/generate.py --check              # exit 1 if haproxy.cfg is not what fleet.toml gives
    python3 deploy/haproxy/generate.py -f my.toml -o my.cfg

The description names the replicas (in the order they are filled and woken)
and the models with their aliases (the daemons' own `[models.ID]` ids and
aliases). Every model gets a backend in which each of its replicas has three
lines, one per tier (serve, warm, wake), and an overflow backend; each line's
agent check names the tier and the model, and the daemon's agent
(daemon/http/agent.py) answers for that model alone. Writing those lines by
hand for N replicas and M models is 4 x N x M lines that must agree; this
script is the one place they are written.

Standard library only (Python 3.11+), so it runs where HAProxy runs, without
the daemon installed. tests/unit/test_deploy_haproxy.py checks that the
committed haproxy.cfg is this script's output and that `haproxy -c` passes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_FLEET = HERE / "fleet.toml"
DEFAULT_OUTPUT = HERE / "haproxy.cfg"

# The daemon's own rule for model ids and aliases (config/models.py MODEL_ID;
# a test checks the two are the same).
MODEL_ID = re.compile(r"^(?=.{1,128}$)[A-Za-z0-9][A-Za-z0-9._:-]*(?:/[A-Za-z0-9][A-Za-z0-9._:-]*)*$")
ID_RULE = "1-128 letters, digits, '.', '_', ':' or '-', parts joined by '/' (owner/name:QUANT)"
# Replica names become HAProxy server names and environment variable names
# (r1 -> DORMOUSE_R1): no "_", so that two names never give one variable.
REPLICA_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$|^[a-z]$")
TIERS = ("serve", "warm", "wake")
AGENT_PORT = 8081  # the daemons' agent_port unless DORMOUSE_<R>_AGENT says otherwise
DESCRIPTION_KEYS = {"replicas", "default_model", "models", "routing", "balance_factor"}
# How a model's awake replicas share its requests (fleet.toml's `routing`):
#   "affinity"  by the conversation's key on a consistent-hash ring (the replica
#               that holds its prompt cache), each replica's load bounded
#   "first"     the first listed with a free slot takes everything (the others
#               go idle and sleep; a conversation lands where its cache is by chance)
ROUTINGS = ("affinity", "first")
# Two bounds on a key's replica. Absolute, in the model's backend: a replica
# with no free slot answers its agent "up 0%" and is off the ring until it has
# one, so the key's request goes to the next replica of the ring (a hot key
# fills its replica's slots, then its neighbours'). Relative, in the overflow
# backend (every replica busy, the daemons queue): hash-balance-factor, no
# replica queues more than this % of the average of the requests in flight;
# past it the request goes to the next replica. 150: a hot key may take half
# again its share, no more. Not in the model's backend: HAProxy's bound is
# relative to the requests in flight now, and with few in flight (2 of 3 on
# one replica) it moves conversations away from their cache for nothing
# (measured, 12 conversations on 3 replicas: 3 of 12 moved at 150, 0 at 1000).
BALANCE_FACTOR = 150
# What of a key is hashed: at most this many bytes of it (a key of 1 MB costs
# what one of KEY_BYTES does; keys equal in their first KEY_BYTES bytes go to
# one replica). The prompt's first block, when no key is given, at most
# BLOCK_BYTES (about the prompt cache's first 256-token block of text).
KEY_BYTES = 256
# Each affinity line's weight (HAProxy's default is 1): a server gets 16 points
# on the consistent-hash ring per unit of weight, and 16 points each spread
# 3,000 keys over 3 replicas 875/1035/1090; 100 gives each 1,600 points and an
# even spread. The agent's "up 100%" is 100% of it; HAProxy's maximum is 256.
SERVER_WEIGHT = 100
BLOCK_BYTES = 1024
SESSION_HEADER = "X-Session-Id"
MODEL_KEYS = {"aliases", "replicas"}


class FleetError(ValueError):
    """A description that cannot be turned into a configuration; the message names the key."""


@dataclass(frozen=True)
class Model:
    id: str
    aliases: tuple[str, ...]
    replicas: tuple[str, ...]  # which replicas serve it, in the order its tiers try them


@dataclass(frozen=True)
class Fleet:
    replicas: tuple[str, ...]
    models: tuple[Model, ...]
    default_model: str
    routing: str = "affinity"
    balance_factor: int = BALANCE_FACTOR


def load_fleet(path: Path) -> Fleet:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise FleetError(f"{path}: cannot be read: {exc}") from None
    return parse_fleet(data, str(path))


def parse_fleet(data: dict, where: str = "fleet") -> Fleet:
    unknown = set(data) - DESCRIPTION_KEYS
    if unknown:
        raise FleetError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(DESCRIPTION_KEYS)})")
    replicas = data.get("replicas")
    if not isinstance(replicas, list) or not replicas:
        raise FleetError(f"{where}: replicas must be a list of one or more names, e.g. [\"r1\", \"r2\"]")
    for name in replicas:
        if not isinstance(name, str) or not REPLICA_NAME.fullmatch(name) or name.endswith(("-warm", "-wake")):
            raise FleetError(f"{where}: replica {name!r} must be lower-case letters, digits and '-' "
                             f"(at most 32, not ending in -warm or -wake)")
    if len(set(replicas)) != len(replicas):
        raise FleetError(f"{where}: replicas are listed twice: {replicas}")

    tables = data.get("models")
    if not isinstance(tables, dict) or not tables:
        raise FleetError(f"{where}: at least one [models.ID] table is needed")
    models, names = [], {}
    for index, (model_id, table) in enumerate(tables.items()):
        key = f"{where}: models.{model_id}"
        if not MODEL_ID.fullmatch(model_id):
            raise FleetError(f"{key}: a model id is {ID_RULE}")
        if not isinstance(table, dict) or set(table) - MODEL_KEYS:
            raise FleetError(f"{key}: a table of {sorted(MODEL_KEYS)} only")
        aliases = table.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and MODEL_ID.fullmatch(a) for a in aliases):
            raise FleetError(f"{key}.aliases: a list of names ({ID_RULE})")
        for name in (model_id, *aliases):
            if name in names:
                raise FleetError(f"{key}: the name {name!r} is used by {names[name]} too")
            names[name] = model_id
        # By default the k-th model is tried from the k-th replica on, so that
        # models that do not fit together on one replica each start on their
        # own instead of evicting each other on the first replica while the
        # others sleep.
        order = table.get("replicas", replicas[index % len(replicas):] + replicas[:index % len(replicas)])
        if not isinstance(order, list) or not order or set(order) - set(replicas) or len(set(order)) != len(order):
            raise FleetError(f"{key}.replicas: a list of distinct names from replicas ({replicas})")
        models.append(Model(model_id, tuple(aliases), tuple(order)))

    default = data.get("default_model", models[0].id)
    if default not in tables:
        raise FleetError(f"{where}: default_model {default!r} is not one of the [models.ID] tables")
    routing = data.get("routing", "affinity")
    if routing not in ROUTINGS:
        raise FleetError(f"{where}: routing {routing!r} must be one of {list(ROUTINGS)}")
    factor = data.get("balance_factor", BALANCE_FACTOR)
    # HAProxy's own bounds for hash-balance-factor: 0 (off) or above 100 (at least the average).
    if isinstance(factor, bool) or not isinstance(factor, int) or not 101 <= factor <= 1000:
        raise FleetError(f"{where}: balance_factor {factor!r} must be a whole percentage from 101 to 1000")
    return Fleet(tuple(replicas), tuple(models), default, routing, factor)


def env_name(replica: str) -> str:
    return "DORMOUSE_" + replica.upper().replace("-", "_")


def address(replica: str) -> str:
    return f'"${{{env_name(replica)}}}"'


def agent(replica: str, role: str, model: str) -> str:
    return (f'agent-check agent-port "${{{env_name(replica)}_AGENT-{AGENT_PORT}}}" '
            f'agent-send "{role} {model}\\n"')


# HAProxy's buffer for a request (tune.bufsize): how much of a body it reads the model from.
BUFSIZE = 256 * 1024
MODEL_HEADER = "X-Dormouse-Model"  # the model, for a body too large for HAProxy to read


def name_part(model: str) -> str:
    """A model id within an HAProxy name (letters, digits, '-', '_', '.', ':'): as it is, or for an id
    with '/' (owner/name:QUANT) its parts joined by '.' and a hash of the id, so no two ids share one."""
    if "/" not in model:
        return model
    return model.replace("/", ".") + "." + hashlib.sha256(model.encode()).hexdigest()[:8]


def backend_name(model: str) -> str:
    return f"model.{name_part(model)}"


def overflow_name(model: str) -> str:
    return f"overflow.{name_part(model)}"


def acl_name(model: str) -> str:
    return f"wants_{name_part(model)}"


NAME_IN_REQUEST = "%[var(txn.model),bytes(0,100),json(utf8s)]"  # JSON-escaped, at most 100 bytes


def error_body(message: str, code: str) -> str:
    """OpenAI's error body as a single-quoted lf-string argument. `message` may
    hold NAME_IN_REQUEST; quotes, backslashes and % are escaped for JSON and for
    HAProxy's log-format (single quotes: no other escaping)."""
    refused_name = code == "model_not_found"
    body = json.dumps({"error": {"message": message.replace(NAME_IN_REQUEST, "\0"),
                                 "type": "invalid_request_error" if refused_name else "server_error",
                                 "code": code, "param": "model" if refused_name else None}})
    body = body.replace("%", "%%").replace("\\u0000", NAME_IN_REQUEST)
    assert "'" not in body, body
    return f"'{body}'"


HEADER = """\
# GENERATED by deploy/haproxy/generate.py from {fleet_file}: do not edit by hand.
# Edit the description and run `python3 deploy/haproxy/generate.py` (CI checks
# that this file is its output). README.md beside this file says how to run
# it; docs/SCALING.md says why each number is what it is.
# tests/reliability/test_haproxy.py runs this very file, unchanged, in front of
# three real daemons.
#
# Replicas, in the order they are filled and woken: {replicas}
# Models (aliases) and the order their tiers try the replicas:
{model_lines}
# Requests that name no model go to {default}.
#
# Set in HAProxy's environment (systemd: Environment= or EnvironmentFile=):
#   DORMOUSE_BIND             where HAProxy listens (default :8080)
{replica_lines}
#   DORMOUSE_CHECK_HOST       Host header of the health checks; one of the
#                             daemons' allowed_hosts when that is set (default localhost).
#                             Not DORMOUSE_HOST: that is the daemon's own bind address
#   DORMOUSE_METRICS_KEY      the daemons' metrics_key, when set (/health needs it)
#   DORMOUSE_HAPROXY_SOCKET   the runtime API socket (default /run/haproxy/dormouse.sock)
#   DORMOUSE_HAPROXY_BUFSIZE  tune.bufsize, bytes: the largest body whose model is read (default {bufsize})
#
# A request goes to the backend of the model it names: the body's "model"
# (OpenAI's /v1/*, Anthropic's /v1/messages, Ollama's /api/*; Ollama's older
# "name" under /api/), else the X-Dormouse-Model header, else the query's
# ?model= (/props, /slots, /sleep), else the default model. HAProxy reads a
# body only as far as its buffer holds it (tune.bufsize, {bufsize_kib} KiB here,
# DORMOUSE_HAPROXY_BUFSIZE; less about 1 KiB for the headers): the "model" of
# a larger body (a long conversation, images) is not read, so a client that
# sends such bodies names the model in X-Dormouse-Model too, or the request
# goes to the default model's backend (the daemon there still answers it with
# the model its body names). A name that no model has is answered 404 here,
# and a model that no replica can serve now (failed, down or stopping on every
# one) 503 at once, without waiting for a server.
#
# In a model's backend every replica that serves it has three lines, and each
# line's agent check (`dormouse serve --agent-port 8081`) names its tier and
# the model; the daemon's agent answers for that model alone
# (daemon/http/agent.py):
#   serve     active line: 100% while the model is awake with a free slot, else 0%
#   warm      backup line: 100% while the model is loading or waking, else 0%
#   wake      backup line: 100% while the model is asleep, else 0%
#   overflow  the model's other backend: 100% unless stopping
#   a model that failed on a replica: "down" on that model's lines only
# A weight of 0 makes a server unusable to HAProxy, so:
{routing_lines}
#   - when none has a free slot, HAProxy uses the first usable backup only
#     (no `option allbackups`); the warm lines come before the wake lines, so
#     a load under way is waited for, and otherwise exactly one sleeping
#     replica is woken;
{overflow_line}
# The agent never says "drain" or "ready": those set an administrative state
# that outlives the daemon's process and would override an operator's own.
"""

ROUTING_LINES = {
    "first": """\
#   - replicas awake with a free slot take all the model's traffic (the first
#     listed first: `balance first`, so that the others go idle and sleep);""",
    "affinity": """\
#   - replicas awake with a free slot share the model's traffic by the
#     request's key (routing = "affinity": the frontend's txn.key, hashed on a
#     consistent ring), so a conversation returns to the replica that holds its
#     prompt cache; a busy one (no free slot) is off the ring until it has
#     one, and its keys' requests go to the next replica of the ring (a hot
#     key cannot swamp one replica). Keys move only when a replica joins or
#     leaves the ring;""",
}
OVERFLOW_LINE = {
    "first": """\
#   - when every replica is awake and busy, the overflow backend spreads the
#     queue over them (each daemon queues up to max_queued, then answers 503
#     with Retry-After).""",
    "affinity": """\
#   - when every replica is awake and busy, the overflow backend queues each
#     request on its key's replica, by the same ring, unless that replica has
#     more than {factor}% of the average in flight (hash-balance-factor: the
#     next replica of the ring takes it); each daemon queues up to max_queued,
#     then answers 503 with Retry-After.""",
}

GLOBAL_AND_DEFAULTS = """\
global
    log stdout format raw local0 info
    stats socket "${DORMOUSE_HAPROXY_SOCKET-/run/haproxy/dormouse.sock}" mode 600 level admin
    # A retried request is replayed from HAProxy's copy, and the model is read
    # from the same copy (json_query on req.body): a request larger than
    # tune.bufsize is never retried after it was sent, and its "model" is not
    # read (X-Dormouse-Model is, else it goes to the default model's backend;
    # the daemon there still answers it with the model it names). HAProxy's
    # default of 16 KiB is a chat of a few turns; {bufsize_kib} KiB holds a long
    # conversation's text. Each request HAProxy holds takes up to two buffers
    # while it is in flight (idle connections hold none): {bufsize_kib} KiB x 2 x
    # the requests in flight at once (1,000: {memory_mib} MiB). Images in a body
    # still pass it: name the model in X-Dormouse-Model for those, or raise
    # DORMOUSE_HAPROXY_BUFSIZE (bytes).
    tune.bufsize "${{DORMOUSE_HAPROXY_BUFSIZE-{bufsize}}}"

defaults
    mode http
    log global
    option httplog
    option dontlognull
    option forwardfor
    # Wait for the whole request body (up to tune.bufsize) before choosing a
    # server: the model is read from it, and HAProxy replays only a request it
    # holds whole, so without this a POST whose body arrives after its headers
    # is never retried (measured: every request in flight on a killed replica
    # got 502; with it, none). It concerns requests only. Responses, streamed
    # or not, pass through as the daemon writes them, Retry-After and all; and
    # no `compression` anywhere: a compressor holds text/event-stream chunks
    # back until its window fills, which freezes a token stream.
    option http-buffer-request
    # Loopback or a LAN: a replica that does not accept within 2 s is gone;
    # the request is retried on another one.
    timeout connect 2s
    # The whole answer of a non-streamed completion may take minutes (a wake,
    # a queue, then max_tokens of generation) and a stream may pause while a
    # long prompt is processed: 10 minutes before HAProxy gives up on a quiet
    # server or client. The daemons bound their own waits (wake_timeout,
    # max_queued) well below this.
    timeout server 10m
    timeout client 10m
    timeout http-request 10s
    timeout http-keep-alive 10s
    timeout queue 30s
    timeout check 2s
    # Retry only what the daemon never answered: a refused connection, or a
    # connection closed before any byte of a response (a replica killed or
    # restarted under the request). Completions have no side effect, so a
    # replay costs compute only. Never on a 503: that is the daemon's own
    # answer (queue full, wake timeout, worker crash) and its Retry-After
    # goes to the client; retrying a request that crashed a worker would crash
    # the next replica's.
    retries 3
    retry-on conn-failure empty-response
    option redispatch 1
    # HAProxy's own errors read like the daemon's: OpenAI's error body, and a
    # Retry-After on 503 (no replica usable) and 502/504.
    http-error status 503 content-type application/json hdr Retry-After 1 string '{"error": {"message": "no replica can take the request (all down, stopping or failed)", "type": "server_error", "code": "no_replica", "param": null}}'
    http-error status 502 content-type application/json hdr Retry-After 1 string '{"error": {"message": "a replica gave no valid response", "type": "server_error", "code": "bad_gateway", "param": null}}'
    http-error status 504 content-type application/json hdr Retry-After 1 string '{"error": {"message": "a replica did not answer in time", "type": "server_error", "code": "gateway_timeout", "param": null}}'
    # Health, on every line: any answer from /health means the daemon is
    # there. 200 (ready, sleeping, waking), and also 503, which /health gives
    # while the default model loads, has failed, or the daemon stops: the
    # agent already says each of those per model, and a failed default model
    # must not take the replica's other models away. A check every second,
    # down after 2 failures (a refused or timed-out one), up after 1 success:
    # a restarted replica is back about a second after it binds.
    # `observe layer4` marks a line down at its first refused connection, so
    # that a killed replica is left at once rather than after two checks (its
    # requests are retried meanwhile). HAProxy observes only lines that run
    # their own check, and a request may go out on any tier's line (a replica
    # killed while it wakes), which is why no line `track`s another: a GET of
    # /health per line per second is nothing for the daemon.
    option httpchk
    .if defined(DORMOUSE_METRICS_KEY)
    http-check send meth GET uri /health ver HTTP/1.1 hdr Host "${DORMOUSE_CHECK_HOST-localhost}" hdr Authorization "Bearer ${DORMOUSE_METRICS_KEY}"
    .else
    http-check send meth GET uri /health ver HTTP/1.1 hdr Host "${DORMOUSE_CHECK_HOST-localhost}"
    .endif
    http-check expect rstatus ^(200|503)$
    # The agent every 500 ms: how stale a weight can be. A busy replica still
    # gets requests that long (its daemon queues them); a stopping one too,
    # so the daemon keeps serving that long after SIGTERM while its agent
    # already answers 0 (docs/SCALING.md, "Rolling restarts").
    default-server inter 1s fall 2 rise 1 observe layer4 error-limit 1 on-error mark-down agent-inter 500ms
"""

def render(fleet: Fleet, fleet_file: str = "fleet.toml") -> str:
    model_lines = "\n".join(
        f"#   {m.id}" + (f" ({', '.join(m.aliases)})" if m.aliases else "") + f": {', '.join(m.replicas)}"
        for m in fleet.models)
    replica_lines = "\n".join(
        f"#   {env_name(r):<25} {r}'s HTTP, host:port (required); its agent_port in {env_name(r)}_AGENT "
        f"(default {AGENT_PORT})" for r in fleet.replicas)
    blocks = [HEADER.format(fleet_file=fleet_file, replicas=", ".join(fleet.replicas), model_lines=model_lines,
                            bufsize_kib=BUFSIZE // 1024, bufsize=BUFSIZE,
                            default=fleet.default_model, replica_lines=replica_lines,
                            routing_lines=ROUTING_LINES[fleet.routing],
                            overflow_line=OVERFLOW_LINE[fleet.routing].format(factor=fleet.balance_factor)),
              global_and_defaults(), "\n".join(frontend(fleet))]
    for model in fleet.models:
        blocks += model_backends(model, fleet)
    # One blank line between sections, none at the end.
    return "\n\n".join(block.strip("\n") for block in blocks) + "\n"


def global_and_defaults() -> str:
    # Only the bufsize lines have fields; every other brace of the section is HAProxy's own.
    return GLOBAL_AND_DEFAULTS.replace("{bufsize_kib}", str(BUFSIZE // 1024)).replace(
        "{memory_mib}", str(BUFSIZE * 2 * 1000 // 2**20)).replace(
        "${{DORMOUSE_HAPROXY_BUFSIZE-{bufsize}}}", "${DORMOUSE_HAPROXY_BUFSIZE-%d}" % BUFSIZE)


def frontend(fleet: Fleet) -> list[str]:
    lines = ["frontend dormouse",
             '    bind "${DORMOUSE_BIND-:8080}"',
             "    # Host and Origin pass through unchanged (the daemons check both).",
             "    # The model the request names (see the top of this file).",
             "    http-request set-var(txn.model) req.body,json_query('$.model')",
             "    http-request set-var(txn.model) req.body,json_query('$.name') if !{ var(txn.model) -m found } "
             "{ path_beg /api/ }",
             f"    # A body past tune.bufsize is not read whole: the client's {MODEL_HEADER} says the model.",
             f"    http-request set-var(txn.model) req.hdr({MODEL_HEADER.lower()}) if !{{ var(txn.model) -m found }} "
             f"{{ req.hdr({MODEL_HEADER.lower()}) -m found }}",
             "    http-request set-var(txn.model) url_param(model) if !{ var(txn.model) -m found }"]
    for m in fleet.models:
        lines.append(f"    acl {acl_name(m.id)} var(txn.model) -m str {' '.join((m.id, *m.aliases))}")
    if len(fleet.models) > 1:
        # Without the list of models the daemon's own message gives: HAProxy
        # answers before any key is checked, and the names are not for everyone.
        refusal = error_body(f'model "{NAME_IN_REQUEST}" does not exist (GET /v1/models lists the models)',
                             "model_not_found")
        lines += ["    # A name no model has: what a daemon would answer (404 model_not_found), at once.",
                  f"    http-request return status 404 content-type application/json lf-string {refusal} "
                  "if { var(txn.model) -m found } " + " ".join(f"!{acl_name(m.id)}" for m in fleet.models),
                  f"    http-request set-var(txn.model) str({fleet.default_model}) if !{{ var(txn.model) -m found }}"]
    else:
        lines += ["    # One model: every request is its own, whatever name it gives.",
                  f"    http-request set-var(txn.model) str({fleet.default_model})"]
    lines.append("    # A model that no replica can serve now: 503 at once rather than a wait in a queue.")
    for m in fleet.models:
        condition = f"{acl_name(m.id)} {{ nbsrv({backend_name(m.id)}) eq 0 }} {{ nbsrv({overflow_name(m.id)}) eq 0 }}"
        unavailable = error_body(f"no replica can serve model {m.id} now (failed, down or stopping on every one)",
                                 "no_replica")
        lines.append("    http-request return status 503 content-type application/json hdr Retry-After 1 "
                     f"lf-string {unavailable} if {condition}")
    if fleet.routing == "affinity":
        lines += affinity_key()
    for m in fleet.models:
        lines.append(f"    use_backend {overflow_name(m.id)} if {acl_name(m.id)} {{ nbsrv({backend_name(m.id)}) eq 0 }}")
        lines.append(f"    use_backend {backend_name(m.id)} if {acl_name(m.id)}")
    lines.append(f"    default_backend {backend_name(fleet.default_model)}")
    return lines


# Where the conversation's key is read, in this order (a documented rule:
# docs/SCALING.md, "Affinity"): OpenAI's prompt_cache_key, OpenAI's user,
# Anthropic's metadata.user_id, the X-Session-Id header. A JSON value that is
# not a string or a number (an object, a list) is no key.
KEY_SOURCES = ("req.body,json_query('$.prompt_cache_key')", "req.body,json_query('$.user')",
               "req.body,json_query('$.metadata.user_id')", f"req.hdr({SESSION_HEADER.lower()})")
# With no key, the prompt's first block: Anthropic's and Ollama's system, the
# first message (its text, or its first part's), a completion's prompt, the
# Responses API's input. A shared system prompt is one key, so it is cached in
# one place (the balance factor spreads its load).
BLOCK_SOURCES = ("req.body,json_query('$.system')", "req.body,json_query('$.system[0].text')",
                 "req.body,json_query('$.messages[0].content')",
                 "req.body,json_query('$.messages[0].content[0].text')",
                 "req.body,json_query('$.prompt')", "req.body,json_query('$.input')")
NO_KEY = "!{ var(txn.key) -m len 1: }"  # unset, or an empty string


def affinity_key() -> list[str]:
    """The frontend's lines that set txn.key, what the model backends hash."""
    lines = ["    # Affinity: the conversation's key, hashed by the model's backends onto a ring of its",
             f"    # replicas. prompt_cache_key, else user, else metadata.user_id, else {SESSION_HEADER};",
             f"    # at most {KEY_BYTES} bytes of it are kept (a 1 MB key costs what a short one does).",
             f"    # A key past tune.bufsize in the body is not read: send it in {SESSION_HEADER} too."]
    for index, source in enumerate(KEY_SOURCES):
        lines.append(f"    http-request set-var(txn.key) {source},bytes(0,{KEY_BYTES})" + (f" if {NO_KEY}" if index else ""))
    lines.append(f"    # No key: the prompt's first {BLOCK_BYTES} bytes (a shared system prompt lands in one place).")
    for source in BLOCK_SOURCES:
        lines.append(f"    http-request set-var(txn.key) {source},bytes(0,{BLOCK_BYTES}) if {NO_KEY}")
    lines += ["    # Nothing to hash (a GET, a prompt of token ids): the model's name, so such requests",
              "    # go to one replica rather than round robin.",
              f"    http-request set-var(txn.key) var(txn.model) if {NO_KEY}"]
    return lines


def server_id(fleet_index: int, tier: str) -> int:
    """A replica's serve line and its overflow line share one id: HAProxy
    places a server on the consistent-hash ring by its id and weight, so a key
    goes to the same replica in the model's backend and in its overflow backend
    (a queue for the replica that holds its cache). Backups are never on the
    active ring; their ids only have to differ."""
    return {"serve": 1, "overflow": 1, "warm": 1001, "wake": 2001}[tier] + fleet_index


def weight(fleet: Fleet) -> str:
    return f" weight {SERVER_WEIGHT}" if fleet.routing == "affinity" else ""


def balance(fleet: Fleet, overflow: bool) -> list[str]:
    if fleet.routing == "first":
        return ["    balance leastconn" if overflow else "    balance first"]
    if not overflow:
        return ["    # Affinity: the key's replica on the ring of the lines with a free slot (a full",
                "    # replica is off it: the next one of the ring takes the key's request).",
                "    balance hash var(txn.key)",
                "    hash-type consistent sdbm avalanche"]
    return ["    # Affinity: the key's replica on the same ring (same ids, same weights); one past",
            f"    # {fleet.balance_factor}% of the average in flight passes the request to the next.",
            "    balance hash var(txn.key)",
            "    hash-type consistent sdbm avalanche",
            f"    hash-balance-factor {fleet.balance_factor}"]


def model_backends(model: Model, fleet: Fleet | None = None) -> list[str]:
    """The model's backend and its overflow backend, one string each."""
    fleet = fleet or Fleet((*model.replicas,), (model,), model.id, "first")
    backend, overflow = backend_name(model.id), overflow_name(model.id)
    lines = [f"backend {backend}", *balance(fleet, overflow=False)]
    comments = {
        "serve": "    # serve: awake with a free slot (active lines; the first usable one takes the request).",
        "warm": "    # warm: loading or waking (backups, before the wake lines: a load under way is waited for).",
        "wake": "    # wake: asleep (backups; only the first usable backup is used: one sleeper is woken).",
    }
    for tier in TIERS:
        lines.append(comments[tier])
        for r in model.replicas:
            name, backup = (r, "") if tier == "serve" else (f"{r}-{tier}", " backup")
            ident = server_id(fleet.replicas.index(r), tier)
            lines.append(f"    server {name} {address(r)}{backup} id {ident}{weight(fleet)} check "
                         f"{agent(r, tier, model.id)}")
    spread = "the key's replica queues it" if fleet.routing == "affinity" else "spread the queue"
    spill = [f"backend {overflow}",
             f"    # Every replica of {model.id} awake and busy: {spread}.",
             *balance(fleet, overflow=True)]
    for r in model.replicas:
        ident = server_id(fleet.replicas.index(r), "overflow")
        spill.append(f"    server {r} {address(r)} id {ident}{weight(fleet)} check {agent(r, 'overflow', model.id)}")
    return ["\n".join(lines), "\n".join(spill)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--fleet", type=Path, default=DEFAULT_FLEET, help="the description (fleet.toml)")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="the configuration to write")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the output is out of date")
    args = parser.parse_args(argv)
    try:
        text = render(load_fleet(args.fleet), args.fleet.name)
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is not what {args.fleet} gives: run python3 {Path(__file__).name} "
                  f"(in {HERE})", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
