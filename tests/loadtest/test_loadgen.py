"""The load generator against real stub replicas and the real gateway on loopback ports."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from transformers import AutoTokenizer

from gateway.config.schema import PoolSpec
from loadtest.loadgen import cli
from loadtest.loadgen.knee import KneeParams, find_knee, policy_snippet
from loadtest.loadgen.profile import build_profile, concurrency, read_access_log, table
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.prompts import PromptBuilder
from loadtest.loadgen.roundrobin import create_roundrobin_app
from loadtest.loadgen.runner import RequestRecord, run_level
from loadtest.loadgen.stats import (
    Curve,
    Point,
    Quantiles,
    jump_flags,
    normalise,
    percentile,
    summarize,
)
from loadtest.loadgen.sweep import SweepConfig, Target, run_sweep, session
from loadtest.loadgen.workloads import (
    BUILTIN,
    Fixed,
    Planned,
    Workload,
    WorkloadClass,
    dump_workload,
    load_workload,
)
from tests.conftest import RunningGateway, Stub, basic_policy, eventually

StubFactory = Callable[..., Awaitable[Stub]]
GatewayFactory = Callable[[dict[str, Any]], Awaitable[RunningGateway]]

USERS = (16, 32, 64, 128)
# The article's normalised throughput (generation, 12B and 27B), used as synthetic curves.
GEN_12B = (1.00, 1.98, 2.96, 8.19)
GEN_27B = (1.05, 1.97, 4.00, 4.12)
QUIET = Progress(live=False)


def small_workload(name: str = "small") -> Workload:
    """The article's two classes at a size a stub answers at once."""
    return Workload(
        name=name,
        classes=[
            WorkloadClass(name="classification", isl=Fixed(value=300), osl=Fixed(value=2)),
            WorkloadClass(name="generation", isl=Fixed(value=60), osl=Fixed(value=20)),
        ],
    )


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def builder(tokenizer_dir: Path) -> PromptBuilder:
    return PromptBuilder(tokenizer_dir)


def chat_tokens(hf: Any, text: str) -> int:
    messages = [{"role": "user", "content": text}]
    return len(hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


# --- prompts: exact input length with the real tokenizer ---------------------------------------


def test_chat_prompts_have_exactly_the_planned_tokens(hf: Any, builder: PromptBuilder) -> None:
    lengths = [20, 21, 57, 500, 999, 4000, 4001, 12000]
    texts = builder.texts([("chat", n) for n in lengths])
    assert [chat_tokens(hf, t) for t in texts] == lengths
    assert len(set(texts)) == len(texts)  # unique: no prefix shared with another request


def test_completion_prompts_have_exactly_the_planned_tokens(
    hf: Any, builder: PromptBuilder
) -> None:
    lengths = [8, 9, 10, 333, 4000]
    texts = builder.texts([("completions", n) for n in lengths])
    assert [len(hf(t)["input_ids"]) for t in texts] == lengths


def test_without_a_tokenizer_prompts_are_four_characters_a_token() -> None:
    (text,) = PromptBuilder().texts([("chat", 250)])
    assert len(text) == 1000


def test_a_prompt_below_the_templates_own_tokens_is_refused(builder: PromptBuilder) -> None:
    with pytest.raises(ValueError, match="overhead"):
        builder.texts([("chat", 3)])


# --- a sweep against a stub replica -----------------------------------------------------------


async def test_sweep_sends_exact_prompts_and_fixes_outputs_with_ignore_eos(
    stub_factory: StubFactory, tokenizer_dir: Path, hf: Any
) -> None:
    stub = await stub_factory()
    config = SweepConfig(
        targets=(Target(stub.url, "tiny", str(tokenizer_dir)),),
        workloads=(small_workload(),),
        users=(2,),
        requests_per_level=10,
    )
    result = await run_sweep(config, QUIET)
    shapes = {2: 300, 20: 60}  # small_workload's OSL -> ISL
    records = result.series[0].levels[0][1].records
    assert len(stub.stats.bodies) == len(records) == 10
    for body in stub.stats.bodies:
        assert body["max_tokens"] in shapes and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert chat_tokens(hf, body["messages"][0]["content"]) == shapes[body["max_tokens"]]
    for rec in records:
        assert rec.ok and rec.output_tokens == rec.osl  # from the usage chunk
        assert rec.ttft_s is not None and rec.tpot_s is not None


async def test_completions_endpoint_and_no_stream(stub_factory: StubFactory) -> None:
    stub = await stub_factory()
    config = SweepConfig(
        targets=(Target(stub.url, "tiny"),),
        workloads=(small_workload().with_endpoint("completions"),),
        users=(1,),
        requests_per_level=3,
        stream=False,
    )
    result = await run_sweep(config, QUIET)
    assert all("prompt" in b and b["stream"] is False for b in stub.stats.bodies)
    records = result.series[0].levels[0][1].records
    assert all(r.ok and r.output_tokens == r.osl and r.ttft_s is None for r in records)


async def test_open_loop_is_bounded_by_duration_and_request_count(
    stub_factory: StubFactory,
) -> None:
    stub = await stub_factory()
    config = SweepConfig(
        targets=(Target(stub.url, "tiny"),),
        workloads=(small_workload(),),
        rates=(50.0,),
        duration_s=0.4,
        requests_per_level=12,
    )
    planned = config.planned(small_workload(), 50.0)
    assert 0 < len(planned) <= 12
    assert all(p.at is not None and p.at < 0.4 for p in planned)
    result = await run_sweep(config, QUIET)
    (curve,) = [c for c in result.curves() if c.cls is None]
    assert curve.kind == "rate" and curve.levels[0][1].completed == len(planned)


async def test_the_deadline_leaves_requests_unfinished_not_failed(
    stub_factory: StubFactory,
) -> None:
    stub = await stub_factory(delay_s=30)
    planned = [Planned("generation", "chat", 60, 5)] * 3
    bodies = PromptBuilder().bodies("tiny", planned, stream=True)
    async with session(5) as http:
        run = await run_level(http, stub.url, planned, bodies, 3, 0.3, True, QUIET)
    stats = summarize(run.records, run.duration_s)
    assert (stats.unfinished, stats.sent, stats.failed) == (3, 0, {})
    await eventually(lambda: stub.stats.disconnects == 3)  # the replica stops generating


async def test_failures_are_counted_by_status(stub_factory: StubFactory) -> None:
    stub = await stub_factory(status=503)
    config = SweepConfig(
        targets=(Target(stub.url, "tiny"),),
        workloads=(small_workload(),),
        users=(2,),
        requests_per_level=4,
    )
    result = await run_sweep(config, QUIET)
    stats = result.curves()[0].levels[0][1]
    assert (stats.completed, stats.failed, stats.completion_rate) == (0, {"503": 4}, 0.0)


# --- statistics ----------------------------------------------------------------------------------


def test_percentiles_interpolate_between_closest_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
    assert Quantiles.of([None, 2.0, 1.0]) == Quantiles(1.5, 1.95, 1.99)


def record(e2e: float = 1.0, status: int = 200, out: int = 10) -> RequestRecord:
    return RequestRecord(0, "c", "chat", isl=100, osl=out, start_s=0.0, status=status,
                         ttft_s=e2e / 4, e2e_s=e2e, input_tokens=100, output_tokens=out)  # fmt: skip


def test_level_stats_count_what_completed() -> None:
    records = [record(e2e=float(i)) for i in range(1, 9)]
    records += [record(status=429), record(status=429)]
    records.append(RequestRecord(0, "c", "chat", 100, 10, 0.0, error="unfinished"))
    stats = summarize(records, duration_s=4.0)
    assert (stats.sent, stats.completed, stats.unfinished) == (10, 8, 1)
    assert stats.failed == {"429": 2}
    assert stats.completion_rate == pytest.approx(0.8)
    assert stats.rps == pytest.approx(2.0)
    assert stats.output_tps == pytest.approx(20.0)
    assert stats.tpm == pytest.approx((8 * 110) / 4 * 60)
    assert stats.isl_exact == 8
    assert stats.e2e.p50 == pytest.approx(4.5)


def test_time_scale_reads_in_simulated_time() -> None:
    stats = summarize([record(e2e=0.1)] * 4, duration_s=1.0, time_scale=10)
    assert stats.e2e.p95 == pytest.approx(1.0)
    assert stats.rps == pytest.approx(0.4)


def curve(model: str, throughput: tuple[float, ...], workload: str = "generation") -> Curve:
    """A closed-loop curve whose latency follows from Little's law: E2E = users / throughput."""
    c = Curve(model, "http://127.0.0.1:1", workload, None, "users")
    for users, x in zip(USERS, throughput, strict=True):
        e2e = users / (x * 10)
        completed = 400
        records = [record(e2e=e2e)] * completed
        c.levels.append((users, summarize(records, duration_s=completed / (x * 10))))
    return c


def test_normalised_table_is_relative_to_the_first_model_at_the_baseline_level() -> None:
    table = normalise([curve("12b", GEN_12B), curve("27b", GEN_27B)], baseline=16)
    assert [round(table.throughput["27b generation"][u] or 0, 2) for u in USERS] == list(GEN_27B)
    assert [round(table.throughput["12b generation"][u] or 0, 2) for u in USERS] == list(GEN_12B)
    assert table.references["27b generation"] == "12b generation @ 16"


def test_normalised_table_falls_back_to_the_lowest_level() -> None:
    table = normalise([curve("12b", GEN_12B)], baseline=8)
    assert table.references["12b generation"] == "12b generation @ 16"


def points(throughput: tuple[float, ...], **override: tuple[float, ...]) -> list[Point]:
    """Closed-loop levels at USERS: E2E from Little's law, `override` replaces fields per level."""
    out = []
    for i, (users, x) in enumerate(zip(USERS, throughput, strict=True)):
        point = Point(users, x, x * 1000, 4 * users, 1.0, e2e_p95=users / x, tpot_p95=None)
        out.append(dataclasses.replace(point, **{k: v[i] for k, v in override.items()}))
    return out


def test_the_articles_12b_jump_at_128_users_is_flagged() -> None:
    (flag,) = jump_flags("12b generation", points(GEN_12B), "users")
    assert (flag.load_from, flag.load_to) == (64, 128)
    assert "more than proportional" in flag.reasons[0]
    assert jump_flags("27b generation", points(GEN_27B), "users") == []


def test_a_jump_with_shorter_outputs_or_more_failures_is_flagged() -> None:
    x = (1.0, 2.0, 4.0, 8.0)
    shorter = points(x, output_tps=(1000, 2000, 4000, 5000))
    assert "requests got shorter" in jump_flags("a", shorter, "users")[0].reasons[0]
    failing = points(x, completion_rate=(1.0, 1.0, 1.0, 0.9))
    assert "completion rate fell" in jump_flags("a", failing, "users")[0].reasons[0]
    transient = points(x, completed=(64, 128, 256, 100))
    assert "start-up transient" in jump_flags("a", transient, "users")[0].reasons[0]
    assert jump_flags("a", points(x), "users") == []


# --- knee ----------------------------------------------------------------------------------------


def test_a_linear_curve_has_no_knee() -> None:
    knee = find_knee(points((1.0, 2.0, 4.0, 8.0)))
    assert knee.knee is None and knee.max_concurrency == 128
    assert "sweep higher" in knee.reason


def test_a_curve_that_plateaus_after_64_users_caps_at_64() -> None:
    knee = find_knee(points((1.0, 2.0, 4.0, 4.2)))
    assert (knee.knee, knee.max_concurrency) == (64, 64)
    assert find_knee(points(GEN_27B)).max_concurrency == 64  # the article's own choice


def test_the_knee_is_divided_among_the_replicas_behind_the_target() -> None:
    assert find_knee(points((1.0, 2.0, 4.0, 4.2)), replicas=4).max_concurrency == 16


def test_flat_throughput_without_rising_latency_is_no_knee() -> None:
    flat = points((1.0, 2.0, 2.1, 4.2), e2e_p95=(1.0, 1.0, 1.0, 1.0))
    assert find_knee(flat).knee is None


def test_batching_that_gains_more_throughput_than_latency_is_no_knee() -> None:
    # Gemma 3 12B generation in the simulator: each doubling still pays, no knee up to 128.
    gen_12b = points((1.85, 3.25, 5.26, 7.60), e2e_p95=(8.7, 9.8, 12.2, 16.9))
    knee = find_knee(gen_12b)
    assert (knee.knee, knee.max_concurrency) == (None, 128)
    assert knee.reason.startswith("no knee up to 128 users")


def test_a_tail_that_grows_faster_than_throughput_marks_the_knee() -> None:
    # The same gain from 64 to 128 users, but queueing behind a KV-cache wall doubles P95.
    gen_27b = points((1.07, 1.94, 3.24, 4.74), e2e_p95=(14.9, 16.5, 19.8, 39.2))
    knee = find_knee(gen_27b)
    assert (knee.knee, knee.max_concurrency) == (64, 64)
    assert "grew 1.46x while P95 E2E grew 1.98x" in knee.reason


def test_the_tolerance_ignores_a_small_fall_in_power() -> None:
    noisy = points((1.0, 2.0, 4.0, 3.8), e2e_p95=(1.0, 1.0, 1.0, 1.0))  # 64 -> 128: power -5%
    assert find_knee(noisy).knee == 64
    assert find_knee(noisy, KneeParams(tolerance=0.1)).knee is None


def test_a_knee_at_the_lowest_level_asks_for_a_lower_sweep() -> None:
    knee = find_knee(points((1.0, 1.1, 1.15, 1.2)))
    assert knee.knee == 16 and "sweep lower" in knee.reason


def test_the_policy_snippet_is_a_valid_gateway_pool() -> None:
    knee = find_knee(points((1.0, 2.0, 4.0, 4.2)))
    snippet = policy_snippet(knee, "gen-27b", "gemma-3-27b-it", ["http://127.0.0.1:8000"])
    pool = PoolSpec.model_validate(yaml.safe_load(snippet)["pools"]["gen-27b"])
    assert pool.max_concurrency == 64 and snippet.startswith("# from 64 to 128 users")


# --- profile -------------------------------------------------------------------------------------


def test_concurrency_is_time_weighted_over_overlapping_intervals() -> None:
    # 0-1: one request; 1-3: two; 3-4: one (of 4 seconds, 2 at concurrency 2)
    q = concurrency([(0.0, 3.0), (1.0, 4.0)])
    assert (q.p50, q.p95, q.p99) == (1, 2, 2)
    assert concurrency([(0.0, 1.0), (1.0, 2.0)]).p99 == 1  # back to back is not overlap


async def test_profile_of_the_gateways_log_replays_as_a_workload(
    stub_factory: StubFactory, gateway_factory: GatewayFactory, tokenizer_dir: Path, tmp_path: Path
) -> None:
    stub = await stub_factory()
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    config = SweepConfig(
        targets=(Target(gw.url, "tiny", str(tokenizer_dir)),),
        workloads=(small_workload(),),
        users=(3,),
        requests_per_level=12,
    )
    await run_sweep(config, QUIET)
    log = tmp_path / "access.jsonl"
    log.write_bytes(gw.access_log.getvalue())
    out = tmp_path / "production.yaml"
    assert await asyncio.to_thread(cli.main, ["profile", str(log), "--out", str(out)]) == 0

    workload = load_workload(out)
    (cls,) = workload.classes  # basic_policy: one pool, one class
    assert cls.name == "main/any" and cls.weight == 12
    profile = build_profile(read_access_log(log))
    assert sorted(set(profile.groups[0].isl_values)) == [60, 300]  # the gateway counts exactly
    assert sorted(set(profile.groups[0].osl_values)) == [2, 20]
    assert workload.users and max(workload.users) <= 3

    replay = await stub_factory()
    config = SweepConfig(
        targets=(Target(replay.url, "tiny", str(tokenizer_dir)),),
        workloads=(workload,),
        users=(2,),
        requests_per_level=6,
    )
    result = await run_sweep(config, QUIET)
    assert all(r.ok for r in result.series[0].levels[0][1].records)
    assert {b["max_tokens"] for b in replay.stats.bodies} <= {2, 20}


def test_profile_reports_the_output_requests_produced_zero_included() -> None:
    """Issue 36 item 13: `profile` showed OSL 1 for embeddings (a placeholder) and, for a chat
    that stopped at once, the gateway's expectation instead of the 0 it produced."""

    def line(cls: str, endpoint: str, output: int, expected: int) -> dict[str, object]:
        return {"pool": "p", "class": cls, "endpoint": endpoint, "input_tokens": 50, "status": 200,
                "output_tokens": output, "expected_output_tokens": expected}  # fmt: skip

    records = [line("embed", "embeddings", 0, 0)] * 3 + [
        line("chat", "chat", 0, 40),
        line("chat", "chat", 30, 40),
        {**line("chat", "chat", 0, 40), "status": 429, "output_tokens": None},
    ]
    profile = build_profile(records)
    osl = {g.cls: sorted(g.osl_values) for g in profile.groups}
    assert osl == {"chat": [0, 30, 40], "embed": [0, 0, 0]}
    assert "| p | embed | 3 | 50 / 50 / 50 | 0 / 0 / 0 |" in table(profile)
    classes = {c.name: c for c in profile.to_workload("w").classes}
    assert classes["p/chat"].osl.values == [1, 30, 40]  # type: ignore[union-attr]


def test_a_workload_file_round_trips(tmp_path: Path) -> None:
    text = """
name: prod
users: [4, 8]
classes:
  - {name: a, weight: 3, isl: {type: normal, mean: 400, std: 50, max: 600}, osl: 10}
  - {name: b, endpoint: completions, isl: {type: lognormal, median: 500, sigma: 0.5},
     osl: {type: empirical, values: [5, 6, 7]}}
"""
    path = tmp_path / "prod.yaml"
    path.write_text(text)
    workload = load_workload(path)
    assert load_workload(dump_workload(workload, tmp_path / "again.yaml")) == workload
    assert load_workload("mixed") == BUILTIN["mixed"]
    with pytest.raises(FileNotFoundError, match="classification, generation, mixed"):
        load_workload("nonsense")


# --- reports and compare through the command line -----------------------------------------------


async def test_sweep_command_writes_json_csv_markdown_and_plots(
    stub_factory: StubFactory, tokenizer_dir: Path, tmp_path: Path
) -> None:
    stub = await stub_factory()
    out = tmp_path / "report"
    argv = ["sweep", "--target", stub.url, "--model", "tiny", "--tokenizer", str(tokenizer_dir),
            "--users", "1,2", "--requests-per-level", "3", "--baseline-level", "1",
            "--out", str(out)]  # fmt: skip
    assert await asyncio.to_thread(cli.main, argv) == 0

    results = json.loads((out / "results.json").read_text())
    labels = [c["label"] for c in results["curves"]]
    assert labels == ["tiny classification", "tiny generation"]  # the default: both, apart
    assert set(results["knees"]) == set(labels)
    with (out / "levels.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4  # 2 curves x 2 levels
    with (out / "requests.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 12
    report = (out / "report.md").read_text()
    assert "## Normalised throughput" in report and "max_concurrency:" in report
    for png in ("throughput.png", "latency.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
async def roundrobin(stub_factory: StubFactory) -> AsyncIterator[tuple[str, list[Stub]]]:
    stubs = [await stub_factory(), await stub_factory()]
    runner = web.AppRunner(create_roundrobin_app([s.url for s in stubs]), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", stubs
    await runner.cleanup()


async def test_roundrobin_alternates_and_streams(
    roundrobin: tuple[str, list[Stub]], http: aiohttp.ClientSession
) -> None:
    url, stubs = roundrobin
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    for _ in range(4):
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    assert [s.stats.requests for s in stubs] == [2, 2]


async def test_compare_runs_round_robin_then_the_gateway(
    stub_factory: StubFactory, gateway_factory: GatewayFactory, tokenizer_dir: Path, tmp_path: Path
) -> None:
    stubs = [await stub_factory(), await stub_factory()]
    gw = await gateway_factory(basic_policy(tokenizer_dir, [s.url for s in stubs]))
    workload = dump_workload(small_workload("mix"), tmp_path / "mix.yaml")
    out = tmp_path / "compare"
    argv = ["compare", "--replicas", ",".join(s.url for s in stubs), "--gateway", gw.url,
            "--model", "tiny", "--tokenizer", str(tokenizer_dir), "--workload", str(workload),
            "--rate", "40", "--duration", "0.5", "--requests", "16",
            "--slo", "generation:ttft=5,tpot=1", "--out", str(out)]  # fmt: skip
    assert await asyncio.to_thread(cli.main, argv) == 0

    result = orjson.loads((out / "compare.json").read_bytes())
    assert list(result["outcomes"]) == ["round-robin", "gateway"]
    for rows in result["outcomes"].values():
        assert [r["cls"] for r in rows] == ["all", "classification", "generation"]
        assert rows[0]["stats"]["sent"] == len(result["requests"]["round-robin"])
    assert result["goodput_ratio"] is not None
    # Round robin went through the proxy (no gateway request id), alternating between replicas.
    direct = [sum("x-request-id" not in h for h in s.stats.headers) for s in stubs]
    assert abs(direct[0] - direct[1]) <= 1 and sum(direct) == len(result["requests"]["gateway"])
    assert "Goodput ratio gateway / round-robin" in (out / "compare.md").read_text()
