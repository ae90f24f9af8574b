"""How long a gateway takes to start, and how much memory it holds then, by number of models.

    python -m loadtest.bench_startup [--runs 3] [--tree old=<worktree> --tree new=.]

Each policy names real tokenizers (loadtest/real_tokenizers.py): Gemma 3 alone; Gemma 3 and
Llama 3; three models naming the same Gemma 3 directory. For each, `python -m gateway serve` is
started and `/readyz` asked every 20 ms: ready-time is from the process's start to the first
200, and the RSS (and peak RSS) is read from /proc as it answers, tokenizers loaded and warm.
`explain` is timed whole (start to exit) on the two-model policy with a short chat. Each tree
(`--tree NAME=PATH`: that checkout's `gateway` package, default the current one) runs in turn,
`--runs` times; the table gives medians, and with two trees the ratio of the last to the first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loadtest import real_tokenizers
from loadtest.processes import free_port

READY_WAIT_S = 120.0
CHAT = b'{"model": "llama", "messages": [{"role": "user", "content": "Hello there"}]}'


def _policies(tokenizers: dict[str, Path]) -> dict[str, str]:
    gemma, llama = tokenizers["gemma3"], tokenizers["llama3"]
    models = {
        "gemma3": {"gemma": gemma},
        "gemma3+llama3": {"gemma": gemma, "llama": llama},
        "3 x gemma3": {"gemma": gemma, "gemma-b": gemma, "gemma-c": gemma},
    }
    unused = free_port()  # no replica answers: readiness does not wait for one
    out = {}
    for name, named in models.items():
        lines = ["models:"]
        lines += [f"  {m}: {{tokenizer: {d}, max_model_len: 128000}}" for m, d in named.items()]
        lines.append("pools:")
        lines += [
            f"  {m}: {{model: {m}, replicas: ['http://127.0.0.1:{unused}'], max_concurrency: 8}}"
            for m in named
        ]
        lines += ["classes:", "  - {name: any, when: {}}", "routes:"]
        lines += [f"  - {{match: {{model: {m}}}, pool: {m}}}" for m in named]
        lines.append(f"  - {{pool: {next(iter(named))}}}")
        out[name] = "\n".join(lines) + "\n"
    return out


def _memory(pid: int) -> tuple[float, float]:
    """RSS and peak RSS of `pid`, in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _ready(tree: Path, policy: Path) -> tuple[float, float, float]:
    """Seconds to the first ready `/readyz`, RSS and peak RSS then (MB)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--port", str(port)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree
    )
    try:
        while time.perf_counter() - started < READY_WAIT_S and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5):
                    elapsed = time.perf_counter() - started  # a 200: urlopen raises on a 503
                    return (elapsed, *_memory(proc.pid))
            except OSError:  # not listening yet, or not ready (HTTPError is one)
                time.sleep(0.02)
        raise RuntimeError(f"{tree}: the gateway did not become ready on {policy}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _explain(tree: Path, policy: Path, request: Path) -> float:
    """Seconds `explain` takes, start to exit."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-m", "gateway", "explain", "--policy", str(policy), str(request)]
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True, cwd=tree)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH", help="a checkout to time"
    )
    args = parser.parse_args()
    trees = {
        name: Path(path).resolve()
        for name, _, path in (t.partition("=") for t in args.tree or ["current=."])
    }
    tokenizers = {name: real_tokenizers.directory(name) for name in ("gemma3", "llama3")}
    rows: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    with tempfile.TemporaryDirectory() as work:
        files = {}
        for name, text in _policies(tokenizers).items():
            files[name] = Path(work) / f"{len(files)}.yaml"
            files[name].write_text(text)
        request = Path(work) / "chat.json"
        request.write_bytes(CHAT)
        for _ in range(args.runs):
            for tree_name, tree in trees.items():  # in turn: drift hits every tree alike
                for name, policy in files.items():
                    ready = _ready(tree, policy)
                    rows.setdefault((tree_name, name), []).append(ready)
                    print(f"{tree_name} {name}: {ready[0]:.2f} s, {ready[1]:.0f} MB", flush=True)
                seconds = _explain(tree, files["gemma3+llama3"], request)
                rows.setdefault((tree_name, "explain"), []).append((seconds,))
                print(f"{tree_name} explain: {seconds:.2f} s", flush=True)
    print(f"\nmedians of {args.runs} runs\n")
    print("| tree | policy | ready s | RSS MB | peak RSS MB |\n|---|---|---|---|---|")
    for (tree_name, name), runs in rows.items():
        figures = [statistics.median(column) for column in zip(*runs, strict=True)]
        shown = " | ".join(f"{f:.2f}" if i == 0 else f"{f:.0f}" for i, f in enumerate(figures))
        if len(figures) == 1:
            shown += " | - | -"
        print(f"| {tree_name} | {name if name != 'explain' else 'explain (2 models)'} | {shown} |")
    if len(trees) == 2:
        first, last = trees
        print(f"\n{last} / {first}, medians:")
        for (tree_name, name), runs in rows.items():
            if tree_name != last:
                continue
            base = rows[(first, name)]
            ratios = [
                statistics.median(a) / statistics.median(b)
                for a, b in zip(zip(*runs, strict=True), zip(*base, strict=True), strict=True)
            ]
            print(f"  {name}: " + ", ".join(f"{r:.3f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
