"""deploy/base, rendered from the Helm chart: the chart is the one source of deploy's objects.

The kustomize base is `helm template` of deploy/helm/llm-admission-gateway with the article's
TPU values (values-gke-tpu-v6e.yaml), on a cluster with the Prometheus Operator, split into one
file per concern at the paths docs and tools name (autoscaling/hpa.yaml, monitoring/...), plus
the Namespace (Helm creates its own) and a kustomization listing them. So the HPAs, Redis and the
monitoring objects are written once, in the chart, and nothing under deploy/base is edited by
hand: change the chart and render again. tests/deploy/test_deploy.py renders it again and fails while
the committed files differ.

    python deploy/render.py [--out DIR]       # DIR: deploy/base, replaced
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import yaml

DEPLOY = Path(__file__).resolve().parent
CHART = DEPLOY / "helm" / "llm-admission-gateway"
VALUES = CHART / "values-gke-tpu-v6e.yaml"
# Rendered, never set by kustomize's `namespace:`: it is part of the policy's DNS names, the Redis
# URL and the monitors' namespace selectors, which kustomize would leave pointing at this one.
NAMESPACE = "llm"
HEADER = (
    "# Rendered from deploy/helm/llm-admission-gateway by deploy/render.py (make deploy-base): edit\n"
    "# the chart and render again; tests/deploy/test_deploy.py fails while this file differs.\n"
)
# Where each object goes, by kind and name ("*": any name); each vLLM pool's Deployment and
# headless Service go to vllm/<name>.yaml.
PLACES = {
    ("ServiceAccount", "llm-gateway"): "gateway/serviceaccount.yaml",
    ("ConfigMap", "llm-gateway-policy"): "gateway/policy.yaml",
    ("Deployment", "llm-gateway"): "gateway/deployment.yaml",
    ("Service", "llm-gateway"): "gateway/service.yaml",
    ("Service", "llm-gateway-metrics"): "gateway/service.yaml",
    ("PodDisruptionBudget", "llm-gateway"): "gateway/pdb.yaml",
    ("StatefulSet", "redis"): "redis/statefulset.yaml",
    ("Service", "redis"): "redis/statefulset.yaml",
    ("HorizontalPodAutoscaler", "*"): "autoscaling/hpa.yaml",
    ("ServiceMonitor", "llm-gateway"): "monitoring/servicemonitor.yaml",
    ("PodMonitor", "vllm"): "monitoring/podmonitor-vllm.yaml",
    ("PrometheusRule", "llm-gateway"): "monitoring/prometheusrule.yaml",
    ("ConfigMap", "llm-gateway-dashboard"): "monitoring/dashboard.yaml",
}
NAMESPACE_FILE = f"""\
# Helm creates the release's namespace itself (`--create-namespace`); kustomize needs the object.
---
apiVersion: v1
kind: Namespace
metadata:
  name: {NAMESPACE}
  labels: {{app.kubernetes.io/part-of: llm-admission-gateway}}
"""
KUSTOMIZATION = """\
# The chart rendered for the article's GKE TPU v6e fleet (its values-gke-tpu-v6e.yaml): the
# gateway, its policy, one vLLM Deployment + headless Service per pool, Redis, the HPAs and the
# Prometheus objects. `overlays/gke-tpu-v6e` names the images; apply that
# (`kubectl apply -k deploy/overlays/gke-tpu-v6e`). The label replaces the chart's
# `app.kubernetes.io/managed-by: Helm`, untrue of what kubectl applies.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
labels:
  - pairs: {app.kubernetes.io/managed-by: kustomize}
resources:
"""


def fail(message: str) -> NoReturn:
    sys.exit(f"deploy/render.py: {message}")


def helm_template() -> str:
    helm = shutil.which("helm")
    if helm is None:
        fail("helm is not installed: python tests/setup/install_kubectl.py .venv/bin")
    done = subprocess.run(
        [helm, "template", "llm", str(CHART), "--namespace", NAMESPACE,
         "--api-versions", "monitoring.coreos.com/v1", "-f", str(VALUES)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        fail(f"helm template failed:\n{done.stderr}")
    return done.stdout


def place(doc: dict[str, Any]) -> str:
    kind, meta = doc["kind"], doc["metadata"]
    if (
        kind in ("Deployment", "Service")
        and meta.get("labels", {}).get("app.kubernetes.io/name") == "vllm"
    ):
        return f"vllm/{meta['name']}.yaml"
    found = PLACES.get((kind, meta["name"])) or PLACES.get((kind, "*"))
    if found is None:
        fail(f"no place in deploy/base for {kind}/{meta['name']}: add one to PLACES")
    return found


def render() -> dict[str, str]:
    """Each file of the base, by its path under it: helm's documents as helm wrote them
    (its `# Source:` line and the templates' comments kept), in helm's order."""
    documents: dict[str, list[str]] = {}
    for chunk in re.split(r"^---[ \t]*$", helm_template(), flags=re.MULTILINE):
        text = chunk.strip("\n")
        doc = yaml.safe_load(text)
        if doc:
            documents.setdefault(place(doc), []).append(text)
    files = {
        path: HEADER + "".join(f"---\n{d}\n" for d in docs) for path, docs in documents.items()
    }
    files["namespace.yaml"] = HEADER + NAMESPACE_FILE
    listed = ["namespace.yaml", *sorted(set(files) - {"namespace.yaml"})]
    files["kustomization.yaml"] = (
        HEADER + KUSTOMIZATION + "".join(f"  - {path}\n" for path in listed)
    )
    return files


def write(out: Path, files: dict[str, str]) -> None:
    """Replace `out` with `files`, unless it holds a file this script did not write."""
    if out.exists():
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            if not path.read_text().startswith(HEADER):
                fail(f"{path} was not rendered here: not replacing {out}")
        shutil.rmtree(out)
    for relative, text in files.items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEPLOY / "base", help="default: deploy/base")
    write(parser.parse_args().out, render())


if __name__ == "__main__":
    main()
