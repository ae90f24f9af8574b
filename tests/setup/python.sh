#!/usr/bin/env bash
# Prints the Python that `make` builds .venv with: $PYTHON if given, else the first of
# python3.11 ... python3.14, python3 that exists and is 3.11 or newer. Stops with what to install
# when there is none, rather than letting `venv` fail later with an unrelated message.
set -euo pipefail

version_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

if [[ -n ${PYTHON:-} ]]; then
    if ! command -v "$PYTHON" >/dev/null || ! version_ok "$PYTHON"; then
        echo "PYTHON=$PYTHON: not found or older than 3.11; the gateway needs Python 3.11 or newer" >&2
        exit 1
    fi
    echo "$PYTHON"
    exit 0
fi
for candidate in python3.11 python3.12 python3.13 python3.14 python3; do
    if command -v "$candidate" >/dev/null && version_ok "$candidate"; then
        echo "$candidate"
        exit 0
    fi
done
echo "no Python 3.11 or newer found (tried python3.11 ... python3.14, python3)." >&2
echo "Install one (Debian/Ubuntu: apt-get install python3 python3-venv) or pass PYTHON=/path/to/python3.X" >&2
exit 1
