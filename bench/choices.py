"""n choices from one prompt: one request with n = 4 (the prompt decoded once,
its KV copied to three more slots) beside four concurrent requests with the
same prompt (each slot reads it), measured in the same run, on a prompt of
about 1500 tokens.

    .venv/bin/python -m bench.choices [--reps 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

from bench.common import Daemon, bundled_model, median, table


def prompt(rep: int, case: str) -> str:
    # A different first line per run: no case finds another's prompt in the cache.
    lines = " ".join(f"Line {i}: the river passes the mill and the baker sells bread." for i in range(90))
    return f"Run {rep} of {case}. {lines}"


def one_request(d: Daemon, text: str, n: int) -> dict:
    r = d.http.post("/v1/completions", json={"prompt": text, "max_tokens": 16, "temperature": 0, "n": n,
                                             "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def run(reps: int = 3) -> tuple[str, dict]:
    d = Daemon("--sleep-idle-seconds", "-1", "--parallel", "4", "--ctx-size", "8192", model=bundled_model())
    seconds: dict[str, list[float]] = {"n=4": [], "4 requests": []}
    try:
        d.wait_state("ready")
        one_request(d, "warm up", 1)
        for rep in range(reps):
            start = time.perf_counter()
            body = one_request(d, prompt(rep, "n"), 4)
            seconds["n=4"].append(time.perf_counter() - start)
            tokens = body["usage"]["prompt_tokens"]
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda _: one_request(d, prompt(rep, "separate"), 1), range(4)))
            seconds["4 requests"].append(time.perf_counter() - start)
    finally:
        d.stop()
    data = {k: median(v) for k, v in seconds.items()} | {"prompt_tokens": tokens}
    text = table(["4 answers of 16 tokens to one prompt", "seconds (median)"], [
        [f"one request, n = 4 (prompt of {tokens} tokens read once)", data["n=4"]],
        ["four concurrent requests (each reads the prompt)", data["4 requests"]],
    ]) + f"\n\nfour requests / n = 4: {data['4 requests'] / data['n=4']:.2f}x\n"
    return text, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    text, data = run(args.reps)
    print(text)
    print(json.dumps(data))


if __name__ == "__main__":
    main()
