"""A chat request rendered to the exact prompt text vLLM 0.32 renders for it.

Counting a chat means encoding this text once, so every rule that changes a character of it is
vLLM's own, read from its source (vllm/renderers/chat_utils.py, vllm/renderers/hf.py,
vllm/entrypoints/openai/chat_completion/protocol.py and renderers/params.py):

- Content parts (chat_utils `_parse_chat_message_content_mm_part`, `MM_PARSER_MAP`,
  `TEXT_PART_TYPES`): `text`, `input_text`, `output_text` (their `text`), `refusal` (its
  `refusal`), `thinking` (its `thinking`) and plain strings are text; `tool_reference` is its
  `name`; image types, or an untyped part (or one with a `uuid`) carrying an image key, are
  images; other media are the replica's. A part of no known type is refused as vLLM refuses it.
- Content format (hf `_detect_content_format`): a template whose jinja AST loops over a
  message's content is "openai": it gets parts, text as `{"type": "text", "text": ...}` and each
  image as `{"type": "image"}`, with the part's unknown fields (`_collect_extra_fields`); string
  content becomes one text part. Any other template ("string") gets the non-empty texts joined
  with newlines and no image (vLLM adds the image's placeholder itself, which the counter charges
  inside the image's cost).
- Message fields (`_parse_chat_message_content`): only `role` and `content`, an assistant's
  `tool_calls` and `reasoning` (or the deprecated `reasoning_content`, renamed by the request's
  before-validator; handed over under both names), a tool's `tool_call_id`, a string `name` or
  `task`, and a developer's `tools` reach the template. A system message loses a leading Claude
  Code billing header line; a tool message's all-text parts are joined to a string.
- Tool calls (`_postprocess_messages`): an empty list is dropped; the arguments JSON string is
  parsed into the dict templates expect (invalid JSON, or JSON that is not an object, as `{}`).
- Developer role (hf `_detect_developer_role_support`): a template that never names
  "developer" gets developer messages as system ones (their tools dropped), all system messages
  merged into the first (`_consolidate_system_messages`).
- Tools (protocol `ChatCompletionToolsParam`/`FunctionDefinition` `model_dump`): exactly
  `type`, `function` {`name`, `description`, `parameters`, and `strict`/`defer_loading` when
  set}, with `defer_loading` when set; a client's other fields are dropped.
- Template variables (protocol `build_chat_params`, params `merge_kwargs`, hf
  `resolve_chat_template_kwargs`): `chat_template_kwargs` under the request's own
  `add_generation_prompt`, `continue_final_message`, `documents` and `reasoning_effort` (which also
  sets `enable_thinking` unless the client did), values `None` or `"auto"` dropped, then only the
  template's own undeclared variables or `apply_chat_template`'s parameters as vLLM's transformers
  has them (`_HF_PARAMS`, fixed: a newer transformers adds parameters vLLM would drop). A client
  never supplies a template: parse refuses one before anything is rendered.

Booleans are read as pydantic reads them for vLLM's fields (`lax_bool`), so `"false"` is false.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gateway.errors import BadRequest

# vLLM's part types (chat_utils `MM_PARSER_MAP`) by what they hand the template.
_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIPPED_WHEN_NONE = ("text", "refusal")  # `PART_TYPES_TO_SKIP_NONE_CONTENT`
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image_pil", "image_embeds"})
_MEDIA_PART_TYPES = frozenset(
    {"audio_url", "input_audio", "video_url", "audio_embeds", "video_embeds", "prompt_embeds"}
)
_PART_TYPES = frozenset(_TEXT_KEYS) | IMAGE_PART_TYPES | _MEDIA_PART_TYPES | {"tool_reference"}
# An untyped part (or one with a `uuid`) is classified by the first of these keys it carries.
_UNTYPED_KEYS = (
    ("image_url", "image"),
    ("image_pil", "image"),
    ("image_embeds", "image"),
    ("audio_embeds", "media"),
    ("video_embeds", "media"),
    ("prompt_embeds", "media"),
    ("audio_url", "media"),
    ("input_audio", "media"),
    ("video_url", "media"),
    ("tool_reference", "tool_reference"),
)
# `_KNOWN_CONTENT_PART_FIELDS`: any other field of a part reaches an "openai" template.
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
        "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
        "thinking", "type", "uuid", "video_embeds", "video_url",
    }
)  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"  # `_strip_claude_code_billing_header`
# `apply_chat_template`'s parameters under the transformers vLLM 0.32 pins (5.16-5.19), which
# `resolve_chat_template_kwargs` lets through whether or not the template reads them.
_HF_PARAMS = frozenset(
    {
        "add_generation_prompt", "chat_template", "continue_final_message", "conversation",
        "documents", "max_length", "padding", "return_assistant_tokens_mask", "return_dict",
        "return_tensors", "self", "tokenize", "tokenizer_kwargs", "tools", "truncation",
    }
)  # fmt: skip
_SET_HERE = frozenset({"tools", "chat_template", "tokenize"})  # passed by name, never from kwargs
# What only `apply_chat_template` itself handles (continuing the final message, the assistant
# mask, its own argument checks): a request with any of these is rendered through it; any other
# is rendered by the compiled template directly, with what apply_chat_template would pass it.
_APPLY_ONLY = _HF_PARAMS - {"add_generation_prompt", "documents"}
_UNSET = (None, "auto")  # `merge_kwargs`'s unset values
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_NO_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide"
    " a chat template if the tokenizer does not define one."
)


def lax_bool(value: Any, name: str, default: bool, nullable: bool = False) -> bool:
    """`value` as pydantic's lax mode reads a vLLM `bool` field (`bool | None` when `nullable`,
    `None` then being `default`): booleans, 0 and 1, and the strings true/false, yes/no, on/off,
    t/f, y/n, 1/0 in any case; anything else is refused as pydantic refuses it."""
    if value is None and nullable:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise BadRequest(f"'{name}' must be a boolean", param=name, code="invalid_type")


def part_kind(part: Any) -> tuple[str, Any]:
    """What vLLM makes of one content part: `("text", text or None)`, `("image", None)`,
    `("tool_reference", name)` or `("media", None)`; a part vLLM refuses raises `BadRequest`."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise BadRequest("content parts must be objects or strings", param="messages")
    kind = part.get("type")
    if isinstance(kind, str) and kind in _PART_TYPES and part.get("uuid") is None:
        if kind in _TEXT_KEYS:
            return "text", part.get(_TEXT_KEYS[kind])
        if kind == "tool_reference":
            return kind, part.get("name")
        return ("image" if kind in IMAGE_PART_TYPES else "media"), None
    if kind is None or part.get("uuid") is not None:
        for key, untyped in _UNTYPED_KEYS:
            if key in part:
                return untyped, part.get("name") if untyped == "tool_reference" else None
        raise BadRequest("Missing 'type' field in multimodal part.", param="type")
    if not isinstance(kind, str):
        raise BadRequest("Invalid 'type' field in multimodal part.", param="type")
    supported = ", ".join(sorted(_PART_TYPES))
    raise BadRequest(
        f"Unsupported chat content part type: {kind!r}. Supported types: {supported}.",
        param="type",
    )


def extra_fields(part: Any) -> dict[str, Any]:
    """A part's fields vLLM does not know, which it hands an "openai" template as they are."""
    if not isinstance(part, dict):
        return {}
    return {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}


def message_text(content: Any) -> str:
    """A message's content as a "string"-format template gets it: its non-empty texts joined
    with newlines (the parts parse accepted; anything else is skipped, never raised on)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content if isinstance(content, list) else ():
        try:
            kind, value = part_kind(part)
        except BadRequest:
            continue
        if kind in ("text", "tool_reference") and isinstance(value, str) and value:
            texts.append(value)
    return "\n".join(texts)


def _without_billing_header(parts: Iterable[Any]) -> list[Any]:
    """A system message's parts without Claude Code's per-request attribution line."""
    out = []
    for part in parts:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else part
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _template_part(part: Any, openai: bool) -> Any:
    """One part as the template gets it; None (or "") for what vLLM leaves out."""
    kind, value = part_kind(part)
    if kind == "text":
        if value is None and (isinstance(part, str) or part.get("type") in _SKIPPED_WHEN_NONE):
            return None
        return {"type": "text", "text": value, **extra_fields(part)} if openai else value
    if kind == "tool_reference":
        return {"type": "tool_reference", "name": value} if openai else value
    if kind == "image" and openai:
        return {"type": "image", **extra_fields(part)}
    return None  # media, and images for a "string" template: the replica's placeholders


def _content(role: str, content: Any, openai: bool) -> Any:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    else:
        parts = list(content)
    if role == "system":
        parts = _without_billing_header(parts)
    rendered = [r for r in (_template_part(p, openai) for p in parts) if r]
    if not openai:
        return "\n".join(rendered)
    if role == "tool" and all(r.get("type") == "text" for r in rendered):
        return "\n".join(r["text"] for r in rendered)
    return rendered


def tool_call_function(call: Any) -> dict[str, Any]:
    """A tool call's `function`, or the refusal vLLM gives a call of another shape."""
    if not isinstance(call, dict):
        raise BadRequest("assistant tool_calls entries must be objects.", param="tool_calls")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise BadRequest(
            "chat completions only support assistant tool_calls of type 'function'.",
            param="tool_calls",
        )
    return function


RENDER_CHARS_PER_UNIT = 256


def render_weight(body: dict[str, Any], limit: int) -> int:
    """A bound on the work of rendering a request's chat, in units of about one JSON value: every
    value of the body (a message, a part, a tool, a property of a tool's schema: templates cost
    per value) plus one per `RENDER_CHARS_PER_UNIT` characters of its strings (tool calls'
    arguments are parsed as JSON; texts are copied). Measured on the request as the client sent
    it, whatever the endpoint converts it to before rendering; counting stops a little past
    `limit`, so a huge body costs no more to weigh than a small one. A body continuing a stored
    response carries the stored turns it renders too (`turns`, gateway/api/responses.py
    `Continued`): they weigh as much as the client's own."""
    stack: list[Any] = [body, *getattr(body, "turns", ())]
    weight = 0
    while stack and weight <= limit:
        value = stack.pop()
        weight += 1
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            weight += len(value) // RENDER_CHARS_PER_UNIT
    return weight


def _tool_call(call: Any) -> dict[str, Any]:
    """A tool call with its arguments as a dict, as `_postprocess_messages` leaves it."""
    function = tool_call_function(call)
    arguments = function.get("arguments")
    if arguments and isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
        except ValueError as exc:  # e.g. an integer of more digits than Python converts
            raise BadRequest(f"tool call arguments: {exc}", param="tool_calls") from None
        except RecursionError:  # nested past what Python's parser (and so vLLM's) can read
            raise BadRequest(
                "tool call arguments are nested too deep to parse", param="tool_calls"
            ) from None
    parsed = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": {**function, "arguments": parsed}}


# What `_message` reads of a message: nothing else of it reaches a template.
_MESSAGE_FIELDS = (
    "role", "content", "reasoning", "reasoning_content", "tool_calls", "tool_call_id", "name",
    "task", "tools",
)  # fmt: skip


def essentials(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with only what a template gets of it, for a conversation kept to be rendered
    again (a stored response's, gateway/request/holders.py): the fields `_message` reads, a typed part's
    kind and text (an image or other media part its type alone: its data is the replica's, its
    tokens the image's cost), a tool call's id, type, name and arguments. The fields of a part
    vLLM does not know, which it hands an "openai" template, go too: no template prints them."""
    kept = {key: message[key] for key in _MESSAGE_FIELDS if key in message}
    content = kept.get("content")
    if isinstance(content, list):
        kept["content"] = [_essential_part(part) for part in content]
    calls = kept.get("tool_calls")
    if isinstance(calls, list):
        kept["tool_calls"] = [_essential_call(call) for call in calls]
    return kept


def _essential_part(part: Any) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in _PART_TYPES or part.get("uuid") is not None:
        return part  # a string, or a part its keys classify: as it is
    if kind in _TEXT_KEYS:
        return {"type": kind, _TEXT_KEYS[kind]: part.get(_TEXT_KEYS[kind])}
    if kind == "tool_reference":
        return {"type": kind, "name": part.get("name")}
    return {"type": kind}


def _essential_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    kept = {key: call[key] for key in ("id", "type") if key in call}
    function = call["function"]
    kept["function"] = {key: function[key] for key in ("name", "arguments") if key in function}
    return kept


def image_parts(messages: Iterable[dict[str, Any]]) -> int:
    """The image parts of messages whose shape was checked (`check_chat`)."""
    return sum(
        part_kind(part)[0] == "image"
        for message in messages
        if isinstance(content := message.get("content"), list)
        for part in content
    )


def _message(message: dict[str, Any], openai: bool) -> dict[str, Any]:
    role = message["role"]
    out: dict[str, Any] = {"role": role, "content": _content(role, message.get("content"), openai)}
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls:  # parse refused any but a list; an empty one is dropped
            out["tool_calls"] = [_tool_call(call) for call in calls]
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as system ones, every system message merged into the first."""
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for index, message in enumerate(conversation):
        if message["role"] not in ("developer", "system"):
            others.append(message)
            continue
        merge = merge or index > 0 or bool(texts)
        content = message["content"]
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            texts.append(content)
    if not merge:
        return [
            {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
            if m["role"] == "developer"
            else m
            for m in conversation
        ]
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


def tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM dumps them for the template (parse checked their shape)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        function = tool["function"]
        dumped: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        defer = tool.get("defer_loading")
        for key in ("strict", "defer_loading"):
            value = function.get(key)
            if key == "defer_loading" and value is None:
                value = defer
            if value is not None:
                dumped[key] = lax_bool(value, f"tools.function.{key}", False)
        entry: dict[str, Any] = {"type": "function", "function": dumped}
        if defer is not None:
            entry["defer_loading"] = lax_bool(defer, "tools.defer_loading", False)
        out.append(entry)
    return out


def _set(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in values.items() if not (v is None or (isinstance(v, str) and v == "auto"))
    }


# The fields of a request `template_kwargs` reads: a chat without any of them is rendered with
# the keywords of an empty one.
KEYWORD_FIELDS = frozenset(
    {
        "add_generation_prompt", "chat_template_kwargs", "continue_final_message", "documents",
        "reasoning_effort", "tools",
    }
)  # fmt: skip


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """Every keyword vLLM hands `apply_chat_template` before its filter, `tools` included."""
    user = body.get("chat_template_kwargs") or {}
    effort = body.get("reasoning_effort")
    request = {
        "add_generation_prompt": lax_bool(
            body.get("add_generation_prompt", True), "add_generation_prompt", True
        ),
        "continue_final_message": lax_bool(
            body.get("continue_final_message", False), "continue_final_message", False
        ),
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        request["enable_thinking"] = effort != "none"
    merged = _set({**user, **_set(request)})
    return {"tools": tool_dicts(body.get("tools")), "tokenize": False} | merged


@dataclass(frozen=True)
class _Source:
    """What vLLM finds in one template's text at load."""

    text: str
    takes_parts: bool  # "openai" content format
    variables: frozenset[str]  # undeclared variables: the kwargs it may read
    knows_developer: bool

    @cached_property
    def accepted(self) -> frozenset[str]:
        """The keywords `resolve_chat_template_kwargs` lets through for this template."""
        return (self.variables | _HF_PARAMS) - _SET_HERE


def _source(text: str) -> _Source:
    return _Source(text, _loops_over_content(text), _variables(text), _names_developer(text))


def _names_developer(text: str) -> bool:
    """`_detect_developer_role_support`."""
    return '"developer"' in text or "'developer'" in text


def _variables(text: str) -> frozenset[str]:
    """`_resolve_chat_template_kwargs`: the template's undeclared variables."""
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):  # transformers' `{% generation %}` tag
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation_support")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(text)))


def _loops_over_content(text: str) -> bool:
    """`_detect_content_format`: "openai" when the AST has a loop over a message's content (a
    template jinja cannot parse is "string", vLLM's default)."""
    import transformers.utils.chat_template_utils as hf

    try:
        ast = hf._compile_jinja_template(text).environment.parse(text)
    except Exception:  # vLLM logs it and falls back to "string"
        return False
    return any(True for _ in _content_loops(ast))


def _is_var(node: Any, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: Any, name: str, key: str) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem):
        return (
            _is_var(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        )
    return isinstance(node, nodes.Getattr) and _is_var(node.node, name) and node.attr == key


def _reads(node: Any, name: str, key: str | None = None) -> bool:
    """`_is_var_or_elems_access`: `name` (or `name[key]`), through filters, tests and slices."""
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: Any, name: str) -> list[str]:
    """`_iter_nodes_assign_var_or_elems`: `name` and the variables assigned from it."""
    from jinja2 import nodes

    found, pending = [name], [name]
    while pending:
        current = pending.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, current):
                found.append(assign.target.name)
                if assign.target.name != current:
                    pending.append(assign.target.name)
    return found


def _message_names(root: Any) -> list[str]:
    """`_iter_nodes_assign_messages_item`: the targets of loops over the messages."""
    from jinja2 import nodes

    names = _aliases(root, "messages")
    return [
        loop.target.name
        for loop in root.find_all(nodes.For)
        if any(_reads(loop.iter, name) for name in names)
    ]


def _content_loops(root: Any) -> Iterable[Any]:
    """`_iter_nodes_assign_content_item`: loops over a message's content, directly, through a
    macro parameter given it, or over a variable named `content` outside macros."""
    from jinja2 import nodes

    messages = _message_names(root)
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_reads(arg, m, "content") for m in messages):
                    params.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if kwarg.key in names and any(_reads(kwarg.value, m, "content") for m in messages):
                    params.add(kwarg.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(nodes.For):
        if any(_reads(loop.iter, m, "content") for m in messages):
            yield loop
        elif isinstance(loop.iter, nodes.Name) and (
            loop.iter.name in params_by_loop.get(id(loop), ())
            or (id(loop) not in in_macros and loop.iter.name == "content")
        ):
            yield loop


class TemplateHost:
    """What rendering reads of a transformers tokenizer, without its vocabulary: its chat
    templates and special tokens, and transformers' own `get_chat_template` and
    `apply_chat_template` run on them (with `tokenize=False` they read nothing else of the
    tokenizer), so a chat renders exactly as vLLM's transformers renders it while the
    tokenizer, hundreds of MB for a large vocabulary, is let go (gateway/tokenizer/loaded.py)."""

    def __init__(self, chat_template: Any, special_tokens_map: dict[str, Any]) -> None:
        self.chat_template = chat_template
        self.special_tokens_map = special_tokens_map

    @classmethod
    def of(cls, tokenizer: Any) -> Any:
        """The host of `tokenizer`'s templates; the tokenizer itself where its class renders
        in a way of its own (transformers' Mistral tokenizers)."""
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        own = PreTrainedTokenizerBase
        if (
            type(tokenizer).apply_chat_template is not own.apply_chat_template
            or type(tokenizer).get_chat_template is not own.get_chat_template
        ):
            return tokenizer
        return cls(tokenizer.chat_template, dict(tokenizer.special_tokens_map))

    def get_chat_template(self, chat_template: str | None, tools: Any) -> str:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        return str(PreTrainedTokenizerBase.get_chat_template(self, chat_template, tools))  # type: ignore[arg-type]

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        return PreTrainedTokenizerBase.apply_chat_template(self, conversation, **kwargs)  # type: ignore[arg-type]


class ChatTemplate:
    """One model's chat template, examined once at load as vLLM examines it.

    `render(body)` is the prompt text vLLM 0.32 renders for a chat request (encoded by it
    without special tokens). `takes_parts` is whether the template gets content parts ("openai"
    format); `image_placeholder` is the text it writes for each image then ("" otherwise: vLLM
    adds the placeholder itself, as part of the image).
    """

    def __init__(self, tokenizer: Any) -> None:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.tokenizer = tokenizer
        # A tokenizer may keep a "tool_use" template apart: the text depends only on whether
        # the request has tools. Each is examined and compiled once, as transformers caches it.
        self._by_tools: dict[bool, _Source | None] = {}
        for tools in (False, True):
            text = self._text(True if tools else None)
            self._by_tools[tools] = None if text is None else _source(text)
        default = self._by_tools[False]
        specials = dict(tokenizer.special_tokens_map)  # what transformers adds per call
        self._compiled = {
            source.text: _Compiled(_compile_jinja_template(source.text), specials)
            for source in self._by_tools.values()
            if source is not None
        }
        self._plain = self._keywords({})  # what a chat setting none of `KEYWORD_FIELDS` gets
        self.takes_parts = default is not None and default.takes_parts
        self.image_placeholder = self._placeholder() if self.takes_parts else ""

    @cached_property
    def merges_inline_system(self) -> bool:
        """vLLM's Anthropic `_should_merge_inline_system`: whether a template (either, with or
        without tools) refuses a system message after the first turn, in which case `/v1/messages`
        merges every inline system message into the leading one. A missing template merges."""
        return any(_refuses_inline_system(s) for s in self._by_tools.values())

    @cached_property
    def disabled_thinking_effort(self) -> str:
        """vLLM's Anthropic `_probe_disabled_thinking_effort`: the `reasoning_effort` that
        `thinking: {"type": "disabled"}` becomes: "none", unless the template refuses it or
        renders it as it renders some real effort (then "low")."""
        none = self._probe("none")
        if none is None or any(self._probe(effort) == none for effort in _EFFORTS):
            return "low"
        return "none"

    def probe(self) -> None:
        """Answer now what `/v1/messages` asks of the template (`merges_inline_system`,
        `disabled_thinking_effort`): each compiles or renders the template, tens of ms, which
        a first request would otherwise spend on the loop."""
        for name in ("merges_inline_system", "disabled_thinking_effort"):
            getattr(self, name)  # a cached_property: computed once, then kept

    def _probe(self, effort: str) -> str | None:
        try:
            return self.render(
                {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort}
            )
        except BadRequest:
            return None

    def _text(self, tools: Any) -> str | None:
        try:
            return str(self.tokenizer.get_chat_template(None, tools=tools))
        except ValueError:  # no template
            return None

    def _placeholder(self) -> str:
        """The text the template writes for an image: what it puts between two texts with the
        image between them, less what it puts there without."""
        image = {"type": "image_url", "image_url": {"url": "data:,"}}
        marks = ("\x00image-before\x00", "\x00image-after\x00")
        between = []
        for middle in ([image], []):
            parts = [
                {"type": "text", "text": marks[0]},
                *middle,
                {"type": "text", "text": marks[1]},
            ]
            try:
                rendered = self.render({"messages": [{"role": "user", "content": parts}]})
            except BadRequest:
                return ""
            between.append(rendered.partition(marks[0])[2].partition(marks[1])[0])
        with_image, without = between
        return with_image.replace(without, "", 1) if without else with_image

    def _keywords(self, body: dict[str, Any]) -> tuple[_Source | None, Any, dict[str, Any]]:
        """The template `body` is rendered with (None: the tokenizer has none), its tools, and
        the keywords vLLM lets through to it. The same for every body that sets none of
        `KEYWORD_FIELDS`: then `_plain`'s, worked out at load and never changed."""
        kwargs = template_kwargs(body)
        tools = kwargs.pop("tools")
        source = self._by_tools[tools is not None]
        if source is None:
            return None, tools, {}
        passed = {k: v for k, v in kwargs.items() if k in source.accepted}
        if not passed.get("continue_final_message"):
            passed.pop("continue_final_message", None)  # false is apply_chat_template's default
        return source, tools, passed

    def render(self, body: dict[str, Any]) -> str:
        """The prompt vLLM renders for `body` (checked by parse); a template's refusal, or
        vLLM's of the messages, is a `BadRequest` on `messages`."""
        plain = KEYWORD_FIELDS.isdisjoint(body)
        source, tools, passed = self._plain if plain else self._keywords(body)
        if source is None:
            raise BadRequest(_NO_TEMPLATE, param="messages")
        conversation = [_message(m, source.takes_parts) for m in body["messages"]]
        if not source.knows_developer and any(m["role"] == "developer" for m in conversation):
            conversation = _as_system(conversation)
        try:
            if passed.keys() & _APPLY_ONLY or passed.get("documents") is not None:
                rendered = self.tokenizer.apply_chat_template(
                    conversation,
                    tools=tools,
                    chat_template=source.text,
                    tokenize=False,
                    **passed,
                    return_dict=False,
                )
            else:  # what apply_chat_template renders, without its per-call set-up
                rendered = self._compiled[source.text].render(conversation, tools, passed)
        except Exception as exc:  # templates raise whatever jinja or their own checks raise
            raise BadRequest(_reason(exc), param="messages") from None
        return str(rendered)


class _Compiled:
    """A compiled template rendered as `apply_chat_template` renders it (`messages`, `tools`,
    `documents`, `add_generation_prompt` and the special tokens, then the request's keywords),
    with what is the same for every request worked out at load. jinja's `Template.render` copies
    the environment's globals (a `ChainMap`, walked in Python) into a new dict on every call,
    as much as a short chat's template itself costs. Here they are flattened once, and each
    render builds its context as `Template.render` does (`new_context`, then the root function),
    from them."""

    def __init__(self, template: Any, specials: dict[str, Any]) -> None:
        from jinja2.runtime import new_context

        assert not template.environment.is_async  # transformers' environment never is
        self._template = template
        self._new_context = new_context
        self._globals = dict(template.globals)
        self._fixed = {**self._globals, "documents": None, "add_generation_prompt": False}
        self._fixed.update(specials)

    def render(self, messages: list[Any], tools: Any, passed: dict[str, Any]) -> str:
        """`Template.render(messages=..., tools=..., documents=None, add_generation_prompt=False,
        **specials, **passed)`; a keyword of `passed` it sets itself is refused as that call
        refuses it (a `TypeError`)."""
        if passed.keys() & _SET_BY_RENDER:
            duplicate = sorted(passed.keys() & _SET_BY_RENDER)[0]
            raise TypeError(f"render() got multiple values for keyword argument {duplicate!r}")
        template = self._template
        variables = {**self._fixed, "messages": messages, "tools": tools, **passed}
        context = self._new_context(
            template.environment, template.name, template.blocks, variables, shared=True,
            globals=self._globals,
        )  # fmt: skip
        try:
            return str(template.environment.concat(template.root_render_func(context)))
        except Exception:
            template.environment.handle_exception()  # raises it, as `Template.render` does
            raise


_SET_BY_RENDER = frozenset({"messages", "tools", "documents"})
_EFFORTS = ("low", "medium", "high", "xhigh", "max")  # vLLM's `AnthropicEffort`
_INLINE_SYSTEM_PROBE = [
    {"role": role, "content": "t"} for role in ("system", "user", "system", "user")
]


def _refuses_inline_system(source: _Source | None) -> bool:
    """`_detect_merge_inline_system`: the bare template (no `raise_exception`, no special tokens)
    rendered on [system, user, system, user]; any template error means it refuses."""
    if source is None:
        return True
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    try:
        env.from_string(source.text).render(
            messages=_INLINE_SYSTEM_PROBE, add_generation_prompt=False
        )
    except jinja2.TemplateError:
        return True
    return False


def _reason(exc: BaseException) -> str:
    """`_template_error_reason`: the innermost jinja error's text, else the exception's."""
    import jinja2

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)
