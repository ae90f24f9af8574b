"""vLLM's scoring endpoints: `/rerank` (`/v1/rerank`, `/v2/rerank`) and `/score` (`/v1/score`).

A rerank pairs its `query` with each of its `documents`; a score pairs `text_1` with `text_2`
(also named `data_1`/`data_2`, `queries`/`documents` or `queries`/`items`), one first text for
all or one per second text. How vLLM tokenizes a pair depends on the served model, which the
gateway does not know (entrypoints/pooling/scoring/io_processor.py):

- a cross-encoder encodes each pair as the tokenizer's pair (`text=q, text_pair=d`, special
  tokens on), or, an LLM used as reranker, `q + d` as one text; a model with a score template
  (Qwen3-Reranker and the like) renders its own template around them;
- a bi-encoder or late-interaction model encodes each text once, on its own, with special
  tokens.

So the count is conservative, not exact: each pair is counted as its two texts each encoded
alone with special tokens (what a bi-encoder sends per text, and at least what a tokenizer's
pair encoding adds: BERT's `[CLS] q [SEP] d [SEP]` is 3 specials to two singles' 4; Llama's
pair adds a BOS per text), plus an `instruction`'s tokens per pair. A bi-encoder's usage is
lower (the query once); a score template's text is not counted (it may be higher). The replica's
`usage.prompt_tokens` settles the charge (`exact` False: it is believed within the context).
The context check uses the longest single text, which every kind must fit.
`max_tokens_per_query`/`max_tokens_per_doc` and `truncate_prompt_tokens` are not applied (the
count stays an upper bound). Only text is admitted: a multimodal `{"content": [...]}` input is
a 400 (not counted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.api.embeddings import PoolingApi
from gateway.api.fields import check_prompt_chars
from gateway.context.endpoint import FINGERPRINT_CHARS, SAMPLE_DOCS, SAMPLE_TEXT
from gateway.errors import BadRequest
from gateway.tokenizer.counters import HFCounter

if TYPE_CHECKING:
    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx
    from gateway.tokenizer.counters import TokenCounter

# vLLM's names of a score request's two sides, in the order its request union tries them.
_SCORE_FIELDS: tuple[tuple[str, str], ...] = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


def _texts(value: Any, param: str) -> list[str]:
    """A side's texts: one string or a non-empty array of them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise BadRequest(
        f"'{param}' must be a string or a non-empty array of strings (multimodal inputs are"
        " not admitted)",
        param=param,
    )


class ScoringApi(PoolingApi):
    """Pairs of texts, each counted as its two texts alone (see the module's docstring)."""

    __slots__ = ()
    exact = False

    def sides(self, body: dict[str, Any]) -> tuple[list[str], list[str]]:
        raise NotImplementedError

    def parse(self, ctx: Ctx, body: dict[str, Any], limits: ServerSpec) -> tuple[int, int | None]:
        """One prompt per pair; the output bound is 0."""
        self.check_no_stream(body)
        first, second = self.sides(body)
        if len(first) not in (1, len(second)):
            raise BadRequest(
                f"the first side has {len(first)} texts and the second {len(second)}: one, or"
                " as many",
                param=self.prompt_param,
            )
        instruction = body.get("instruction")
        if instruction is not None and not isinstance(instruction, str):
            raise BadRequest("'instruction' must be a string", param="instruction")
        chars = sum(map(len, first)) + sum(map(len, second)) + len(instruction or "")
        check_prompt_chars(chars, limits, self.prompt_param)
        return len(second), 0

    async def count(
        self, body: dict[str, Any], counter: TokenCounter, refuse_at: int, images: int
    ) -> tuple[int, int]:
        first, second = self.sides(body)
        instruction = body.get("instruction")
        texts = [*first, *second] + ([instruction] if instruction else [])
        counts = await counter.count_prompts(texts, refuse_at)
        ones, twos = counts[: len(first)], counts[len(first) : len(first) + len(second)]
        per_pair = counts[-1] if instruction else 0
        if len(ones) == 1:
            total = len(twos) * (ones[0] + per_pair) + sum(twos)
        else:
            total = sum(ones) + sum(twos) + len(twos) * per_pair
        return total, max(counts)

    async def prompt_ids(
        self, body: dict[str, Any], counter: TokenCounter, special: bool | None = None
    ) -> list[int] | None:
        """None: how a pair reaches the model depends on its kind (`count`), so which ids it
        caches is not known here."""
        return None

    def fingerprint(self, body: dict[str, Any]) -> int:
        """The start of the (first) query."""
        return hash(self.sides(body)[0][0][:FINGERPRINT_CHARS])

    def input_floor(self, ctx: Ctx, counter: TokenCounter) -> int:
        """The texts' floors, each once (a bi-encoder's usage may be no more)."""
        floor = counter.floor if isinstance(counter, HFCounter) else None
        if floor is None:
            return 0
        first, second = self.sides(ctx.body)
        return sum(map(floor.tokens, first)) + sum(map(floor.tokens, second))


class RerankApi(ScoringApi):
    """vLLM's (and Cohere's, Jina's) rerank: a `query` and its `documents`."""

    __slots__ = ()
    name = "rerank"
    path = "/v1/rerank"
    sample = {"query": SAMPLE_TEXT, "documents": SAMPLE_DOCS}
    aliases = ("/rerank", "/v2/rerank")
    prompt_param = "documents"

    def sides(self, body: dict[str, Any]) -> tuple[list[str], list[str]]:
        query = body.get("query")
        if not isinstance(query, str):
            raise BadRequest("'query' must be a string", param="query")
        return [query], _texts(body.get("documents"), "documents")


class ScoreApi(ScoringApi):
    """vLLM's score: a first side and a second, under any of vLLM's four pairs of names."""

    __slots__ = ()
    name = "score"
    path = "/score"
    sample = {"text_1": SAMPLE_TEXT, "text_2": SAMPLE_DOCS}
    aliases = ("/v1/score",)
    prompt_param = "text_2"

    def sides(self, body: dict[str, Any]) -> tuple[list[str], list[str]]:
        for one, two in _SCORE_FIELDS:
            if one in body and two in body:
                return _texts(body[one], one), _texts(body[two], two)
        raise BadRequest(
            "a score request needs 'text_1' and 'text_2' (or 'queries' and 'documents' or"
            " 'items', or 'data_1' and 'data_2')",
            param="text_1",
        )


RERANK = RerankApi()
SCORE = ScoreApi()
