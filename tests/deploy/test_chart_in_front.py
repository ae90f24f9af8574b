"""The chart in front of what a cluster already runs: pools on vLLM it does not create
(values-existing-vllm.yaml), a policy ConfigMap whose name stays so that upgrades hot-reload
instead of rolling the gateways, the listener's certificate from a Secret (cert-manager's, if
asked), and an HTTPRoute for a Gateway API gateway in front.

Rendered by helm and checked by kubernetes-validate; the CRD kinds (cert-manager's Certificate,
the Gateway API's HTTPRoute) field by field against their published schemas, which are not
available offline. The mounted Secret is laid out as the kubelet lays it out and served by a real
gateway, through a renewal.
"""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.conftest import basic_policy, serving
from tests.deploy.test_deploy import (
    CHART,
    adapter_rules,
    check_policy,
    deployed_policy,
    helm,
    kinds,
    one,
    operator_scrape_config,
    tool,
    validate_core,
)
from tests.server.test_reload import kubelet_update
from tests.server.test_tls import ca, issue, peer_serial, served  # noqa: F401 - `ca`: a fixture

EXISTING = "values-existing-vllm.yaml"
NAMESPACE = "llm"  # test_deploy.helm's release namespace


def values_file(directory: Path, values: dict[str, Any], name: str = "values.yaml") -> str:
    """`values` as a values file: an absolute path, which `helm()` takes as it is."""
    path = directory / name
    path.write_text(yaml.safe_dump(values))
    return str(path)


def helm_fails(*values: str) -> str:
    """What `helm template` says when the values are refused."""
    files = [arg for name in values for arg in ("-f", str(CHART / name))]
    out = subprocess.run(
        [tool("helm"), "template", "llm", str(CHART), "--namespace", NAMESPACE, *files],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode != 0, "rendered"
    return out.stderr


def gateway_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment", "llm-gateway")["spec"]["template"]  # type: ignore[no-any-return]


def mount(pod: dict[str, Any], volume: str) -> dict[str, Any]:
    (gateway,) = pod["spec"]["containers"]
    (found,) = [m for m in gateway["volumeMounts"] if m["name"] == volume]
    return found  # type: ignore[no-any-return]


# --- In front of vLLM the chart does not create --------------------------------------------------


def test_the_gateway_only_install_creates_no_vllm_and_validates() -> None:
    objects = helm(EXISTING)
    assert [d["metadata"]["name"] for d in kinds(objects, "Deployment")] == ["llm-gateway"]
    assert not kinds(objects, "PodMonitor")  # it would select the chart's vLLM pods: none
    validate_core(objects)
    lint = subprocess.run(
        [tool("helm"), "lint", "--strict", str(CHART), "-f", str(CHART / EXISTING)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_each_pool_finds_the_teams_replicas_and_its_hpa_scales_the_teams_workload(
    tmp_path: Path,
) -> None:
    values = yaml.safe_load((CHART / EXISTING).read_text())["pools"]
    objects = helm(EXISTING)
    pools = deployed_policy(objects)["pools"]
    assert set(pools) == {"chat-8b", "generate-70b", "qwen3-8b"}
    # The team's headless Service, by its cluster DNS name.
    assert pools["chat-8b"]["dns"] == f"vllm-llama-8b.{NAMESPACE}.svc.cluster.local:8000"
    # The team's pods, through a headless Service of the chart's selecting them.
    host, _, port = pools["generate-70b"]["dns"].rpartition(":")
    service = one(objects, "Service", host.split(".")[0])
    assert host.split(".")[1] == service["metadata"]["namespace"] == NAMESPACE
    assert service["spec"]["clusterIP"] == "None", "a ClusterIP would defeat per-replica caps"
    assert service["spec"]["selector"] == values["generate-70b"]["existing"]["selector"]
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(int(port),) * 2]
    # Fixed URLs.
    assert pools["qwen3-8b"]["replicas"] == values["qwen3-8b"]["existing"]["urls"]
    # An HPA on the gateway's signals for each pool that names its workload, and only those.
    served_metrics = {r["name"]["as"] for r in adapter_rules()}
    hpas = {h["metadata"]["labels"]["llm.gateway/pool"]: h for h in kinds(objects, "HorizontalPodAutoscaler")}  # fmt: skip
    assert set(hpas) == {"chat-8b", "generate-70b"}
    for pool, hpa in hpas.items():
        scale = values[pool]["autoscaling"]
        assert hpa["metadata"]["namespace"] == NAMESPACE  # the workload's: an HPA scales there only
        assert hpa["spec"]["scaleTargetRef"] == scale["scaleTargetRef"]
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
            scale["minReplicas"], scale["maxReplicas"],
        )  # fmt: skip
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "External"
            assert metric["external"]["metric"]["name"] in served_metrics
            assert metric["external"]["metric"]["selector"]["matchLabels"] == {"pool": pool}
    check_policy(deployed_policy(objects), tmp_path)


def documented_check() -> str:
    """docs/operations.md's render-and-check of a gateway-only install, as one shell script."""
    text = (CHART.parent.parent.parent / "docs" / "operations.md").read_text()
    block = text.split("3. **Check it before installing.**", 1)[1].split("```sh\n", 1)[1]
    lines = block.split("```", 1)[0].splitlines()
    return "\n".join(line.removeprefix("   ") for line in lines)


def test_the_documented_check_renders_the_gateway_only_policy_and_checks_it(
    tmp_path: Path,
) -> None:
    script = documented_check().replace("deploy/helm/llm-admission-gateway", str(CHART))
    script = script.replace("my-values.yaml", str(CHART / EXISTING))
    env = {k: os.environ[k] for k in ("PYTHONPATH", "HOME") if k in os.environ}
    env["PATH"] = f"{Path(tool('helm')).parent}:{Path(sys.executable).parent}:/usr/bin:/bin"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    checked = yaml.safe_load((tmp_path / "policy.yaml").read_text())
    assert set(checked["pools"]) == set(deployed_policy(helm(EXISTING))["pools"])
    assert checked["pools"]["chat-8b"]["dns"] == "vllm-llama-8b.inference.svc.cluster.local:8000"


def test_the_prometheus_operator_scrapes_the_gateway_only_install_as_any_other() -> None:
    """The same scrape config (job name, relabelling) as the fleet whose alerts and dashboard a
    real Prometheus evaluates in test_deploy: the alerts apply unchanged."""
    target = "127.0.0.1:9090"
    assert operator_scrape_config(helm(EXISTING), target) == operator_scrape_config(
        helm("values-gke-tpu-v6e.yaml"), target
    )


def test_a_pool_in_front_of_existing_vllm_says_where_in_exactly_one_way(tmp_path: Path) -> None:
    both = {"pools": {"chat-8b": {"existing": {"service": "a", "urls": ["http://b:8000"]}}}}
    said = helm_fails(EXISTING, values_file(tmp_path, both))
    assert "pools.chat-8b.existing: give one of service" in said
    https = {"pools": {"chat-8b": {"existing": {"scheme": "https", "namespace": "team-a"}}}}
    pools = deployed_policy(helm(EXISTING, values_file(tmp_path, https, "https.yaml")))["pools"]
    assert pools["chat-8b"]["dns"] == {
        "name": "vllm-llama-8b.team-a.svc.cluster.local:8000", "scheme": "https",
    }  # fmt: skip


# --- The policy, hot-reloaded ---------------------------------------------------------------------


def test_a_policy_change_keeps_the_configmaps_name_and_the_pods_unless_asked_to_roll(
    tmp_path: Path,
) -> None:
    """An upgrade that changes only the policy changes only the ConfigMap's contents: the pod
    template stays, so no gateway restarts; the kubelet updates the mounted directory (never a
    subPath, which it does not update) and the gateway's watch reloads it (tests/server/test_reload.py,
    on the kubelet's exact layout). `rollOnChange` rolls them instead."""
    edit = {"policy": {"server": {"drain_grace_s": 20}}}
    before, after = helm(), helm(values_file(tmp_path, edit))
    assert deployed_policy(before) != deployed_policy(after)
    for objects in (before, after):
        config = one(objects, "ConfigMap", "llm-gateway-policy")
        assert "policy.yaml" in config["data"]
        pod = gateway_pod(objects)
        policy_mount = mount(pod, "policy")
        assert "subPath" not in policy_mount
        (gateway,) = pod["spec"]["containers"]
        policy_file = Path(gateway["args"][gateway["args"].index("--policy") + 1])
        assert policy_file == Path(policy_mount["mountPath"]) / "policy.yaml"
        assert deployed_policy(objects)["admin"]["watch_interval_s"] > 0
    assert gateway_pod(before) == gateway_pod(after)
    roll = {"policyUpdates": {"rollOnChange": True}}
    rolled = [helm(values_file(tmp_path, roll, "roll.yaml"), extra) for extra in (
        values_file(tmp_path, {}, "same.yaml"), values_file(tmp_path, edit, "edit.yaml"))]  # fmt: skip
    checksums = [gateway_pod(o)["metadata"]["annotations"]["checksum/policy"] for o in rolled]
    assert checksums[0] != checksums[1]
    assert one(rolled[1], "ConfigMap", "llm-gateway-policy")  # the name stays either way


# --- TLS from a Secret ----------------------------------------------------------------------------

TLS = {"tls": {"secretName": "llm-gateway-tls",
               "certManager": {"issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer"},
                               "dnsNames": ["llm.example.internal"]}}}  # fmt: skip
# cert-manager.io/v1 Certificate, from cert-manager's CRD (deploy/crds): the spec's fields, the
# required ones, and the enumerations the chart uses.
CERTIFICATE_SPEC = {
    "additionalOutputFormats", "commonName", "dnsNames", "duration", "emailAddresses",
    "encodeUsagesInRequest", "ipAddresses", "isCA", "issuerRef", "keystores", "literalSubject",
    "nameConstraints", "otherNames", "privateKey", "renewBefore", "renewBeforePercentage",
    "revisionHistoryLimit", "secretName", "secretTemplate", "signatureAlgorithm", "subject",
    "uris", "usages",
}  # fmt: skip
PRIVATE_KEY = {"algorithm": {"RSA", "ECDSA", "Ed25519"}, "encoding": {"PKCS1", "PKCS8"},
               "rotationPolicy": {"Never", "Always"}}  # fmt: skip
ECDSA_SIZES = {256, 384, 521}
KEY_USAGES = {
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime",
    "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc",
}  # fmt: skip
GO_DURATION = re.compile(r"(\d+(\.\d+)?(h|m|s|ms|us|µs|ns))+")


def go_hours(duration: str) -> float:
    scale = {"h": 1.0, "m": 1 / 60, "s": 1 / 3600}
    return sum(float(n) * scale[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", duration))


def test_tls_comes_from_a_mounted_secret_cert_manager_issues_and_the_probes_speak_https(
    tmp_path: Path,
) -> None:
    objects = helm(values_file(tmp_path, TLS))
    validate_core(objects)
    pod = gateway_pod(objects)
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "tls"]
    assert volume["secret"] == {"secretName": "llm-gateway-tls"}  # not optional: no HTTP fallback
    tls_mount = mount(pod, "tls")
    assert "subPath" not in tls_mount and tls_mount["readOnly"] is True  # renewals reach it
    directory = Path(tls_mount["mountPath"])
    # A kubernetes.io/tls Secret's keys, which cert-manager writes too.
    assert deployed_policy(objects)["server"]["tls"] == {
        "cert_file": str(directory / "tls.crt"), "key_file": str(directory / "tls.key"),
    }  # fmt: skip
    (gateway,) = pod["spec"]["containers"]
    for probe in ("livenessProbe", "startupProbe"):
        assert gateway[probe]["httpGet"]["scheme"] == "HTTPS", probe
    # A pod of workers is ready as its parent says, on the plain metrics port.
    assert gateway["readinessProbe"]["httpGet"] == {
        "path": "/readyz",
        "port": "metrics",
        "scheme": "HTTP",
    }
    metrics = {p["name"]: p["containerPort"] for p in gateway["ports"]}["metrics"]
    assert deployed_policy(objects)["server"]["metrics_port"] == metrics  # scraped over HTTP
    certificate = one(objects, "Certificate", "llm-gateway")
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    spec = certificate["spec"]
    assert set(spec) <= CERTIFICATE_SPEC and {"issuerRef", "secretName"} <= set(spec)
    assert spec["secretName"] == volume["secret"]["secretName"]
    assert spec["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer"}
    for field, allowed in PRIVATE_KEY.items():
        assert spec["privateKey"].get(field, next(iter(allowed))) in allowed, field
    assert spec["privateKey"]["rotationPolicy"] == "Always"
    assert spec["privateKey"]["size"] in ECDSA_SIZES
    assert set(spec["usages"]) <= KEY_USAGES and "server auth" in spec["usages"]
    for field, minimum_hours in (("duration", 1), ("renewBefore", 5 / 60)):
        assert GO_DURATION.fullmatch(spec[field]) and go_hours(spec[field]) >= minimum_hours
    assert go_hours(spec["renewBefore"]) < go_hours(spec["duration"])
    services = {s["metadata"]["name"] for s in kinds(objects, "Service")}
    assert "llm-gateway" in services
    cluster_name = f"llm-gateway.{NAMESPACE}.svc.cluster.local"  # what a BackendTLSPolicy names
    assert {cluster_name, "llm.example.internal"} <= set(spec["dnsNames"])
    assert not kinds(helm(), "Certificate")  # off unless asked
    said = helm_fails(values_file(tmp_path, {"tls": {"certManager": TLS["tls"]["certManager"]}}, "no-secret.yaml"))  # fmt: skip
    assert "tls.certManager.issuerRef needs tls.secretName" in said


async def test_the_listener_serves_the_mounted_secret_and_its_renewal(
    ca: tuple[Path, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    tokenizer_dir: Path,
) -> None:
    """The chart's TLS wiring run for real: the Secret's directory laid out as the kubelet mounts
    it, at the chart's mount path (under a temporary root), the policy's `server.tls` as the
    chart renders it; the probe's request over HTTPS answers; a renewal (the kubelet's swap of
    `..data`) is served without a restart."""
    objects = helm(values_file(tmp_path, TLS))
    rendered = deployed_policy(objects)
    root = tmp_path / "pod"
    secret = root / mount(gateway_pod(objects), "tls")["mountPath"].lstrip("/")
    secret.mkdir(parents=True)

    def renew(version: str, serial: int) -> None:
        cert, key = issue(ca, tmp_path / "issued" / version, serial)
        pair = {
            "tls.crt": cert.read_text(),
            "tls.key": key.read_text(),
            "ca.crt": ca[0].read_text(),
        }
        kubelet_update(secret, version, pair)

    renew("v1", 1001)
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:9"])
    policy["server"] = {
        "tls": {k: str(root / v.lstrip("/")) for k, v in rendered["server"]["tls"].items()}
    }
    policy["admin"] = rendered["admin"]
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    (gateway,) = gateway_pod(objects)["spec"]["containers"]
    probe = gateway["readinessProbe"]["httpGet"]
    async with serving(path) as (proc, url), aiohttp.ClientSession() as http:
        assert url.startswith("https://")
        assert await peer_serial(url, ca[0]) == 1001
        kubelet_probe = ssl.create_default_context()  # the kubelet does not verify
        kubelet_probe.check_hostname, kubelet_probe.verify_mode = False, ssl.CERT_NONE
        async with http.get(f"{url}{probe['path']}", ssl=kubelet_probe) as resp:
            assert resp.status in (200, 503)  # answered over HTTPS (ready or not: no replica)
        renew("v2", 2002)
        await served(lambda: peer_serial(url, ca[0]), 2002, within_s=20)
        assert proc.returncode is None


# --- Behind a Gateway API gateway -----------------------------------------------------------------

ROUTE = {"httpRoute": {"enabled": True,
                       "parentRefs": [{"name": "inference", "namespace": "gateway-infra",
                                       "sectionName": "https"}],
                       "hostnames": ["llm.example.internal"]}}  # fmt: skip
# gateway.networking.k8s.io/v1 HTTPRoute, from the Gateway API's standard CRD: the fields of its
# spec, a rule, a parentRef and a backendRef; a hostname's and a duration's (GEP-2257) patterns.
ROUTE_SPEC = {"parentRefs", "hostnames", "rules"}
ROUTE_RULE = {
    "name",
    "matches",
    "filters",
    "backendRefs",
    "timeouts",
    "retry",
    "sessionPersistence",
}
PARENT_REF = {"group", "kind", "namespace", "name", "sectionName", "port"}
BACKEND_REF = {"group", "kind", "name", "namespace", "port", "weight", "filters"}
HOSTNAME = re.compile(r"(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
GATEWAY_DURATION = re.compile(r"([0-9]{1,5}(h|m|s|ms)){1,4}")


def test_the_httproute_sends_every_path_to_the_gateways_service_with_no_timeout_on_streams(
    tmp_path: Path,
) -> None:
    objects = helm(values_file(tmp_path, ROUTE))
    route = one(objects, "HTTPRoute", "llm-gateway")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert set(spec) <= ROUTE_SPEC
    assert spec["parentRefs"] == ROUTE["httpRoute"]["parentRefs"]
    assert all(set(p) <= PARENT_REF and p["name"] for p in spec["parentRefs"])
    assert all(HOSTNAME.fullmatch(h) for h in spec["hostnames"])
    (rule,) = spec["rules"]
    assert set(rule) <= ROUTE_RULE
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    (backend,) = rule["backendRefs"]
    assert set(backend) <= BACKEND_REF
    service = one(objects, "Service", backend["name"])
    assert service["metadata"]["namespace"] == route["metadata"]["namespace"]
    assert backend["port"] in {p["port"] for p in service["spec"]["ports"]}
    assert service["spec"]["selector"] == gateway_pod(objects)["metadata"]["labels"]
    timeouts = rule["timeouts"]  # "0s": none, per the Gateway API: streams last minutes
    assert timeouts == {"request": "0s", "backendRequest": "0s"}
    assert all(GATEWAY_DURATION.fullmatch(t) for t in timeouts.values())
    assert not kinds(helm(), "HTTPRoute")  # off unless asked
    no_parent = {"httpRoute": {"enabled": True}}
    said = helm_fails(values_file(tmp_path, no_parent, "no-parent.yaml"))
    assert "httpRoute.parentRefs" in said
