"""`llm-loadtest simulate`: N simulated vLLM replicas on consecutive ports, in one process.

    llm-loadtest simulate --profile gemma-3-27b-tpu-v6e-2x2 --replicas 2 --base-port 18101 \\
        [--host 127.0.0.1] [--time-scale 50] [--tokenizer DIR] [--faults JSON|@FILE] \\
        [--no-enable-prefix-caching] [--enable-prompt-tokens-details] [--block-size N] \\
        [--kv-events-config JSON]

Each replica is an independent engine with its own KV cache and metrics on port base+i. One
process (uvloop) serves them all: the engines are cheap, and a 2-core machine also has to run
the load generator. `--faults` takes one fault set for every replica or a list with one per
replica (see loadtest/sim/faults.py); POST /admin/faults changes them at run time.
`--kv-events-config` is vLLM's (loadtest/sim/kv_events.py); replica i publishes on the
endpoint's port + i (an ipc path gets `_i`), as vLLM offsets one per data-parallel rank.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import orjson
from pydantic import TypeAdapter, ValidationError

from loadtest.sim.faults import Faults
from loadtest.sim.kv_events import KVEventsConfig
from loadtest.sim.profiles import bundled_profiles, cache_geometry, load_profile
from loadtest.sim.server import Replica, ReplicaOptions, start_replica


def parse_faults(text: str | None, replicas: int) -> list[Faults]:
    """One fault set per replica from `--faults`: an object for all, or a list of objects."""
    if not text:
        return [Faults()] * replicas
    raw = Path(text[1:]).read_bytes() if text.startswith("@") else text.encode()
    value = orjson.loads(raw)
    if isinstance(value, list):
        if len(value) != replicas:
            raise ValueError(f"--faults lists {len(value)} fault sets for {replicas} replicas")
        return TypeAdapter(list[Faults]).validate_python(value)
    return [Faults.model_validate(value)] * replicas


def kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.model_validate_json(text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def replica_kv_events(config: KVEventsConfig | None, i: int) -> KVEventsConfig | None:
    """Replica `i`'s own endpoint: replicas of one process cannot bind the same one."""
    if config is None or not i:
        return config
    endpoint = config.endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if int(port):  # port 0 is the OS's pick for each
            endpoint = f"{host}:{int(port) + i}"
    else:
        endpoint = f"{endpoint}_{i}"
    return config.model_copy(update={"endpoint": endpoint})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-loadtest simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--profile", required=True, help=f"a YAML file or one of: {', '.join(bundled_profiles())}"
    )
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--base-port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated s per wall s")
    p.add_argument(
        "--tokenizer",
        help="HF tokenizer directory: prompt counts, and generated text that re-encodes to one"
        " token per token (default: 4 characters a token, ' the' per generated token)",
    )
    p.add_argument("--faults", help="JSON fault set, a JSON list (one per replica), or @file")
    p.add_argument("--served-model-name", nargs="+", help="names to serve (default: profile's)")
    p.add_argument(
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
        help="LoRA adapters to list and accept as models, as vLLM's flag",
    )  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, help="override the profile's serving flag")
    p.add_argument("--max-num-batched-tokens", type=int, help="override the profile's flag")
    p.add_argument("--max-model-len", type=int, help="override the profile's flag")
    p.add_argument("--block-size", type=int, help="override the profile's KV-cache block size")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM V1's automatic prefix caching (default: on, as in vLLM)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage reports the prompt's tokens the prefix cache served, as vLLM's flag does",
    )
    p.add_argument(
        "--kv-events-config",
        type=kv_events_config,
        help="""vLLM's KV-cache events, e.g. '{"enable_kv_cache_events": true, "publisher":"""
        """ "zmq", "endpoint": "tcp://*:5557"}' (default: off)""",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        help="wall ms between a stream's chunks (default: 0 at time scale 1, else 50)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


async def serve(replicas: int, options: list[ReplicaOptions], args: argparse.Namespace) -> None:
    profile = load_profile(args.profile)
    flags = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
    }
    overrides = {k: v for k, v in flags.items() if v is not None}
    if overrides:
        profile = profile.with_serving(**overrides)
    geometry = cache_geometry(profile)
    started: list[Replica] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for i in range(replicas):
            started.append(
                await start_replica(profile, options[i], host=args.host, port=args.base_port + i)
            )
        serving = profile.serving
        print(
            f"{profile.name}: {replicas} replica(s) of {profile.served_model_name}, time scale"
            f" {args.time_scale:g}, KV cache {geometry.kv_budget_bytes / 1e9:.1f} GB,"
            f" max_num_seqs {serving.max_num_seqs}, max_num_batched_tokens"
            f" {serving.max_num_batched_tokens}, block size {geometry.block_size}, prefix"
            f" caching {'on' if args.enable_prefix_caching else 'off'}",
            flush=True,
        )
        for replica in started:
            print(f"  {replica.url}", flush=True)
        await stop.wait()
    finally:
        for replica in started:
            await replica.close()


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["simulate"]:
        args_in = args_in[1:]
    args = parser().parse_args(args_in)
    if args.replicas < 1:
        print("--replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        faults = parse_faults(args.faults, args.replicas)
    except (ValueError, ValidationError, OSError) as exc:
        print(f"--faults: {exc}", file=sys.stderr)
        return 2
    names = tuple(args.served_model_name or ())
    if any("=" not in module for module in args.lora_modules):
        print("--lora-modules takes NAME=PATH", file=sys.stderr)
        return 2
    loras = tuple((m.partition("=")[0], m.partition("=")[2]) for m in args.lora_modules)
    options = [
        ReplicaOptions(
            time_scale=args.time_scale,
            tokenizer=args.tokenizer,
            faults=faults[i],
            seed=args.seed + i,
            served_model_names=names,
            lora_modules=loras,
            stream_interval_ms=args.stream_interval_ms,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            kv_events_config=replica_kv_events(args.kv_events_config, i),
        )
        for i in range(args.replicas)
    ]
    import uvloop

    try:
        uvloop.run(serve(args.replicas, options, args))
    except (FileNotFoundError, ValueError) as exc:  # a bad profile or override
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
