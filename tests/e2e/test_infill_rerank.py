"""Fill-in-the-middle and rerank (issue 17, sections 4 and 5) on real worker
processes and the tiny fixture models.

/infill and `suffix` on /v1/completions: the prompt the worker builds is
llama-server's FIM layout (format_prompt_infill), checked token by token: the
test builds the expected prompt itself from the model's vocabulary (read here
by llama.cpp's own API, llama-cpp-python's bindings), then /completion is
given those token ids and must answer with the same greedy tokens and the
same log-probabilities, and read as many tokens, as /infill. Requests are the
ones llama.vim and llama.vscode send. The bundled Gemma (no FIM tokens) is
refused with a 400 that says so.

/v1/rerank (and /rerank, /reranking, /v1/reranking) on the tiny BERT
cross-encoder: every score equals the one llama.cpp computes in this process
on the same (query, document) pair, laid out as llama-server lays it out
(BOS query EOS SEP document EOS, or the model's rerank template), to 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess

pytestmark = pytest.mark.e2e

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"},
         {"text": "the dormouse sleeps at the tea party\n"}]  # no filename: llama-server's "tmp"
GREEDY = {"temperature": 0, "cache_prompt": False, "return_tokens": True, "n_probs": 2}
BATCH = 128  # the FIM window: the prefix keeps its last 96 tokens, the suffix its first 30 (less the typed prompt)
SLOT_CTX = 1024  # --ctx-size 2048, --parallel 2


# -- llama.cpp, in this process: the reference --------------------------------------------------


def _lc():
    # The ctypes bindings as the worker imports them: once daemon.worker.llama_lib is imported (another
    # test may have), `llama_cpp` is a package without its __init__ (nor its logger), and its names live
    # in llama_cpp.llama_cpp. llama.cpp's load log goes to stderr, which pytest captures.
    from daemon.worker.llama_lib import llama as lc

    lc.llama_backend_init()
    return lc


class Vocab:
    """A model's vocabulary (vocab_only), tokenized as llama-server tokenizes."""

    def __init__(self, path: str | Path, vocab_only: bool = True) -> None:
        lc = self.lc = _lc()
        params = lc.llama_model_default_params()
        params.vocab_only = vocab_only
        params.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp cannot load {path}"
        self.vocab = lc.llama_model_get_vocab(self.model)

    def tokens(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        data = text.encode()
        buf = (self.lc.llama_token * (len(data) + 8))()
        n = self.lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_special, parse_special)
        assert n >= 0
        return list(buf[:n])

    def fim(self, name: str) -> int:
        return getattr(self.lc, f"llama_vocab_fim_{name}")(self.vocab)

    def close(self) -> None:
        self.lc.llama_model_free(self.model)


class Reranker(Vocab):
    """A rank-pooled context with llama.cpp's defaults (flash attention auto, as llama-server), scoring pairs."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, vocab_only=False)
        lc = self.lc
        params = lc.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = 512
        params.embeddings = True
        params.pooling_type = lc.LLAMA_POOLING_TYPE_RANK
        params.n_threads = params.n_threads_batch = 2
        self.ctx = lc.llama_init_from_model(self.model, params)
        assert self.ctx
        template = lc.llama_model_chat_template(self.model, b"rerank")
        self.template = template.decode() if template else None

    def pair(self, query: str, document: str) -> list[int]:
        """llama-server's format_prompt_rerank: the model's rerank template, else the plain layout."""
        if self.template is not None:
            return self.tokens(self.template.replace("{query}", query).replace("{document}", document),
                               parse_special=True)
        return self.plain_pair(query, document)

    def plain_pair(self, query: str, document: str) -> list[int]:
        """BOS query EOS SEP document EOS, each where the vocabulary adds it (EOS falling back to SEP)."""
        lc, vocab = self.lc, self.vocab
        eos = lc.llama_vocab_eos(vocab)
        if eos < 0:
            eos = lc.llama_vocab_sep(vocab)
        tokens = [lc.llama_vocab_bos(vocab)] if lc.llama_vocab_get_add_bos(vocab) else []
        tokens += self.tokens(query)
        if lc.llama_vocab_get_add_eos(vocab):
            tokens.append(eos)
        if lc.llama_vocab_get_add_sep(vocab):
            tokens.append(lc.llama_vocab_sep(vocab))
        tokens += self.tokens(document)
        if lc.llama_vocab_get_add_eos(vocab):
            tokens.append(eos)
        return tokens

    def score(self, tokens: list[int]) -> float:
        lc = self.lc
        batch = lc.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(tokens)
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
            assert lc.llama_decode(self.ctx, batch) == 0
            assert lc.llama_model_n_cls_out(self.model) == 1
            return float(lc.llama_get_embeddings_seq(self.ctx, 0)[0])
        finally:
            lc.llama_batch_free(batch)

    def close(self) -> None:
        self.lc.llama_free(self.ctx)
        super().close()


# -- daemons ------------------------------------------------------------------------------------


def start(tmp: Path, model: str | Path, *args: str) -> DaemonProcess:
    d = DaemonProcess("--model", str(model), "--threads", "2", "--sleep-idle-seconds", "-1", *args,
                      log_path=tmp / f"{Path(model).stem}.log")
    try:
        d.wait_state("ready", timeout=180)
    except BaseException:
        d.stop()
        raise
    return d


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> Path:
    from tests.fixtures.fim_model import write_fim_model

    return write_fim_model(tmp_path_factory.mktemp("fim") / "tiny-fim.gguf")


@pytest.fixture(scope="module")
def fim(tmp_path_factory, fim_model):
    d = start(tmp_path_factory.mktemp("fimd"), fim_model, "--ctx-size", str(2 * SLOT_CTX), "--parallel", "2",
              "--batch-size", str(BATCH))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def vocab(fim_model):
    v = Vocab(fim_model)
    yield v
    v.close()


@pytest.fixture(scope="module")
def rerank_model(tmp_path_factory) -> Path:
    from tests.fixtures.rerank_model import write_rerank_model

    return write_rerank_model(tmp_path_factory.mktemp("rr") / "tiny-reranker.gguf")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, rerank_model):
    d = start(tmp_path_factory.mktemp("rrd"), rerank_model, "--embeddings", "--pooling", "rank",
              "--ctx-size", "1024", "--parallel", "2")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def reference(rerank_model):
    r = Reranker(rerank_model)
    yield r
    r.close()


# -- helpers ------------------------------------------------------------------------------------


def post(d: DaemonProcess, path: str, body: dict, status: int = 200) -> dict | list:
    r = d.http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def fim_layout(v: Vocab, prefix: list[int], suffix: list[int], typed: list[int] = (),
               extra: list[int] = ()) -> list[int]:
    """llama-server's format_prompt_infill, for a vocabulary that adds BOS."""
    return [*extra, v.lc.llama_vocab_bos(v.vocab), v.fim("pre"), *prefix, *typed, v.fim("suf"), *suffix, v.fim("mid")]


def repo_extra(v: Vocab, chunks: list[dict]) -> list[int]:
    """The repository-level extra context (arXiv 2409.12186), as llama-server writes it."""
    tokens = [v.fim("rep"), *v.tokens("myproject\n")]
    for chunk in chunks:
        tokens += [v.fim("sep"), *v.tokens(chunk.get("filename", "tmp") + "\n"), *v.tokens(chunk["text"])]
    return tokens + [v.fim("sep"), *v.tokens("filename\n")]


def same_answer(infill: dict, completion: dict) -> None:
    """Greedy tokens, text and log-probabilities equal: the two read the same prompt."""
    assert infill["tokens"] and infill["tokens"] == completion["tokens"]
    assert infill["content"] == completion["content"]
    assert infill["tokens_evaluated"] == completion["tokens_evaluated"]
    for a, b in zip(infill["completion_probabilities"], completion["completion_probabilities"], strict=True):
        assert a["id"] == b["id"] and [t["id"] for t in a["top_logprobs"]] == [t["id"] for t in b["top_logprobs"]]
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def check_layout(d: DaemonProcess, body: dict, expected: list[int]) -> dict:
    answer = post(d, "/infill", {**GREEDY, **body})
    assert answer["tokens_evaluated"] == len(expected)
    same_answer(answer, post(d, "/completion", {**GREEDY, "prompt": expected, "n_predict": body["n_predict"]}))
    return answer


def events(d: DaemonProcess, path: str, body: dict) -> list[dict]:
    with d.http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


# -- fill in the middle -------------------------------------------------------------------------


def test_infill_reads_prefix_typed_prompt_and_suffix_in_fim_order(fim, vocab):
    typed = "return a"
    expected = fim_layout(vocab, vocab.tokens(PREFIX), vocab.tokens(SUFFIX), vocab.tokens(typed, parse_special=True))
    answer = check_layout(fim, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": typed, "n_predict": 8},
                          expected)
    assert answer["tokens_predicted"] == len(answer["tokens"]) <= 8
    # Without the typed prompt, and an empty suffix: still FIM_PRE .. FIM_SUF FIM_MID.
    check_layout(fim, {"input_prefix": PREFIX, "input_suffix": "", "n_predict": 4},
                 fim_layout(vocab, vocab.tokens(PREFIX), []))
    # A FIM marker typed in the code is text, not the control token (llama-server tokenizes without specials).
    code = 'marker = "<|fim_middle|>"\n'
    assert vocab.fim("mid") not in vocab.tokens(code) and vocab.fim("mid") in vocab.tokens(code, parse_special=True)
    check_layout(fim, {"input_prefix": code, "input_suffix": SUFFIX, "n_predict": 4},
                 fim_layout(vocab, vocab.tokens(code), vocab.tokens(SUFFIX)))


def test_extra_files_come_first_with_the_repository_and_file_separators(fim, vocab):
    assert min(vocab.fim(n) for n in ("pre", "suf", "mid", "rep", "sep")) >= 0  # the fixture has them all
    expected = fim_layout(vocab, vocab.tokens(PREFIX), vocab.tokens(SUFFIX), extra=repo_extra(vocab, EXTRA))
    check_layout(fim, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "n_predict": 8},
                 expected)


def test_long_inputs_are_cut_as_llama_server_cuts_them(fim, vocab):
    """The prefix keeps its last 3/4 of a batch, the suffix its first 1/4 less 2 and the typed prompt; the extra
    context keeps its last tokens within the slot's context less a batch and twice n_predict."""
    prefix = "".join(f"x{i} = add(x{i - 1}, {i})\n" for i in range(1, 40))
    suffix = "".join(f"print(x{i})\n" for i in range(40))
    chunks = [{"filename": f"f{i}.py", "text": f"def f{i}(tea):\n    return tea * {i}\n"} for i in range(12)]
    typed = "y ="
    p, s, t, e = vocab.tokens(prefix), vocab.tokens(suffix), vocab.tokens(typed, parse_special=True), \
        repo_extra(vocab, chunks)
    n_predict = 400
    budget = SLOT_CTX - BATCH - 2 * n_predict
    assert len(p) > 3 * BATCH // 4 and len(s) > BATCH // 4 and len(e) > budget  # each one is cut
    expected = fim_layout(vocab, p[-(3 * BATCH // 4):], s[:BATCH // 4 - 2 - len(t)], t, e[-budget:])
    check_layout(fim, {"input_prefix": prefix, "input_suffix": suffix, "prompt": typed, "input_extra": chunks,
                       "n_predict": n_predict}, expected)


def test_infill_streamed_says_what_infill_whole_says(fim):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "ret", "n_predict": 10,
            "temperature": 0, "return_tokens": True}
    whole = post(fim, "/infill", body)
    chunks = events(fim, "/infill", {**body, "stream": True})
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"] and whole["tokens"]
    last = chunks[-1]
    assert last["tokens_evaluated"] == whole["tokens_evaluated"]
    assert last["tokens_predicted"] == whole["tokens_predicted"]


def test_editor_plugins_requests_are_answered(fim):
    # llama.vim (autoload/llama.vim, llama#fim): its chunks carry `time` (reltime(): a list), it picks response_fields.
    vim = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "re", "n_predict": 6, "n_indent": 4, "top_k": 40,
           "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
           "t_max_prompt_ms": 500, "t_max_predict_ms": 1500,
           "input_extra": [{"text": c["text"], "time": [1733400000, 52311], "filename": c.get("filename", "a.py")}
                           for c in EXTRA],
           "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                               "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                               "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                               "tokens_cached"]}
    answer = post(fim, "/infill", vim)
    assert set(answer) == set(vim["response_fields"])  # each one it asked for, under its own name, and no more
    assert isinstance(answer["content"], str) and 1 <= answer["timings/predicted_n"] <= 6
    assert answer["timings/prompt_n"] > 0 and answer["truncated"] is False
    # llama.vscode (src/llama-server.ts, createRequestPayload): no response_fields, the whole answer.
    vscode = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "", "n_predict": 6,
              "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
              "cache_prompt": True, "n_indent": 4, "t_max_prompt_ms": 500, "t_max_predict_ms": 3000}
    answer = post(fim, "/infill", vscode)
    assert answer["stop"] is True and answer["model"] == "tiny-fim" and answer["tokens_evaluated"] > 0
    assert 1 <= answer["tokens_predicted"] <= 6 and answer["generation_settings"]["n_predict"] == 6
    # A LoRA adapter (llama.vscode's lora_completion) is not something Dormouse loads: refused by name.
    error = post(fim, "/infill", {**vscode, "lora": [{"id": 0, "scale": 0.5}]}, 400)["error"]
    assert error["param"] == "lora" and "lora" in error["message"]
    assert post(fim, "/infill", {**vscode, "lora": []})["stop"] is True  # no adapter asked for
    # Both warm the cache with n_predict 0 (llama.vim's ring update, llama.vscode's updateExtraContext):
    # the files are read into a slot's cache and nothing is predicted.
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": EXTRA, "prompt": "", "n_predict": 0,
            "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""]}
    assert post(fim, "/infill", warm) == {}  # response_fields [""] picks nothing
    read = post(fim, "/infill", {**warm, "input_extra": EXTRA[::-1], "response_fields": []})
    assert read["content"] == "" and read["tokens_predicted"] == 0 and read["stop_type"] == "limit"
    assert read["tokens_evaluated"] > 0
    # What they warm it for: the next completion over the same files reads only what follows them
    # (the files, then the FIM prefix token; the typed prefix and the rest differ).
    typed = post(fim, "/infill", {**warm, "input_extra": EXTRA[::-1], "input_prefix": PREFIX, "input_suffix": SUFFIX,
                                  "n_predict": 2, "response_fields": []})
    assert typed["tokens_cached"] >= read["tokens_evaluated"] - 3, (typed["tokens_cached"], read["tokens_evaluated"])


def test_completions_suffix_answers_as_infill(fim):
    infill = post(fim, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, **GREEDY})
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}
    completion = post(fim, "/v1/completions", {**body, "logprobs": 1})
    assert completion["choices"][0]["text"] == infill["content"]
    chosen = completion["choices"][0]["logprobs"]["token_logprobs"]
    assert chosen == pytest.approx([e["logprob"] for e in infill["completion_probabilities"]], abs=1e-4)
    assert completion["usage"]["prompt_tokens"] == infill["tokens_evaluated"]
    assert completion["usage"]["completion_tokens"] == infill["tokens_predicted"]
    streamed = events(fim, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in streamed if c.get("choices")) == infill["content"]
    # Token ids are not a text before the gap.
    error = post(fim, "/v1/completions", {**body, "prompt": [1, 2, 3]}, 400)["error"]
    assert error["param"] == "suffix"


def test_fim_tokens_found_by_their_texts_without_repository_tokens(tmp_path):
    """No tokenizer.ggml.fim_* keys: llama.cpp finds <|fim_prefix|> ... by text; without FIM_REP and FIM_SEP the
    extra chunks are each preceded by llama-server's snippet separator."""
    from tests.fixtures.fim_model import write_fim_model

    path = write_fim_model(tmp_path / "tiny-fim-texts.gguf", by_keys=False, repo_level=False)
    v = Vocab(path)
    try:
        assert min(v.fim(n) for n in ("pre", "suf", "mid")) >= 0 and v.fim("rep") < 0 and v.fim("sep") < 0
        separator = v.tokens("\n\n--- snippet ---\n\n")
        extra = [t for c in EXTRA for t in (*separator, *v.tokens(c["text"]))]
        expected = fim_layout(v, v.tokens(PREFIX), v.tokens(SUFFIX), extra=extra)
    finally:
        v.close()
    d = start(tmp_path, path, "--ctx-size", "1024", "--parallel", "1")
    try:
        check_layout(d, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "n_predict": 6},
                     expected)
    finally:
        d.stop()


# -- rerank -------------------------------------------------------------------------------------

QUERY = "the dormouse at the tea party"
DOCS = ["a cat sat", "tea with the hatter", "the dormouse sleeps at the tea party", "the queen and the hare",
        "tea, tea, tea!"]
RERANK_PATHS = ["/v1/rerank", "/rerank", "/reranking", "/v1/reranking"]


def reference_scores(ref: Reranker, query: str, documents: list[str]) -> tuple[list[float], int]:
    pairs = [ref.pair(query, doc) for doc in documents]
    return [ref.score(tokens) for tokens in pairs], sum(map(len, pairs))


def test_rerank_scores_are_llama_cpps(reranker, reference):
    scores, n_tokens = reference_scores(reference, QUERY, DOCS)
    assert len(set(round(s, 3) for s in scores)) == len(DOCS)  # distinct: the order below means something
    answer = post(reranker, "/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": DOCS})
    assert answer["object"] == "list" and answer["model"] == "tiny-reranker"
    results = answer["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    for r in results:
        assert r["relevance_score"] == pytest.approx(scores[r["index"]], abs=1e-4)
        assert "document" not in r
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -scores[i])
    assert answer["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    # A document alone in a request scores as it does among others (each pair is its own sequence).
    alone = post(reranker, "/v1/rerank", {"query": QUERY, "documents": [DOCS[3]]})["results"]
    assert alone[0]["index"] == 0 and alone[0]["relevance_score"] == pytest.approx(scores[3], abs=1e-4)
    # Empty texts, special-token text (stays text: [SEP] typed in a document is no separator), upper case, Unicode.
    for query, documents in (("", ["tea"]), ("tea", [""]), ("the [SEP] queen", ["a [CLS] cat", "Ünïcödé 漢字 ☕"]),
                             ("TEA Party", ["the HATTER"])):
        scores, n_tokens = reference_scores(reference, query, documents)
        answer = post(reranker, "/v1/rerank", {"query": query, "documents": documents})
        assert {r["index"]: r["relevance_score"] for r in answer["results"]} == \
            pytest.approx(dict(enumerate(scores)), abs=1e-4)
        assert answer["usage"]["prompt_tokens"] == n_tokens


def test_rerank_top_n_and_return_documents(reranker, reference):
    scores, _ = reference_scores(reference, QUERY, DOCS)
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    documents = [d if i % 2 else {"text": d} for i, d in enumerate(DOCS)]  # strings and Jina's objects, mixed
    answer = post(reranker, "/v1/rerank", {"query": QUERY, "documents": documents, "top_n": 2,
                                           "return_documents": True})
    assert [(r["index"], r["document"]) for r in answer["results"]] == [(i, {"text": DOCS[i]}) for i in best[:2]]
    assert answer["results"][0]["relevance_score"] >= answer["results"][1]["relevance_score"]
    assert len(post(reranker, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 99})["results"]) == len(DOCS)
    # TEI's request (texts) gets TEI's answer: a bare list of {index, score, text}.
    tei = post(reranker, "/rerank", {"query": QUERY, "texts": DOCS, "return_text": True, "top_n": 3})
    assert [(r["index"], r["text"]) for r in tei] == [(i, DOCS[i]) for i in best[:3]]
    assert [r["score"] for r in tei] == pytest.approx([scores[i] for i in best[:3]], abs=1e-4)
    error = post(reranker, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, 400)["error"]
    assert error["param"] == "top_n"


def test_rerank_aliases_answer_the_same(reranker):
    body = {"query": QUERY, "documents": DOCS, "top_n": 3, "return_documents": True}
    answers = [post(reranker, path, body) for path in RERANK_PATHS]
    assert all({k: v for k, v in a.items() if k != "id"} == {k: v for k, v in answers[0].items() if k != "id"}
               for a in answers)
    assert len(answers[0]["results"]) == 3


def test_a_reranker_only_reranks(reranker):
    assert post(reranker, "/v1/embeddings", {"input": QUERY}, 400)["error"]["message"].find("reranker") >= 0
    assert post(reranker, "/v1/completions", {"prompt": QUERY, "max_tokens": 2}, 400)["error"]["code"] == \
        "model_not_generative"
    assert post(reranker, "/infill", {"input_prefix": "a", "input_suffix": "b"}, 400)["error"]["code"] == \
        "model_not_generative"
    # A pair longer than one decode is refused by name, and the reranker keeps answering.
    error = post(reranker, "/v1/rerank", {"query": QUERY, "documents": ["tea " * 600]}, 400)["error"]
    assert error["code"] == "context_length_exceeded"
    assert len(post(reranker, "/v1/rerank", {"query": QUERY, "documents": DOCS[:2]})["results"]) == 2


def test_a_rerank_template_lays_out_the_pair(tmp_path):
    """A GGUF with tokenizer.chat_template.rerank: llama-server fills in {query} and {document} and reads the
    text with its special tokens parsed, instead of BOS query EOS SEP document EOS."""
    from tests.fixtures.rerank_model import write_rerank_model

    path = write_rerank_model(tmp_path / "tiny-reranker-template.gguf", seed=3,
                              template="[CLS] query: {query} [SEP] document: {document} [SEP]")
    ref = Reranker(path)
    try:
        assert ref.template is not None
        scores, n_tokens = reference_scores(ref, QUERY, DOCS)
        # The plain layout scores otherwise: what is compared below is the template's layout.
        assert [ref.score(ref.plain_pair(QUERY, doc)) for doc in DOCS] != pytest.approx(scores, abs=1e-4)
    finally:
        ref.close()
    d = start(tmp_path, path, "--embeddings", "--pooling", "rank", "--ctx-size", "512", "--parallel", "1")
    try:
        answer = post(d, "/v1/rerank", {"query": QUERY, "documents": DOCS})
        assert {r["index"]: r["relevance_score"] for r in answer["results"]} == \
            pytest.approx(dict(enumerate(scores)), abs=1e-4)
        assert answer["usage"]["prompt_tokens"] == n_tokens
    finally:
        d.stop()


def test_a_model_without_a_classifier_head_is_no_reranker(tmp_path):
    from tests.fixtures.rerank_model import write_rerank_model

    path = write_rerank_model(tmp_path / "tiny-headless.gguf", with_head=False)
    d = start(tmp_path, path, "--embeddings", "--pooling", "rank", "--ctx-size", "512", "--parallel", "1")
    try:
        error = post(d, "/v1/rerank", {"query": QUERY, "documents": DOCS}, 400)["error"]
        assert "classifier head" in error["message"]
    finally:
        d.stop()


# -- the bundled chat model: no FIM tokens, no reranker --------------------------------------------


def test_the_bundled_chat_model_refuses_infill_and_rerank_clearly(start_daemon, bundled_model):
    v = Vocab(bundled_model)
    try:
        assert v.fim("pre") < 0 and v.fim("suf") < 0 and v.fim("mid") < 0  # the premise: Gemma 3 has none
    finally:
        v.close()
    d = start_daemon("--parallel", "1", "--ctx-size", "1024", "--sleep-idle-seconds", "-1")
    d.wait_state("ready", timeout=180)
    for path, body in (("/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4}),
                       ("/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4})):
        error = post(d, path, body, 400)["error"]
        assert "fill-in-the-middle" in error["message"] and "FIM" in error["message"], error
    streamed = d.http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": "", "stream": True})
    assert streamed.status_code == 400 and "fill-in-the-middle" in streamed.json()["error"]["message"]
    for path in RERANK_PATHS:
        error = post(d, path, {"query": QUERY, "documents": DOCS}, 400)["error"]
        assert error["code"] == "reranking_not_enabled" and "not a reranker" in error["message"], error
    # Still a chat model that answers.
    answer = post(d, "/v1/completions", {"prompt": PREFIX, "max_tokens": 2, "temperature": 0})
    assert answer["usage"]["completion_tokens"] >= 1
