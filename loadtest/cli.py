"""`llm-loadtest`: the capacity toolkit's command line.

llm-loadtest simulate ...   simulated vLLM replicas (loadtest/sim)
llm-loadtest sweep ...      closed- or open-loop load, per-level report, knee (loadtest/loadgen)
llm-loadtest profile ...    ISL / OSL / concurrency distributions from a gateway access log
llm-loadtest compare ...    the gateway against plain round-robin at overload
llm-loadtest autoscale ...  a simulated HPA scaling simulated pools on the gateway's metric
llm-loadtest autoscale-matrix ...
                            the same run four ways: reactive / forecast signal, spill-over off / on
llm-loadtest seed-latency ...
                            the gateway's latency model seed (`slo.model:`) fitted on a profile
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "simulate": "loadtest.sim.cli",
    "sweep": "loadtest.loadgen.cli",
    "profile": "loadtest.loadgen.cli",
    "compare": "loadtest.loadgen.cli",
    "autoscale": "loadtest.autoscale.cli",
    "autoscale-matrix": "loadtest.autoscale.matrix",
    "seed-latency": "loadtest.loadgen.seed_latency",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not args or args[0] not in COMMANDS:
        # A typo must not look like help that was asked for: say so, on stderr, and fail.
        problem = f"unknown command {args[0]!r}" if args else "a command is required"
        print(f"llm-loadtest: {problem}\n{__doc__}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]])
    result: int = module.main(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
