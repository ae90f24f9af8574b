"""Promise C against real vLLM, on the adversary's own request shapes (issue 35).

The adversary (`loadtest/adversary/`) checks the count promise against a scripted replica that
counts prompts with a reimplementation of vLLM's rendering (`count.py`); this is the sample that
checks it against vLLM itself. A seeded sample of the generator's bodies (its shape functions,
drawn for the one tiny model) goes through the gateway to the session's vLLM: chat (system
prompts, earlier turns, text parts, tools, `n`, bounds present or not, `ignore_eos`,
`min_tokens`, streams with and without usage), completions (text and token ids), Anthropic
Messages (a system prompt as a string and as blocks, several turns), single Responses and
Responses chains continued by `previous_response_id` over vLLM's real outputs.

For every 200, the access log's `input_tokens` must equal vLLM's usage (`prompt_tokens`, or
`input_tokens`) in the answer; a stream that carried no usage to the client is sent to vLLM
directly once more, whole and with one output token, for vLLM's count. For every 400 the gateway
answers, the same body sent to vLLM directly must draw vLLM's 400 too: the gateway refuses
nothing vLLM would serve. A fixed seed and a fresh one, each printed (`pytest -s`) and in the
test's id; a failure lists each request with its body and both counts.

Outputs stay short so the sample runs in a minute or two on a small CPU: the shapes' long bounds
are cut to 64 tokens (`Generator(longest_output=...)`), and a request with no bound gets the
model's `default_output_tokens` from the gateway, as any request of a tenant with a TPM window
does. This vLLM has no tool-call parser, so `tools` go with `tool_choice: "none"` (rendered
still; "auto" would be vLLM's 400). Embeddings need vLLM started as an embedding model: they are
tests_vllm/test_embeddings.py's, each input form counted exactly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.request.authenticate import key_entry
from loadtest.adversary.generator import ENDPOINT_PATHS, Generator, Planned, fresh_seed
from loadtest.vllm_server import SERVED_NAME, VLLMServer
from tests_vllm.conftest import eventually, vllm_policy

TENANT, KEY = "adversary", "adversary-sample-key"
LONGEST_OUTPUT = 64
SINGLES = {"chat": 7, "messages": 6, "responses": 2}  # per seed
COMPLETIONS = {"text": 4, "ids": 3}
CHAINS = 3  # of 2-4 turns each
CONCURRENCY = 4
BOUNDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass
class Sent:
    """One request of the sample and what became of it."""

    planned: Planned
    body: dict[str, Any]
    status: int = 0
    answer: bytes = b""
    vllm_counts: set[int] = field(default_factory=set)
    vllm_status: int | None = None  # the same body sent to vLLM directly, when it was
    response_id: str | None = None

    @property
    def shape(self) -> str:
        if self.planned.endpoint == "completions":
            return "completions-ids" if isinstance(self.body["prompt"], list) else "completions"
        if self.planned.endpoint == "responses" and "previous_response_id" in self.body:
            return "responses-chained"
        return self.planned.endpoint

    def show(self, counted: int | None) -> str:
        direct = "" if self.vllm_status is None else f", sent to vLLM directly: {self.vllm_status}"
        return (
            f"{self.planned.nonce} {self.shape}: gateway {self.status}, counted {counted},"
            f" vLLM's count {sorted(self.vllm_counts)}{direct}\n"
            f"  body {orjson.dumps(self.body).decode()}\n  answer {self.answer[:300]!r}"
        )


def sample(seed: int) -> list[list[Sent]]:
    """The seed's requests, in units sent one after another (a chain's turns), the units
    concurrently."""
    gen = Generator(seed, [SERVED_NAME], [TENANT], 1, longest_output=LONGEST_OUTPUT)
    units = [[gen.request(e)] for e, n in SINGLES.items() for _ in range(n)]
    wanted = dict(COMPLETIONS)
    for _ in range(200):  # token ids are a quarter of the shape's draws
        p = gen.request("completions")
        kind = "ids" if isinstance(p.body["prompt"], list) else "text"
        if wanted[kind]:
            wanted[kind] -= 1
            units.append([p])
    assert not any(wanted.values()), wanted
    units += [gen.move("chain").requests for _ in range(CHAINS)]
    return [[Sent(p, _as_sent(p.body)) for p in unit] for unit in units]


def _as_sent(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    if "tools" in out:
        out["tool_choice"] = "none"
    return out


def _events(raw: bytes) -> list[dict[str, Any]]:
    if raw.lstrip().startswith(b"{"):
        return [orjson.loads(raw)]
    return [
        orjson.loads(line[len(b"data: ") :])
        for line in raw.splitlines()
        if line.startswith(b"data: {")
    ]


def reported(raw: bytes) -> tuple[set[int], str | None]:
    """The prompt counts an answer of vLLM's states, whole or streamed (a chat chunk's or an
    Anthropic `message_delta`'s `usage`, `message_start`'s `message.usage`, a Responses terminal
    event's `response.usage`): one, unless its events disagree. And a Responses answer's id."""
    counts: set[int] = set()
    response_id = None
    for event in _events(raw):
        for holder in (event, event.get("response"), event.get("message")):
            if not isinstance(holder, dict):
                continue
            usage = holder.get("usage")
            if isinstance(usage, dict):
                count = usage.get("prompt_tokens", usage.get("input_tokens"))
                if isinstance(count, int) and count > 0:
                    counts.add(count)
            if holder.get("object") == "response" and response_id is None:
                response_id = holder.get("id")
    return counts, response_id


def whole_with_one_token(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The same request unstreamed, producing one token: its answer's usage is vLLM's count of
    the prompt, which no output field changes."""
    dropped = (*BOUNDS, "stream", "stream_options", "min_tokens", "n")
    out = {k: v for k, v in body.items() if k not in dropped}
    out["max_output_tokens" if endpoint == "responses" else "max_tokens"] = 1
    return out


async def post(
    http: aiohttp.ClientSession, url: str, sent: Sent, body: dict[str, Any]
) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {KEY}", "x-request-id": sent.planned.nonce}
    async with http.post(
        url + ENDPOINT_PATHS[sent.planned.endpoint], json=body, headers=headers
    ) as resp:
        return resp.status, await resp.read()


async def play(http: aiohttp.ClientSession, gateway: str, vllm: str, unit: list[Sent]) -> None:
    previous: str | None = None
    for sent in unit:
        if sent.planned.after is not None:
            if previous is None:
                return  # the turn it continues was refused: nothing to chain
            sent.body["previous_response_id"] = previous
        sent.status, sent.answer = await post(http, gateway, sent, sent.body)
        if sent.status == 200:
            sent.vllm_counts, sent.response_id = reported(sent.answer)
            if not sent.vllm_counts:  # a stream that carried no usage
                direct = whole_with_one_token(sent.body, sent.planned.endpoint)
                sent.vllm_status, answer = await post(http, vllm, sent, direct)
                sent.vllm_counts = reported(answer)[0] if sent.vllm_status == 200 else set()
        elif sent.status == 400:
            sent.vllm_status, _ = await post(http, vllm, sent, sent.body)
        previous = sent.response_id


@pytest.mark.parametrize("seed", [35, fresh_seed()], ids=lambda seed: f"seed{seed}")
async def test_the_adversarys_shapes_are_counted_as_vllm_counts_them(
    seed: int, vllm: VLLMServer, gateway_factory
) -> None:
    print(f"adversary sample seed {seed}")
    policy = vllm_policy(vllm)
    policy["models"][SERVED_NAME]["default_output_tokens"] = LONGEST_OUTPUT
    policy["tenants"] = {TENANT: {"keys": [key_entry(KEY)], "tpm": 100_000_000}}
    gw = await gateway_factory(policy)
    units = sample(seed)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(unit: list[Sent]) -> None:
        async with gate:
            await play(http, gw.url, vllm.url, unit)

    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        await asyncio.gather(*(one(unit) for unit in units))
    sent = [s for unit in units for s in unit if s.status]
    served = [s for s in sent if s.status == 200]

    def logged() -> dict[str, int]:
        lines = map(orjson.loads, gw.access_log.getvalue().splitlines())
        return {line["request_id"]: line["input_tokens"] for line in lines}

    await eventually(lambda: {s.planned.nonce for s in served} <= logged().keys(), 30)
    counted = logged()
    problems = [
        s.show(counted.get(s.planned.nonce))
        for s in sent
        if (s.status == 200 and {counted[s.planned.nonce]} != s.vllm_counts)
        or (s.status == 400 and s.vllm_status != 400)
        or s.status not in (200, 400)
    ]
    shapes = sorted({s.shape for s in served})
    print(f"seed {seed}: {len(sent)} sent, {len(served)} served: {shapes}")
    for s in sent:
        if s.status != 200:
            print(f"  refused: {s.planned.nonce} {s.shape} {s.status} {s.answer[:200]!r}")
    assert not problems, f"seed {seed}:\n" + "\n".join(problems)
    assert shapes == sorted(
        ("chat", "completions", "completions-ids", "messages", "responses", "responses-chained")
    ), (seed, shapes)
