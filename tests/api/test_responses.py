"""The official `openai` SDK's Responses API pointed at the gateway, in front of simulated vLLM
replicas that serve `/v1/responses` and store what they answer, as an Agents SDK or Codex client
would use it: created whole and streamed, continued by `previous_response_id` on the replica that
holds the conversation, retrieved, refused in OpenAI's shape; behind two gateways that share
state through Redis, with the turns alternating between them."""

from __future__ import annotations

import asyncio
import copy
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api import RESPONSES, responses
from gateway.api.responses import to_chat
from gateway.state import Holder
from gateway.state.failover import FailoverState
from gateway.state.redis import RedisState
from gateway.tokenizer.chat_template import render_weight
from gateway.tokenizer.counters import INLINE_RENDER_WEIGHT
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.sweep import SweepConfig, Target, run_sweep
from loadtest.loadgen.workloads import Fixed, Session, Workload, WorkloadClass
from loadtest.sim import Profile, ReplicaOptions, start_replica
from loadtest.sim.faults import Faults
from tests.conftest import (
    RedisServer,
    accounted,
    basic_policy,
    eventually,
    real_load,
    real_reference,
)
from tests.fuzzing import counted_or_refused, values
from tests.loadtest.test_simulator import write_profile

HELLO = "review this product"


@pytest.fixture
def tiny(tmp_path: Path) -> Profile:
    return write_profile(tmp_path)


@pytest.fixture
async def sims(tiny: Profile, tokenizer_dir: Path) -> AsyncIterator[list[Any]]:
    """Two replicas counting prompts with the model's own tokenizer, as vLLM does."""
    options = ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir)
    replicas = [await start_replica(tiny, options) for _ in range(2)]
    yield replicas
    for replica in replicas:
        await replica.close()


@pytest.fixture
async def gw(sims, gateway_factory, tokenizer_dir):
    return await gateway_factory(basic_policy(tokenizer_dir, [r.url for r in sims]))


def client(gw: Any, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def logged(gw: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]


async def test_create_counts_the_input_as_the_replica_does(gw) -> None:
    async with client(gw) as sdk:
        reply = await sdk.responses.create(
            model="tiny", instructions="You are a terse reviewer.", input=HELLO,
            max_output_tokens=4,
        )  # fmt: skip
    assert reply.status == "completed" and reply.output_text
    assert reply.usage is not None and 1 <= reply.usage.output_tokens <= 4
    await accounted(gw, 0)
    (line,) = logged(gw)
    assert line["endpoint"] == "responses" and line["status"] == 200
    # The replica rendered the chat vLLM converts it to with the model's template; so did
    # the gateway, before admitting it.
    assert line["input_tokens"] == reply.usage.input_tokens
    assert line["output_tokens"] == reply.usage.output_tokens


async def test_stream_relays_typed_events_and_reads_usage_from_completed(gw) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": HELLO}]},
        {"type": "message", "role": "assistant", "content": "Which product?"},
        {"role": "user", "content": "the kettle"},
    ]
    async with (
        client(gw) as sdk,
        sdk.responses.stream(model="tiny", input=items, max_output_tokens=6) as stream,
    ):
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert final.output_text and final.usage is not None
    await accounted(gw, 0)
    (line,) = logged(gw)
    assert line["input_tokens"] == final.usage.input_tokens
    assert line["output_tokens"] == final.usage.output_tokens


async def test_a_conversation_continues_on_the_replica_that_stores_it(gw, sims) -> None:
    async with client(gw) as sdk:
        first = await sdk.responses.create(model="tiny", input=HELLO, max_output_tokens=3)
        turns = [first]
        for _ in range(5):  # each turn on the holder of the one before, never the other replica
            turns.append(
                await sdk.responses.create(
                    model="tiny", input="and then?", previous_response_id=turns[-1].id,
                    max_output_tokens=3,
                )
            )  # fmt: skip
        stored = await sdk.responses.retrieve(turns[-1].id)
        with pytest.raises(openai.BadRequestError, match="synchronous"):
            await sdk.responses.cancel(first.id)  # vLLM's answer, from the replica holding it
    assert stored.id == turns[-1].id and stored.output_text == turns[-1].output_text
    await accounted(gw, len(turns) - 1)
    lines = logged(gw)
    assert len({line["replica"] for line in lines}) == 1
    # The stored turns are rendered with the new input: each turn's count is the replica's.
    counts = [line["input_tokens"] for line in lines]
    assert counts == sorted(counts) and counts[-1] > 3 * counts[0]
    assert counts == [turn.usage.input_tokens for turn in turns if turn.usage is not None]
    assert [line["output_tokens"] for line in lines] == [
        turn.usage.output_tokens for turn in turns if turn.usage is not None
    ]


# --- a chain counted exactly, on the real tokenizers: the reference renders the conversation
# vLLM 0.32 builds for a chained turn (responses/utils.py `construct_input_messages`) with
# transformers' own `apply_chat_template` ---------------------------------------------------

REAL_MODELS = ("gemma3", "llama3", "qwen3")
CHAIN = [  # (instructions, input, streamed)
    (None, [{"role": "system", "content": "Be terse."},
            {"role": "user", "content": [{"type": "input_text", "text": HELLO}]}], False),
    ("You are a product reviewer.", "and the kettle?", True),
    (None, [{"type": "message", "role": "user", "content": "and the toaster, in French?"}], False),
    ("Answer as a haiku.", "which one would you buy?", True),
]  # fmt: skip


def vllm_chain(replies: list[Any]) -> list[list[dict[str, Any]]]:
    """The messages vLLM renders for each turn of `CHAIN`, given the turns' answers: the
    turn's instructions, the stored conversation without its system messages, an assistant
    message per content part of the previous output's messages, the turn's input."""
    rendered, stored = [], []
    for (instructions, said, _), reply in zip(CHAIN, [None, *replies], strict=False):
        carried = [m for m in stored if m["role"] != "system"]
        if reply is not None:
            carried += [
                {"role": "assistant", "content": part.text}
                for item in reply.output
                if item.type == "message"
                for part in item.content
            ]
        own = [{"role": "user", "content": said}] if isinstance(said, str) else said
        own = [{"role": m["role"], "content": m["content"]} for m in own]
        stored = ([{"role": "system", "content": instructions}] if instructions else []) + carried
        stored += own
        rendered.append(stored)
    return rendered


def reference_count(model: str, messages: list[dict[str, Any]]) -> int:
    """transformers' count of what vLLM renders: vLLM's parsed conversation through the
    template, encoded with the special tokens (a responses request keeps them)."""
    from tests.tokenizer.test_real_tokenizers import OPENAI_FORMAT, vllm_conversation

    tokenizer = real_reference(model)
    conversation = vllm_conversation({"messages": messages}, OPENAI_FORMAT[model])
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text)["input_ids"])


@pytest.mark.parametrize("model", REAL_MODELS)
async def test_a_chain_is_counted_as_the_replica_renders_it(
    model: str, tiny: Profile, gateway_factory
) -> None:
    """Each turn's count is the whole stored conversation, the earlier outputs' text
    included, rendered as vLLM renders it: equal to the replica's and to transformers'."""
    from loadtest.real_tokenizers import directory

    replica = await start_replica(tiny, ReplicaOptions(time_scale=1000, tokenizer=directory(model)))
    try:
        real_load(model)  # the policy's counter finds it loaded
        gw = await gateway_factory(basic_policy(directory(model), [replica.url]))
        replies: list[Any] = []
        async with client(gw) as sdk:
            for instructions, said, streamed in CHAIN:
                fields: dict[str, Any] = {
                    "model": "tiny", "input": said, "max_output_tokens": 30,
                    "extra_body": {"ignore_eos": True},
                    "previous_response_id": replies[-1].id if replies else None,
                    "instructions": instructions,
                }  # fmt: skip
                fields = {k: v for k, v in fields.items() if v is not None}
                if streamed:
                    async with sdk.responses.stream(**fields) as stream:
                        async for _ in stream:
                            pass
                        replies.append(await stream.get_final_response())
                else:
                    replies.append(await sdk.responses.create(**fields))
        await accounted(gw, len(CHAIN) - 1)
    finally:
        await replica.close()
    assert all(r.usage is not None and r.usage.output_tokens == 30 for r in replies)
    counted = [line["input_tokens"] for line in logged(gw)]
    reported = [r.usage.input_tokens for r in replies]
    expected = [reference_count(model, messages) for messages in vllm_chain(replies)]
    assert counted == reported == expected


@pytest.mark.parametrize(
    ("streamed", "bound"), [(True, "_KEPT_OUTPUT_CHARS"), (False, "_DECODED_ANSWER_BYTES")]
)
async def test_an_output_whose_text_is_not_kept_is_counted_by_its_tokens(
    gw, monkeypatch: pytest.MonkeyPatch, streamed: bool, bound: str
) -> None:
    """Past the bounds on what the gateway keeps of an answer (its text, or a whole answer it
    would decode), the next turn counts the output by the replica's `output_tokens` in an empty
    assistant message: the template's frame around it still counted."""
    monkeypatch.setattr(responses, bound, 8)
    fields: dict[str, Any] = {"model": "tiny", "input": HELLO, "max_output_tokens": 30,
                              "extra_body": {"ignore_eos": True}}  # fmt: skip
    async with client(gw) as sdk:
        if streamed:
            async with sdk.responses.stream(**fields) as stream:
                async for _ in stream:
                    pass
                first = await stream.get_final_response()
        else:
            first = await sdk.responses.create(**fields)
        second = await sdk.responses.create(
            model="tiny", input="and then?", previous_response_id=first.id, max_output_tokens=3
        )
    held = gw.gateway.holders._held[first.id]
    assert held.unheard == 30 and held.turns[-1] == {"role": "assistant", "content": ""}
    await accounted(gw, 1)
    assert second.usage is not None
    assert logged(gw)[1]["input_tokens"] == second.usage.input_tokens


async def test_a_chained_turn_counts_as_its_conversation_sent_whole(
    sims, gateway_factory, tokenizer_dir
) -> None:
    """A stored turn's images are rendered again, each at the model's `image_tokens`: the
    chained turn counts as the same conversation sent in one request."""
    policy = basic_policy(tokenizer_dir, [r.url for r in sims])
    policy["models"]["tiny"]["image_tokens"] = 260
    gw = await gateway_factory(policy)
    image = {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 4000}
    opening = [{"role": "user", "content": [{"type": "input_text", "text": HELLO}, image]}]
    async with client(gw) as sdk:
        first = await sdk.responses.create(model="tiny", input=opening, max_output_tokens=5)
        await sdk.responses.create(
            model="tiny", input="and then?", previous_response_id=first.id, max_output_tokens=3
        )
        whole = [*opening, {"role": "assistant", "content": first.output_text},
                 {"role": "user", "content": "and then?"}]  # fmt: skip
        await sdk.responses.create(model="tiny", input=whole, max_output_tokens=3)
    await accounted(gw, 2)
    _, chained, sent_whole = logged(gw)
    assert chained["input_tokens"] == sent_whole["input_tokens"] > 260


async def test_a_stored_turn_keeps_only_what_a_template_reads(pair, fresh_redis, http) -> None:
    """Fields no template reads are not kept with the stored turns (nor written to Redis for
    every later turn of the chain); the count is the replica's all the same."""
    first_gw, second_gw = pair
    junk = "x" * 20_000
    said = {"role": "user", "junk": junk,
            "content": [{"type": "input_text", "text": HELLO, "junk": junk}]}  # fmt: skip
    body = {"model": "tiny", "input": [said], "max_output_tokens": 3}
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    async with http.post(f"{first_gw.url}/v1/responses", json=body, headers=headers) as resp:
        assert resp.status == 200
        first = await resp.json()
    async with client(second_gw, KEYS["alice"]) as two:
        second = await two.responses.create(
            model="tiny", input="and then?", previous_response_id=first["id"], max_output_tokens=3
        )
    raw = redis.Redis(port=fresh_redis.port).get(f"holder:{first['id']}")
    assert raw is not None and len(raw) < 2000
    await accounted(second_gw, 0)
    assert second.usage is not None
    assert logged(second_gw)[0]["input_tokens"] == second.usage.input_tokens


async def test_a_conversation_over_its_bound_is_kept_as_its_tokens(gw) -> None:
    """What a template drops (here the earlier reasoning) is not counted, so it could make a
    stored conversation any size: past 16 bytes a token of the context, the gateway keeps only
    its token count (the turn's count and its output's) and counts it so from then on."""
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "r" * 200_000}]}  # fmt: skip
    opening = [{"role": "user", "content": HELLO}, thought, {"role": "user", "content": "go"}]
    async with client(gw) as sdk:
        first = await sdk.responses.create(model="tiny", input=opening, max_output_tokens=3)
        await sdk.responses.create(
            model="tiny", input="and then?", previous_response_id=first.id, max_output_tokens=3
        )
        await sdk.responses.create(model="tiny", input="and then?", max_output_tokens=3)
    await accounted(gw, 2)
    opened, chained, alone = logged(gw)
    held = gw.gateway.holders._held[first.id]
    assert held.turns == () and held.unheard == opened["input_tokens"] + opened["output_tokens"]
    assert chained["input_tokens"] == held.unheard + alone["input_tokens"]


async def test_unknown_and_other_tenants_responses_are_not_found(
    sims, gateway_factory, tokenizer_dir
) -> None:
    policy = basic_policy(tokenizer_dir, [r.url for r in sims])
    policy["tenants"] = {
        name: {"keys": [f"sha256:{hashlib.sha256(f'key-{name}'.encode()).hexdigest()}"]}
        for name in ("alice", "bob")
    }
    gw = await gateway_factory(policy)
    async with client(gw, "key-alice") as alice, client(gw, "key-bob") as bob:
        mine = await alice.responses.create(model="tiny", input=HELLO, max_output_tokens=2)
        for call in (
            bob.responses.retrieve(mine.id),
            bob.responses.create(model="tiny", input="x", previous_response_id=mine.id),
            alice.responses.create(model="tiny", input="x", previous_response_id="resp_none"),
        ):
            with pytest.raises(openai.NotFoundError) as caught:
                await call
            assert caught.value.code == "response_not_found"
        assert (await alice.responses.retrieve(mine.id)).id == mine.id


async def test_a_response_whose_replica_left_is_gone(gw, sims) -> None:
    async with client(gw) as sdk:
        first = await sdk.responses.create(model="tiny", input=HELLO, max_output_tokens=2)
        holder = next(r for r in sims if r.state.responses.get(first.id) is not None)
        pool = gw.gateway.slots["main"]
        pool.replicas = [r for r in pool.replicas if r.url != holder.url]  # as a reload does
        with pytest.raises(openai.NotFoundError, match="left the pool"):
            await sdk.responses.create(model="tiny", input="more", previous_response_id=first.id)
    await eventually(lambda: gw.gateway.slots["main"].inflight == 0)


async def test_background_and_bad_input_are_refused_in_openai_shape(gw) -> None:
    async with client(gw) as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.create(model="tiny", input=HELLO, background=True)
        assert caught.value.code == "background_not_supported"
        with pytest.raises(openai.BadRequestError, match="Unsupported input item type"):
            await sdk.responses.create(model="tiny", input=[{"type": "nonsense"}])
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.create(model="tiny", input=HELLO, max_output_tokens=0)
        assert caught.value.param == "max_output_tokens"


async def test_a_stream_the_replica_breaks_ends_with_an_error_event(gw, sims, http) -> None:
    for replica in sims:
        replica.state.set_faults(Faults(reset_after_chunks=1))
    body = {"model": "tiny", "input": HELLO, "max_output_tokens": 40, "stream": True}
    async with http.post(f"{gw.url}/v1/responses", json=body) as resp:
        raw = await resp.read()
    *relayed, last = raw.decode().split("\n\n")[:-1]
    assert relayed[0].startswith("event: response.created")
    name, data = last.split("\n")
    assert name == "event: error"
    error = orjson.loads(data.removeprefix("data: "))
    assert error["type"] == "error" and error["code"] == "upstream_error"
    await accounted(gw, 0)
    (line,) = logged(gw)
    assert line["reason"] == "upstream_error" and line["output_tokens"] >= 1
    assert gw.gateway.slots["main"].inflight == 0


item_types = st.sampled_from(
    ["message", "function_call", "function_call_output", "custom_tool_call",
     "custom_tool_call_output", "reasoning", "web_search_call", None]
)  # fmt: skip
item_fields = st.sampled_from(
    ["role", "content", "call_id", "name", "arguments", "input", "output", "namespace",
     "summary", "encrypted_content", "status", "id"]
)  # fmt: skip
items = st.builds(
    lambda kind, extra: {**({"type": kind} if kind else {}), **extra},
    item_types,
    st.dictionaries(item_fields, values, max_size=4),
)
tools = st.builds(
    lambda kind, extra: {"type": kind, **extra},
    st.sampled_from(["function", "namespace", "custom", "web_search_preview", "mcp"]),
    st.dictionaries(st.sampled_from(["name", "parameters", "tools", "strict"]), values, max_size=3),
)
bodies = st.fixed_dictionaries(
    {"model": st.just("tiny"), "input": st.text(max_size=10) | st.lists(items, max_size=4)},
    optional={
        "instructions": values,
        "tools": st.lists(tools, max_size=3) | values,
        "reasoning": values | st.fixed_dictionaries({"effort": values}),
        "max_output_tokens": values,
        "previous_response_id": values,
    },
)


@settings(max_examples=400, deadline=None, database=None)
@given(body=bodies)
def test_any_body_is_counted_or_refused_never_a_crash(
    tiny_policy: Any, body: dict[str, Any]
) -> None:
    """Whatever the items' and tools' shapes, parse and the conversion end in a count or a
    400: a body that passed the checks never crashes the template (a 500 for the client)."""
    counted_or_refused(tiny_policy, RESPONSES, body)


def test_converting_leaves_the_body_as_it_came() -> None:
    """A tool call merges into the assistant message before it, which may be the client's own
    item: merged into a copy, so the second conversion (the count after parse's check, the
    stored turns) sees the call once and the replica gets the body as the client sent it."""
    body = {"model": "tiny", "input": [
        {"role": "user", "content": HELLO},
        {"role": "assistant"},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "found"},
    ]}  # fmt: skip
    sent = copy.deepcopy(body)
    first, second = to_chat(body), to_chat(body)
    assert body == sent and first == second
    assert [len(m.get("tool_calls", ())) for m in first["messages"]] == [0, 1, 0]


def test_a_long_stored_conversation_weighs_as_much_as_a_long_input() -> None:
    """Where a turn is rendered (on the loop or a tokenizer thread) is decided by its weight: a
    short new input continuing a long conversation renders the whole conversation."""
    turns = tuple({"role": "user", "content": "a turn"} for _ in range(INLINE_RENDER_WEIGHT))
    body = {"model": "m", "input": "and one more", "previous_response_id": "resp_1"}
    assert render_weight(body, INLINE_RENDER_WEIGHT) <= INLINE_RENDER_WEIGHT
    continued = responses.Continued(body, turns)
    assert render_weight(continued, INLINE_RENDER_WEIGHT) > INLINE_RENDER_WEIGHT


def test_prefix_affinity_reads_the_instructions_then_the_input() -> None:
    from gateway.pick.prompt import prompt_text

    as_string = prompt_text({"instructions": "Rules.", "input": "Hi"})
    as_items = prompt_text({"instructions": "Rules.", "input": [{"role": "user", "content": "Hi"}]})
    assert as_string == as_items == "system\x1fRules.\x1euser\x1fHi\x1e"


async def test_a_sweep_of_agent_sessions_on_the_responses_api(sims, gw, tokenizer_dir) -> None:
    """The load generator speaks the Responses API: sessions whose turns are input items,
    streamed, each turn's usage read from `response.completed`."""
    turns = WorkloadClass(
        name="agent", endpoint="responses", isl=Fixed(value=40), osl=Fixed(value=5),
        session=Session(turns=3),
    )  # fmt: skip
    config = SweepConfig(
        targets=(Target(gw.url, "tiny", str(tokenizer_dir)),),
        workloads=(Workload(name="agent", classes=[turns]),),
        users=(2,),
        requests_per_level=6,
        stream=True,
    )
    result = await run_sweep(config, Progress(live=False))
    records = result.series[0].levels[0][1].records
    assert records and all(r.ok and r.output_tokens == 5 for r in records), records
    assert all(r.ttft_s is not None for r in records)
    await accounted(gw, len(records) - 1)
    assert {line["endpoint"] for line in logged(gw)} == {"responses"}


async def test_a_large_stored_response_is_retrieved_whole(gw) -> None:
    async with client(gw) as sdk:
        made = await sdk.responses.create(
            model="tiny", input=HELLO, max_output_tokens=2000,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        stored = await sdk.responses.retrieve(made.id)
    assert len(made.output_text) >= 8000
    assert stored.output_text == made.output_text


# --- behind two gateways that share state through a real `redis-server`: a conversation's turns
# alternate between them, as a load balancer without affinity sends them ---------------------

KEYS = {name: f"key-{name}-0123456789" for name in ("alice", "bob")}


def shared_policy(tokenizer_dir: Path, replicas: list[str], server: RedisServer) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, replicas)
    policy["state"] = {"backend": "redis", "url": server.url, "timeout_s": 0.3, "gateways": 2}
    policy["tenants"] = {
        name: {"keys": [f"sha256:{hashlib.sha256(key.encode()).hexdigest()}"]}
        for name, key in KEYS.items()
    }
    return policy


def holders(server: RedisServer) -> dict[str, list[Any]]:
    """Every holder record in Redis, by response id."""
    db = redis.Redis(port=server.port)
    return {k.decode()[7:]: orjson.loads(db.get(k)) for k in db.scan_iter("holder:*")}


@pytest.fixture
async def pair(sims, fresh_redis, gateway_factory, tokenizer_dir) -> tuple[Any, Any]:
    """Two gateways in front of the same replicas, sharing state through Redis."""
    policy = shared_policy(tokenizer_dir, [r.url for r in sims], fresh_redis)
    return await gateway_factory(policy), await gateway_factory(policy)


async def test_a_conversation_alternating_gateways_stays_on_the_replica_that_stores_it(
    pair, fresh_redis
) -> None:
    first_gw, second_gw = pair
    async with client(first_gw, KEYS["alice"]) as one, client(second_gw, KEYS["alice"]) as two:
        turns = [await one.responses.create(model="tiny", input=HELLO, max_output_tokens=3)]
        for sdk in (two, one, two, one):
            turns.append(
                await sdk.responses.create(
                    model="tiny", input="and then?", previous_response_id=turns[-1].id,
                    max_output_tokens=3,
                )
            )  # fmt: skip
        stored = await two.responses.retrieve(turns[0].id)  # made by the first gateway
    assert stored.id == turns[0].id and stored.output_text == turns[0].output_text
    await accounted(first_gw, 2)  # turns 0, 2 and 4
    await accounted(second_gw, 1)  # turns 1 and 3
    lines = logged(first_gw) + logged(second_gw)
    assert len(lines) == len(turns)
    assert len({line["replica"] for line in lines}) == 1  # never the other replica
    # Each gateway counted the stored turns it continued, whichever recorded them, exactly.
    counted = sorted(line["input_tokens"] for line in lines)  # a chain's counts only grow
    assert counted == [turn.usage.input_tokens for turn in turns if turn.usage is not None]
    recorded = holders(fresh_redis)
    assert set(recorded) == {turn.id for turn in turns}
    assert {tuple(v[:3]) for v in recorded.values()} == {("alice", "main", lines[0]["replica"])}


async def test_another_tenant_and_an_id_no_gateway_made_are_not_found(pair, fresh_redis) -> None:
    first_gw, second_gw = pair
    async with client(first_gw, KEYS["alice"]) as alice, client(second_gw, KEYS["bob"]) as bob:
        mine = await alice.responses.create(model="tiny", input=HELLO, max_output_tokens=2)
        # A record that is not a gateway's (another version, or written by hand) is no record.
        redis.Redis(port=fresh_redis.port).set(f"holder:resp_{'0' * 32}", b"not json")
        for call in (
            bob.responses.retrieve(mine.id),
            bob.responses.create(model="tiny", input="x", previous_response_id=mine.id),
            bob.responses.create(model="tiny", input="x", previous_response_id=f"resp_{'0' * 32}"),
            bob.responses.retrieve("holder:*"),
        ):
            with pytest.raises(openai.NotFoundError) as caught:
                await call
            assert caught.value.code == "response_not_found"
    await accounted(second_gw, 0)


async def test_redis_down_each_gateway_still_knows_its_own(pair, fresh_redis) -> None:
    first_gw, second_gw = pair
    async with client(first_gw, KEYS["alice"]) as one, client(second_gw, KEYS["alice"]) as two:
        made = await one.responses.create(model="tiny", input=HELLO, max_output_tokens=2)
        fresh_redis.stop()
        with pytest.raises(openai.NotFoundError):  # the second never saw it, and cannot ask
            await two.responses.retrieve(made.id)
        turn = await one.responses.create(
            model="tiny", input="more", previous_response_id=made.id, max_output_tokens=2
        )
        assert (await one.responses.retrieve(turn.id)).id == turn.id
        fresh_redis.start()  # empty: what Redis had is gone, what each gateway recorded is not
        assert (await one.responses.retrieve(made.id)).id == made.id
        with pytest.raises(openai.NotFoundError):
            await two.responses.retrieve(turn.id)


async def test_a_record_lives_its_ttl_from_its_last_use(redis_server: RedisServer) -> None:
    shared = RedisState(redis_server.url, holder_ttl_s=0.5)
    record = FailoverState(shared, on_failure="closed", gateways=2)
    held = Holder("alice", "main", "http://127.0.0.1:9", ({"role": "user", "content": "hi"},), 3)
    try:
        await shared.client.flushdb()
        await record.record("resp_a", held)
        for _ in range(3):  # read within its TTL, it lives on
            await asyncio.sleep(0.3)
            assert await record.holder("resp_a") == held
        await asyncio.sleep(0.7)
        assert await record.holder("resp_a") is None
        await record.record("resp_b", held)
        await record.forget("resp_b")
        assert await record.holder("resp_b") is None
    finally:
        await record.close()
