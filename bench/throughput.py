"""Decode throughput: one stream through the daemon against llama-cpp-python's
own `Llama` on the same model and threads, measured in the same run; then
aggregate tokens/s with 1, 2, 4 and 8 concurrent streams.

    .venv/bin/python -m bench.throughput [--tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

from bench.common import Daemon, bundled_model, median, run_python, table

LLAMA = """
import json, time, llama_cpp
llm = llama_cpp.Llama({model!r}, n_ctx=4096, n_threads={threads}, n_threads_batch={threads}, verbose=False)
rates, ttfts = [], []
for _ in range({reps}):
    start = time.perf_counter(); first = None; n = 0
    for chunk in llm.create_completion("Once upon a time", max_tokens={tokens}, temperature=0, stream=True):
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    rates.append((n - 1) / (end - first)); ttfts.append(first - start)
    llm.reset()
print(json.dumps({{"rates": rates, "ttfts": ttfts}}))
"""


def one_stream(d: Daemon, tokens: int, prompt: str = "Once upon a time") -> tuple[float, float, int, float]:
    """(decode tokens/s after the first token, ttft, tokens, total seconds)."""
    start = time.perf_counter()
    first, total, n = d.stream_first_token("/v1/completions", {
        "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    return (n - 1) / (total - first), first, n, time.perf_counter() - start


def aggregate(d: Daemon, streams: int, tokens: int) -> float:
    prompts = [f"Story number {i}: once upon a time" for i in range(streams)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda p: one_stream(d, tokens, p), prompts))
    wall = time.perf_counter() - start
    return sum(r[2] for r in results) / wall


def run(tokens: int = 128, threads: int = 2, reps: int = 3) -> tuple[str, dict]:
    args = argparse.Namespace(tokens=tokens, threads=threads, reps=reps)
    model = bundled_model()
    out: list[str] = []
    print = out.append  # noqa: A001

    llama = run_python(LLAMA.format(model=model, threads=args.threads, tokens=args.tokens, reps=args.reps))
    d = Daemon("--sleep-idle-seconds", "-1", "--parallel", "8", "--ctx-size", "8192", model=model, threads=args.threads)
    try:
        d.wait_state("ready")
        one_stream(d, 16)  # first request after start
        single = [one_stream(d, args.tokens) for _ in range(args.reps)]
        agg = {n: aggregate(d, n, args.tokens) for n in (1, 2, 4, 8)}
    finally:
        d.stop()

    llama_rate = median(llama["rates"])
    rate = median([s[0] for s in single])
    print(f"Decode throughput, bundled Gemma 3 270M, {args.threads} threads, {args.tokens} tokens, median of {args.reps}\n")
    print(table(["what", "tokens/s", "ratio"], [
        ["llama-cpp-python Llama, one stream", llama_rate, 1.0],
        ["dormouse, one stream", rate, rate / llama_rate],
    ]))
    print(f"\nwarm time to first token: Llama {median(llama['ttfts']):.3f} s, dormouse {median([s[1] for s in single]):.3f} s (HTTP included)")
    print("\nAggregate tokens/s by concurrent streams (dormouse, 8 slots)\n")
    print(table(["streams", "tokens/s", "x one stream"], [[n, v, v / agg[1]] for n, v in agg.items()]))
    return "\n".join(out), {"llama_rate": llama_rate, "dormouse_rate": rate, "aggregate": agg}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    text, data = run(args.tokens, args.threads, args.reps)
    print(text)
    print("\n" + json.dumps(data))


if __name__ == "__main__":
    main()
