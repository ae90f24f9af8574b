#!/usr/bin/env bash
# The Dockerfile built by a daemonless builder and its image run: Debian's buildah, as root, with
# chroot isolation and vfs storage (no daemon, no overlay mounts, no user namespaces). CI reaches
# Debian's and PyPI's registries but not Docker Hub, so `FROM python:3.11-slim` is given a
# stand-in of the same Debian and Python (bookworm, 3.11) made by debootstrap from Debian's
# packages: every step of the Dockerfile runs, and the image then checks, as user 10001, the
# policy the chart renders. The published base itself is not what this builds on.
#
#     .ci/image.sh VENV        # as root; VENV has helm (tests/setup/tools.sh put it there)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1
buildah=(buildah --storage-driver vfs)
base=localhost/python:3.11-slim

missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ -z $("${buildah[@]}" images --quiet "$base" 2>/dev/null) ]]; then
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm \
        "$work/rootfs" >/dev/null
    ln -s python3 "$work/rootfs/usr/bin/python"  # the official image's `python`
    rm -f "$work/rootfs"/var/cache/apt/archives/*.deb
    # pip in the build trusts what the host trusts (a proxy's CA on some CI machines).
    cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/host-ca.crt"
    printf '[global]\ncert = /etc/ssl/host-ca.crt\n' >"$work/rootfs/etc/pip.conf"
    container=$("${buildah[@]}" from scratch)
    "${buildah[@]}" copy --quiet "$container" "$work/rootfs" / >/dev/null
    "${buildah[@]}" commit --quiet --rm "$container" "$base" >/dev/null
fi

"${buildah[@]}" bud --quiet --isolation chroot --pull-never -t llm-admission-gateway:ci . >/dev/null
"$venv/bin/helm" template llm deploy/helm/llm-admission-gateway --namespace llm \
    --show-only templates/gateway.yaml |
    "$venv/bin/python" -c 'import sys, yaml
(policy,) = [d["data"]["policy.yaml"] for d in yaml.safe_load_all(sys.stdin) if d and d["kind"] == "ConfigMap"]
sys.stdout.write(policy)' >"$work/policy.yaml"
chmod -R a+rX "$work"
container=$("${buildah[@]}" from --pull-never llm-admission-gateway:ci)
trap '"${buildah[@]}" rm "$container" >/dev/null; rm -rf "$work"' EXIT
"${buildah[@]}" run --isolation chroot --volume "$work:/check:ro" "$container" -- \
    sh -c '[ "$(id -u)" = 10001 ] && llm-gateway check /check/policy.yaml'
echo "image: llm-admission-gateway:ci built and checked the chart's policy as user 10001"
