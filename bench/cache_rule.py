"""What the deterministic prompt cache costs (issue 16, section 2).

The same multi-turn chat trace three ways, in one run on the bundled model:
`cache_deterministic = true` (reuse only whole prompt chunks counted from 0,
so answers equal a fresh read token for token), `false` (reuse every shared
token), and no reuse at all (`cache_prompt: false`, the baseline a cache
must beat). Four conversations take turns on four slots; each turn adds a
user message of ~100 tokens to the history and asks for a 32-token answer.
Printed: prompt tokens kept from the cache and decoded, and the prompt time
per turn (the worker's prompt_ms: time to first token without HTTP).

    .venv/bin/python -m bench.cache_rule [--turns 6] [--batch-size 512]
"""

from __future__ import annotations

import argparse
import random
import statistics

from bench.common import Daemon, bundled_model, median, table

WORDS = ("river mill dawn baker rye bread miller stone bridge lamp market winter cart horse salt ledger clock "
         "harbor rope lantern orchard well").split()


def trace(turns: int, conversations: int, seed: int = 16) -> list[list[str]]:
    rng = random.Random(seed)
    return [[" ".join(rng.choice(WORDS) for _ in range(300 if t == 0 else 90)) for t in range(turns)]
            for _ in range(conversations)]


def run(d: Daemon, messages_by_turn: list[list[str]], cache: bool) -> dict:
    histories: list[list[dict]] = [[] for _ in messages_by_turn]
    kept = decoded = 0
    prompt_ms: list[float] = []
    answers: list[str] = []
    for turn in range(len(messages_by_turn[0])):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": messages_by_turn[c][turn]})
            prompt = d.http.post("/apply-template", json={"messages": history}).json()["prompt"]
            body = d.http.post("/completion", json={"prompt": prompt, "n_predict": 32, "temperature": 0,
                                                    "cache_prompt": cache, "stop": ["<end_of_turn>"]}).json()
            history.append({"role": "assistant", "content": body["content"]})
            answers.append(body["content"])
            if turn > 0:  # the first turn has nothing to reuse in any mode
                kept += body["tokens_cached"]
                decoded += body["tokens_evaluated"] - body["tokens_cached"]
                prompt_ms.append(body["timings"]["prompt_ms"])
    return {"kept": kept, "decoded": decoded, "prompt_ms": prompt_ms, "answers": answers}


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else float("nan")


def measure(turns: int = 6, batch_size: int = 512) -> dict:
    model = bundled_model()
    work = trace(turns, conversations=4)
    results = {}
    for deterministic in (True, False):
        d = Daemon("--parallel", "4", "--ctx-size", "8192", "--batch-size", str(batch_size),
                   "--sleep-idle-seconds", "-1", model=model,
                   env={"DORMOUSE_CACHE_DETERMINISTIC": str(deterministic).lower()})
        try:
            d.wait_state("ready")
            if deterministic:  # the baseline in the same daemon, before the cache has anything
                results["no reuse"] = run(d, work, cache=False)
                results["deterministic"] = run(d, work, cache=True)
            else:
                results["every shared token"] = run(d, work, cache=True)
        finally:
            d.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=512)
    args = parser.parse_args()
    results = measure(args.turns, args.batch_size)
    base = median(results["no reuse"]["prompt_ms"])
    rows = []
    for name, r in results.items():
        rows.append([name, r["kept"], r["decoded"], median(r["prompt_ms"]) / 1000, p95(r["prompt_ms"]) / 1000,
                     f"{base / median(r['prompt_ms']):.2f}x"])
    print(f"4 conversations x {args.turns} turns on 4 slots, batch_size {args.batch_size}; turns after the first")
    print(table(["reuse", "tokens kept", "tokens decoded", "prompt s (median)", "prompt s (p95)",
                 "faster than no reuse"], rows))
    same = results["deterministic"]["answers"] == results["no reuse"]["answers"]
    differ = sum(a != b for a, b in zip(results["every shared token"]["answers"], results["no reuse"]["answers"]))
    print(f"answers equal to no reuse: deterministic {'all' if same else 'NOT all'}; "
          f"every shared token: {len(results['no reuse']['answers']) - differ} of {len(results['no reuse']['answers'])}")


if __name__ == "__main__":
    main()
