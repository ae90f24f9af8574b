"""Which endpoints the adversary draws, driven by the gateway's registry (`gateway.api.BY_NAME`).

Every registered endpoint is either in `DRAWN` (its path, how often a single request draws it,
and its `kind`: how `generator.py` draws its bodies, how `replica.py` answers it and how
`count.py` counts its prompt) or in `NOT_DRAWN` with the reason it is not; `unaccounted` names
the ones that are neither, and `tests/promises/test_adversary.py` fails on any, so the next
endpoint registered cannot be forgotten here. Some entries are not registered `Api`s: the
counting endpoints `/tokenize`, `/detokenize` and `/v1/messages/count_tokens` (answered by the
gateway itself, no replica; kind `tokenize`) and a passthrough path (a route's, from the policy).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.api import BY_NAME


@dataclass(frozen=True)
class Drawn:
    """`kind`: `generative` (a chat-like answer, streamed or whole), `embed` (pooling over
    `input` texts), `pair` (scoring pairs of texts), `speech` (a multipart upload), `tokenize`
    or `passthrough`. `counted`: the C promise compares its input count with the replica's."""

    path: str
    weight: int
    kind: str
    counted: bool = True


def _registered(name: str, weight: int, kind: str) -> Drawn:
    return Drawn(BY_NAME[name].path, weight, kind)


DRAWN: dict[str, Drawn] = {
    "chat": _registered("chat", 5, "generative"),
    "completions": _registered("completions", 3, "generative"),
    "messages": _registered("messages", 4, "generative"),
    "responses": _registered("responses", 4, "generative"),
    "embeddings": _registered("embeddings", 1, "embed"),
    "classify": _registered("classify", 1, "embed"),
    "pooling": _registered("pooling", 1, "embed"),
    "rerank": _registered("rerank", 1, "pair"),
    "score": _registered("score", 1, "pair"),
    "transcriptions": _registered("transcriptions", 2, "speech"),
    "translations": _registered("translations", 1, "speech"),
    "tokenize": Drawn("/tokenize", 1, "tokenize", counted=False),
    "detokenize": Drawn("/detokenize", 1, "tokenize", counted=False),
    "count_tokens": Drawn("/v1/messages/count_tokens", 1, "tokenize", counted=False),
    "passthrough": Drawn("/v1/adversary/echo", 1, "passthrough", counted=False),
}
# A registered endpoint the adversary does not draw, and why (none today: each is drawn).
NOT_DRAWN: dict[str, str] = {}
COUNTING = frozenset(name for name, d in DRAWN.items() if d.kind == "tokenize")
GENERATIVE = tuple(name for name, d in DRAWN.items() if d.kind == "generative")
SPEECH = tuple(name for name, d in DRAWN.items() if d.kind == "speech")
COUNTED = tuple(name for name, d in DRAWN.items() if d.counted)


def unaccounted() -> list[str]:
    """Registered endpoints neither drawn nor said why not; and names said both."""
    return sorted(
        {name for name in BY_NAME if (name in DRAWN) == (name in NOT_DRAWN)}
        | {name for name in NOT_DRAWN if name not in BY_NAME}
    )
