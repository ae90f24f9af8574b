"""What counting one ~4,000-token text costs, by entry point, and what the prefix cache saves.

    python -m loadtest.bench_encode [--repeat 200] [--tokens 4000] [--tokenizer DIR]

The tokenizer is loadtest.tokenizer32k's 32k byte-level BPE with Llama 3's split regex, trained
here in seconds on generated text (nothing is downloaded; `--tokenizer DIR` keeps it), loaded
through `AutoTokenizer` as the gateway loads one. Prints a Markdown table: the median of
`--repeat` calls of each way to count the text, wall and CPU time (all threads: the batch entry
points spread a batch over cores), and the speed of a Python thread spinning while the calls run
back to back, against the same thread alone just before (100%: the calls hold the GIL for none
of their time; other load on the machine makes this column the noisiest). Figures are this
machine's, with a 32k vocabulary: a model's 128k-262k one costs more per token.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.prefixcount import PrefixCounts
from gateway.tokens import load_tokenizer
from loadtest import tokenizer32k


def load(directory: Path) -> Any:
    """The 32k tokenizer saved in `directory`, built there first if there is none."""
    if not (directory / "tokenizer.json").exists():
        tokenizer32k.build(directory)
    return load_tokenizer(str(directory))  # as the gateway loads it, in its environment


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
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--tokenizer", type=Path, help="where the trained tokenizer is kept")
    args = parser.parse_args()
    if args.tokenizer is not None:
        tokenizer = load(args.tokenizer)
    else:
        with tempfile.TemporaryDirectory() as directory:
            tokenizer = load(Path(directory))
    backend = tokenizer.backend_tokenizer
    rng = random.Random(5)
    rules = ""
    while len(backend.encode(rules).ids) < args.tokens:
        rules += tokenizer32k.text(rng, 12) + "\n"
    unique = "Product:\n" + tokenizer32k.text(rng, 12)
    text = rules + unique
    n_tokens = len(backend.encode(text).ids)
    cold = PrefixCounts(backend, entries=0)  # caches nothing: every call a miss
    warm = PrefixCounts(backend, entries=4096)
    warm.lengths([rules + "warm-up"], False)
    suffixes = [f"Product:\n{tokenizer32k.text(rng, 12)}" for _ in range(64)]
    ways: dict[str, Callable[[], object]] = {
        "tokenizers `encode(text)`": lambda: backend.encode(text),
        "tokenizers `encode_batch([text])`": lambda: backend.encode_batch([text]),
        "tokenizers `encode_batch_fast([text])`": lambda: backend.encode_batch_fast([text]),
        "transformers `tokenizer(text)`": lambda: tokenizer(text),
        "transformers `tokenizer.encode(text)`": lambda: tokenizer.encode(text),
        "PrefixCounts, nothing cached (a miss)": lambda: cold.lengths([text], False),
        "PrefixCounts, rules block cached, a new suffix": lambda: warm.lengths(
            [rules + rng.choice(suffixes)], False
        ),
    }
    print(f"Text: {len(text)} chars, {n_tokens} tokens; vocabulary {backend.get_vocab_size()}.\n")
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
