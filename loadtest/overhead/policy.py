"""The gateway's policy for a benchmark run, and how the gateway itself sees a request.

One pool per model, each of the one stub replica, with caps that never queue: the benchmark
measures what admission costs, not what it refuses. `explain` asks the gateway offline how it
counts and classifies a body, so the report states the gateway's own figures.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtest.overhead.bodies import MODEL
from loadtest.overhead.fleet import ROOT


def write_policy(
    workdir: Path,
    tokenizer: Path,
    replica: str,
    redis_url: str | None,
    tokenizer_threads: int | None,
    name: str = "policy.yaml",
    counted: Mapping[str, Path] | None = None,
    traces_to: tuple[str, float] | None = None,
    tenant_key: str | None = None,
) -> Path:
    """The tiny tokenizer's model and `counted`'s (model name: tokenizer directory, each counted
    by the backend `auto` chooses), a pool each of the one replica with caps that never queue,
    access log on; with `redis_url`, quotas and slots shared through Redis as several gateways
    would run; with `traces_to` (an OTLP/HTTP endpoint, a sample ratio), requests traced; with
    `tenant_key`, one tenant holding it, with token and request windows too large to refuse:
    what charging and correcting its windows costs, never a 429."""
    pool = {"replicas": [replica], "max_concurrency": 100000, "queue": {"max_depth": 1024}}
    models = {MODEL: tokenizer, **(counted or {})}
    policy: dict[str, Any] = {
        "models": {
            model: {"tokenizer": str(directory), "max_model_len": 32768}
            for model, directory in models.items()
        },
        "pools": {model: {"model": model, **pool} for model in models},
        "classes": [
            {
                "name": "prefill_heavy",
                "when": {"input_tokens": {"gte": 1024}, "output_tokens": {"lte": 64}},
            },
            {"name": "decode_heavy", "when": {}},
        ],
        "routes": [{"match": {"model": model}, "pool": model} for model in models],
        "server": {"access_log": True, "drain_grace_s": 2},
    }
    if tokenizer_threads is not None:
        policy["server"]["tokenizer_threads"] = tokenizer_threads
    if redis_url is not None:
        policy["state"] = {"backend": "redis", "url": redis_url, "gateways": 3}
    if tenant_key is not None:
        digest = hashlib.sha256(tenant_key.encode()).hexdigest()
        policy["tenants"] = {"bench": {"keys": [f"sha256:{digest}"], "tpm": 10**12, "rpm": 10**12}}
    if traces_to is not None:
        endpoint, ratio = traces_to
        policy["tracing"] = {"endpoint": endpoint, "sample_ratio": ratio}
    path = workdir / name
    path.write_text(json.dumps(policy, indent=2))  # JSON is YAML
    return path


def explain(policy: Path, body: str, workdir: Path) -> dict[str, Any]:
    """How the gateway itself counts and classifies a request (offline, `llm-gateway explain`)."""
    request = workdir / "explain.json"
    request.write_text(body)
    argv = [sys.executable, "-m", "gateway", "explain", "--policy", str(policy), "--json"]
    out = subprocess.run(
        [*argv, str(request)], cwd=ROOT, capture_output=True, check=True, timeout=120
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def counting_backends(gateway_url: str) -> dict[str, str]:
    """The library the running gateway counts each model with (`llm_token_counter_info`):
    `explain` counts every model with the tokenizers library, the reference, whatever the
    gateway chose."""
    with urllib.request.urlopen(f"{gateway_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        sample.labels["model"]: sample.labels["backend"]
        for family in text_string_to_metric_families(text)
        if family.name == "llm_token_counter_info"
        for sample in family.samples
    }
