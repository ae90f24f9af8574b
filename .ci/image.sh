#!/usr/bin/env bash
# The Dockerfile built by a daemonless builder and its image run: Debian's buildah, as root, with
# chroot isolation and vfs storage (no daemon, no overlay mounts, no user namespaces). CI reaches
# Debian's and PyPI's registries but not Docker Hub, so `FROM python:3.11-slim` is given a
# stand-in of the same Debian and Python (bookworm, 3.11) made by debootstrap from Debian's
# packages: every step of the Dockerfile runs, and the image then does what the chart's pod does
# at start: its init container fetches the tokenizer (from tests/hub.py, a Hub on loopback), and
# the gateway, as user 10001, loads the chart's policy with it. Then the air-gapped way: the
# tokenizer image (deploy/tokenizers.Dockerfile) built on it from those files, and the chart's
# copying init container run in it, whose copy the policy loads from. The published base itself
# is not what this builds on.
#
#     .ci/image.sh VENV        # as root; VENV has helm (tests/setup/tools.sh put it there)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1
# tests/setup/tools.sh installs helm into the environment unless the machine has it already.
helm=$venv/bin/helm
[[ -x $helm ]] || helm=$(command -v helm)
buildah=(buildah --storage-driver vfs)
base=localhost/python:3.11-slim

missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v npm >/dev/null || missing+=(npm)  # the tokenizer files tests/hub.py serves
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

# The release workflow (.github/workflows/release.yml) builds the same file, context and arguments.
"${buildah[@]}" bud --quiet --isolation chroot --pull-never --file Dockerfile -t llm-admission-gateway:ci \
    . >/dev/null
# The chart's pod, rendered with the given values flags: its policy, and its init container's
# command (NUL-separated) and environment, as PREFIX.policy.yaml, PREFIX.args and PREFIX.env.
render_pod() {
    local prefix=$1
    shift
    "$helm" template llm deploy/helm/llm-admission-gateway --namespace llm \
        --show-only templates/gateway.yaml "$@" |
        "$venv/bin/python" -c 'import sys, yaml
docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
(policy,) = [d["data"]["policy.yaml"] for d in docs if d["kind"] == "ConfigMap"]
(pod,) = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
(init,) = pod["initContainers"]
open(sys.argv[1], "w").write(policy)
open(sys.argv[2], "w").write("\0".join(init["command"] + init["args"]) + "\0")
env = [e["name"] + "=" + e["value"] for e in init.get("env", []) if "value" in e]
open(sys.argv[3], "w").write("\0".join(env) + "\0")' \
            "$prefix.policy.yaml" "$prefix.args" "$prefix.env"
}
render_pod "$work/hub"
mkdir "$work/models"
chmod -R a+rX "$work"
chmod a+w "$work/models"  # the pod's emptyDir, written by user 10001
container=$("${buildah[@]}" from --pull-never llm-admission-gateway:ci)
hub=""
tokenizers=""
trap '[[ -n $hub ]] && kill "$hub"; "${buildah[@]}" rm "$container" $tokenizers >/dev/null
    [[ -n $tokenizers ]] && "${buildah[@]}" rmi llm-tokenizers:ci >/dev/null; rm -rf "$work"' EXIT

# The init container, run in the image as the pod runs it, against a Hub on loopback
# (tests/hub.py: the real Gemma 3 tokenizer files beside weights it must not fetch).
"$venv/bin/python" -m loadtest.real_tokenizers >/dev/null
"$venv/bin/python" -m tests.hub "$work/hub.port" &
hub=$!
for _ in $(seq 100); do [[ -s $work/hub.port ]] && break; sleep 0.1; done
mapfile -d '' init <"$work/hub.args"
mapfile -d '' envs <"$work/hub.env"
env_flags=()
for e in "${envs[@]}"; do env_flags+=(--env "$e"); done
"${buildah[@]}" run --isolation chroot --volume "$work/models:/models" "${env_flags[@]}" \
    --env "HF_ENDPOINT=http://127.0.0.1:$(cat "$work/hub.port")" "$container" -- "${init[@]}"
# Then the gateway's check of the chart's policy, as user 10001, loading what it fetched.
"${buildah[@]}" run --isolation chroot --volume "$work:/check:ro" \
    --volume "$work/models:/models:ro" "$container" -- \
    sh -c '[ "$(id -u)" = 10001 ] && llm-gateway check --load-tokenizers /check/hub.policy.yaml'

# The air-gapped way (docs/operations.md): deploy/tokenizers.Dockerfile on this image, its
# context the directory the init container filled, and the chart's `tokenizerSource.type: image`
# init container run in that image as the pod runs it, copying into an empty volume (user 10001
# again) that the gateway then loads the policy from.
"${buildah[@]}" bud --quiet --isolation chroot --pull-never --file deploy/tokenizers.Dockerfile \
    --build-arg GATEWAY_IMAGE=llm-admission-gateway:ci -t llm-tokenizers:ci "$work/models" >/dev/null
render_pod "$work/image" --set tokenizerSource.type=image \
    --set tokenizerSource.image.reference=localhost/llm-tokenizers:ci
mapfile -d '' copy <"$work/image.args"
mkdir "$work/copied"
chmod a+w "$work/copied"
tokenizers=$("${buildah[@]}" from --pull-never llm-tokenizers:ci)
"${buildah[@]}" run --isolation chroot --volume "$work/copied:/models" "$tokenizers" -- \
    sh -c '[ "$(id -u)" = 10001 ] && exec "$@"' copy "${copy[@]}"
"${buildah[@]}" run --isolation chroot --volume "$work:/check:ro" \
    --volume "$work/copied:/models:ro" "$container" -- \
    llm-gateway check --load-tokenizers /check/image.policy.yaml
echo "image: llm-admission-gateway:ci built; its init container fetched the chart's tokenizer" \
    "and, as user 10001, it loaded the chart's policy with it; the tokenizer image built from" \
    "the fetched files, its init container copied them and the policy loaded from the copy"
