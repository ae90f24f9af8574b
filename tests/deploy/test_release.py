""".github/workflows/release.yml, read as GitHub would (its YAML) and its shell run here where it
needs nothing of GitHub: it builds what `make image` builds (.ci/image.sh's `buildah bud`: the
same Dockerfile, context and build arguments), pushes the image the chart's default names for
that registry, refuses a tag that is not the chart's version, and puts the pushed digest in the
release notes. GitHub itself is not exercised."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_chart_tokenizers import pod_spec, render
from tests.deploy.test_deploy import CHART, ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
REGISTRY = "registry.internal/llm"  # what a repository's IMAGE_REGISTRY variable might say

# `buildah bud` options that change how or where an image is built, or its name, never its
# content; every other option must be in BUILD_OPTIONS and the same on both sides.
HOW_FLAGS = {"--quiet", "-q", "--pull-never"}
HOW_VALUED = {"--isolation", "--tag", "-t", "--storage-driver"}
BUILD_OPTIONS = {"--file": "file", "-f": "file", "--target": "target", "--build-arg": "build-arg",
                 "--platform": "platform", "--build-context": "build-context"}  # fmt: skip


def workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW.read_text())  # type: ignore[no-any-return]


def steps() -> list[dict[str, Any]]:
    (job,) = workflow()["jobs"].values()
    return job["steps"]  # type: ignore[no-any-return]


def step(name: str) -> dict[str, Any]:
    (found,) = [s for s in steps() if s.get("name") == name]
    return found


def bud_commands(script: str) -> Iterator[list[str]]:
    """Each `buildah bud` of a shell script, as its words (continuations joined)."""
    for line in script.replace("\\\n", " ").splitlines():
        if re.match(r"\s*(buildah|\S*\{buildah\S*) bud ", line):
            words = shlex.split(line, comments=True)
            words = words[words.index("bud") + 1 :]
            ends = [n for n, w in enumerate(words) if re.match(r"\d?[<>]|[|&;]", w)]
            yield words[: ends[0] if ends else None]  # up to a redirection or the next command


def what_it_builds(words: list[str]) -> list[tuple[str, str]]:
    """The options of a `buildah bud` that decide the image's content, and its context."""
    built = []
    rest = iter(words)
    for word in rest:
        name, eq, value = word.partition("=")
        if not word.startswith("-"):
            built.append(("context", word))
        elif name in HOW_FLAGS:
            continue
        elif name in HOW_VALUED:
            if not eq:
                next(rest)  # its value
        elif name in BUILD_OPTIONS:
            built.append((BUILD_OPTIONS[name], value if eq else next(rest)))
        else:
            pytest.fail(f"buildah bud {name}: add it to HOW_* or BUILD_OPTIONS")
    if not any(option == "file" for option, _ in built):
        built.append(("file", "Dockerfile"))  # buildah's default
    return sorted(built)


def test_the_release_builds_what_make_image_builds() -> None:
    # .ci/image.sh builds the gateway's image (then the tokenizer image on it).
    (make_image,) = [
        words
        for words in bud_commands((ROOT / ".ci" / "image.sh").read_text())
        if any(w.startswith("llm-admission-gateway:") for w in words)
    ]
    releases = [c for s in steps() for c in bud_commands(s.get("run", ""))]
    assert len(releases) == 1, releases
    built = what_it_builds(make_image)
    assert what_it_builds(releases[0]) == built
    assert ("context", ".") in built
    for option, value in built:
        if option == "file":
            assert (ROOT / value).is_file(), value


def test_the_workflow_runs_on_a_version_tag_with_the_registry_from_a_variable() -> None:
    on = workflow().get("on", workflow().get(True))  # YAML 1.1 reads a bare `on` as true
    assert on == {"push": {"tags": ["v*"]}}
    (job,) = workflow()["jobs"].values()
    assert job["env"]["IMAGE_REGISTRY"] == "${{ vars.IMAGE_REGISTRY }}"
    assert workflow()["permissions"] == {"contents": "write"}
    # No registry's host is written into the workflow: `host.name/...` nowhere.
    assert not re.findall(r"\b[a-z0-9-]+(?:\.[a-z0-9-]+)+(?::\d+)?/", WORKFLOW.read_text())
    # The password is read from standard input, never on a command line.
    push = step("Push the image")
    assert push["env"]["REGISTRY_PASSWORD"] == "${{ secrets.IMAGE_REGISTRY_PASSWORD }}"
    assert "--password-stdin" in push["run"] and "--password " not in push["run"]


def run_version_check(tag: str, registry: str, tmp_path: Path) -> tuple[int, str, dict[str, str]]:
    """The workflow's version step, its shell as the runner runs it, in the repository."""
    script = step("Check the tag against the versions")["run"]
    assert "${{" not in script  # nothing for GitHub to fill in: it runs here as it is
    outputs = tmp_path / "github-output"
    outputs.write_text("")
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "GITHUB_REF_NAME": tag, "IMAGE_REGISTRY": registry, "GITHUB_OUTPUT": str(outputs)}  # fmt: skip
    done = subprocess.run(
        ["bash", "-e", "-c", script], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    pairs = dict(line.split("=", 1) for line in outputs.read_text().splitlines())
    return done.returncode, done.stdout + done.stderr, pairs


def test_the_release_pushes_the_image_the_charts_default_names(tmp_path: Path) -> None:
    """The tag is the chart's appVersion (and the package's): the image pushed is the one the
    chart of that tag renders with `gateway.image.registry` set to the same registry."""
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    code, out, outputs = run_version_check(f"v{version}", REGISTRY, tmp_path)
    assert code == 0, out
    chart = render(tmp_path, {"gateway": {"image": {"registry": REGISTRY}}})
    (gateway,) = pod_spec(chart)["containers"]
    assert outputs == {"version": version, "image": gateway["image"]}
    image = "${{ steps.version.outputs.image }}"
    assert step("Build the image")["env"]["IMAGE"] == image
    assert step("Push the image")["env"]["IMAGE"] == image
    assert (
        'buildah push --digestfile "$RUNNER_TEMP/digest" "$IMAGE"' in step("Push the image")["run"]
    )


@pytest.mark.parametrize("tag", ["v0.0.0-not-this-one", "latest"])
def test_a_tag_that_is_not_the_charts_version_pushes_nothing(tag: str, tmp_path: Path) -> None:
    code, out, outputs = run_version_check(tag, REGISTRY, tmp_path)
    assert code == 1 and "::error::" in out and "appVersion" in out, out
    assert outputs == {}
    # and every step after this one needs its output
    later = steps()[[s.get("id") for s in steps()].index("version") + 1 :]
    assert all("steps.version.outputs.image" in str(s.get("env")) for s in later)


def test_without_the_registry_variable_the_release_stops_saying_which(tmp_path: Path) -> None:
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    code, out, _ = run_version_check(f"v{version}", "", tmp_path)
    assert code == 1 and "IMAGE_REGISTRY" in out, out


def test_the_release_notes_carry_the_pushed_digest() -> None:
    push = step("Push the image")
    assert push["id"] == "push"
    assert 'echo "digest=$(cat "$RUNNER_TEMP/digest")" >>"$GITHUB_OUTPUT"' in push["run"]
    release = step("Create the release with the digest")
    assert release["env"]["DIGEST"] == "${{ steps.push.outputs.digest }}"
    (create,) = [c for c in release["run"].split("gh release create")[1:]]
    notes = create.split("--notes", 1)[1]
    assert "$DIGEST" in notes and "$IMAGE" in notes
