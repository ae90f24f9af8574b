"""The generative adversary: seeded random traffic and a lying replica against the real gateway.

Issue 35's promises (docs/architecture.md, "What the gateway promises") are checked after every
run against what the harness itself saw, never against the gateway's own view alone:

- `replica.py`, a scripted vLLM look-alike on loopback that, per request, tells the truth or lies
  as the harness scripted it (usage missing, negative, huge, understated; multi-token chunks;
  thousands of tiny usage-bearing events; redirects; hangs; resets; a 500) and keeps a ledger
  of what it really produced, its prompts counted by `transformers` with each model's own chat
  template;
- `endpoints.py`, the endpoints drawn: every one the gateway registers, or why not;
- `generator.py`, the seeded sequences of requests (every endpoint, random shapes, tenants and
  client behaviours), replayable from the printed seed; `uploads.py`, multipart bodies;
- `harness.py`, the processes (one gateway, or two sharing a `redis-server` that is stopped and
  restarted mid-run, or a pod of two workers sharing one: `serve --workers 2`) and a `/healthz`
  ticker in its own process; `slow_link.py`, the gateways'
  link to that Redis, which holds its replies for a spell;
- `checks.py`, Q (quota), C (count), L (loop) and S (slots), and R (the refusals drawn), each
  failure naming the promise, the seed and the offending requests.

    python -m loadtest.adversary --seed 7 --seconds 60 [--gateways 2] [--workers 2] [--out loadtest/out/...]
"""
