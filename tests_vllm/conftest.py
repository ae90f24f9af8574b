"""Real vLLM (CPU build) behind the gateway: one vLLM server for the session, gateways per test.

`make test-vllm` builds the tiny model, installs vLLM's environment and sets `VLLM_PYTHON` and
`VLLM_MODEL_DIR` for this suite; the vLLM server starts here on a free loopback port and stops at
the end of the session, however it ends. The gateway fixtures are the normal suite's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.vllm_server import MAX_MODEL_LEN, SERVED_NAME, VLLMServer, serve_vllm
from tests.conftest import basic_policy, eventually, gateway_factory, http

__all__ = ["basic_policy", "eventually", "gateway_factory", "http"]


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    python, model_dir = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL_DIR")
    if not python or not model_dir:
        pytest.fail("VLLM_PYTHON and VLLM_MODEL_DIR must be set: run `make test-vllm`")
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with serve_vllm(python, Path(model_dir).resolve(), log) as server:
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


_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$", re.M)


async def scrape_all(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every series of the exposition at `url`/metrics, each the sum of its samples: one read, so
    the values are of one instant."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    sums: dict[str, float] = {}
    for m in _SAMPLE.finditer(text):
        sums[m["name"]] = sums.get(m["name"], 0.0) + float(m["value"])
    return sums


async def scrape(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """Sum of the samples of series `name` in the exposition at `url`/metrics."""
    return (await scrape_all(http, url)).get(name, 0.0)
