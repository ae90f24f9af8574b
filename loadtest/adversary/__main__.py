"""`python -m loadtest.adversary`: one run (or runs until a promise breaks), then the checks.

    python -m loadtest.adversary --seed 7 --seconds 60 [--gateways 2] [--workers 2] [--out FILE]
    python -m loadtest.adversary --seconds 20 --until Q    # fresh seeds until Q breaks
    python -m loadtest.adversary --seconds 20 --until L:tiny_events   # ... naming that move

Prints every broken promise with its seed and requests, writes a report (Markdown) and exits
1 when a promise broke, 0 when all held. `--seed` replays a run's plan.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from loadtest.adversary.checks import Broken, check, worst_loop
from loadtest.adversary.generator import fresh_seed
from loadtest.adversary.harness import Run, execute

ROOT = Path(__file__).resolve().parents[2]


def report(run: Run, broken: list[Broken], wall_s: float) -> str:
    reached = sum(1 for o in run.outcomes if run.ledger.arrivals.get(o.planned.nonce))
    statuses: dict[int, int] = {}
    for o in run.outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    lines = [
        f"# Adversary run, seed {run.seed}",
        "",
        f"- gateways: {run.gateways}{f', each a pod of {run.workers} workers' if run.workers > 1 else ''}"
        f"{' sharing redis-server (stopped, restarted)' if run.state is not None else ''}",
        *(
            [f"- shared state: {run.state}; slots reserved for `tight`: {run.reserve}"]
            if run.state
            else []
        ),
        *(
            [
                f"- Redis's replies held {run.redis_slow[2]:g} s each for"
                f" {run.redis_slow[1] - run.redis_slow[0]:.1f} s of the attack"
            ]
            if run.redis_slow
            else []
        ),
        f"- attack: {run.seconds:g} s; wall {wall_s:.0f} s; requests sent {len(run.outcomes)},"
        f" reached a replica {reached}",
        f"- statuses: {', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))}",
        "- loop, beyond what the machine explains (quiet baseline, worst second): "
        + ", ".join(
            f"gateway {i} {base * 1000:.0f} ms, {worst * 1000:.0f} ms"
            for i, (base, worst) in enumerate(worst_loop(run))
        ),
        f"- replay: `python -m loadtest.adversary --seed {run.seed} --seconds {run.seconds:g}"
        f" --gateways {run.gateways}{f' --workers {run.workers}' if run.workers > 1 else ''}`",
        "",
        "## Broken promises" if broken else "## All promises held",
        "",
        *(f"- {b.line(run.seed)}" for b in broken),
    ]
    return "\n".join(lines) + "\n"


async def once(
    seed: int, seconds: float, gateways: int, logs: Path, backend: str, workers: int
) -> tuple[Run, list[Broken], float]:
    started = time.monotonic()
    run = await execute(seed, seconds, gateways, logs, backend, workers)
    return run, check(run), time.monotonic() - started


def _matches(broken: Broken, until: str, seed: int) -> bool:
    promise, _, text = until.partition(":")
    return broken.promise == promise and text in broken.line(seed)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.adversary")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--gateways", type=int, choices=(1, 2), default=1)
    parser.add_argument(
        "--workers",
        type=int,
        choices=(1, 2),
        default=1,
        help="each gateway a pod of this many (`serve --workers`), sharing Redis",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--backend",
        choices=("auto", "tokenizers"),
        default="auto",
        help="the gateways' tokenizer library (tokenizers: a faster start)",
    )
    parser.add_argument(
        "--until",
        default=None,
        help="repeat with fresh seeds until this promise (Q, C, L, S, X) breaks; PROMISE:TEXT"
        " until a broken line of it also names TEXT (a move, e.g. Q:cut_streams)",
    )
    args = parser.parse_args()
    seed = fresh_seed() if args.seed is None else args.seed
    began = time.monotonic()
    while True:
        print(
            f"adversary: seed {seed}, {args.seconds:g} s, {args.gateways} gateway(s)",
            file=sys.stderr,
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix="adversary-") as logs:
            run, broken, wall = asyncio.run(
                once(seed, args.seconds, args.gateways, Path(logs), args.backend, args.workers)
            )
        text = report(run, broken, wall)
        print(text, flush=True)
        if args.until is None or any(_matches(b, args.until, run.seed) for b in broken):
            break
        seed = fresh_seed()
    if args.until is not None:
        print(f"adversary: {args.until} broke after {time.monotonic() - began:.0f} s (seed {seed})")
    out = args.out or ROOT / "loadtest" / "out" / f"adversary-{seed}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
