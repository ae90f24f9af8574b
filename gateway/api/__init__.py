"""The APIs the gateway admits: one module each, registered here by endpoint name and by path.

`server/app.py` serves a POST route per entry of `BY_PATH`, each handing its `Api` to the
pipeline, which sets it on the request's `Ctx`; every stage reads `ctx.api` after that. The
names are policy vocabulary (a route's or class's `match.endpoint`), declared once in
gateway/config/schema.py `Endpoint`, which imports no stage: the registry is checked against it
here, at import, so an API added without its name there (or the reverse) fails to start.
"""

from __future__ import annotations

from typing import get_args

from gateway.api.anthropic import MESSAGES
from gateway.api.chat import CHAT
from gateway.api.classify import CLASSIFY
from gateway.api.completions import COMPLETIONS
from gateway.api.embeddings import EMBEDDINGS
from gateway.api.pooling import POOLING
from gateway.api.responses import RESPONSES
from gateway.api.scoring import RERANK, SCORE
from gateway.config.schema import Endpoint
from gateway.context.endpoint import Api

APIS: tuple[Api, ...] = (
    CHAT, COMPLETIONS, MESSAGES, RESPONSES, EMBEDDINGS, RERANK, SCORE, CLASSIFY, POOLING
)  # fmt: skip
BY_NAME: dict[str, Api] = {api.name: api for api in APIS}
BY_PATH: dict[str, Api] = {path: api for api in APIS for path in (api.path, *api.aliases)}

if sorted(BY_NAME) != sorted(get_args(Endpoint)) or len(BY_PATH) != sum(
    1 + len(api.aliases) for api in APIS
):
    raise RuntimeError(
        f"gateway/api/ serves {sorted(BY_NAME)} at {sorted(BY_PATH)}; the policy's endpoints"
        f" (gateway/config/schema.py `Endpoint`) are {sorted(get_args(Endpoint))}"
    )

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
    "Api",
]
