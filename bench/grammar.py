"""Decode speed with a JSON-schema grammar beside without, measured in the
same run: one greedy stream through the daemon (plain, constrained by a
schema, and with logprobs), and llama-cpp-python's own `Llama` with and
without the same grammar on the same model and threads.

    .venv/bin/python -m bench.grammar [--tokens 96] [--reps 3]

The schema keeps the model writing (one long string field), so the tokens
measured are tokens under the grammar, not a closing brace and end of text.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import Daemon, bundled_model, median, run_python, table

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 1000}}, "required": ["story"],
          "additionalProperties": False}
PROMPT = "Write a long story about the sea as JSON: "

LLAMA = """
import json, time, llama_cpp
from llama_cpp.llama_grammar import LlamaGrammar
llm = llama_cpp.Llama({model!r}, n_ctx=2048, n_threads={threads}, n_threads_batch={threads}, verbose=False)
grammar = LlamaGrammar.from_json_schema(json.dumps({schema!r}), verbose=False)
out = {{}}
for name, g in (("plain", None), ("grammar", grammar)):
    rates = []
    for _ in range({reps}):
        llm.reset()
        first = None; n = 0
        for chunk in llm.create_completion({prompt!r}, max_tokens={tokens}, temperature=0, stream=True, grammar=g):
            n += 1
            if first is None:
                first = time.perf_counter()
        rates.append((n - 1) / (time.perf_counter() - first))
    out[name] = rates
print(json.dumps(out))
"""


def stream_rate(d: Daemon, body: dict) -> tuple[float, int]:
    """(tokens/s after the first token, tokens) of one streamed completion."""
    first = None
    n = 0
    with d.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                n += 1
                if first is None:
                    first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first), n


def run(tokens: int = 96, reps: int = 3, threads: int = 2) -> tuple[str, dict]:
    model = bundled_model()
    llama = run_python(LLAMA.format(model=model, threads=threads, tokens=tokens, reps=reps, schema=SCHEMA, prompt=PROMPT))
    d = Daemon("--sleep-idle-seconds", "-1", "--parallel", "1", "--ctx-size", "2048", model=model, threads=threads)
    cases = {"plain": {}, "json_schema": {"json_schema": SCHEMA}, "logprobs (top 5)": {"logprobs": 5}}
    rates: dict[str, list[float]] = {name: [] for name in cases}
    try:
        d.wait_state("ready")
        stream_rate(d, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})  # warm
        for _ in range(reps):
            for name, extra in cases.items():  # interleaved: drift on a noisy machine hits all cases alike
                rate, _ = stream_rate(d, {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                                          **extra})
                rates[name].append(rate)
    finally:
        d.stop()
    data = {"dormouse": {k: median(v) for k, v in rates.items()},
            "llama_cpp_python": {k: median(v) for k, v in llama.items()}}
    dm, lc = data["dormouse"], data["llama_cpp_python"]
    text = table(["decode tokens/s (median)", "plain", "JSON-schema grammar", "grammar / plain"], [
        ["dormouse", dm["plain"], dm["json_schema"], f"{dm['json_schema'] / dm['plain']:.2f}x"],
        ["llama-cpp-python Llama", lc["plain"], lc["grammar"], f"{lc['grammar'] / lc['plain']:.2f}x"],
    ]) + (f"\n\ndormouse with logprobs (top 5): {dm['logprobs (top 5)']:.1f} tokens/s "
          f"({dm['logprobs (top 5)'] / dm['plain']:.2f}x plain)\n")
    return text, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    text, data = run(args.tokens, args.reps)
    print(text)
    print(json.dumps(data))


if __name__ == "__main__":
    main()
