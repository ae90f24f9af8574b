"""`POST /v1/chat/completions`: a chat's messages, checked and counted as vLLM renders them.

Parse checks a chat's shape, vLLM's refusals before rendering (a client's chat template, both
`continue_final_message` and `add_generation_prompt`, empty `tools`) in its words, and the size
of everything its template may render (contents, roles, names, tool calls, reasoning, tools,
documents, template variables: all in `max_prompt_chars`), so no tokenizer ever sees more than
the operator allowed. Counting renders the whole chat with the model's own template
(gateway/tokenizer/). Which message type each message validates as is gateway/api/message_types.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.api.fields import check_prompt_chars, positive_int, text_chars
from gateway.api.message_types import check_message_type
from gateway.api.openai import OpenAIApi
from gateway.context.endpoint import FINGERPRINT_CHARS, SAMPLE_TEXT
from gateway.errors import BadRequest
from gateway.tokenizer.chat_template import extra_fields, lax_bool, message_text, part_kind

if TYPE_CHECKING:
    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx
    from gateway.tokenizer.counters import TokenCounter

# vLLM takes any role, and templates print it in every turn's header: OpenAI's longest is 9
# characters ("assistant"), custom ones (critic, environment, ipython) stay far below 64.
MAX_ROLE_CHARS = 64
# `reasoning_effort` values vLLM's field accepts (a template may read them).
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
_UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set."
    " Refused request with untrusted chat template."
)


def _content_chars(content: Any, index: int) -> tuple[int, int]:
    """Characters and image parts of one message's content; its shape is checked on the way.

    Every part is classified as vLLM classifies it (gateway/tokenizer/chat_template.py `part_kind`): the
    text of text-like parts and any field an "openai" template gets counts; images are counted
    apart and charged at the model's `image_tokens` by tokenize (their URLs are no prompt)."""
    param = f"messages[{index}].content"
    if content is None:
        return 0, 0
    if isinstance(content, str):
        return len(content), 0
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or an array of parts", param=param)
    chars = images = 0
    for part in content:
        try:
            kind, value = part_kind(part)
        except BadRequest as exc:
            raise BadRequest(exc.message, param=param) from None
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"{param} parts' text must be a string", param=param)
        images += kind == "image"
        chars += len(value or "") + text_chars(extra_fields(part))
    return chars, images


_TEMPLATE_FLAGS = (("add_generation_prompt", True), ("continue_final_message", False))
# The fields besides role, content and tool calls a template may render (gateway/tokenizer/chat_template.py).
_TEXT_FIELDS = ("name", "tool_call_id", "reasoning", "reasoning_content", "task")


def _message_chars(message: Any, index: int, typed: bool) -> tuple[int, int]:
    """Characters a template may render of one message, and its images; bounded and checked
    (against the message types of vLLM's chat request model when `typed`)."""
    param = f"messages[{index}]"
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str):
        raise BadRequest(f"{param} must be an object with a string 'role'", param=param)
    if len(role) > MAX_ROLE_CHARS:
        raise BadRequest(
            f"{param}.role is over {MAX_ROLE_CHARS} characters",
            param=f"{param}.role",
            code="role_too_long",
        )
    calls = message.get("tool_calls")
    if isinstance(calls, str | dict):  # vLLM's request model lists any iterable but a list
        calls = message["tool_calls"] = list(calls)
    if typed:
        check_message_type(message, index)  # tool calls included, where vLLM reads them
    chars, images = _content_chars(message.get("content"), index)
    for field in _TEXT_FIELDS:  # of any type: vLLM prints only strings, and only some
        chars += text_chars(message.get(field))
    return len(role) + chars + text_chars(calls) + text_chars(message.get("tools")), images


def _check_tools(tools: Any, choice: Any) -> None:
    """vLLM's refusals of `tools` and `tool_choice` (`check_tool_usage`,
    `ChatCompletionToolsParam`)."""
    if tools is not None:
        _check_tool_list(tools)
    if choice is None or choice == "none":
        return
    if tools is None:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if not isinstance(choice, dict):
        if choice in ("auto", "required"):
            return
        raise BadRequest(
            f"Invalid value for `tool_choice`: {str(choice)[:100]}! Only named tools, "
            '"none", "auto" or "required" are supported.',
            param="tool_choice",
        )
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise BadRequest(
            "`tool_choice` must name a function: "
            '{"type": "function", "function": {"name": "my_function"}}',
            param="tool_choice.function.name",
        )
    if all(tool["function"]["name"] != name for tool in tools):
        raise BadRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )


def _optional_bool(value: Any) -> bool:
    try:
        lax_bool(value, "", False, nullable=True)
    except BadRequest:
        return False
    return True


def _function_tool(tool: Any) -> bool:
    """Whether `tool` validates as vLLM's `ChatCompletionToolsParam`."""
    function = tool.get("function") if isinstance(tool, dict) else None
    return (
        isinstance(function, dict)
        and tool.get("type", "function") == "function"
        and _optional_bool(tool.get("defer_loading"))
        and isinstance(function.get("name"), str)
        and isinstance(function.get("description", ""), str | None)
        and isinstance(function.get("parameters", {}), dict | None)
        and all(_optional_bool(function.get(key)) for key in ("strict", "defer_loading"))
    )


def _check_tool_list(tools: Any) -> None:
    if tools == []:
        raise BadRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit the"
            " field entirely.",
            param="tools",
        )
    if not isinstance(tools, list) or not all(map(_function_tool, tools)):
        raise BadRequest(
            "'tools' must be an array of function tools, each with a string 'function.name' (and"
            " a string description, an object of parameters, boolean strict and defer_loading)",
            param="tools",
            code="invalid_type",
        )


def check_message_list(body: dict[str, Any], limits: ServerSpec) -> list[Any]:
    """A body's `messages`: a non-empty array within `max_messages`, or a 400."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    if len(messages) > limits.max_messages:
        raise BadRequest(
            f"{len(messages)} messages, over the {limits.max_messages} limit",
            param="messages",
            code="too_many_messages",
        )
    return messages


def check_chat(body: dict[str, Any], limits: ServerSpec, typed: bool = True) -> int:
    """Check a chat's shape, vLLM's refusals and the size of everything its template may render
    (messages, tools, documents, template variables, all in `max_prompt_chars`) before anything
    is rendered; return its image parts. `typed`: each message validates as one of the chat
    request model's message types (a chat vLLM builds itself, as from a responses request,
    passes through no such model)."""
    messages = check_message_list(body, limits)
    parts = sum(
        len(content)
        for message in messages
        if isinstance(message, dict) and isinstance(content := message.get("content"), list)
    )
    if parts > limits.max_content_parts:
        raise BadRequest(
            f"{parts} content parts, over the {limits.max_content_parts} limit",
            param="messages",
            code="too_many_parts",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest(
            "'chat_template_kwargs' must be an object",
            param="chat_template_kwargs",
            code="invalid_type",
        )
    if body.get("chat_template") is not None or (kwargs or {}).get("chat_template") is not None:
        raise BadRequest(_UNTRUSTED_TEMPLATE, param="chat_template")
    for name, default in _TEMPLATE_FLAGS:  # pydantic's refusal; the template reads them again
        lax_bool(body.get(name, default), name, default)
    if body.get("continue_final_message") and body.get("add_generation_prompt"):  # as sent
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    effort = body.get("reasoning_effort")
    if effort is not None and (not isinstance(effort, str) or effort not in REASONING_EFFORTS):
        raise BadRequest(
            f"'reasoning_effort' must be one of {', '.join(sorted(REASONING_EFFORTS))}",
            param="reasoning_effort",
        )
    _check_tools(body.get("tools"), body.get("tool_choice"))
    documents = body.get("documents")
    if documents is not None and not isinstance(documents, list):
        raise BadRequest("'documents' must be an array", param="documents", code="invalid_type")
    chars = images = 0
    for index, message in enumerate(messages):
        message_chars, message_images = _message_chars(message, index, typed)
        chars += message_chars
        images += message_images
    chars += text_chars(body.get("tools")) + text_chars(documents) + text_chars(kwargs)
    check_prompt_chars(chars, limits, "messages")
    return images


class ChatApi(OpenAIApi):
    """OpenAI's chat completions, as vLLM serves them."""

    __slots__ = ()
    name = "chat"
    path = "/v1/chat/completions"
    sample = {"messages": [{"role": "user", "content": SAMPLE_TEXT}], "max_tokens": 16}
    prompt_param = "messages"
    bound_field = "max_completion_tokens"
    continuous_usage = True

    def parse(self, ctx: Ctx, body: dict[str, Any], limits: ServerSpec) -> tuple[int, int | None]:
        """One prompt; the output bound is `max_completion_tokens`, else the older `max_tokens`."""
        ctx.images = check_chat(body, limits)
        max_output = positive_int(body, "max_completion_tokens")
        if max_output is None:
            max_output = positive_int(body, "max_tokens")
        return 1, max_output

    async def count(
        self, body: dict[str, Any], counter: TokenCounter, refuse_at: int, images: int
    ) -> tuple[int, int]:
        """The rendered chat, counted whole: its one prompt is its longest."""
        text = await counter.count_chat(body, refuse_at - images)
        return images + text, images + text

    async def prompt_ids(
        self, body: dict[str, Any], counter: TokenCounter, special: bool | None = None
    ) -> list[int] | None:
        return await counter.chat_ids(body, bool(special))

    def fingerprint(self, body: dict[str, Any]) -> int:
        """The start of the first message: a system prompt or a rules block."""
        return hash(message_text(body["messages"][0].get("content"))[:FINGERPRINT_CHARS])

    def input_floor(self, ctx: Ctx, counter: TokenCounter) -> int:
        """The images (each at the model's `image_cost`, which counting adds to the text's
        count); not the text: a template may drop content (Qwen 3 drops earlier turns'
        reasoning) and only the rendered prompt's count is exact."""
        return ctx.images * counter.image_cost


CHAT = ChatApi()
