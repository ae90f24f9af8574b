"""The SSE relay reads usage without re-framing the stream, and drops only what the gateway added."""

from __future__ import annotations

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import CHAT
from gateway.context.ctx import Ctx
from gateway.request.forward import _scan


def ctx() -> Ctx:
    return Ctx(request_id="r", api=CHAT, path="/v1/chat/completions",
               headers=CIMultiDictProxy(CIMultiDict()), arrived=0.0)  # fmt: skip


def event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


TOKENS = b"".join(event({"choices": [{"index": 0, "delta": {"content": "t"}}]}) for _ in range(5))
USAGE = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}})
DONE = b"data: [DONE]\n\n"


def test_the_usage_chunk_the_client_did_not_ask_for_is_dropped() -> None:
    c = ctx()
    assert _scan(c, TOKENS + USAGE + DONE, drop_usage=True) == TOKENS + DONE
    assert (c.output_tokens, c.chunks) == (5, 5)
    assert c.first_token is not None


def test_the_usage_chunk_the_client_asked_for_is_kept() -> None:
    c = ctx()
    assert _scan(c, TOKENS + USAGE + DONE, drop_usage=False) == TOKENS + USAGE + DONE
    assert c.output_tokens == 5


def test_continuous_usage_on_ordinary_chunks_is_counted_and_kept() -> None:
    c = ctx()
    chunks = b"".join(
        event(
            {
                "choices": [{"index": 0, "delta": {"content": "t"}}],
                "usage": {"prompt_tokens": 7, "completion_tokens": i},
            }
        )
        for i in range(1, 4)
    )
    assert _scan(c, chunks + DONE, drop_usage=True) == chunks + DONE
    # A running count (`continuous_usage_stats`): what was delivered, not the answer's usage.
    assert (c.delivered, c.output_tokens, c.chunks) == (3, None, 3)


def test_a_run_without_usage_is_passed_through_as_is() -> None:
    c = ctx()
    assert _scan(c, TOKENS, drop_usage=True) is TOKENS
    assert c.chunks == 5 and c.output_tokens is None


def test_of_many_usages_in_a_run_the_last_is_read() -> None:
    """Usage is cumulative: the last event carrying it is the one parsed, the others counted."""
    c = ctx()
    chunks = b"".join(
        event({"choices": [{"delta": {"content": "t"}}], "usage": {"completion_tokens": i}})
        for i in range(1, 1001)
    )
    assert _scan(c, chunks + DONE, drop_usage=True) == chunks + DONE
    assert (c.delivered, c.chunks) == (1000, 1000)


def test_a_token_that_reads_usage_does_not_hide_the_usage() -> None:
    """A string `"usage"` after the usage chunk is a value, not a key: the usage is still read."""
    c = ctx()
    word = event({"choices": [{"index": 0, "delta": {"content": "usage"}}]})
    assert _scan(c, TOKENS + USAGE + word + DONE, drop_usage=True) == TOKENS + word + DONE
    assert (c.output_tokens, c.chunks) == (5, 6)
