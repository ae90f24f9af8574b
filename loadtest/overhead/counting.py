"""(d), (e), (f): what counting costs on the tokenizers users serve, Gemma 3's and Llama 3's.

The gateway's CPU per request is set beside what the counting backend it chose, and the
tokenizers library, spend alone on the same rendered texts, on as many threads, just before its
run, and beside the pass-through's for the same bodies. Every body is prose drawn from the run's
seed and sized from the warm-up's rate, so no cache of the gateway's or of a tokenizer's has seen
a whole prompt. (f) repeats (d) and (e) on a gateway with one tokenizer thread.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import prose
from loadtest.overhead.bodies import dumps, prose_chat
from loadtest.overhead.fleet import Service, log
from loadtest.overhead.wrk import Run, bodies_lua, measure, run_wrk

ONE_THREAD = "gateway-1t"  # the gateway again with one tokenizer thread, for (f)
COUNTING_CONNECTIONS = 16
WARM_BODIES = 300  # fresh bodies for a gateway's 1 s warm-up; its rate sizes the measured run's
MAX_BODIES = 20_000  # ~400 MB of bodies at most per run; a run outlasting them says so
ALONE_TEXTS = 300  # of the gateway's bodies, rendered and counted by each library alone


@dataclass(frozen=True)
class Counted:
    """A real model whose counting (d)/(e) measure, and issue 26's target for it."""

    row: str  # the request's letter in the report
    key: str  # its `loadtest.real_tokenizers` name
    label: str
    min_replicas: int  # simulated 27B classification replicas per gateway core

    @property
    def model(self) -> str:
        return f"bench-{self.key}"


COUNTED = (Counted("d", "gemma3", "Gemma 3", 100), Counted("e", "llama3", "Llama 3", 250))


def write_bodies(
    path: Path,
    counted: Counted,
    chars_per_token: float,
    count: int,
    rng: random.Random,
    keep: int = 0,
) -> list[dict[str, Any]]:
    """`count` prose chats of `counted`'s model drawn from `rng` (seeded once per run: no earlier
    run sent them), one JSON body a line; the first `keep` of them returned, to be counted alone."""
    kept = []
    with open(path, "w") as out:
        for n in range(count):
            chat = prose_chat(counted.model, chars_per_token, rng)
            out.write(dumps(chat) + "\n")
            if n < keep:
                kept.append(chat)
    return kept


class Alone:
    """One library encoding one model's `tokenizer.json` alone, in this process: what counting
    costs without the gateway around it.

    Measured just before the gateway run it is compared with, on texts that run sends and on the
    threads the gateway would count them on: the machine's speed moves by a third within minutes
    here, and two busy cores make each one slower, so a figure taken once, single-threaded,
    before the load flattered or wronged the gateway by as much as the ratio it was meant to
    check."""

    def __init__(self, library: str, tokenizer_json: Path, threads: int) -> None:
        import gateway.tokenizer.counters  # noqa: F401  sets the gateway's TOKENIZERS_PARALLELISM
        from gateway.config.schema import ServerSpec
        from gateway.tokenizer.backends import FastokensEncoder, TokenizersEncoder

        self.count: Callable[[str], int] = (
            _fastokens_count(tokenizer_json)
            if library == "fastokens"
            else _tokenizers_count(tokenizer_json)
        )
        # Where the gateway counts a text of this library (gateway/tokenizer/counters.py), at the policy's
        # default `inline_tokenize_max_chars` over the library's encoder's `inline_share`: longer
        # ones on its tokenizer threads.
        limit: int = ServerSpec.model_fields["inline_tokenize_max_chars"].default
        encoder = {e.name: e for e in (FastokensEncoder, TokenizersEncoder)}[library]
        self.inline_max = limit // encoder.inline_share
        self.count("warm up")
        # Long-lived, as the gateway's tokenizer threads are: fastokens keeps state per thread
        # (its regex engine's caches), and a new thread's first few dozen Llama 3 texts cost up
        # to ten times its later ones.
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"alone-{library}")

    def cost(self, texts: list[str]) -> tuple[float, float]:
        """The mean thread-CPU ms and the mean tokens per text; as the gateway counts them, those
        over its inline limit on all the threads at once, the rest one at a time on this one."""
        spent: list[float] = []
        tokens: list[int] = []

        def count(share: list[str]) -> None:
            for text in share:
                started = time.thread_time()
                tokens.append(self.count(text))
                spent.append(time.thread_time() - started)

        count([text for text in texts if len(text) <= self.inline_max])
        threaded = [text for text in texts if len(text) > self.inline_max]
        list(self._pool.map(count, [threaded[i :: self.threads] for i in range(self.threads)]))
        return 1000 * statistics.fmean(spent), statistics.fmean(tokens)


def _fastokens_count(tokenizer_json: Path) -> Callable[[str], int]:
    """fastokens' count of a rendered chat (`encode`, no special tokens: the template wrote them)."""
    import fastokens

    tokenizer = fastokens.Tokenizer.from_file(str(tokenizer_json))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def _tokenizers_count(tokenizer_json: Path) -> Callable[[str], int]:
    """The tokenizers library's (`encode_batch_fast`: the batch entry point releases the GIL)."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return lambda text: len(tokenizer.encode_batch_fast([text], add_special_tokens=False)[0])


@dataclass
class Libraries:
    """One real model's side of (d)/(e): its chat template, and the library the gateway counts it
    with and the tokenizers library, each alone."""

    counted: Counted
    backend: str  # the gateway's choice for this model: `explain`'s `counting_backend`
    alone: dict[str, Alone]  # the backend's and the tokenizers library's (one, if the same)
    chars_per_token: float  # of prose, by this tokenizer: sizes its ~4,000-token chats
    template: Any  # the transformers tokenizer whose chat template renders a chat, as vLLM's

    @classmethod
    def load(cls, counted: Counted, directory: Path, backend: str, threads: int) -> Libraries:
        from gateway.tokenizer.loaded import load_tokenizer

        alone = {
            library: Alone(library, directory / "tokenizer.json", threads)
            for library in dict.fromkeys((backend, "tokenizers"))
        }
        sample = prose.text(random.Random(0), 200_000)
        chars_per_token = len(sample) / alone[backend].count(sample)
        return cls(counted, backend, alone, chars_per_token, load_tokenizer(str(directory)))

    def render(self, chat: dict[str, Any]) -> str:
        """The prompt vLLM encodes for `chat` (transformers' rendering, generation prompt on)."""
        text: str = self.template.apply_chat_template(
            chat["messages"], tokenize=False, add_generation_prompt=True
        )
        return text


@dataclass
class AloneCost:
    """What one library alone spent per text on (a sample of) the gateway's texts."""

    ms: float
    tokens: float
    chars: float


def measure_counting(
    targets: dict[str, Service],
    services: Sequence[Service],
    libraries: list[Libraries],
    workdir: Path,
    duration: int,
    rng: random.Random,
    notes: list[str],
    own: dict[tuple[str, str], AloneCost],
) -> list[Run]:
    """(d) and (e) on the gateway, the pass-through and the one-thread gateway (f).

    A gateway's runs send bodies no earlier run sent: a fresh set for its warm-up, then one
    sized from the warm-up's rate (twice what it would need), so no cache has seen any of them;
    a run that still outlasts its set is noted in `notes`. The pass-through is sent the bodies
    the gateway just was. Before the gateway's run, `own[(request, library)]` gets what each
    library alone spends on the first of the bodies it is about to be sent, on as many threads
    as the gateway's, once it has counted the gateway's warm-up bodies on them."""
    runs = []
    for lib in libraries:
        request, script = lib.counted.row, workdir / f"counting-{lib.counted.row}.lua"
        measured = workdir / f"bodies-{request}.txt"
        for name in ("gateway", "pass-through", ONE_THREAD):
            target, counted = targets[name], name != "pass-through"
            if counted:
                warm = workdir / "bodies-warm.txt"
                warm_chats = write_bodies(
                    warm, lib.counted, lib.chars_per_token, WARM_BODIES, rng,
                    WARM_BODIES if name == "gateway" else 0,
                )  # fmt: skip
                script.write_text(bodies_lua(warm))
                warmed = run_wrk(target.url, script, COUNTING_CONNECTIONS, 1)
                rate = warmed["requests"] / (warmed["duration_us"] / 1e6)
                sized = min(MAX_BODIES, max(WARM_BODIES, math.ceil(2 * rate * duration)))
                kept = write_bodies(
                    measured, lib.counted, lib.chars_per_token, sized, rng,
                    ALONE_TEXTS if name == "gateway" else 0,
                )  # fmt: skip
                script.write_text(bodies_lua(measured))
                if kept:
                    # Each library alone first counts what the gateway's warm-up did: both
                    # tokenizers cache words, fastokens' first texts cost many times its later
                    # ones, and the gateway is measured warm.
                    warmed_up = [lib.render(chat) for chat in warm_chats]
                    texts = [lib.render(chat) for chat in kept]
                    chars = statistics.fmean(map(len, texts))
                    for library, alone in lib.alone.items():
                        alone.cost(warmed_up)
                        own[(request, library)] = AloneCost(*alone.cost(texts), chars)
            else:
                run_wrk(target.url, script, COUNTING_CONNECTIONS, 1)  # warm up its connections
            result = measure(request, target, services, script, COUNTING_CONNECTIONS, duration)
            if counted and result.requests > sized:
                notes.append(
                    f"({request}) {name} outlasted its fresh bodies ({result.requests:,} requests,"
                    f" {sized:,} bodies) and sent some again."
                )
            log(
                f"({request}) c={COUNTING_CONNECTIONS} {name:<12} {result.rps:8,.0f} req/s"
                f"  CPU {result.cpu_ms_per_request or 0:.3f} ms/req  errors {result.errors}"
            )
            runs.append(result)
    return runs
