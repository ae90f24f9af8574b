"""Real vLLM (CPU build) behind the gateway: one vLLM server for the session, gateways per test.

`make test-vllm` builds the tiny model, installs vLLM's environment and sets `VLLM_PYTHON` and
`VLLM_MODEL_DIR` for this suite; the vLLM server starts here on a free loopback port and stops at
the end of the session, however it ends. The gateway fixtures are the normal suite's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from safetensors.numpy import save_file

from loadtest.vllm_server import MAX_MODEL_LEN, SERVED_NAME, VLLMServer, serve_vllm
from tests.conftest import (
    accounted,
    basic_policy,
    eventually,
    gateway_factory,
    http,
    stub,
    stub_factory,
)
from tests_vllm.otlp import Receiver

__all__ = ["basic_policy", "eventually", "gateway_factory", "http", "stub", "stub_factory"]

# Every server of the suite runs eagerly. Compiling the model (torch.compile's trace and its
# Inductor build) is most of a CPU start's engine set-up, paid again at every start (vLLM 0.32
# fails to load its own compile cache back), and a server with a LoRA runs eagerly on CPU anyway:
# what reaches the gateway, the HTTP API and the model's answers, is the same.
EAGER = "--enforce-eager"


def started_vllm(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    flags: Sequence[str] = (),
    labels: int | None = None,
) -> Iterator[VLLMServer]:
    """vLLM serving the tiny model (with `flags`: `--convert embed`, say; as a classifier of
    `labels` labels, its head in the checkpoint: loadtest/tiny_llama.py) until the generator is
    closed, its log in a directory named `name`."""
    python, model_dir = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL_DIR")
    if not python or not model_dir:
        pytest.fail("VLLM_PYTHON and VLLM_MODEL_DIR must be set: run `make test-vllm`")
    directory = tmp_path_factory.mktemp(name)
    model = Path(model_dir).resolve()
    if labels is not None:
        model = directory / "model"
        subprocess.run(
            [python, "-m", "loadtest.tiny_llama", str(model), str(labels)],
            check=True, capture_output=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
    with serve_vllm(python, model, directory / "vllm.log", extra_args=[EAGER, *flags]) as server:
        yield server


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from started_vllm(tmp_path_factory, "vllm")


async def counted_and_reported(
    gw: Any, http: aiohttp.ClientSession, calls: Sequence[tuple[str, dict[str, Any]]]
) -> tuple[list[int], list[int]]:
    """Each call's input tokens as the gateway's access log counted them, and as vLLM's usage
    reported them (`usage.prompt_tokens`), in order."""
    reported = []
    for path, body in calls:
        async with http.post(f"{gw.url}{path}", json={"model": SERVED_NAME, **body}) as resp:
            answer = await resp.json()
            assert resp.status == 200, (path, answer)
            reported.append(answer["usage"]["prompt_tokens"])
    await accounted(gw, len(calls) - 1)
    logged = [json.loads(line) for line in gw.access_log.getvalue().splitlines()]
    return [r["input_tokens"] for r in logged], reported


LORA_NAME = "tiny-lora"
LORA_RANK = 8


def build_lora(directory: Path, model_dir: Path) -> Path:
    """A PEFT-format LoRA for the tiny Llama, made here (no peft, no download): rank-8 deltas
    on every layer's q_proj and v_proj, random with a fixed seed, so the adapter changes what
    the model writes. The tensor names and config keys are the ones vLLM's loader reads
    (vllm/lora/lora_model.py `from_local_checkpoint`, vllm/lora/utils.py
    `parse_fine_tuned_lora_name`, vllm/lora/peft_helper.py `PEFTHelper`)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    outputs = {
        "q_proj": config["num_attention_heads"] * config["head_dim"],
        "v_proj": config["num_key_value_heads"] * config["head_dim"],
    }
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(layers):
        for module, out in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.5, (LORA_RANK, hidden))
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.5, (out, LORA_RANK))
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.astype(np.float32) for k, v in tensors.items()},
              str(directory / "adapter_model.safetensors"))  # fmt: skip
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 16,
        "target_modules": sorted(outputs), "bias": "none", "base_model_name_or_path": SERVED_NAME,
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))
    return directory


@pytest.fixture(scope="session")
def receiver() -> Iterator[Receiver]:
    """The OTLP/HTTP endpoint `vllm_lora` exports its spans to (test_tracing.py)."""
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture(scope="session")
def vllm_lora(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[VLLMServer]:
    """A second vLLM, for what the session's must not change for every other test: the tiny
    model with a LoRA loaded at start, scheduling by priority, one sequence at a time (so
    requests queue in vLLM, not in the gateway: test_lora.py); publishing its KV-cache events on
    an ipc endpoint (test_kv_events.py); exporting its spans to `receiver` and reporting its
    prefix-cache hits (test_tracing.py). One server for the three modules: a start costs more
    than any one module's tests."""
    python, model_dir = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL_DIR")
    if not python or not model_dir:
        pytest.fail("VLLM_PYTHON and VLLM_MODEL_DIR must be set: run `make test-vllm`")
    base = tmp_path_factory.mktemp("vllm-lora")
    adapter = build_lora(base / LORA_NAME, Path(model_dir).resolve())
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{base}/kv-events.ipc",
    }
    flags = [
        EAGER,
        "--enable-lora", "--max-lora-rank", str(LORA_RANK),
        "--lora-modules", f"{LORA_NAME}={adapter}",
        "--scheduling-policy", "priority",
        "--kv-events-config", json.dumps(events),
        "--otlp-traces-endpoint", receiver.url,
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        env.setenv("OTEL_SERVICE_NAME", "vllm")
        with serve_vllm(
            python, Path(model_dir).resolve(), base / "vllm.log", max_num_seqs=1, extra_args=flags
        ) as server:
            yield server


POLICY_MAX_MODEL_LEN = 2 * MAX_MODEL_LEN


def vllm_policy(server: VLLMServer, **pool: Any) -> dict[str, Any]:
    """The normal suite's one-pool policy, with the model's own tokenizer and vLLM as replica.

    Its `max_model_len` is twice vLLM's, so the gateway lets through everything vLLM accepts and a
    prompt between the two reaches vLLM and draws vLLM's own 400."""
    policy = basic_policy(server.model_dir, [server.url], **pool)
    assert SERVED_NAME in policy["models"]
    policy["models"][SERVED_NAME]["max_model_len"] = POLICY_MAX_MODEL_LEN
    return policy


_SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=120)
_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$", re.M)


async def scrape_all(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every series of the exposition at `url`/metrics, each the sum of its samples: one read, so
    the values are of one instant.

    One bound for the whole scrape, no connect time-out of its own: with vLLM's CPU engine and the
    gateway sharing a 2-core runner, a connection has waited past aiohttp's 30 s connect default,
    which failed a test on a slow scrape rather than on what it asserts."""
    async with http.get(f"{url}/metrics", timeout=_SCRAPE_TIMEOUT) as resp:
        text = await resp.text()
    sums: dict[str, float] = {}
    for m in _SAMPLE.finditer(text):
        sums[m["name"]] = sums.get(m["name"], 0.0) + float(m["value"])
    return sums


async def scrape(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """Sum of the samples of series `name` in the exposition at `url`/metrics."""
    return (await scrape_all(http, url)).get(name, 0.0)
