"""LoRA adapters: routed to the pool of their base model, their name kept upstream, discovered from
the replicas' `/v1/models`, and counted in metrics only when known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.load import PolicyError
from gateway.fleet.adapters import MAX_PER_POOL
from gateway.observability.instruments import MAX_ADAPTER_LABELS, OTHER
from gateway.policy.compile import load_policy
from loadtest.sim.server import ReplicaOptions, start_replica
from tests.conftest import _serve, basic_policy, eventually, write_policy
from tests.loadtest.test_simulator import write_profile

FAST = 0.05  # s between discoveries: the tests wait for one, never for a time


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def two_pools(tokenizer: Path, tiny_url: str, other_url: str, **main: Any) -> dict[str, Any]:
    """`tiny` on pool main, `other` on pool other, and a catch-all route to other: before
    adapters, a request for `sql-lora` matched the glob and went to `other` as `other`."""
    policy = basic_policy(tokenizer, [tiny_url], **main)
    policy["models"]["other"] = {"tokenizer": "estimate", "max_model_len": 8192}
    policy["pools"]["other"] = {"model": "other", "replicas": [other_url], "max_concurrency": 4}
    policy["routes"].append({"match": {"model": "*"}, "pool": "other"})
    return policy


async def test_an_adapter_goes_to_its_base_models_pool_and_keeps_its_name(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    tiny, other = await stub_factory(), await stub_factory()
    gw = await gateway_factory(two_pools(tokenizer_dir, tiny.url, other.url, adapters=["sql-lora"]))
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat("sql-lora")) as resp:
        assert resp.status == 200
        assert (await resp.json())["model"] == "sql-lora"
    assert [b["model"] for b in tiny.stats.bodies] == ["sql-lora"]
    assert other.stats.requests == 0
    line = json.loads(gw.access_log.getvalue().splitlines()[-1])
    assert (line["adapter"], line["served_model"], line["pool"]) == ("sql-lora", "tiny", "main")
    # An alias is still rewritten to the pool's model: only adapters keep their name.
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat("tiny-alias")) as resp:
        assert resp.status == 200
    assert tiny.stats.bodies[-1]["model"] == "tiny"


async def test_an_adapter_follows_the_base_models_routes_by_class(
    stub_factory, gateway_factory, tokenizer_dir, http
) -> None:
    """Two pools serve the base model and the adapter, split by class: the adapter's requests
    follow the base model's routes."""
    short, long = await stub_factory(), await stub_factory()
    policy = basic_policy(tokenizer_dir, [short.url], adapters=["sql-lora"])
    policy["pools"]["long"] = {**policy["pools"]["main"], "replicas": [long.url]}
    policy["classes"] = [
        {"name": "big", "when": {"input_tokens": {"gte": 50}}},
        {"name": "any", "when": {}},
    ]
    policy["routes"] = [
        {"match": {"model": "tiny", "class": "big"}, "pool": "long"},
        {"match": {"model": "tiny"}, "pool": "main"},
    ]
    gw = await gateway_factory(policy)
    big = {**chat("sql-lora"), "messages": [{"role": "user", "content": "word " * 200}]}
    for body in (chat("sql-lora"), big):
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
    assert [b["model"] for b in short.stats.bodies] == ["sql-lora"]
    assert [b["model"] for b in long.stats.bodies] == ["sql-lora"]
    assert long.stats.bodies[0]["messages"] == big["messages"]


async def test_an_unknown_adapter_is_model_not_found_and_makes_no_label(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url], adapters=["sql-lora"]))
    for model in ("sql-lora", "nope-lora"):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat(model)) as resp:
            body = await resp.json()
    assert (resp.status, body["error"]["code"]) == (404, "model_not_found")
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        text = await resp.text()
    assert "nope-lora" not in text
    samples = {
        (s.labels["adapter"], s.labels["code"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "llm_adapter_requests"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert samples == {("sql-lora", "200"): 1.0}


async def test_adapter_labels_are_bounded(stub, gateway_factory, tokenizer_dir) -> None:
    """However many adapters replicas come to list over time, the label set ends."""
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    metrics = gw.gateway.accountant.metrics
    labels = {metrics.adapter_label(f"lora-{i}") for i in range(MAX_ADAPTER_LABELS + 50)}
    assert len(labels) == MAX_ADAPTER_LABELS + 1
    assert metrics.adapter_label("lora-0") == "lora-0"
    assert metrics.adapter_label("lora-new") == OTHER


async def sim_replica(tmp_path: Path, *lora_modules: tuple[str, str]) -> Any:
    options = ReplicaOptions(time_scale=1000, lora_modules=lora_modules)
    return await start_replica(write_profile(tmp_path), options)


async def test_adapters_are_discovered_from_the_replicas_models(
    tmp_path, gateway_factory, tokenizer_dir, http
) -> None:
    """The simulator lists its adapter as vLLM does (a card with `parent`) and 404s any model it
    does not serve: the request reaching it proves the name was kept."""
    replica = await sim_replica(tmp_path, ("sim-lora", "/adapters/sim"))
    try:
        policy = basic_policy(tokenizer_dir, [replica.url], health={"reconcile_interval_s": FAST})
        gw = await gateway_factory(policy)
        slots = gw.gateway.slots["main"]
        await eventually(lambda: bool(slots.replicas[0].adapters))
        assert slots.replicas[0].adapters == {"sim-lora"}
        async with http.get(f"{gw.url}/v1/models") as resp:
            cards = {c["id"]: c.get("parent") for c in (await resp.json())["data"]}
        assert cards == {"tiny": None, "tiny-alias": None, "sim-lora": "tiny"}
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat("sim-lora")) as resp:
            assert resp.status == 200
            assert (await resp.json())["model"] == "sim-lora"
    finally:
        await replica.close()


async def test_a_replica_that_lists_no_adapter_keeps_the_policys_list(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    """The stub has no /v1/models: it is taken to serve what the policy says."""
    policy = basic_policy(
        tokenizer_dir, [stub.url], adapters=["sql-lora"], health={"reconcile_interval_s": FAST}
    )
    gw = await gateway_factory(policy)
    replica = gw.gateway.slots["main"].replicas[0]
    await eventually(lambda: bool(replica.adapters))
    assert replica.adapters == {"sql-lora"}
    async with http.get(f"{gw.url}/v1/models") as resp:
        cards = [c for c in (await resp.json())["data"] if c["id"] == "sql-lora"]
    assert [{k: v for k, v in c.items() if k != "permission"} for c in cards] == [
        {"id": "sql-lora", "object": "model", "created": 0, "owned_by": "llm-admission-gateway",
         "root": "sql-lora", "parent": "tiny", "max_model_len": None}
    ]  # fmt: skip


async def test_what_a_replica_lists_is_bounded_and_never_shadows_a_model(
    gateway_factory, tokenizer_dir, http
) -> None:
    """A replica listing thousands of adapters, and one named like an alias: the pool keeps
    MAX_PER_POOL of them, and the alias stays an alias (rewritten to the pool's model)."""
    cards = [{"id": "tiny-alias", "parent": "tiny"}]
    cards += [{"id": f"lora-{i:05}", "parent": "tiny"} for i in range(3 * MAX_PER_POOL)]
    received: list[dict[str, Any]] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}, *cards]})

    async def completions(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.json_response({"choices": [], "usage": {"completion_tokens": 1}})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", completions)
    runner, url = await _serve(app)
    try:
        policy = basic_policy(tokenizer_dir, [url], health={"reconcile_interval_s": FAST})
        gw = await gateway_factory(policy)
        catalog = gw.gateway.policy.adapters
        await eventually(lambda: bool(catalog.cards()))
        assert len(catalog.cards()) == MAX_PER_POOL
        assert catalog.pools("tiny-alias") == frozenset()
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat("tiny-alias")) as resp:
            assert resp.status == 200
        assert received[-1]["model"] == "tiny"
    finally:
        await runner.cleanup()


async def test_discovered_adapters_survive_a_reload(
    tmp_path, gateway_factory, tokenizer_dir, http
) -> None:
    replica = await sim_replica(tmp_path, ("sim-lora", "/adapters/sim"))
    try:
        # Discovered once, then never again: what the reloaded policy knows was carried over.
        policy = basic_policy(tokenizer_dir, [replica.url], health={"reconcile_interval_s": 60})
        gw = await gateway_factory(policy)
        await eventually(lambda: bool(gw.gateway.policy.adapters.cards()))
        policy["pools"]["main"]["max_concurrency"] = 4
        write_policy(Path(gw.gateway.policy.path).parent, policy)
        await gw.gateway.reload()
        assert gw.gateway.policy.spec.pools["main"].max_concurrency == 4
        assert gw.gateway.policy.adapters.pools("sim-lora") == {"main"}
    finally:
        await replica.close()


def test_explain_shows_the_adapter_kept(tmp_path, tokenizer_dir) -> None:
    policy = write_policy(
        tmp_path,
        two_pools(tokenizer_dir, "http://127.0.0.1:1", "http://127.0.0.1:2", adapters=["sql-lora"]),
    )
    request = tmp_path / "request.json"
    request.write_text(json.dumps(chat("sql-lora")))
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "explain", "--json", "--policy", str(policy), str(request)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    decision = json.loads(out.stdout)
    assert (decision["adapter"], decision["pool"], decision["rewritten_model"]) == (
        "sql-lora",
        "main",
        "sql-lora",
    )
    assert decision["tokenizer"] == str(tokenizer_dir)


@pytest.mark.parametrize(
    ("adapters", "problem"),
    [
        (["tiny"], r"pools.main.adapters.0: 'tiny' is a model or alias name already"),
        (["tiny-alias"], r"pools.main.adapters.0: 'tiny-alias' is a model or alias name"),
        (["a", "a"], r"pools.main.adapters: .*adapters must be distinct"),
    ],
)
def test_policy_refuses_adapters_that_are_not_names_of_their_own(
    tmp_path, adapters, problem
) -> None:
    path = write_policy(
        tmp_path, basic_policy("estimate", ["http://127.0.0.1:1"], adapters=adapters)
    )
    with pytest.raises(PolicyError, match=problem):
        load_policy(path, load_tokenizers=False)


def test_policy_refuses_an_adapter_on_pools_of_other_models(tmp_path, tokenizer_dir) -> None:
    policy = two_pools(tokenizer_dir, "http://127.0.0.1:1", "http://127.0.0.1:2", adapters=["x"])
    policy["pools"]["other"]["adapters"] = ["x"]
    with pytest.raises(PolicyError, match=r"pools.other.adapters.0: adapter 'x' is listed on a"):
        load_policy(write_policy(tmp_path, policy), load_tokenizers=False)


async def test_an_adapters_requests_go_only_to_the_replicas_that_list_it(
    tmp_path, gateway_factory, tokenizer_dir, http
) -> None:
    """One replica has the adapter loaded, the other not (it would answer 404): every request
    for the adapter waits for the first rather than fail on the second; base-model requests
    still use both."""
    with_it = await sim_replica(tmp_path, ("sim-lora", "/adapters/sim"))
    without = await sim_replica(tmp_path)
    try:
        urls = [without.url, with_it.url]  # the one without first: least in flight tries it first
        policy = basic_policy(tokenizer_dir, urls, health={"reconcile_interval_s": FAST})
        gw = await gateway_factory(policy)
        slots = gw.gateway.slots["main"]
        await eventually(lambda: bool(slots.replicas[1].adapters))
        requests = [chat("sim-lora") for _ in range(6)] + [chat("tiny") for _ in range(6)]
        statuses = []
        for body in requests:
            async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                statuses.append(resp.status)
        assert statuses == [200] * 12
        served = [sum(r.engine.stats.success.values()) for r in (without, with_it)]
        assert served == [6, 6]  # least in flight sends the base requests to the first
    finally:
        await with_it.close()
        await without.close()
