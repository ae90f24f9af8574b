"""Fuzzing: thousands of malformed bodies and headers through a real gateway on loopback.

Every answer must be a 4xx in the OpenAI error shape or the stub replica's own 200 — never a 5xx
from the gateway, never a dropped connection — and each request must leave nothing behind (no
slot, no reserved tokens, no waiter). One gateway serves every example of a test: that is the
point (state that leaks from one request into the next is what fuzzing should find), so
Hypothesis's warning about function-scoped fixtures is silenced on purpose.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.conftest import basic_policy, eventually

MAX_BODY = 64 * 1024
FUZZ = settings(
    max_examples=800,
    deadline=None,  # loopback round trips vary; a slow example is not a failure
    database=None,  # keep runs reproducible from the printed seed, and write nothing to the tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
async def gw(stub, gateway_factory, tokenizer_dir):
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["server"] = {"max_body_bytes": MAX_BODY, "max_prompt_chars": 16_000}
    return await gateway_factory(policy)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)  # past 64 bits, where orjson gives up
    | st.floats(allow_nan=True, allow_infinity=True)  # NaN and Infinity are not JSON
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


DELETE = object()  # a mutation that removes the field


def mutate(body: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A valid body with a few fields replaced by arbitrary JSON, or removed."""
    out = {**body, **changes}
    return {key: value for key, value in out.items() if value is not DELETE}


def mostly(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a well-typed value (five times in six), else any JSON value at all."""
    # `one_of` would treat the repeated branch as one; sampling the strategy keeps the weights.
    return st.sampled_from([good] * 5 + [json_values]).flatmap(lambda chosen: chosen)


text_part = st.fixed_dictionaries({"type": mostly(st.just("text")), "text": mostly(st.text())})
message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "user", "assistant"]))},
    optional={"content": mostly(st.text(max_size=200) | st.lists(mostly(text_part), max_size=3))},
)
common = {
    "max_tokens": st.integers(min_value=1, max_value=9000),
    "n": st.integers(min_value=1, max_value=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
models = st.sampled_from(["tiny", "tiny-alias"])
valid_chat = st.fixed_dictionaries(
    {"model": models, "messages": st.lists(mostly(message), min_size=1, max_size=3)},
    optional={
        **common,
        "max_completion_tokens": st.integers(min_value=1, max_value=9000),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
    },
)
CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
    "add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs",
]  # fmt: skip
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "n", "stream", "stream_options"]


def mutations(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(fields), json_values | st.just(DELETE), max_size=2)


chat_body = st.builds(mutate, valid_chat, mutations(CHAT_FIELDS))
token_ids = st.lists(st.integers(min_value=-5, max_value=2**40), min_size=1, max_size=20)
prompt = st.one_of(
    st.text(max_size=200),
    st.lists(st.text(max_size=50), max_size=3),
    token_ids,
    st.lists(token_ids, min_size=1, max_size=3),
)
valid_completion = st.fixed_dictionaries({"model": models, "prompt": prompt}, optional=common)
completion_body = st.builds(mutate, valid_completion, mutations(COMPLETION_FIELDS))


def encode(value: Any) -> bytes:
    # The stdlib writes what orjson would refuse to (NaN, 2**70), which is the point.
    return json.dumps(value, ensure_ascii=False).encode()


def nested(depth: int) -> bytes:
    return b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def huge(chars: int) -> bytes:
    return encode({"model": "tiny", "messages": [{"role": "user", "content": "word " * chars}]})


def spliced(body: bytes, junk: bytes, at: int) -> bytes:
    """`junk` (invalid UTF-8, control bytes, anything) put inside an otherwise plausible body."""
    at %= len(body) + 1
    return body[:at] + junk + body[at:]


raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.integers(min_value=1, max_value=1500).map(nested),
    st.integers(min_value=1, max_value=MAX_BODY // 5 - 40).map(huge),
    st.builds(
        spliced,
        st.sampled_from(
            [encode({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})]
        ),
        st.binary(min_size=1, max_size=8),
        st.integers(min_value=0),
    ),
    json_values.map(encode),
)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
content_types = st.one_of(
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-8",
            "text/plain",
            "",
            "APPLICATION/JSON",
        ]
    ),
    header_text,
)


async def check(gw, http, endpoint: str, body: bytes, headers: dict[str, str]) -> None:
    """One request: a 4xx in the OpenAI shape or a 200, and afterwards nothing held."""
    async with http.post(f"{gw.url}/v1/{endpoint}", data=body, headers=headers) as resp:
        answer = await resp.read()
        assert resp.status == 200 or 400 <= resp.status < 500, (resp.status, answer[:300])
        if resp.status == 200:
            event("200")  # --hypothesis-show-statistics shows the mix of answers reached
        else:
            error = json.loads(answer)["error"]
            assert error["message"] and error["type"] and error["code"]
            event(f"{resp.status} {error['code']}")
    await eventually(lambda: gw.inflight() == 0 and gw.inflight_tokens() == 0 and gw.waiting() == 0)


@FUZZ
@given(body=chat_body)
async def test_chat_bodies(gw, http, body) -> None:
    await check(gw, http, "chat/completions", encode(body), {"Content-Type": "application/json"})


@FUZZ
@given(body=completion_body)
async def test_completion_bodies(gw, http, body) -> None:
    await check(gw, http, "completions", encode(body), {"Content-Type": "application/json"})


@FUZZ
@given(endpoint=st.sampled_from(["chat/completions", "completions"]), body=raw_bodies)
async def test_raw_bodies(gw, http, endpoint, body) -> None:
    await check(gw, http, endpoint, body, {"Content-Type": "application/json"})


@FUZZ
@given(
    priority=st.none() | st.sampled_from(["critical", "standard", "sheddable"]) | header_text,
    request_id=st.none() | header_text,
    content_type=content_types,
)
async def test_headers(gw, http, priority, request_id, content_type) -> None:
    headers = {"Content-Type": content_type}
    if priority is not None:
        headers["x-priority"] = priority
    if request_id is not None:
        headers["x-request-id"] = request_id
    body = encode({"model": "tiny", "messages": [{"role": "user", "content": "hello"}]})
    await check(gw, http, "chat/completions", body, headers)
