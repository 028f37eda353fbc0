"""metrics_compat against a daemon on the fake worker: scrapes recorded while
it serves, queues, sleeps and wakes answer the queries other tools run (vLLM's
stock Grafana dashboard, the Gateway API Inference Extension's model-server
protocol, llama-server and OpenTelemetry GenAI panels), evaluated by promtool
on the recorded series; promtool's lint finds nothing but the colons those
tools' names carry; and with metrics_compat off /metrics is Dormouse's own."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.http.keys import METRICS
from statemachine import ServerState
from tests.conftest import fake_daemon, fake_fleet
from tests.metrics_text import samples, series, value

QUERIES = yaml.safe_load((Path(__file__).parents[1] / "fixtures" / "metrics_compat_queries.yaml").read_text())
COMPAT = ["llamacpp", "vllm", "otel"]
TIMED = "tests.fixtures.timed_fake_worker"  # the fake, reporting prefill and decode seconds on each Done
STEP = 10  # seconds between two recorded scrapes, as promtool replays them
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (.ci/run installs it)")
COLON = "metric names should not contain ':'"
TWO = {"chat": {}, "coder": {}}


async def until(predicate, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def scrape(client) -> str:
    response = await client.get("/metrics")
    assert response.status == 200
    return await response.text()


async def chat(client, max_tokens=4, **body):
    return await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **body})


async def complete(client, prompt="hi", max_tokens=4, **body):
    return await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **body})


async def scrape_beside_own(client, same, tries: int = 20) -> tuple[bytes, bytes]:
    """A scrape, and the registry's own text just after it. A late message from
    the worker (its slots going idle) may change a value in between, so a
    mismatch is looked at again on a quieter scrape; a real difference stays."""
    for _ in range(tries):
        body = await (await client.get("/metrics")).read()
        own = generate_latest(client.server.app[METRICS].registry)
        if same(body, own):
            break
        await asyncio.sleep(0.05)
    return body, own


def one(text: str, name: str, **labels) -> float:
    found = samples(text, name, **labels)
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


async def record(controller, client) -> dict[str, str]:
    """A daemon's life in scrapes: idle, after warm requests, in a burst beyond
    its slots, after it, asleep, while a request waits for the wake, awake."""
    s: dict[str, str] = {}
    assert await controller.wait_for(lambda st: st is ServerState.READY, 10)
    s["idle"] = await scrape(client)
    assert (await chat(client)).status == 200
    assert (await complete(client)).status == 200
    streamed = await chat(client, stream=True)
    assert streamed.status == 200 and (await streamed.read()).endswith(b"data: [DONE]\n\n")
    assert (await complete(client, prompt="FAIL")).status == 400  # the worker refuses it: an error Done
    s["served"] = await scrape(client)

    burst = [asyncio.create_task(complete(client, max_tokens=40)) for _ in range(6)]  # 2 slots

    async def queued() -> bool:
        s["burst"] = await scrape(client)
        return value(s["burst"], "vllm:num_requests_running") == 2 and value(s["burst"], "vllm:num_requests_waiting") == 4
    await until(queued)
    assert all(r.status == 200 for r in await asyncio.gather(*burst))
    s["after_burst"] = await scrape(client)

    assert (await client.post("/sleep")).status == 200
    s["asleep"] = await scrape(client)
    cold = asyncio.create_task(chat(client))  # wakes it (FAKE_LOAD_SECONDS)

    async def waiting_for_wake() -> bool:
        s["waking"] = await scrape(client)
        return value(s["waking"], "vllm:num_requests_waiting") == 1
    await until(waiting_for_wake)
    assert (await cold).status == 200
    s["awake"] = await scrape(client)
    return s


def promtool_unanswered(tmp_path: Path, scrapes: list[str], queries: list[str]) -> list[str]:
    """The queries that return nothing (or only NaN) at the last of `scrapes`,
    replayed STEP seconds apart: each query an alert `absent((q) == (q))` that
    `promtool test rules` expects not to fire."""
    rules = {"groups": [{"name": "queries", "rules": [
        {"alert": f"q{i}", "expr": f"absent(({q}) == ({q}))"} for i, q in enumerate(queries)]}]}
    end = f"{STEP * (len(scrapes) - 1)}s"
    recorded = series(scrapes)
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": f"{STEP}s", "tests": [{
        "interval": f"{STEP}s",
        "input_series": [{"series": name, "values": " ".join("_" if v is None else repr(float(v)) for v in values)}
                         for name, values in recorded.items()],
        "alert_rule_test": [{"eval_time": end, "alertname": f"q{i}", "exp_alerts": []} for i in range(len(queries))],
    }]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules, width=10_000))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, width=10_000))
    done = subprocess.run([PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    output = done.stdout + done.stderr
    failed = sorted({int(i) for i in re.findall(r"alertname: q(\d+)", output)})
    assert (done.returncode == 0) == (not failed), output  # a rule or series that does not parse fails loudly
    return [queries[i] for i in failed]


def for_model(queries: list[str], model: str, span: str) -> list[str]:
    return [q.replace("$model_name", model).replace("$__rate_interval", span) for q in queries]


def lint(text: str) -> list[str]:
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    return [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


def colon_families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ") and ":" in line.split()[2]}


@needs_promtool
async def test_recorded_scrapes_answer_the_dashboard_and_the_endpoint_picker(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "0.3")
    async with fake_daemon(metrics_compat=COMPAT, worker_module=TIMED, parallel=2) as (controller, client):
        s = await record(controller, client)
    scrapes = list(s.values())
    span = f"{STEP * (len(scrapes) - 1)}s"  # Grafana's $__rate_interval: the whole recording
    queries = (for_model(QUERIES["vllm_grafana"]["queries"], "fake", span)
               + list(QUERIES["gie_model_server_protocol"]["metrics"].values())
               + for_model(QUERIES["llamacpp"]["queries"], "fake", span)
               + for_model(QUERIES["otel"]["queries"], "fake", span))
    absent = list(QUERIES["gie_model_server_protocol"]["not_applicable"].values()) + ["vllm:num_requests_swapped"]
    # The check can fail: what Dormouse does not export is reported, and nothing else.
    assert promtool_unanswered(tmp_path, scrapes, queries + absent) == absent


@needs_promtool
async def test_promtool_finds_only_the_colons_of_the_names_other_tools_read():
    async with fake_fleet(TWO, memory_budget=100 * 2**30, metrics_compat=COMPAT, worker_module=TIMED) as (fleet, client):
        assert await fleet.default_model.controller.wait_for(lambda st: st is ServerState.READY, 10)
        assert (await chat(client)).status == 200
        assert (await complete(client, model="coder")).status == 200  # wakes coder
        assert (await complete(client, prompt="FAIL")).status == 400
        text = await scrape(client)
    findings = lint(text)
    colons = colon_families(text)
    assert colons and all(name.startswith(("llamacpp:", "vllm:")) for name in colons)
    # and llama-server's n_tokens_max, a counter without _total in llama-server's own exposition
    total = 'llamacpp:n_tokens_max counter metrics should have "_total" suffix'
    assert sorted(findings) == sorted([f"{name} {COLON}" for name in colons] + [total]), "\n".join(findings)


async def test_the_mapping_follows_dormouse_through_a_recording(monkeypatch):
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "0.3")
    async with fake_daemon(metrics_compat=COMPAT, worker_module=TIMED, parallel=2) as (controller, client):
        s = await record(controller, client)
    end = s["awake"]
    # The endpoint picker's three gauges, one series each, as vLLM's.
    families = {f.name: f for f in text_string_to_metric_families(end)}
    for name in QUERIES["gie_model_server_protocol"]["metrics"].values():
        assert families[name].type == "gauge"
        assert [x.labels for x in families[name].samples] == [{"model_name": "fake", "engine": "0"}]
    # In the burst: 2 slots busy, 4 beyond them; asleep; waiting for the wake.
    burst = s["burst"]
    assert one(burst, "vllm:kv_cache_usage_perc") == 1.0
    assert (one(burst, "llamacpp:requests_processing"), one(burst, "llamacpp:requests_deferred")) == (2, 4)
    for name, awake, discard in (("idle", 1, 0), ("asleep", 0, 1), ("waking", 0, 1), ("awake", 1, 0)):
        assert one(s[name], "vllm:engine_sleep_state", sleep_state="awake") == awake, name
        assert one(s[name], "vllm:engine_sleep_state", sleep_state="discard_all") == discard, name
        assert one(s[name], "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 0
    assert one(s["waking"], "llamacpp:requests_deferred") == 1 and one(s["waking"], "vllm:kv_cache_usage_perc") == 0
    assert one(s["asleep"], "vllm:num_requests_running") == 0
    # Counters and histograms are Dormouse's own, renamed.
    prompt, cached = value(end, "dormouse_prompt_tokens_total"), value(end, "dormouse_prompt_cache_tokens_total")
    generated = value(end, "dormouse_generated_tokens_total")
    assert prompt > 0 and generated > 0
    assert one(end, "vllm:prompt_tokens_total") == prompt == one(end, "vllm:prefix_cache_queries_total")
    assert one(end, "vllm:generation_tokens_total") == generated == one(end, "llamacpp:tokens_predicted_total")
    assert one(end, "llamacpp:prompt_tokens_total") == prompt - cached
    assert one(end, "vllm:time_to_first_token_seconds_count") == value(end, "dormouse_time_to_first_token_seconds_count")
    assert (one(end, "gen_ai_server_time_per_output_token_seconds_count")
            == one(end, "vllm:request_time_per_output_token_seconds_count")
            == value(end, "dormouse_inter_token_seconds_count") > 0)
    inference = sum(value(end, "dormouse_request_duration_seconds_count", endpoint=e)
                    for e in ("chat.completions", "completions"))
    assert one(end, "vllm:e2e_request_latency_seconds_count") == inference == 11  # 4 warm (1 refused), 6, 1 cold
    assert value(end, "gen_ai_server_request_duration_seconds_count") == inference
    assert one(end, "gen_ai_server_request_duration_seconds_count", gen_ai_operation_name="text_completion",
               error_type="_OTHER") == 1  # the refused prompt
    assert one(end, "vllm:request_success_total", finished_reason="length") == 10
    assert one(end, "vllm:request_success_total", finished_reason="error") == 1
    assert one(end, "vllm:request_prefill_time_seconds_count") == 10
    assert one(end, "llamacpp:tokens_predicted_seconds_total") > 0 and one(end, "llamacpp:prompt_seconds_total") > 0
    # One model: llama-server's shape, no labels.
    assert [x.labels for x in families["llamacpp:requests_processing"].samples] == [{}]


async def test_off_by_default_metrics_are_dormouses_own_byte_for_byte():
    async with fake_daemon() as (controller, client):
        assert controller.settings.metrics_compat == []
        assert await controller.wait_for(lambda st: st is ServerState.READY, 10)
        assert (await complete(client)).status == 200
        body, own = await scrape_beside_own(client, lambda body, own: body == own)
        assert body == own
    text = body.decode()
    assert "llamacpp:" not in text and "vllm:" not in text and "gen_ai_" not in text
    # The per-request detail the compat series read is kept outside the registry.
    for name in ("dormouse_request_prompt_tokens", "dormouse_request_queue_seconds", "dormouse_requests_finished"):
        assert name not in text


async def test_compat_series_follow_dormouses_own_text_unchanged():
    async with fake_daemon(metrics_compat=COMPAT, worker_module=TIMED) as (controller, client):
        assert await controller.wait_for(lambda st: st is ServerState.READY, 10)
        assert (await complete(client)).status == 200
        body, own = await scrape_beside_own(client, lambda body, own: body.startswith(own))
    assert body.startswith(own) and len(body) > len(own)
    tail = body[len(own):].decode()
    assert {line.split()[2].split(":")[0].split("_")[0] for line in tail.splitlines() if line.startswith("# TYPE ")} \
        == {"llamacpp", "vllm", "gen"}


async def test_a_fleet_labels_each_model_and_sleeps_them_apart():
    async with fake_fleet(TWO, memory_budget=100 * 2**30, metrics_compat=COMPAT, worker_module=TIMED) as (fleet, client):
        assert await fleet.default_model.controller.wait_for(lambda st: st is ServerState.READY, 10)
        assert (await complete(client, model="coder")).status == 200  # wakes coder
        assert (await client.post("/sleep", json={"model": "chat"})).status == 200
        text = await scrape(client)
    assert one(text, "vllm:engine_sleep_state", model_name="chat", sleep_state="discard_all") == 1
    assert one(text, "vllm:engine_sleep_state", model_name="coder", sleep_state="awake") == 1
    assert one(text, "llamacpp:tokens_predicted_total", model="coder") == 4
    assert one(text, "llamacpp:tokens_predicted_total", model="chat") == 0
    assert one(text, "gen_ai_server_request_duration_seconds_count", gen_ai_request_model="coder") == 1
    assert {x.labels.get("model") for f in text_string_to_metric_families(text) if f.name.startswith("llamacpp:")
            for x in f.samples} == {"chat", "coder"}
