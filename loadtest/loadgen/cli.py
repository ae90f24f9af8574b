"""`llm-loadtest sweep | profile | compare`: argument parsing only; the work is in the modules.

    llm-loadtest sweep --target http://127.0.0.1:8000 --model gemma-3-27b-it \
        --tokenizer /models/gemma-3 --workload generation --users 16,32,64,128 --out report/
    llm-loadtest sweep --target URL --model NAME --workload mixed --rate 20 --duration 60
    llm-loadtest sweep --target URL --model NAME --tokenizer DIR --workload rules-8x3000 --users 16
    llm-loadtest compare ... --workload sessions-5x200-think2 --rate 4 --duration 60
    llm-loadtest profile access.jsonl --out workload.yaml
    llm-loadtest compare --replicas http://127.0.0.1:8001,http://127.0.0.1:8002 \
        --gateway http://127.0.0.1:8080 --model gemma-3-27b-it --rate 12 --duration 60
    python -m loadtest.loadgen.cli roundrobin URL [URL ...]   (compare's proxy, on its own)

See docs/loadgen.md for what each number means.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args

from loadtest.loadgen import profile as profiling
from loadtest.loadgen.compare import (
    DEFAULT_SLOS,
    CompareConfig,
    objective_slos,
    parse_slo,
    run_compare,
    table,
    write_compare_report,
)
from loadtest.loadgen.knee import KneeParams
from loadtest.loadgen.report import summary_text, write_report
from loadtest.loadgen.roundrobin import __doc__ as roundrobin_doc
from loadtest.loadgen.roundrobin import roundrobin_process, serve
from loadtest.loadgen.sweep import SweepConfig, Target, run_sweep
from loadtest.loadgen.turns import turn_table
from loadtest.loadgen.workloads import BUILTIN, NAMED, Endpoint, dump_workload, load_workload

T = TypeVar("T")


def _numbers(kind: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    def parse(text: str) -> tuple[T, ...]:
        try:
            values = tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated numbers, not {text!r}"
            ) from None
        if not values or any(float(v) <= 0 for v in values):  # type: ignore[arg-type]
            raise argparse.ArgumentTypeError(f"expected positive numbers, not {text!r}")
        return values

    return parse


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} must be an http:// or https:// URL")
    return text.rstrip("/")


def _urls(text: str) -> list[str]:
    return [_url(u) for u in text.split(",") if u.strip()]


def _per_target(values: list[str] | None, count: int, flag: str) -> list[str | None]:
    """One value for every target, or one per target in order."""
    if not values:
        return [None] * count
    if len(values) == 1:
        return [values[0]] * count
    if len(values) != count:
        raise SystemExit(f"give {flag} once, or once per --target ({count})")
    return [*values]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    import uvloop

    return uvloop.run(coro)


def _sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-loadtest sweep",
        description="Closed- or open-loop load,"
        " per-level report, knee and recommended per-replica cap.",
    )
    p.add_argument(
        "--target",
        action="append",
        type=_url,
        required=True,
        help="base URL of a replica, the gateway or vLLM (repeat for several)",
    )
    p.add_argument("--model", action="append", required=True, help="once, or once per --target")
    p.add_argument(
        "--tokenizer",
        action="append",
        help="local HF tokenizer dir for exact prompt lengths; once or per --target",
    )
    p.add_argument(
        "--workload",
        action="append",
        help=f"{', '.join(BUILTIN)}, shared prefixes {NAMED}, or a workload YAML (repeatable;"
        " default: classification and generation, separately)",
    )
    p.add_argument(
        "--endpoint",
        choices=get_args(Endpoint),
        help="override every class's endpoint",
    )
    p.add_argument(
        "--users", type=_numbers(int), help="closed-loop levels, e.g. 16,32,64,128 (the default)"
    )
    p.add_argument(
        "--rate",
        type=_numbers(float),
        help="open loop instead: Poisson arrivals per second (comma-separated levels)",
    )
    p.add_argument("--duration", type=float, help="open loop: seconds of arrivals per level")
    p.add_argument(
        "--requests-per-level",
        type=int,
        help="at most this many requests per level (closed-loop default: 4 x users)",
    )
    p.add_argument("--max-seconds-per-level", type=float, default=600.0)
    p.add_argument(
        "--baseline-level",
        type=float,
        default=16,
        help="the level the normalised table is relative to",
    )
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream (needed for TTFT and TPOT)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the simulator's --time-scale: report in simulated time",
    )
    p.add_argument(
        "--target-replicas",
        type=int,
        default=1,
        help="replicas behind each target: the recommended cap is per replica",
    )
    p.add_argument(
        "--knee-tolerance",
        type=float,
        default=KneeParams.tolerance,
        help="how far throughput / P95 E2E must fall between levels to mark the knee (0.05: 5%%)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtest-report"))
    return p


def sweep(argv: Sequence[str]) -> int:
    args = _sweep_parser().parse_args(argv)
    if args.rate and args.users:
        raise SystemExit("give --users (closed loop) or --rate (open loop), not both")
    if args.rate and not args.duration:
        raise SystemExit("--rate needs --duration")
    count = len(args.target)
    models = _per_target(args.model, count, "--model")
    tokenizers = _per_target(args.tokenizer, count, "--tokenizer")
    targets = tuple(
        Target(url, str(model), tok)
        for url, model, tok in zip(args.target, models, tokenizers, strict=True)
    )
    workloads = tuple(load_workload(w) for w in args.workload or ["classification", "generation"])
    if args.endpoint:
        workloads = tuple(w.with_endpoint(args.endpoint) for w in workloads)
    config = SweepConfig(
        targets=targets,
        workloads=workloads,
        users=args.users,
        rates=args.rate or (),
        duration_s=args.duration,
        requests_per_level=args.requests_per_level,
        max_seconds_per_level=args.max_seconds_per_level,
        stream=args.stream,
        seed=args.seed,
        time_scale=args.time_scale,
        baseline_level=args.baseline_level,
        knee=KneeParams(args.knee_tolerance),
        target_replicas=args.target_replicas,
    )
    result = _run(run_sweep(config))
    paths = write_report(result, args.out)
    print(summary_text(result))
    runs = {
        f"{s.target.model} {s.workload.name} {config.kind}={config.reported_load(load):g}": run.records
        for s in result.series
        for load, run in s.levels
    }
    _print_turns(runs, args.time_scale)
    print(f"\nWrote {', '.join(str(p) for p in paths)}")
    return 0


def profile(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="llm-loadtest profile",
        description=profiling.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("access_log", type=Path)
    p.add_argument("--out", type=Path, help="write the workload YAML here")
    p.add_argument("--fit", choices=["empirical", "lognormal"], default="empirical")
    p.add_argument("--name", help="workload name (default: the output file's stem)")
    args = p.parse_args(argv)
    result = profiling.build_profile(profiling.read_access_log(args.access_log))
    if not result.groups:
        raise SystemExit(f"{args.access_log}: no classified requests with token counts")
    print(profiling.table(result))
    if args.out:
        name = args.name or args.out.stem
        workload = result.to_workload(name, args.fit)
        workload = workload.model_copy(
            update={"source": {"access_log": str(args.access_log), **workload.source}}
        )
        print(f"\nWrote {dump_workload(workload, args.out)}")
    return 0


def _compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-loadtest compare",
        description="The same open-loop workload against plain round-robin and the gateway.",
    )
    rr = p.add_mutually_exclusive_group(required=True)
    rr.add_argument(
        "--replicas",
        type=_urls,
        help="comma-separated replica URLs: start a round-robin proxy over them",
    )
    rr.add_argument("--roundrobin", type=_url, help="an already running round-robin URL")
    p.add_argument("--gateway", type=_url, required=True)
    p.add_argument("--model", required=True, help="model name sent to the round-robin target")
    p.add_argument("--gateway-model", help="model name sent to the gateway (default: --model)")
    p.add_argument("--tokenizer", help="local HF tokenizer dir for exact prompt lengths")
    p.add_argument(
        "--workload",
        default="mixed",
        help=f"{', '.join(BUILTIN)}, shared prefixes {NAMED}, or a workload YAML",
    )
    p.add_argument(
        "--rate",
        type=float,
        required=True,
        help="arrivals per second (intended: 1.5x the fleet's capacity)",
    )
    p.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    p.add_argument("--requests", type=int, help="at most this many arrivals")
    p.add_argument(
        "--max-seconds", type=float, default=600.0, help="per target, arrivals and drain"
    )
    p.add_argument(
        "--slo",
        action="append",
        type=_slo,
        default=[],
        help="CLASS:metric=seconds[,...], metrics e2e, ttft, tpot; defaults: a class's own"
        " objectives (`slo:` in the workload), else "
        + "; ".join(f"{k}: {v.describe()}" for k, v in DEFAULT_SLOS.items()),
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the simulator's --time-scale: SLOs are in simulated seconds",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtest-compare"))
    return p


def _slo(text: str) -> Any:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def compare(argv: Sequence[str]) -> int:
    args = _compare_parser().parse_args(argv)

    async def go() -> Any:
        gateway = Target(args.gateway, args.gateway_model or args.model, args.tokenizer)
        if args.roundrobin:
            rr = Target(args.roundrobin, args.model, args.tokenizer)
            return await run_compare(config(rr, gateway))
        async with roundrobin_process(args.replicas) as url:
            return await run_compare(config(Target(url, args.model, args.tokenizer), gateway))

    def config(rr: Target, gateway: Target) -> CompareConfig:
        workload = load_workload(args.workload)
        return CompareConfig(
            targets=(("round-robin", rr), ("gateway", gateway)),
            rate=args.rate,
            duration_s=args.duration,
            workload=workload,
            requests=args.requests,
            max_seconds=args.max_seconds,
            slos={**DEFAULT_SLOS, **objective_slos(workload), **dict(args.slo)},
            time_scale=args.time_scale,
            seed=args.seed,
        )

    result = _run(go())
    paths = write_compare_report(result, args.out)
    print(table(result))
    _print_turns({name: run.records for name, run in result.runs.items()}, args.time_scale)
    print(f"\nWrote {', '.join(str(p) for p in paths)}")
    return 0


def _print_turns(runs: dict[str, Any], time_scale: float) -> None:
    if turns := turn_table(runs, time_scale):
        print(f"\nSession turns (ISL: the whole prompt, history included):\n{turns}")


def roundrobin(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.loadgen.cli roundrobin",
        description=roundrobin_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("replicas", nargs="+", type=_url)
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        _run(serve(args.replicas, args.host, args.port))
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "sweep": sweep,
    "profile": profile,
    "compare": compare,
    "roundrobin": roundrobin,  # compare's proxy process; not an `llm-loadtest` command
}


def main(argv: Sequence[str] | None = None) -> int:
    """`argv[0]` is the subcommand, as `loadtest/cli.py` passes it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        print(__doc__)
        return 2
    return COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
