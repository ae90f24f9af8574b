"""Prompt tokens as vLLM counts them, reimplemented with `transformers` (not the gateway's code).

Chat: the model's own chat template over the messages (text parts joined by a newline for a
template that reads `content` as a string, kept as parts for one that loops over them, as
vLLM's content-format detection does), `add_generation_prompt`, then an encode without special
tokens. Completions: an encode with them. Anthropic Messages and Responses are first turned into
that chat the way vLLM's own servers do; a Responses follow-up prefills the stored turns (their
inputs and outputs) before its own, and its rendered chat is encoded with special tokens (vLLM
0.32's Responses server does: a second BOS where the template writes one). Pooling: each input
encoded with special tokens, each scored pair as the tokenizer's pair. An upload: its text prompt.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

_LOOPS_OVER_CONTENT = re.compile(r"for \w+ in (message|m)(\[['\"]content['\"]\]|\.content)")


class Counter:
    """Each served model's tokenizer, by the model name the replica is sent."""

    def __init__(self, tokenizers: dict[str, Path]) -> None:
        self._tok = {
            name: PreTrainedTokenizerFast.from_pretrained(str(path))
            for name, path in tokenizers.items()
        }
        self._parts = {
            name: bool(_LOOPS_OVER_CONTENT.search(str(tok.chat_template or "")))
            for name, tok in self._tok.items()
        }

    def _content(self, model: str, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        if self._parts[model]:
            return [{"type": "text", "text": t} for t in texts]
        # vLLM keeps a part only if its parse is truthy: an empty text is no line of its own
        # (`_parse_chat_message_content_parts`, string content).
        return "\n".join(t for t in texts if t)

    def chat(
        self, model: str, messages: list[dict[str, Any]], tools: Any = None, special: bool = False
    ) -> int:
        tok = self._tok[model]
        conversation = [{**m, "content": self._content(model, m.get("content"))} for m in messages]
        rendered = tok.apply_chat_template(
            conversation, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
        return len(tok.encode(rendered, add_special_tokens=special))

    def prompt(
        self, model: str, endpoint: str, body: dict[str, Any], chat: list[dict[str, Any]] | None
    ) -> int:
        if endpoint == "chat":
            return self.chat(model, body["messages"], body.get("tools"))
        if endpoint == "completions":
            return sum(self._encode(model, p) for p in _prompts(body["prompt"]))
        if endpoint == "messages":
            return self.chat(model, messages_chat(body), _anthropic_tools(body.get("tools")))
        assert chat is not None
        return self.chat(model, chat, special=True)

    def _encode(self, model: str, prompt: Any) -> int:
        if isinstance(prompt, list):
            return len(prompt)
        return len(self._tok[model].encode(prompt, add_special_tokens=True))

    def pooling(self, model: str, kind: str, body: dict[str, Any]) -> int:
        """`embed`: each `input` encoded with special tokens; `pair`: each pair of a rerank or
        score encoded as the tokenizer's pair, the one first text paired with every second."""
        if kind == "embed":
            return sum(self._encode(model, i) for i in _prompts(body["input"]))
        first, second = _sides(body)
        if len(first) == 1:
            first = first * len(second)
        tok = self._tok[model]
        return sum(
            len(tok.encode(q, d, add_special_tokens=True))
            for q, d in zip(first, second, strict=True)
        )

    def speech(self, model: str, form: dict[str, str]) -> int:
        """An upload's text `prompt`, encoded with special tokens: what the gateway promises to
        count of it (the audio's tokens are the model's own, and no promise's)."""
        prompt = form.get("prompt")
        return self._encode(model, prompt) if prompt else 0

    @staticmethod
    def responses_chat(body: dict[str, Any], stored: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """vLLM's `construct_input_messages`: instructions, the stored turns, then the input."""
        out: list[dict[str, Any]] = []
        if body.get("instructions"):
            out.append({"role": "system", "content": body["instructions"]})
        out.extend(stored)
        given = body.get("input")
        if isinstance(given, str):
            out.append({"role": "user", "content": given})
        else:
            for item in given or []:
                content = item.get("content")
                if isinstance(content, list):
                    content = [{"type": "text", "text": p.get("text", "")} for p in content]
                out.append({"role": item.get("role", "user"), "content": content})
        return out


_SIDES = (
    ("query", "documents"), ("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
    ("data_1", "data_2"),
)  # fmt: skip


def _sides(body: dict[str, Any]) -> tuple[list[str], list[str]]:
    """A rerank's or score's two sides, each a list of texts, by vLLM's names for them."""
    for one, two in _SIDES:
        if one in body and two in body:
            first, second = body[one], body[two]
            return (
                first if isinstance(first, list) else [first],
                second if isinstance(second, list) else [second],
            )
    raise ValueError("a scoring body without its two sides")


def _prompts(given: Any) -> list[Any]:
    """A `prompt` (or `input`) as its list of prompts: one text, one list of token ids, or a
    list of either."""
    if not isinstance(given, list) or all(isinstance(t, int) for t in given):
        return [given]
    return given


def messages_chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    """vLLM's Anthropic server: the system prompt (its blocks' text joined) first."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str):
        out.append({"role": "system", "content": system})
    elif isinstance(system, list):
        out.append({"role": "system", "content": "".join(b.get("text", "") for b in system)})
    for message in body.get("messages", []):
        content = message.get("content")
        if not isinstance(content, list):
            out.append({"role": message["role"], "content": content})
            continue
        # Empty text blocks are dropped; one text block left is the content as a string; a
        # user message left with none is dropped whole (`_convert_message_content`).
        parts = [{"type": "text", "text": b["text"]} for b in content if b.get("text")]
        if not parts and message["role"] == "user":
            continue
        converted: dict[str, Any] = {"role": message["role"]}
        if parts:
            converted["content"] = parts[0]["text"] if len(parts) == 1 else parts
        out.append(converted)
    return out


def _anthropic_tools(tools: Any) -> Any:
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {}),
            },
        }
        for t in tools
    ]
