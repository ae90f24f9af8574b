"""What counting one ~4,000-token text of real prose costs, by library and entry point.

    python -m loadtest.bench_encode [--model gemma3] [--repeat 200] [--tokens 4000] [--seed N]

The tokenizer is a real one (loadtest/real_tokenizers.py: Gemma 3, Llama 3 or Qwen 3), loaded
through `AutoTokenizer` as the gateway loads one; each timed call counts a new text (loadtest/
prose.py, reseeded per run; words recur, as in any prose). Prints a Markdown table: the median of `--repeat` calls of each way to count, wall and CPU time (all threads: the
batch entry points may spread a batch over cores), and the speed of a Python thread spinning
while the calls run back to back, against the same thread alone just before (100%: the calls
hold the GIL for none of their time; other load on the machine makes this column the noisiest).
That column is what decides where counting may run: a call that holds the GIL holds the event
loop wherever it runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable

from gateway.tokenizer.backends import FastokensEncoder, TokenizersEncoder
from gateway.tokenizer.loaded import load_tokenizer
from loadtest import prose, real_tokenizers


def spin(stop: threading.Event, done: list[int]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    done.append(n)


def spun(call: Callable[[], object], seconds: float) -> float:
    """Spins per second of a Python thread while `call` runs back to back for `seconds`."""
    stop, done = threading.Event(), list[int]()
    spinner = threading.Thread(target=spin, args=(stop, done))
    spinner.start()
    began = time.perf_counter()
    try:
        while time.perf_counter() - began < seconds:
            call()
    finally:  # a call that raises must not leave the spinner spinning
        elapsed = time.perf_counter() - began
        stop.set()
        spinner.join()
    return done[0] / elapsed


def medians_ms(call: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median wall and CPU (this process, all threads) milliseconds per call."""
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        call()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(real_tokenizers.PACKAGES), default="gemma3")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=random.randrange(1 << 32))
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(real_tokenizers.directory(args.model)))
    backend = tokenizer.backend_tokenizer
    reference = TokenizersEncoder(backend)
    fast = FastokensEncoder(backend.to_str())
    rng = random.Random(args.seed)
    probe = prose.text(rng, args.tokens * 8)
    chars = len(probe) * args.tokens // len(backend.encode(probe).ids)  # ~`tokens` of this prose
    # A new text for every timed call of every way; the GIL column's calls reuse them.
    texts = [prose.text(rng, chars) for _ in range(4 * (args.repeat + 1))]
    turn = iter(range(1 << 62))

    def text() -> str:
        return texts[next(turn) % len(texts)]

    ways: dict[str, Callable[[], object]] = {
        "tokenizers `encode(text)`": lambda: backend.encode(text()),
        "tokenizers `encode_batch_fast([text])` (the gateway's `tokenizers`)": lambda: (
            reference.counts([text()], False)
        ),
        "transformers `tokenizer(text)`": lambda: tokenizer(text()),
        "fastokens `encode(text)` (the gateway's `fastokens`)": lambda: fast.counts(
            [text()], False
        ),
    }
    tokens = statistics.median(len(backend.encode(t).ids) for t in texts[:8])
    print(f"{args.model}, seed {args.seed}: texts of ~{chars} characters, ~{tokens:.0f} tokens.\n")
    print("| way | wall per call | CPU per call | a Python thread beside it runs at |")
    print("|---|---:|---:|---:|")
    for name, call in ways.items():
        call()
        wall, cpu = medians_ms(call, args.repeat)
        alone = spun(lambda: time.sleep(0.5), 0.5)  # just before: other load on the machine varies
        beside = spun(call, 0.5)
        print(f"| {name} | {wall:.3f} ms | {cpu:.3f} ms | {beside / alone:.0%} |")


if __name__ == "__main__":
    main()
