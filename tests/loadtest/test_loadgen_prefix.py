"""Shared-prefix workloads: rule sets and multi-turn sessions, against real replicas on loopback
ports (the stub, and the simulator where the server's own token count matters), with the real
tokenizer fixture."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from transformers import AutoTokenizer

from loadtest.loadgen import cli
from loadtest.loadgen.compare import CompareConfig, run_compare
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.prompts import Body, PromptBuilder
from loadtest.loadgen.runner import RequestRecord
from loadtest.loadgen.sweep import SweepConfig, Target, run_sweep
from loadtest.loadgen.workloads import Workload, dump_workload, load_workload, plan
from loadtest.sim import ReplicaOptions, load_profile, start_replica
from tests.conftest import RunningGateway, Stub, basic_policy

StubFactory = Callable[..., Awaitable[Stub]]
GatewayFactory = Callable[[dict[str, Any]], Awaitable[RunningGateway]]
QUIET = Progress(live=False)
ROOT = Path(__file__).resolve().parents[2]
HEAD = "<bos><start_of_turn>user\n"  # the tiny tokenizer's chat template before the content


def rules_workload(sets: int = 8, tokens: int = 300, isl: int = 500, **pick: Any) -> Workload:
    return Workload.model_validate(
        {
            "name": f"rules-{sets}x{tokens}",
            "classes": [
                {"name": "classification", "isl": isl, "osl": 2,
                 "rules": {"sets": sets, "tokens": tokens, **pick}},
            ],
        }
    )  # fmt: skip


def sessions_workload(turns: int = 4, message: int = 40, osl: int = 5) -> Workload:
    return Workload.model_validate(
        {
            "name": "chat",
            "classes": [{"name": "chat", "isl": message, "osl": osl, "session": {"turns": turns}}],
        }
    )


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def prompt_ids(hf: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def contents(bodies: Sequence[Body]) -> list[str]:
    out = []
    for b in bodies:
        assert isinstance(b, bytes)
        out.append(orjson.loads(b)["messages"][0]["content"])
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return sum(
        1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a, b, strict=False))
    )


# --- rule sets --------------------------------------------------------------------------------


def test_eight_rule_sets_are_eight_shared_prefixes_of_exactly_r_tokens(
    hf: Any, tokenizer_dir: Path
) -> None:
    planned = plan(rules_workload(sets=8, tokens=300, isl=500), 64, random.Random(0))
    texts = contents(PromptBuilder(tokenizer_dir).bodies("tiny", planned, stream=True))
    ids = [prompt_ids(hf, [{"role": "user", "content": t}]) for t in texts]
    assert {len(i) for i in ids} == {500}  # every prompt exactly its ISL

    head = len(hf(HEAD, add_special_tokens=False)["input_ids"])
    rules = {tuple(i[head : head + 300]) for i in ids}
    assert len(rules) == 8  # the first R tokens after the template: exactly 8 distinct
    by_set: dict[int | None, list[list[int]]] = defaultdict(list)
    for p, t, i in zip(planned, texts, ids, strict=True):
        rule_text = t.split("\n")[0]  # the rule set, then a newline and the product text
        assert hf(rule_text, add_special_tokens=False)["input_ids"] == i[head : head + 300]
        by_set[p.rule_set].append(i)
    for members in by_set.values():
        assert all(m[: head + 300] == members[0][: head + 300] for m in members)
        # beyond the rule set only the product tags' first characters can coincide
        assert all(
            common_prefix(a, b) < head + 300 + 3 for a, b in itertools.combinations(members, 2)
        )
    assert len(set(texts)) == len(texts)


def test_zipf_picks_the_first_sets_most_and_uniform_spreads(tokenizer_dir: Path) -> None:
    zipf = Counter(p.rule_set for p in plan(rules_workload(pick="zipf", zipf_s=1.5), 400,
                                            random.Random(0)))  # fmt: skip
    uniform = Counter(p.rule_set for p in plan(rules_workload(), 400, random.Random(0)))
    assert zipf.most_common(1)[0][0] == 0 and zipf[0] > 3 * zipf[7]
    assert len(uniform) == 8 and max(uniform.values()) < 3 * min(uniform.values())


def test_the_same_seed_makes_the_same_prompts(tokenizer_dir: Path) -> None:
    config = SweepConfig(targets=(), workloads=(), users=(4,), requests_per_level=24, seed=3)
    first, again = (
        PromptBuilder(tokenizer_dir).bodies("tiny", config.planned(rules_workload(), 4), True)
        for _ in range(2)
    )
    assert first == again
    other = SweepConfig(targets=(), workloads=(), users=(4,), requests_per_level=24, seed=4)
    assert [p.rule_set for p in other.planned(rules_workload(), 4)] != [
        p.rule_set for p in config.planned(rules_workload(), 4)
    ]


def test_each_bodies_call_gets_fresh_rule_sets_of_the_same_shape(
    hf: Any, tokenizer_dir: Path
) -> None:
    # A later compare target or sweep level must not find the earlier one's prefixes cached.
    builder = PromptBuilder(tokenizer_dir)
    planned = plan(rules_workload(sets=2), 6, random.Random(0))
    one, two = (contents(builder.bodies("tiny", planned, True)) for _ in range(2))
    assert {t.split("\n")[0] for t in one}.isdisjoint(t.split("\n")[0] for t in two)
    lengths = [len(prompt_ids(hf, [{"role": "user", "content": t}])) for t in one + two]
    assert set(lengths) == {500}


def test_a_rule_set_needs_room_for_the_product_text() -> None:
    with pytest.raises(ValueError, match="product text needs room"):
        rules_workload(tokens=300, isl=300)
    with pytest.raises(ValueError, match="endpoint must be chat"):
        sessions_workload().with_endpoint("completions")


def test_named_shared_prefix_workloads() -> None:
    (rules,) = load_workload("rules-64x3000-zipf1.1").classes
    assert rules.rules is not None and (rules.rules.sets, rules.rules.tokens) == (64, 3000)
    assert (rules.rules.pick, rules.rules.zipf_s, rules.isl.sample(random.Random())) == (
        "zipf", 1.1, 4000)  # fmt: skip
    (chat,) = load_workload("sessions-5x200-think2").classes
    assert chat.session is not None and chat.session.think_s == 2.0
    assert (chat.session.turns.sample(random.Random()), chat.isl.sample(random.Random())) == (
        5,
        200,
    )


async def test_the_sweep_command_sends_rule_sets_to_a_replica(
    stub_factory: StubFactory, tokenizer_dir: Path, hf: Any, tmp_path: Path
) -> None:
    stub = await stub_factory()
    argv = ["sweep", "--target", stub.url, "--model", "tiny", "--tokenizer", str(tokenizer_dir),
            "--workload", "rules-4x200", "--users", "2", "--requests-per-level", "12",
            "--baseline-level", "2", "--out", str(tmp_path)]  # fmt: skip
    assert await asyncio.to_thread(cli.main, argv) == 0
    messages = [b["messages"] for b in stub.stats.bodies]
    assert len(messages) == 12
    assert {len(prompt_ids(hf, m)) for m in messages} == {4000}  # rules-KxR: 4,000 in
    assert len({m[0]["content"].split("\n")[0] for m in messages}) <= 4


async def test_without_a_tokenizer_a_rule_set_prompt_is_its_isl_at_four_characters_a_token() -> (
    None
):
    """The fidelity runs' mode: no tokenizer on either side; the simulator counts 4 characters a
    token, and the rule set is part of the ISL, not on top of it."""
    profile = load_profile(ROOT / "loadtest/profiles/gemma-3-12b-tpu-v6e-2x2.yaml")
    replica = await start_replica(profile, ReplicaOptions(time_scale=1000))
    try:
        config = SweepConfig(
            targets=(Target(replica.url, "gemma-3-12b-it"),),
            workloads=(rules_workload(sets=2, tokens=300, isl=500),),
            users=(2,),
            requests_per_level=6,
        )
        result = await run_sweep(config, QUIET)
    finally:
        await replica.close()
    records = result.series[0].levels[0][1].records
    # The simulator's estimate adds 4 tokens per chat message, for unique prompts as well.
    assert {r.input_tokens for r in records} == {500 + 4}


# --- sessions ---------------------------------------------------------------------------------


def by_session(bodies: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for b in bodies:
        out[b["user"]].append(b)
    return out


async def test_a_session_resends_its_history_turn_by_turn(
    stub_factory: StubFactory, tokenizer_dir: Path, hf: Any
) -> None:
    stub = await stub_factory()
    config = SweepConfig(
        targets=(Target(stub.url, "tiny", str(tokenizer_dir)),),
        workloads=(sessions_workload(turns=4, message=40, osl=5),),
        users=(2,),
        requests_per_level=3,  # sessions: each arrival or user's pick is a whole session
    )
    result = await run_sweep(config, QUIET)
    records = result.series[0].levels[0][1].records
    assert len(stub.stats.bodies) == len(records) == 12 and all(r.ok for r in records)

    sessions = by_session(stub.stats.bodies)
    assert len(sessions) == 3
    for headers, b in zip(stub.stats.headers, stub.stats.bodies, strict=True):
        assert headers["x-session-id"] == b["user"]  # both, for affinity on either
    for turns in sessions.values():
        for before, after in itertools.pairwise(turns):
            reply = {"role": "assistant", "content": " tok" * 5}  # what the stub answered
            assert after["messages"][:-1] == [*before["messages"], reply]
            assert after["messages"][-1]["role"] == "user"
        news = [t["messages"][-1]["content"] for t in turns]
        assert [len(hf(n, add_special_tokens=False)["input_ids"]) for n in news] == [40] * 4
    isl = {(r.session, r.turn): r.isl for r in records}
    for sid, turns in sessions.items():  # the recorded ISL is the whole prompt's, per turn
        assert [isl[(sid, t)] for t in range(4)] == [
            len(prompt_ids(hf, t["messages"])) for t in turns
        ]


async def test_a_sessions_turns_are_sequential(stub_factory: StubFactory) -> None:
    stub = await stub_factory(delay_s=0.05)
    config = SweepConfig(
        targets=(Target(stub.url, "tiny"),),
        workloads=(sessions_workload(turns=3),),
        rates=(50.0,),
        duration_s=0.1,
        requests_per_level=4,
    )
    result = await run_sweep(config, QUIET)
    records: dict[str | None, list[RequestRecord]] = defaultdict(list)
    for rec in result.series[0].levels[0][1].records:
        records[rec.session].append(rec)
    assert records and all(len(turns) == 3 for turns in records.values())
    for turns in records.values():
        assert [r.turn for r in turns] == [0, 1, 2]
        for before, after in itertools.pairwise(turns):
            assert before.e2e_s is not None and after.start_s >= before.start_s + before.e2e_s


async def test_a_failed_turn_ends_its_session(stub_factory: StubFactory) -> None:
    stub = await stub_factory(status=503)
    config = SweepConfig(
        targets=(Target(stub.url, "tiny"),),
        workloads=(sessions_workload(turns=4),),
        users=(2,),
        requests_per_level=3,
    )
    result = await run_sweep(config, QUIET)
    records = result.series[0].levels[0][1].records
    assert [r.turn for r in records] == [0, 0, 0] and stub.stats.requests == 3


async def test_session_turn_isl_is_the_servers_count(tokenizer_dir: Path) -> None:
    profile = load_profile(ROOT / "loadtest/profiles/gemma-3-12b-tpu-v6e-2x2.yaml")
    options = ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir, served_model_names=("tiny",))
    replica = await start_replica(profile, options)
    try:
        config = SweepConfig(
            targets=(Target(replica.url, "tiny", str(tokenizer_dir)),),
            workloads=(sessions_workload(turns=3, message=60, osl=8),),
            users=(2,),
            requests_per_level=2,
        )
        result = await run_sweep(config, QUIET)
    finally:
        await replica.close()
    records = result.series[0].levels[0][1].records
    assert len(records) == 6 and all(r.ok and r.input_tokens == r.isl for r in records)
    assert result.curves()[0].levels[0][1].isl_exact == 6


# --- compare: the same arrivals and shapes for every variant ----------------------------------


async def test_compare_sends_every_variant_the_same_sessions_and_rule_picks(
    stub_factory: StubFactory, tokenizer_dir: Path
) -> None:
    stubs = [await stub_factory(), await stub_factory()]
    targets = tuple((name, Target(s.url, "tiny", str(tokenizer_dir)))
                    for name, s in zip(("least-inflight", "prefix"), stubs, strict=True))  # fmt: skip
    for workload in (sessions_workload(turns=2), rules_workload(sets=3)):
        config = CompareConfig(targets=targets, rate=40, duration_s=0.3, workload=workload)
        result = await run_compare(config, QUIET)
        runs = [result.runs[name] for name, _ in targets]
        shapes = [sorted((r.index, r.turn, r.osl) for r in run.records) for run in runs]
        assert shapes[0] == shapes[1] and shapes[0]
    # Same rule-set picks, in the same order, but each variant's own rule texts and sessions.
    first, second = ([b for b in s.stats.bodies if "user" not in b] for s in stubs)
    rules = [[b["messages"][0]["content"].split("\n")[0] for b in run] for run in (first, second)]
    pattern = [[run.index(r) for r in run] for run in rules]
    assert pattern[0] == pattern[1] and set(rules[0]).isdisjoint(rules[1])
    sessions = [{b["user"] for b in s.stats.bodies if "user" in b} for s in stubs]
    assert sessions[0].isdisjoint(sessions[1])


async def test_the_compare_command_runs_sessions_through_the_gateway_and_reports_turns(
    stub_factory: StubFactory,
    gateway_factory: GatewayFactory,
    tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stubs = [await stub_factory(), await stub_factory()]
    gw = await gateway_factory(basic_policy(tokenizer_dir, [s.url for s in stubs]))
    out = tmp_path / "compare"
    argv = ["compare", "--replicas", ",".join(s.url for s in stubs), "--gateway", gw.url,
            "--model", "tiny", "--tokenizer", str(tokenizer_dir), "--workload", "sessions-3x40",
            "--rate", "20", "--duration", "0.2", "--requests", "3", "--out", str(out)]  # fmt: skip
    assert await asyncio.to_thread(cli.main, argv) == 0

    result = orjson.loads((out / "compare.json").read_bytes())
    for rows in result["requests"].values():
        assert sorted(r["turn"] for r in rows) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        by_turn = defaultdict(list)
        for r in rows:
            by_turn[r["turn"]].append(r["isl"])
        assert min(by_turn[1]) > max(by_turn[0]) and min(by_turn[2]) > max(by_turn[1])
    printed = capsys.readouterr().out
    assert "Session turns" in printed and "| gateway | 2 | 3 | 3 |" in printed
    # The gateway forwards the session's header and body field to the replica as received.
    seen = [h for s in stubs for h in s.stats.headers if "x-request-id" in h]
    assert len(seen) == 9 and all(h["x-session-id"].startswith("session-") for h in seen)


def test_a_shared_prefix_workload_file_round_trips(tmp_path: Path) -> None:
    text = """
classes:
  - {name: rules, isl: {type: normal, mean: 4000, std: 200, min: 3500}, osl: 10,
     rules: {sets: 64, tokens: 3000, pick: zipf, zipf_s: 1.1}}
  - {name: chat, isl: 200, osl: 150, session: {turns: {type: empirical, values: [2, 5, 9]},
     think_s: 1.5}}
"""
    path = tmp_path / "prefixes.yaml"
    path.write_text(text)
    workload = load_workload(path)
    assert load_workload(dump_workload(workload, tmp_path / "again.yaml")) == workload
    planned = plan(workload, 50, random.Random(0))
    assert {p.cls for p in planned if p.session is not None} == {"chat"}
    assert all(
        p.rule_set is not None and p.rule_tokens == 3000 for p in planned if p.cls == "rules"
    )
