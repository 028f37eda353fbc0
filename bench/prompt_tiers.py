"""The prompt cache's tiers on an agent-like trace: N conversations taking turns
on --parallel 2, each turn adding ~100 tokens to a ~1,500-token history, for R
rounds, two clients at a time. Time to first streamed token per turn (median
and p95, the first round left out: every server reads it in full) for
Dormouse with its tiers, Dormouse with slots only, and llama-server with its
RAM cache (`--cache-ram`, run here when installed); then the round right
after a restart (or a sleep) in the middle. Beside them, the RAM tier's save
and restore rates and the disk tier's restore rate as the worker measured
them, and this machine's memcpy and sequential-read rates measured here.

    .venv/bin/python -m bench.prompt_tiers [--conversations 8] [--rounds 5] [--history 1500]
        [--llama-server PATH (or $LLAMA_SERVER; default /tmp/llama-build/bin/llama-server)]
        [--break restart|sleep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import Daemon, bundled_model, free_port, table

DEFAULT_LLAMA_SERVER = "/tmp/llama-build/bin/llama-server"


def opening(c: int, tokens: int) -> str:
    # ~15 tokens a line with the bundled tokenizer; the conversation's number in every line: no two alike
    return " ".join(f"Log {c}.{i}: agent {c} read file {i * 7 + c} and found {i % 5} issues." for i in range(tokens // 15))


def turn_text(c: int, r: int) -> str:
    return " ".join(f"Step {r}.{i} of agent {c}: run the tool on item {i + r} and report." for i in range(7))


def stream_ttft(http: httpx.Client, messages: list[dict]) -> tuple[float, str, tuple[int, int]]:
    """TTFT, the answer, and (cached, prompt) tokens from the usage chunk ((0, 0) when there is none)."""
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage = None, [], (0, 0)
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                u = chunk["usage"]
                usage = ((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0), u.get("prompt_tokens", 0))
            delta = chunk["choices"][0].get("delta", {}) if chunk.get("choices") else {}
            if delta.get("content"):
                first = first or time.perf_counter()
                text.append(delta["content"])
    return (first or time.perf_counter()) - start, "".join(text), usage


def run_trace(url_of, brk, conversations: int, rounds: int, history: int) -> dict:
    """TTFT of every turn, by round. url_of(): the current base URL; brk(): the restart or sleep."""
    convs = [[{"role": "system", "content": "You are agent %d. Answer in one short line." % c},
              {"role": "user", "content": opening(c, history)}] for c in range(conversations)]
    by_round: list[list[float]] = []
    cached_by_round: list[list[tuple[int, int]]] = []
    for r in range(rounds):
        if r == rounds // 2 + 1 and brk is not None:
            brk()
        http = httpx.Client(base_url=url_of(), timeout=600)
        ttfts: list[float] = [0.0] * conversations
        usages: list[tuple[int, int]] = [(0, 0)] * conversations
        order = list(range(conversations))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    if not order:
                        return
                    c = order.pop(0)
                if r > 0:
                    convs[c].append({"role": "user", "content": turn_text(c, r)})
                ttfts[c], answer, usages[c] = stream_ttft(http, convs[c])
                convs[c].append({"role": "assistant", "content": answer or "ok"})

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        http.close()
        by_round.append(ttfts)
        cached_by_round.append(usages)
    after = rounds // 2 + 1
    awake = [t for r, row in enumerate(by_round) if r > 0 and r != after for t in row]
    return {"rounds": by_round, "awake": awake, "after_break": by_round[after] if brk is not None else [],
            "cached": cached_by_round}


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95)) if values else float("nan")


def dormouse(model: str, tiers: bool, brk: str, args) -> tuple[dict, dict]:
    state = tempfile.mkdtemp(prefix="tiers-")
    env = {"DORMOUSE_KV_CACHE_MIN_TOKENS": "64"}
    if not tiers:
        env.update({"DORMOUSE_PROMPT_CACHE_RAM_BYTES": "0", "DORMOUSE_KV_CACHE_DISK_BYTES": "0"})
    argv = ("--sleep-idle-seconds", "-1", "--parallel", "2", "--ctx-size", "8192", "--state-dir", state)
    holder = {"d": Daemon(*argv, model=model, threads=args.threads, env=env)}
    holder["d"].wait_state("ready")
    props: dict = {}

    def brk_fn() -> None:
        props.update(holder["d"].props()["kv_cache"].get("tiers") or {})
        if brk == "sleep":
            holder["d"].http.post("/sleep").raise_for_status()
            return
        holder["d"].stop()
        holder["d"] = Daemon(*argv, model=model, threads=args.threads, env=env)
        holder["d"].wait_state("ready")

    try:
        result = run_trace(lambda: holder["d"].url, brk_fn, args.conversations, args.rounds, args.history)
        final = holder["d"].props()["kv_cache"].get("tiers") or {}
        for tier in ("ram", "disk"):  # rates from either worker: the first measured RAM, the second disk
            for key, val in final.get(tier, {}).items():
                if key.endswith("_gbps") and val:
                    props.setdefault(tier, {})[key] = val
    finally:
        holder["d"].stop()
    return result, props


class LlamaServer:
    def __init__(self, binary: str, model: str, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([binary, "-m", model, "--port", str(self.port), "--parallel", "2", "-c", "8192",
                                      "-t", str(threads), "--cache-ram", "8192", "--no-webui"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("llama-server never became healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def llama_server(binary: str, model: str, args) -> dict:
    holder = {"s": LlamaServer(binary, model, args.threads)}

    def brk_fn() -> None:  # llama-server has no sleep: a restart, which loses its RAM cache
        holder["s"].stop()
        holder["s"] = LlamaServer(binary, model, args.threads)

    try:
        return run_trace(lambda: holder["s"].url, brk_fn, args.conversations, args.rounds, args.history)
    finally:
        holder["s"].stop()


def machine_rates() -> dict:
    """memcpy (numpy, 256 MiB) and sequential read of a 256 MiB file just written (the page cache, as the
    disk tier reads a file it wrote), on this machine, now."""
    a = np.random.randint(0, 255, 256 * 2**20, np.uint8)
    b = np.empty_like(a)
    b[:] = a
    start = time.perf_counter()
    for _ in range(4):
        b[:] = a
    memcpy = 4 * a.nbytes / (time.perf_counter() - start) / 1e9
    with tempfile.NamedTemporaryFile(dir=tempfile.gettempdir()) as f:
        f.write(a.tobytes())
        f.flush()
        os.fsync(f.fileno())
        start = time.perf_counter()
        with open(f.name, "rb") as g:
            while g.readinto(b):
                pass
        seq = a.nbytes / (time.perf_counter() - start) / 1e9
    return {"memcpy_gbps": round(memcpy, 2), "sequential_read_gbps": round(seq, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8, help="conversations taking turns")
    parser.add_argument("--rounds", type=int, default=5, help="turns per conversation (the first is a full read)")
    parser.add_argument("--history", type=int, default=1500, help="tokens of each conversation's opening")
    parser.add_argument("--threads", type=int, default=2, help="threads of every server")
    parser.add_argument("--break", dest="brk", choices=["restart", "sleep"], default="restart",
                        help="what happens to Dormouse in the middle (llama-server, which has no sleep: a restart)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", DEFAULT_LLAMA_SERVER),
                        help="llama-server binary; skipped (and said so) when it is not there")
    parser.add_argument("--skip", nargs="*", default=[], choices=["tiers", "slots", "llama-server"],
                        help="servers to leave out")
    parser.add_argument("--json", help="also write every TTFT and rate to this file")
    args = parser.parse_args()
    model = bundled_model()
    results: dict[str, dict] = {}
    rates: dict = {}
    if "tiers" not in args.skip:
        results["Dormouse, tiers"], rates = dormouse(model, True, args.brk, args)
    if "slots" not in args.skip:
        results["Dormouse, slots only"], _ = dormouse(model, False, args.brk, args)
    if "llama-server" not in args.skip:
        if Path(args.llama_server).is_file() and os.access(args.llama_server, os.X_OK):
            results["llama-server --cache-ram 8192 (restart)"] = llama_server(args.llama_server, model, args)
        else:
            print(f"llama-server: not installed ({args.llama_server})")
    machine = machine_rates()
    rows = []
    for name, res in results.items():
        rows.append([name, statistics.median(res["awake"]), p95(res["awake"]),
                     statistics.median(res["after_break"]) if res["after_break"] else float("nan"),
                     p95(res["after_break"])])
    print(f"\n{args.conversations} conversations x {args.rounds} rounds on --parallel 2, ~{args.history}-token "
          f"histories, +~100 tokens a turn; a {args.brk} before round {args.rounds // 2 + 1} (0-based); TTFT in s")
    print(table(["server", "awake median", "awake p95", f"after the {args.brk} median", "p95"], rows))
    print("\nprompt tokens kept from the cache / read, summed per round (round 0 is every conversation's first):")
    for name, res in results.items():
        sums = [f"{sum(c for c, _ in row)}/{sum(n for _, n in row)}" for row in res["cached"]]
        print(f"  {name}: {', '.join(sums)}")
    print("\nrates (GB/s):", json.dumps({"ram": {k: v for k, v in rates.get("ram", {}).items() if k.endswith("gbps")},
                                        "disk": {k: v for k, v in rates.get("disk", {}).items() if k.endswith("gbps")},
                                        "machine": machine}))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "rates": rates, "machine": machine}, indent=2))


if __name__ == "__main__":
    main()
