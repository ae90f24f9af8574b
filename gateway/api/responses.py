"""`POST /v1/responses`: OpenAI's Responses API, counted as vLLM 0.32 serves it.

vLLM turns a responses request into chat messages (vllm/entrypoints/openai/responses/utils.py
`construct_input_messages`: `instructions` as a system message, a string `input` as the user's
message, each input item as the message it stands for, tool calls merged into the assistant
message before them) and its tools into chat function tools (`construct_tool_dicts`: namespace
functions flattened to `<namespace>__<name>`, custom tools as a one-string function, built-in
tools dropped), then renders them with the model's chat template (`add_generation_prompt`
unless the last item is an unfinished message, which is continued; `reasoning.effort` as the
template's `reasoning_effort`). `to_chat` is that conversion, and the chat's own counting
(gateway/api/chat.py) renders and counts it, so the count is vLLM's.

A request that continues a stored response (`previous_response_id`) is also the conversation the
replica holds: the gateway sends it to that replica and renders the stored turns with its own
input (gateway/request/holders.py keeps them; `Continued` carries them to the count). `background` is
refused: its generation outlives the request, so no slot could be held for it. The answer's
usage is `usage.input_tokens` and `output_tokens`, in a stream on the terminal
`response.completed` (or `.incomplete`, `.failed`) event; refusals are OpenAI's error shape, a
broken stream ends with an `error` event.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

import orjson

from gateway.api.chat import REASONING_EFFORTS, check_chat
from gateway.api.fields import lax_int
from gateway.api.openai import OpenAIApi
from gateway.api.usage import read_usage
from gateway.context.endpoint import FINGERPRINT_CHARS, SAMPLE_TEXT
from gateway.errors import BadRequest
from gateway.tokenizer.chat_template import essentials, lax_bool, message_text

if TYPE_CHECKING:
    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx
    from gateway.errors import GatewayError
    from gateway.tokenizer.counters import TokenCounter

# `custom_tool_parameters`: the one-string function a custom tool is shown to the model as.
_CUSTOM_INPUT = "input"
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {
        _CUSTOM_INPUT: {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": [_CUSTOM_INPUT],
    "additionalProperties": False,
}
_UNFINISHED = ("in_progress", "incomplete")
_OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output")
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
# A stored response's output text the gateway keeps for the turns that continue it: past this
# (about a quarter of a million tokens), it counts them by the replica's `output_tokens`
# (`kept_conversation`).
_KEPT_OUTPUT_CHARS = 1 << 20
_DECODED_ANSWER_BYTES = 2 * _KEPT_OUTPUT_CHARS
_KEPT_OUTPUT_PARTS = 256  # vLLM writes one text part per output message
_KEPT_BYTES_PER_TOKEN = 16  # a stored conversation's JSON, per token of the model's context


def _refuse(param: str, message: str) -> BadRequest:
    return BadRequest(f"'{param}' {message}", param=param, code="invalid_type")


def _string(item: dict[str, Any], field: str, where: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise _refuse(f"{where}.{field}", "is required and must be a string")
    return value


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A `function_call` or `custom_tool_call` item as the chat tool call vLLM makes of it."""
    name = _string(item, "name", where)
    if item["type"] == "function_call":
        namespace = item.get("namespace")
        if namespace:
            name = f"{namespace}__{name}"
        arguments = _string(item, "arguments", where)
    else:
        payload = item.get("input") or ""
        arguments = json.dumps({_CUSTOM_INPUT: payload}, ensure_ascii=False)
    call_id = _string(item, "call_id", where)
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content's first, else its summary's first."""
    if item.get("encrypted_content"):
        raise BadRequest("Encrypted content is not supported.", param="input")
    for field in ("content", "summary"):
        parts = item.get(field)
        if isinstance(parts, list) and parts:
            first = parts[0]
            if not isinstance(first, dict) or not isinstance(first.get("text"), str):
                raise _refuse(f"{where}.{field}[0].text", "is required and must be a string")
            return str(first["text"])
    if not isinstance(item.get("summary"), list):
        raise BadRequest("Unsupported input item type: reasoning", param="input")
    return ""


def _assistant_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _merge(messages: list[dict[str, Any]], field: str, value: Any) -> bool:
    """Put `value` in the previous assistant message's `field` if it has none yet (vLLM's
    `_construct_message_from_response_item`); whether it went there."""
    previous = messages[-1] if messages else None
    if previous is None or previous.get("role") != "assistant":
        return False
    if field == "tool_calls":
        previous.setdefault("tool_calls", []).append(value)
        return True
    if previous.get(field) is None:
        previous[field] = value
        return True
    return False


def _item_message(item: Any, index: int, messages: list[dict[str, Any]]) -> None:
    """Append the chat message one input item stands for, or merge it into the one before."""
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise _refuse(where, "must be an object")
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item, where)
        if not _merge(messages, "tool_calls", call):
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "reasoning":
        text = _reasoning(item, where)
        if not _merge(messages, "reasoning", text):
            messages.append({"role": "assistant", "reasoning": text})
    elif kind in _OUTPUT_ITEMS:
        messages.append(
            {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
        )
    elif (
        item.get("role") == "assistant"
        and (said := _assistant_text(item.get("content"))) is not None
    ):
        if not _merge(messages, "content", said):
            messages.append({"role": "assistant", "content": said})
    elif "role" in item:
        messages.append(dict(item))  # a copy: merging items after it must not change the body
    else:
        raise BadRequest(f"Unsupported input item type: {kind}", param="input")


def _function(tool: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _refuse(f"{where}.parameters", "must be an object")
    function = {"name": name, "description": tool.get("description"), "parameters": parameters}
    for flag in ("strict", "defer_loading"):
        if tool.get(flag) is not None:
            function[flag] = lax_bool(tool[flag], f"{where}.{flag}", False)
    return {"type": "function", "function": function}


def _chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """`construct_tool_dicts`: the function tools the template is shown, in request order."""
    out = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise _refuse(f"{where}.type", "is required and must be a string")
        kind = tool["type"]
        if kind == "function":
            out.append(_function(tool, _string(tool, "name", where), where))
        elif kind == "namespace":
            namespace = _string(tool, "name", where)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise _refuse(f"{where}.tools", "is required and must be an array")
            for number, function in enumerate(inner):
                at = f"{where}.tools[{number}]"
                if isinstance(function, dict) and function.get("type") == "function":
                    name = f"{namespace}__{_string(function, 'name', at)}"
                    out.append(_function(function, name, at))
        elif kind == "custom":
            custom = {**tool, "parameters": _CUSTOM_PARAMETERS}
            out.append(_function(custom, _string(tool, "name", where), where))
    return out


def _continues(items: Any) -> bool:
    """`should_continue_final_message`: the last item is an unfinished assistant message."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and (
        last.get("status") in _UNFINISHED
    )


def _input_messages(items: Any) -> list[dict[str, Any]]:
    """The messages a request's own `input` stands for (merging looks only at its items)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _refuse("input", "is required and must be a string or an array of items")
    turn: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        _item_message(item, index, turn)
    return turn


class Continued(dict[str, Any]):
    """A request body that continues a stored response, as the gateway counts it: the body
    itself (what goes upstream) and the stored turns the replica renders before its input
    (`turns`, gateway/request/holders.py). Only the gateway makes one: a client's JSON cannot."""

    __slots__ = ("turns",)

    def __init__(self, body: dict[str, Any], turns: tuple[dict[str, Any], ...]) -> None:
        super().__init__(body)
        self.turns = turns


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request vLLM renders for a responses request (its shape is checked on the way:
    a 400 for what vLLM refuses): `instructions`, the stored turns of the response it
    continues (a `Continued` body's), then its own input (`construct_input_messages`)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _refuse("instructions", "must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(body, Continued):
        messages += body.turns
    items = body.get("input")
    messages += _input_messages(items)
    continued = _continues(items)
    chat: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": not continued,
        "continue_final_message": continued,
    }
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _refuse("tools", "must be an array of tools")
    if tools and (functions := _chat_tools(tools)):
        chat["tools"] = functions
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise _refuse("reasoning", "must be an object")
    effort = (reasoning or {}).get("effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
            efforts = ", ".join(sorted(REASONING_EFFORTS))
            raise _refuse("reasoning.effort", f"must be one of {efforts}")
        chat["reasoning_effort"] = effort
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    return chat


def output_messages(output: Any) -> list[dict[str, Any]] | None:
    """The assistant messages vLLM makes of a stored response's `output` when a request
    continues it (`construct_input_messages`): one per content part of each output message, its
    text; reasoning and tool calls are not carried over. None for an output that is not a list
    of items, or whose text is over `_KEPT_OUTPUT_CHARS` (or in over `_KEPT_OUTPUT_PARTS`
    parts)."""
    if not isinstance(output, list):
        return None
    messages = []
    for item in output:
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        parts = item.get("content")
        for part in parts if isinstance(parts, list) else ():
            text = part.get("text") if isinstance(part, dict) else None
            if isinstance(text, str):
                messages.append({"role": "assistant", "content": text})
    if (
        len(messages) > _KEPT_OUTPUT_PARTS
        or sum(len(m["content"]) for m in messages) > _KEPT_OUTPUT_CHARS
    ):
        return None
    return messages


def answer_output(ctx: Ctx) -> Any:
    """A stored response's `output` items: a stream's terminal event left them in
    `ctx.output`; a whole answer (its bytes held for the accounting's usage) is decoded here,
    when it is at most `_DECODED_ANSWER_BYTES`: a larger one would hold the event loop."""
    if ctx.output is not None or ctx.unread_usage is None:
        return ctx.output
    data = ctx.unread_usage[0]
    if len(data) > _DECODED_ANSWER_BYTES:
        return None
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return answer.get("output") if isinstance(answer, dict) else None


def _output_tokens(ctx: Ctx) -> int:
    """The answer's output tokens as the replica reported them (within what the request could
    produce), else as the stream relayed them."""
    assert ctx.pool is not None
    read_usage(ctx)  # a whole answer's, otherwise read once it was sent
    tokens = ctx.output_tokens if ctx.output_tokens is not None else ctx.chunks
    return max(0, min(tokens, ctx.max_output or ctx.pool.model.spec.max_model_len))


def kept_conversation(ctx: Ctx) -> tuple[tuple[dict[str, Any], ...], int]:
    """The stored turns a request continuing `ctx`'s stored response renders (`stored_turns`),
    and the tokens among them it counts as the replica did instead of rendering them.

    An output whose text is not kept (over the bounds above, or its stream's terminal event
    never read) is one empty assistant message, the template's frame around the text, and its
    output tokens. A conversation whose turns are over `_KEPT_BYTES_PER_TOKEN` bytes a token of
    the context (none that fits the context needs that many; a template that drops what it is
    given, as Qwen 3 drops earlier reasoning, may let more through) is kept as tokens alone:
    this request's count and its output's."""
    said = output_messages(answer_output(ctx))
    unheard = ctx.holder.unheard if ctx.holder is not None else 0
    if said is None:
        said, unheard = [{"role": "assistant", "content": ""}], unheard + _output_tokens(ctx)
    turns = stored_turns(ctx.body, said)
    assert ctx.pool is not None
    if len(orjson.dumps(turns)) > ctx.pool.model.spec.max_model_len * _KEPT_BYTES_PER_TOKEN:
        return (), ctx.input_tokens + _output_tokens(ctx)
    return turns, unheard


def stored_turns(body: dict[str, Any], said: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """What a request that continues this one's stored response renders between its own
    instructions and input: the turns this one continued, its own input and `said`, its
    output's messages. vLLM stores the whole conversation it rendered and leaves its system
    messages out when it continues it (instructions do not carry over)."""
    before = body.turns if isinstance(body, Continued) else ()
    own = [essentials(m) for m in _input_messages(body.get("input")) if m.get("role") != "system"]
    return (*before, *own, *said)


class ResponsesApi(OpenAIApi):
    """OpenAI's Responses API, as vLLM serves it."""

    __slots__ = ()
    name = "responses"
    path = "/v1/responses"
    sample = {"input": SAMPLE_TEXT, "max_output_tokens": 16}
    prompt_param = "input"
    bound_field = "max_output_tokens"
    openai_fields = False
    usage_fields = ("output_tokens", "input_tokens", "input_tokens_details")

    def parse(self, ctx: Ctx, body: dict[str, Any], limits: ServerSpec) -> tuple[int, int | None]:
        """One prompt, bounded by `max_output_tokens`; the conversation it continues, if any."""
        if lax_bool(body.get("background"), "background", False, nullable=True):
            raise BadRequest(
                "background responses are not served through this gateway: their generation"
                " outlives the request, so admission could hold no slot for it",
                param="background",
                code="background_not_supported",
            )
        items = body.get("input")
        if isinstance(items, list) and len(items) > limits.max_messages:
            raise BadRequest(
                f"{len(items)} input items, over the {limits.max_messages} limit",
                param="input",
                code="too_many_messages",
            )
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str) or not previous:
                raise _refuse("previous_response_id", "must be a non-empty string")
            ctx.continues = previous
        chat = to_chat(body)
        if not chat["messages"]:
            raise BadRequest("'input' must not be empty without 'instructions'", param="input")
        ctx.images = check_chat(chat, limits, typed=False)
        if lax_bool(body.get("store", True), "store", True, nullable=True):
            ctx.stores_as = f"resp_{uuid.uuid4().hex}"
        ctx.forced_output = lax_bool(body.get("ignore_eos"), "ignore_eos", False, nullable=True)
        if body.get("max_output_tokens") is None:
            return 1, None
        bound = lax_int(body, "max_output_tokens")
        if bound < 1:
            raise BadRequest("max_output_tokens must be at least 1", param="max_output_tokens")
        return 1, bound

    async def count(
        self, body: dict[str, Any], counter: TokenCounter, refuse_at: int, images: int
    ) -> tuple[int, int]:
        """The chat vLLM converts it to, rendered and counted whole, encoded with the
        tokenizer's special tokens: a responses request's tokenization keeps
        `TokenizeParams`' default `add_special_tokens` (a chat completion's turns it off), so
        a template that prints its BOS gets a second one."""
        extra = counter.specials
        text = extra + await counter.count_chat(body, refuse_at - images - extra, to_chat)
        return images + text, images + text

    async def prompt_ids(
        self, body: dict[str, Any], counter: TokenCounter, special: bool | None = None
    ) -> list[int] | None:
        return await counter.chat_ids(body, special is not False, to_chat)

    def fingerprint(self, body: dict[str, Any]) -> int:
        """The start of the instructions, else of the input."""
        lead = body.get("instructions") or body.get("input")
        if isinstance(lead, list):
            first = lead[0] if lead and isinstance(lead[0], dict) else {}
            lead = message_text(first.get("content"))
        return hash(str(lead)[:FINGERPRINT_CHARS])

    def input_floor(self, ctx: Ctx, counter: TokenCounter) -> int:
        return ctx.images * counter.image_cost

    def upstream_fields(self, ctx: Ctx, changes: dict[str, Any]) -> None:
        """The response's id (vLLM's `request_id`) is always the gateway's (`ctx.stores_as`,
        made at parse): it knows which replica stores what before the answer, and no tenant
        can name, and so overwrite, a response another tenant stored."""
        changes["request_id"] = ctx.stores_as or f"resp_{uuid.uuid4().hex}"

    def usage_event(self, ctx: Ctx, event: dict[str, Any]) -> bool:
        """The terminal event carries the whole response, usage included; the others that
        carry a response (`response.created`, `.in_progress`) have no usage yet. None is only
        usage: none is ever dropped."""
        if event.get("type") in _TERMINAL:
            response = event.get("response")
            if isinstance(response, dict):
                self.read_usage(ctx, response.get("usage"))
                ctx.output = response.get("output")
        return False

    def deltas(self, events: bytes) -> int:
        """Delta events (text, reasoning, tool-call arguments): a token each, near enough."""
        return events.count(b".delta\ndata: ")

    def ended(self, out: bytes) -> bool:
        """The terminal event went out: the client has the whole response."""
        return any(b"event: " + kind.encode() + b"\n" in out for kind in _TERMINAL)

    def stream_error(self, error: GatewayError) -> bytes:
        """The Responses stream's `error` event."""
        event = {"type": "error", "code": error.code, "message": error.message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


RESPONSES = ResponsesApi()
