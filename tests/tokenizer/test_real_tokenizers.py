"""The gateway counts every prompt exactly as vLLM 0.32 counts it, on the real tokenizers users
serve (Gemma 3, Llama 3, Qwen 3: their own `tokenizer.json` and chat templates, fetched by
loadtest/real_tokenizers.py), with every counting backend.

The reference is transformers' own count of what vLLM hands the template: `vllm_conversation`
below is a second, independent reading of vLLM 0.32's chat parsing (renderers/chat_utils.py
`_parse_chat_message_content`, `_parse_chat_message_content_part`, `_postprocess_messages`;
renderers/hf.py `safe_apply_chat_template`; the request's `_normalize_messages_before` and the
tools' `model_dump`), and `apply_chat_template(tokenize=True)` encodes the rendered prompt without
special tokens, as vLLM does. Completions are `tokenizer(prompt)["input_ids"]`. The gateway side
is the counter a policy naming the tokenizer directory builds, called as the pipeline calls it.

Contents are real English prose (loadtest/prose.py: stdlib docstrings) mixed with hypothesis
text: mixed scripts, emoji, combining marks, the templates' own markers, and whitespace at every
edge.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from gateway.policy.compile import Policy, load_policy
from loadtest import prose
from loadtest.real_tokenizers import directory
from tests.conftest import real_reference

MODELS = ("gemma3", "llama3", "qwen3")
BACKENDS = ("fastokens", "tokenizers")
REPLICA = "http://127.0.0.1:9"  # never contacted: only the counters are used
IMAGE_TOKENS = 260  # Gemma 3: "\n\n" + <start_of_image> + 256 + <end_of_image> + "\n\n"
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBORw0KGgo" * 8}}
# Gemma 3's template loops over a message's content: vLLM hands it parts ("openai" format).
OPENAI_FORMAT = {"gemma3": True, "llama3": False, "qwen3": False}
CHATS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROMPTS = settings(CHATS, max_examples=100)


# ---------------------------------------------------------------- the two sides


@pytest.fixture(scope="session")
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as running:
        yield running


@pytest.fixture(scope="session")
def references() -> dict[str, Any]:
    """transformers' tokenizers, loaded once per model on first use."""
    return _Lazy(real_reference)


@pytest.fixture(scope="session")
def policies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Lazy]:
    """One compiled policy per (model, backend), as an operator writes it; closed at the end."""

    def compile_one(key: tuple[str, str]) -> Policy:
        model, backend = key
        spec: dict[str, Any] = {"tokenizer": str(directory(model)), "max_model_len": 131072}
        spec["tokenizer_backend"] = backend
        if model == "gemma3":
            spec["image_tokens"] = IMAGE_TOKENS
        policy = {
            "models": {model: spec},
            "pools": {"main": {"model": model, "replicas": [REPLICA], "max_concurrency": 8}},
            "classes": [{"name": "any", "when": {}}],
            "routes": [{"match": {"model": model}, "pool": "main"}],
        }
        path = tmp_path_factory.mktemp(f"{model}-{backend}") / "policy.yaml"
        path.write_text(yaml.safe_dump(policy, sort_keys=False))
        return load_policy(path)

    lazy = _Lazy(compile_one)
    yield lazy
    for policy in lazy.loaded.values():
        policy.close()


class _Lazy:
    def __init__(self, load: Any) -> None:
        self.load, self.loaded = load, {}

    def __getitem__(self, key: Any) -> Any:
        if key not in self.loaded:
            self.loaded[key] = self.load(key)
        return self.loaded[key]


def counter(policies: _Lazy, model: str, backend: str) -> Any:
    found = policies[model, backend].models[model].counter
    assert found.backend == backend
    return found


# ---------------------------------------------------------------- vLLM 0.32, read again

TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text"}
TEXT_KEYS |= {"refusal": "refusal", "thinking": "thinking"}


def _part(part: Any, openai: bool) -> Any:
    """chat_utils `_parse_chat_message_content_part`: what one part hands the template."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai else part
    kind = part["type"]
    if kind in TEXT_KEYS:
        text = part.get(TEXT_KEYS[kind])
        if text is None and kind in ("text", "refusal"):
            return None
        return {"type": "text", "text": text} if openai else text
    if kind == "tool_reference":
        return {"type": "tool_reference", "name": part["name"]} if openai else part["name"]
    assert kind == "image_url" and openai, "string-format models here take no images"
    return {"type": "image"}


def vllm_conversation(body: dict[str, Any], openai: bool) -> list[dict[str, Any]]:
    """The conversation vLLM 0.32 hands the chat template for `body`'s messages."""
    messages = copy.deepcopy(body["messages"])
    for message in messages:  # protocol `_normalize_messages_before`
        legacy = message.pop("reasoning_content", None)
        if legacy is not None and message.get("reasoning") is None:
            message["reasoning"] = legacy
    conversation = []
    for message in messages:  # chat_utils `_parse_chat_message_content`
        role, content = message["role"], message.get("content")
        parts = [] if content is None else [content] if isinstance(content, str) else content
        parsed = [p for p in (_part(part, openai) for part in parts) if p]  # falsy: dropped
        out: dict[str, Any] = {"role": role, "content": parsed if openai else "\n".join(parsed)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                out["tool_calls"] = list(message["tool_calls"])
            if message.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                out["tool_call_id"] = message["tool_call_id"]
            if openai and all(p.get("type") == "text" for p in out["content"]):
                texts = [p.get("text", "") for p in out["content"]]
                out["content"] = "\n".join(texts) if texts else ""
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        conversation.append(out)
    for out in conversation:  # `_postprocess_messages`
        calls = out.get("tool_calls")
        if out["role"] != "assistant" or not isinstance(calls, list):
            continue
        if not calls:
            del out["tool_calls"]
        for call in calls:
            function = call["function"]
            arguments = function.get("arguments")
            if arguments:
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return conversation


def vllm_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """`ChatCompletionToolsParam.model_dump()`: FunctionDefinition's fields in its order."""
    if tools is None:
        return None
    dumped = []
    for tool in tools:
        given = tool["function"]
        function = {"name": given["name"], "description": given.get("description")}
        function["parameters"] = given.get("parameters")
        if given.get("strict") is not None:
            function["strict"] = given["strict"]
        dumped.append({"type": "function", "function": function})
    return dumped


def reference_chat(tokenizer: Any, body: dict[str, Any], model: str) -> int:
    """Tokens vLLM counts for a chat: the template rendered with vLLM's conversation, encoded
    without special tokens; each image's placeholder token grows to `IMAGE_TOKENS`."""
    openai = OPENAI_FORMAT[model]
    conversation = vllm_conversation(body, openai)
    kwargs = dict(body.get("chat_template_kwargs") or {})
    ids = tokenizer.apply_chat_template(
        conversation,
        tools=vllm_tools(body.get("tools")),
        tokenize=True,
        add_generation_prompt=True,
        continue_final_message=False,
        return_dict=False,
        **kwargs,
    )
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    images = sum(p == {"type": "image"} for m in conversation for p in _parts(m))
    placeholder = len(tokenizer.encode("<start_of_image>", add_special_tokens=False))
    return len(ids) + images * (IMAGE_TOKENS - placeholder)


def _parts(message: dict[str, Any]) -> list[Any]:
    return message["content"] if isinstance(message["content"], list) else []


def reference_prompts(tokenizer: Any, prompt: Any) -> list[int]:
    """Tokens vLLM counts for each prompt of a completion (special tokens added)."""
    if isinstance(prompt, str):
        return [len(tokenizer(prompt)["input_ids"])]
    if isinstance(prompt[0], int):
        return [len(prompt)]
    return [len(p) if isinstance(p, list) else len(tokenizer(p)["input_ids"]) for p in prompt]


async def gateway_chat(count: Any, body: dict[str, Any]) -> int:
    """The chat's input tokens as the gateway charges them: the counter's count plus each
    image's `image_cost`."""
    images = sum(
        isinstance(p, dict) and p.get("type") == "image_url"
        for m in body["messages"]
        if isinstance(m.get("content"), list)
        for p in m["content"]
    )
    return await count.count_chat(copy.deepcopy(body)) + images * count.image_cost


def difference(count: Any, tokenizer: Any, body: dict[str, Any], model: str) -> str:
    """Where the gateway's rendered prompt and the reference's first differ, for the report."""
    mine = count.template.render(copy.deepcopy(body))
    theirs = tokenizer.apply_chat_template(
        vllm_conversation(body, OPENAI_FORMAT[model]),
        tools=vllm_tools(body.get("tools")),
        tokenize=False,
        add_generation_prompt=True,
        **dict(body.get("chat_template_kwargs") or {}),
    )
    return first_difference(mine, theirs, "reference")


def first_difference(mine: str, theirs: str, other: str) -> str:
    """Where the gateway's rendered prompt first differs from `other`'s, for a failure report."""
    if mine == theirs:
        return "same rendered prompt: the encodings differ"
    at = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
    at = min(len(mine), len(theirs)) if at is None else at
    return (
        f"rendered prompts differ at character {at}:\n"
        f"  gateway: {mine[max(0, at - 60) : at + 60]!r}\n"
        f"  {other}: {theirs[max(0, at - 60) : at + 60]!r}"
    )


# ---------------------------------------------------------------- what users send

ATOMS = (
    "naïve café", "e\u0301\u0301", "Ångström", "日本語のテキスト", "中文内容\uff0c标点\u3002", "한국어 문장",
    "Привет, мир", "مرحبا بالعالم", "שלום", "हिन्दी पाठ", "ไทย", "👩‍👩‍👧‍👦", "🇯🇵🇫🇷", "👍🏽", "🤖",
    "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<|eot_id|>", "<tool_call>", "{\"json\": [1, 2.5, null]}", "x = f(y)  # code", "    indented",
    "\u200b", "\u00a0", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
)  # fmt: skip
EDGES = ("", "", " ", "  ", "\n", "\n\n", "\t", " \n\t ", "\r\n", "\n \n")
SEPARATORS = (" ", " ", "\n", "\n\n", "\t", ", ", "", "  \n")


@st.composite
def texts(draw: st.DrawFn, paragraphs: int = 2) -> str:
    """Prose with unicode inside and whitespace at its edges."""
    corpus = prose.paragraphs()
    pieces = draw(
        st.lists(
            st.one_of(
                st.sampled_from(corpus),
                st.sampled_from(corpus).map(lambda p: p[: len(p) // 3]),
                st.sampled_from(ATOMS),
                st.text(min_size=1, max_size=40),
            ),
            min_size=1,
            max_size=paragraphs + 2,
        )
    )
    body = pieces[0]
    for piece in pieces[1:]:
        body += draw(st.sampled_from(SEPARATORS)) + piece
    return draw(st.sampled_from(EDGES)) + body + draw(st.sampled_from(EDGES))


@st.composite
def contents(draw: st.DrawFn, images: bool = False, tool_reference: bool = True) -> Any:
    """A message's content: a string, or parts of every kind vLLM takes as text (and images)."""
    if draw(st.booleans()):
        return draw(texts())
    kinds = ["text", "input_text", "output_text", "refusal", "thinking", "str", "empty"]
    kinds += ["tool_reference"] if tool_reference else []
    kinds += ["image"] * 2 if images else []
    parts: list[Any] = []
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=4)):
        if kind == "image":
            parts.append(IMAGE)
        elif kind == "tool_reference":
            parts.append({"type": kind, "name": draw(st.sampled_from(TOOL_NAMES))})
        elif kind == "str":
            parts.append(draw(texts(1)))
        elif kind == "empty":  # vLLM drops an empty text from a "string" template's join
            parts.append(draw(st.sampled_from(["", {"type": "text", "text": ""}])))
        else:
            parts.append({"type": kind, TEXT_KEYS[kind]: draw(texts(1))})
    if parts[0] == IMAGE and not draw(st.booleans()):
        parts.insert(0, {"type": "text", "text": draw(texts(1))})
    return parts


TOOL_NAMES = ("get_weather", "search_catalog", "classify_product", "lookup_order")
SCHEMA = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "What to look for."},
        "limit": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["query"],
}


@st.composite
def tools(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for name in draw(st.lists(st.sampled_from(TOOL_NAMES), min_size=1, max_size=3, unique=True)):
        function: dict[str, Any] = {"name": name}
        if draw(st.booleans()):
            function["description"] = draw(texts(1))
        if draw(st.booleans()):
            function["parameters"] = SCHEMA
        if draw(st.booleans()):  # a client's own order: the dump puts fields in the model's
            function = dict(reversed(function.items()))
        if draw(st.integers(0, 4)) == 0:
            function["strict"] = True
        out.append({"type": "function", "function": function})
    return out


@st.composite
def tool_calls(draw: st.DrawFn) -> list[dict[str, Any]]:
    calls = []
    for index in range(draw(st.integers(1, 2))):
        arguments = draw(
            st.one_of(
                st.fixed_dictionaries({"query": texts(1)}, optional={"limit": st.integers(1, 99)}),
                st.sampled_from(["", "not json {", "[1, 2]", "{}"]),
            )
        )
        calls.append(
            {
                "id": f"call_{index}",
                "type": "function",
                "function": {
                    "name": draw(st.sampled_from(TOOL_NAMES)),
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    return calls


@st.composite
def assistant(draw: st.DrawFn, openai: bool, calls: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant"}
    if calls:
        message["tool_calls"] = draw(tool_calls())
        message["content"] = draw(st.one_of(st.none(), texts(1)))
    else:
        message["content"] = draw(contents(tool_reference=not openai))
    reasoning = draw(st.sampled_from([None, "reasoning", "reasoning_content"]))
    if reasoning:
        message[reasoning] = draw(texts(1))
    return message


@st.composite
def chats(draw: st.DrawFn, model: str) -> dict[str, Any]:
    """A chat request `model`'s template accepts: Gemma 3 alternates user and model after an
    optional system turn and takes images; Llama 3 and Qwen 3 take tool calls and results."""
    openai = OPENAI_FORMAT[model]
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        # Gemma 3 reads a system turn's first part's `text`: a tool reference has none.
        system = {"role": "system", "content": draw(contents(tool_reference=not openai))}
        messages.append(system)
    for turn in range(draw(st.integers(1, 3))):
        if openai and messages and messages[-1]["role"] == "user":
            messages.append(draw(assistant(openai, False)))  # Gemma 3 alternates strictly
        user: dict[str, Any] = {"role": "user", "content": draw(contents(images=openai))}
        if draw(st.integers(0, 5)) == 0:
            user["name"] = "alice"
        messages.append(user)
        if turn == 2 or not draw(st.booleans()):
            continue
        calls = draw(st.booleans())
        messages.append(draw(assistant(openai, calls)))
        if calls and not openai:  # Gemma 3's template has no tool role: its calls go unanswered
            for call in messages[-1]["tool_calls"]:
                result = {"role": "tool", "tool_call_id": call["id"], "content": draw(contents())}
                messages.append(result)
            if draw(st.booleans()):
                messages.append(draw(assistant(openai, False)))
            elif draw(st.booleans()):
                break  # the model answers the tool results
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": draw(contents(images=openai))})
    body: dict[str, Any] = {"model": model, "messages": messages}
    if draw(st.booleans()):
        body["tools"] = draw(tools())
    if model == "qwen3" and draw(st.booleans()):
        body["chat_template_kwargs"] = {"enable_thinking": draw(st.booleans())}
    return body


def prompts() -> st.SearchStrategy[Any]:
    ids = st.lists(st.integers(0, 32000), min_size=1, max_size=64)
    return st.one_of(
        texts(3),
        st.lists(texts(1), min_size=1, max_size=4),
        ids,
        st.lists(ids, min_size=1, max_size=4),
    )


# ---------------------------------------------------------------- the properties


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", MODELS)
@CHATS
@given(data=st.data())
def test_a_chat_is_counted_as_vllm_counts_it(
    model: str, backend: str, data: st.DataObject, policies, references, runner
) -> None:
    body = data.draw(chats(model), label="request")
    count, tokenizer = counter(policies, model, backend), references[model]
    expected = reference_chat(tokenizer, body, model)
    counted = runner.run(gateway_chat(count, body))
    if counted != expected:
        note(difference(count, tokenizer, body, model))
    assert counted == expected, f"{model}/{backend}: gateway {counted}, vLLM {expected}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", MODELS)
@PROMPTS
@given(prompt=prompts())
def test_a_completions_prompt_is_counted_as_vllm_counts_it(
    model: str, backend: str, prompt: Any, policies, references, runner
) -> None:
    count, tokenizer = counter(policies, model, backend), references[model]
    counted = runner.run(count.count_prompts(copy.deepcopy(prompt)))
    expected = reference_prompts(tokenizer, prompt)
    assert counted == expected, f"{model}/{backend}: gateway {counted}, vLLM {expected}"


def classification_chat(model: str) -> dict[str, Any]:
    """A realistic ~4,000-token classification request: rules, then a product's text."""
    rng = random.Random(26)
    rules = "\n".join(
        f"{n}. {prose.text(rng, 200)}" for n in range(1, 9)
    )  # numbered rules of prose
    system = (
        "You classify product listings for a marketplace. Answer with one label of ALLOWED,"
        " REVIEW or BLOCKED and one sentence of reason.\n\nRules:\n" + rules + "\n"
    )
    product = "Title: Hand-made ceramic teapot 🫖 (1.2 L)\n\n" + prose.text(rng, 14500)
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Classify this listing:\n\n" + product + "\n"},
        ],
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", MODELS)
def test_a_4000_token_classification_chat_is_counted_exactly(
    model: str, backend: str, policies, references, runner
) -> None:
    body = classification_chat(model)
    count, tokenizer = counter(policies, model, backend), references[model]
    expected = reference_chat(tokenizer, body, model)
    assert 3000 < expected < 5000  # the corpus varies a little with what is imported
    counted = runner.run(gateway_chat(count, body))
    assert counted == expected, difference(count, tokenizer, body, model)
