"""(a) and (b): one `wrk` run against one target, and the CPU the target spent on it.

The load comes from `wrk` (C, one thread) driven by a Lua script written here, not from Python:
a Python load generator costs about as much CPU per request as the proxies it measures, so on
two cores it would become the bottleneck. Every script ends with the same `done` hook, which
prints one `BENCH` line that `run_wrk` parses. The counting runs of (d)/(e)/(f) use it too, with
prepared bodies (`bodies_lua`).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.overhead.bodies import CHAT_PATH
from loadtest.overhead.fleet import CpuMeter, Service

# wrk prints this line from `done`; latency percentiles are in microseconds.
_DONE_LUA = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d p50_us=%d p99_us=%d connect=%d read=%d write=%d status=%d timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def _lua_string(text: str) -> str:
    """A Lua long-bracket literal: no escaping, so the JSON goes out byte for byte."""
    level = 1
    while f"]{'=' * level}]" in text:
        level += 1
    return f"[{'=' * level}[{text}]{'=' * level}]"


def static_lua(body: str, headers: Mapping[str, str] | None = None) -> str:
    """The same body (and `headers`) on every request: wrk builds it once, the cheapest load to
    generate."""
    extra = "".join(
        f"wrk.headers[ {_lua_string(k)} ] = {_lua_string(v)}\n" for k, v in (headers or {}).items()
    )
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        + extra
        + f"wrk.body = {_lua_string(body)}\n"
        + _DONE_LUA
    )


def varying_lua(prefix: str, variants: Sequence[str], suffix: str) -> str:
    """A new user message per request (SKU counter + a cycled listing) around a fixed rules block.

    Each body is unique, so nothing downstream can cache the whole request; only the rules block
    repeats, as in a real classification workload.
    """
    items = ",\n".join(_lua_string(v) for v in variants)
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"local prefix = {_lua_string(prefix)}\n"
        f"local suffix = {_lua_string(suffix)}\n"
        f"local listings = {{\n{items}\n}}\n"
        "local counter = 0\n"
        "local threads = 0\n"
        "-- setup runs in the main state and sets the global `id` in each thread's own state\n"
        "setup = function(thread) threads = threads + 1; thread:set('id', threads) end\n"
        "request = function()\n"
        "  counter = counter + 1\n"
        "  local listing = listings[(counter % #listings) + 1]\n"
        "  local body = prefix .. 'SKU ' .. tostring(id or 0) .. '-' .. tostring(counter) .. ': '"
        " .. listing .. suffix\n"
        "  return wrk.format(nil, nil, nil, body)\n"
        "end\n" + _DONE_LUA
    )


def bodies_lua(path: Path) -> str:
    """Bodies read once from `path` (one JSON body a line), sent in order and, if the run
    outlasts them, again from the top. Building a 33 KB body in Lua per request took a share of
    the cores the gateway's tokenizer threads need; reading prepared ones costs wrk next to
    nothing, so a gateway with 2 threads can be shown using 2 cores."""
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        "local bodies = {}\n"
        f"for line in io.lines({_lua_string(str(path))}) do bodies[#bodies + 1] = line end\n"
        "local sent = 0\n"
        "request = function()\n"
        "  sent = sent + 1\n"
        "  return wrk.format(nil, nil, nil, bodies[(sent - 1) % #bodies + 1])\n"
        "end\n" + _DONE_LUA
    )


@dataclass
class Run:
    request: str
    connections: int
    target: str
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    cpu_ms_per_request: float | None
    other_cores: float
    round: int = 0  # (a) and (b) run `--rounds` times; each round's ratios are its own pairs
    loop_ms_per_request: float | None = None  # of `cpu_ms_per_request`, the main thread's


_BENCH_LINE = re.compile(r"^BENCH (.*)$", re.M)


def run_wrk(url: str, script: Path, connections: int, duration: int) -> dict[str, int]:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "5s"]
    out = subprocess.run(
        [*argv, "-s", str(script), url + CHAT_PATH],
        capture_output=True, text=True, timeout=duration + 30, check=False,
    )  # fmt: skip
    match = _BENCH_LINE.search(out.stdout)
    if out.returncode != 0 or match is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout}\n{out.stderr}")
    return {k: int(v) for k, v in (item.split("=") for item in match.group(1).split())}


def measure(
    request: str,
    target: Service,
    services: Sequence[Service],
    script: Path,
    connections: int,
    duration: int,
) -> Run:
    """One wrk run, plus the CPU the target's own process (stub or proxy) spent per request."""
    with CpuMeter(target, services) as cpu:
        stats = run_wrk(target.url, script, connections, duration)
    requests = stats["requests"]
    errors = sum(stats[k] for k in ("connect", "read", "write", "status", "timeout"))
    return Run(
        request=request,
        connections=connections,
        target=target.name,
        rps=requests / (stats["duration_us"] / 1e6),
        p50_ms=stats["p50_us"] / 1000,
        p99_ms=stats["p99_us"] / 1000,
        requests=requests,
        errors=errors,
        cpu_ms_per_request=1000 * cpu.target_s / requests if requests else None,
        other_cores=cpu.other_cores,
        loop_ms_per_request=1000 * cpu.target_loop_s / requests if requests else None,
    )
