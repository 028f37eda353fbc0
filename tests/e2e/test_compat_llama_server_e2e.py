"""llama-server's surface where the worker matters, on the bundled model:
logit_bias text keys tokenized as llama-server tokenizes them, post-sampling
probabilities read from the sampler chain, a draft model's counts in
timings, the server's sampling defaults, and the overflow error with the
worker's own counts. The HTTP side is in
tests/integration/test_compat_llama_server.py."""

from __future__ import annotations

import math
import random
import re

import pytest

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bundled_model):
    """The bundled model drafting for itself, two slots of 512 tokens, the server's defaults set."""
    from tests.conftest import DaemonProcess

    tmp = tmp_path_factory.mktemp("compat")
    d = DaemonProcess("--model", bundled_model, "--model-draft", bundled_model, "--threads", "2", "--ctx-size",
                      "1024", "--parallel", "2", "--sleep-idle-seconds", "-1", "--n-predict", "6", "--temp", "0",
                      "--draft-p-min", "0.5", log_path=tmp / "daemon.log")
    d.wait_state("ready", timeout=180)
    yield d
    d.stop()


def post(d, path: str, **body) -> dict:
    response = d.http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def tokens_of(d, text: str, add_special: bool = False) -> list[int]:
    return post(d, "/tokenize", content=text, add_special=add_special)["tokens"]


def test_text_keys_bias_the_tokens_of_their_text(daemon):
    london = tokens_of(daemon, " London")  # as llama-server tokenizes a key: no BOS, no special tokens
    by_text = post(daemon, "/completion", prompt=PROMPT, n_predict=3, return_tokens=True,
                   logit_bias={" London": 100})["tokens"]
    by_ids = post(daemon, "/completion", prompt=PROMPT, n_predict=3, return_tokens=True,
                  logit_bias=[[t, 100] for t in london])["tokens"]
    assert by_text == by_ids and by_text[0] in london  # +100 on its tokens: one of them comes first
    plain = post(daemon, "/completion", prompt=PROMPT, n_predict=3, return_tokens=True)["tokens"]
    assert plain != by_text
    # false bans: the greedy first token, banned by its text, is not chosen first.
    text = post(daemon, "/detokenize", tokens=[plain[0]])["content"]
    assert tokens_of(daemon, text) == [plain[0]], text
    banned = post(daemon, "/completion", prompt=PROMPT, n_predict=3, return_tokens=True,
                  logit_bias=[[text, False]])["tokens"]
    assert plain[0] not in banned


def test_post_sampling_probs_are_the_chains_distribution(daemon):
    sampled = dict(prompt=PROMPT, n_predict=4, n_probs=5, temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, seed=5)
    post_probs = post(daemon, "/completion", post_sampling_probs=True, **sampled)["completion_probabilities"]
    raw = post(daemon, "/completion", **sampled)["completion_probabilities"]
    assert len(post_probs) == len(raw) == 4
    for after, before in zip(post_probs, raw):
        assert after["id"] == before["id"]  # the same seed draws the same tokens
        kept = after["top_probs"]
        assert 1 <= len(kept) <= 3  # top_k 3: no other candidate survives the chain
        assert math.isclose(sum(k["prob"] for k in kept), 1.0, abs_tol=1e-4)
        assert [k["id"] for k in kept] == [t["id"] for t in before["top_logprobs"][:len(kept)]]
        mine = next(k["prob"] for k in kept if k["id"] == after["id"])
        assert math.isclose(after["prob"], mine, rel_tol=1e-6)
        # Renormalized over fewer candidates: each keeps at least its share of the whole vocabulary.
        assert after["prob"] >= math.exp(before["logprob"]) - 1e-6
    greedy = post(daemon, "/completion", prompt=PROMPT, n_predict=2, n_probs=3, post_sampling_probs=True,
                  temperature=0)["completion_probabilities"]
    assert all(e["prob"] == 1.0 and e["top_probs"] == [{"id": e["id"], "token": e["token"], "bytes": e["bytes"],
                                                        "prob": 1.0}] for e in greedy)


def test_penalties_count_the_prompts_last_repeat_last_n_tokens_as_llama_servers_do(daemon):
    # llama-server accepts every prompt token into its sampler, so the penalties see the prompt's last
    # repeat_last_n tokens before the first drawn one. At temperature 1 with no truncation, the chain's
    # distribution is the model's own shifted by the penalties: for each token, the log of its
    # post-sampling probability less its own log-probability is one constant less count * frequency
    # (+ presence when it occurs), the count taken over the prompt's last window. Random prompts, windows and
    # penalties, against the model's own log-probabilities of the same request.
    rng = random.Random(11)
    words = ["one", "two", "three", "red", "blue", "cat"]
    checked = 0
    for case in range(6):  # bounded by count
        prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(8, 40)))
        tokens = tokens_of(daemon, prompt, add_special=True)
        window = rng.choice([-1, 0, 1, 4, len(tokens) // 2, len(tokens) + 10])
        frequency, presence = round(rng.uniform(0.3, 2.0), 3), round(rng.uniform(-1.0, 1.0), 3)
        sampled = dict(prompt=prompt, n_predict=1, n_probs=20, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                       seed=case, repeat_last_n=window, cache_prompt=False)  # both read whole: the same logits
        after = post(daemon, "/completion", post_sampling_probs=True, frequency_penalty=frequency,
                     presence_penalty=presence, **sampled)["completion_probabilities"][0]["top_probs"]
        before = post(daemon, "/completion", **sampled)["completion_probabilities"][0]["top_logprobs"]
        seen = tokens[-window:] if window > 0 else tokens if window < 0 else []
        own = {t["id"]: t["logprob"] for t in before}
        shifts = {}
        for t in after:
            if t["id"] in own and t["prob"] > 0:
                count = seen.count(t["id"])
                shifts[t["id"]] = math.log(t["prob"]) - own[t["id"]] + count * frequency + (presence if count else 0.0)
        assert len(shifts) >= 2, (prompt, after, before)
        assert max(shifts.values()) - min(shifts.values()) < 1e-3, (prompt, window, frequency, presence, shifts)
        checked += any(seen.count(i) for i in shifts) and any(not seen.count(i) for i in shifts)
    assert checked >= 3  # cases where a penalized and an unpenalized token were compared


def test_top_p_zero_keeps_the_most_probable_token_only(daemon):
    # OpenAI's range for top_p is 0..1 and llama.cpp's top-p keeps at least one token: at 0, the most
    # probable one, so a sampled answer at any temperature and seed is the greedy one.
    for prompt, seed in ((PROMPT, 1), ("Once upon a time", 2)):
        greedy = post(daemon, "/completion", prompt=prompt, n_predict=6, temperature=0, cache_prompt=False,
                      return_tokens=True)["tokens"]
        sampled = post(daemon, "/completion", prompt=prompt, n_predict=6, temperature=1.5, top_k=0, top_p=0,
                       seed=seed, cache_prompt=False, return_tokens=True)["tokens"]
        assert sampled == greedy


def test_draft_counts_are_in_timings(daemon):
    for path, body in (("/completion", {"prompt": PROMPT, "n_predict": 16}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to ten."}],
                                                 "max_tokens": 16})):
        timings = post(daemon, path, **body)["timings"]
        assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"], (path, timings)
    assert all(s["speculative"] for s in daemon.http.get("/slots").json())


def test_server_defaults_apply_to_requests_that_leave_them_out(daemon):
    native = post(daemon, "/completion", prompt=PROMPT, ignore_eos=True)
    assert native["tokens_predicted"] == 6 and native["generation_settings"]["temperature"] == 0
    text = post(daemon, "/v1/completions", prompt=PROMPT, ignore_eos=True)
    assert text["usage"]["completion_tokens"] == 6
    greedy = post(daemon, "/v1/completions", prompt=PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]
    assert text["choices"][0]["text"] == greedy  # --temp 0: greedy unless asked otherwise
    props = daemon.http.get("/props").json()["default_generation_settings"]
    assert props["params"]["n_predict"] == 6 and props["n_ctx"] == 512
    assert re.fullmatch(r"b[0-9.]+-[0-9a-f]{8}", text["system_fingerprint"])


def test_overflow_on_completion_counts_the_prompt_as_llama_server(daemon):
    prompt = "hello there " * 300
    counted = len(tokens_of(daemon, prompt, add_special=True))
    assert counted > 512
    response = daemon.http.post("/completion", json={"prompt": prompt})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "exceed_context_size_error" and error["code"] == 400
    assert error["n_prompt_tokens"] == counted and error["n_ctx"] == 512
    listed = daemon.http.post("/completion", json={"prompt": [1] * 600}).json()["error"]
    assert (listed["n_prompt_tokens"], listed["n_ctx"]) == (600, 512)
    assert post(daemon, "/completion", prompt=PROMPT, n_predict=1)["stop"] is True


def test_verbose_shows_the_prompt_the_worker_rendered(daemon):
    """`"verbose": true` (llama-server's debug echo): the chat prompt as the model's template rendered it,
    read back from the worker, beside an answer to the same request."""
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    body = post(daemon, "/v1/chat/completions", messages=messages, max_tokens=2, verbose=True)
    prompt = body["__verbose"]["prompt"]
    assert prompt.index("Book") < prompt.index("What is the best book")
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["prompt_tokens"] > 5
    assert "__verbose" not in post(daemon, "/v1/chat/completions", messages=messages, max_tokens=2)


def test_ignore_eos_never_draws_an_end_of_generation_token_and_says_so(daemon):
    eog = daemon.http.get("/v1/models").json()["data"][0]["meta"]["eog_tokens"]
    assert eog  # Gemma 3: <eos>, <end_of_turn>
    pushed = [[t, 100] for t in eog]  # the end, made the likeliest token by far
    ended = post(daemon, "/completion", prompt=PROMPT, n_predict=4, return_tokens=True, logit_bias=pushed)
    assert ended["tokens"] == [] and ended["stop_type"] == "eos"
    kept = post(daemon, "/completion", prompt=PROMPT, n_predict=4, return_tokens=True, logit_bias=pushed,
                ignore_eos=True)
    assert len(kept["tokens"]) == 4 and not set(kept["tokens"]) & set(eog) and kept["stop_type"] == "limit"
    # llama-server's generation_settings: the end tokens at -inf, written null
    shown = {entry["token"]: entry["bias"] for entry in kept["generation_settings"]["logit_bias"]}
    assert shown == dict.fromkeys(eog, None)
    assert post(daemon, "/completion", prompt=PROMPT, n_predict=1)["generation_settings"]["logit_bias"] == []


def test_the_end_of_generation_tokens_are_llama_cpps_whole_set(bundled_model):
    """Listed from llama.cpp's candidates, without a walk of the vocabulary: the walk finds no other."""
    from daemon.worker.end_of_generation import end_of_generation_tokens
    from tests.e2e.test_infill_rerank import Vocab

    vocab = Vocab(bundled_model)
    try:
        lc, v = vocab.lc, vocab.vocab

        def single_tokens(texts):
            return [t[0] for t in (vocab.tokens(text, parse_special=True) for text in texts) if len(t) == 1]

        walked = [t for t in range(lc.llama_vocab_n_tokens(v)) if lc.llama_vocab_is_eog(v, t)]
        assert end_of_generation_tokens(v, single_tokens) == walked and len(walked) >= 2
    finally:
        vocab.close()


def test_ignore_eos_leaves_a_grammars_end_to_the_grammar(daemon):
    """A grammar says when the answer is whole; ignore_eos then banning the end would end it in an error."""
    body = {"prompt": PROMPT, "n_predict": 10, "grammar": 'root ::= "a" "a" "a"'}
    plain, kept = post(daemon, "/completion", **body), post(daemon, "/completion", **body, ignore_eos=True)
    assert kept["content"] == plain["content"] == "aaa" and kept["stop_type"] == plain["stop_type"]
    assert kept["generation_settings"]["logit_bias"] == []  # nothing banned: the grammar decides
