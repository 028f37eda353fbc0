"""Pooled outputs from a context made with embeddings on (ModelSpec.embeddings;
runtime.py sets the pooling type): normalized embeddings, and a reranker's
scores (pooling = "rank": llama.cpp runs the model's classifier head on the
pooled vector and returns its n_cls_out outputs; the first is the score).

Each input is decoded as one sequence in one llama_decode (a pooled sequence
must sit in one micro-batch), on the sequence id of slot 0, which an
embeddings model never uses for anything else; its cache is cleared before
and after, so inputs never see each other.
"""

from __future__ import annotations

import ctypes
import math
from functools import lru_cache

from daemon.worker.errors import RequestError
from daemon.worker.fim import head_tokens, text_tokens
from daemon.worker.llama_lib import fill_sequence, llama

RERANK_TEMPLATE_KEY = "tokenizer.chat_template.rerank"  # what llama_model_chat_template(model, "rerank") reads


def pooled(ctx: ctypes.c_void_p, batch, limit: int, n_out: int, tokens: list[int]) -> list[float]:
    """The `n_out` pooled floats of one tokenized input of at most `limit`
    tokens (the batch size, and the context of one sequence)."""
    return _decoded(ctx, batch, limit, tokens, lambda: _floats(llama.llama_get_embeddings_seq(ctx, 0), n_out))


def per_token(ctx: ctypes.c_void_p, batch, limit: int, n_embd: int, tokens: list[int]) -> list[list[float]]:
    """Each token's vector of one tokenized input, as the model computed it (pooling none: nothing pooled,
    nothing normalized, as llama-server answers it)."""
    return _decoded(ctx, batch, limit, tokens,
                    lambda: [_floats(llama.llama_get_embeddings_ith(ctx, i), n_embd) for i in range(len(tokens))])


def _floats(pointer, n: int) -> list[float]:
    if not pointer:
        raise RequestError("the context returned no embedding", "decode_failed")
    return [float(pointer[i]) for i in range(n)]


def _decoded(ctx: ctypes.c_void_p, batch, limit: int, tokens: list[int], read):
    """read() after one decode of the input on sequence 0 (its cache cleared before and after)."""
    if not tokens:
        raise RequestError("it is empty")
    if len(tokens) > limit:
        raise RequestError(f"it has {len(tokens)} tokens; an embeddings model reads at most {limit} per input "
                           "(its batch_size, within ctx_size / parallel)", "context_length_exceeded")
    memory = llama.llama_get_memory(ctx)
    llama.llama_memory_seq_rm(memory, 0, -1, -1)
    fill_sequence(batch, tokens, 0, 0, logits_from=0)
    try:
        rc = llama.llama_decode(ctx, batch)
        if rc != 0:
            raise RequestError(f"llama_decode failed ({rc}) on an embeddings input", "decode_failed")
        return read()
    finally:
        llama.llama_memory_seq_rm(memory, 0, -1, -1)


def input_tokens(engine, text: str, limit: int, truncate: bool) -> list[int]:
    """One text input's tokens, the vocabulary's specials added. Longer than
    `limit`: refused (by pooled()), or, with truncate (Ollama's), cut at its end:
    the text's first tokens between the specials a whole input has (BOS or CLS
    before, EOS or SEP after), so the model reads it as it reads any input.
    Either way the tokenizing work is bounded by the limit, not the text."""
    try:
        tokens = engine.prompt_tokens_within(text, limit, what="it")
        if len(tokens) <= limit or not truncate:
            return tokens
    except RequestError as exc:
        if not truncate or exc.code != "context_length_exceeded":
            raise
    # Which specials wrap a text, and on which side: a one-letter text tokenized with and without them.
    wrapped, plain = engine.tokenize("a", True), engine.tokenize("a", False)
    head = next((i for i in range(len(wrapped) - len(plain) + 1) if wrapped[i:i + len(plain)] == plain), None)
    if head is None:  # a vocabulary whose specials change the text's own tokens: the first tokens, as they come
        return head_tokens(lambda t: engine.tokenize(t, True), text, limit)
    tail = len(wrapped) - head - len(plain)
    if limit - head - tail < 1:
        raise RequestError(f"an input of {limit} tokens holds nothing between its {head + tail} special tokens",
                           "context_length_exceeded")
    body = head_tokens(lambda t: engine.tokenize(t, False), text, limit - head - tail)
    return wrapped[:head] + body + wrapped[len(wrapped) - tail:]


def embed(ctx: ctypes.c_void_p, batch, limit: int, n_embd: int, tokens: list[int]) -> list[float]:
    """The L2-normalized pooled embedding of one tokenized input."""
    vector = pooled(ctx, batch, limit, n_embd, tokens)
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


# -- rerank ------------------------------------------------------------------------


@lru_cache(maxsize=4)
def has_classifier_head(path: str) -> bool:
    """Whether the GGUF holds a classifier head (cls.weight for BERT-style
    rerankers, cls.output.weight for others): without one, rank pooling
    returns the first number of the hidden state, which ranks nothing."""
    from daemon.model.gguf_header import GgufError, read_header

    try:
        return any(t.name.startswith("cls.") for t in read_header(path).tensors)
    except (GgufError, OSError):  # llama.cpp loaded it, this reader could not: the configuration is trusted
        return True


def check_reranker(model: ctypes.c_void_p, vocab, path: str, template: str | None) -> None:
    """llama.cpp's own conditions for reranking (common_init_from_params), and a head to rank with."""
    if not has_classifier_head(path):
        raise RequestError("this model has no classifier head (no cls.* tensors in its GGUF): it is not a "
                           "reranker, whatever its pooling; name a reranker model")
    if template is None:
        if llama.llama_vocab_bos(vocab) < 0:
            raise RequestError("this reranker's vocabulary has no BOS token and its GGUF no rerank template "
                               f"({RERANK_TEMPLATE_KEY}): its prompt cannot be built")
        if llama.llama_vocab_eos(vocab) < 0 and llama.llama_vocab_sep(vocab) < 0:
            raise RequestError("this reranker's vocabulary has neither an EOS nor a SEP token, and its GGUF no "
                               f"rerank template ({RERANK_TEMPLATE_KEY}): its prompt cannot be built")


def rerank_tokens(vocab, query: str, document: str, limit: int, template: str | None,
                  tokens_within) -> list[int]:
    """One (query, document) pair as llama-server's format_prompt_rerank puts
    it: the model's rerank template with {query} and {document} replaced
    (special tokens parsed, as there), or BOS query EOS SEP document EOS where
    the vocabulary adds each (EOS falling back to SEP); the texts' own special
    tokens are not parsed. Refused past `limit` tokens, the work bounded by it.
    tokens_within(text, limit): the text's tokens, specials parsed, refused past limit."""
    if template is not None:
        return tokens_within(template.replace("{query}", query).replace("{document}", document), limit)

    def tokenize(text: str) -> list[int]:
        return text_tokens(vocab, text)

    eos = llama.llama_vocab_eos(vocab)
    if eos < 0:
        eos = llama.llama_vocab_sep(vocab)
    add_eos = bool(llama.llama_vocab_get_add_eos(vocab))
    tokens = [llama.llama_vocab_bos(vocab)] if llama.llama_vocab_get_add_bos(vocab) else []
    tokens += head_tokens(tokenize, query, limit + 1)
    if add_eos:
        tokens.append(eos)
    if llama.llama_vocab_get_add_sep(vocab):
        tokens.append(llama.llama_vocab_sep(vocab))
    if len(tokens) <= limit:  # past it the pair is refused anyway: the document is not read
        tokens += head_tokens(tokenize, document, limit + 1 - len(tokens))
        if add_eos:
            tokens.append(eos)
    if len(tokens) > limit:
        raise RequestError(f"the query and this document have more than {limit} tokens together; a reranker "
                           "reads a pair in one decode of at most batch_size tokens (within ctx_size / parallel)",
                           "context_length_exceeded")
    return tokens
