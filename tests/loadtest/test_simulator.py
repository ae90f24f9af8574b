"""The simulated vLLM replica: real servers on loopback ports, a real tokenizer, no mocks.

Engine behaviour is checked in simulated time (deterministic); wall time only bounds polls.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from loadtest.sim import (
    BatchShape,
    Faults,
    Profile,
    Replica,
    ReplicaOptions,
    Roofline,
    Scheduler,
    Sequence,
    cache_geometry,
    create_replica_app,
    load_profile,
    start_replica,
)
from loadtest.sim.cli import parse_faults
from loadtest.sim.engine import DecodeSpan, Engine
from loadtest.sim.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
)
from loadtest.sim.tokens import DEFAULT_TOKEN_TEXT, TokenizerEncoder, output_token_text
from tests.conftest import eventually

ROOT = Path(__file__).resolve().parents[2]

# A toy model on a toy chip: 405 KV layer-blocks, so a handful of requests over-commits it.
TINY: dict[str, Any] = {
    "name": "tiny",
    "served_model_name": "tiny",
    "hardware": {
        "name": "toy",
        "chips": 1,
        "peak_flops_per_chip": 1.0e12,
        "hbm_bytes_per_chip": 1_400_000,
        "hbm_bandwidth_per_chip": 1.0e11,
        "compute_efficiency": 0.5,
        "memory_efficiency": 0.8,
        "step_overhead_s": 0.001,
    },
    "model": {
        "name": "toy",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 6,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "vocab_size": 1000,
        "sliding_window": 64,
        "sliding_window_pattern": 3,
    },
    "serving": {
        "max_model_len": 2048,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 16,
        "gpu_memory_utilization": 1.0,
        "activation_reserve_bytes": 0,
    },
    "output_lengths": {"distribution": "uniform", "low": 5, "high": 60},
}

FAST = ReplicaOptions(time_scale=1000)  # a tiny-model request takes well under a wall second


def write_profile(directory: Path, **overrides: Any) -> Profile:
    spec = copy.deepcopy(TINY)
    for section, values in overrides.items():
        spec[section].update(values)
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_profile(path)


@pytest.fixture
def tiny(tmp_path: Path) -> Profile:
    return write_profile(tmp_path)


ReplicaFactory = Callable[..., Awaitable[Replica]]


@pytest.fixture
async def replicas() -> AsyncIterator[ReplicaFactory]:
    started: list[Replica] = []

    async def start(profile: Profile, options: ReplicaOptions = FAST) -> Replica:
        replica = await start_replica(profile, options)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        await replica.close()


def chat(model: str = "tiny", **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "review this listing"}]}
    return {**body, "max_tokens": 8, "ignore_eos": True, **extra}


def sse_events(raw: bytes) -> list[Any]:
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else orjson.loads(e[6:]) for e in events]


async def metric_families(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return {f.name: f for f in text_string_to_metric_families(await resp.text())}


def sample(families: dict[str, Any], name: str, **labels: str) -> float:
    for family in families.values():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {name} {labels}")


# -- wire format ----------------------------------------------------------------------------


async def test_chat_stream_has_role_tokens_finish_usage_and_done(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    replica = await replicas(tiny)
    body = chat(stream=True, stream_options={"include_usage": True})
    async with http.post(f"{replica.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-sim-stream-interval-ms"] == "50"
        events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    *chunks, usage, _ = events
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == DEFAULT_TOKEN_TEXT * 8
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 8
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 8


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_continuous_usage_stats_put_the_running_count_on_every_chunk(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession, path: str
) -> None:
    """As vLLM's `continuous_usage_stats`: each chunk (a chat's role chunk too, at 0) carries
    the output so far, the last chunk's is the final usage's; the gateway settles a stream the
    client leaves on it."""
    replica = await replicas(tiny)
    options = {"include_usage": True, "continuous_usage_stats": True}
    if path == "/v1/completions":
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    else:
        body = chat()
    body = {**body, "stream": True, "stream_options": options}
    async with http.post(f"{replica.url}{path}", json=body) as resp:
        events = sse_events(await resp.read())
    *chunks, final, _ = events
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    if path == "/v1/chat/completions":
        assert counts[0] == 0 and chunks[0]["usage"]["completion_tokens_details"] is None
    texts = [c["choices"][0].get("text") or c["choices"][0]["delta"].get("content") or ""
             for c in chunks]  # fmt: skip
    assert [len("".join(texts[: i + 1])) for i in range(len(texts))] == [
        n * len(DEFAULT_TOKEN_TEXT) for n in counts
    ]
    assert counts[-1] == final["usage"]["completion_tokens"] == 8
    prompt = final["usage"]["prompt_tokens"]
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"]
               for c in chunks)  # fmt: skip


async def test_completions_stream_without_include_usage_has_no_usage_chunk(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    replica = await replicas(tiny, ReplicaOptions(time_scale=1))
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": True, "ignore_eos": True}
    async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
        assert resp.headers["x-sim-stream-interval-ms"] == "0"
        events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 5  # time scale 1: one token per chunk, no packing
    assert all(c["object"] == "text_completion" and c["choices"] for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks] == [DEFAULT_TOKEN_TEXT] * 5
    assert "usage" not in chunks[-1]


async def test_non_streaming_usage_is_the_tokenizers_count(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession, tokenizer_dir: Path
) -> None:
    replica = await replicas(tiny, ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir))
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    messages = [
        {"role": "system", "content": "Product rules: no weapons, no counterfeit brands."},
        {"role": "user", "content": "Listing 7: lithium battery toy for children. " * 40},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected_chat = len(tok(rendered, add_special_tokens=False)["input_ids"])
    prompt = "seller rules " * 300  # long enough to be counted on the worker thread
    expected_prompt = len(tok(prompt)["input_ids"])
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "ignore_eos": True}
    async with http.post(f"{replica.url}/v1/chat/completions", json=body) as resp:
        answer = await resp.json()
    assert answer["object"] == "chat.completion"
    assert answer["usage"] == {
        "prompt_tokens": expected_chat,
        "completion_tokens": 3,
        "total_tokens": expected_chat + 3,
    }
    assert (
        answer["choices"][0]["message"]["content"] == TokenizerEncoder(tokenizer_dir).token_text * 3
    )
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
        answer = await resp.json()
    assert answer["object"] == "text_completion"
    assert answer["usage"]["prompt_tokens"] == expected_prompt
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
        assert (await resp.json())["usage"]["prompt_tokens"] == 3


async def _generated_texts(http: aiohttp.ClientSession, url: str, n: int) -> list[str]:
    """The text of n generated tokens from chat and completions, streamed and not."""
    texts = []
    for path, body in (
        ("chat/completions", chat(max_tokens=n)),
        ("completions", {"model": "tiny", "prompt": "review", "max_tokens": n, "ignore_eos": True}),
    ):
        async with http.post(f"{url}/v1/{path}", json=body) as resp:
            choice = (await resp.json())["choices"][0]
        texts.append(choice["message"]["content"] if "message" in choice else choice["text"])
        async with http.post(f"{url}/v1/{path}", json={**body, "stream": True}) as resp:
            events = sse_events(await resp.read())[:-1]
        parts = [c["choices"][0].get("delta", c["choices"][0]) for c in events]
        texts.append("".join(p.get("content", p.get("text", "")) for p in parts))
    return texts


@pytest.mark.parametrize("tokenizer", [True, False], ids=["tokenizer", "default"])
async def test_generated_text_re_tokenizes_to_one_token_per_generated_token(
    tiny: Profile,
    replicas: ReplicaFactory,
    http: aiohttp.ClientSession,
    tokenizer_dir: Path,
    tokenizer: bool,
) -> None:
    """Clients that re-count the text (aiperf, genai-perf) must count what `usage` says."""
    options = ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir if tokenizer else None)
    replica = await replicas(tiny, options)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for n in (1, 2, 7, 40):
        for text in await _generated_texts(http, replica.url, n):
            assert len(tok.encode(text, add_special_tokens=False)) == n, (n, text[:40])


def test_output_token_text_falls_back_to_the_vocabulary(tokenizer_dir: Path) -> None:
    """Without a common word in the vocabulary, some other entry that re-encodes to one token."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    class NoCommonWords:
        def __getattr__(self, name: str) -> Any:
            return getattr(tok, name)

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            ids = tok.encode(text, add_special_tokens=add_special_tokens)
            return ids + ids if set(text.split()) & {"the", "and", "of", "to", "in"} else ids

    text = output_token_text(NoCommonWords())
    assert text[0] == " " and text[1:].isalpha()
    assert text.strip() not in ("the", "and", "of", "to", "in")
    for n in (1, 2, 3, 10):
        assert len(tok.encode(text * n, add_special_tokens=False)) == n


async def test_output_length_is_drawn_without_ignore_eos_and_bounded_by_max_tokens(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    replica = await replicas(tiny)
    lengths, reasons = [], set()
    for _ in range(12):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 30}
        async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
            answer = await resp.json()
        lengths.append(answer["usage"]["completion_tokens"])
        reasons.add(answer["choices"][0]["finish_reason"])
    assert all(5 <= n <= 30 for n in lengths)  # the profile draws 5..60, max_tokens caps at 30
    assert len(set(lengths)) > 1
    assert reasons == {"stop", "length"}


async def test_models_and_health(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    options = ReplicaOptions(time_scale=1000, served_model_names=("tiny", "tiny-alias"))
    replica = await replicas(tiny, options)
    async with http.get(f"{replica.url}/v1/models") as resp:
        listing = await resp.json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["tiny", "tiny-alias"]
    assert listing["data"][0]["max_model_len"] == 2048
    async with http.get(f"{replica.url}/health") as resp:
        assert resp.status == 200
    async with http.post(f"{replica.url}/v1/chat/completions", json=chat("tiny-alias")) as resp:
        assert resp.status == 200


@pytest.mark.parametrize(
    ("body", "status", "kind", "param", "phrase"),
    [
        (chat("gemma-3-27b-it"), 404, "NotFoundError", "model", "does not exist"),
        (chat(max_tokens=2040), 400, "BadRequestError", "max_tokens", "is too large: 2040"),
        (
            {"model": "tiny", "prompt": list(range(2048)), "max_tokens": 1},
            400,
            "BadRequestError",
            "prompt",
            "maximum context length is 2048",
        ),
        ({"model": "tiny", "prompt": ["a", "b"]}, 400, "BadRequestError", "prompt", "batch"),
    ],
)
async def test_errors_in_vllms_shape(
    tiny: Profile,
    replicas: ReplicaFactory,
    http: aiohttp.ClientSession,
    body: dict[str, Any],
    status: int,
    kind: str,
    param: str,
    phrase: str,
) -> None:
    replica = await replicas(tiny)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with http.post(replica.url + path, json=body) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (kind, status)
    assert phrase in error["message"]
    # vLLM names no parameter when the prompt alone is too long.
    assert error["param"] == (None if "context" in phrase else param)


# -- metrics --------------------------------------------------------------------------------


async def test_metrics_have_vllms_names_types_labels_and_buckets(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    replica = await replicas(tiny)
    for _ in range(3):
        async with http.post(f"{replica.url}/v1/chat/completions", json=chat()) as resp:
            assert resp.status == 200
    families = await metric_families(http, replica.url)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
        for s in families[name].samples:
            assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0", name
    assert sample(families, "vllm:generation_tokens_total") == 24
    assert sample(families, "vllm:request_success_total", finished_reason="length") == 3
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    buckets = {
        "vllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN_BUCKETS,
        "vllm:inter_token_latency_seconds": INTER_TOKEN_LATENCY_BUCKETS,
        "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
        "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    }
    for name, bounds in buckets.items():
        les = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert les == [*bounds, float("inf")], name
    assert sample(families, "vllm:inter_token_latency_seconds_count") == 21  # 7 per request
    assert sample(families, "vllm:time_to_first_token_seconds_count") == 3


def test_bucket_boundaries_are_vllms() -> None:
    # vllm/v1/metrics/buckets.py; the endpoints guard against a transcription slip.
    assert (len(TIME_TO_FIRST_TOKEN_BUCKETS), TIME_TO_FIRST_TOKEN_BUCKETS[-1]) == (22, 2560.0)
    assert (len(INTER_TOKEN_LATENCY_BUCKETS), INTER_TOKEN_LATENCY_BUCKETS[-1]) == (19, 80.0)
    assert (len(REQUEST_LATENCY_BUCKETS), REQUEST_LATENCY_BUCKETS[-1]) == (21, 7680.0)


# -- the engine -----------------------------------------------------------------------------


async def test_over_committed_cache_preempts_and_every_request_still_completes(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    replica = await replicas(tiny)
    geometry = cache_geometry(tiny)
    # Ten sequences growing to 400 tokens need ten times 2 x 25 + 4 x 5 blocks: far over 405.
    assert 10 * geometry.units(399, 400) > geometry.capacity_units

    async def one() -> int:
        body = {"model": "tiny", "prompt": list(range(100)), "max_tokens": 300, "ignore_eos": True}
        async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
            return int((await resp.json())["usage"]["completion_tokens"])

    assert await asyncio.gather(*(one() for _ in range(10))) == [300] * 10
    families = await metric_families(http, replica.url)
    assert sample(families, "vllm:num_preemptions_total") > 0
    assert sample(families, "vllm:num_requests_running") == 0
    assert sample(families, "vllm:kv_cache_usage_perc") == 0
    assert sample(families, "vllm:prompt_tokens_total") == 1000  # recomputes are not recounted


def test_step_time_grows_with_batch_and_context() -> None:
    profile = load_profile("gemma-3-27b-tpu-v6e-2x2")
    roofline, window = Roofline(profile), profile.model.sliding_window or 0
    times = []
    for batch in (1, 8, 32, 64, 128, 256):
        shape = BatchShape()
        for _ in range(batch):
            shape.add(1000, 1, True, window)
        times.append(roofline.step_time(shape))
        compute, memory = roofline.terms(shape)
        assert memory > compute  # decode is bound by weight and KV reads
    assert times == sorted(times) and len(set(times)) == len(times)
    longer = BatchShape()
    for _ in range(64):
        longer.add(4000, 1, True, window)
    shorter = BatchShape()
    for _ in range(64):
        shorter.add(500, 1, True, window)
    assert roofline.step_time(longer) > roofline.step_time(shorter)
    prefill = BatchShape()
    prefill.add(0, 4000, True, window)
    compute, memory = roofline.terms(prefill)
    assert compute > memory  # prefill is bound by FLOPs
    assert 0.08 < roofline.step_time(prefill) < 0.16  # PERF_NOTES.md: about 0.12 s


def test_kv_geometry_of_the_bundled_models() -> None:
    # tpu-inference's page size for 128,000 tokens: 512 with 512 sequences, 64 with 64.
    assert cache_geometry(load_profile("gemma-3-27b-tpu-v6e-2x2")).block_size == 512
    assert cache_geometry(load_profile("gemma-3-27b-tpu-v6e-2x2-seqs64")).block_size == 64
    g27 = cache_geometry(load_profile("gemma-3-27b-tpu-v6e-2x2").with_serving(block_size=16))
    g12 = cache_geometry(load_profile("gemma-3-12b-tpu-v6e-2x2").with_serving(block_size=16))
    assert g27.block_bytes == 16 * 2 * 16 * 128 * 2  # 16 tokens x K,V x 16 heads x 128 x bf16
    assert g12.block_bytes == 16 * 2 * 8 * 256 * 2
    # vLLM pads 27B's 52 local layers to 6 groups of 10; 12B's 40 are 5 groups of 8.
    assert (g27.global_layers, g27.local_layers) == (10, 60)
    assert (g12.global_layers, g12.local_layers) == (8, 40)
    # Past the window a sequence stops growing on local layers: its 1024 tokens span 64 blocks
    # when aligned, 65 when not.
    assert g27.units(1999, 2000) == 10 * 125 + 60 * 64
    assert g27.units(2000, 2001) == 10 * 126 + 60 * 65
    assert g27.units(99, 100) == 70 * 7


def test_profile_checks_its_parameter_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="parameters"):
        write_profile(tmp_path, model={"reported_params": 10_000_000})
    with pytest.raises(ValueError, match="vLLM would refuse to start"):
        write_profile(tmp_path, hardware={"hbm_bytes_per_chip": 700_000})


def _run_to_completion(
    profile: Profile, fast_forward: bool, requests: list[tuple[int, int, int]]
) -> tuple[Scheduler, list[Sequence]]:
    scheduler = Scheduler(profile, fast_forward=fast_forward)
    seqs = [Sequence(i, p, m, t) for i, (p, m, t) in enumerate(requests)]
    scheduler.waiting.extend(seqs)
    clock = 0.0
    for _ in range(100_000):
        if not scheduler.has_work():
            break
        plan = scheduler.plan(clock, 1e9 if fast_forward else 0)
        assert plan is not None
        scheduler.commit(plan, plan.steps, clock)
        clock += plan.end(plan.steps)
    assert not scheduler.has_work()
    return scheduler, seqs


@pytest.mark.parametrize("seed", range(6))
def test_decode_spans_equal_step_by_step(tiny: Profile, seed: int) -> None:
    rng = random.Random(seed)
    requests = []
    for _ in range(40):
        max_tokens = rng.randint(1, 300)
        requests.append((rng.randint(1, 400), max_tokens, rng.randint(1, max_tokens)))
    fast, fast_seqs = _run_to_completion(tiny, True, requests)
    slow, slow_seqs = _run_to_completion(tiny, False, requests)
    assert fast.stats.steps == slow.stats.steps
    assert fast.stats.preemptions == slow.stats.preemptions > 0
    assert fast.stats.itl.counts == slow.stats.itl.counts
    for a, b in zip(fast_seqs, slow_seqs, strict=True):
        assert (a.generated, a.preemptions, a.finish_reason) == (
            b.generated,
            b.preemptions,
            b.finish_reason,
        )
        assert a.finished_at == pytest.approx(b.finished_at, rel=1e-9)
        assert a.first_token_at == pytest.approx(b.first_token_at, rel=1e-9)
    assert fast.free_units == slow.free_units == fast.geometry.capacity_units


def test_a_span_cut_short_leaves_the_state_of_as_many_steps(tiny: Profile) -> None:
    fast = Scheduler(tiny)
    seqs = [Sequence(i, 30 + 7 * i, 200, 200) for i in range(4)]
    fast.waiting.extend(seqs)
    clock = 0.0
    plan = fast.plan(clock, 1e9)
    while not isinstance(plan, DecodeSpan):  # prefill steps first
        assert plan is not None
        fast.commit(plan, 1, clock)
        clock += plan.end(1)
        plan = fast.plan(clock, 1e9)
    assert plan.steps > 10
    slow = copy.deepcopy(fast)
    slow.fast_forward = False
    fast.commit(plan, 10, clock)
    slow_clock = clock
    for _ in range(10):
        step = slow.plan(slow_clock, 0)
        assert step is not None
        slow.commit(step, 1, slow_clock)
        slow_clock += step.end(1)
    assert clock + plan.end(10) == pytest.approx(slow_clock, rel=1e-12)
    assert fast.free_units == slow.free_units
    state = [(s.computed, s.generated, s.units) for s in fast.running]
    assert state == [(s.computed, s.generated, s.units) for s in slow.running]


async def test_engine_clock_is_paced_and_monotonic(tiny: Profile) -> None:
    engine = Engine(tiny, time_scale=100, stream_interval_s=0.01)
    task = asyncio.create_task(engine.run())
    try:
        seq = engine.submit(50, 400, ignore_eos=True)
        readings = []
        while not seq.done:  # bounded: the request finishes in about 0.5 s of simulated time
            readings.append(engine.now())
            await seq.wait(any_token=True, limit_s=0.001)
        assert readings == sorted(readings)
        assert seq.arrival <= seq.scheduled_at <= seq.first_token_at <= seq.finished_at  # type: ignore[operator]
        assert seq.finished_at <= engine.now()  # type: ignore[operator]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# -- disconnects ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts_the_sequence_and_frees_its_blocks(
    tiny: Profile, replicas: ReplicaFactory, stream: bool
) -> None:
    replica = await replicas(tiny, ReplicaOptions(time_scale=20))
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2000, "ignore_eos": True}
    body["stream"] = stream
    async with aiohttp.ClientSession() as http:
        request = asyncio.create_task(http.post(f"{replica.url}/v1/completions", json=body))
        await eventually(lambda: replica.engine.num_running == 1)
        if stream:
            resp = await request
            await resp.content.readline()  # the stream is flowing
            resp.close()
        else:
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
    await eventually(lambda: replica.engine.num_running == 0)
    assert replica.engine.kv_cache_usage == 0
    assert replica.engine.stats.success["length"] == 0


# -- faults ---------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 503])
async def test_error_rate_fault(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession, status: int
) -> None:
    options = ReplicaOptions(time_scale=1000, faults=Faults(error_rate=1.0, error_status=status))
    replica = await replicas(tiny, options)
    async with http.post(f"{replica.url}/v1/chat/completions", json=chat()) as resp:
        assert resp.status == status
        assert (await resp.json())["error"]["code"] == status
    async with http.post(f"{replica.url}/admin/faults", json={"error_rate": 0.5}) as resp:
        assert (await resp.json())["faults"]["error_rate"] == 0.5
    statuses = []
    for _ in range(30):
        async with http.post(f"{replica.url}/v1/chat/completions", json=chat()) as resp:
            statuses.append(resp.status)
    assert set(statuses) == {200, 500}  # the default status; roughly half of each
    async with http.post(f"{replica.url}/admin/faults", json={}) as resp:
        assert (await resp.json())["faults"]["error_rate"] == 0
    async with http.post(f"{replica.url}/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200


async def test_stall_pauses_the_engine(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    replica = await replicas(tiny, ReplicaOptions(time_scale=100))
    async with http.post(f"{replica.url}/admin/faults", json={"stall_s": 30}) as resp:
        stalled_from = (await resp.json())["now_s"]
    async with http.post(f"{replica.url}/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200
    families = await metric_families(http, replica.url)
    ttft = sample(families, "vllm:time_to_first_token_seconds_sum")
    queued = sample(families, "vllm:request_queue_time_seconds_sum")
    assert replica.engine.now() >= stalled_from + 30
    assert ttft >= queued > 0  # it waited for the stall to end before its first step
    assert sample(families, "sim_faults_injected_total", fault="stall") == 1


async def test_slow_first_token_fault(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    faults = Faults(first_token_delay_s=20)
    replica = await replicas(tiny, ReplicaOptions(time_scale=100, faults=faults))
    body = chat(stream=True)
    async with http.post(f"{replica.url}/v1/chat/completions", json=body) as resp:
        assert sse_events(await resp.read())[-1] == "[DONE]"
    families = await metric_families(http, replica.url)
    assert sample(families, "vllm:time_to_first_token_seconds_sum") >= 20
    assert sample(families, "vllm:request_queue_time_seconds_sum") >= 20


async def test_reset_after_chunks_fault(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    options = ReplicaOptions(time_scale=1, faults=Faults(reset_after_chunks=3))
    replica = await replicas(tiny, options)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    received = b""
    with pytest.raises(aiohttp.ClientError):
        async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
            async for chunk in resp.content.iter_any():
                received += chunk
    assert received.count(b"data: ") == 3
    assert b"[DONE]" not in received
    await eventually(lambda: replica.engine.num_running == 0)
    assert replica.engine.stats.faults["reset"] == 1


async def test_refuse_connections_fault(
    tiny: Profile, replicas: ReplicaFactory, http: aiohttp.ClientSession
) -> None:
    replica = await replicas(tiny, ReplicaOptions(time_scale=100))
    async with http.post(f"{replica.url}/admin/faults", json={"refuse_for_s": 60}) as resp:
        assert resp.status == 200  # answered on the open connection
    async with aiohttp.ClientSession() as fresh:
        with pytest.raises(aiohttp.ClientConnectorError):
            async with fresh.get(f"{replica.url}/health"):
                pass

        async def listening() -> bool:
            try:
                async with fresh.get(f"{replica.url}/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectorError:
                return False

        async with asyncio.timeout(10):
            while not await listening():  # noqa: ASYNC110 - 60 simulated s are 0.6 wall s
                await asyncio.sleep(0.05)


async def test_refusing_needs_a_listener_the_simulator_owns(
    tiny: Profile, http: aiohttp.ClientSession
) -> None:
    from aiohttp import web

    runner = web.AppRunner(create_replica_app(tiny, FAST), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with http.post(f"{url}/admin/faults", json={"refuse_for_s": 1}) as resp:
            assert resp.status == 409
        async with http.post(f"{url}/admin/faults", json={"error_rate": 2}) as resp:
            assert resp.status == 400
        async with http.get(f"{url}/admin/faults") as resp:
            assert (await resp.json())["faults"] == Faults().model_dump()
    finally:
        await runner.cleanup()


def test_faults_argument_is_one_set_or_one_per_replica() -> None:
    assert parse_faults(None, 2) == [Faults(), Faults()]
    assert parse_faults('{"error_rate": 0.1}', 2) == [Faults(error_rate=0.1)] * 2
    assert parse_faults('[{}, {"stall_s": 5}]', 2)[1].stall_s == 5
    with pytest.raises(ValueError, match="2 fault sets for 3 replicas"):
        parse_faults("[{}, {}]", 3)
    with pytest.raises(ValueError):
        parse_faults('{"no_such_fault": 1}', 1)


# -- the command line -----------------------------------------------------------------------


def _free_port_pair() -> int:
    """A port P with P+1 also free (bound and released: a small race, loopback only)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return int(port)
    raise RuntimeError("no two consecutive free ports")


async def test_cli_serves_independent_replicas_on_consecutive_ports(
    http: aiohttp.ClientSession,
) -> None:
    port = _free_port_pair()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest.cli", "simulate",
        "--profile", "gemma-3-27b-tpu-v6e-2x2-seqs64", "--replicas", "2",
        "--base-port", str(port), "--time-scale", "100", "--faults", '[{}, {"error_rate": 1}]',
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            banner = await proc.stdout.readline()
            urls = [(await proc.stdout.readline()).decode().strip() for _ in range(2)]
        assert b"max_num_seqs 64" in banner
        assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        body = chat("gemma-3-27b-it")
        statuses = []
        for url in urls:
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                statuses.append(resp.status)
        assert statuses == [200, 500]
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await proc.wait() == 0
