"""The load generator's retrieval workload: embedding requests through the gateway to the
simulator, each input exactly its planned tokens, prefill-only and never streamed."""

from __future__ import annotations

import json

from loadtest.loadgen.progress import Progress
from loadtest.loadgen.sweep import SweepConfig, Target, run_sweep
from loadtest.loadgen.workloads import BUILTIN, Fixed, Workload, WorkloadClass, load_workload
from loadtest.sim import ReplicaOptions, load_profile, start_replica
from tests.conftest import accounted, basic_policy


def test_retrieval_is_a_builtin_workload_of_embedding_requests() -> None:
    (cls,) = load_workload("retrieval").classes
    assert load_workload("retrieval") == BUILTIN["retrieval"] and cls.endpoint == "embeddings"


async def test_a_retrieval_sweep_through_the_gateway(tokenizer_dir, gateway_factory) -> None:
    options = ReplicaOptions(time_scale=50, tokenizer=tokenizer_dir, served_model_names=("tiny",))
    replica = await start_replica(load_profile("gemma-3-12b-tpu-v6e-2x2"), options)
    try:
        gw = await gateway_factory(basic_policy(tokenizer_dir, [replica.url]))
        retrieval = WorkloadClass(
            name="retrieval", endpoint="embeddings", isl=Fixed(value=96), osl=Fixed(value=1)
        )
        config = SweepConfig(
            targets=(Target(gw.url, "tiny", str(tokenizer_dir)),),
            workloads=(Workload(name="retrieval", classes=[retrieval]),),
            users=(2,),
            requests_per_level=4,
            stream=True,  # asked for, and not used: an embedding is one JSON answer
        )
        result = await run_sweep(config, Progress(live=False))
        records = result.series[0].levels[0][1].records
        assert all(r.ok and r.input_tokens == 96 for r in records), records
        await accounted(gw, 3)
        logged = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
        assert {(r["endpoint"], r["input_tokens"], r["output_tokens"]) for r in logged} == {
            ("embeddings", 96, 0)
        }
    finally:
        await replica.close()


def test_a_profile_keeps_the_embedding_requests_of_the_log() -> None:
    from loadtest.loadgen.profile import build_profile

    rows = [
        {"pool": "main", "class": "any", "endpoint": "embeddings", "input_tokens": n,
         "status": 200, "output_tokens": 0, "expected_output_tokens": 0}
        for n in (100, 200)
    ]  # fmt: skip
    (cls,) = build_profile(rows).to_workload("prod").classes
    assert cls.endpoint == "embeddings" and cls.isl.model_dump()["values"] == [100, 200]
