"""What deploy/ and the chart start vLLM with is what vLLM 0.32 accepts: each vLLM container's
command and arguments, rendered as a cluster gets them (kustomize, the chart with its TPU and GPU
values), parsed by vLLM's own `vllm serve` parser. A flag vLLM renamed or dropped fails here, not
in a pod's crash loop on an accelerator node."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from tests.deploy.test_deploy import FLEETS, kinds

# `vllm serve`'s parser as vLLM's CLI builds it; each argv parsed, or its error printed.
PARSE = """
import json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
root = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(root.add_subparsers(dest="subcommand"))
for argv in json.load(sys.stdin):
    ns = root.parse_args(argv)
    print(json.dumps({"model": ns.model_tag, "served": ns.served_model_name,
                      "max_num_seqs": ns.max_num_seqs, "port": ns.port}))
"""


def vllm_argvs(objects: list[dict[str, Any]]) -> list[list[str]]:
    """`serve MODEL ARGS...` of every vLLM container, as its command and args run it."""
    argvs = []
    for deployment in kinds(objects, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            command = container.get("command", [])
            if command[:2] == ["vllm", "serve"]:
                argvs.append([*command[1:], *container.get("args", [])])
    return argvs


def parse(argvs: list[list[str]]) -> subprocess.CompletedProcess[str]:
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        pytest.fail("VLLM_PYTHON must be set: run `make test-vllm`")
    return subprocess.run(
        [python, "-c", PARSE], input=json.dumps(argvs), capture_output=True, text=True,
        timeout=300, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip


@pytest.mark.parametrize("fleet", list(FLEETS))
def test_every_vllm_container_starts_with_flags_vllm_accepts(fleet: str) -> None:
    argvs = vllm_argvs(FLEETS[fleet]())
    assert argvs, "no vLLM Deployment rendered"
    done = parse(argvs)
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = [json.loads(line) for line in done.stdout.splitlines()]
    assert [p["model"] for p in parsed] == [argv[1] for argv in argvs]
    for argv, seen in zip(argvs, parsed, strict=True):
        flags = dict(a.removeprefix("--").split("=", 1) for a in argv[2:] if "=" in a)
        assert seen["max_num_seqs"] == int(flags["max-num-seqs"])
        assert seen["served"] == [flags["served-model-name"]]


def test_a_flag_vllm_does_not_know_fails_the_parse() -> None:
    """The check above can fail: vLLM's parser refuses what it does not know."""
    done = parse([["serve", "google/gemma-3-27b-it", "--max-num-seqs=8", "--max-num-seq-groups=8"]])
    assert done.returncode != 0 and "unrecognized arguments: --max-num-seq-groups" in done.stderr
