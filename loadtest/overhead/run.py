"""One whole `loadtest.bench_overhead` run: start the targets, check them, measure, report.

The order is (a) and (b) with wrk, `--rounds` times, the targets back to back in each; the
one-connection pairs, once a round; the counting runs (d)/(e)/(f); then (c). The temporary
directory holds the tokenizer, policies, scripts and bodies, and goes when the run ends.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from gateway.tokenizer.cpus import available_cpus
from loadtest import prose, real_tokenizers
from loadtest.overhead.bodies import (
    LISTING_TOKENS,
    RULE_COUNT,
    RULES_TOKENS,
    classify_parts,
    dumps,
    prose_chat,
    short_chat,
    stream_chat,
)
from loadtest.overhead.counting import COUNTED, ONE_THREAD, AloneCost, Libraries, measure_counting
from loadtest.overhead.fleet import (
    ROOT,
    TARGETS,
    Fleet,
    Service,
    build_tokenizer,
    check_target,
    log,
    start_backends,
    start_gateway,
    start_redis,
    wait_started,
)
from loadtest.overhead.paired import Paired, measure_paired
from loadtest.overhead.policy import counting_backends, explain, write_policy
from loadtest.overhead.report import counting_report, git_revision, machine, report
from loadtest.overhead.ttfb import TtfbResult, measure_ttfb
from loadtest.overhead.wrk import Run, measure, run_wrk, static_lua, varying_lua

CONNECTIONS = (1, 16, 64)
DEFAULT_OUT = ROOT / "loadtest" / "out" / "overhead.md"


@contextlib.contextmanager
def fleet(
    workdir: Path, shared: bool, threads: int | None, counted: Mapping[str, Path]
) -> Iterator[dict[str, Service]]:
    """Start stub, pass-through and the two gateways, counting the tiny tokenizer's model and
    `counted`'s (and, `shared`, the Redis the gateways share their slots through), wait until
    each is ready, and yield them by name."""
    tokenizer = build_tokenizer(workdir, "loadtest.tiny_tokenizer")
    procs = Fleet(workdir)
    try:
        redis_url = start_redis(procs) if shared else None
        stub, passthrough = start_backends(procs)
        policy = write_policy(workdir, tokenizer, stub.url, redis_url, threads, counted=counted)
        one_thread = write_policy(
            workdir, tokenizer, stub.url, redis_url, 1, "policy-1t.yaml", counted
        )
        gateways = [
            start_gateway(procs, name, file)
            for name, file in (("gateway", policy), (ONE_THREAD, one_thread))
        ]
        wait_started(stub, passthrough, gateways)
        yield {s.name: s for s in (stub, passthrough, *gateways)}
    finally:
        procs.stop()


def run(
    duration: int, out_path: Path, shared: bool, threads: int | None, rounds: int, seed: int
) -> int:
    if shutil.which("wrk") is None:
        log("wrk is not installed (apt-get install -y wrk)")
        return 2
    if shared and shutil.which("redis-server") is None:
        log("redis-server is not installed (apt-get install -y redis-server)")
        return 2
    started = time.monotonic()
    load = os.getloadavg()[0]  # anything else on these two cores skews every number below
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        workdir = Path(tmp)
        short_body, stream_body = dumps(short_chat()), dumps(stream_chat())
        prefix, variants, suffix = classify_parts()
        sample_classify = prefix + "SKU 0-0: " + variants[0] + suffix
        scripts = {"a": workdir / "short.lua", "b": workdir / "classify.lua"}
        scripts["a"].write_text(static_lua(short_body))
        scripts["b"].write_text(varying_lua(prefix, variants, suffix))
        stream_file = workdir / "stream.json"
        stream_file.write_text(stream_body)
        short_file = workdir / "short.json"
        short_file.write_text(short_body)
        rng = random.Random(seed)  # every counting prompt of the run is drawn from it
        directories = {c.model: real_tokenizers.directory(c.key) for c in COUNTED}
        runs: list[Run] = []
        paired: list[Paired] = []
        ttfb: list[TtfbResult] = []
        notes: list[str] = []
        own: dict[tuple[str, str], AloneCost] = {}
        gateway_threads = threads or available_cpus()
        with fleet(workdir, shared, threads, directories) as targets:
            services = list(targets.values())
            policy = workdir / "policy.yaml"
            decision = explain(policy, sample_classify, workdir)
            short_decision = explain(policy, short_body, workdir)
            bodies = {"short": short_body, "classify": sample_classify, "stream": stream_body}
            libraries = []
            backends = counting_backends(targets["gateway"].url)
            for counted in COUNTED:
                # A sample (~4.5 characters a token) shows which library the gateway counts the
                # model with, and that the texts measured alone are counted as the gateway does.
                chat = prose_chat(counted.model, 4.5, rng)
                sample = explain(policy, dumps(chat), workdir)
                lib = Libraries.load(
                    counted, directories[counted.model], backends[counted.model], gateway_threads
                )
                alone = lib.alone[lib.backend].count(lib.render(chat))
                if alone != sample["input_tokens"]:
                    notes.append(
                        f"({counted.row}) {counted.label}: the gateway counts the sample"
                        f" {sample['input_tokens']} tokens, {lib.backend} alone {alone} on its"
                        " rendering: the texts measured alone are not counted as the gateway's."
                    )
                bodies[f"counting ({counted.row})"] = dumps(chat)
                libraries.append(lib)
            for name, service in targets.items():
                check_target(name, service.port, bodies)
            log(
                f"ready; (b) is {len(sample_classify):,} bytes, {decision['input_tokens']} input"
                f" tokens, class {decision['class']}"
            )
            for request in ("a", "b"):
                for name in TARGETS:  # warm up: connections, caches, the estimator's window
                    run_wrk(targets[name].url, scripts[request], 16, 1)
                for n, connections in itertools.product(range(rounds), CONNECTIONS):
                    for name in TARGETS:
                        result = measure(
                            request, targets[name], services, scripts[request], connections,
                            duration,
                        )  # fmt: skip
                        result.round = n
                        log(
                            f"({request}) c={connections:<2} {name:<12} {result.rps:8,.0f} req/s"
                            f"  p50 {result.p50_ms:6.2f} ms  p99 {result.p99_ms:6.2f} ms"
                            f"  other CPU {result.other_cores:.2f}  errors {result.errors}"
                        )
                        runs.append(result)
            for _ in range(rounds):
                paired.append(measure_paired(targets, services, short_file))
                log(
                    "(a) c=1 paired blocks, p50 ms: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in paired[-1].p50_ms.items() if v)
                    + f"  other CPU {paired[-1].other_cores:.2f}"
                )
            runs += measure_counting(
                targets, services, libraries, workdir, duration, rng, notes, own
            )
            for name in TARGETS:
                result_t = measure_ttfb(targets[name], services, stream_file, duration)
                log(
                    f"(c) TTFB {name:<12} p50 {result_t.p50_ms:.2f} ms p99 {result_t.p99_ms:.2f} ms"
                )
                ttfb.append(result_t)
            rss = {name: targets[name].rss_mb() for name in ("gateway", ONE_THREAD)}
    import aiohttp

    header = [
        f"Run {datetime.datetime.now().astimezone().isoformat(timespec='seconds')},"
        f" {machine()}, Python {platform.python_version()}, aiohttp {aiohttp.__version__},"
        f" gateway at {git_revision()}, load average {load:.2f} at the start,"
        f" {time.monotonic() - started:.0f}s in all.",
        "",
        (
            "The gateway shares its slots and quotas through a local redis-server (`state: redis`)."
            if shared
            else "The gateway keeps its slots and quotas in memory (`state: memory`)."
        )
        + f" Tokenizer threads: {threads or 'the default (the CPUs it may use)'}.",
        "",
        f"(a) short chat: 1 user message, max_tokens 16, {len(short_body)} bytes,"
        f" {short_decision['input_tokens']} input tokens, class {short_decision['class']}.",
        f"(b) classification: a fixed {RULE_COUNT}-rule system message + a user message unique per"
        f" request, max_tokens 10, ~{len(sample_classify):,} bytes,"
        f" {decision['input_tokens']} input tokens (the gateway's count, tiny tokenizer),"
        f" class {decision['class']}.",
        f"(d) Gemma 3, (e) Llama 3: a classification chat of ~{RULES_TOKENS:,} tokens of rules"
        f" (system) and ~{LISTING_TOKENS:,} of product text (user) drawn from real prose"
        f" (`loadtest.prose`, {len(prose.paragraphs()):,} paragraphs of stdlib docstrings), every"
        f" one new, max_tokens 10; seed {seed} (`--seed {seed}` draws the same texts again). Each"
        " gateway loads the three models (RSS after the runs: "
        + ", ".join(f"{name} {mb:,.0f} MB" for name, mb in rss.items())
        + ").",
    ]
    text, clean = report(runs, paired, ttfb, header, duration, rounds)
    threads_label = f"{gateway_threads} threads"
    text += "\n".join(counting_report(runs, own, libraries, threads_label, notes)) + "\n"
    print(text)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    log(f"wrote {out_path}")
    return 0 if clean else 1
