"""The gateway's own `/tokenize`, `/detokenize`, `/v1/models` and `/version` against real vLLM's
answers for the same input: field by field, token ids equal.

The gateway answers from the model's tokenizer (the model directory vLLM serves); vLLM from its
engine's. Its policy's `max_model_len` is vLLM's here, so the two answers' must agree too."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from loadtest.vllm_server import MAX_MODEL_LEN, SERVED_NAME
from tests_vllm.conftest import vllm_policy

SYSTEM = {"role": "system", "content": "answer in one word"}
USER = {"role": "user", "content": "  the listing review, summarised: é 日本語 🙂  "}
ASSISTANT = {"role": "assistant", "content": "the seller"}
PARTS = {
    "role": "user",
    "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}

TOKENIZE = [
    {"model": SERVED_NAME, "prompt": "the seller wrote the listing"},
    {"model": SERVED_NAME, "prompt": "  é 日本語 🙂\n\n{json} 1,234.5  "},
    {"model": SERVED_NAME, "prompt": "the seller", "add_special_tokens": False},
    {"model": SERVED_NAME, "prompt": "the seller", "return_token_strs": True},
    {"prompt": "no model named: the server's one model"},
    {"model": SERVED_NAME, "messages": [USER]},
    {"model": SERVED_NAME, "messages": [SYSTEM, USER, ASSISTANT, PARTS]},
    {"model": SERVED_NAME, "messages": [SYSTEM, USER], "add_generation_prompt": False},
    {
        "model": SERVED_NAME,
        "messages": [USER, ASSISTANT],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {"model": SERVED_NAME, "messages": [USER], "add_special_tokens": True},
    {"model": SERVED_NAME, "messages": [USER], "return_token_strs": True, "tools": [TOOL]},
]

REFUSED = [  # (path, body): vLLM's status, and its error's fields, are the gateway's
    ("/tokenize", {"model": "no-such-model", "prompt": "x"}),
    ("/detokenize", {"model": "no-such-model", "tokens": [5]}),
    ("/tokenize", {"model": SERVED_NAME, "prompt": 7}),
    ("/tokenize", {"model": SERVED_NAME, "prompt": "x", "add_special_tokens": None}),
    ("/tokenize", {"model": SERVED_NAME, "messages": "hello"}),
    (
        "/tokenize",
        {
            "model": SERVED_NAME,
            "messages": [USER],
            "add_generation_prompt": True,
            "continue_final_message": True,
        },
    ),
    ("/detokenize", {"model": SERVED_NAME, "tokens": [-1]}),
    ("/detokenize", {"model": SERVED_NAME, "tokens": "5 6"}),
]


async def answer(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
) -> tuple[int, Any]:
    async with http.post(f"{url}{path}", json=body) as resp:
        return resp.status, await resp.json()


def policy(server: Any) -> dict[str, Any]:
    spec = vllm_policy(server)
    spec["models"][SERVED_NAME]["max_model_len"] = MAX_MODEL_LEN
    return spec


@pytest.mark.parametrize("body", TOKENIZE)
async def test_tokenize_and_detokenize_answer_as_vllm(vllm, gateway_factory, http, body) -> None:
    gw = await gateway_factory(policy(vllm))
    vllm_status, expected = await answer(http, vllm.url, "/tokenize", body)
    status, got = await answer(http, gw.url, "/tokenize", body)
    assert (status, vllm_status) == (200, 200), (got, expected)
    assert set(got) == set(expected)
    for field in expected:
        assert got[field] == expected[field], field
    back = {"model": SERVED_NAME, "tokens": expected["tokens"]}
    assert await answer(http, gw.url, "/detokenize", back) == await answer(
        http, vllm.url, "/detokenize", back
    )


@pytest.mark.parametrize(("path", "body"), REFUSED)
async def test_refusals_have_vllms_status_and_error_shape(
    vllm, gateway_factory, http, path, body
) -> None:
    gw = await gateway_factory(policy(vllm))
    vllm_status, expected = await answer(http, vllm.url, path, body)
    status, got = await answer(http, gw.url, path, body)
    assert status == vllm_status, (got, expected)
    assert {"message", "type", "code"} <= set(got["error"]) & set(expected["error"])


async def test_model_cards_have_vllms_fields(vllm, gateway_factory, http) -> None:
    gw = await gateway_factory(policy(vllm))
    async with http.get(f"{vllm.url}/v1/models") as resp:
        [expected] = (await resp.json())["data"]
    async with http.get(f"{gw.url}/v1/models") as resp:
        cards = {c["id"]: c for c in (await resp.json())["data"]}
    got = cards[SERVED_NAME]
    assert set(got) == set(expected)
    for field in ("id", "object", "parent", "max_model_len"):
        assert got[field] == expected[field], field
    [permission], [vllm_permission] = got["permission"], expected["permission"]
    assert set(permission) == set(vllm_permission)
    for field in set(permission) - {"id", "created"}:  # both made per answer
        assert permission[field] == vllm_permission[field], field
    # The alias the gateway routes is listed too, as the model it is counted as.
    assert cards["tiny-alias"]["max_model_len"] == expected["max_model_len"]


async def test_version_has_vllms_shape(vllm, gateway_factory, http) -> None:
    gw = await gateway_factory(policy(vllm))
    async with http.get(f"{vllm.url}/version") as resp:
        expected = await resp.json()
    async with http.get(f"{gw.url}/version") as resp:
        got = await resp.json()
    assert set(got) == set(expected) == {"version"}
    assert isinstance(got["version"], str)
