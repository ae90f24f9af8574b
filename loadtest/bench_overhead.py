"""What the gateway costs on top of the cheapest Python proxy, measured side by side in one run.

Absolute numbers on a 2-core machine swing 2-3x between runs (docs/benchmarks.md), so this
benchmark never reports the gateway alone: it starts three targets at once — the zero-delay stub
replica, a bare aiohttp pass-through to it (`loadtest.passthrough`) and the gateway to it — and
measures them back to back, under the same load generator, in the same minute. The ratios between
them are the result; the raw numbers only give them a scale.

- Throughput and latency come from `wrk` (C, one thread), not from Python: a Python load generator
  costs about as much CPU per request as the proxies it measures, so on two cores it would become
  the bottleneck and blur exactly the differences measured here.
- (a) a short chat request, (b) a ~4,000-token classification request (tiny tokenizer) whose
  system message (a rules block) is identical in every request and whose user message varies per
  request, at 1, 16 and 64 connections.
- (a) at one connection again, once a round, the three targets side by side in alternating
  blocks (`loadtest.paired_latency`): wrk's runs come one after another while the machine's
  speed drifts, and issue 15's one-connection verdict is a quotient of differences of p50s.
- (c) time to first body byte of a 20-chunk stream at 16 connections, which wrk cannot see, from a
  small asyncio raw-socket client run as its own process (`--ttfb-client`, internal).
- What counting costs on the tokenizers users serve, at 16 connections: (d) Gemma 3 and (e)
  Llama 3 (their real tokenizer.json and chat template, `loadtest.real_tokenizers`), each a
  classification chat of ~4,000 tokens of real English prose (`loadtest.prose`: ~3,000 tokens of
  rules in the system message, ~1,000 of product text in the user's, max_tokens 10), every one
  unique: drawn from a seed printed with the report (from the OS unless `--seed`) and sized from
  the warm-up's rate, so no cache of the gateway's or of a tokenizer's can have seen a whole
  prompt, and words are as varied as prose's. A vocabulary of a few thousand words would live in
  the tokenizers' word caches and flatter the count. Beside the gateway's CPU per request, in the
  same run: what the counting backend the gateway chose for the model (`explain`'s
  `counting_backend`) spends alone on the same rendered texts, what the tokenizers library alone
  (`encode_batch_fast`) spends on them, both in this process on the threads the gateway would
  count them on, and the pass-through's CPU per request for the same bodies: the gateway's
  target is the sum of the two (counting plus the cheapest proxying). And the simulated 27B
  classification replicas (8.6 req/s each) one gateway core keeps up with.
- (f) (d) and (e) again on a second gateway with one tokenizer thread, against the first (by
  default as many threads as CPUs): how counting scales with the cores. wrk reads prepared
  bodies, so the load generator leaves the cores to the gateway.

    python -m loadtest.bench_overhead [--duration 5] [--rounds 1] [--seed N] [--out loadtest/out/overhead.md]

Everything listens and connects on 127.0.0.1 only; every child runs in its own process group and is
killed in a `finally`; every load loop is bounded in time and in requests.
"""

# The entry point only: what it measures lives in `loadtest.overhead`, one module a part (bodies,
# fleet, policy, wrk, paired, ttfb, counting, report, run). Its docstring above is `--help`.

from __future__ import annotations

import argparse
import secrets
import signal
import sys
from pathlib import Path

from loadtest.overhead.fleet import log
from loadtest.overhead.run import DEFAULT_OUT, run
from loadtest.overhead.ttfb import ttfb_client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=int, default=5, help="seconds per measured run (>= 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Markdown report file")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure (a) and (b) this many times, targets back to back in each; the verdicts"
        " are the medians of the rounds' ratios (>= 1)",
    )
    parser.add_argument(
        "--state",
        choices=("memory", "redis"),
        default="memory",
        help="where the gateway keeps slots and quotas: `redis` starts a local redis-server",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="draw (d) and (e)'s prose from this seed (default: a new one from the OS, printed)",
    )
    parser.add_argument(
        "--tokenizer-threads",
        type=int,
        help="the gateway's server.tokenizer_threads (default: its own, the CPUs it may use)",
    )
    # Internal: the child processes this benchmark starts.
    parser.add_argument("--ttfb-client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--ttfb-body", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.duration < 1:
        parser.error("--duration must be at least 1 second")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.ttfb_client is not None:
        return ttfb_client(args.ttfb_client, args.ttfb_body, args.duration)
    # SIGTERM's default would end this process without its `finally`, leaving the children
    # running: turn it into SystemExit so the fleet is stopped either way.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    seed = secrets.randbits(32) if args.seed is None else args.seed
    log(f"seed {seed}")
    return run(
        args.duration, args.out, args.state == "redis", args.tokenizer_threads, args.rounds, seed
    )


if __name__ == "__main__":
    raise SystemExit(main())
