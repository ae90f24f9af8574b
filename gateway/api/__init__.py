"""The APIs the gateway admits: one module each, registered here by endpoint name and by path.

`server/app.py` serves a POST route per entry of `BY_PATH`, each handing its `Api` to the
pipeline, which sets it on the request's `Ctx`; every stage reads `ctx.api` after that. The
names are policy vocabulary (a route's or class's `match.endpoint`), checked against `BY_NAME`
when a policy is compiled; the endpoint benchmark and the simulated replica serve what is
registered here, each request from its `Api.example`. So a new endpoint is its module and its
line in `APIS`.
"""

from __future__ import annotations

from gateway.api.anthropic import MESSAGES
from gateway.api.audio import TRANSCRIPTIONS, TRANSLATIONS
from gateway.api.chat import CHAT
from gateway.api.classify import CLASSIFY
from gateway.api.completions import COMPLETIONS
from gateway.api.embeddings import EMBEDDINGS
from gateway.api.pooling import POOLING
from gateway.api.responses import RESPONSES
from gateway.api.scoring import RERANK, SCORE
from gateway.context.endpoint import Api

APIS: tuple[Api, ...] = (
    CHAT, COMPLETIONS, MESSAGES, RESPONSES, EMBEDDINGS, RERANK, SCORE, CLASSIFY, POOLING,
    TRANSCRIPTIONS, TRANSLATIONS,
)  # fmt: skip
BY_NAME: dict[str, Api] = {api.name: api for api in APIS}
BY_PATH: dict[str, Api] = {path: api for api in APIS for path in (api.path, *api.aliases)}

if len(BY_NAME) != len(APIS) or len(BY_PATH) != sum(1 + len(api.aliases) for api in APIS):
    raise RuntimeError(f"two APIs in gateway/api/ share a name or a path: {sorted(BY_PATH)}")

__all__ = [
    "APIS",
    "BY_NAME",
    "BY_PATH",
    "CHAT",
    "CLASSIFY",
    "COMPLETIONS",
    "EMBEDDINGS",
    "MESSAGES",
    "POOLING",
    "RERANK",
    "RESPONSES",
    "SCORE",
    "TRANSCRIPTIONS",
    "TRANSLATIONS",
    "Api",
]
