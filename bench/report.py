"""Run every benchmark and write docs/BENCHMARKS.md with the tables and two
plots (resume latency by phase, throughput by stream count).

    make bench        (or: .venv/bin/python -m bench.report)
"""

from __future__ import annotations

import datetime
import os
import platform

from bench import choices, fleet, grammar, hostile_crowd, idle_cpu, resume, throughput
from bench.common import ROOT

DOCS = ROOT / "docs"
# Sections after this line are measured by their own, longer commands (each
# says which); `make bench` keeps them as they are.
KEPT = "<!-- measured separately: make bench keeps what follows -->"
GRAMMAR_ABOUT = """One greedy stream, 96 tokens inside a JSON string field, beside the same
stream unconstrained, and llama-cpp-python's `Llama` with the same grammar
(from its own converter) in the same run. Dormouse draws from the sampler
chain first and applies the grammar to the whole vocabulary only when the
grammar refuses that token (as llama-server's common_sampler does);
llama-cpp-python masks all 262k candidates of Gemma 3's vocabulary at every
step. Logprobs cost a log-softmax over the vocabulary per token (numpy)."""


def plot(resume_data: dict, throughput_data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    labels = ["llama-cpp-python\nbare load + 1st token", "dormouse\nno spawn-ahead", "dormouse\nspawn-ahead"]
    phases = ["spawn", "backend", "model", "context"]
    bars = {"spawn-ahead": resume_data["with_spare"], "no spawn-ahead": resume_data["without"]}
    left = [0.0, 0.0, 0.0]
    ax.barh(labels[0], resume_data["bare_first_token"], color="#999999", label="bare llama-cpp-python")
    colors = {"spawn": "#4c72b0", "backend": "#dd8452", "model": "#55a868", "context": "#c44e52", "first token": "#8172b2"}
    for i, key in ((1, "no spawn-ahead"), (2, "spawn-ahead")):
        data = bars[key]
        for phase in phases:
            width = data["phases"].get(phase, 0.0)
            ax.barh(labels[i], width, left=left[i], color=colors[phase], label=phase if i == 1 else None)
            left[i] += width
        ax.barh(labels[i], max(0.0, data["resume"] - left[i]), left=left[i], color=colors["first token"],
                label="first token + HTTP" if i == 1 else None)
    ax.set_xlabel("seconds from request (asleep) to first streamed token")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(DOCS / "resume_phases.png", dpi=120)

    fig, ax = plt.subplots(figsize=(5, 3.2))
    streams = [int(k) for k in throughput_data["aggregate"]]
    values = list(throughput_data["aggregate"].values())
    ax.plot(streams, values, marker="o", label="dormouse aggregate")
    ax.axhline(throughput_data["llama_rate"], color="#999999", linestyle="--", label="llama-cpp-python, 1 stream")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens/s")
    ax.set_xticks(streams)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "throughput.png", dpi=120)


def main() -> None:
    resume_text, resume_data = resume.run()
    throughput_text, throughput_data = throughput.run()
    idle_text, _ = idle_cpu.run()
    fleet_text, _ = fleet.run()
    crowd_text, _ = hostile_crowd.run()
    grammar_text, _ = grammar.run()
    choices_text, _ = choices.run()
    plot(resume_data, throughput_data)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    doc = f"""# Benchmarks

Measured {datetime.date.today()} on {machine}, no GPU, bundled Gemma 3 270M
Q4_K_M, 2 threads. Each table puts Dormouse beside a baseline measured in the
same run (llama-cpp-python 0.3.36 on the same model and threads); machines
here are noisy, so read the ratios. Regenerate everything with `make bench`
(`.venv/bin/python -m bench.report`); each part alone with the command above it.

## Resume latency and memory

`.venv/bin/python -m bench.resume`

```
{resume_text}
```

![resume latency by phase](resume_phases.png)

## Throughput

`.venv/bin/python -m bench.throughput`

```
{throughput_text}
```

![throughput by stream count](throughput.png)

## CPU while asleep

`.venv/bin/python -m bench.idle_cpu`

```
{idle_text}
```

## Several models: admission by memory beside a count

`.venv/bin/python -m bench.fleet`

{fleet.ABOUT.strip()}

```
{fleet_text}
```

## Structured output: decode speed under a JSON-schema grammar

`.venv/bin/python -m bench.grammar`

{GRAMMAR_ABOUT}

```
{grammar_text}
```

## n choices from one prompt

`.venv/bin/python -m bench.choices`

```
{choices_text}
```

## One normal stream beside a hostile crowd

`.venv/bin/python -m bench.hostile_crowd`

The inter-token gap of one greedy stream alone, then while four clients send
200 hostile requests (6 MB prompts, 50k logit_bias entries, huge windows and
the like, all refused or bounded). On 2 cores the crowd's own client process
and the daemon's parsing share the CPU with decoding, so the mean gap grows;
the max gap shows that no single request stalls the stream.

```
{crowd_text}
```
"""
    old = (DOCS / "BENCHMARKS.md").read_text() if (DOCS / "BENCHMARKS.md").exists() else ""
    if KEPT in old:
        doc += "\n" + KEPT + old.split(KEPT, 1)[1]
    (DOCS / "BENCHMARKS.md").write_text(doc)
    print(doc)


if __name__ == "__main__":
    main()
