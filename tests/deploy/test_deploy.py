"""deploy/ checked by the real tools: kustomize and helm render it (the Helm chart with its TPU and
GPU values files too, the same checks on every fleet), the kustomize base is the chart rendered
(deploy/render.py) as committed, the Kubernetes schemas accept every core
object, promtool checks and unit-tests the alerts, and a real Prometheus scrapes a running gateway
under traffic and evaluates every expression of the rules, the adapter config and the dashboard.

Nothing here is skipped: a missing tool fails with how to install it (`.ci/run` installs them all),
because a deploy tree nobody rendered is exactly the one that breaks on the first `kubectl apply`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import RunningGateway, Stub, basic_policy

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAY = DEPLOY / "overlays" / "gke-tpu-v6e"
ADAPTER = DEPLOY / "prometheus-adapter"
CHART = DEPLOY / "helm" / "llm-admission-gateway"
RULES_TEST = Path(__file__).resolve().parent / "rules_test.yaml"
CRD_GROUP = "monitoring.coreos.com/"
CRD_GROUPS = (CRD_GROUP, "cert-manager.io/", "gateway.networking.k8s.io/")  # no schema to check
MIN_KUBERNETES = (1, 33)  # the oldest minor GKE's regular channel still runs

INSTALL = {
    "kubectl": "python tests/setup/install_kubectl.py .venv/bin",
    "helm": "python tests/setup/install_kubectl.py .venv/bin",
    "promtool": "apt-get install -y prometheus",
    "prometheus": "apt-get install -y prometheus",
}


def tool(name: str) -> str:
    """The tool's path, or a failure that says how to install it (never a skip)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: {INSTALL[name]} (`make test` does it)")
    return path


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """Render a kustomization with kubectl's built-in kustomize, as `kubectl apply -k` would."""
    out = subprocess.run(
        [tool("kubectl"), "kustomize", str(directory)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def helm(*values: str, operator: bool = True) -> list[dict[str, Any]]:
    """Render the chart as `helm install -n llm` would, with the chart's `values` files, on a
    cluster with the Prometheus Operator's CRDs (or, `operator=False`, without them)."""
    files = [arg for name in values for arg in ("-f", str(CHART / name))]
    apis = ["--api-versions", "monitoring.coreos.com/v1"] if operator else []
    out = subprocess.run(
        [tool("helm"), "template", "llm", str(CHART), "--namespace", "llm", *apis, *files],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


# The fleets deploy/ installs: the article's TPU fleet with kustomize and with the chart, and the
# chart's GPU fleet.
FLEETS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "kustomize-tpu": lambda: kustomize(OVERLAY),
    "helm-tpu": lambda: helm("values-gke-tpu-v6e.yaml"),
    "helm-gpu": lambda: helm("values-gpu-nvidia.yaml"),
}


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    """The kustomize overlay: what the rules' checks run on (the chart rendered, as
    `test_the_kustomize_base_is_the_chart_rendered` proves)."""
    return kustomize(OVERLAY)


@pytest.fixture(scope="module", params=list(FLEETS))
def fleet(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return FLEETS[request.param]()


@pytest.fixture(scope="module", params=["kustomize-tpu", "helm-tpu"])
def tpu_fleet(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return FLEETS[request.param]()


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def kinds(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def rule_groups(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "PrometheusRule", "llm-gateway")["spec"]  # type: ignore[no-any-return]


def adapter_rules() -> list[dict[str, Any]]:
    config = one(kustomize(ADAPTER), "ConfigMap", "prometheus-adapter-llm")
    return yaml.safe_load(config["data"]["config.yaml"])["externalRules"]  # type: ignore[no-any-return]


def dashboard() -> dict[str, Any]:
    return json.loads((CHART / "files" / "dashboard.json").read_text())  # type: ignore[no-any-return]


def deployed_policy(objects: list[dict[str, Any]]) -> dict[str, Any]:
    config = one(objects, "ConfigMap", gateway_policy_name(objects))
    return yaml.safe_load(config["data"]["policy.yaml"])  # type: ignore[no-any-return]


def check_policy(policy: dict[str, Any], directory: Path) -> None:
    """`llm-gateway check` passes the rendered `policy`; its `/models/...` tokenizer directories
    are the pod's, not this machine's, so only their files are not looked at."""
    path = directory / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--skip-tokenizers", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def gateway_policy_name(objects: list[dict[str, Any]]) -> str:
    volumes = one(objects, "Deployment", "llm-gateway")["spec"]["template"]["spec"]["volumes"]
    return next(v["configMap"]["name"] for v in volumes if v["name"] == "policy")  # type: ignore[no-any-return]


# --- Kustomize and the Kubernetes schemas -------------------------------------------------------


def test_kustomize_renders_every_tree_with_kustomize_v5() -> None:
    out = subprocess.run(
        [tool("kubectl"), "version", "--client", "-o", "json"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    version = json.loads(out.stdout)["kustomizeVersion"]
    assert re.match(r"v[5-9]\.", version), f"kubectl's kustomize is {version}; the tree needs v5+"
    for tree in (DEPLOY / "base", OVERLAY, ADAPTER):
        assert kustomize(tree), tree


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}


def render_base(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEPLOY / "render.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_kustomize_base_is_the_chart_rendered(tmp_path: Path) -> None:
    """Issue 37 item 6: deploy/base is `helm template` of the chart (deploy/render.py), so the
    HPAs, Redis and the monitoring objects are written once, in the chart. A chart change not
    rendered into the base, or a hand edit of the base, fails here, file by file."""
    tool("helm")
    done = render_base(tmp_path / "base")
    assert done.returncode == 0, done.stderr
    rendered, committed = tree(tmp_path / "base"), tree(DEPLOY / "base")
    stale = sorted(
        p for p in rendered.keys() | committed.keys() if rendered.get(p) != committed.get(p)
    )
    assert not stale, f"deploy/base differs from the chart in {stale}: run `make deploy-base`"


def test_rendering_never_replaces_a_directory_it_did_not_write(tmp_path: Path) -> None:
    tool("helm")
    (tmp_path / "mine.yaml").write_text("kind: Mine\n")
    done = render_base(tmp_path)
    assert done.returncode != 0 and "was not rendered here" in done.stderr
    assert tree(tmp_path) == {"mine.yaml": "kind: Mine\n"}


def test_an_overlay_replaces_the_rendered_policy_as_docs_operations_md_shows(
    tmp_path: Path,
) -> None:
    """The base's policy is the chart's; a kustomize user's own replaces it in an overlay, under
    the name the gateways mount and watch, with the generator docs/operations.md shows."""
    text = (ROOT / "docs" / "operations.md").read_text()
    (snippet,) = [
        textwrap.dedent(block)
        for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
        if "behavior: replace" in block
    ]
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    shutil.copytree(DEPLOY / "base", tmp_path / "base")
    mine = {"models": {"tiny": {"tokenizer": "estimate"}}}
    (overlay / "my-policy.yaml").write_text(yaml.safe_dump(mine))
    kustomization = {"resources": ["../base"], **yaml.safe_load(snippet)}
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects = kustomize(overlay)
    assert gateway_policy_name(objects) == "llm-gateway-policy"
    assert deployed_policy(objects) == mine


def validate_core(objects: list[dict[str, Any]]) -> int:
    """Validate every object of Kubernetes' own kinds (strict: no unknown field) against the
    newest schemas kubernetes-validate has and the oldest supported minor's; return how many.
    CRD kinds (the Prometheus Operator's, cert-manager's, the Gateway API's) have no schema
    there and are checked field by field by their tests."""
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: pip install -e '.[dev]'")
    version: str = kubernetes_validate.latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= MIN_KUBERNETES, version
    core = [o for o in objects if not o["apiVersion"].startswith(CRD_GROUPS)]
    for obj in core:
        for v in (version, f"{MIN_KUBERNETES[0]}.{MIN_KUBERNETES[1]}.0"):
            kubernetes_validate.validate(obj, v, strict=True)
    return len(core)


def test_every_core_object_validates_against_current_kubernetes_schemas(
    fleet: list[dict[str, Any]],
) -> None:
    import kubernetes_validate

    assert validate_core([*fleet, *kustomize(ADAPTER)]) >= 15
    # The validator does reject: an unknown field in a Deployment's container.
    broken = json.loads(json.dumps(one(fleet, "Deployment", "llm-gateway")))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_the_gateway_deployment_drains_within_its_grace_period_unprivileged(
    fleet: list[dict[str, Any]],
) -> None:
    pod = one(fleet, "Deployment", "llm-gateway")["spec"]["template"]["spec"]
    (gateway,) = pod["containers"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # preStop, then /readyz fails for readiness_delay_s, then in-flight work gets drain_grace_s:
    # all of it must end before the kubelet's SIGKILL.
    server = deployed_policy(fleet)["server"]
    sleep = float(gateway["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = sleep + server["readiness_delay_s"] + server["drain_grace_s"]
    assert pod["terminationGracePeriodSeconds"] > drain, drain
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert gateway["securityContext"]["readOnlyRootFilesystem"] is True
    assert gateway["securityContext"]["allowPrivilegeEscalation"] is False
    assert gateway["resources"]["requests"] and gateway["resources"]["limits"]
    env = {e["name"]: e for e in gateway["env"]}
    assert env["LLM_GATEWAY_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
    mounts = {m["mountPath"] for m in gateway["volumeMounts"]}
    assert "/etc/llm-gateway" in mounts
    for model in deployed_policy(fleet)["models"].values():  # each tokenizer on a volume
        tokenizer = Path(model["tokenizer"])
        assert any(tokenizer == Path(m) or Path(m) in tokenizer.parents for m in mounts), tokenizer
    pdb = one(fleet, "PodDisruptionBudget", "llm-gateway")
    assert pdb["spec"]["selector"]["matchLabels"] == pod_labels(fleet, "llm-gateway")


def test_the_gateway_runs_a_worker_per_requested_cpu_with_the_metrics_port_set(
    fleet: list[dict[str, Any]],
) -> None:
    """`gateway.workers` processes per pod, one per CPU it requests: fewer leave cores idle,
    more share them; more than one needs the pod's one scrape port and shared state."""
    (gateway,) = one(fleet, "Deployment", "llm-gateway")["spec"]["template"]["spec"]["containers"]
    args = gateway["args"]
    workers = int(args[args.index("--workers") + 1])
    assert workers == 2 == int(gateway["resources"]["requests"]["cpu"])
    policy = deployed_policy(fleet)
    assert policy["state"]["backend"] == "redis" and policy["server"]["metrics_port"]


def test_the_charts_workers_follow_the_cpu_request_and_need_shared_state() -> None:
    def render(*sets: str) -> subprocess.CompletedProcess[str]:
        argv = [tool("helm"), "template", "llm", str(CHART), "--namespace", "llm"]
        for each in sets:
            argv += ["--set", each]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)

    def workers(*sets: str) -> int:
        out = render(*sets)
        assert out.returncode == 0, out.stderr
        (deployment,) = (
            d for d in yaml.safe_load_all(out.stdout)
            if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "llm-gateway"
        )  # fmt: skip
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return int(args[args.index("--workers") + 1])

    assert workers("gateway.resources.requests.cpu=4") == 4
    assert workers("gateway.resources.requests.cpu=1500m") == 2  # rounded up
    assert workers("gateway.resources.requests.cpu=4", "gateway.workers=3") == 3  # as set
    refused = render("redis.enabled=false")
    assert refused.returncode != 0 and "state.backend: redis" in refused.stderr
    assert workers("redis.enabled=false", "gateway.resources.requests.cpu=1") == 1


def pod_labels(objects: list[dict[str, Any]], deployment: str) -> dict[str, str]:
    return one(objects, "Deployment", deployment)["spec"]["selector"]["matchLabels"]  # type: ignore[no-any-return]


def test_each_pool_has_a_tpu_deployment_and_a_headless_service_its_dns_name_resolves_to(
    tpu_fleet: list[dict[str, Any]],
) -> None:
    policy = deployed_policy(tpu_fleet)
    assert set(policy["pools"]) == {"classify-27b", "generate-12b", "generate-27b"}
    for name, pool in policy["pools"].items():
        host, _, port = pool["dns"].rpartition(":")
        service_name, namespace = host.split(".")[:2]
        service = one(tpu_fleet, "Service", service_name)
        assert service["metadata"]["namespace"] == namespace
        assert service["spec"]["clusterIP"] == "None", "a ClusterIP would defeat per-replica caps"
        assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
        deployment = one(tpu_fleet, "Deployment", service_name)
        assert deployment["metadata"]["labels"]["llm.gateway/pool"] == name
        spec = deployment["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {
            "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
            "cloud.google.com/gke-tpu-topology": "2x2",
        }
        (vllm,) = spec["containers"]
        assert vllm["resources"]["requests"]["google.com/tpu"] == "4"
        assert vllm["resources"]["limits"]["google.com/tpu"] == "4"
        flags = dict(a.removeprefix("--").split("=", 1) for a in vllm["args"])
        assert flags["max-model-len"] == "128000"
        assert flags["max-num-batched-tokens"] == "8192"
        assert int(flags["max-num-seqs"]) == pool["max_concurrency"], "the cap is the knee"
        assert flags["served-model-name"] == pool["model"]
        assert "VLLM_TPU_BUCKET_PADDING_GAP" in {e["name"] for e in vllm["env"]}
        assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"
        assert vllm["ports"][0]["containerPort"] == int(port)
    redis = one(tpu_fleet, "StatefulSet", "redis")
    assert redis["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_chart_lints_with_each_values_file() -> None:
    for values in ([], ["-f", str(CHART / "values-gke-tpu-v6e.yaml")],
                   ["-f", str(CHART / "values-gpu-nvidia.yaml")]):  # fmt: skip
        out = subprocess.run(
            [tool("helm"), "lint", "--strict", str(CHART), *values],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_chart_installs_on_a_cluster_without_the_prometheus_operator() -> None:
    """Without the Operator's CRDs its objects are left out (an install would fail on them);
    the rest, the dashboard's ConfigMap included, is rendered all the same."""
    with_operator = helm("values-gpu-nvidia.yaml")
    without = helm("values-gpu-nvidia.yaml", operator=False)
    monitors = [o for o in with_operator if o["apiVersion"].startswith(CRD_GROUP)]
    assert {o["kind"] for o in monitors} == {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    assert without == [o for o in with_operator if o not in monitors]
    assert one(without, "ConfigMap", "llm-gateway-dashboard")


def test_every_fleets_pools_resolve_to_headless_services_and_its_policy_checks(
    fleet: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Whatever the accelerator: each pool's `dns` names a headless Service of its own vLLM
    Deployment, whose --max-num-seqs is the pool's cap and whose accelerators are its tensor
    parallel size; the policy passes `llm-gateway check`; the tokenizers the policy names are
    what the gateway's init container fetches (the chart) or mounts (kustomize)."""
    policy = deployed_policy(fleet)
    for name, pool in policy["pools"].items():
        host, _, port = pool["dns"].rpartition(":")
        service = one(fleet, "Service", host.split(".")[0])
        assert service["spec"]["clusterIP"] == "None"
        deployment = one(fleet, "Deployment", service["metadata"]["name"])
        assert deployment["metadata"]["labels"]["llm.gateway/pool"] == name
        (vllm,) = deployment["spec"]["template"]["spec"]["containers"]
        flags = dict(a.removeprefix("--").split("=", 1) for a in vllm["args"])
        assert int(flags["max-num-seqs"]) == pool["max_concurrency"]
        assert flags["served-model-name"] == pool["model"]
        assert vllm["ports"][0]["containerPort"] == int(port)
        accelerators = {
            k: v for k, v in vllm["resources"]["limits"].items() if k not in ("cpu", "memory")
        }
        tensor_parallel = flags.get("tensor-parallel-size", "1")
        assert accelerators in ({"google.com/tpu": "4"}, {"nvidia.com/gpu": tensor_parallel})
    check_policy(policy, tmp_path)
    pod = one(fleet, "Deployment", "llm-gateway")["spec"]["template"]["spec"]
    tokenizers = {m["tokenizer"] for m in policy["models"].values()}
    for init in pod.get("initContainers", []):
        assert set(init["args"][1::2]) == tokenizers  # the script, then directory, repo, ...


def test_a_policy_change_updates_one_configmap_the_gateways_watch(
    tpu_fleet: list[dict[str, Any]],
) -> None:
    """Issue 36 item 2, the kustomize tree as the chart: the policy ConfigMap keeps its name (a
    hashed one rolled every gateway on any policy edit), is mounted as a directory (the kubelet
    swaps a whole-volume mount only) and watched, so the gateways hot-reload it."""
    pod = one(tpu_fleet, "Deployment", "llm-gateway")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "policy"]
    assert not re.search(r"-[a-z0-9]{10}$", volume["configMap"]["name"]), volume
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "policy"]
    assert "subPath" not in mount
    assert deployed_policy(tpu_fleet)["admin"]["watch_interval_s"] > 0


def test_the_deployed_policy_is_the_articles_fleet_on_headless_services_and_checks(
    tpu_fleet: list[dict[str, Any]], tmp_path: Path
) -> None:
    """deploy/'s copy of policies/gemma3-tpu-v6e.yaml differs only where Kubernetes needs it:
    replicas from DNS, drain timings the pod's grace period is sized for, the Redis that the
    gateways share their tenants' windows in, and the watch that hot-reloads the mounted
    ConfigMap's updates."""
    deployed = deployed_policy(tpu_fleet)
    example = yaml.safe_load((ROOT / "policies" / "gemma3-tpu-v6e.yaml").read_text())
    for pool in (*deployed["pools"].values(), *example["pools"].values()):
        pool.pop("dns", None)
        pool.pop("replicas", None)
    deployed.pop("server")
    assert deployed.pop("admin")["watch_interval_s"] > 0
    assert deployed.pop("state")["url"] == "redis://redis.llm.svc.cluster.local:6379/0"
    assert deployed == example
    check_policy(deployed_policy(tpu_fleet), tmp_path)


def test_the_policys_redis_is_the_statefulsets_and_counts_the_deployments_gateways(
    fleet: list[dict[str, Any]],
) -> None:
    """While Redis is down each gateway takes 1/`gateways` of every limit: a count that drifts
    from the Deployment's replicas over- or under-serves every tenant."""
    state = deployed_policy(fleet)["state"]
    assert state["gateways"] == one(fleet, "Deployment", "llm-gateway")["spec"]["replicas"]
    host, port = state["url"].removeprefix("redis://").split("/")[0].split(":")
    service_name, namespace = host.split(".")[:2]
    service = one(fleet, "Service", service_name)
    assert service["metadata"]["namespace"] == namespace
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
    assert service["spec"]["selector"] == pod_labels_of(one(fleet, "StatefulSet", "redis"))


def pod_labels_of(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def test_one_hpa_per_vllm_deployment_on_the_gateways_signals_never_cpu(
    fleet: list[dict[str, Any]],
) -> None:
    served = {r["name"]["as"] for r in adapter_rules()}
    vllm = {d["metadata"]["name"]: d for d in kinds(fleet, "Deployment") if d is not None}
    vllm.pop("llm-gateway")
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in kinds(fleet, "HorizontalPodAutoscaler")}
    assert set(hpas) == set(vllm)
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        pool = vllm[name]["metadata"]["labels"]["llm.gateway/pool"]
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "External", "never on CPU or memory"
            assert metric["external"]["metric"]["name"] in served
            assert metric["external"]["metric"]["selector"]["matchLabels"] == {"pool": pool}
        targets = {
            m["external"]["metric"]["name"]: m["external"]["target"] for m in hpa["spec"]["metrics"]
        }
        demand = {"type": "AverageValue", "averageValue": "1"}  # replicas, proposed as they are
        # the forecast beside the reactive estimate: the HPA's max keeps the reactive one a floor
        assert targets["llm_pool_desired_replicas"] == demand
        assert targets["llm_pool_desired_replicas_forecast"] == demand
        up, down = hpa["spec"]["behavior"]["scaleUp"], hpa["spec"]["behavior"]["scaleDown"]
        assert up["stabilizationWindowSeconds"] == 0
        assert down["stabilizationWindowSeconds"] >= 300
        assert max(p["value"] for p in down["policies"] if p["type"] == "Pods") == 1


def test_each_pools_hpa_holds_the_queue_wait_to_its_own_slo(
    tpu_fleet: list[dict[str, Any]],
) -> None:
    """docs/operations.md's targets: 5 s for classification, 10 s for generation, which waits
    longer by design (its queue's max_wait_s is 30 s against classification's 20 s)."""
    slos = {}
    for hpa in kinds(tpu_fleet, "HorizontalPodAutoscaler"):
        (wait,) = [
            m["external"] for m in hpa["spec"]["metrics"]
            if m["external"]["metric"]["name"] == "llm_pool_queue_wait_p95_seconds"
        ]  # fmt: skip
        slos[wait["metric"]["selector"]["matchLabels"]["pool"]] = wait["target"]
    assert slos == {
        "classify-27b": {"type": "Value", "value": "5"},
        "generate-12b": {"type": "Value", "value": "10"},
        "generate-27b": {"type": "Value", "value": "10"},
    }


def test_a_pool_with_objectives_may_scale_on_its_miss_share_and_one_without_may_not(
    tmp_path: Path,
) -> None:
    """`autoscaling.sloMissRatio`: the share of the pool's objectives missed or refused
    (`llm_pool_slo_miss_ratio`, served by the adapter) against a Value target, beside the
    other signals. Refused on a pool without `slo`: its HPA could never read the metric, and an
    HPA that cannot read one of its metrics never scales down."""
    slo = {"objectives": {"standard": {"ttft_ms": 2000, "tpot_ms": 100}}}
    values = tmp_path / "slo.yaml"
    values.write_text(yaml.safe_dump({"pools": {"generate-27b": {
        "autoscaling": {"sloMissRatio": 0.1}, "policy": {"slo": slo},
    }}}))  # fmt: skip
    hpas = {
        h["metadata"]["name"]: {m["external"]["metric"]["name"]: m for m in h["spec"]["metrics"]}
        for h in kinds(helm("values-gke-tpu-v6e.yaml", str(values)), "HorizontalPodAutoscaler")
    }
    miss = hpas["gemma3-27b-gen"]["llm_pool_slo_miss_ratio"]["external"]
    assert miss == {
        "metric": {"name": "llm_pool_slo_miss_ratio", "selector": {"matchLabels": {"pool": "generate-27b"}}},
        "target": {"type": "Value", "value": "0.1"},
    }  # fmt: skip
    assert "llm_pool_slo_miss_ratio" in {r["name"]["as"] for r in adapter_rules()}
    assert "llm_pool_desired_replicas" in hpas["gemma3-27b-gen"]  # the demand stays the floor
    assert "llm_pool_slo_miss_ratio" not in hpas["gemma3-12b-gen"]
    values.write_text(yaml.safe_dump({"pools": {"generate-12b": {
        "autoscaling": {"sloMissRatio": 0.1},
    }}}))  # fmt: skip
    files = ["-f", str(CHART / "values-gke-tpu-v6e.yaml"), "-f", str(values)]
    out = subprocess.run(
        [tool("helm"), "template", "llm", str(CHART), "--namespace", "llm", *files],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "pools.generate-12b.autoscaling.sloMissRatio: the pool's policy has no `slo`" in (
        out.stderr
    )


def test_the_adapter_serves_the_forecast_summed_over_gateways_as_the_reactive_estimate() -> None:
    rules = {r["name"]["as"]: r for r in adapter_rules()}
    for name in ("llm_pool_desired_replicas", "llm_pool_desired_replicas_forecast"):
        rule = rules[name]
        assert rule["seriesQuery"] == f'{name}{{pool!=""}}'  # the gateway's gauge of that name
        assert rule["metricsQuery"] == "sum by (pool) (<<.Series>>{<<.LabelMatchers>>})"
        assert rule["resources"] == {"namespaced": False}


# --- The Prometheus Operator's objects (CRDs: no schema in kubernetes-validate) -------------------


def monitored_service(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The one Service the gateway's ServiceMonitor selects."""
    monitor = one(objects, "ServiceMonitor", "llm-gateway")
    selected = [
        s
        for s in kinds(objects, "Service")
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["llm-gateway-metrics"]
    return selected[0]


def test_servicemonitor_and_podmonitor_select_real_ports(fleet: list[dict[str, Any]]) -> None:
    monitor = one(fleet, "ServiceMonitor", "llm-gateway")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = monitored_service(fleet)
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+s", endpoint["interval"])
    pods = one(fleet, "PodMonitor", "vllm")
    assert pods["apiVersion"] == "monitoring.coreos.com/v1"
    for deployment in kinds(fleet, "Deployment"):
        if deployment["metadata"]["name"] == "llm-gateway":
            continue
        template = deployment["spec"]["template"]
        assert (
            pods["spec"]["selector"]["matchLabels"].items()
            <= template["metadata"]["labels"].items()
        )
        names = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
        assert {e["port"] for e in pods["spec"]["podMetricsEndpoints"]} <= names


def test_metrics_are_served_on_their_own_port_which_the_client_service_does_not_expose(
    fleet: list[dict[str, Any]],
) -> None:
    """/metrics names tenants and replica URLs: the policy moves it to `server.metrics_port`, the
    container names that port `metrics`, and only the metrics Service (scraped) reaches it."""
    metrics_port = deployed_policy(fleet)["server"]["metrics_port"]
    (gateway,) = one(fleet, "Deployment", "llm-gateway")["spec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert container_ports["metrics"] == metrics_port != container_ports["http"]
    public = one(fleet, "Service", "llm-gateway")["spec"]["ports"]
    assert [p["targetPort"] for p in public] == ["http"]
    private = one(fleet, "Service", "llm-gateway-metrics")["spec"]["ports"]
    assert [p["targetPort"] for p in private] == ["metrics"]


def test_prometheusrule_has_the_operators_fields_and_a_runbook_per_alert(
    rendered: list[dict[str, Any]],
) -> None:
    rule = one(rendered, "PrometheusRule", "llm-gateway")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "llm"
    groups = rule["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups)
    alerts, records = {}, set()
    for group in groups:
        for r in group["rules"]:
            if "record" in r:  # a recording rule: a name, an expression, no alerting fields
                assert set(r) <= {"record", "expr", "labels"}
                assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", r["record"]), r["record"]
                records.add(r["record"])
                continue
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}
            assert isinstance(r["expr"], str) and r["expr"].strip()
            assert re.fullmatch(r"\d+[smh]", r.get("for", "0s"))
            assert r["labels"]["severity"] in {"page", "warning"}
            assert r["annotations"]["runbook"] and r["annotations"]["summary"]
            alerts[r["alert"]] = r
    article = alerts["LLMEndToEndLatencyP95High"]
    assert article["expr"] == (
        "histogram_quantile(0.95, sum by (le, model) "
        "(rate(llm_request_e2e_seconds_bucket[5m]))) > 30"
    )
    assert article["for"] == "10m"
    used = " ".join(r["expr"] for r in alerts.values())
    for metric in ("llm_queue_wait_seconds_bucket", "llm_rejections_total", "llm_replica_up",
                   "llm_replica_ejections_total", "llm_pool_capacity", "llm_state_backend_up",
                   "llm_policy_reload_errors_total", "llm_tls_reload_errors_total",
                   "llm_slo_requests_total"):  # fmt: skip
        assert metric in used, metric
    assert {record for record in records if record in used} == {
        "pool_objective:llm_slo_attainment:ratio_rate5m"
    }


def test_the_dashboard_has_the_issues_panels_per_pool_and_class() -> None:
    board = dashboard()
    assert {v["name"] for v in board["templating"]["list"]} >= {"datasource", "pool", "class"}
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in board["panels"]}
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])

    def panel(*needles: str) -> str:
        found = [t for t, e in exprs.items() if all(n in e for n in needles)]
        assert found, needles
        return found[0]

    panel("rate(llm_requests_total", "pool, class")  # requests/s
    panel("sum by (endpoint) (rate(llm_requests_total")  # each API's share
    panel("llm_input_tokens_total", "llm_output_tokens_total", "* 60")  # TPM
    for metric in ("e2e", "ttft", "tpot", "queue_wait"):
        name = f"llm_{'request_' if metric != 'queue_wait' else ''}{metric}_seconds_bucket"
        panel(
            *(
                f"histogram_quantile({q}, sum by (le, pool, class) (rate({name}"
                for q in ("0.5", "0.95", "0.99")
            )
        )
    panel("llm_queue_depth")
    panel("llm_inflight_requests", "llm_pool_capacity")  # saturation
    panel("llm_rejections_total", "reason")
    panel("llm_replica_up", "llm_replica_ejections_total")
    panel("llm_pool_desired_replicas{", "llm_pool_desired_replicas_forecast{", "llm_replica_up")
    panel("llm_tenant_tokens_total")


# --- promtool -----------------------------------------------------------------------------------


def write_rules(objects: list[dict[str, Any]], directory: Path, annotations: bool) -> Path:
    spec = json.loads(json.dumps(rule_groups(objects)))
    if not annotations:
        for group in spec["groups"]:
            for r in group["rules"]:
                r.pop("annotations", None)
    path = directory / ("full.yaml" if annotations else "rules.yaml")
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_promtool_checks_the_rules_and_unit_tests_every_alert(
    rendered: list[dict[str, Any]], tmp_path: Path
) -> None:
    promtool = tool("promtool")
    full = write_rules(rendered, tmp_path, annotations=True)
    check = subprocess.run(
        [promtool, "check", "rules", str(full)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    write_rules(rendered, tmp_path, annotations=False)
    tests = yaml.safe_load(RULES_TEST.read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    alerts = {
        r["alert"] for g in rule_groups(rendered)["groups"] for r in g["rules"] if "alert" in r
    }
    assert tested == alerts, "every alert has a unit test"
    for name in alerts:  # ... in which it fires and in which it does not
        cases = [t for c in tests["tests"] for t in c["alert_rule_test"] if t["alertname"] == name]
        assert any(t["exp_alerts"] for t in cases) and any(not t["exp_alerts"] for t in cases)
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    run = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def gateway_down_jobs() -> set[str]:
    """The jobs tests/deploy/rules_test.yaml expects LLMGatewayDown to fire for."""
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    return {
        alert["exp_labels"]["job"]
        for case in tests
        for t in case["alert_rule_test"]
        if t["alertname"] == "LLMGatewayDown"
        for alert in t["exp_alerts"]
    }


# --- A real Prometheus scraping a real gateway ----------------------------------------------------

KEY, LIMITED_KEY = "deploy-test-key", "deploy-limited-key"
RATE_INTERVAL = "1m"
# Expressions with no series yet, and why; every other expression must return data.
# Series this test's single gateway cannot have, each with where they are scraped for real.
NO_DATA: dict[str, str] = {
    "llm_gateway_worker_restarts_total": "a pod's parent's (`serve --workers N`):"
    " tests/server/test_workers.py scrapes it after a worker's restart",
}
COMPARISON = re.compile(r"\s*(>|<|==|!=|>=|<=)\s*[-+0-9.e]+\s*$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> None:
        """Fail with Prometheus' own words if it exited (a bad rule file, a taken port)."""
        if self.proc.poll() is not None:
            pytest.fail(
                f"prometheus exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
            )


def label_name(name: str) -> str:
    """A Kubernetes label's name as Prometheus' discovery and the operator spell it in a label
    (`__meta_kubernetes_service_label_<name>`): what a label name cannot hold becomes `_`."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def operator_scrape_config(objects: list[dict[str, Any]], target: str) -> dict[str, Any]:
    """The scrape config the Prometheus Operator generates for the gateway's ServiceMonitor
    (pkg/prometheus/promcfg.go), Kubernetes discovery replaced by one static target carrying
    what discovery would say of the Service: its name and labels. `job` is set as the operator
    sets it: the Service's name, then the value of the Service label `jobLabel` names, where
    that is set and not empty. So the alerts meet the job name a cluster would give them, not
    one this test chose."""
    monitor = one(objects, "ServiceMonitor", "llm-gateway")
    service = monitored_service(objects)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert "relabelings" not in endpoint  # the operator runs them after its own: they could rename
    meta = {"__meta_kubernetes_service_name": service["metadata"]["name"]}
    for key, value in service["metadata"]["labels"].items():
        meta[f"__meta_kubernetes_service_label_{label_name(key)}"] = value
    relabel: list[dict[str, Any]] = [
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job",
         "replacement": "${1}"},
    ]  # fmt: skip
    if job_label := monitor["spec"].get("jobLabel"):
        relabel.append(
            {"source_labels": [f"__meta_kubernetes_service_label_{label_name(job_label)}"],
             "target_label": "job", "regex": "(.+)", "replacement": "${1}"}
        )  # fmt: skip
    name = monitor["metadata"]
    return {
        "job_name": f"serviceMonitor/{name['namespace']}/{name['name']}/0",
        "metrics_path": endpoint["path"],
        "static_configs": [{"targets": [target], "labels": meta}],
        "relabel_configs": relabel,
    }


@contextlib.contextmanager
def prometheus(directory: Path, scrape: dict[str, Any], rules: Path) -> Iterator[Prometheus]:
    """Debian's Prometheus on a free loopback port, running `scrape` every second."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [scrape],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    log_path = directory / "prometheus.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [tool("prometheus"), f"--config.file={directory / 'prometheus.yml'}",
         f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


async def traffic(http: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> None:
    """Bursts past the pool's cap and queue (queue waits, 429s), streams (TTFT, TPOT), and a
    tenant over its rpm (quota refusals); bounded by `stop` and the test's deadline."""

    async def one(stream: bool, key: str = KEY) -> None:
        body = {"model": "tiny", "prompt": "hello world " * 20, "max_tokens": 8, "stream": stream}
        headers = {"Authorization": f"Bearer {key}"}
        with contextlib.suppress(aiohttp.ClientError):
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                await resp.read()

    while not stop.is_set():
        burst = [one(stream=i % 2 == 0) for i in range(12)] + [one(False, LIMITED_KEY)]
        await asyncio.gather(*burst)
        await asyncio.sleep(0.2)


async def query(http: aiohttp.ClientSession, base: str, expr: str) -> list[Any]:
    async with http.get(f"{base}/api/v1/query", params={"query": expr}) as resp:
        body = await resp.json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]  # type: ignore[no-any-return]


LABEL_VALUES = re.compile(r"label_values\((\w+), *(\w+)\)")


async def has_data(http: aiohttp.ClientSession, base: str, where: str, expr: str) -> bool:
    """Evaluate `expr` (an error fails the test) and say whether it has data: for an alert, its
    expression before the threshold (an alert that does not fire still has to see its series);
    for a dashboard variable, Grafana's `label_values` through the same label API Grafana uses."""
    if variable := LABEL_VALUES.fullmatch(expr):
        metric, label = variable.groups()
        url = f"{base}/api/v1/label/{label}/values"
        async with http.get(url, params={"match[]": metric}) as resp:
            body = await resp.json()
        assert body["status"] == "success", f"{where}: {body}"
        return bool(body["data"])
    result = await query(http, base, expr)
    if where.startswith("rule ") and not result:
        result = await query(http, base, COMPARISON.sub("", expr))
    return bool(result)


def expressions(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Every PromQL expression deploy/ ships, by where it comes from, made evaluable: the adapter's
    templates filled as prometheus-adapter fills them, the dashboard's variables set to All."""
    found: dict[str, str] = {}
    for group in rule_groups(objects)["groups"]:
        for r in group["rules"]:
            found[f"rule {r.get('alert') or r['record']}"] = r["expr"]
    for r in adapter_rules():
        series = r["seriesQuery"].split("{")[0]
        expr = r["metricsQuery"].replace("<<.Series>>", series)
        found[f"adapter {r['name']['as']}"] = expr.replace("<<.LabelMatchers>>", 'pool="main"')
    board = dashboard()
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL)
            expr = expr.replace('"$pool"', '".*"').replace('"$class"', '".*"')
            found[f"dashboard {panel['title']} {target['refId']}"] = expr
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            found[f"dashboard variable {var['name']}"] = var["definition"]
    return found


def wants_data(expr: str) -> bool:
    return not any(metric in expr for metric in NO_DATA)


async def test_prometheus_scrapes_the_gateway_and_evaluates_every_expression(
    rendered: list[dict[str, Any]],
    tmp_path: Path,
    stub_factory: Callable[..., Awaitable[Stub]],
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    tokenizer_dir: Path,
    http: aiohttp.ClientSession,
) -> None:
    stubs = [await stub_factory(delay_s=0.05, chunk_delay_s=0.01) for _ in range(2)]
    stubs.append(await stub_factory(status=500))  # fails every request: ejected, then readmitted
    policy = basic_policy(
        tokenizer_dir, [s.url for s in stubs], max_concurrency=2,
        queue={"max_depth": 4, "max_wait_s": 0.15},
        slo={"objectives": {"standard": {"ttft_ms": 60, "tpot_ms": 20}}},
    )  # fmt: skip
    policy["tenants"] = {
        "deploy-test": {"keys": [sha(KEY)], "tier": "standard", "tpm": 10_000_000},
        "limited": {"keys": [sha(LIMITED_KEY)], "tier": "sheddable", "rpm": 2},
    }
    gw = await gateway_factory(policy)
    exprs = expressions(rendered)
    # the metrics port, as deployed: with tenants the public one serves no /metrics
    scrape = operator_scrape_config(rendered, gw.metrics_url.removeprefix("http://"))
    with prometheus(tmp_path, scrape, write_rules(rendered, tmp_path, annotations=True)) as prom:
        base = prom.url
        stop = asyncio.Event()
        load = asyncio.create_task(traffic(http, gw.url, stop))
        try:
            async with asyncio.timeout(40):
                await until_ready(http, prom)
                while not (up := await query(http, base, "up")):  # noqa: ASYNC110 - in Prometheus
                    await asyncio.sleep(0.5)
                assert {s["metric"]["job"] for s in up} == gateway_down_jobs(), (
                    "the job the operator names is the one LLMGatewayDown's promtool case fires on"
                )
                missing = dict(exprs)
                while True:
                    for where, expr in list(missing.items()):
                        if await has_data(http, base, where, expr) or not wants_data(expr):
                            del missing[where]
                    if not missing:
                        break
                    prom.alive()
                    await asyncio.sleep(1)
        except TimeoutError:
            pytest.fail(f"no data within 40 s for: {sorted(missing)}")
        finally:
            stop.set()
            await load
        for where, expr in exprs.items():
            if not wants_data(expr):
                assert not await has_data(http, base, where, expr), f"{where}: has data now"
        await rules_are_healthy(http, base)


async def until_ready(http: aiohttp.ClientSession, prom: Prometheus) -> None:
    while True:
        prom.alive()
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{prom.url}/-/ready") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.2)


async def rules_are_healthy(http: aiohttp.ClientSession, base: str) -> None:
    """Prometheus itself loaded the PrometheusRule's groups and evaluates them without error."""
    async with http.get(f"{base}/api/v1/rules") as resp:
        body = await resp.json()
    rules = [r for g in body["data"]["groups"] for r in g["rules"]]
    assert len(rules) >= 10
    for r in rules:
        assert r["health"] in {"ok", "unknown"} and not r.get("lastError"), r


def test_the_dockerfile_runs_as_the_deployments_non_root_user_with_no_model_inside(
    rendered: list[dict[str, Any]],
) -> None:
    """No container engine here: the Dockerfile is read for what the Deployment relies on."""
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    (user,) = [line.split()[1] for line in lines if line.startswith("USER ")]
    pod = one(rendered, "Deployment", "llm-gateway")["spec"]["template"]["spec"]
    assert user == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    copies = " ".join(line for line in lines if line.startswith(("COPY", "ADD")))
    assert "tokenizer" not in copies and "models" not in copies and "policies" not in copies
    assert 'ENTRYPOINT ["llm-gateway"]' in lines
    assert lines[0].startswith("#") and any(
        line.startswith("FROM python:3.11-slim") for line in lines
    )


def image_env() -> dict[str, str]:
    """The environment the Dockerfile's final stage sets (`ENV` lines, continuations joined)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final = text.rsplit("\nFROM ", 1)[1]
    pairs = [p for line in final.splitlines() if line.startswith("ENV ") for p in line.split()[1:]]
    return dict(pair.split("=", 1) for pair in pairs)


def hub_offline(env: dict[str, str]) -> bool:
    """Whether huggingface_hub, under this environment, refuses to reach the Hub."""
    out = subprocess.run(
        [sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_OFFLINE)"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return out.stdout.strip() == "True"


@pytest.mark.parametrize("values", ["values.yaml", "values-gpu-nvidia.yaml"])
def test_the_tokenizer_init_container_reaches_the_hub_which_the_gateway_never_does(
    values: str,
) -> None:
    """The init container runs the gateway's image, whose HF_HUB_OFFLINE=1 would make its
    download fail before trying: it must turn that off, and only it."""
    pod = one(helm(values), "Deployment", "llm-gateway")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (gateway,) = pod["containers"]

    def env_of(container: dict[str, Any]) -> dict[str, str]:
        return {**image_env(), **{e["name"]: e["value"] for e in container["env"] if "value" in e}}

    assert hub_offline(image_env())
    assert not hub_offline(env_of(init))
    assert hub_offline(env_of(gateway))
    assert "/models" in {m["mountPath"] for m in init["volumeMounts"]}
