"""A bystander's pace while a long prompt is read, with a draft model (issue 27 item 1).

One daemon with a draft model (the bundled model drafts for itself). A bystander
streams an answer alone, then the same answer again while a prompt that fills
another slot's context arrives: the draft reads that history one chunk per step
(daemon/worker/speculative.py) instead of in one step, so the bystander's largest
inter-token gap grows by about one chunk, not by the whole history. Both runs are
measured in this run, on this machine: the figures to read are the ratios.

Also printed: whether the worker was killed (restarts), and how the draft caught
up (its chunks, from the worker's log line).

    .venv/bin/python -m bench.liveness [--prompt-tokens 3900] [--ctx-size 8192]
        [--batch-size 512] [--bystander-tokens 120] [--rounds 2] [--liveness 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import ROOT, bundled_model, free_port, table

CAUGHT_UP = re.compile(r"draft caught up on slot (\d+): (\d+) tokens in (\d+) chunks of at most (\d+)")


def prompt_tokens(http: httpx.Client, n: int) -> list[int]:
    """n token ids of plain prose (numbered lines, so no two are alike)."""
    text = " ".join(f"Line {i}: the river passes the mill and the baker sells bread." for i in range(n // 12 + 10))
    tokens = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert len(tokens) >= n, (len(tokens), n)
    return tokens[:n]


def stream_gaps(http: httpx.Client, body: dict, started: threading.Event | None = None) -> dict:
    """Stream a completion; the gaps between its content chunks, and how it ended."""
    stamps, finish = [], None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"], "gaps": [], "tokens": len(stamps)}
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if choice.get("text"):
                stamps.append(time.perf_counter())
                if started is not None:
                    started.set()
            finish = choice.get("finish_reason") or finish
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"gaps": gaps, "tokens": len(stamps), "finish": finish}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=3900, help="the long prompt (fills a slot of ctx/2)")
    parser.add_argument("--ctx-size", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--bystander-tokens", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2, help="alone / beside pairs; the largest gaps are medians over rounds")
    parser.add_argument("--liveness", type=float, default=60.0, help="worker_liveness_timeout")
    parser.add_argument("--threads", type=int, default=1,
                        help="llama.cpp threads (1: on a shared machine two threads spin on each other)")
    args = parser.parse_args()

    model = bundled_model()
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="dormouse-liveness-")) / "daemon.log"
    env = {**os.environ, "DORMOUSE_WORKER_LIVENESS_TIMEOUT": str(args.liveness),
           "DORMOUSE_STATE_DIR": str(log_path.parent / "state")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daemon", "serve", "--port", str(port), "--model", model, "--model-draft", model,
             "--threads", str(args.threads), "--ctx-size", str(args.ctx_size), "--parallel", "2",
             "--batch-size", str(args.batch_size), "--sleep-idle-seconds", "-1", "--log-format", "json"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    try:
        for _ in range(2400):
            try:
                if http.get("/health").json()["state"] == "ready":
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        bystander = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": args.bystander_tokens,
                     "temperature": 0, "ignore_eos": True}
        rows, alone_max, beside_max, alone_med, beside_med, long_ok = [], [], [], [], [], []
        for round_ in range(args.rounds):
            alone = stream_gaps(http, bystander)
            started = threading.Event()
            long_result: dict = {}
            # A new prompt each round (a number in front): nothing of it is cached anywhere.
            tokens = prompt_tokens(http, args.prompt_tokens + round_)[round_:]

            def send_long() -> None:
                started.wait(60)
                r = http.post("/v1/completions", json={"prompt": tokens, "max_tokens": 8, "temperature": 0})
                long_result.update(status=r.status_code, body=r.json())

            sender = threading.Thread(target=send_long)
            sender.start()
            beside = stream_gaps(http, bystander, started)
            sender.join()
            long_ok.append(long_result.get("status") == 200)
            for name, result in (("alone", alone), ("beside the long prompt", beside)):
                gaps = result["gaps"] or [float("nan")]
                rows.append([round_ + 1, name, result["tokens"], result.get("finish") or result.get("error"),
                             max(gaps), statistics.median(gaps)])
            alone_max.append(max(alone["gaps"] or [float("nan")]))
            beside_max.append(max(beside["gaps"] or [float("nan")]))
            alone_med.append(statistics.median(alone["gaps"] or [float("nan")]))
            beside_med.append(statistics.median(beside["gaps"] or [float("nan")]))
        metrics = http.get("/metrics").text
    finally:
        proc.terminate()
        proc.wait(120)
        http.close()

    restarts = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("dormouse_worker_restarts_total"))
    catch_ups = [tuple(int(x) for x in m.groups()) for m in CAUGHT_UP.finditer(log_path.read_text(errors="replace"))]
    print(f"bystander: {args.bystander_tokens} tokens, greedy; long prompt: {args.prompt_tokens} tokens, "
          f"ctx {args.ctx_size} / 2 slots, batch {args.batch_size}, draft = target (bundled), "
          f"worker_liveness_timeout {args.liveness:g}s, threads {args.threads}")
    print(table(["round", "bystander", "tokens", "end", "largest gap s", "median gap s"], rows))
    ratio = statistics.median(beside_max) / statistics.median(alone_max)
    print(f"\nlargest inter-token gap, beside / alone (median of {args.rounds} rounds): {ratio:.2f}x")
    print(f"median inter-token gap, beside / alone: {statistics.median(beside_med) / statistics.median(alone_med):.2f}x")
    print(f"long prompts answered: {sum(long_ok)}/{len(long_ok)}; worker restarts (killed as hung or crashed): {restarts:g}")
    for slot, n, chunks, size in catch_ups:
        print(f"draft catch-up on slot {slot}: {n} tokens in {chunks} chunks of at most {size}")
    print(f"(daemon log: {log_path})")


if __name__ == "__main__":
    main()
