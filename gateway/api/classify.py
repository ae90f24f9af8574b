"""`POST /classify`: vLLM's classification, the same inputs as an embedding request.

vLLM's `ClassificationRequest` is `input` (a string, strings, token ids or arrays of them,
`add_special_tokens` true by default) or one conversation in `messages` (rendered by the chat
template, `add_generation_prompt` false, no special tokens by default), with
`truncate_prompt_tokens`: counted as gateway/api/embeddings.py counts them. (vLLM refuses the
batched and `input`-held conversations an embedding request may send; so does the replica.)
"""

from __future__ import annotations

from gateway.api.embeddings import EmbeddingsApi


class ClassifyApi(EmbeddingsApi):
    __slots__ = ()
    name = "classify"
    path = "/classify"


CLASSIFY = ClassifyApi()
