"""The model cards `GET /v1/models` lists, with vLLM's fields.

vLLM's card (`ModelCard`, vllm/entrypoints/serve/engine/protocol.py) carries `root`, `parent`,
`max_model_len` and a `permission` list besides OpenAI's four fields; clients written for vLLM
read `max_model_len` from it to size their prompts. The gateway lists every name it routes: each
pool's model and each literal alias, with the `max_model_len` of the model the name is counted
as (its first route's), and `root` that model's name (vLLM's `root` is the model's path, which
the gateway does not know). LoRA adapters are listed as vLLM lists them: `parent` their base
model, no `max_model_len`; `root` is the adapter's name, for the same reason.

`created` is 0 and each permission's id new per answer, as vLLM makes one per card per call.
"""

from __future__ import annotations

import uuid
from typing import Any

from gateway.policy.compile import Policy

OWNER = "llm-admission-gateway"


def _permission() -> dict[str, Any]:
    """vLLM's `ModelPermission` defaults: sampling, logprobs and view allowed, nothing else."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": 0,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def _card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": OWNER,
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [_permission()],
    }


def model_cards(policy: Policy) -> list[dict[str, Any]]:
    """Every served model and literal alias, then every known adapter."""
    cards = []
    for name in policy.served_models:
        # Counted as the model of the first route taking the name (an alias has one).
        routed = (r.pool.model for r in policy.routes if r.accepts_model(name))
        model = next(routed, None) or policy.models[name]
        cards.append(_card(name, model.name, None, model.spec.max_model_len))
    cards += [_card(name, name, base, None) for name, base in policy.adapters.cards()]
    return cards
