"""What deploy/ and the chart start vLLM with is what vLLM 0.32 accepts: each vLLM container's
command and arguments, rendered as a cluster gets them (kustomize, the chart with its TPU and GPU
values), parsed by vLLM's own `vllm serve` parser. A flag vLLM renamed or dropped fails here, not
in a pod's crash loop on an accelerator node."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.deploy.test_deploy import FLEETS, kinds

# `vllm serve`'s parser as vLLM's CLI builds it, imported once (seconds of importing vLLM); each
# request (argvs, and the files its output goes to) is parsed in a fork of this process, which
# prints and exits as a process of its own would: its exit status is the answer's line.
PARSER = """
import json, os, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
root = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(root.add_subparsers(dest="subcommand"))
for request in sys.stdin:
    argvs, out, err = json.loads(request)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out, os.O_WRONLY), 1)
        os.dup2(os.open(err, os.O_WRONLY), 2)
        code = 0
        try:
            for argv in argvs:
                ns = root.parse_args(argv)
                print(json.dumps({"model": ns.model_tag, "served": ns.served_model_name,
                                  "max_num_seqs": ns.max_num_seqs, "port": ns.port}))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

Parse = Callable[[list[list[str]]], subprocess.CompletedProcess[str]]


def vllm_argvs(objects: list[dict[str, Any]]) -> list[list[str]]:
    """`serve MODEL ARGS...` of every vLLM container, as its command and args run it."""
    argvs = []
    for deployment in kinds(objects, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            command = container.get("command", [])
            if command[:2] == ["vllm", "serve"]:
                argvs.append([*command[1:], *container.get("args", [])])
    return argvs


@pytest.fixture(scope="module")
def parse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parse]:
    """Each list of argvs parsed as `vllm serve` parses it, in vLLM's environment: the exit
    status, the parsed fields printed, the parser's errors."""
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        pytest.fail("VLLM_PYTHON must be set: run `make test-vllm`")
    directory = tmp_path_factory.mktemp("vllm-parse")
    parser = subprocess.Popen(
        [python, "-c", PARSER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert parser.stdin is not None and parser.stdout is not None
    asked = itertools.count()

    def one(argvs: list[list[str]]) -> subprocess.CompletedProcess[str]:
        assert parser.stdin is not None and parser.stdout is not None
        n = next(asked)
        out, err = directory / f"{n}.out", directory / f"{n}.err"
        out.touch()
        err.touch()
        parser.stdin.write(json.dumps([argvs, str(out), str(err)]) + "\n")
        parser.stdin.flush()
        status = parser.stdout.readline()
        assert status, "vLLM's parser process ended"
        return subprocess.CompletedProcess(argvs, int(status), out.read_text(), err.read_text())

    try:
        yield one
    finally:
        parser.stdin.close()
        try:
            parser.wait(30)
        except subprocess.TimeoutExpired:
            parser.kill()
            parser.wait()


@pytest.mark.parametrize("fleet", list(FLEETS))
def test_every_vllm_container_starts_with_flags_vllm_accepts(fleet: str, parse: Parse) -> None:
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


def test_a_flag_vllm_does_not_know_fails_the_parse(parse: Parse) -> None:
    """The check above can fail: vLLM's parser refuses what it does not know."""
    done = parse([["serve", "google/gemma-3-27b-it", "--max-num-seqs=8", "--max-num-seq-groups=8"]])
    assert done.returncode != 0 and "unrecognized arguments: --max-num-seq-groups" in done.stderr
