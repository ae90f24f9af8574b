"""The endpoint registry (gateway/api/): one `Api` per endpoint, the policy's names, each served."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.api import APIS, BY_NAME, BY_PATH, CHAT, COMPLETIONS, MESSAGES
from gateway.api.completions import CompletionsApi
from gateway.config.load import PolicyError
from gateway.config.schema import ServerSpec
from gateway.policy.compile import load_policy
from gateway.server.app import create_app
from tests.conftest import basic_policy, write_policy


def test_the_registry_names_the_policys_endpoints() -> None:
    assert len(BY_NAME) == len(APIS)
    assert len(BY_PATH) == sum(1 + len(api.aliases) for api in APIS)  # no path shared
    assert BY_NAME["chat"] is CHAT and BY_NAME["completions"] is COMPLETIONS
    assert BY_NAME["messages"] is MESSAGES


async def test_each_api_is_a_post_route_of_the_gateway(tmp_path: Path) -> None:
    policy = load_policy(write_policy(tmp_path, basic_policy("estimate", ["http://127.0.0.1:9"])))
    app = create_app(policy)
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    policy.close()
    assert {("POST", path) for path in BY_PATH} <= served


class _Drafts(CompletionsApi):
    __slots__ = ()
    name = "drafts"
    path = "/v1/drafts"


def test_a_policy_names_any_registered_endpoint_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy's endpoint names are the registry's: an API registered in gateway/api/ is
    policy vocabulary without a line in the schema, and an unknown name lists the known."""
    policy = basic_policy("estimate", ["http://127.0.0.1:9"])
    policy["routes"][0]["match"] = {"endpoint": ["drafts", "chat"]}
    with pytest.raises(PolicyError, match="unknown endpoint 'drafts'; known: chat, completions"):
        load_policy(write_policy(tmp_path, policy))
    monkeypatch.setitem(BY_NAME, "drafts", _Drafts())
    load_policy(write_policy(tmp_path, policy)).close()


@pytest.mark.parametrize("api", [CHAT, MESSAGES], ids=["openai", "anthropic"])
def test_a_json_body_goes_upstream_as_the_clients_own_bytes_unless_a_field_changes(api) -> None:
    """No copy, no re-encode on the common path; a change, or a client's `priority` (never the
    replica's to read), re-encodes."""
    from multidict import CIMultiDict, CIMultiDictProxy

    from gateway.context.ctx import Ctx

    raw, content_type = api.example("tiny")
    ctx = Ctx("r", api, api.path, CIMultiDictProxy(CIMultiDict()), 0.0)
    ctx.raw, ctx.body = raw, api.decode(raw, content_type, ServerSpec())
    assert api.upstream_body(ctx, {}) is raw
    assert orjson.loads(api.upstream_body(ctx, {"model": "big"}))["model"] == "big"
    ctx.body = {**ctx.body, "priority": -5}
    assert "priority" not in orjson.loads(api.upstream_body(ctx, {}))
