"""The prompt cache across a sleep: time to first token of the first request
after a wake, with the saved prefix restored vs read again in full, beside
llama-cpp-python's prefill of the same prompt measured in the same run; the
bytes saved per token and the time the save adds to a sleep.

    .venv/bin/python -m bench.kv_restore [--sizes 500 2000 4000] [--cycles 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from bench.common import Daemon, bundled_model, median, run_python, table

BARE = """
import json, time
import llama_cpp
llm = llama_cpp.Llama({model!r}, n_ctx=8192, n_threads={threads}, verbose=False)
out = {{}}
for n, prompt in {prompts!r}.items():
    llm.reset()
    start = time.perf_counter()
    for _ in llm.create_completion(prompt, max_tokens=1, temperature=0, stream=True):
        break
    out[n] = time.perf_counter() - start
print(json.dumps(out))
"""


def prompt_of(tokens: int) -> str:
    # ~20 tokens a sentence with the bundled tokenizer; numbered so no two are alike.
    return " ".join(f"Line {i}: the river passes the mill and the baker sells bread." for i in range(tokens // 17))


def measure(model: str, sizes: list[int], cycles: int, keep: bool, threads: int) -> dict[int, dict]:
    """Per size: TTFT after a wake (median over cycles), sleep seconds, kv_save seconds and bytes."""
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as state:
        env_before = dict(os.environ)
        os.environ["DORMOUSE_KV_CACHE_DISK_BYTES"] = "8GiB" if keep else "0"
        try:
            d = Daemon("--sleep-idle-seconds", "-1", "--parallel", "1", "--ctx-size", "8192", "--state-dir", state,
                       model=model, threads=threads)
        finally:
            os.environ.clear()
            os.environ.update(env_before)
        try:
            d.wait_state("ready")
            for n in sizes:
                body = {"prompt": prompt_of(n), "max_tokens": 1, "temperature": 0}
                ttfts, sleeps, saves = [], [], []
                prompt_tokens = cached = 0
                for _ in range(cycles):
                    d.http.post("/v1/completions", json=body).raise_for_status()  # the conversation so far
                    report = d.http.post("/sleep").json()["last_sleep"]
                    sleeps.append(report["seconds"])
                    # The first cycle writes the prefix; later ones find it saved already (0 bytes).
                    saves += [p for p in report["phases"] if p["name"] == "kv_save" and p["freed_bytes"]]
                    ttfts.append(d.stream_first_token("/v1/completions", body)[0])
                    usage = d.http.post("/v1/completions", json=body).json()["usage"]  # warm: for the token counts
                    prompt_tokens = usage["prompt_tokens"]
                cached = d.props()["kv_cache"]["prefixes"][:1]
                results[n] = {
                    "ttft": median(ttfts), "sleep": median(sleeps), "prompt_tokens": prompt_tokens,
                    "save_seconds": median([p["seconds"] for p in saves]) if saves else 0.0,
                    "save_bytes": median([p["freed_bytes"] for p in saves]) if saves else 0,
                    "saved_prefix": cached[0] if cached else 0,
                }
        finally:
            d.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 2000, 4000])
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = bundled_model()
    bare = run_python(BARE.format(model=model, threads=args.threads,
                                  prompts={n: prompt_of(n) for n in args.sizes}))
    restored = measure(model, args.sizes, args.cycles, keep=True, threads=args.threads)
    reread = measure(model, args.sizes, args.cycles, keep=False, threads=args.threads)
    rows = []
    for n in args.sizes:
        r, f = restored[n], reread[n]
        per_token = r["save_bytes"] / r["saved_prefix"] if r["saved_prefix"] else float("nan")
        rows.append([r["prompt_tokens"], r["ttft"], f["ttft"], bare[str(n)], f["ttft"] / r["ttft"],
                     f"{per_token / 1024:.1f} KiB", r["save_seconds"], r["sleep"], f["sleep"]])
    print(table(["prompt tokens", "TTFT after wake, restored (s)", "TTFT after wake, re-read (s)",
                 "llama-cpp-python prefill (s)", "re-read / restored", "saved per token", "kv_save (s)",
                 "sleep with save (s)", "sleep without (s)"], rows))
    print(json.dumps({"restored": restored, "reread": reread, "llama_cpp_python_prefill": bare}))


if __name__ == "__main__":
    main()
