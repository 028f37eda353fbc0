"""Resume latency by phase, with and without a worker spawned ahead, against
llama-cpp-python's bare load of the same model in the same run; warm time to
first token; RSS of all daemon processes loaded and asleep.

    .venv/bin/python -m bench.resume [--cycles 5]
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import Daemon, bundled_model, median, run_python, table

BARE = """
import json, time
t0 = time.perf_counter()
import llama_cpp
t1 = time.perf_counter()
llm = llama_cpp.Llama({model!r}, n_ctx=4096, n_threads={threads}, verbose=False)
t2 = time.perf_counter()
first = None
for chunk in llm.create_completion("The capital of France is", max_tokens=4, temperature=0, stream=True):
    first = first or time.perf_counter()
print(json.dumps({{"import": t1 - t0, "load": t2 - t1, "load_to_first_token": first - t1}}))
"""

BODY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def measure_daemon(model: str, spawn_ahead: bool, cycles: int, threads: int) -> dict:
    d = Daemon("--sleep-idle-seconds", "-1", "--spawn-ahead" if spawn_ahead else "--no-spawn-ahead",
               model=model, threads=threads)
    try:
        d.wait_state("ready")
        loaded_rss = d.tree_rss()
        warm = [d.stream_first_token("/v1/completions", BODY)[0] for _ in range(3)]
        resumes, phases, asleep_rss = [], [], []
        for _ in range(cycles):
            d.http.post("/sleep").raise_for_status()
            if spawn_ahead:
                d.wait_spare()
            time.sleep(0.5)  # let the machine settle: a real wake comes after idle time
            asleep_rss.append(d.tree_rss())
            resumes.append(d.stream_first_token("/v1/completions", BODY)[0])
            phases.append({ph["name"]: ph["seconds"] for ph in d.props()["last_wake"]["phases"]})
        return {
            "resume": median(resumes),
            "warm_ttft": median(warm),
            "phases": {name: median([p.get(name, 0.0) for p in phases]) for name in phases[0]},
            "loaded_rss": loaded_rss,
            "asleep_rss": median(asleep_rss),
        }
    finally:
        d.stop()


def run(cycles: int = 5, threads: int = 2) -> tuple[str, dict]:
    """Measure; return the printed report and the figures."""
    args = argparse.Namespace(cycles=cycles, threads=threads)
    model = bundled_model()
    out: list[str] = []
    print = out.append  # noqa: A001 - the report is collected, then printed or written

    bare = [run_python(BARE.format(model=model, threads=args.threads)) for _ in range(args.cycles)]
    bare_load = median([b["load"] for b in bare])
    bare_first = median([b["load_to_first_token"] for b in bare])
    bare_import = median([b["import"] for b in bare])
    with_spare = measure_daemon(model, True, args.cycles, args.threads)
    without = measure_daemon(model, False, args.cycles, args.threads)

    mib = 1024 * 1024
    print(f"Resume latency (request to first streamed token while asleep), median of {args.cycles}, {args.threads} threads\n")
    rows = [
        ["llama-cpp-python bare Llama() load", bare_load, 1.0],
        ["llama-cpp-python bare load + first token", bare_first, bare_first / bare_load],
        ["dormouse resume, spawn-ahead", with_spare["resume"], with_spare["resume"] / bare_load],
        ["dormouse resume, no spawn-ahead", without["resume"], without["resume"] / bare_load],
        ["dormouse warm time to first token", with_spare["warm_ttft"], with_spare["warm_ttft"] / bare_load],
    ]
    print(table(["what", "seconds", "x bare load"], rows))
    print(f"\n(bare `import llama_cpp` alone: {bare_import:.3f} s, not counted in the bare load)")
    print("\nResume phases (median seconds)\n")
    names = list(without["phases"])
    print(table(["phase", "spawn-ahead", "no spawn-ahead"],
                [[n, with_spare["phases"].get(n, 0.0), without["phases"].get(n, 0.0)] for n in names]))
    print("\nRSS of all daemon processes (MiB)\n")
    print(table(["", "loaded", "asleep", "goal asleep"], [
        ["spawn-ahead", with_spare["loaded_rss"] / mib, with_spare["asleep_rss"] / mib, "< 100"],
        ["no spawn-ahead", without["loaded_rss"] / mib, without["asleep_rss"] / mib, "< 60"],
    ]))
    data = {"bare_load": bare_load, "bare_first_token": bare_first, "with_spare": with_spare, "without": without}
    return "\n".join(out), data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    text, data = run(args.cycles, args.threads)
    print(text)
    print("\n" + json.dumps(data))


if __name__ == "__main__":
    main()
