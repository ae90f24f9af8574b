"""What a request tells the picker about where it would run best (gateway/pick/prompt.py makes it:
its prompt's leading blocks and its session)."""

from __future__ import annotations

from typing import NamedTuple


class Affinity(NamedTuple):
    blocks: tuple[int, ...] = ()  # chained hashes of the prompt's full leading chunks
    session: str | None = None  # tenant + session id, from a header or the OpenAI `user` field
    tokens: tuple[int, ...] = ()  # keys of its full leading token blocks (`kv_events.py`)
