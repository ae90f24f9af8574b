"""The access log: a line per request, out by the end of the loop turn it ended in, at one
write for every request that ended in that turn."""

from __future__ import annotations

import asyncio
import io
import time

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api.chat import CHAT
from gateway.context.ctx import Ctx
from gateway.observability.instruments import Instruments
from gateway.request.account import Accountant


class Log(io.BytesIO):
    """An access log that notes what had been flushed at each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[int] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue().count(b"\n"))


def _ended(request_id: str) -> Ctx:
    headers = CIMultiDictProxy(CIMultiDict())
    return Ctx(request_id, CHAT, "/v1/chat/completions", headers, time.perf_counter())


async def test_the_requests_that_end_in_one_turn_are_flushed_once_by_its_end() -> None:
    log = Log()
    accountant = Accountant(Instruments(), log)
    for request_id in ("a", "b", "c"):
        accountant.account(_ended(request_id), None)
    assert log.flushed == []  # written, not yet flushed: the turn goes on
    await asyncio.sleep(0)
    assert log.flushed == [3]
    accountant.account(_ended("d"), None)
    await asyncio.sleep(0)
    assert log.flushed == [3, 4]
    lines = [orjson.loads(line) for line in log.getvalue().splitlines()]
    assert [line["request_id"] for line in lines] == ["a", "b", "c", "d"]
