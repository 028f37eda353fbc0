"""Structured output as the daemon runs it (llguidance, through
daemon.grammar and the worker's daemon/worker/structured.py), beside llama.cpp's
GBNF grammar sampler as the baseline (fed by llama-cpp-python's JSON Schema
converter: the daemon's own GBNF converter was deleted with the move), on the
bundled model (Gemma 3 270M, 262k-token vocabulary), in one run (issue 28).

    .venv/bin/python -m bench.structured_engines [--quick] [--threads 1] [--samples]

Setup: the worker's tokenizer build (time, RSS) and the longest the decode
thread is held up meanwhile (a 1 ms ticker on the main thread while the build
runs on its own thread, as in the worker).

Four tables:
1. JSON Schema coverage: per keyword case (bench/structured_schemas.py),
   whether each engine refuses the schema, or accepts it and then matches the
   values that must match and refuses the ones that must not (checked with
   jsonschema first). With --samples, also one greedy sample per engine,
   validated with jsonschema.
2. Mask time per token along a real generated JSON (the llguidance run's
   output of table 3, replayed token by token): the allowed-token mask over
   all 262k tokens and the one-token check (the worker's fast path).
3. Decode speed: the same greedy loop over llama.cpp's logits, plain and with
   each engine in it, as a ratio to plain decoding measured in the same run.
4. The hostile schemas of bench/hostile_crowd.py: compile time, memory and
   mask time per engine, each in its own subprocess under a time bound; for
   llguidance through daemon.grammar.grammar_for (its limits included), for
   GBNF a forced tool call given as the anyOf of its calls.
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
from bench.structured_adapters import ENGINES, EOS_IDS, Refused, bits_to_bool, load_model, make_engine, vocab_of
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


def worker_chain(llm, grammar: str | None):
    """The worker's own SamplerChain (daemon/worker/sampling.py), greedy, with or without llguidance's grammar:
    the one-token check first, the mask only when the chain's token is refused (llama-server's strategy)."""
    from daemon.protocol import SamplingParams
    from daemon.worker.sampling import SamplerChain

    chain = SamplerChain(SamplingParams(temperature=0.0, grammar=grammar), llm.n_vocab(), llm.n_ctx(), vocab_of(llm))
    return lambda logits, timer: chain.sample(llm.ctx, -1)


def masked(matcher, check_first: bool):
    """An engine in the loop: its mask (every token, or only when greedy's token is refused), applied to the
    logits with numpy."""
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
        allowed = words if words.dtype == bool else bits_to_bool(words, len(logits))
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
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
        step = masked(matcher, check_first=True)
        tokens, _, _ = decode(llm, step, max_tokens, prompt)
        return llm.detokenize(tokens).decode("utf-8", "replace"), len(tokens) < max_tokens
    finally:
        matcher.free()


def decode_speed(engines: dict, llm, max_tokens: int, reps: int) -> tuple[str, dict, list[int]]:
    llg, gbnf = engines["llguidance"], engines.get("gbnf")
    grammar = llg.grammar_text(RECORD)
    variants = {
        "plain (worker chain, greedy in C)": lambda: worker_chain(llm, None),
        "plain (numpy argmax)": lambda: plain_numpy,
        "llguidance (worker chain: check, mask on refusal)": lambda: worker_chain(llm, grammar),
        "llguidance (mask every token)": lambda: masked(llg.compile(grammar=grammar), False),
    }
    if gbnf is not None:
        gbnf_text = gbnf.grammar_text(RECORD)
        variants["gbnf (check, mask on refusal)"] = lambda: masked(gbnf.compile(grammar=gbnf_text), True)
        variants["gbnf (full mask every token, as llama-cpp-python's Llama)"] = \
            lambda: gbnf_full_mask(gbnf.compile(grammar=gbnf_text))
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
        if name.startswith("plain"):
            valid = "-"
        rows.append([name, f"{rate:.1f}", ms(parts["engine"] / n), ms(parts["numpy apply"] / n),
                     f"{parts['masked steps'] / n:.0%}" if parts["masked steps"] else "-", len(results[0][0]), valid])
        data[name] = {"tokens_per_s": rate, "engine_ms_per_token": parts["engine"] / n * 1000,
                      "numpy_apply_ms_per_token": parts["numpy apply"] / n * 1000, "output": text}
        if name.startswith("llguidance (worker"):
            replay = results[0][0]
    plain = "plain (worker chain, greedy in C)"
    base = data[plain]["tokens_per_s"]
    # On a loaded machine the forward pass's time swings between runs more than any engine costs; the second
    # ratio takes one forward pass for all (the run's median of time per token minus the engine's) and adds each
    # engine's own ms: what the engine alone does to decode speed.
    forward = statistics.median(1000 / d["tokens_per_s"] - d["engine_ms_per_token"] for d in data.values())
    for row in rows:
        figures = data[row[0]]
        figures["vs_plain"] = figures["tokens_per_s"] / base
        figures["vs_plain_engine_only"] = (forward + data[plain]["engine_ms_per_token"]) / (
            forward + figures["engine_ms_per_token"])
        row[2:2] = [f"{figures['vs_plain']:.2f}x", f"{figures['vs_plain_engine_only']:.2f}x"]
    headers = ["decode (greedy, RECORD schema)", "tokens/s", "vs plain (same run)",
               f"vs plain, engine only (forward {forward:.0f} ms)", "engine ms/token", "of which numpy apply",
               "masked steps", "tokens", "output"]
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
                matcher.fill()
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
    """A forced tool call as one JSON Schema (what the GBNF converter is given): one of the calls."""
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
            if engine_name == "llguidance":  # the daemon's path: the request's fields, its checks and limits
                matcher = engine.compile(grammar=engine.grammar_text(**fields))
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


def tokenizer_setup(llm, model: str) -> dict:
    """The worker's tokenizer build on its own thread (structured.py), while this thread ticks every 1 ms as the
    decode thread would step: the build's time, RSS, and the longest this thread was held up meanwhile."""
    import psutil

    from daemon.worker import structured

    vocab = vocab_of(llm)
    process = psutil.Process()
    rss = process.memory_info().rss
    structured.tokenizers.attach(vocab, model)
    began = time.perf_counter()
    gaps, last = [], began
    while not structured.tokenizers.ready(vocab):  # the first call starts the build on its thread
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    build = time.perf_counter() - began
    grown = (process.memory_info().rss - rss) / 2**20
    structured.tokenizers.get(vocab)
    constructor = structured.tokenizers.build_parts.get("constructor_s", float("nan"))
    return {"build_s": build, "rss_mib": grown, "stall_ms": max(gaps, default=0.0) * 1000, "ticks": len(gaps),
            "constructor_s": constructor}


def run(quick: bool, threads: int, samples: bool) -> dict:
    """Prints each table as soon as it is measured (a long run shows its progress); returns the figures."""
    model = bundled_model()
    llm = load_model(model, threads=threads)
    engines = {"llguidance": None, "gbnf": make_engine("gbnf", llm, model)}
    setup = tokenizer_setup(llm, model)
    engines["llguidance"] = make_engine("llguidance", llm, model)  # the tokenizer just built: kept
    say = lambda *lines: print(*lines, sep="\n", flush=True)  # noqa: E731
    say(table(["llguidance tokenizer (once per worker and model file)", "value"], [
        ["build s (pieces read, then llguidance's trie)", f"{setup['build_s']:.2f}"],
        ["RSS growth MiB", f"{setup['rss_mib']:.0f}"],
        ["decode thread's longest hold-up ms (1 ms ticker; the build on its own thread)", f"{setup['stall_ms']:.0f}"],
        ["decode thread's ticks during the build (of ~1 per ms)", setup["ticks"]],
        ["of which llguidance's constructor s (Rust; holds the GIL)", f"{setup['constructor_s']:.2f}"],
    ]), "(GBNF needs no setup: llama.cpp's grammar sampler works on the vocabulary directly)")
    cov_text, cov = coverage(engines, llm, sample=samples)
    say("", "1. JSON Schema coverage (ok: matches every value that must match and none that must not)", cov_text)
    dec_text, dec, replay = decode_speed(engines, llm, 32 if quick else 128, 1 if quick else 2)
    mask_text, masks = mask_times(engines, replay, 1 if quick else 3)
    say("", f"2. Mask time per token along the generated JSON ({len(replay)} tokens of the llguidance run below)",
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
