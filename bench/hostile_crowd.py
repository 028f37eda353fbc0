"""Crowds of hostile requests beside one normal stream: the stream's
inter-token gap alone and beside each crowd, measured in the same run.

    .venv/bin/python -m bench.hostile_crowd [--requests 200] [--clients 4] [--grammar-clients 3]

Two crowds. The field crowd: bodies whose numbers, lists and strings are out
of bounds (every one a 400 or a bounded answer). The grammar crowd (issue 16):
schemas that are as costly as the limits let through (an enum of 1400
forty-digit strings, 128 optional properties, 8 forced tools) and ones past
them (12 forced tools x 900 optional properties, 990 optional properties,
anyOf alternatives that double at every level), sent by a few clients for as
long as the normal stream runs. Before the limits, three of those enums
paused a neighbour stream 41 s and the 12 x 900 tools froze the daemon 38 s.

The reliability test (tests/reliability/test_hardening.py) sends the field
crowd and checks the answers; the timing lives here, as a ratio, because a
shared 2-core machine cannot keep a timing bound in a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import random
import statistics
import threading
import time

import httpx

from bench.common import Daemon, bundled_model, table


def hostile_bodies() -> list[tuple[str, dict]]:
    """(what, body): every one must be answered 400 or with a bounded answer."""
    small = {"prompt": "Hello", "max_tokens": 3}
    return [
        ("huge max_tokens", {**small, "max_tokens": 10**12}),
        ("negative max_tokens", {**small, "max_tokens": -5}),
        ("huge top_k", {**small, "top_k": 2**40}),
        ("top_k at the int32 edge", {**small, "top_k": 2**31 - 1}),
        ("negative top_k", {**small, "top_k": -3}),
        ("huge penalty window", {**small, "repeat_penalty": 1.1, "repeat_last_n": 2**29}),
        ("penalty window past int32", {**small, "repeat_penalty": 1.1, "repeat_last_n": 2**40}),
        ("negative penalty window", {**small, "repeat_last_n": -7}),
        ("negative seed", {**small, "seed": -1}),
        ("huge seed", {**small, "seed": 2**70}),
        ("50k logit_bias entries", {**small, "logit_bias": {str(i): 1.0 for i in range(50_000)}}),
        ("1000 logit_bias ids outside the vocabulary", {**small, "logit_bias": {str(10**9 + i): 1.0 for i in range(1000)}}),
        ("1000 valid logit_bias entries", {**small, "logit_bias": {str(i): -1.0 for i in range(1000)}}),
        ("logit_bias not a number", {**small, "logit_bias": {"5": "x"}}),
        ("16 stop strings", {**small, "stop": [f"stop{i}" for i in range(16)]}),
        ("100 stop strings", {**small, "stop": [f"stop{i}" for i in range(100)]}),
        ("a 100 kB stop string", {**small, "stop": ["x" * 100_000]}),
        ("negative temperature", {**small, "temperature": -1}),
        ("temperature as text", {**small, "temperature": "hot"}),
        ("token ids past the vocabulary", {"prompt": [2**31 - 1, 5], "max_tokens": 3}),
        ("a 6 MB prompt", {"prompt": "lorem ipsum " * 500_000, "max_tokens": 3}),
        ("a 6 MB chat message", {"messages": [{"role": "user", "content": "lorem ipsum " * 500_000}], "max_tokens": 3}),
    ]


def _optional_object(n: int) -> dict:
    return {"type": "object", "properties": {f"field_number_{i}": {"type": "string"} for i in range(n)}}


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def grammar_bodies() -> list[tuple[str, str, dict]]:
    """(what, path, body): the costliest grammars the limits accept, and some they refuse."""
    rng = random.Random(16)
    digits = ["".join(rng.choice("0123456789") for _ in range(40)) for _ in range(1400)]
    ambiguous: dict = {"type": "string"}
    for _ in range(7):
        ambiguous = {"anyOf": [{"type": "array", "items": ambiguous}] * 2}
    chat = {"messages": [{"role": "user", "content": "Call a tool."}], "max_tokens": 32}
    return [
        ("enum of 1400 forty-digit strings", "/v1/completions",
         {"prompt": "A number:", "json_schema": {"enum": digits}, "max_tokens": 32}),
        ("128 optional properties", "/v1/completions",
         {"prompt": "A record:", "json_schema": _optional_object(128), "max_tokens": 32}),
        # Few enough to fit the prompt of a 512-token slot: each tool is described in it.
        ("8 forced tools", "/v1/chat/completions",
         {**chat, "tools": [_tool(f"tool_{i}", {"type": "object", "properties": {}}) for i in range(8)],
          "tool_choice": "required"}),
        ("12 forced tools x 900 optional properties", "/v1/chat/completions",
         {**chat, "tools": [_tool(f"tool_{i}", _optional_object(900)) for i in range(12)], "tool_choice": "required"}),
        ("990 optional properties", "/v1/completions", {"prompt": "x", "json_schema": _optional_object(990)}),
        ("anyOf doubling over 7 levels", "/v1/completions", {"prompt": "x", "json_schema": ambiguous}),
    ]


REFUSED = "the refused ones, in turn"  # a crowd of every case past the limits


def grammar_crowds() -> dict[str, list[tuple[str, str, dict]]]:
    """Each accepted case on its own, and the refused ones together."""
    cases = grammar_bodies()
    accepted = cases[:3]
    return {**{what: [(what, path, body)] for what, path, body in accepted}, REFUSED: cases[3:]}


def run_grammar_crowd(url: str, crowd: str, clients: int, stop, results) -> None:
    """In its own process: `clients` threads send the crowd's bodies in turn
    until `stop` is set (each at least once). Puts (sent, {what: [statuses]})."""
    bodies = [(what, path, json.dumps(body).encode()) for what, path, body in grammar_crowds()[crowd]]
    lock = threading.Lock()
    sent = [0]
    outcomes: dict[str, list] = {}

    def client() -> None:
        with httpx.Client(base_url=url, timeout=300, headers={"Content-Type": "application/json"}) as http:
            while True:
                with lock:
                    if stop.is_set() and sent[0] >= len(bodies):
                        return
                    what, path, raw = bodies[sent[0] % len(bodies)]
                    sent[0] += 1
                status = http.post(path, content=raw).status_code
                with lock:
                    outcomes.setdefault(what, []).append(status)

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    results.put((sent[0], outcomes))


def grammar_crowd_beside_stream(url: str, crowd: str, clients: int) -> tuple[list[float], int, dict]:
    """One grammar crowd in its own process, one normal stream timed while it runs:
    (stream stamps, requests sent, {what: statuses})."""
    spawn = multiprocessing.get_context("spawn")
    results, stop = spawn.Queue(), spawn.Event()
    crowd = spawn.Process(target=run_grammar_crowd, args=(url, crowd, clients, stop, results))
    crowd.start()
    time.sleep(2.0)  # under way: its process has imported and the first grammars are being matched
    stamps = stream_stamps(url)
    stop.set()
    sent, outcomes = results.get(timeout=600)
    crowd.join(30)
    return stamps, sent, outcomes


def run_crowd(url: str, total: int, clients: int, results) -> None:
    """In its own process, so that encoding multi-megabyte bodies does not take
    the GIL from the thread that times the normal stream. Puts (sent, {what:
    [(status, completion_tokens or None)]}) on results."""
    bodies = [(what, "/v1/chat/completions" if "messages" in body else "/v1/completions", json.dumps(body).encode())
              for what, body in hostile_bodies()]
    lock = threading.Lock()
    sent = [0]
    outcomes: dict[str, list] = {}

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120, headers={"Content-Type": "application/json"}) as http:
            while True:
                with lock:
                    if sent[0] >= total:
                        return
                    what, path, raw = bodies[sent[0] % len(bodies)]
                    sent[0] += 1
                r = http.post(path, content=raw)
                tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None
                outcomes.setdefault(what, []).append((r.status_code, tokens))

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    results.put((sent[0], outcomes))


def stream_stamps(url: str, max_tokens: int = 96) -> list[float]:
    """Arrival time of each streamed chunk of one normal greedy stream."""
    body = {"prompt": "Write about the sea.", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
    return stamps


def steady_gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps[5:], stamps[6:])]  # after the prompt, steady decode


def crowd_beside_stream(url: str, requests: int, clients: int) -> tuple[list[float], int, dict, int | None]:
    """Start the crowd in its own process, time one normal stream while it runs.
    Returns (stream stamps, requests sent, outcomes, crowd exit code)."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    crowd = spawn.Process(target=run_crowd, args=(url, requests, clients, results))
    crowd.start()
    time.sleep(1.0)  # the crowd is under way (its process imports first)
    stamps = stream_stamps(url)
    sent, outcomes = results.get(timeout=600)
    crowd.join(30)
    return stamps, sent, outcomes, crowd.exitcode


def run(requests: int = 200, clients: int = 4, grammar_clients: int = 3) -> tuple[str, dict]:
    d = Daemon("--sleep-idle-seconds", "-1", "--parallel", "4", "--ctx-size", "2048", model=bundled_model())
    try:
        d.wait_state("ready")
        stream_stamps(d.url)  # warm
        alone = steady_gaps(stream_stamps(d.url))
        stamps, sent, outcomes, _ = crowd_beside_stream(d.url, requests, clients)
        beside = steady_gaps(stamps)
        grammar_runs = {crowd: grammar_crowd_beside_stream(d.url, crowd, grammar_clients) for crowd in grammar_crowds()}
    finally:
        d.stop()
    p90 = lambda gaps: statistics.quantiles(gaps, n=10)[-1]  # noqa: E731
    ms = lambda s: round(s * 1000, 1)  # noqa: E731
    columns = {"alone": alone, f"beside {sent} hostile fields": beside}
    columns.update({f"beside {crowd} x{grammar_clients}": steady_gaps(run[0]) for crowd, run in grammar_runs.items()})
    data = {"requests": sent, "gap_alone_ms": ms(statistics.mean(alone)), "gap_beside_ms": ms(statistics.mean(beside)),
            "ratio": round(statistics.mean(beside) / statistics.mean(alone), 2),
            "p90_ms": tuple(ms(p90(g)) for g in columns.values()),
            "max_ms": tuple(ms(max(g)) for g in columns.values()),
            "statuses": {what: sorted({s for s, _ in pairs}) for what, pairs in sorted(outcomes.items())},
            "grammar_statuses": {what: sorted(set(codes)) for _, _, found in grammar_runs.values()
                                 for what, codes in found.items()}}
    text = table(["normal stream", *columns], [
        ["mean inter-token gap (ms)", *(ms(statistics.mean(g)) for g in columns.values())],
        ["p90 gap (ms)", *data["p90_ms"]],
        ["max gap (ms)", *data["max_ms"]],
    ]) + (f"\n\nratio (beside / alone, mean gap): fields {data['ratio']}x\n"
          "grammars: " + "; ".join(f"{what} -> {codes}" for what, codes in data["grammar_statuses"].items()))
    return text, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--grammar-clients", type=int, default=3)
    args = parser.parse_args()
    text, data = run(args.requests, args.clients, args.grammar_clients)
    print(text)
    print(json.dumps(data["statuses"], indent=1))


if __name__ == "__main__":
    main()
