"""The parts of `loadtest.bench_overhead`: what the gateway costs over the cheapest proxy.

`python -m loadtest.bench_overhead` (its docstring says what is measured and why) is the entry
point; each module here is one part of a run, and imports only the ones above it:

- `bodies`: the requests, (a) short, (b) classification, (c) stream, (d)/(e) prose.
- `fleet`: the processes (stub replica, pass-through, gateways, Redis), started, checked and
  stopped, and the CPU they spend (`CpuMeter`).
- `policy`: the gateway's policy for the run, and `explain`, the gateway's own view of a body.
- `wrk`: (a) and (b), wrk runs and their Lua scripts.
- `paired`: (a) at one connection, the targets side by side (`loadtest.paired_latency`).
- `ttfb`: (c), time to the first byte of a stream, and the client that measures it.
- `counting`: (d), (e), (f), counting on real tokenizers against each library alone.
- `report`: the Markdown report and its verdicts.
- `run`: one whole run, in order.

`loadtest.bench_ab`, `loadtest.bench_endpoints`, `loadtest.bench_instructions`,
`loadtest.bench_vllm`, `loadtest.soak` and `loadtest.paired_latency` reuse `fleet`, `policy`,
`bodies`, `wrk`, `paired` and `ttfb`.
"""
