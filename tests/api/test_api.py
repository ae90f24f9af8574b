"""The endpoint registry (gateway/api/): one `Api` per endpoint, the policy's names, each served."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

from gateway.api import APIS, BY_NAME, BY_PATH, CHAT, COMPLETIONS, MESSAGES
from gateway.policy.compile import load_policy
from gateway.policy.schema import Endpoint
from gateway.server.app import create_app
from tests.conftest import basic_policy, write_policy


def test_the_registry_names_exactly_the_policys_endpoints() -> None:
    assert sorted(BY_NAME) == sorted(get_args(Endpoint))
    assert len(BY_PATH) == sum(1 + len(api.aliases) for api in APIS)  # no path shared
    assert BY_NAME["chat"] is CHAT and BY_NAME["completions"] is COMPLETIONS
    assert BY_NAME["messages"] is MESSAGES


async def test_each_api_is_a_post_route_of_the_gateway(tmp_path: Path) -> None:
    policy = load_policy(write_policy(tmp_path, basic_policy("estimate", ["http://127.0.0.1:9"])))
    app = create_app(policy)
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    policy.close()
    assert {("POST", path) for path in BY_PATH} <= served
