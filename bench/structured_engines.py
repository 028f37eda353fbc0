"""Structured output engines side by side (issue 28): llama.cpp's GBNF sampler
fed by daemon/grammar (today's engine), llguidance and xgrammar, on the
bundled model (Gemma 3 270M, 262k-token vocabulary), in one run.

    .venv/bin/python -m bench.structured_engines [--quick] [--threads 1] [--samples]

Four tables:
1. JSON Schema coverage: per keyword case (bench/structured_schemas.py),
   whether each engine refuses the schema, or accepts it and then matches the
   values that must match and refuses the ones that must not (checked with
   jsonschema first). With --samples, also one greedy sample per engine,
   validated with jsonschema.
2. Mask time per token along a real generated JSON (the GBNF run's output of
   table 3, replayed token by token): the allowed-token mask over all 262k
   tokens (for GBNF: llama.cpp's grammar applied to every candidate, the
   worker's slow path) and the one-token check (the worker's fast path).
3. Decode speed: the same greedy loop over llama.cpp's logits, plain and with
   each engine in it; the time spent in the engine and, for llguidance and
   xgrammar, in applying their bitmask with numpy (Python overhead that a C
   integration would not pay) are shown apart.
4. The hostile schemas of bench/hostile_crowd.py: compile time, memory and
   mask time per engine, each in its own subprocess under a time bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from bench.common import ROOT, bundled_model, table
from bench.structured_adapters import ENGINES, EOS_IDS, Refused, bits_to_bool, load_model, make_engine
from bench.structured_schemas import CASES

PROMPT = "Describe a famous film as JSON (title, year, genre, rating, cast, summary):\n"
RECORD = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 200},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "genre": {"enum": ["drama", "comedy", "documentary", "thriller", "science fiction"]},
    "rating": {"type": "number"},
    "cast": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 80}, "role": {"type": "string",
                                                                                                "maxLength": 80}},
        "required": ["name", "role"], "additionalProperties": False}},
    "summary": {"type": "string", "maxLength": 1000}},
    "required": ["title", "year", "genre", "rating", "cast", "summary"], "additionalProperties": False}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def tokens_of(llm, value) -> list[int]:
    return llm.tokenize(json.dumps(value).encode(), add_bos=False, special=False)


def schema_valid(schema: dict, value) -> bool:
    import jsonschema

    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(value)


# -- 1. coverage ---------------------------------------------------------------------------


def _matches(engine, schema: dict, tokens: list[int]) -> bool:
    matcher = engine.compile(schema)
    try:
        return all(matcher.accept(t) for t in tokens) and matcher.complete()
    finally:
        matcher.free()


def coverage_cell(engine, llm, schema: dict, good: list, bad: list, sample: bool) -> str:
    try:
        start = time.perf_counter()
        engine.compile(schema).free()
        took = time.perf_counter() - start
    except Refused as exc:
        return "refused: " + str(exc).split(": ", 1)[-1][:40]
    strict = [v for v in good if not _matches(engine, schema, tokens_of(llm, v))]
    loose = [v for v in bad if _matches(engine, schema, tokens_of(llm, v))]
    verdict = "ok" if not strict and not loose else "WRONG:" + (
        f" refuses {json.dumps(strict[0])[:24]}" if strict else "") + (f" admits {json.dumps(loose[0])[:24]}" if loose
                                                                         else "")
    if took > 0.05:
        verdict += f" ({took:.2f}s)"
    if sample:
        text, finished = generate_text(llm, engine, schema, "Answer with one JSON value:\n", 48)
        if finished:
            verdict += ", sample valid" if _valid_text(schema, text) else f", SAMPLE INVALID {text[:24]!r}"
    return verdict


def _valid_text(schema: dict, text: str) -> bool:
    try:
        return schema_valid(schema, json.loads(text))
    except ValueError:
        return False


def _format_checked(schema: dict) -> bool:
    """Whether jsonschema can check the schema's format here (date-time needs an optional package)."""
    import jsonschema

    return "format" not in schema or schema["format"] in jsonschema.FormatChecker().checkers


def coverage(engines: dict, llm, sample: bool) -> tuple[str, dict]:
    rows, data = [], {}
    for name, schema, good, bad in CASES:
        own = [v for v in good if not schema_valid(schema, v)] + [v for v in bad if schema_valid(schema, v)
                                                                  and _format_checked(schema)]
        cells = [coverage_cell(e, llm, schema, good, bad, sample) for e in engines.values()]
        if own:
            cells = [f"(case wrong: jsonschema disagrees on {own})"] * len(cells)
        rows.append([name, *cells])
        data[name] = dict(zip(engines, cells))
    return table(["keyword case", *engines], rows), data


# -- 3. the decode loop (table 2 replays its tokens) ---------------------------------------


class Timer:
    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds


def decode(llm, steps, max_tokens: int, prompt: str = PROMPT) -> tuple[list[int], float, Timer]:
    """Greedy decode with `steps(logits, timer) -> token`; (tokens, seconds after the prompt, timer)."""
    import llama_cpp

    timer = Timer()
    llm.reset()
    llm.eval(llm.tokenize(prompt.encode(), add_bos=True, special=False))
    n_vocab = llm.n_vocab()
    out: list[int] = []
    start = time.perf_counter()
    for _ in range(max_tokens):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        began = time.perf_counter()
        token = steps(logits, timer)
        timer.add("engine", time.perf_counter() - began)
        if token in EOS_IDS:
            break
        out.append(token)
        llm.eval([token])
    return out, time.perf_counter() - start, timer


def plain_numpy(logits, timer) -> int:
    return int(np.argmax(logits))


def worker_chain(llm, gbnf: str | None):
    """The worker's own SamplerChain (daemon/worker/sampling.py), greedy, with or without the GBNF."""
    from daemon.protocol import SamplingParams
    from daemon.worker.sampling import SamplerChain

    from bench.structured_adapters import vocab_of

    chain = SamplerChain(SamplingParams(temperature=0.0, grammar=gbnf), llm.n_vocab(), llm.n_ctx(), vocab_of(llm))
    return lambda logits, timer: chain.sample(llm.ctx, -1)


def masked(matcher, check_first: bool):
    """llguidance/xgrammar in the loop: the bitmask (every token, or only when greedy's token is refused),
    applied to the logits with numpy."""
    def step(logits, timer) -> int:
        if check_first:
            token = int(np.argmax(logits))
            began = time.perf_counter()
            if matcher.allows(token):
                matcher.accept(token)
                timer.add("check", time.perf_counter() - began)
                return token
        began = time.perf_counter()
        words = matcher.fill()
        filled = time.perf_counter()
        token = int(np.argmax(np.where(bits_to_bool(words, len(logits)), logits, -np.inf)))
        applied = time.perf_counter()
        matcher.accept(token)
        timer.add("mask", filled - began)
        timer.add("numpy apply", applied - filled)
        timer.add("masked steps", 1)
        return token
    return step


def gbnf_full_mask(matcher):
    """llama.cpp's grammar over all 262k candidates at every token (as llama-cpp-python's Llama does)."""
    def step(logits, timer) -> int:
        began = time.perf_counter()
        allowed = matcher.mask()
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        matcher.accept(token)
        timer.add("mask", time.perf_counter() - began)
        return token
    return step


def generate_text(llm, engine, schema: dict, prompt: str, max_tokens: int) -> tuple[str, bool]:
    """Greedy text under the engine's mask, and whether it ended (EOS) within max_tokens."""
    matcher = engine.compile(schema)
    try:
        step = gbnf_full_mask(matcher) if engine.name == "gbnf" else masked(matcher, check_first=True)
        tokens, _, _ = decode(llm, step, max_tokens, prompt)
        return llm.detokenize(tokens).decode("utf-8", "replace"), len(tokens) < max_tokens
    finally:
        matcher.free()


def decode_speed(engines: dict, llm, max_tokens: int, reps: int) -> tuple[str, dict, list[int]]:
    gbnf = engines["gbnf"].grammar_text(RECORD)
    variants = {
        "plain (worker chain, greedy in C)": lambda: worker_chain(llm, None),
        "plain (numpy argmax)": lambda: plain_numpy,
        "gbnf (worker chain: check, mask on refusal)": lambda: worker_chain(llm, gbnf),
        "gbnf (full mask every token)": lambda: gbnf_full_mask(engines["gbnf"].compile(gbnf=gbnf)),
    }
    for name in ("llguidance", "xgrammar"):
        if name in engines:
            variants[f"{name} (mask every token)"] = lambda n=name: masked(engines[n].compile(RECORD), False)
            variants[f"{name} (check, mask on refusal)"] = lambda n=name: masked(engines[n].compile(RECORD), True)
    runs: dict[str, list] = {name: [] for name in variants}
    decode(llm, plain_numpy, 8)  # warm
    for _ in range(reps):
        for name, make in variants.items():  # interleaved: drift on a shared machine hits every variant alike
            runs[name].append(decode(llm, make(), max_tokens))
    rows, data, replay = [], {}, []
    for name, results in runs.items():
        rate = statistics.median(len(t) / s for t, s, _ in results)
        n = sum(len(t) for t, _, _ in results) or 1
        parts = {k: sum(r[2].parts.get(k, 0.0) for r in results) for k in ("engine", "mask", "numpy apply",
                                                                             "masked steps")}
        text = llm.detokenize(results[0][0]).decode("utf-8", "replace")
        valid = "valid" if _valid_text(RECORD, text) else ("unfinished" if len(results[0][0]) == max_tokens else
                                                           "INVALID")
        if "grammar" not in name and name.startswith("plain"):
            valid = "-"
        rows.append([name, f"{rate:.1f}", ms(parts["engine"] / n), ms(parts["numpy apply"] / n),
                     f"{parts['masked steps'] / n:.0%}" if parts["masked steps"] else "-", len(results[0][0]), valid])
        data[name] = {"tokens_per_s": rate, "engine_ms_per_token": parts["engine"] / n * 1000,
                      "numpy_apply_ms_per_token": parts["numpy apply"] / n * 1000, "output": text}
        if name.startswith("gbnf (worker"):
            replay = results[0][0]
    base = data["plain (worker chain, greedy in C)"]["tokens_per_s"]
    for row in rows:
        row.insert(2, f"{data[row[0]]['tokens_per_s'] / base:.2f}x")
    headers = ["decode (greedy, RECORD schema)", "tokens/s", "vs plain", "engine ms/token",
               "of which numpy apply", "masked steps", "tokens", "output"]
    return table(headers, rows), data, replay


# -- 2. mask time along the generated JSON --------------------------------------------------


def mask_times(engines: dict, tokens: list[int], reps: int) -> tuple[str, dict]:
    rows, data = [], {}
    for name, engine in engines.items():
        full, check, accept, failed = [], [], [], None
        for _ in range(reps):
            matcher = engine.compile(RECORD)
            for i, token in enumerate(tokens):
                began = time.perf_counter()
                matcher.mask() if name == "gbnf" else matcher.fill()
                masked_at = time.perf_counter()
                ok = matcher.allows(token)
                checked = time.perf_counter()
                ok = ok and matcher.accept(token)
                accepted = time.perf_counter()
                if not ok:
                    failed = i
                    break
                full.append(masked_at - began)
                check.append(checked - masked_at)
                accept.append(accepted - checked)
            matcher.free()
        if not full:
            rows.append([name, len(tokens), "-", "-", "-", "-", "-", f"REFUSED token {failed}"])
            continue
        rows.append([name, len(tokens), ms(statistics.median(full)), ms(percentile(full, 99)), ms(max(full)),
                     ms(statistics.median(check)), ms(statistics.median(accept)),
                     "all accepted" if failed is None else f"REFUSED token {failed}"])
        data[name] = {"mask_median_ms": statistics.median(full) * 1000, "mask_p99_ms": percentile(full, 99) * 1000,
                      "check_median_ms": statistics.median(check) * 1000, "refused_at": failed}
    headers = ["engine (262k vocab)", "tokens", "full mask median ms", "p99 ms", "max ms", "one-token check ms",
               "accept ms", "replay"]
    return table(headers, rows), data


# -- 4. hostile schemas, each in its own process ---------------------------------------------


def hostile_cases() -> list[tuple[str, dict]]:
    """(what, request fields) from bench/hostile_crowd.py's grammar crowd."""
    from bench.hostile_crowd import grammar_bodies

    keys = ("json_schema", "tools", "tool_choice")
    return [(what, {k: body[k] for k in keys if k in body}) for what, _, body in grammar_bodies()]


def as_schema(fields: dict) -> dict:
    """A forced tool call as one JSON Schema (what llguidance/xgrammar would be given): one of the calls."""
    if "json_schema" in fields:
        return fields["json_schema"]
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"]["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for t in fields["tools"]]
    return {"anyOf": calls}


def hostile_child(indices: list[int], engine_name: str, steps: int) -> None:
    """In a subprocess: compile each hostile case in turn and walk `steps` random allowed tokens,
    printing one JSON line per case as soon as it is done (a stall loses only what follows)."""
    import psutil

    from daemon.grammar import GrammarRefused, grammar_for  # imported before any memory is counted

    model = bundled_model()
    llm = load_model(model, vocab_only=True)
    engine = make_engine(engine_name, llm, model)
    closers = {t for t in range(llm.n_vocab()) if set(llm.detokenize([t])) & set(b"}]") or
               not llm.detokenize([t]).strip()}  # the walk avoids them while it can, to go deep
    cases = hostile_cases()
    for index in indices:
        _, fields = cases[index]
        process = psutil.Process()
        base = process.memory_info().rss
        peak = [base]
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.005):
                peak[0] = max(peak[0], process.memory_info().rss)

        threading.Thread(target=watch, daemon=True).start()
        began = time.perf_counter()
        try:
            if engine_name == "gbnf":
                try:
                    matcher = engine.compile(gbnf=grammar_for(**fields))
                except GrammarRefused as exc:
                    raise Refused(exc.message) from None
            else:
                matcher = engine.compile(as_schema(fields))
        except Refused as exc:
            done.set()
            print(json.dumps({"index": index, "compile_s": time.perf_counter() - began, "refused": str(exc)[:90],
                              "rss_mib": (peak[0] - base) / 2**20}), flush=True)
            continue
        compiled = time.perf_counter() - began
        rng = random.Random(28)
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            allowed = np.flatnonzero(matcher.mask())
            times.append(time.perf_counter() - began)
            choices = [t for t in allowed.tolist() if t not in EOS_IDS]
            deeper = [t for t in choices if t not in closers]
            if not choices or not matcher.accept(rng.choice(deeper or choices)):
                break
        error = matcher.error() if hasattr(matcher, "error") else ""  # llguidance stops at its own bounds
        done.set()
        peak[0] = max(peak[0], process.memory_info().rss)
        matcher.free()
        print(json.dumps({"index": index, "compile_s": compiled, "first_mask_ms": times[0] * 1000,
                          "max_mask_ms": max(times) * 1000, "median_mask_ms": statistics.median(times) * 1000,
                          "steps": len(times), "rss_mib": (peak[0] - base) / 2**20,
                          "error": error.splitlines()[0][:90] if error else ""}), flush=True)


def _child(indices: list[int], name: str, steps: int, timeout: float) -> dict[int, dict]:
    """Run hostile_child; {case index: result}; the case it was in when the time ran out: stalled."""
    command = [sys.executable, "-m", "bench.structured_engines", "--hostile-child", name,
               ",".join(map(str, indices)), "--steps", str(steps)]
    began = time.perf_counter()
    try:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        stdout, failure = out.stdout, (None if out.returncode == 0 else
                                       {"crashed": (out.stderr.strip().splitlines() or ["?"])[-1][:80]})
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        failure = {"stalled": f"no answer in {timeout:g}s (with {time.perf_counter() - began:.0f}s of loading)"}
    results = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result.pop("index")] = result
    missing = [i for i in indices if i not in results]
    if missing and failure:
        results[missing[0]] = failure
    return results


def hostile(engine_names: list[str], timeout: float, steps: int, per_case: bool) -> tuple[str, dict]:
    """per_case: one process per case and engine (each stall bounded alone), else one per engine."""
    cases = hostile_cases()
    results: dict[str, dict[int, dict]] = {}
    for name in engine_names:
        if per_case:
            results[name] = {i: _child([i], name, steps, timeout).get(i, {"crashed": "no output"})
                             for i in range(len(cases))}
        else:
            results[name] = _child(list(range(len(cases))), name, steps, timeout)
    rows, data = [], {}
    for index, (what, _) in enumerate(cases):
        cells = [results[name].get(index, {"skipped": "not reached"}) for name in engine_names]
        data[what] = dict(zip(engine_names, cells))
        rows.append([what, *map(_hostile_cell, cells)])
    return table(["hostile case (hostile_crowd.py)", *engine_names], rows), data


def _hostile_cell(r: dict) -> str:
    if "stalled" in r:
        return "STALLED: " + r["stalled"]
    if "skipped" in r:
        return "not reached (an earlier case stalled)"
    if "crashed" in r:
        return "CRASHED: " + r["crashed"]
    if "refused" in r:
        return f"refused in {r['compile_s'] * 1000:.0f} ms ({r['refused'][:50]})"
    if r.get("error"):
        return f"compile {r['compile_s'] * 1000:.0f} ms, then ERROR at token {r['steps']}: {r['error'][:60]}"
    return (f"compile {r['compile_s'] * 1000:.0f} ms, +{r['rss_mib']:.0f} MiB, mask {r['median_mask_ms']:.1f} ms "
            f"(max {r['max_mask_ms']:.1f}, {r['steps']} steps)")


# -- the run -------------------------------------------------------------------------------


def run(quick: bool, threads: int, samples: bool) -> dict:
    """Prints each table as soon as it is measured (a long run shows its progress); returns the figures."""
    model = bundled_model()
    llm = load_model(model, threads=threads)
    engines, setup = {}, {}
    import importlib

    import psutil

    process = psutil.Process()
    for name, module in (("gbnf", "daemon.grammar"), ("llguidance", "llguidance"), ("xgrammar", "xgrammar")):
        rss, began = process.memory_info().rss, time.perf_counter()
        importlib.import_module(module)
        imported, rss_imported = time.perf_counter(), process.memory_info().rss
        engines[name] = make_engine(name, llm, model)
        setup[name] = {"import_s": imported - began, "import_mib": (rss_imported - rss) / 2**20,
                       "tokenizer_s": time.perf_counter() - imported,
                       "tokenizer_mib": (process.memory_info().rss - rss_imported) / 2**20}
    say = lambda *lines: print(*lines, sep="\n", flush=True)  # noqa: E731
    say(table(["engine setup (once per worker / model)", "import s", "import RSS MiB", "tokenizer build s",
               "tokenizer RSS MiB"], [[k, v["import_s"], f"{v['import_mib']:.0f}", v["tokenizer_s"],
                                      f"{v['tokenizer_mib']:.0f}"] for k, v in setup.items()]))
    cov_text, cov = coverage(engines, llm, sample=samples)
    say("", "1. JSON Schema coverage (ok: matches every value that must match and none that must not)", cov_text)
    dec_text, dec, replay = decode_speed(engines, llm, 32 if quick else 128, 1 if quick else 2)
    mask_text, masks = mask_times(engines, replay, 1 if quick else 3)
    say("", f"2. Mask time per token along the generated JSON ({len(replay)} tokens of the GBNF run below)",
        mask_text, "", f"3. Decode speed ({threads} thread(s); engine ms/token is inside the loop)", dec_text)
    hostile_text, hostile_data = hostile(list(ENGINES), 45 if quick else 120, 4 if quick else 32, per_case=not quick)
    say("", "4. Hostile schemas (one subprocess each; compile, RSS growth, mask time over random valid tokens)",
        hostile_text)
    return {"setup_s": setup, "coverage": cov, "mask": masks, "hostile": hostile_data,
            "decode": {k: {m: n for m, n in v.items() if m != "output"} for k, v in dec.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repetitions (~3 min)")
    parser.add_argument("--samples", action="store_true",
                        help="also one greedy sample per engine and coverage case, validated (slow on CPU)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hostile-child", nargs=2, metavar=("ENGINE", "INDICES"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hostile_child:
        hostile_child([int(i) for i in args.hostile_child[1].split(",")], args.hostile_child[0], args.steps)
        return
    print(json.dumps(run(args.quick, args.threads, args.samples)))


if __name__ == "__main__":
    main()
