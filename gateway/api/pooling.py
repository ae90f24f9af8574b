"""`POST /pooling`: vLLM's raw pooling (any `task`), the same inputs as an embedding request.

vLLM's `PoolingRequest` is `input` or one conversation in `messages`, with the embedding
defaults (gateway/api/embeddings.py counts them). Whatever its task (`embed`, `classify`,
`token_embed`, ...), it produces no output tokens.
"""

from __future__ import annotations

from gateway.api.embeddings import EmbeddingsApi


class PoolingEndpointApi(EmbeddingsApi):
    __slots__ = ()
    name = "pooling"
    path = "/pooling"


POOLING = PoolingEndpointApi()
