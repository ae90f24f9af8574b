"""What a request tells the picker about where it would run best: its prompt's leading blocks
and its session.

The blocks are chained hashes of fixed-size chunks of the prompt's characters (the messages in
order, role included), so two prompts share their first k blocks exactly when their first k
chunks are equal, as vLLM's token blocks are chained from their parent block
(vllm/v1/core/kv_cache_utils.py `hash_block_tokens`). Characters rather than tokens: the gateway
counts a chat's tokens from memoized per-message counts and never holds the rendered token ids,
and encoding the prompt again only to hash it would cost more than everything else the picker
does (docs/benchmarks.md, "Prefix hashing"). The chunks stand in for token blocks: the same
leading messages render to the same leading tokens, which is all a prefix cache keys on.

Python's string hash is seeded per process: the blocks mean something only to the index of
the gateway that made them, which is where they are used.
"""

from __future__ import annotations

from typing import Any

from gateway.tokenizer.chat_template import message_text

MAX_SESSION_CHARS = 256  # a session id longer than this is cut: it only has to tell sessions apart


def prompt_text(body: dict[str, Any]) -> str | list[int] | None:
    """The prompt in the order the replica's cache sees it: a chat's messages (role, then
    text), a responses request's instructions and input items, a completion's first prompt
    (text or token ids); None when there is none."""
    messages = body.get("messages")
    items = body.get("input")  # the Responses API's: a string is the user's message
    if messages is None and isinstance(items, str):
        messages = [{"role": "user", "content": items}]
    elif messages is None and isinstance(items, list) and items and isinstance(items[0], dict):
        messages = items
    if isinstance(messages, list):
        # Anthropic's messages carry the system prompt beside them, the Responses API's its
        # instructions: it leads the prompt too.
        system = body.get("system") or body.get("instructions")
        lead = f"system\x1f{message_text(system)}\x1e" if system else ""
        return lead + "".join(
            f"{m.get('role')}\x1f{message_text(m.get('content'))}\x1e"
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # several prompts share one pick: the first stands for them all
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def chain(
    seed: object, prompt: str | list[int], block_chars: int, max_blocks: int
) -> tuple[int, ...]:
    """Hashes of the prompt's full chunks, each chained from the one before (a last, partial
    chunk is not a block, as vLLM caches only full blocks). Token ids are chunked a quarter as
    long: about four characters make a token."""
    size = block_chars if isinstance(prompt, str) else max(1, block_chars // 4)
    count = min(len(prompt) // size, max_blocks)
    blocks = []
    parent = hash(seed)
    for start in range(0, count * size, size):
        chunk = prompt[start : start + size]
        parent = hash((parent, chunk if isinstance(chunk, str) else tuple(chunk)))
        blocks.append(parent)
    return tuple(blocks)
