#!/usr/bin/env bash
# Creates the virtual environment VENV with PYTHON. Debian and Ubuntu ship `venv` without
# ensurepip (package python3.X-venv): as root with apt-get that package is installed here, as
# .ci/run installs the test tools; otherwise the one command to run is printed.
#
#     tests/setup/venv.sh PYTHON VENV
set -euo pipefail
python=$1 venv=$2

[[ -x $venv/bin/python ]] && exit 0
if "$python" -m venv "$venv" 2>/dev/null; then
    exit 0
fi
rm -rf "$venv"
package=python$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "venv: $python has no ensurepip; installing Debian's $package" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null
    exec "$python" -m venv "$venv"
fi
echo "cannot create $venv: $python -m venv failed (on Debian/Ubuntu: sudo apt-get install $package)" >&2
exit 1
