"""A crowd of hostile requests beside one normal stream: the stream's
inter-token gap alone and beside the crowd, measured in the same run.

    .venv/bin/python -m bench.hostile_crowd [--requests 200] [--clients 4]

The reliability test (tests/reliability/test_hardening.py) sends the same crowd
and checks the answers; the timing lives here, as a ratio, because a shared
2-core machine cannot keep a timing bound in a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
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


def run(requests: int = 200, clients: int = 4) -> tuple[str, dict]:
    d = Daemon("--sleep-idle-seconds", "-1", "--parallel", "4", "--ctx-size", "2048", model=bundled_model())
    try:
        d.wait_state("ready")
        stream_stamps(d.url)  # warm
        alone = steady_gaps(stream_stamps(d.url))
        stamps, sent, outcomes, _ = crowd_beside_stream(d.url, requests, clients)
        beside = steady_gaps(stamps)
    finally:
        d.stop()
    p90 = lambda gaps: statistics.quantiles(gaps, n=10)[-1]  # noqa: E731
    ms = lambda s: round(s * 1000, 1)  # noqa: E731
    data = {"requests": sent, "gap_alone_ms": ms(statistics.mean(alone)), "gap_beside_ms": ms(statistics.mean(beside)),
            "ratio": round(statistics.mean(beside) / statistics.mean(alone), 2),
            "p90_ms": (ms(p90(alone)), ms(p90(beside))), "max_ms": (ms(max(alone)), ms(max(beside))),
            "statuses": {what: sorted({s for s, _ in pairs}) for what, pairs in sorted(outcomes.items())}}
    text = table(["normal stream", "alone", f"beside {sent} hostile requests"], [
        ["mean inter-token gap (ms)", data["gap_alone_ms"], data["gap_beside_ms"]],
        ["p90 gap (ms)", *data["p90_ms"]],
        ["max gap (ms)", *data["max_ms"]],
    ]) + f"\n\nratio (beside / alone, mean gap): {data['ratio']}x\n"
    return text, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    text, data = run(args.requests, args.clients)
    print(text)
    print(json.dumps(data["statuses"], indent=1))


if __name__ == "__main__":
    main()
