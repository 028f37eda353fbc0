"""metrics_compat's mapping, on Dormouse's metric families alone (no daemon):
the setting, what each compat series reads, sleep states, the throughput
window, the labels, and that off means Dormouse's own text unchanged."""

from __future__ import annotations

import time
from unittest import mock

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from config import ConfigError, Settings, load_settings
from daemon import protocol as p
from daemon.metrics import MetricFamilies, Metrics
from daemon.metrics_compat import KINDS, SLEEP_STATES, VLLM_SLEEP_STATES
from statemachine import ServerState
from tests.metrics_text import samples, value

ALL = list(KINDS)
DETAIL = ("request_prompt_tokens", "request_generation_tokens", "request_max_generation_tokens", "request_queue_seconds",
          "request_prefill_seconds", "request_decode_seconds", "request_inference_seconds", "requests_finished")


def fleet(*ids: str) -> tuple[MetricFamilies, dict[str, Metrics]]:
    families = MetricFamilies()
    return families, {i: Metrics(families, i) for i in ids}


def text(families: MetricFamilies, kinds=ALL) -> str:
    return families.render(kinds)[0].decode()


def done(reason="stop", prompt=10, completion=5, cached=4, prefill=0.1, decode=0.4) -> p.Done:
    return p.Done("r", reason, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                  prompt_seconds=prefill, generation_seconds=decode, cache_tier="slot" if cached else "")


def finish(m: Metrics, d: p.Done, waited: float = 0.5, choices: int = 1) -> None:
    """As the controller accounts a Done (and the HTTP layer its duration). The clock is held still
    while it is read twice (here and in observe_request), so a busy machine adds no queue time."""
    m.prompt_tokens.inc(d.prompt_tokens)
    m.generated_tokens.inc(d.completion_tokens)
    now = time.monotonic()
    with mock.patch("daemon.metrics.time.monotonic", return_value=now):
        m.observe_request(d, now - waited - d.prompt_seconds - d.generation_seconds, choices)


# -- the setting --

def test_the_setting_takes_a_list_or_names_separated_by_commas(monkeypatch):
    assert Settings().metrics_compat == []
    assert Settings(metrics_compat=["vllm", "otel"]).metrics_compat == ["vllm", "otel"]
    assert Settings(metrics_compat="vllm, llamacpp,vllm").metrics_compat == ["vllm", "llamacpp"]
    assert Settings(metrics_compat='["otel"]').metrics_compat == ["otel"]
    monkeypatch.setenv("DORMOUSE_METRICS_COMPAT", "llamacpp,otel")
    assert load_settings().metrics_compat == ["llamacpp", "otel"]


@pytest.mark.parametrize("bad", ["prometheus", "vllm,tgi", '["vllm", 3]', "[oops"])
def test_the_setting_refuses_what_it_does_not_know_and_names_itself(monkeypatch, bad):
    monkeypatch.setenv("DORMOUSE_METRICS_COMPAT", bad)
    with pytest.raises(ConfigError, match=r"metrics_compat.*environment DORMOUSE_METRICS_COMPAT"):
        load_settings()


def test_the_setting_from_a_config_file_refuses_a_string_of_unknown_names(tmp_path):
    config = tmp_path / "dormouse.toml"
    config.write_text('metrics_compat = ["vllm", "sglang"]\n')
    with pytest.raises(ConfigError, match=r"metrics_compat\.1: Input should be 'llamacpp', 'vllm' or 'otel'"):
        load_settings(config)


# -- off: Dormouse's own text --

def test_off_renders_the_registry_alone_and_the_detail_stays_outside_it():
    families, models = fleet("a")
    finish(models["a"], done())
    own = generate_latest(families.registry)
    assert families.render()[0] == own == families.render([])[0]
    registered = {f.name for f in families.registry.collect()}
    detail = {getattr(families, name)._name for name in DETAIL}
    assert len(detail) == len(DETAIL) and not detail & registered
    assert families.render(ALL)[0].startswith(own)


@pytest.mark.parametrize("kind, prefix", [("llamacpp", "llamacpp:"), ("vllm", "vllm:"), ("otel", "gen_ai_server_")])
def test_each_kind_alone_adds_its_own_names_only(kind, prefix):
    families, _ = fleet("a")
    own = generate_latest(families.registry)
    tail = families.render([kind])[0][len(own):].decode()
    names = {f.name for f in text_string_to_metric_families(tail)}
    assert names and all(name.startswith(prefix) for name in names)


# -- what the series read --

def test_running_waiting_and_kv_usage_come_from_slots_and_requests():
    families, models = fleet("a")
    m = models["a"]
    m.set_state(ServerState.READY)
    m.set_slots(["generating", "processing_prompt", "idle", "idle"])
    m.requests_in_flight.set(5)  # 2 on slots, 3 queued in the worker
    m.requests_waiting.set(1)  # (and one for a wake: not while ready, but counted all the same)
    t = text(families)
    assert value(t, "vllm:num_requests_running") == 2 == value(t, "llamacpp:requests_processing")
    assert value(t, "vllm:num_requests_waiting") == 4 == value(t, "llamacpp:requests_deferred")
    assert value(t, "vllm:kv_cache_usage_perc") == 0.5
    m.set_slots([])  # asleep: no slots
    m.requests_in_flight.set(0)
    t = text(families)
    assert value(t, "vllm:kv_cache_usage_perc") == 0 and value(t, "vllm:num_requests_waiting") == 1


def test_a_request_of_n_choices_on_n_slots_is_n_running_and_none_waiting():
    families, models = fleet("a")
    models["a"].set_slots(["generating"] * 3 + ["idle"])
    models["a"].requests_in_flight.set(1)
    t = text(families)
    assert value(t, "vllm:num_requests_running") == 3 and value(t, "vllm:num_requests_waiting") == 0


@pytest.mark.parametrize("state", list(ServerState))
def test_every_state_maps_to_at_most_one_sleep_state(state):
    families, models = fleet("a")
    models["a"].set_state(state)
    t = text(families, ["vllm"])
    ones = [s for s in VLLM_SLEEP_STATES if value(t, "vllm:engine_sleep_state", sleep_state=s) == 1]
    assert ones == ([SLEEP_STATES[state.value]] if state.value in SLEEP_STATES else [])
    assert len(samples(t, "vllm:engine_sleep_state")) == 3
    expected = {ServerState.READY: ["awake"], ServerState.SLEEPING: ["discard_all"], ServerState.WAKING: ["discard_all"],
                ServerState.UNLOADING: ["discard_all"], ServerState.DOZING: ["weights_offloaded"],
                ServerState.DROWSY: ["weights_offloaded"], ServerState.ROUSING: ["weights_offloaded"],
                ServerState.LIGHT_SLEEP: ["weights_offloaded"]}
    assert ones == expected.get(state, [])


@pytest.mark.parametrize("state, tier, sleep_state", [
    ("ready", "awake", "awake"), ("dozing", "drowsy", "weights_offloaded"), ("drowsy", "drowsy", "weights_offloaded"),
    ("rousing", "drowsy", "weights_offloaded"), ("light_sleep", "light", "weights_offloaded"),
    ("sleeping", "deep", "discard_all"), ("unloading", "light", "weights_offloaded"),
    ("unloading", "deep", "discard_all"), ("unloading", "drowsy", "weights_offloaded"),
    ("waking", "light", "weights_offloaded"), ("waking", "deep", "discard_all"),
    ("starting", None, None), ("loading", None, None), ("failed", None, None), ("stopping", None, None)])
def test_each_tier_is_vllms_sleep_level_and_the_way_there_its_tiers(state, tier, sleep_state):
    """vLLM's level 1 (weights_offloaded: the KV cache gone, the weights kept in memory) is
    drowsy and light; level 2 (discard_all) is deep; on the way down or up, the tier's."""
    families, models = fleet("a")
    models["a"].set_state(ServerState(state))
    models["a"].set_tier(tier)
    t = text(families, ["vllm"])
    ones = [s for s in VLLM_SLEEP_STATES if value(t, "vllm:engine_sleep_state", sleep_state=s) == 1]
    assert ones == ([sleep_state] if sleep_state else [])


def test_tokens_are_dormouses_counters_and_llamacpp_leaves_the_cached_ones_out():
    families, models = fleet("a")
    finish(models["a"], done(prompt=10, cached=4, completion=5))
    finish(models["a"], done(prompt=20, cached=0, completion=7))
    t = text(families)
    assert value(t, "vllm:prompt_tokens_total") == 30 == value(t, "vllm:prefix_cache_queries_total")
    assert value(t, "vllm:prompt_tokens_cached_total") == 4 == value(t, "vllm:prefix_cache_hits_total")
    assert value(t, "llamacpp:prompt_tokens_total") == 26 and value(t, "llamacpp:prompt_tokens_cached_total") == 4
    assert value(t, "vllm:generation_tokens_total") == 12 == value(t, "llamacpp:tokens_predicted_total")
    assert value(t, "vllm:request_prompt_tokens_count") == 2 and value(t, "vllm:request_prompt_tokens_sum") == 30
    assert value(t, "vllm:request_prompt_tokens_bucket", le="10.0") == 1
    assert value(t, "llamacpp:prompt_seconds_total") == pytest.approx(0.2)
    assert value(t, "llamacpp:tokens_predicted_seconds_total") == pytest.approx(0.8)
    assert value(t, "vllm:request_inference_time_seconds_sum") == pytest.approx(1.0)
    assert value(t, "vllm:request_queue_time_seconds_sum") == pytest.approx(1.0)  # 0.5 each


def test_llama_servers_decode_counters_add_up_the_workers_reports():
    families, models = fleet("a")
    t = text(families)
    assert value(t, "llamacpp:n_decode_total") == 0 == value(t, "llamacpp:n_busy_slots_per_decode")  # no 0/0
    for decodes, busy, rounds, longest in ((10, 14, 0, 300), (5, 10, 2, 120)):  # reports since the last one
        models["a"].add_decodes(p.SlotStates([], decodes=decodes, busy_slot_decodes=busy, draft_rounds=rounds,
                                             tokens_max=longest))
    t = text(families)
    assert value(t, "llamacpp:n_decode_total") == 15 == value(t, "dormouse_decodes_total", model="a")
    assert value(t, "llamacpp:n_busy_slots_per_decode") == pytest.approx(24 / 15)
    assert value(t, "llamacpp:spec_decode_num_drafts_total") == 2
    assert value(t, "dormouse_sequence_tokens_max", model="a") == 300  # the longest, not the last
    # as llama-server writes it: a counter without _total (prometheus_client's parser would rename it)
    assert "# TYPE llamacpp:n_tokens_max counter" in t and "llamacpp:n_tokens_max 300.0" in t.splitlines()
    families, models = fleet("a", "b")
    models["b"].add_decodes(p.SlotStates([], tokens_max=7))
    assert 'llamacpp:n_tokens_max{model="b"} 7.0' in text(families).splitlines()


def test_finish_reasons_are_vllms_and_a_refused_request_computed_nothing():
    families, models = fleet("a")
    for reason in ("stop", "length", "length", "cancelled", "error"):
        models["a"].observe_request(done(reason), time.monotonic(), 1)
    t = text(families)
    got = {r: value(t, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")}
    assert got == {"stop": 1, "length": 2, "abort": 1, "error": 1}
    assert value(t, "vllm:request_generation_tokens_count") == 4  # the error's Done is no finished generation


def test_max_generation_tokens_is_per_choice():
    families, models = fleet("a")
    models["a"].observe_request(done(completion=9), time.monotonic(), 3)
    assert value(text(families), "vllm:request_max_num_generation_tokens_sum") == 3


def test_latency_histograms_merge_dormouses_series_and_keep_its_buckets():
    families, models = fleet("a")
    m = models["a"]
    m.ttft_seconds.labels(start="cold").observe(2.5)
    m.ttft_seconds.labels(start="warm").observe(0.04)
    m.inter_token_seconds.observe(0.02)
    for endpoint, outcome, seconds in (("chat.completions", "ok", 0.3), ("completions", "ok", 0.6),
                                       ("completion", "error", 0.1), ("tokenize", "ok", 0.001),
                                       ("embeddings", "ok", 0.2)):
        m.request_seconds.labels(endpoint=endpoint, outcome=outcome).observe(seconds)
    t = text(families)
    assert value(t, "vllm:time_to_first_token_seconds_count") == 2
    assert value(t, "vllm:time_to_first_token_seconds_bucket", le="0.05") == 1
    assert value(t, "vllm:time_to_first_token_seconds_bucket", le="3.0") == 2
    assert value(t, "gen_ai_server_time_to_first_token_seconds_sum") == pytest.approx(2.54)
    assert value(t, "vllm:inter_token_latency_seconds_count") == 1 == value(t, "gen_ai_server_time_per_output_token_seconds_count")
    assert value(t, "vllm:e2e_request_latency_seconds_count") == 4  # tokenize asks nothing of the model
    duration = "gen_ai_server_request_duration_seconds_count"
    assert value(t, duration, gen_ai_operation_name="chat", error_type="") == 1
    assert value(t, duration, gen_ai_operation_name="text_completion", error_type="") == 1
    assert value(t, duration, gen_ai_operation_name="text_completion", error_type="_OTHER") == 1
    assert value(t, duration, gen_ai_operation_name="embeddings") == 1
    assert value(t, duration) == 4
    assert samples(t, duration, gen_ai_provider_name="dormouse", gen_ai_request_model="a", gen_ai_response_model="a")


def test_llamacpp_throughput_gauges_cover_the_window_since_the_last_scrape():
    families, models = fleet("a")
    finish(models["a"], done(prompt=10, cached=0, completion=8, prefill=0.5, decode=2.0))
    t = text(families, ["llamacpp"])
    assert value(t, "llamacpp:prompt_tokens_seconds") == pytest.approx(20)
    assert value(t, "llamacpp:predicted_tokens_seconds") == pytest.approx(4)
    t = text(families, ["llamacpp"])  # nothing since: no throughput, as llama-server's empty bucket
    assert value(t, "llamacpp:prompt_tokens_seconds") == 0 == value(t, "llamacpp:predicted_tokens_seconds")
    finish(models["a"], done(prompt=30, cached=10, completion=6, prefill=0.25, decode=0.5))
    t = text(families, ["llamacpp"])
    assert value(t, "llamacpp:prompt_tokens_seconds") == pytest.approx(80)
    assert value(t, "llamacpp:predicted_tokens_seconds") == pytest.approx(12)


def test_one_model_is_llama_servers_shape_and_several_carry_a_model_label():
    families, _ = fleet("only")
    one = [s.labels for f in text_string_to_metric_families(text(families, ["llamacpp"])) if f.name.startswith("llamacpp:")
           for s in f.samples]
    assert one and all(labels == {} for labels in one)
    families, _ = fleet("a", "b")
    t = text(families)
    several = [s.labels for f in text_string_to_metric_families(t) if f.name.startswith("llamacpp:") for s in f.samples]
    assert {labels["model"] for labels in several} == {"a", "b"}
    assert {s.labels["model_name"] for s in text_string_to_metric_families(t) if s.name == "vllm:num_requests_running"
            for s in s.samples} == {"a", "b"}
    assert all(s.labels["engine"] == "0" for f in text_string_to_metric_families(t) if f.name.startswith("vllm:")
               for s in f.samples)


def test_requests_refused_before_any_model_are_no_models_series():
    families, _ = fleet("a")
    families.requests.labels(model="", endpoint="chat.completions", status="404").inc()  # as app.py counts them
    t = text(families)
    assert {s.labels.get("model_name") for f in text_string_to_metric_families(t) if f.name.startswith("vllm:")
            for s in f.samples} == {"a"}
