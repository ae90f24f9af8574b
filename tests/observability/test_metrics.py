"""After traffic, /metrics holds every series alerts and the HPA read, with bounded labels."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.instruments import Instruments
from gateway.observability.registry import Declared, Declaring
from loadtest.tiny_tokenizer import WORDS
from tests.conftest import basic_policy

WORKLOAD = {"model": "tiny", "pool": "main", "class": "any"}


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


async def test_every_series_is_exported_with_its_labels(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url], max_concurrency=4))
    chat = {
        "model": "tiny-alias",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 5,
    }
    async with http.post(f"{gw.url}/v1/chat/completions", json={**chat, "stream": True}) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat) as resp:
        assert resp.status == 200
    async with http.post(f"{gw.url}/v1/chat/completions", json={**chat, "model": "nope"}) as resp:
        assert resp.status == 404
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        found = samples(await resp.text())

    for name, labels in (
        ("llm_request_e2e_seconds", WORKLOAD),
        ("llm_request_ttft_seconds", WORKLOAD),
        ("llm_request_tpot_seconds", WORKLOAD),
        ("llm_queue_wait_seconds", {**WORKLOAD, "tier": "standard"}),  # only tiers seen
    ):
        buckets = [s for s in found[f"{name}_bucket"] if s.labels["le"] == "+Inf"]
        assert [{k: v for k, v in s.labels.items() if k != "le"} for s in buckets] == [labels], name
    e2e_count = {s.labels["model"]: s.value for s in found["llm_request_e2e_seconds_count"]}
    assert e2e_count == {"tiny": 2.0}
    ttft_count = [s.value for s in found["llm_request_ttft_seconds_count"]]
    assert ttft_count == [1.0]  # only the stream shows a first token
    e2e_les = {float(s.labels["le"]) for s in found["llm_request_e2e_seconds_bucket"]}
    assert min(e2e_les) == 0.01 and max(e2e_les - {float("inf")}) == 600

    codes = {(s.labels["pool"], s.labels["code"]): s.value for s in found["llm_requests_total"]}
    assert codes == {("main", "200"): 2.0, ("none", "404"): 1.0}
    assert [(s.labels, s.value) for s in found["llm_rejections_total"]] == [
        ({"pool": "none", "reason": "model_not_found"}, 1.0)
    ]
    assert [s.value for s in found["llm_output_tokens_total"]] == [10.0]
    assert [s.labels for s in found["llm_input_tokens_total"]] == [WORKLOAD]

    replica = {"pool": "main", "replica": stub.url}
    assert [(s.labels, s.value) for s in found["llm_inflight_requests"]] == [(replica, 0.0)]
    assert [(s.labels, s.value) for s in found["llm_inflight_tokens"]] == [(replica, 0.0)]
    assert [(s.labels, s.value) for s in found["llm_queue_depth"]] == [
        ({"pool": "main", "tier": tier}, 0.0) for tier in ("critical", "standard", "sheddable")
    ]
    assert [(s.labels, s.value) for s in found["llm_pool_capacity"]] == [({"pool": "main"}, 4.0)]


async def test_health_answers_as_vllm_does(stub, gateway_factory, tokenizer_dir, http) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    async with http.get(f"{gw.url}/health") as resp:
        assert resp.status == 200 and await resp.read() == b""


async def test_health_and_readiness(stub, gateway_factory, tokenizer_dir, http) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    async with http.get(f"{gw.url}/healthz") as resp:
        assert resp.status == 200
    async with http.get(f"{gw.url}/readyz") as resp:
        assert resp.status == 200
        pools = (await resp.json())["pools"]
    assert pools == {
        "main": {
            "healthy": 1,
            "failing": 0,
            "ejected": 0,
            "unchecked": 0,
            "replicas": {stub.url: "healthy"},
        }
    }
    gw.gateway.draining = True
    async with http.get(f"{gw.url}/readyz") as resp:
        assert resp.status == 503
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "shutting_down"


async def scrape(http, gw) -> str:
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        return await resp.text()


async def test_counters_and_histograms_export_no_created_series(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat) as resp:
        assert resp.status == 200
    found = samples(await scrape(http, gw))
    assert "llm_requests_total" in found and "llm_request_e2e_seconds_count" in found
    assert [name for name in found if name.endswith("_created")] == []


async def test_state_backend_up_reads_1_in_memory_mode_and_says_so(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    text = await scrape(http, gw)
    assert "llm_state_backend_up 1.0" in text.splitlines()
    help_line = next(
        line for line in text.splitlines() if line.startswith("# HELP llm_state_backend_up")
    )
    assert "memory" in help_line  # 1 in memory mode is not a claim that Redis is in use


async def test_each_model_says_which_library_counts_it(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["models"]["rough"] = {"tokenizer": "estimate", "max_model_len": 4096}
    gw = await gateway_factory(policy)
    found = samples(await scrape(http, gw))["llm_token_counter_info"]
    assert {(s.labels["model"], s.labels["backend"], s.value) for s in found} == {
        ("tiny", "fastokens", 1.0),
        ("rough", "estimate", 1.0),
    }


async def test_the_tokenizer_threads_say_how_busy_they_are(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    """A text over `inline_tokenize_max_chars` is counted on the small pool's threads: its job,
    CPU and wait show there; a short one stays on the event loop and is no job."""
    policy = {
        **basic_policy(tokenizer_dir, [stub.url]),
        "server": {"tokenizer_threads": 3, "inline_tokenize_max_chars": 256},
    }
    gw = await gateway_factory(policy)

    async def send(text: str) -> dict[str, dict[str, float]]:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200
        found = samples(await scrape(http, gw))
        return {
            name: {s.labels["size"]: s.value for s in found[name]}
            for name in (
                "llm_tokenizer_threads",
                "llm_tokenizer_jobs_total",
                "llm_tokenizer_cpu_seconds_total",
                "llm_tokenizer_busy_seconds_total",
                "llm_tokenizer_wait_seconds_total",
            )
        }

    short = await send("hello")
    assert short["llm_tokenizer_threads"] == {"small": 3.0, "large": 3.0}
    assert short["llm_tokenizer_jobs_total"] == {"small": 0.0, "large": 0.0}
    long = await send(" ".join(WORDS[n % len(WORDS)] for n in range(200)))
    assert long["llm_tokenizer_jobs_total"] == {"small": 1.0, "large": 0.0}
    assert long["llm_tokenizer_cpu_seconds_total"]["small"] > 0
    assert long["llm_tokenizer_busy_seconds_total"]["small"] > 0
    assert long["llm_tokenizer_wait_seconds_total"]["small"] >= 0
    assert long["llm_tokenizer_cpu_seconds_total"]["large"] == 0


async def test_no_tokenizer_thread_series_when_every_count_is_estimated(
    stub, gateway_factory, http
) -> None:
    policy = basic_policy("estimate", [stub.url])
    gw = await gateway_factory(policy)
    found = samples(await scrape(http, gw))
    assert not [name for name in found if name.startswith("llm_tokenizer_")]


async def test_a_gateway_with_every_feature_exports_exactly_the_declared_families(
    stub, gateway_factory, tokenizer_dir, http, tmp_path: Path
) -> None:
    """What each collector fills at a scrape is what it declares: the same families, types, help
    texts and label names, so docs/metrics-reference.md (rendered from the declarations) lists
    what a scrape shows. Prefix and precise-prefix scorers, tokenizer threads and two counting
    libraries, and a pool with `slo`, make every family appear."""
    policy = {
        **basic_policy(tokenizer_dir, [stub.url], pick={"scorers": {"prefix": 1}}, slo={}),
        "server": {"tokenizer_threads": 2},
    }
    kv_events = {"weight": 1, "endpoint": f"ipc://{tmp_path}/kv-{{port}}"}
    policy["pools"]["precise"] = {
        "model": "tiny",
        "replicas": [stub.url],
        "max_concurrency": 8,
        "pick": {"scorers": {"precise_prefix": kv_events}},
    }
    policy["models"]["rough"] = {"tokenizer": "estimate", "max_model_len": 4096}
    gw = await gateway_factory(policy)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat) as resp:
        assert resp.status == 200

    exported = {}
    for family in text_string_to_metric_families(await scrape(http, gw)):
        label_sets = {tuple(k for k in s.labels if k != "le") for s in family.samples}
        exported[family.name] = (family.type, family.documentation, label_sets)
    declared = {
        d.name: (d().type, d.help, {tuple(sorted(d.labels))})
        for d in gw.gateway.accountant.metrics.registry.declared()
    }
    assert exported.keys() == declared.keys()
    for name, (kind, documentation, label_sets) in exported.items():
        assert (kind, documentation) == declared[name][:2], name
        assert {tuple(sorted(labels)) for labels in label_sets} <= declared[name][2], name


def test_the_registry_takes_only_collectors_that_declare_their_families() -> None:
    class Undeclared:
        def collect(self) -> list[Metric]:
            return [GaugeMetricFamily("llm_undeclared", "A family no reference would list.")]

    with pytest.raises(TypeError, match="Undeclared declares no families"):
        Instruments().registry.register(Undeclared())


class _Witness(Declaring):
    """A collector that notes how many turns the loop had taken when it was collected, and the
    thread that wrote its family out."""

    def __init__(self, name: str, turns: list[int]) -> None:
        self.turns = turns
        self.declared = (Declared(GaugeMetricFamily, name, "A witness."),)
        self.seen_at: int | None = None
        self.written_on: set[int] = set()

    def collect(self) -> list[Metric]:
        self.seen_at = self.turns[0]
        witness, family = self, self.declared[0]()

        class Noted(GaugeMetricFamily):
            @property  # type: ignore[override]
            def samples(self) -> list:
                witness.written_on.add(threading.get_ident())
                return family.samples

            @samples.setter
            def samples(self, value: list) -> None:
                pass

        noted = Noted(family.name, family.documentation, value=1)
        self.written_on.clear()  # building it read its samples too
        return [noted]


async def test_a_scrape_lets_the_loop_run_between_collectors_and_writes_off_it(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    """A busy gateway's scrape is long to build and longer to write: the loop must not wait for
    all of it at once, nor for any writing."""
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    turns = [0]
    first, second = _Witness("llm_witness_a", turns), _Witness("llm_witness_b", turns)
    registry = gw.gateway.accountant.metrics.registry
    registry.register(first)
    registry.register(second)

    async def ticking() -> None:
        while True:
            turns[0] += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(ticking())
    try:
        async with http.get(f"{gw.metrics_url}/metrics") as resp:
            assert resp.status == 200
            found = samples(await resp.text())
    finally:
        ticker.cancel()
    assert found["llm_witness_a"][0].value == found["llm_witness_b"][0].value == 1
    assert first.seen_at is not None and second.seen_at is not None
    assert second.seen_at > first.seen_at  # the loop took a turn between the two
    assert first.written_on and threading.get_ident() not in first.written_on | second.written_on
