"""Request bodies whose prompts are exactly the planned number of tokens for the target model.

The count is the one the server will make: a chat prompt is the model's chat template rendered
with `add_generation_prompt=True` and encoded without extra special tokens; a completions prompt
is encoded with them (vLLM does both, and so does the gateway's `gateway/tokenizer/counters.py`). Without a
tokenizer the prompt is 4 characters a token, and only the server's usage chunk tells the truth.

How a prompt of N tokens is made, cheaply: a long filler text of common words is encoded once,
keeping where each of its tokens ends. A prompt is a unique tag (so that no two requests share a
prefix the server could cache: a second request for a prompt would skip its prefill) followed by
the filler cut at a token end. The cut is guessed, the whole templated prompt is counted, and the
cut moves by the difference until the count is exact; when two cuts straddle the target (a merge
at the cut), the filler starts one token later and the search goes on. The guess per (endpoint,
ISL) is remembered, so after the first request of a shape one batched encode verifies each prompt.
All of it runs before a level's clock starts, in `tokenizers`' batch encoder (which releases the
GIL), so the generator is never the bottleneck of the measurement.

Shared prefixes. A rule set is fitted the same way to exactly R tokens on its own (a `Rules N:`
tag and filler, no template), once per `bodies` call, so that every compare target and sweep
level gets fresh sets of the same shape and never finds an earlier one's blocks cached on shared
replicas. A request of that set is the rule set, a separator, its unique tag and filler; the
fit checks, on the encoding's offsets, that the rule set's R tokens appear unchanged at a token
boundary of the whole prompt (a merge across the join would change the shared tokens), and if
not tries the next separator. A session turn is a `Turn`: its new message is fitted to its
planned tokens on its own, and its body is built when it is sent, from the history then known
(the user messages and the replies actually received), its whole prompt counted then.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from gateway.tokenizer.loaded import load_tokenizer
from loadtest.loadgen.workloads import Planned
from loadtest.tiny_tokenizer import WORDS

CHARS_PER_TOKEN = 4.0
MAX_ROUNDS = 24
SESSION_HEADER = "x-session-id"

# How a fitted text is counted: a chat prompt through the template, a completions prompt with
# special tokens, a rule set or a session's message on its own (no template, no special tokens).
Kind = Literal["chat", "completions", "text"]
Message = dict[str, str]
PLAIN = ("{n}.",)
RULES = ("Rules {n}:",)
# What follows a rule set: a separator and the request's tag, the next tried when the tokenizer
# merges one across the join.
AFTER_RULES = ("\n{n}.", "\n\nProduct {n}:", "\n#{n}", " | {n}.")


def filler(words: int, seed: int = 11) -> str:
    """Deterministic prose-like text: the tokenizer sees ordinary words, not one repeated token."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(frozen=True, slots=True)
class RuleText:
    """A rule set as sent: its text and its token ids (exactly the planned R)."""

    text: str
    ids: tuple[int, ...]


@dataclass(slots=True)
class _Search:
    """One text being fitted: `prefix`, a tag, then the filler span [start, start + k) tokens."""

    kind: Kind
    target: int
    serial: int
    styles: tuple[str, ...]
    start: int
    k: int
    tried: set[int]
    prefix: RuleText | None = None
    style: int = 0

    @property
    def tag(self) -> str:
        return self.styles[self.style].format(n=self.serial)

    @property
    def shape(self) -> tuple[Kind, int, int]:
        return self.kind, self.target, len(self.prefix.ids) if self.prefix else 0


@dataclass(slots=True)
class Conversation:
    """One session's history: the user messages sent and the replies received, in order."""

    id: str
    history: list[Message] = field(default_factory=list)


@dataclass(slots=True)
class Turn:
    """A session turn's body, which exists only once the previous answer has arrived."""

    conversation: Conversation
    message: str
    planned: Planned
    model: str
    stream: bool
    builder: PromptBuilder

    def messages(self) -> list[Message]:
        return [*self.conversation.history, {"role": "user", "content": self.message}]

    async def render(self) -> tuple[bytes, int]:
        """The body to send now and its input tokens, counted off the loop."""
        messages = self.messages()
        isl = await asyncio.to_thread(self.builder.conversation_tokens, messages)
        out = body(self.model, self.planned, messages, self.stream)
        out["user"] = self.conversation.id  # the OpenAI field a gateway may key affinity on
        return orjson.dumps(out), isl

    def answered(self, reply: str) -> None:
        self.conversation.history += [
            {"role": "user", "content": self.message},
            {"role": "assistant", "content": reply},
        ]


Body = bytes | Turn


class PromptBuilder:
    """Makes OpenAI request bodies for planned requests; one builder serves a whole run."""

    def __init__(self, tokenizer_dir: str | Path | None = None) -> None:
        self.tokenizer = None if tokenizer_dir is None else load_tokenizer(str(tokenizer_dir))
        self._serial = itertools.count()
        self._text = ""
        self._ends: list[int] = []  # character offset where each filler token ends
        # Tokens besides the filler (template, tag, rule set) that made an exact prompt last time.
        self._by_shape: dict[tuple[Kind, int, int], int] = {}
        self._by_kind: dict[tuple[Kind, int], int] = {}

    def count(self, endpoint: Kind, texts: Sequence[str]) -> list[int]:
        """Input tokens the server will count for each prompt text."""
        return [len(e.ids) for e in self._encode(endpoint, self._render(endpoint, texts))]

    def conversation_tokens(self, messages: list[Message]) -> int:
        """Input tokens of a chat prompt of several messages (4 characters a token without a
        tokenizer, as everywhere here)."""
        if self.tokenizer is None:
            return round(sum(len(m["content"]) for m in messages) / CHARS_PER_TOKEN)
        rendered = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return len(self._encode("chat", [rendered])[0].ids)

    def _render(self, kind: Kind, texts: Sequence[str]) -> list[str]:
        assert self.tokenizer is not None
        if kind != "chat":
            return list(texts)
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
            for t in texts
        ]

    def _encode(self, kind: Kind, rendered: list[str]) -> list[Any]:
        assert self.tokenizer is not None
        backend = self.tokenizer.backend_tokenizer
        return list(backend.encode_batch(rendered, add_special_tokens=kind == "completions"))

    def texts(
        self,
        shapes: Sequence[tuple[Kind, int]],
        prefixes: Sequence[RuleText | None] | None = None,
    ) -> list[str]:
        """A unique text of exactly `isl` tokens for each (kind, isl), after its prefix if any."""
        prefixes = prefixes or [None] * len(shapes)
        searches = [
            _Search(kind, isl, next(self._serial), AFTER_RULES if pre else PLAIN, 0, 0, set(), pre)
            for (kind, isl), pre in zip(shapes, prefixes, strict=True)
        ]
        return self._fit(searches)

    def rule_sets(self, lengths: Sequence[int]) -> list[RuleText]:
        """Distinct rule sets, each exactly its length in tokens on its own."""
        searches = [_Search("text", n, next(self._serial), RULES, 0, 0, set()) for n in lengths]
        texts = self._fit(searches)
        if self.tokenizer is None:
            return [RuleText(t, ()) for t in texts]
        encoded = self._encode("text", texts)
        return [RuleText(t, tuple(e.ids)) for t, e in zip(texts, encoded, strict=True)]

    def _fit(self, searches: list[_Search]) -> list[str]:
        if self.tokenizer is None:
            return [self._by_chars(s) for s in searches]
        for s in searches:
            s.k = max(0, s.target - self._guess(s))
        pending = dict(enumerate(searches))
        done: dict[int, str] = {}
        for _ in range(MAX_ROUNDS):
            for kind in ("chat", "completions", "text"):
                batch = [(i, s) for i, s in pending.items() if s.kind == kind]
                if not batch:
                    continue
                candidates = [self._candidate(s) for _, s in batch]
                rendered = self._render(kind, candidates)
                encoded = self._encode(kind, rendered)
                for (i, s), text, shown, enc in zip(
                    batch, candidates, rendered, encoded, strict=True
                ):
                    got = len(enc.ids)
                    if got != s.target:
                        self._step(s, s.target - got)
                    elif s.prefix and not _keeps(s.prefix, shown, enc):
                        self._next_style(s)
                    else:
                        done[i] = text
                        self._by_shape[s.shape] = self._by_kind[s.shape[::2]] = s.target - s.k
                        del pending[i]
            if not pending:
                return [done[i] for i in range(len(searches))]
        s = next(iter(pending.values()))
        raise RuntimeError(f"could not build a {s.kind} prompt of exactly {s.target} tokens")

    def _guess(self, s: _Search) -> int:
        """This shape's last overhead, else the kind's last, else none (the first prompt)."""
        return self._by_shape.get(s.shape, self._by_kind.get(s.shape[::2], 0))

    def _step(self, s: _Search, diff: int) -> None:
        s.tried.add(s.k)
        s.k = max(0, s.k + diff)
        if s.k in s.tried:
            if s.k == 0 and diff < 0:
                raise ValueError(
                    f"{s.target} input tokens is less than the {s.kind} prompt's own overhead"
                    " (template, request tag and rule set)"
                )
            s.start += 1  # the two cuts around the target straddle a merge: shift the filler
            s.tried.clear()

    def _next_style(self, s: _Search) -> None:
        s.style += 1
        if s.style == len(s.styles):
            raise RuntimeError(
                "this tokenizer merges every separator tried into the rule set's last or the"
                f" template's first token: {s.styles}"
            )
        s.tried.clear()

    def _candidate(self, s: _Search) -> str:
        while len(self._ends) < s.start + s.k:
            self._grow()
        begin = self._ends[s.start - 1] if s.start else 0
        end = self._ends[s.start + s.k - 1] if s.k else begin
        return f"{s.prefix.text if s.prefix else ''}{s.tag} {self._text[begin:end].lstrip()}"

    def _grow(self) -> None:
        """Double the filler; with a tokenizer, encode it once to learn its token ends."""
        self._text = filler(max(4096, 2 * self._text.count(" ")))
        if self.tokenizer is not None:
            encoded = self.tokenizer.backend_tokenizer.encode(self._text, add_special_tokens=False)
            self._ends = [end for _, end in encoded.offsets]

    def _by_chars(self, s: _Search) -> str:
        prefix = s.prefix.text if s.prefix else ""
        chars = round(s.target * CHARS_PER_TOKEN) - len(prefix)  # the rule set is in the target
        while len(self._text) < chars:
            self._grow()
        return prefix + f"{s.tag} {self._text}"[:chars]

    def bodies(self, model: str, planned: Sequence[Planned], stream: bool) -> list[Body]:
        """Request bodies, output fixed by `max_tokens` + `ignore_eos`: serialised, or a `Turn`
        for a session's request. Rule sets and sessions are this call's own."""
        keys = list(dict.fromkeys((p.cls, p.rule_set) for p in planned if p.rule_set is not None))
        lengths = {(p.cls, p.rule_set): p.rule_tokens for p in planned}
        rules: dict[tuple[str, int | None], RuleText] = dict(
            zip(keys, self.rule_sets([lengths[k] for k in keys]), strict=True)
        )
        shapes: list[tuple[Kind, int]] = [(_kind(p), p.isl) for p in planned]
        prefixes = [rules.get((p.cls, p.rule_set)) for p in planned]
        texts = self.texts(shapes, prefixes)
        conversations: dict[int, Conversation] = {}
        out: list[Body] = []
        for p, text in zip(planned, texts, strict=True):
            if p.session is None:
                out.append(orjson.dumps(body(model, p, text, stream)))
                continue
            if p.session not in conversations:
                conversations[p.session] = Conversation(f"session-{next(self._serial)}")
            out.append(Turn(conversations[p.session], text, p, model, stream, self))
        return out


def _keeps(prefix: RuleText, rendered: str, encoding: Any) -> bool:
    """Whether the rule set's own tokens are the prompt's, from a boundary to a boundary."""
    start = rendered.find(prefix.text)
    end = start + len(prefix.text)
    offsets, r = encoding.offsets, len(prefix.ids)
    first = next((i for i, (_, stop) in enumerate(offsets) if stop > start), None)
    if start < 0 or first is None or offsets[first][0] != start:
        return False  # a token straddles the rule set's start
    return tuple(encoding.ids[first : first + r]) == prefix.ids and offsets[first + r - 1][1] == end


def _kind(planned: Planned) -> Kind:
    """How a request's text is counted: an embedding's input is encoded as a completion's prompt
    (with special tokens), a session's message as bare text, and a messages request's one user
    message as the chat it converts to (vLLM's Anthropic serving)."""
    if planned.session is not None:
        return "text"
    return "completions" if planned.endpoint in ("completions", "embeddings") else "chat"


def body(model: str, planned: Planned, prompt: str | list[Message], stream: bool) -> dict[str, Any]:
    """A chat or messages body carries the prompt as its one user message, or a session's
    messages (user and assistant turns with string content, valid in both APIs); an embedding
    request its `input` alone (no output, never streamed)."""
    if planned.endpoint == "embeddings":
        return {"model": model, "input": prompt}
    out: dict[str, Any] = {"model": model}
    if isinstance(prompt, list):
        out["messages"] = prompt
    elif planned.endpoint != "completions":
        out["messages"] = [{"role": "user", "content": prompt}]
    else:
        out["prompt"] = prompt
    if planned.endpoint == "messages":  # Anthropic's: max_tokens bounds the output, no ignore_eos
        return out | {"max_tokens": planned.osl, "stream": stream}
    if planned.endpoint == "responses":  # the messages are its input items; usage always sent
        return {"model": model, "input": out["messages"], "max_output_tokens": planned.osl,
                "ignore_eos": True, "stream": stream}  # fmt: skip
    # ignore_eos makes the output exactly max_tokens long: the shape is the load test's, not the model's.
    out |= {"max_tokens": planned.osl, "ignore_eos": True, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out
