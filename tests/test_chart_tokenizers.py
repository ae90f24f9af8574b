"""The chart's `tokenizers` init container, run as the pod runs it: its rendered command, arguments
and environment, its `huggingface_hub` against a Hugging Face Hub on a loopback port that serves
the real Gemma 3 and Llama 3 tokenizer files beside weights it must not fetch, one repository
gated as Meta's are. What it leaves in the volume is what the chart's policy then loads."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.policy.compile import load_policy
from tests.hub import TOKEN, WEIGHTS, Hub, serving
from tests.test_deploy import CHART, deployed_policy, helm, one


@pytest.fixture
async def hub() -> AsyncIterator[Hub]:
    async with serving() as served:
        yield served


def init_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(objects, "Deployment", "llm-gateway")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    return init  # type: ignore[no-any-return]


def run_init(
    init: dict[str, Any], volume: Path, hub: Hub, token: str | None
) -> subprocess.CompletedProcess[str]:
    """The container's command as the pod runs it, `/models` being `volume`; its environment
    with the `hf-token` Secret's key (or no Secret: optional) and the Hub on loopback."""
    assert init["command"][0] == "python"
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    secret = next(e for e in init["env"] if "valueFrom" in e)
    assert secret["name"] == "HF_TOKEN"
    assert secret["valueFrom"]["secretKeyRef"]["optional"] is True
    if token is not None:
        env["HF_TOKEN"] = token
    env["HF_HOME"] = str(volume.parent / "hf-home")  # the pod's /tmp
    env["HF_ENDPOINT"] = hub.url
    args = [a.replace("/models/", f"{volume}/") for a in init["args"]]
    keep = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    return subprocess.run(
        [sys.executable, *init["command"][1:], *args],
        env={**keep, **env}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("values", ["values-gke-tpu-v6e.yaml", "values-gpu-nvidia.yaml"])
async def test_the_init_container_fetches_the_tokenizers_and_the_policy_loads_them(
    values: str, hub: Hub, tmp_path: Path
) -> None:
    objects = helm(values)
    init = init_container(objects)
    # The image is offline for the gateway (HF_HUB_OFFLINE=1); this container must not be.
    assert {"name": "HF_HUB_OFFLINE", "value": "0"} in init["env"]
    volume = tmp_path / "models"
    done = await asyncio.to_thread(run_init, init, volume, hub, TOKEN)
    assert done.returncode == 0, done.stderr[-2000:]
    pairs = dict(zip(init["args"][1::2], init["args"][2::2], strict=True))  # after the script
    allowed = set(yaml.safe_load((CHART / "values.yaml").read_text())["tokenizerFiles"])
    for mount, repo in pairs.items():
        fetched = {p.name for p in (volume / mount.removeprefix("/models/")).iterdir()}
        fetched.discard(".cache")  # huggingface_hub's own bookkeeping
        assert fetched == set(hub.files(repo)) & allowed, repo
    assert not [f for f in hub.fetched if f.endswith((WEIGHTS, "README.md"))]
    # The chart's policy, its /models paths on this volume, loads every tokenizer.
    policy = deployed_policy(objects)
    for model in policy["models"].values():
        model["tokenizer"] = model["tokenizer"].replace("/models/", f"{volume}/")
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    load_policy(path, load_tokenizers=True).close()


async def test_a_gated_tokenizer_without_the_token_fails_the_pod_start_saying_why(
    hub: Hub, tmp_path: Path
) -> None:
    init = init_container(helm("values-gpu-nvidia.yaml"))
    done = await asyncio.to_thread(run_init, init, tmp_path / "models", hub, None)
    assert done.returncode != 0  # the init container fails: the gateway never starts uncounted
    assert "401" in done.stderr and "Llama-3.1-8B-Instruct" in done.stderr


def documented_download() -> str:
    """docs/operations.md's `hf download` for a cluster without egress, as one shell line."""
    text = (CHART.parent.parent.parent / "docs" / "operations.md").read_text()
    block = text.split("Fill it\nwith the same files the init container fetches:\n\n```sh\n")[1]
    return block.split("```")[0].replace("\\\n", " ")


async def test_the_documented_download_fetches_what_the_init_container_does(
    hub: Hub, tmp_path: Path
) -> None:
    command = documented_download().replace("/mnt/", f"{tmp_path}/")
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HF_ENDPOINT": hub.url,
           "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf-home")}  # fmt: skip
    done = await asyncio.to_thread(
        subprocess.run, command, shell=True, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    fetched = {p.name for p in (tmp_path / "gemma-3-tokenizer").iterdir()} - {".cache"}
    allowed = set(yaml.safe_load((CHART / "values.yaml").read_text())["tokenizerFiles"])
    assert fetched == set(hub.files("google/gemma-3-27b-it")) & allowed
