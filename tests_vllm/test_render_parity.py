"""The gateway's chat counts equal vLLM 0.32's own, on the real tokenizers (issue 26).

No model weights are here, so vLLM cannot serve Gemma 3, Llama 3 or Qwen 3; but everything it
does to a chat request before the engine is plain Python. tests_vllm/vllm_render.py runs that
code itself in vLLM's environment (`$VLLM_PYTHON`): the request validated into
`ChatCompletionRequest`, `OnlineRenderer.render_chat` (tool checks, `validate_chat_template`,
`preprocess_chat`), the `HfRenderer` (`parse_chat_messages_async`,
`resolve_chat_template_content_format`, `safe_apply_chat_template`) and the tokenization that
gives the engine its `prompt_token_ids`, which vLLM reports as `usage.prompt_tokens`. Each
request's count, or vLLM's refusal with its status, is compared with the gateway's: a policy
naming the tokenizer directory, the request through the gateway's `parse` (its pre-count checks)
and the model's `counter.count_chat`, as the pipeline calls them; a `BadRequest` is its refusal.

The corpus is generated with a fixed seed: system and developer turns, 1-4 turns, content-part
arrays of every part type vLLM 0.32 takes as text (and `tool_reference`), tools with assistant
tool calls (arguments as JSON strings, as OpenAI clients send them, some invalid) and tool
results, `reasoning_content` and `reasoning`, `chat_template_kwargs` (Qwen 3's
`enable_thinking`, variables the template does not declare), `reasoning_effort`,
`add_generation_prompt`/`continue_final_message` combinations, whitespace and unicode at the
edges; then fixed edge cases, several of which vLLM refuses. Texts are stdlib docstring
paragraphs of a fixed list of modules (the same for a given Python) mixed with unicode atoms.
Images are left out: their count needs the model's multimodal processor.

vLLM's request model is part of the path: which of its message types a message validates as
decides whether a content part its parser would take as text is refused first
(gateway/api/message_types.py); `type_cases` walks those decisions for every standard role.

Each mismatch is printed with its request and both outcomes. vLLM is configured as a deployment
that takes tools is (`--enable-auto-tool-choice --tool-call-parser ...`): without a tool parser
it refuses every request with tools (tool_choice "auto" is their default), which the gateway
cannot know. The npm "llama3" tokenizer's template is Llama 3's (no tools, no
`add_generation_prompt` test), and has no `<|python_tag|>`, so its parser is `pythonic`.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import CHAT
from gateway.context.ctx import Ctx
from gateway.errors import BadRequest
from gateway.policy.compile import load_policy
from gateway.request.parse import parse
from loadtest.real_tokenizers import directory
from tests.tokenizer.test_real_tokenizers import SCHEMA, TOOL_NAMES, first_difference

MODELS = ("gemma3", "llama3", "qwen3")
# The `--tool-call-parser` each model's deployment names; it changes no prompt (its
# `adjust_request` runs after rendering), only that vLLM takes tool_choice "auto".
TOOL_PARSERS = {"gemma3": "pythonic", "llama3": "pythonic", "qwen3": "hermes"}
MAX_MODEL_LEN = 131072
GENERATED = 90  # per model, besides the fixed edge cases
SEED = 26
RENDER = Path(__file__).with_name("vllm_render.py")
SHOWN = 2000  # characters of a mismatching request printed


# ---------------------------------------------------------------- the corpus

PROSE_MODULES = (
    "argparse", "bisect", "calendar", "difflib", "fractions", "heapq", "json", "shlex",
    "statistics", "textwrap",
)  # fmt: skip
ATOMS = (
    "naïve café", "e\u0301\u0301", "Ångström", "日本語のテキスト", "中文内容\uff0c标点\u3002", "한국어 문장",
    "Привет, мир", "مرحبا بالعالم", "שלום", "हिन्दी पाठ", "ไทย", "👩‍👩‍👧‍👦", "🇯🇵🇫🇷", "👍🏽", "🤖",
    "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<|eot_id|>", "<tool_call>", "{\"json\": [1, 2.5, null]}", "x = f(y)  # code", "    indented",
    "\u200b", "\u00a0", "\ufeff", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇", "{{ raw jinja }}", "{% if x %}",
)  # fmt: skip
EDGES = ("", "", "", " ", "  ", "\n", "\n\n", "\t", " \n\t ", "\r\n", "\n \n", "\u3000")
SEPARATORS = (" ", " ", "\n", "\n\n", "\t", ", ", "", "  \n")


def paragraphs() -> list[str]:
    """Paragraphs of the docstrings of `PROSE_MODULES` and their public callables, in a fixed
    order, their own line breaks kept. (loadtest.prose's corpus varies with what else is
    imported; this one does not.)"""
    found: list[str] = []
    for name in PROSE_MODULES:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module) or ""]
        docs += [
            inspect.getdoc(member) or ""
            for key, member in sorted(vars(module).items())
            if not key.startswith("_") and callable(member)
        ]
        for doc in docs:
            found += [p for p in doc.split("\n\n") if len(p) > 80 and p not in found]
    return found


class Corpus:
    """Chat requests for one model, drawn from a seeded generator."""

    def __init__(self, model: str, rng: random.Random, prose: list[str]) -> None:
        self.model, self.rng, self.prose = model, rng, prose
        self.alternating = model == "gemma3"  # user/model turns only; no tool messages

    def text(self, pieces: int = 3) -> str:
        rng = self.rng
        out = ""
        for index in range(rng.randint(1, pieces)):
            roll = rng.random()
            if roll < 0.5:
                piece = rng.choice(self.prose)
            elif roll < 0.7:
                paragraph = rng.choice(self.prose)
                piece = paragraph[: rng.randint(1, len(paragraph))]
            else:
                piece = rng.choice(ATOMS)
            out += (rng.choice(SEPARATORS) if index else "") + piece
        return rng.choice(EDGES) + out + rng.choice(EDGES)

    def parts(self, tool_reference: bool = True) -> list[Any]:
        rng = self.rng
        # vLLM 0.32 takes all of these as text in its parser, but its request model types a
        # standard role's content array with OpenAI's part types, checked when first iterated:
        # `input_text`, `output_text`, plain strings and empty texts are refused there. They
        # are drawn less often, so that most requests reach the template.
        kinds = {"text": 6, "refusal": 2, "thinking": 2, "input_text": 0.3, "output_text": 0.3}
        kinds |= {"str": 0.3, "empty": 0.2} | ({"tool_reference": 1} if tool_reference else {})
        parts: list[Any] = []
        for kind in rng.choices(list(kinds), list(kinds.values()), k=rng.randint(1, 4)):
            if kind == "str":
                parts.append(self.text(1))
            elif kind == "empty":
                parts.append(rng.choice(["", {"type": "text", "text": ""}]))
            elif kind == "tool_reference":
                parts.append({"type": kind, "name": rng.choice(TOOL_NAMES)})
            elif kind in ("refusal", "thinking"):
                parts.append({"type": kind, kind: self.text(1)})
            else:
                parts.append({"type": kind, "text": self.text(1)})
        return parts

    def content(self, tool_reference: bool = True) -> Any:
        return self.text() if self.rng.random() < 0.55 else self.parts(tool_reference)

    def tools(self) -> list[dict[str, Any]]:
        rng = self.rng
        out = []
        for name in rng.sample(TOOL_NAMES, rng.randint(1, 3)):
            function: dict[str, Any] = {"name": name}
            if rng.random() < 0.7:
                function["description"] = self.text(1)
            if rng.random() < 0.7:
                function["parameters"] = SCHEMA
            if rng.random() < 0.3:  # a client's own key order: the dump puts the model's
                function = dict(reversed(function.items()))
            if rng.random() < 0.2:
                function["strict"] = True
            out.append({"type": "function", "function": function})
        return out

    def tool_calls(self) -> list[dict[str, Any]]:
        rng = self.rng
        calls = []
        for index in range(rng.randint(1, 2)):
            if rng.random() < 0.75:
                arguments: dict[str, Any] = {"query": self.text(1)}
                if rng.random() < 0.5:
                    arguments["limit"] = rng.randint(1, 99)
                raw = json.dumps(arguments, ensure_ascii=rng.random() < 0.5)
            else:  # what a client may send: empty, invalid, not an object, empty object
                raw = rng.choice(["", "not json {", "[1, 2]", "{}", "42"])
            calls.append(
                {
                    "id": f"call_{index}",
                    "type": "function",
                    "function": {"name": rng.choice(TOOL_NAMES), "arguments": raw},
                }
            )
        return calls

    def assistant(self, calls: bool) -> dict[str, Any]:
        rng = self.rng
        message: dict[str, Any] = {"role": "assistant"}
        if calls:
            message["tool_calls"] = self.tool_calls()
            message["content"] = rng.choice([None, "", self.text(1)])
        else:
            message["content"] = self.content(tool_reference=not self.alternating)
        reasoning = rng.choice([None, None, "reasoning", "reasoning_content"])
        if reasoning:
            message[reasoning] = self.text(1)
        return message

    def body(self) -> dict[str, Any]:
        rng = self.rng
        body: dict[str, Any] = {"model": self.model}
        messages: list[dict[str, Any]] = []
        system = rng.random()
        if system < 0.5:
            content = self.content(tool_reference=not self.alternating)
            messages.append({"role": "system", "content": content})
        elif system < 0.6:
            messages.append({"role": "developer", "content": self.text()})
        if rng.random() < 0.05:  # Claude Code's billing header, which vLLM drops
            header = "x-anthropic-billing-header: cc_version=1.0.0; cch=abc123;\n"
            messages.insert(0, {"role": "system", "content": header + self.text(1)})
        tools = (not self.alternating and rng.random() < 0.4) or rng.random() < 0.1
        if tools:
            body["tools"] = self.tools()
            choice = rng.random()
            if choice < 0.15:
                body["tool_choice"] = "none"
            elif choice < 0.25:
                body["tool_choice"] = "required"
        for turn in range(rng.randint(1, 4)):
            user: dict[str, Any] = {"role": "user", "content": self.content()}
            if rng.random() < 0.1:
                user["name"] = rng.choice(["alice", "Bob Smith"])
            messages.append(user)
            if turn == 0 and not self.alternating and rng.random() < 0.2:
                messages.append({"role": "user", "content": self.text(1)})  # two in a row
            calls = rng.random() < (0.6 if tools else 0.1)
            messages.append(self.assistant(calls))
            if calls and not self.alternating:
                for call in messages[-1]["tool_calls"]:
                    result = self.text(1) if rng.random() < 0.7 else self.parts(False)
                    tool = {"role": "tool", "tool_call_id": call["id"], "content": result}
                    messages.append(tool)
                if rng.random() < 0.5:
                    messages.append(self.assistant(False))
        ending = rng.random()
        if ending < 0.7 or messages[-1]["role"] != "assistant":
            while messages[-1]["role"] != "user" and (
                self.alternating or messages[-1]["role"] == "assistant"
            ):
                messages.pop()  # end on the user's turn (or a tool's result)
            if rng.random() < 0.1:
                body["add_generation_prompt"] = False
            elif rng.random() < 0.1:
                body["add_generation_prompt"] = True
        elif ending < 0.85:  # a prefill the model continues
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
            last = messages[-1]
            last.pop("tool_calls", None)
            last["content"] = self.text(1)
        else:
            body["add_generation_prompt"] = False
        body["messages"] = messages
        kwargs: dict[str, Any] = {}
        if self.model == "qwen3" and rng.random() < 0.4:
            kwargs["enable_thinking"] = rng.random() < 0.4
        if rng.random() < 0.1:
            kwargs["custom_flag"] = True  # no template declares it: vLLM drops it
        if rng.random() < 0.05:
            kwargs["add_generation_prompt"] = False  # the request's own field wins
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if rng.random() < 0.1:
            body["reasoning_effort"] = rng.choice(["none", "low", "high"])
        if rng.random() < 0.3:
            body["max_tokens"] = rng.randint(1, 512)
        return body


def edge_cases(model: str, corpus: Corpus) -> list[dict[str, Any]]:
    """Fixed requests at the edges: what vLLM refuses, empty and odd contents, odd flags."""
    hi = [{"role": "user", "content": "Hello there."}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    cases: list[dict[str, Any]] = [
        {"messages": hi, "add_generation_prompt": True, "continue_final_message": True},
        {"messages": hi, "chat_template": "{{ messages }}"},
        {"messages": hi, "chat_template_kwargs": {"chat_template": "{{ messages }}"}},
        {"messages": hi, "chat_template_kwargs": {"tokenize": True}},
        {"messages": []},
        {"messages": [{"role": "user", "content": 42}]},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "user", "content": ""}]},
        {"messages": [{"role": "user", "content": "   \n\t  "}]},
        {"messages": [{"role": "user", "content": []}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
        {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": None}]}]},
        {"messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "hm"}]}]},
        {"messages": [*hi, {"role": "user", "content": "Again."}]},
        {"messages": [{"role": "assistant", "content": "I start."}, *hi]},
        {"messages": [*hi, {"role": "assistant", "content": "Partial answ"}]},
        {
            "messages": [*hi, {"role": "assistant", "content": "Partial answ"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        {"messages": hi, "continue_final_message": True, "add_generation_prompt": False},
        {"messages": hi, "add_generation_prompt": "false"},
        {"messages": hi, "add_generation_prompt": "yes"},
        {"messages": hi, "add_generation_prompt": None},
        {"messages": hi, "reasoning_effort": "extreme"},
        {"messages": hi, "reasoning_effort": "none"},
        {"messages": hi, "tool_choice": "required"},
        {"messages": hi, "tools": [tool], "tool_choice": "sometimes"},
        {
            "messages": hi,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        {
            "messages": hi,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        {"messages": hi, "tools": [{"type": "function", "function": {"description": "no name"}}]},
        {"messages": hi, "tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
        {"messages": hi, "tools": [{"type": "function", "function": {"name": "f", "strict": 5}}]},
        {
            "messages": hi,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}],
        },
        {"messages": hi, "tools": [tool], "tool_choice": {"type": "x", "function": {"name": "f"}}},
        {"messages": hi, "chat_template_kwargs": {"enable_thinking": False, "unknown": [1]}},
        {"messages": hi, "chat_template_kwargs": None},
        {"messages": hi, "chat_template_kwargs": "enable_thinking"},
        {"messages": hi, "documents": [{"title": "T", "text": corpus.text(1)}]},
        {"messages": [{"role": "developer", "content": "Be brief."}, *hi]},
        {
            "messages": [
                {"role": "system", "content": "A."},
                {"role": "system", "content": "B."},
                *hi,
            ]
        },
        {"messages": [{"role": "user", "content": "Hi.", "name": 7}]},
        {"messages": [{"role": "user", "content": "Hi.", "extra_field": "ignored?"}]},
        {"messages": [{"role": "robot", "content": "Beep."}, *hi]},
        {"messages": [*hi, {"role": "assistant", "content": None, "tool_calls": [call]}]},
        {
            "messages": [*hi, {"role": "assistant", "content": "x", "tool_calls": []}],
            "add_generation_prompt": False,
        },
        {
            "messages": [
                *hi,
                {
                    "role": "assistant",
                    "tool_calls": [{**call, "function": {"name": "f", "arguments": {"a": 1}}}],
                },
            ]
        },
        {
            "messages": [
                *hi,
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "why",
                    "reasoning": "how",
                },
            ],
            "add_generation_prompt": False,
        },
        {
            "messages": [
                *hi,
                {"role": "assistant", "content": "ok", "tool_calls": [call]},
                {
                    "role": "tool",
                    "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
                },
            ]
        },
        {
            "messages": [
                *hi,
                {"role": "assistant", "content": "ok", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [tool],
        },
        {"messages": [{"role": "user", "content": "\n" * 300 + " " * 300 + "\t" * 50}]},
        {"messages": [{"role": "user", "content": " ".join(ATOMS)}]},
    ]
    return [{"model": model, **case} for case in cases]


# Content parts and message fields that decide which of vLLM's message types a message
# validates as (gateway/api/message_types.py): each alone, and beside a part vLLM's own type takes.
TYPED_PARTS: tuple[Any, ...] = (
    {"type": "text", "text": "hi"},
    {"type": "refusal", "refusal": "no"},
    {"type": "thinking", "thinking": "hm", "closed": "yes"},
    {"type": "input_text", "text": "hi"},
    {"type": "output_text", "text": "hi"},
    {"type": "input_text", "text": "hi", "uuid": "u1"},
    "plain",
    {"type": "text", "text": None},
    {"type": "text"},
    {"type": "text", "text": "hi", "extra": 1},
    {"type": "text", "text": "hi", "prompt_cache_breakpoint": {}},
    {"type": "tool_reference", "name": "f"},
    {"type": "tool_reference"},
    {"type": "refusal", "refusal": None},
    {"text": "untyped"},
)
TYPED_FIELDS: tuple[dict[str, Any], ...] = (
    {}, {"name": "bob"}, {"name": None}, {"reasoning": "r"}, {"reasoning_content": "r"},
    {"tool_call_id": "c9"}, {"task": "t"},
)  # fmt: skip


def type_cases(model: str) -> list[dict[str, Any]]:
    """Each standard role with each of `TYPED_PARTS` (alone, then after a refusal part) and
    each of `TYPED_FIELDS`; null and absent contents; tool calls of every shape."""
    hi = {"role": "user", "content": "Hello."}
    cases = []
    for role in ("system", "user", "assistant", "tool"):
        for part in TYPED_PARTS:
            for content in ([part], [{"type": "refusal", "refusal": "no"}, part]):
                for fields in TYPED_FIELDS:
                    message = {"role": role, "content": content, **fields}
                    if role == "tool":
                        message.setdefault("tool_call_id", "c0")
                    cases.append([message, hi] if role == "system" else [hi, message])
        cases += [[hi, {"role": role, "content": None}], [hi, {"role": role}]]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for odd in (
        {"id": None}, {"type": None}, {"function": {"name": "f"}},
        {"function": {"name": "f", "arguments": None}}, {"function": "f"},
    ):  # fmt: skip
        shaped = {key: value for key, value in {**call, **odd}.items() if value is not None}
        cases.append([hi, {"role": "assistant", "content": "ok", "tool_calls": [shaped]}])
    tool = {"type": "function", "function": {"name": "f"}}
    deep = {**call, "function": {"name": "f", "arguments": '{"a": ' + "[" * 200 + "]" * 200 + "}"}}
    cases += [  # fields whose types vLLM's own type checks and OpenAI's ignore, and the reverse
        [hi, {"role": "assistant", "content": [{"type": "input_text", "text": "x"}],
              "refusal": None, "tools": [tool]}],
        [hi, {"role": "assistant", "content": [{"type": "input_text", "text": "x"}],
              "refusal": None, "tools": [{"type": "function"}]}],
        [{"role": "user", "content": [{"type": "input_text", "text": "x"}], "tools": [1]}],
        [hi, {"role": "assistant", "content": "ok", "tool_calls": ""}],
        [hi, {"role": "assistant", "content": "ok", "tool_calls": {}}],
        [hi, {"role": "assistant", "content": "ok", "tool_calls": "ab"}],
        [{"role": "user", "content": "x", "tool_call_id": 5, "task": 5, "tool_calls": [1]}],
        [hi, {"role": "tool", "tool_call_id": "c", "content": "x", "name": 5}],
        [hi, {"role": "assistant", "content": "ok", "reasoning": "r", "reasoning_content": 5}],
        [hi, {"role": "assistant", "content": "", "tool_calls": [deep]}],
    ]  # fmt: skip
    bodies = [{"model": model, "messages": messages} for messages in cases]
    return [{**body, "add_generation_prompt": False} for body in bodies]


def corpus_for(model: str) -> list[dict[str, Any]]:
    corpus = Corpus(model, random.Random(f"{SEED}-{model}"), paragraphs())
    generated = [corpus.body() for _ in range(GENERATED)]
    return generated + edge_cases(model, corpus) + type_cases(model)


# ---------------------------------------------------------------- the two sides


def start_vllm(jobs: list[dict[str, Any]], tmp_path: Path) -> subprocess.Popen[bytes]:
    """vLLM's render path over `jobs`, in vLLM's environment; its results on stdout."""
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        pytest.fail("VLLM_PYTHON must be set: run `make test-vllm`")
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps(jobs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with requests.open("rb") as stdin:
        return subprocess.Popen(
            [python, str(RENDER)], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env,
        )  # fmt: skip


def write_policy(tmp_path: Path, model: str) -> Path:
    policy = {
        "models": {model: {"tokenizer": str(directory(model)), "max_model_len": MAX_MODEL_LEN}},
        "pools": {
            "main": {"model": model, "replicas": ["http://127.0.0.1:9"], "max_concurrency": 8}
        },
        "classes": [{"name": "any", "when": {}}],
        "routes": [{"match": {"model": model}, "pool": "main"}],
    }
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


async def gateway_outcome(policy: Any, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The gateway's count of `body`, or its refusal: its parse, then the model's counter."""
    ctx = Ctx(
        request_id="parity",
        api=CHAT,
        path="/v1/chat/completions",
        headers=CIMultiDictProxy(CIMultiDict()),
        arrived=0.0,
    )
    counter = policy.models[model].counter
    try:
        parse(ctx, "application/json", orjson.dumps(body), policy.spec.server)
        return {"tokens": await counter.count_chat(ctx.body)}
    except BadRequest as exc:
        return {"refused": exc.status, "error": f"BadRequest: {exc}"[:500]}


def agree(gateway: dict[str, Any], vllm: dict[str, Any]) -> bool:
    if "tokens" in vllm or "tokens" in gateway:
        return gateway.get("tokens") == vllm.get("tokens")
    return gateway["refused"] == vllm["refused"] == 400


def show(outcome: dict[str, Any]) -> str:
    if "tokens" in outcome:
        return f"{outcome['tokens']} tokens"
    return f"refused {outcome['refused']} ({outcome['error']})"


def rendered_difference(policy: Any, model: str, body: dict[str, Any], theirs: str) -> str:
    """Where the gateway's rendered prompt first differs from vLLM's, for the report."""
    template = getattr(policy.models[model].counter, "template", None)
    if template is None or not theirs:
        return ""
    try:
        mine = template.render(copy.deepcopy(body))
    except Exception as exc:
        return f"  (gateway render raised {exc!r})"
    return "  " + first_difference(mine, theirs, "vLLM").replace("\n", "\n  ")


@dataclass(frozen=True)
class Outcome:
    """One request of the corpus: what the gateway and vLLM's own path made of it."""

    label: str  # model and index
    gateway: dict[str, Any]
    vllm: dict[str, Any]
    report: str  # the request, and where the renders first differ

    def __str__(self) -> str:
        return f"{self.label}: gateway {show(self.gateway)}, vLLM {show(self.vllm)}"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    """Both sides over the whole corpus, once for the module's tests."""
    return asyncio.run(collect(tmp_path_factory))


async def collect(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    tmp_path = tmp_path_factory.mktemp("parity")
    corpora = {model: corpus_for(model) for model in MODELS}
    jobs = [
        {
            "tokenizer": str(directory(model)),
            "max_model_len": MAX_MODEL_LEN,
            "tool_parser": TOOL_PARSERS[model],
            "bodies": corpora[model],
        }
        for model in MODELS
    ]
    vllm = start_vllm(jobs, tmp_path)  # vLLM renders while the gateway counts
    try:
        gateway: dict[str, list[dict[str, Any]]] = {}
        policies = {}
        for model in MODELS:
            policy = policies[model] = load_policy(write_policy(tmp_path, model))
            bodies = copy.deepcopy(corpora[model])
            gateway[model] = [await gateway_outcome(policy, model, b) for b in bodies]
        out, err = vllm.communicate(timeout=600)
    finally:
        if vllm.poll() is None:
            vllm.kill()
            vllm.wait()
    assert vllm.returncode == 0, err.decode(errors="replace")[-5000:]
    report = json.loads(out)
    print(f"\nModelConfig attributes vLLM read: {', '.join(report['read'])}")
    found = []
    for model, theirs in zip(MODELS, report["results"], strict=True):
        counter = policies[model].models[model].counter
        counted = sum("tokens" in t for t in theirs)
        pairs = list(zip(gateway[model], theirs, strict=True))
        print(
            f"{model} ({getattr(counter, 'backend', '?')}): "
            f"{sum(agree(g, v) for g, v in pairs)} of {len(pairs)} agree "
            f"({counted} counted by vLLM, {len(theirs) - counted} refused by it)"
        )
        for index, (g, v) in enumerate(pairs):
            body = corpora[model][index]
            text = json.dumps(body, ensure_ascii=False)
            if len(text) > SHOWN:
                text = text[:SHOWN] + f"... ({len(text)} characters)"
            detail = (
                ""
                if agree(g, v)
                else rendered_difference(policies[model], model, body, v.get("prompt", ""))
            )
            found.append(Outcome(f"{model} #{index}", g, v, f"  request: {text}\n{detail}"))
    for policy in policies.values():
        policy.close()
    return found


def mismatches(outcomes: list[Outcome], kind: str) -> list[str]:
    shown = []
    for outcome in outcomes:
        if not agree(outcome.gateway, outcome.vllm) and kind in (
            "count" if "tokens" in outcome.vllm else "refusal",
        ):
            print(f"MISMATCH {outcome}\n{outcome.report}")
            shown.append(str(outcome))
    return shown


def test_what_vllm_counts_the_gateway_counts_alike(outcomes: list[Outcome]) -> None:
    """Every request vLLM's own path counts: the gateway's count is the same, never a refusal."""
    failures = mismatches(outcomes, "count")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])


def test_what_vllm_refuses_the_gateway_refuses(outcomes: list[Outcome]) -> None:
    """Every request vLLM's own path refuses with a 400, the gateway refuses before counting."""
    failures = mismatches(outcomes, "refusal")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
