"""Issue 9 where the bug lived in llama.cpp's use: the slot choice keeps two
conversations cached, a step's batch holds every slot, and every sampling
number is bounded before it reaches llama.cpp. Real model, real worker."""

import concurrent.futures

import httpx
import openai
import pytest

from tests.metrics_text import value

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bundled_model):
    from tests.conftest import DaemonProcess

    d = DaemonProcess("--model", bundled_model, "--threads", "2", "--parallel", "4", "--ctx-size", "4096",
                      "--sleep-idle-seconds", "-1", log_path=tmp_path_factory.mktemp("d") / "daemon.log")
    d.wait_state("ready")
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def worker_pid(daemon) -> int:
    return daemon.props()["last_wake"]["worker_pid"]


def test_two_interleaved_conversations_both_keep_their_cache(client):
    """A, then an unrelated B, then A again: A's prefix is still cached (item 2)."""
    a = "Alice asks about the rivers of France, their length, their sources and the cities on their banks. " * 3
    b = "Bob wants a recipe for bread with rye flour, water, salt and a sourdough starter kept warm. " * 3
    cached = {}
    for name, prompt in (("a1", a), ("b1", b), ("a2", a + " Which river is longest?"),
                         ("b2", b + " How long should it rise?")):
        r = client.completions.create(model="x", prompt=prompt, max_tokens=2, temperature=0)
        details = r.usage.prompt_tokens_details
        cached[name] = (details.cached_tokens if details else 0, r.usage.prompt_tokens)
    print("cached/prompt tokens:", cached)
    a1_prompt, b1_prompt = cached["a1"][1], cached["b1"][1]
    assert cached["a2"][0] >= a1_prompt - 1
    assert cached["b2"][0] >= b1_prompt - 1


def test_huge_penalty_window_is_bounded_to_the_slot_context(client, daemon):
    """repeat_last_n of 2**29 allocated 2 GiB in llama.cpp (item 4); -1 means the slot context."""
    pid = worker_pid(daemon)
    for window in (536870912, 2**31 - 1, -1):
        r = client.completions.create(model="x", prompt="Once upon a time", max_tokens=4, temperature=0,
                                      extra_body={"repeat_penalty": 1.1, "repeat_last_n": window})
        assert r.choices[0].finish_reason == "length"
    rss = value(daemon.http.get("/metrics").text, "dormouse_worker_rss_bytes")
    print(f"worker RSS after huge penalty windows: {rss / 2**20:.0f} MiB")
    assert rss < 1.5 * 2**30  # an unbounded window alone was 2 GiB
    assert worker_pid(daemon) == pid  # nothing was killed


def test_top_k_beyond_the_vocabulary_is_the_vocabulary(client):
    r = client.completions.create(model="x", prompt="Once upon a time", max_tokens=3, seed=1,
                                  extra_body={"top_k": 2**31 - 1})
    assert r.usage.completion_tokens == 3


def test_logit_bias_outside_the_vocabulary_is_400_naming_it(client, daemon):
    pid = worker_pid(daemon)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="x", prompt="Hi", max_tokens=2, logit_bias={"1000000000": 5})
    assert "vocabulary" in info.value.message
    # A valid bias still works, and nothing was restarted.
    r = client.completions.create(model="x", prompt="Hi", max_tokens=2, logit_bias={"100": -100})
    assert r.usage.completion_tokens == 2
    assert worker_pid(daemon) == pid


def test_eight_streams_on_a_batch_of_four(start_daemon):
    """--parallel 8 --batch-size 4: a generation step carries 8 tokens (item 3)."""
    d = start_daemon("--parallel", "8", "--batch-size", "4", "--ctx-size", "2048", "--sleep-idle-seconds", "-1")
    d.wait_state("ready")
    pid = worker_pid(d)

    def stream(i: int) -> tuple[int, str]:
        body = {"prompt": f"Story number {i}:", "max_tokens": 12, "stream": True, "temperature": 0}
        with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=120) as r:
            return r.status_code, r.read().decode()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, range(8)))
    assert [status for status, _ in results] == [200] * 8
    assert all(text.rstrip().endswith("data: [DONE]") for _, text in results)
    assert worker_pid(d) == pid
