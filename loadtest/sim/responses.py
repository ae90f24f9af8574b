"""OpenAI's Responses API on a simulated replica, as vLLM 0.32 serves it without tools.

    POST /v1/responses                     a chat (gateway/api/responses.py `to_chat`), streamed
                                           as typed events or answered whole
    GET  /v1/responses/{id}                a stored response
    POST /v1/responses/{id}/cancel         vLLM's 400 for a synchronous one

A replica stores what it answers (vLLM does with `VLLM_ENABLE_RESPONSES_API_STORE=1`), under
the body's `request_id` (vLLM's response id), in memory and bounded: a later request's
`previous_response_id` renders the stored conversation (its messages and its output's text)
before its own input, as vLLM 0.32 does, and any other replica answers 404, as a vLLM that
never saw it does. The stream is vLLM's for a text answer:
`response.created`, `.in_progress`, the output item and content part added, one
`response.output_text.delta` per chunk, their `.done` events, and `response.completed` with
the whole response and its usage.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.api.responses import to_chat
from gateway.errors import BadRequest

if TYPE_CHECKING:
    from loadtest.sim.sequence import Sequence

STORED = 10_000  # responses a replica keeps, the oldest dropped first


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation it rendered (vLLM's `msg_store`)


class ResponseStore:
    """What one replica stored, by response id."""

    def __init__(self) -> None:
        self._held: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        return self._held.get(response_id)

    def put(self, response_id: str, stored: Stored) -> None:
        self._held[response_id] = stored
        while len(self._held) > STORED:
            self._held.popitem(last=False)


def not_found(response_id: str) -> web.Response:
    """vLLM's `_make_not_found_error`."""
    error = {
        "message": f"Response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    return web.json_response({"error": error}, status=404)


def conversation(body: dict[str, Any], previous: Stored | None) -> dict[str, Any]:
    """The chat the request renders to, or a `BadRequest` (vLLM's 400). Continuing `previous`,
    vLLM's `construct_input_messages`: the instructions, then the messages it rendered but
    their system ones, then an assistant message per content part of its output's messages,
    then the request's own input."""
    if not isinstance(body.get("input"), str | list):
        raise BadRequest("input: Field required", param="input")
    chat = to_chat(body)
    if previous is not None:
        carried = [m for m in previous.messages if m.get("role") != "system"]
        carried += [
            {"role": "assistant", "content": part["text"]}
            for item in previous.response["output"]
            if item["type"] == "message"
            for part in item["content"]
        ]
        at = 1 if body.get("instructions") else 0  # after the instructions' system message
        chat["messages"][at:at] = carried
    return chat


def response_object(
    body: dict[str, Any], rid: str, model: str, status: str, text: str, seq: Sequence | None
) -> dict[str, Any]:
    """`ResponsesResponse.from_request`, dumped: the fields a client reads."""
    output = []
    if seq is not None:
        content = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        output.append(
            {"id": f"msg_{rid[5:]}", "type": "message", "role": "assistant",
             "status": "completed", "content": [content]}
        )  # fmt: skip
    usage = None
    if seq is not None:
        usage = {
            "input_tokens": seq.prompt_tokens,
            "input_tokens_details": {"cached_tokens": seq.cached_tokens},
            "output_tokens": seq.generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": seq.prompt_tokens + seq.generated,
        }
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
        "status": status, "output": output, "usage": usage,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "incomplete_details": None if seq is None or seq.finish_reason != "length"
        else {"reason": "max_output_tokens"},
    }  # fmt: skip


class EventWriter:
    """Typed events with their `sequence_number`, as vLLM numbers them."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def opening(event: EventWriter, response: dict[str, Any], item_id: str) -> bytes:
    """Everything before the first delta."""
    message = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress",
               "content": []}  # fmt: skip
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return (
        event("response.created", response=response)
        + event("response.in_progress", response=response)
        + event("response.output_item.added", output_index=0, item=message)
        + event("response.content_part.added", output_index=0, content_index=0, item_id=item_id,
                part=part)
    )  # fmt: skip


def delta(event: EventWriter, item_id: str, text: str) -> bytes:
    return event(
        "response.output_text.delta",
        output_index=0, content_index=0, item_id=item_id, delta=text, logprobs=[],
    )  # fmt: skip


def closing(event: EventWriter, response: dict[str, Any], item_id: str) -> bytes:
    """The `.done` events and `response.completed` with the whole response."""
    item = response["output"][0]
    part = item["content"][0]
    return (
        event("response.output_text.done", output_index=0, content_index=0, item_id=item_id,
              text=part["text"], logprobs=[])
        + event("response.content_part.done", output_index=0, content_index=0, item_id=item_id,
                part=part)
        + event("response.output_item.done", output_index=0, item=item)
        + event("response.completed", response=response)
    )  # fmt: skip


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def stored_handlers(store_of: Callable[[web.Request], ResponseStore]) -> tuple[Handler, Handler]:
    """`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`."""

    async def retrieve(request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["response_id"]
        stored = store_of(request).get(response_id)
        if stored is None:
            return not_found(response_id)
        return web.json_response(stored.response)

    async def cancel(request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["response_id"]
        if store_of(request).get(response_id) is None:
            return not_found(response_id)
        error = {"message": "Cannot cancel a synchronous response.",
                 "type": "invalid_request_error", "param": "response_id", "code": 400}  # fmt: skip
        return web.json_response({"error": error}, status=400)

    return retrieve, cancel


def new_id(body: dict[str, Any]) -> str:
    """vLLM's response id: the body's `request_id`, else its own."""
    given = body.get("request_id")
    return given if isinstance(given, str) and given else f"resp_{uuid.uuid4().hex}"
