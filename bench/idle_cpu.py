"""CPU used by all daemon processes while asleep (spawned-ahead worker
included), and while loaded and idle, over the same window.

    .venv/bin/python -m bench.idle_cpu [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import Daemon, bundled_model, table


def run(seconds: float = 60.0) -> tuple[str, dict]:
    d = Daemon("--sleep-idle-seconds", "-1", model=bundled_model())
    try:
        d.wait_state("ready")
        time.sleep(1)
        rows = {}
        for label in ("loaded, idle", "asleep (spawn-ahead worker held)"):
            if label.startswith("asleep"):
                d.http.post("/sleep").raise_for_status()
                d.wait_spare()
                time.sleep(1)
            before = d.tree_cpu_seconds()
            time.sleep(seconds)
            used = d.tree_cpu_seconds() - before
            rows[label] = {"cpu_seconds": used, "percent_of_core": 100 * used / seconds, "rss_mib": d.tree_rss() / 2**20}
    finally:
        d.stop()
    text = f"CPU of all daemon processes over {seconds:g} s (goal asleep: under 1% of a core)\n\n" + table(
        ["state", "CPU seconds", "% of one core", "RSS MiB"],
        [[k, v["cpu_seconds"], v["percent_of_core"], v["rss_mib"]] for k, v in rows.items()])
    return text, rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    text, data = run(parser.parse_args().seconds)
    print(text)
    print("\n" + json.dumps(data))


if __name__ == "__main__":
    main()
