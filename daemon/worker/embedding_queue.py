"""An embeddings model's work: each request's inputs embedded one per engine step (or, for a
reranker, each document scored with the query), answered after its last input.

A mixin of Engine (daemon/worker/engine.py), kept apart as prompt_text.py and slot_assignment.py
are: an embeddings model generates nothing, so none of this touches a slot's generation. It uses the
engine's context, batch, vocabulary, runtime and emit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon import protocol as p
from daemon.worker.errors import RequestError
from daemon.worker.llama_lib import llama


@dataclass
class EmbeddingWork:
    """An embeddings request in progress: one vector per input, in order."""

    msg: p.Query
    vectors: list = field(default_factory=list)  # a vector per input (pooling none: a vector per token of each)
    read: int = 0  # tokens


# pooling none: the most numbers one embeddings answer carries (every token's vector of every input), so
# that it stays well inside a worker message (protocol.MAX_MESSAGE_BYTES: 9 bytes a number, ~36 MB here).
MAX_TOKEN_VECTOR_FLOATS = 4_000_000


class EmbeddingQueue:
    """Mixed into Engine."""

    def _queue_embeddings(self, msg: p.Query) -> None:
        if not self.embeddings_only:
            self.emit(p.Answer(msg.request_id, error="this model was not loaded for embeddings: set embeddings = true "
                               "in its settings (or start with --embeddings)", error_code="embeddings_not_enabled"))
            return
        try:
            self._check_pooling(msg)
            if self.rt.spec.pooling == "none" and msg.kind == "embed":
                self._check_token_vectors(msg)
        except RequestError as exc:
            self.emit(p.Answer(msg.request_id, error=str(exc), error_code=exc.code))
            return
        if not msg.inputs:
            self.emit(p.Answer(msg.request_id))
            return
        self.embedding_work.append(EmbeddingWork(msg))

    def _check_token_vectors(self, msg: p.Query) -> None:
        """pooling none: the whole answer's numbers, counted before anything is decoded (tokenizing is
        cheap and bounded by the batch), so that a request past the bound costs no decode at all. The count
        stops at the bound: this step tokenizes at most the bound's worth of tokens (and one input)."""
        limit = self._embedding_limit()
        tokens = 0
        for item in msg.inputs:
            if isinstance(item, str):
                try:
                    tokens += len(self.prompt_tokens_within(item, limit, what="it"))
                except RequestError:
                    tokens += limit  # past the batch: refused (or cut to it) when its turn comes
            else:
                tokens += min(len(item), limit)
            self._refuse_past_vector_bound(tokens * self.n_embd)

    @staticmethod
    def _refuse_past_vector_bound(floats: int) -> None:
        if floats > MAX_TOKEN_VECTOR_FLOATS:  # the answer is one message to the daemon: bounded
            raise RequestError(f"the token vectors of these inputs would be {floats} numbers, more than the "
                               f"{MAX_TOKEN_VECTOR_FLOATS} one answer carries: send fewer or shorter inputs",
                               "invalid_request")

    def _embedding_limit(self) -> int:
        # One decode, within one sequence's context. llama.cpp caps its batch at the requested n_ctx (before
        # padding the context up): with ctx_size 128 a 256-token slot still decodes at most 128 at once, and
        # a longer decode aborts the worker (GGML_ASSERT n_tokens_all <= n_batch).
        return min(self.n_batch, llama.llama_n_batch(self.ctx), llama.llama_n_ubatch(self.ctx), self.n_ctx_slot)

    def _check_pooling(self, msg: p.Query) -> None:
        """A reranker (pooling = rank) answers rerank only, any other embeddings model embed only."""
        from daemon.worker.embeddings import RERANK_TEMPLATE_KEY, check_reranker

        ranks = self.rt.spec.pooling == "rank"
        if msg.kind == "embed" and ranks:
            raise RequestError("this model is a reranker (pooling = \"rank\"): it scores query and document "
                               "pairs at /v1/rerank, it has no embeddings")
        if msg.kind == "rerank":
            if not ranks:
                raise RequestError("this model was not loaded as a reranker: set embeddings = true and "
                                   "pooling = \"rank\" in its settings")
            check_reranker(self.rt.model, self.vocab, self.rt.spec.model, self.rt.meta(RERANK_TEMPLATE_KEY))

    def _embed_next(self) -> None:
        """Embed (or score, for rerank) the next input of the oldest embeddings request; answer it after its last."""
        from daemon.worker.embeddings import RERANK_TEMPLATE_KEY, embed, input_tokens, per_token, pooled, rerank_tokens

        work = self.embedding_work[0]
        item = work.msg.inputs[len(work.vectors)]
        limit = self._embedding_limit()
        try:
            if work.msg.kind == "rerank":  # the query and this document, scored by the classifier head
                if not isinstance(item, str):
                    raise RequestError("a document is text, not token ids")
                tokens = rerank_tokens(self.vocab, work.msg.text, item, limit, self.rt.meta(RERANK_TEMPLATE_KEY),
                                       lambda text, n: self.prompt_tokens_within(text, n, False, what="it"))
                vector = pooled(self.ctx, self.batch, limit, max(1, llama.llama_model_n_cls_out(self.rt.model)), tokens)
            else:
                if isinstance(item, str):
                    tokens = input_tokens(self, item, limit, work.msg.truncate)
                else:
                    self._check_vocab(item)
                    tokens = list(item)
                if self.rt.spec.pooling == "none":
                    self._refuse_past_vector_bound((work.read + len(tokens)) * self.n_embd)  # counted before too
                    vector = per_token(self.ctx, self.batch, limit, self.n_embd, tokens)
                else:
                    vector = embed(self.ctx, self.batch, limit, self.n_embd, tokens)
            work.vectors.append(vector)
            work.read += len(tokens)
        except RequestError as exc:
            self.embedding_work.popleft()
            what = "document" if work.msg.kind == "rerank" else "input"
            self.emit(p.Answer(work.msg.request_id, error=f"{what} {len(work.vectors)}: {exc}",
                               error_code=exc.code or "invalid_request"))
            return
        if len(work.vectors) == len(work.msg.inputs):
            self.embedding_work.popleft()
            if self.rt.spec.pooling == "none" and work.msg.kind == "embed":
                self.emit(p.Answer(work.msg.request_id, token_embeddings=work.vectors, prompt_tokens=work.read))
            else:
                self.emit(p.Answer(work.msg.request_id, embeddings=work.vectors, prompt_tokens=work.read))
