"""The chart's tokenizer sources, run as the pod runs them. `hub`: the `tokenizers` init container's
rendered command, arguments and environment, its `huggingface_hub` against a Hugging Face Hub on a
loopback port that serves the real Gemma 3 and Llama 3 tokenizer files beside weights it must not
fetch, one repository gated as Meta's are, and the same Hub under a mirror's path that
`tokenizerSource.hub.endpoint` names. `pvc`, `image` and `imageVolume` (docs/operations.md's
air-gapped values, rendered as written there): the claim or the image as a local directory laid out
as the mount or deploy/tokenizers.Dockerfile lays it, the copying init container's own command run
on it. What each leaves at /models is what the chart's policy then loads."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.policy.compile import load_policy
from tests.deploy.test_deploy import (
    CHART,
    ROOT,
    deployed_policy,
    helm,
    hub_offline,
    image_env,
    one,
    tool,
    validate_core,
)
from tests.hub import TOKEN, WEIGHTS, Hub, serving

MIRROR_PATH = "/api/huggingface"  # where a repository manager's Hugging Face remote answers, say
SOURCES = ["hub", "pvc", "image", "imageVolume"]


@pytest.fixture
async def hub() -> AsyncIterator[Hub]:
    async with serving() as served:
        yield served


@pytest.fixture
async def mirror() -> AsyncIterator[Hub]:
    """The same Hub under a path of its own and nowhere else: only an endpoint with the path
    finds it."""
    async with serving(MIRROR_PATH) as served:
        yield served


def pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment", "llm-gateway")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def init_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (init,) = pod_spec(objects)["initContainers"]
    return init  # type: ignore[no-any-return]


def chart_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())  # type: ignore[no-any-return]


def allowed_files() -> set[str]:
    return set(chart_values()["tokenizerFiles"])


def run_init(
    init: dict[str, Any], volume: Path, token: str | None, endpoint: str | None
) -> subprocess.CompletedProcess[str]:
    """The container's command as the pod runs it, `/models` being `volume`; its environment
    with the `hf-token` Secret's key (or no Secret: optional). `endpoint` stands in for the Hub
    itself where the chart names none; a mirror the chart names is its rendered HF_ENDPOINT."""
    assert init["command"][0] == "python"
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    secret = next(e for e in init["env"] if "valueFrom" in e)
    assert secret["name"] == "HF_TOKEN"
    assert secret["valueFrom"]["secretKeyRef"]["optional"] is True
    if token is not None:
        env["HF_TOKEN"] = token
    env["HF_HOME"] = str(volume.parent / "hf-home")  # the pod's /tmp
    if endpoint is not None:
        assert "HF_ENDPOINT" not in env, "the chart's default is the Hub itself"
        env["HF_ENDPOINT"] = endpoint
    args = [a.replace("/models/", f"{volume}/") for a in init["args"]]
    keep = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    return subprocess.run(
        [sys.executable, *init["command"][1:], *args],
        env={**keep, **env}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def assert_fetched(init: dict[str, Any], volume: Path, hub: Hub) -> None:
    """Each repository's tokenizer files, and nothing else of it, in its directory, from `hub`."""
    pairs = dict(zip(init["args"][1::2], init["args"][2::2], strict=True))  # after the script
    for mount, repo in pairs.items():
        fetched = {p.name for p in (volume / mount.removeprefix("/models/")).iterdir()}
        fetched.discard(".cache")  # huggingface_hub's own bookkeeping
        assert fetched == set(hub.files(repo)) & allowed_files(), repo
        assert any(f.startswith(f"{repo}/") for f in hub.fetched), repo
    assert not [f for f in hub.fetched if f.endswith((WEIGHTS, "README.md"))]


def load_chart_policy(objects: list[dict[str, Any]], models: Path, tmp_path: Path) -> None:
    """The chart's policy, its /models paths on `models` (what the gateway's /models mount
    shows), loads every tokenizer."""
    policy = deployed_policy(objects)
    for model in policy["models"].values():
        model["tokenizer"] = model["tokenizer"].replace("/models/", f"{models}/")
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    load_policy(path, load_tokenizers=True).close()


@pytest.mark.parametrize("values", ["values-gke-tpu-v6e.yaml", "values-gpu-nvidia.yaml"])
async def test_the_init_container_fetches_the_tokenizers_and_the_policy_loads_them(
    values: str, hub: Hub, tmp_path: Path
) -> None:
    objects = helm(values)
    init = init_container(objects)
    # The image is offline for the gateway (HF_HUB_OFFLINE=1); this container must not be.
    assert {"name": "HF_HUB_OFFLINE", "value": "0"} in init["env"]
    volume = tmp_path / "models"
    done = await asyncio.to_thread(run_init, init, volume, TOKEN, hub.url)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_fetched(init, volume, hub)
    load_chart_policy(objects, volume, tmp_path)


async def test_a_gated_tokenizer_without_the_token_fails_the_pod_start_saying_why(
    hub: Hub, tmp_path: Path
) -> None:
    init = init_container(helm("values-gpu-nvidia.yaml"))
    done = await asyncio.to_thread(run_init, init, tmp_path / "models", None, hub.url)
    assert done.returncode != 0  # the init container fails: the gateway never starts uncounted
    assert "401" in done.stderr and "Llama-3.1-8B-Instruct" in done.stderr


# --- Air-gapped: docs/operations.md's values, as written there ----------------------------------


def air_gapped_section() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    return text.split("\n## Air-gapped install\n", 1)[1].split("\n## ", 1)[0]


def documented_download() -> str:
    """The section's `hf download` (step 2), as one shell line."""
    block = air_gapped_section().split("The tokenizer files, once.", 1)[1]
    return block.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")


def documented_values() -> dict[str, dict[str, Any]]:
    """The section's values blocks: the gateway image's ("gateway") and one per tokenizer
    source, by its type."""
    found: dict[str, dict[str, Any]] = {}
    for block in re.findall(r"```yaml\n(.*?)^ *```", air_gapped_section(), re.S | re.M):
        values = yaml.safe_load(textwrap.dedent(block))
        source = values.get("tokenizerSource")
        found["gateway" if source is None else source.get("type", "hub")] = values
    assert set(found) == {"gateway", *SOURCES}, set(found)
    return found


def render(tmp_path: Path, *overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart with its defaults, then each of `overrides` as a values file, in order."""
    files = []
    for n, values in enumerate(overrides):
        files.append(tmp_path / f"values-{n}.yaml")
        files[-1].write_text(yaml.safe_dump(values))
    return helm(*map(str, files))  # an absolute path stays itself under CHART


def air_gapped(tmp_path: Path, source: str) -> list[dict[str, Any]]:
    """The chart as the air-gapped install renders it: the image's values, then the source's."""
    documented = documented_values()
    return render(tmp_path, documented["gateway"], documented[source])


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
    (directory,) = chart_values()["tokenizers"]
    fetched = {p.name for p in (tmp_path / "tokenizers" / directory).iterdir()} - {".cache"}
    assert fetched == set(hub.files(chart_values()["tokenizers"][directory])) & allowed_files()


@pytest.mark.parametrize("source", SOURCES)
def test_each_documented_source_renders_objects_kubernetes_accepts_from_its_registry(
    source: str, tmp_path: Path
) -> None:
    objects = air_gapped(tmp_path, source)
    assert validate_core(objects) >= 10
    files = [arg for n in range(2) for arg in ("-f", str(tmp_path / f"values-{n}.yaml"))]
    lint = subprocess.run(
        [tool("helm"), "lint", "--strict", str(CHART), *files],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert lint.returncode == 0, lint.stdout + lint.stderr
    # Every image the gateway's pod pulls is the private registry's, with its pull Secret, and
    # the gateway's is the release the chart came with.
    gateway = documented_values()["gateway"]["gateway"]
    pod = pod_spec(objects)
    images = {c["image"] for c in [*pod.get("initContainers", []), *pod["containers"]]}
    images |= {v["image"]["reference"] for v in pod["volumes"] if "image" in v}
    assert len(images) == (1 if source in ("hub", "pvc") else 2), images
    assert all(i.startswith(gateway["image"]["registry"] + "/") for i in images), images
    assert pod["imagePullSecrets"] == gateway["imagePullSecrets"]
    # Nothing in the pod reaches the Hub (the images, the gateway's and the tokenizer image on
    # it, set HF_HUB_OFFLINE=1) but the `hub` source's init container.
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        reaches_hub = source == "hub" and container["name"] == "tokenizers"
        assert hub_offline({**image_env(), **env}) is not reaches_hub, container["name"]
    release = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    (container,) = pod["containers"]
    assert container["image"] == f"{gateway['image']['registry']}/llm-admission-gateway:{release}"


async def test_a_hub_mirror_is_the_init_containers_hf_endpoint(mirror: Hub, tmp_path: Path) -> None:
    """The documented mirror, its endpoint this Hub's path: the init container finds it only
    because the chart passed the path on (nothing of the Hub's API answers at the root)."""
    documented = documented_values()["hub"]
    documented["tokenizerSource"]["hub"]["endpoint"] = mirror.url
    gpu = yaml.safe_load((CHART / "values-gpu-nvidia.yaml").read_text())  # a gated repository
    objects = render(tmp_path, gpu, documented)
    init = init_container(objects)
    assert {"name": "HF_ENDPOINT", "value": mirror.url} in init["env"]
    volume = tmp_path / "models"
    done = await asyncio.to_thread(run_init, init, volume, TOKEN, None)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_fetched(init, volume, mirror)
    load_chart_policy(objects, volume, tmp_path)


def downloaded(directory: Path) -> Path:
    """`directory` holding what step 2's `hf download` leaves for each of the chart's default
    `tokenizers`: the Hub's files of its repository that `tokenizerFiles` allows."""
    for name, repo in chart_values()["tokenizers"].items():
        (directory / name).mkdir(parents=True)
        for file, data in Hub().files(repo).items():
            if file in allowed_files():
                (directory / name / file).write_bytes(data)
    return directory


def tokenizers_volume(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's `tokenizers` volume, and the gateway's read-only mount of it at /models."""
    pod = pod_spec(objects)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tokenizers"]
    (gateway,) = pod["containers"]
    (mount,) = [m for m in gateway["volumeMounts"] if m["name"] == "tokenizers"]
    assert mount["mountPath"] == "/models" and mount["readOnly"] is True
    return volume, mount


def test_a_pvc_is_mounted_read_only_and_holds_what_the_policy_loads(tmp_path: Path) -> None:
    objects = air_gapped(tmp_path, "pvc")
    assert "initContainers" not in pod_spec(objects)  # nothing to fetch or copy
    volume, mount = tokenizers_volume(objects)
    claim = documented_values()["pvc"]["tokenizerSource"]["pvc"]["claimName"]
    assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
    assert "subPath" not in mount  # the claim's root is /models
    load_chart_policy(objects, downloaded(tmp_path / "claim"), tmp_path)


def image_root(root: Path) -> Path:
    """`root` as deploy/tokenizers.Dockerfile builds the image from step 2's directory: the
    directories at its final COPY's destination (`make image` builds the image itself)."""
    lines = (ROOT / "deploy" / "tokenizers.Dockerfile").read_text().splitlines()
    destination = [line.split() for line in lines if line.startswith("COPY ")][-1][-1]
    shutil.copytree(downloaded(root.parent / "context"), root / destination.strip("/"))
    return root


def run_in_image(command: list[str], root: Path, volume: Path) -> subprocess.CompletedProcess[str]:
    """A command as the image's container runs it: an absolute path is in the image's
    filesystem (`root`), but /models is the pod's volume (`volume`)."""

    def in_pod(arg: str) -> str:
        if arg == "/models" or arg.startswith("/models/"):
            return str(volume) + arg.removeprefix("/models")
        return str(root) + arg if arg.startswith("/") else arg

    return subprocess.run(
        [in_pod(a) for a in command], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_tokenizer_image_is_copied_by_its_init_container(tmp_path: Path) -> None:
    objects = air_gapped(tmp_path, "image")
    init = init_container(objects)
    assert init["image"] == documented_values()["image"]["tokenizerSource"]["image"]["reference"]
    volume, _ = tokenizers_volume(objects)
    assert "emptyDir" in volume
    assert {"name": "tokenizers", "mountPath": "/models"} in init["volumeMounts"]
    models = tmp_path / "emptydir"
    models.mkdir()
    done = run_in_image(init["command"] + init["args"], image_root(tmp_path / "image"), models)
    assert done.returncode == 0, done.stderr
    load_chart_policy(objects, models, tmp_path)


def test_a_tokenizer_the_image_lacks_fails_the_pod_start_naming_it(tmp_path: Path) -> None:
    lacking = {"tokenizers": {"qwen-3-tokenizer": "Qwen/Qwen3-8B"}}
    init = init_container(render(tmp_path, documented_values()["image"], lacking))
    models = tmp_path / "emptydir"
    models.mkdir()
    done = run_in_image(init["command"] + init["args"], image_root(tmp_path / "image"), models)
    assert done.returncode != 0 and "qwen-3-tokenizer" in done.stderr, done.stderr


def test_the_tokenizer_image_as_an_image_volume_shows_its_path_at_models(tmp_path: Path) -> None:
    objects = air_gapped(tmp_path, "imageVolume")
    assert "initContainers" not in pod_spec(objects)
    volume, mount = tokenizers_volume(objects)
    source = documented_values()["imageVolume"]["tokenizerSource"]["image"]
    assert volume["image"]["reference"] == source["reference"]
    load_chart_policy(objects, image_root(tmp_path / "image") / mount["subPath"], tmp_path)
