"""Embed and Rerank requests checked and tokenized before any work, and their answers built.

Every problem is INVALID_ARGUMENT naming the field, before the request is queued:

    texts / token_ids        none, both, more than MAX_POOL_INPUTS, an empty one, an id outside
                             the vocabulary, one longer than max_model_len tokens (unless
                             truncate_prompt_tokens cuts it)
    dimensions               for a model without Matryoshka dimensions, or not one of them
    truncate_prompt_tokens   0, or more than max_model_len
    query / documents        empty, too many, a pair longer than max_model_len
    model                    Embed to a cross-encoder, Rerank to a model of several labels
    request_id               longer than MAX_REQUEST_ID_CHARS

Tokenization is sentence-transformers': a text gets the folder's default prompt before it and
the tokenizer's special tokens (`SentenceTransformer.encode`); a (query, document) pair is one
pair input, with its token type ids (`CrossEncoder.predict`). Token ids are taken as given.
`truncate_prompt_tokens` k cuts a text as the tokenizer truncates to k tokens (special tokens
kept, the end of the text cut, as sentence-transformers truncates to its max_seq_length), and
token ids to their first k.

Rerank against an embedding model scores each document by the cosine similarity of its
embedding with the query's (vLLM's score for bi-encoders); against a cross-encoder, by its one
label's score.
"""

from __future__ import annotations

import math
import uuid

from transformers import PreTrainedTokenizerBase

from pagoda.pooling_files import PoolingError, PoolingSpec
from pagoda.step import PoolTask
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.pooling_stream import PoolInput, PoolParams
from scheduler_svc.tokenizer import TooManyTokens, encode_at_most
from scheduler_svc.validation import MAX_REQUEST_ID_CHARS

# The most inputs one Embed (texts or token id lists) or Rerank (documents) may carry: OpenAI's
# limit on an embeddings request's input array.
MAX_POOL_INPUTS = 2048


class PoolingFrontEnd:
    """The pooling model's request rules: its tokenizer, its folder's spec, the served length."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: PoolingSpec, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.spec = spec
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.prompt = spec.prompts.get(spec.default_prompt_name, "") if spec.default_prompt_name else ""

    # ---- Embed ----------------------------------------------------------------------------

    def embed_params(self, req: pb.EmbedRequest) -> PoolParams:
        """Check and tokenize an EmbedRequest (costly for long texts: run it off the event loop)."""
        request_id = _request_id(req.request_id)
        if self.spec.task != "embed":
            raise InvalidArgument("model", "the served model is a cross-encoder: it scores pairs (Rerank), it does not embed")
        if req.texts and req.token_ids:
            raise InvalidArgument("texts", "give texts or token_ids, not both")
        field, count = ("texts", len(req.texts)) if req.texts else ("token_ids", len(req.token_ids))
        if count == 0:
            raise InvalidArgument("texts", "at least one input is required (texts or token_ids)")
        if count > MAX_POOL_INPUTS:
            raise InvalidArgument(field, f"{count} inputs, at most {MAX_POOL_INPUTS}")
        dimensions = req.dimensions if req.HasField("dimensions") else 0
        if req.HasField("dimensions"):
            if dimensions == 0:
                raise InvalidArgument("dimensions", "must be at least 1")
            try:
                self.spec.check_dimensions(dimensions)
            except PoolingError as exc:
                raise InvalidArgument("dimensions", str(exc).removeprefix("dimensions: ")) from None
        truncate = self._truncate(req)
        if req.texts:
            inputs = [self._text_input(f"texts[{i}]", text, truncate) for i, text in enumerate(req.texts)]
        else:
            inputs = [self._ids_input(f"token_ids[{i}].ids", list(ids.ids), truncate) for i, ids in enumerate(req.token_ids)]
        normalize = req.normalize if req.HasField("normalize") else self.spec.normalize
        return PoolParams(request_id, inputs, PoolTask.EMBED, normalize=normalize, dimensions=dimensions)

    def _truncate(self, req: pb.EmbedRequest) -> int | None:
        if not req.HasField("truncate_prompt_tokens"):
            return None
        k = req.truncate_prompt_tokens
        if not 1 <= k <= self.max_model_len:
            raise InvalidArgument("truncate_prompt_tokens", f"must be in [1, max_model_len {self.max_model_len}], got {k}")
        return k

    def _text_input(self, field: str, text: str, truncate: int | None) -> PoolInput:
        if not text:
            raise InvalidArgument(field, "empty text")
        text = self.prompt + text
        if truncate is not None:
            ids = self.tokenizer(text, truncation=True, max_length=truncate)["input_ids"]
            return PoolInput(list(ids))
        try:
            ids = encode_at_most(self.tokenizer, text, True, self.max_model_len)
        except TooManyTokens as exc:
            raise InvalidArgument(field, f"{exc}, more than the model's max_model_len {self.max_model_len} "
                                         f"(set truncate_prompt_tokens to cut it)") from None
        return PoolInput(ids)

    def _ids_input(self, field: str, ids: list[int], truncate: int | None) -> PoolInput:
        if not ids:
            raise InvalidArgument(field, "empty")
        for i, token_id in enumerate(ids):
            if token_id >= self.vocab_size:
                raise InvalidArgument(f"{field}[{i}]", f"{token_id} is outside the vocabulary ({self.vocab_size})")
        if truncate is not None:
            ids = ids[:truncate]
        if len(ids) > self.max_model_len:
            raise InvalidArgument(field, f"{len(ids)} tokens, more than the model's max_model_len {self.max_model_len} "
                                         f"(set truncate_prompt_tokens to cut it)")
        return PoolInput(ids)

    # ---- Rerank ---------------------------------------------------------------------------

    def rerank_params(self, req: pb.RerankRequest) -> PoolParams:
        """Check and tokenize a RerankRequest: one pair a document (cross-encoder), or the query
        then each document (an embedding model: cosine similarity, `rerank_results`)."""
        request_id = _request_id(req.request_id)
        if not req.query:
            raise InvalidArgument("query", "empty text")
        if not req.documents:
            raise InvalidArgument("documents", "at least one document is required")
        if len(req.documents) > MAX_POOL_INPUTS:
            raise InvalidArgument("documents", f"{len(req.documents)} documents, at most {MAX_POOL_INPUTS}")
        for i, document in enumerate(req.documents):
            if not document:
                raise InvalidArgument(f"documents[{i}]", "empty text")
        if self.spec.task == "embed":
            inputs = [self._text_input("query", req.query, None)]
            inputs += [self._text_input(f"documents[{i}]", d, None) for i, d in enumerate(req.documents)]
            return PoolParams(request_id, inputs, PoolTask.EMBED, normalize=True)
        if self.spec.num_labels != 1:
            raise InvalidArgument("model", f"the served cross-encoder has {self.spec.num_labels} labels; Rerank scores "
                                           f"models of one label")
        return PoolParams(request_id, [self._pair_input(req.query, d, i) for i, d in enumerate(req.documents)],
                          PoolTask.CLASSIFY)

    def _pair_input(self, query: str, document: str, index: int) -> PoolInput:
        encoded = self.tokenizer(query, document)
        ids = list(encoded["input_ids"])
        if len(ids) > self.max_model_len:
            raise InvalidArgument(f"documents[{index}]", f"the query and this document are {len(ids)} tokens, more "
                                                         f"than the model's max_model_len {self.max_model_len}")
        return PoolInput(ids, list(encoded.get("token_type_ids") or []))

    # ---- answers --------------------------------------------------------------------------

    @staticmethod
    def usage(params: PoolParams) -> pb.Usage:
        return pb.Usage(prompt_tokens=params.num_prompt_tokens)

    def embed_response(self, params: PoolParams, values: list[list[float]]) -> pb.EmbedResponse:
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(index=i, values=v) for i, v in enumerate(values)], usage=self.usage(params)
        )

    def rerank_response(self, req: pb.RerankRequest, params: PoolParams, values: list[list[float]]) -> pb.RerankResponse:
        if params.task is PoolTask.EMBED:
            query, documents = values[0], values[1:]
            scores = [_cosine(query, d) for d in documents]
        else:
            scores = [v[0] for v in values]
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        if req.HasField("top_n") and req.top_n > 0:
            order = order[: req.top_n]
        return pb.RerankResponse(
            results=[pb.RerankResult(index=i, relevance_score=scores[i]) for i in order], usage=self.usage(params)
        )


def _request_id(request_id: str) -> str:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    return request_id or uuid.uuid4().hex


def _cosine(a: list[float], b: list[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b)) / norm if norm else 0.0
