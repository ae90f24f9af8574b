"""What `server.response_model: requested` costs per relayed event and per JSON answer.

    python -m loadtest.bench_rename

The fastest of five repeats of `ModelRename` on vLLM-shaped bytes: one chat chunk, a run of 20
(what a time-scaled or fast replica delivers in one read), one chunk with spaced JSON (the
regular-expression path), and a 1 MB JSON answer (in place, less the copy the bench makes).
"""

from __future__ import annotations

import timeit
from collections.abc import Callable

from gateway.request.forward import ModelRename

EVENT = (
    b'data: {"id":"cmpl-1","object":"chat.completion.chunk","created":1,'
    b'"model":"gemma-3-27b-it","choices":[{"index":0,"delta":{"content":" the"},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
ANSWER = (
    b'{"id":"x","object":"chat.completion","created":1,"model":"gemma-3-27b-it","choices":'
    b'[{"index":0,"message":{"role":"assistant","content":"' + b"the " * 250_000 + b'"}}]}'
)


def best_s(work: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(work, number=number, repeat=5)) / number


def main() -> None:
    rename = ModelRename(b'"model":"gemma-3-27b-it"', b'"model":"gemma-3"', b'"gemma-3"')
    spaced = EVENT.replace(b'"model":"', b'"model": "')
    run = EVENT * 20
    print(f"one event (replace):  {best_s(lambda: rename.events(EVENT), 200_000) * 1e6:.2f} us")
    print(
        f"20 events (replace):  {best_s(lambda: rename.events(run), 20_000) * 1e6 / 20:.2f} us/event"
    )
    print(f"one event (regex):    {best_s(lambda: rename.events(spaced), 200_000) * 1e6:.2f} us")
    copy = best_s(lambda: bytearray(ANSWER), 50)
    whole = best_s(lambda: rename.answer(bytearray(ANSWER)), 50)
    print(f"1 MB JSON answer:     {(whole - copy) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
