"""The metric names other tools read, mapped from Dormouse's own at scrape time.

`metrics_compat` turns each kind on; off (the default), /metrics carries
Dormouse's names only, byte for byte as without this module.

  llamacpp  llama-server's `llamacpp:` series (dashboards and scripts built on
            llama-server): one model -> no labels, as llama-server; several ->
            a `model` label.
  vllm      vLLM's `vllm:` series with its labels (model_name, engine): the
            Gateway API Inference Extension's endpoint picker reads
            num_requests_waiting, num_requests_running and kv_cache_usage_perc;
            vLLM's Grafana dashboard reads the rest.
  otel      OpenTelemetry GenAI's server histograms, as an OTel Prometheus
            exporter names them (gen_ai_server_*_seconds, attributes as labels).

Nothing here records anything: every value is read, when /metrics is asked
for, from Dormouse's families (the registry's, and the per-request detail that
daemon/metrics.py keeps outside it). The colon names are those tools' own;
`promtool check metrics` reports exactly one finding for each of them ("metric
names should not contain ':'") and nothing else.

What is approximated, and why:
- running = busy slots; waiting (vLLM) / deferred (llama-server) = requests
  waiting for a worker (a wake) plus those handed to the worker beyond its
  slots. A request of n choices holds n slots, as vLLM counts n requests.
- kv_cache_usage_perc = busy slots / slots: llama.cpp gives each slot its own
  n_ctx/parallel cells, so a busy slot's share is taken however full it is.
- Histograms keep Dormouse's buckets (every quantile and mean query works).
  vLLM's inter_token_latency_seconds is one observation per request (its mean
  gap), the same source as request_time_per_output_token_seconds.
- Queue time = accepted to worker start (the rest of the request's time), a
  wake included. vLLM's finished_reason "abort" is a request cancelled when
  its client left.
- llama-server's throughput gauges are averaged over the window between two
  scrapes, as llama-server's (so two scrapers share one window).
- llama-server's n_decode_total counts the model's decodes for prompts and
  generation, speculative verification included (llama-server leaves those
  out), embeddings not; n_tokens_max is the longest sequence a slot has held
  since the daemon started (a counter in llama-server's exposition, a gauge's
  value here). The worker reports these with its slots' states, so they stand
  as of the last slot change (every request's end is one).
- Not exported (Dormouse has no source): vLLM's lora_requests_info (no adapters are served), cache_config_info,
  num_preemptions, iteration_tokens_total.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# daemon.metrics.MetricFamilies, read by attribute: that module imports this one, so this one
# names it only here and does not import it back (no circle).
MetricFamilies = Any

KINDS = ("llamacpp", "vllm", "otel")

# vLLM's sleep_state (vllm:engine_sleep_state): awake; weights_offloaded (sleep level 1: the KV
# cache is discarded, the weights kept in host memory, a wake does not read them from disk);
# discard_all (level 2: weights and KV cache forgotten). Dormouse's tiers, by the same test:
# drowsy frees the contexts and keeps the weights (level 1); light lets the worker go but the
# daemon's keeper holds the GGUF's pages in host memory, so a wake reads no disk (level 1);
# deep holds nothing (level 2). A model on its way down is counted in the tier it goes to, one
# waking in the tier it wakes from (dormouse_sleep_tier says which). Not listed (starting, a
# first load, failed, stopping): neither awake nor asleep, every sleep_state 0.
TIER_SLEEP_STATES = {"awake": "awake", "drowsy": "weights_offloaded", "light": "weights_offloaded",
                     "deep": "discard_all"}
# From the state alone (where no tier is exported): the resting states and the ways between.
SLEEP_STATES = {"ready": "awake", "dozing": "weights_offloaded", "drowsy": "weights_offloaded",
                "rousing": "weights_offloaded", "light_sleep": "weights_offloaded", "unloading": "discard_all",
                "sleeping": "discard_all", "waking": "discard_all"}
VLLM_SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")

# dormouse_request_duration_seconds{endpoint} -> OTel's gen_ai.operation.name. The
# endpoints that ask nothing of the model (tokenize, ...) are no inference requests.
OPERATIONS = {"chat.completions": "chat", "completions": "text_completion", "completion": "text_completion",
              "embeddings": "embeddings"}
NOT_INFERENCE = frozenset({"tokenize", "detokenize", "apply-template", "render-chat", "mixed-prompt.tokenize"})
OTEL_PROVIDER = "dormouse"


@dataclass
class Merged:
    """One histogram's samples, summed over the Dormouse series merged into it."""

    buckets: dict[str, float] = field(default_factory=dict)  # le -> cumulative count, in the family's order
    total: float = 0.0

    def add(self, suffix: str, labels: dict[str, str], value: float) -> None:
        if suffix == "_bucket":
            self.buckets[labels["le"]] = self.buckets.get(labels["le"], 0.0) + value
        elif suffix == "_sum":
            self.total += value


@dataclass
class Model:
    """What one model's Dormouse families say right now."""

    state: str = ""
    tier: str | None = None  # dormouse_sleep_tier's 1 (None: no tier is 1, or none exported)
    slots: int = 0
    busy: int = 0
    in_flight: float = 0.0
    waiting: float = 0.0
    prompt: float = 0.0
    cached: float = 0.0
    generated: float = 0.0
    drafted: float = 0.0
    accepted: float = 0.0
    decodes: float = 0.0
    busy_slot_decodes: float = 0.0
    draft_rounds: float = 0.0
    tokens_max: float = 0.0
    finished: dict[str, float] = field(default_factory=dict)
    hist: dict[str, Merged] = field(default_factory=dict)  # ttft, tpot, request_*, e2e
    e2e: dict[tuple[str, str], Merged] = field(default_factory=dict)  # (operation, outcome) -> duration

    @property
    def deferred(self) -> float:
        """Waiting for a worker, and handed to it beyond its slots."""
        return self.waiting + max(self.in_flight - self.busy, 0.0)

    @property
    def sleep_state(self) -> str | None:
        """vLLM's sleep_state that is 1 (None: none is)."""
        if self.state not in SLEEP_STATES:
            return None
        return TIER_SLEEP_STATES[self.tier] if self.tier in TIER_SLEEP_STATES else SLEEP_STATES[self.state]

    @property
    def slot_usage(self) -> float:
        return self.busy / self.slots if self.slots else 0.0

    def histogram(self, name: str) -> Merged:
        return self.hist.setdefault(name, Merged())


def _samples(family) -> Iterable[tuple[str, dict[str, str], float]]:
    """(suffix after the family's name, labels, value) of a prometheus_client family's samples."""
    for metric in family.collect():
        for sample in metric.samples:
            yield sample.name[len(metric.name):], sample.labels, sample.value


def read(families: MetricFamilies) -> dict[str, Model]:
    """Every model's view, from the families (models in `dormouse_state`)."""
    models: dict[str, Model] = {}

    def each(family, suffix: str = "") -> Iterable[tuple[Model, dict[str, str], float]]:
        for sfx, labels, value in _samples(family):
            if sfx == suffix and labels.get("model") in models:
                yield models[labels["model"]], labels, value

    for _, labels, value in _samples(families.state):
        if labels["model"]:
            model = models.setdefault(labels["model"], Model())
            if value == 1:
                model.state = labels["state"]
    for model, labels, value in each(families.sleep_tier):
        if value == 1:
            model.tier = labels["tier"]
    for model, labels, value in each(families.slots):
        model.slots += int(value)
        if labels["state"] != "idle":
            model.busy += int(value)
    for model, _, value in each(families.requests_in_flight):
        model.in_flight = value
    for model, _, value in each(families.requests_waiting):
        model.waiting = value
    for model, _, value in each(families.sequence_tokens_max):
        model.tokens_max = value
    for name, attr in (("prompt_tokens", "prompt"), ("prompt_cache_restored_tokens", "cached"),  # cached: every tier
                       ("generated_tokens", "generated"), ("draft_tokens", "drafted"), ("accepted_tokens", "accepted"),
                       ("decodes", "decodes"), ("decode_busy_slots", "busy_slot_decodes"),
                       ("speculative_rounds", "draft_rounds")):
        for model, _, value in each(getattr(families, name), "_total"):
            setattr(model, attr, getattr(model, attr) + value)
    for model, labels, value in each(families.requests_finished, "_total"):
        model.finished[labels["reason"]] = model.finished.get(labels["reason"], 0.0) + value
    histograms = {"ttft": families.ttft_seconds, "tpot": families.inter_token_seconds,
                  "prompt_tokens": families.request_prompt_tokens,
                  "generation_tokens": families.request_generation_tokens,
                  "max_generation_tokens": families.request_max_generation_tokens,
                  "queue": families.request_queue_seconds, "prefill": families.request_prefill_seconds,
                  "decode": families.request_decode_seconds, "inference": families.request_inference_seconds}
    for name, family in histograms.items():
        for sfx, labels, value in _samples(family):
            if labels.get("model") in models:
                models[labels["model"]].histogram(name).add(sfx, labels, value)
    for sfx, labels, value in _samples(families.request_seconds):
        model = models.get(labels.get("model", ""))
        if model is None or labels["endpoint"] in NOT_INFERENCE:
            continue
        key = (OPERATIONS.get(labels["endpoint"], labels["endpoint"]), labels["outcome"])
        model.e2e.setdefault(key, Merged()).add(sfx, labels, value)
        model.histogram("e2e").add(sfx, labels, value)
    return models


def _add_histogram(family: HistogramMetricFamily, labels: list[str], h: Merged) -> None:
    family.add_metric(labels, list(h.buckets.items()) or [("+Inf", 0.0)], h.total)


class CompatExport:
    """The compatibility families of one registry (the llama-server throughput
    gauges' window lives here, between two scrapes)."""

    def __init__(self, families: MetricFamilies) -> None:
        self.families = families
        self._window: dict[str, tuple[float, float, float, float]] = {}  # model -> totals at the last scrape

    def render(self, kinds: Sequence[str]) -> bytes:
        models = read(self.families)
        out: list[Any] = []
        if "llamacpp" in kinds:
            out += self.llamacpp(models)
        if "vllm" in kinds:
            out += vllm(models)
        if "otel" in kinds:
            out += otel(models)
        text = generate_latest(_Families(out))
        if "llamacpp" in kinds:
            text += llamacpp_tokens_max(models)
        return text

    def llamacpp(self, models: dict[str, Model]) -> list[Any]:
        """llama-server's /metrics (server-task.cpp to_metrics), one model without labels."""
        names = ["model"] if len(models) > 1 else []

        def labels(model_id: str) -> list[str]:
            return [model_id] if names else []

        def counter(name: str, doc: str, value: Callable[[Model], float]) -> CounterMetricFamily:
            family = CounterMetricFamily(f"llamacpp:{name}", doc, labels=names)
            for model_id, m in models.items():
                family.add_metric(labels(model_id), value(m))
            return family

        def gauge(name: str, doc: str, values: dict[str, float]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"llamacpp:{name}", doc, labels=names)
            for model_id, value in values.items():
                family.add_metric(labels(model_id), value)
            return family

        def seconds(m: Model, name: str) -> float:
            return m.hist[name].total if name in m.hist else 0.0

        prompt_rate, predicted_rate = {}, {}
        for model_id, m in models.items():
            now = (m.prompt - m.cached, seconds(m, "prefill"), m.generated, seconds(m, "decode"))
            before = self._window.get(model_id, (0.0, 0.0, 0.0, 0.0))
            self._window[model_id] = now
            d = [a - b for a, b in zip(now, before)]
            prompt_rate[model_id] = d[0] / d[1] if d[1] > 0 else 0.0
            predicted_rate[model_id] = d[2] / d[3] if d[3] > 0 else 0.0
        return [
            counter("prompt_tokens", "Prompt tokens processed, not those reused from the cache "
                    "(dormouse_prompt_tokens_total - sum of dormouse_prompt_cache_tokens_total)",
                    lambda m: m.prompt - m.cached),
            counter("prompt_tokens_cached", "Prompt tokens reused from the cache (sum of dormouse_prompt_cache_tokens_total)",
                    lambda m: m.cached),
            counter("prompt_seconds", "Time spent reading prompts", lambda m: seconds(m, "prefill")),
            counter("tokens_predicted", "Tokens generated (dormouse_generated_tokens_total)", lambda m: m.generated),
            counter("tokens_predicted_seconds", "Time spent generating", lambda m: seconds(m, "decode")),
            counter("spec_decode_num_draft_tokens", "Tokens proposed by the draft model", lambda m: m.drafted),
            counter("spec_decode_num_accepted_tokens", "Drafted tokens the target accepted", lambda m: m.accepted),
            counter("spec_decode_num_drafts", "Verification steps that checked drafted tokens "
                    "(dormouse_speculative_rounds_total)", lambda m: m.draft_rounds),
            counter("n_decode", "llama_decode calls for prompts and generation (dormouse_decodes_total)",
                    lambda m: m.decodes),
            gauge("prompt_tokens_seconds", "Prompt tokens read per second since the last scrape", prompt_rate),
            gauge("predicted_tokens_seconds", "Tokens generated per second since the last scrape", predicted_rate),
            gauge("requests_processing", "Requests on a slot (busy slots)", {k: m.busy for k, m in models.items()}),
            gauge("requests_deferred", "Requests waiting for a slot or for a wake",
                  {k: m.deferred for k, m in models.items()}),
            gauge("n_busy_slots_per_decode", "Mean busy slots per llama_decode call",
                  {k: m.busy_slot_decodes / max(m.decodes, 1.0) for k, m in models.items()}),
        ]


def llamacpp_tokens_max(models: dict[str, Model]) -> bytes:
    """llamacpp:n_tokens_max as llama-server writes it: typed counter without the _total that
    prometheus_client's counters always add (dashboards query the bare name), so written here.
    Model ids hold no character a label value must escape (config/models.py MODEL_ID)."""
    lines = ["# HELP llamacpp:n_tokens_max The longest sequence a slot has held (dormouse_sequence_tokens_max)",
             "# TYPE llamacpp:n_tokens_max counter"]
    for model_id, m in models.items():
        labels = f'{{model="{model_id}"}}' if len(models) > 1 else ""
        lines.append(f"llamacpp:n_tokens_max{labels} {float(m.tokens_max)!r}")
    return ("\n".join(lines) + "\n").encode()


def vllm(models: dict[str, Model]) -> list[Any]:
    """vLLM v1's PrometheusStatLogger names, labels model_name and engine ("0")."""
    names = ["model_name", "engine"]

    def gauge(name: str, doc: str, value: Callable[[Model], float]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"vllm:{name}", doc, labels=names)
        for model_id, m in models.items():
            family.add_metric([model_id, "0"], value(m))
        return family

    def counter(name: str, doc: str, value: Callable[[Model], float]) -> CounterMetricFamily:
        family = CounterMetricFamily(f"vllm:{name}", doc, labels=names)
        for model_id, m in models.items():
            family.add_metric([model_id, "0"], value(m))
        return family

    def histogram(name: str, doc: str, source: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(f"vllm:{name}", doc, labels=names)
        for model_id, m in models.items():
            _add_histogram(family, [model_id, "0"], m.histogram(source))
        return family

    sleep = GaugeMetricFamily("vllm:engine_sleep_state", "1 for the sleep_state the model is in: awake (ready), "
                              "weights_offloaded (level 1: drowsy or light, the weights kept in memory), "
                              "discard_all (level 2: deep, nothing kept); on the way down or up, its tier's",
                              labels=names + ["sleep_state"])
    success = CounterMetricFamily("vllm:request_success", "Generations finished, by finished_reason",
                                  labels=names + ["finished_reason"])
    for model_id, m in models.items():
        for state in VLLM_SLEEP_STATES:
            sleep.add_metric([model_id, "0", state], 1.0 if m.sleep_state == state else 0.0)
        for reason in VLLM_FINISH_REASONS:
            success.add_metric([model_id, "0", reason], m.finished.get(reason, 0.0))
    return [
        gauge("num_requests_running", "Requests on a slot (busy slots)", lambda m: m.busy),
        gauge("num_requests_waiting", "Requests waiting for a slot or for a wake", lambda m: m.deferred),
        gauge("kv_cache_usage_perc", "Share of the KV cache held by busy slots (1: every slot busy)",
              lambda m: m.slot_usage),
        sleep,
        counter("prompt_tokens", "Prompt tokens of finished requests, cached ones included", lambda m: m.prompt),
        counter("prompt_tokens_cached", "Prompt tokens reused from the cache", lambda m: m.cached),
        counter("generation_tokens", "Tokens generated", lambda m: m.generated),
        counter("prefix_cache_queries", "Prompt tokens looked up in the cache", lambda m: m.prompt),
        counter("prefix_cache_hits", "Prompt tokens found in the cache", lambda m: m.cached),
        counter("spec_decode_num_draft_tokens", "Tokens proposed by the draft model", lambda m: m.drafted),
        counter("spec_decode_num_accepted_tokens", "Drafted tokens the target accepted", lambda m: m.accepted),
        success,
        histogram("time_to_first_token_seconds", "From accepted to first token, a wake included", "ttft"),
        histogram("inter_token_latency_seconds", "Mean time between tokens, one observation per request", "tpot"),
        histogram("request_time_per_output_token_seconds", "Mean time between tokens of each request", "tpot"),
        histogram("e2e_request_latency_seconds", "From accepted to answer complete", "e2e"),
        histogram("request_queue_time_seconds", "From accepted until the worker began the request, a wake included",
                  "queue"),
        histogram("request_prefill_time_seconds", "Reading the prompt", "prefill"),
        histogram("request_decode_time_seconds", "From the first token to the last", "decode"),
        histogram("request_inference_time_seconds", "Prefill and decode", "inference"),
        histogram("request_prompt_tokens", "Prompt tokens of each finished request", "prompt_tokens"),
        histogram("request_generation_tokens", "Tokens generated by each finished request", "generation_tokens"),
        histogram("request_max_num_generation_tokens", "Tokens generated by each finished request, per choice",
                  "max_generation_tokens"),
    ]


def otel(models: dict[str, Model]) -> list[Any]:
    """OpenTelemetry GenAI semantic conventions' server metrics, in Prometheus names."""
    who = ["gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model"]
    ttft = HistogramMetricFamily("gen_ai_server_time_to_first_token_seconds",
                                 "Time to generate the first token (from accepted, a wake included)", labels=who)
    tpot = HistogramMetricFamily("gen_ai_server_time_per_output_token_seconds",
                                 "Time per output token generated after the first, per request", labels=who)
    duration = HistogramMetricFamily("gen_ai_server_request_duration_seconds", "Generative AI server request duration",
                                     labels=["gen_ai_operation_name", *who, "error_type"])
    for model_id, m in models.items():
        own = [OTEL_PROVIDER, model_id, model_id]
        _add_histogram(ttft, own, m.histogram("ttft"))
        _add_histogram(tpot, own, m.histogram("tpot"))
        for (operation, outcome), h in sorted(m.e2e.items()):
            _add_histogram(duration, [operation, *own, "" if outcome == "ok" else "_OTHER"], h)
    return [ttft, tpot, duration]


class _Families:
    """What generate_latest renders: the families built for this scrape."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families
