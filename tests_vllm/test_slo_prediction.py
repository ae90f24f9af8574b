"""The latency model's error on real vLLM (issue 38, experiment (d)): how far each stream's
predicted TTFT and TPOT, as the access log records them, are from what it then saw.

A gateway fronts the session's vLLM with a pool that admits by latency and sends it streams of
mixed prompt lengths at a few concurrency levels, so the prefill ahead of a request and the batch
it joins vary. The model learns online from those same streams; each prediction is made at the
request's grant, before its own sample, so every error is a one-step-ahead one. After a warm-up,
the p50 TTFT error must be below that of the best constant predictor in hindsight (the one value
that minimises the p50 error over the very samples measured, which no real constant could know):
a model whose predictions ignore the load fails it. The figures are printed (`-s`) and recorded
(`record_property`) for docs/capacity.md.

TPOT is reported, not asserted: here the model predicts it worse than that constant. Its
features (the decode batch joined, the context it holds) leave out the prefill of the requests
that arrive while a stream decodes, which vLLM's chunked prefill runs in the same engine steps:
on this workload the stalls it causes, not the batch, set TPOT, and nothing known at the grant
foretells them. And on a busy 2-core machine a stream's tokens often reach the gateway in one
burst (vLLM's API server gets the CPU after its engine has run ahead), which reads as a TPOT of
zero.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson

from tests.conftest import accounted
from tests_vllm.conftest import vllm_policy

COMPLETIONS = "/v1/completions"
# Within one prefill chunk (vLLM's CPU default `max_num_batched_tokens`, 2,048) or just over,
# where the tiny model's prefill on a CPU is about linear in the prompt; far beyond it each chunk
# attends to all the ones before, so prefill grows faster than the prompt, which a model linear
# in the tokens ahead cannot follow.
PROMPT_TOKENS = (64, 512, 1024, 2048, 3072)
OUTPUT_TOKENS = (16, 64)
WARM_UP = ((4, 4),)
MEASURED = ((1, 10), (4, 6), (12, 3))
# Far beyond what vLLM takes here: no request is refused or reordered, and each is predicted
# all the same (a pool with `slo` predicts every grant; the access log shows it with an objective).
OBJECTIVE = {"ttft_ms": 60_000, "tpot_ms": 60_000}
# The seed: the tiny model alone on a 2-core CPU, roughly; the online fit corrects it to the
# machine the test runs on during the warm-up.
SEED = {
    "ttft_base_ms": 40.0,
    "ttft_per_1k_prefill_ms": 160.0,
    "ttft_per_running_ms": 2.0,
    "tpot_base_ms": 3.0,
    "tpot_per_running_ms": 1.0,
    "tpot_per_1k_context_ms": 0.1,
}
_FIRST_ID, _VOCABULARY = 3, 2000  # the tiny tokenizer's ids below 3 are its special tokens


async def _client(http: aiohttp.ClientSession, url: str, rng: random.Random, count: int) -> None:
    """`count` streams one after another, each of a prompt length and output drawn from `rng`;
    each prompt's token ids are drawn afresh, so vLLM's prefix cache holds none of it however
    often the test has run against this vLLM."""
    fresh = random.Random()
    for _ in range(count):
        prompt = [fresh.randrange(_FIRST_ID, _VOCABULARY) for _ in range(rng.choice(PROMPT_TOKENS))]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.choice(OUTPUT_TOKENS),
                "ignore_eos": True, "stream": True}  # fmt: skip
        async with http.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()


async def _levels(
    http: aiohttp.ClientSession, url: str, rng: random.Random, levels: Sequence[tuple[int, int]]
) -> int:
    """The streams of each level (clients, streams each), one level after another; how many."""
    for clients, count in levels:
        seeds = [rng.random() for _ in range(clients)]
        await asyncio.gather(*(_client(http, url, random.Random(s), count) for s in seeds))
    return sum(clients * count for clients, count in levels)


def _p90(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def _best_constant_p50(observed: Sequence[float]) -> float:
    """The smallest p50 absolute error any one constant makes on `observed`: the half-width of
    the shortest interval holding half of them, so it is reached at a midpoint of two of them."""
    midpoints = {(a + b) / 2 for a, b in itertools.combinations_with_replacement(observed, 2)}
    return min(statistics.median(abs(y - c) for y in observed) for c in midpoints)


def _errors(
    records: Sequence[dict[str, Any]],
    predicted: Callable[[dict[str, Any]], float],
    observed: Callable[[dict[str, Any]], float],
) -> dict[str, float]:
    """In milliseconds: the p50 and p90 of |predicted - observed|, the observed p50 and p90, and
    the best constant's p50 error."""
    seen = [observed(r) for r in records]
    errors = [abs(predicted(r) - y) for r, y in zip(records, seen, strict=True)]
    figures = {
        "p50_error": statistics.median(errors),
        "p90_error": _p90(errors),
        "observed_p50": statistics.median(seen),
        "observed_p90": _p90(seen),
        "best_constant_p50_error": _best_constant_p50(seen),
    }
    return {name: round(1000 * seconds, 2) for name, seconds in figures.items()}


def _tpot(record: dict[str, Any]) -> float:
    """The line's TPOT, as `llm_request_tpot_seconds` measures it."""
    return float(record["e2e_s"] - record["ttft_s"]) / (record["output_tokens"] - 1)


async def test_the_latency_model_predicts_vllm_ttft_better_than_any_constant(
    vllm, gateway_factory, http, record_property
) -> None:
    slo = {"objectives": {"standard": OBJECTIVE}, "model": SEED}
    gw = await gateway_factory(vllm_policy(vllm, max_concurrency=16, slo=slo))
    url, rng = gw.url + COMPLETIONS, random.Random(38)
    warm = await _levels(http, url, rng, WARM_UP)
    await accounted(gw, warm - 1)  # the warm-up's lines all before the measured ones
    measured = await _levels(http, url, rng, MEASURED)
    await accounted(gw, warm + measured - 1)
    records = [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()[warm:]]
    assert len(records) == measured
    assert all(r["predicted_ttft_s"] is not None and r["ttft_s"] is not None for r in records)

    figures = {
        "ttft": _errors(records, lambda r: r["predicted_ttft_s"], lambda r: r["ttft_s"]),
        "tpot": _errors(records, lambda r: r["predicted_tpot_s"], _tpot),
    }
    for objective, values in figures.items():
        for name, value in values.items():
            record_property(f"{objective}_{name}_ms", value)
        print(f"\n{objective} (ms, {len(records)} streams): {values}", end="")
    print()
    ttft = figures["ttft"]
    assert ttft["p50_error"] < ttft["best_constant_p50_error"], ttft
