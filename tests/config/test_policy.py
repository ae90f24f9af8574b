"""`llm-gateway check` names file, line and field for every problem; shipped policies are valid."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.config.load import PolicyError
from gateway.policy.compile import json_schema, load_policy

ROOT = Path(__file__).resolve().parents[2]

BROKEN = """\
models:
  gemma-3-12b-it:
    tokenizer: estimate
    max_model_len: 128000
pools:
  generate-12b:
    model: gemma-3-12b-it
    replicas: [http://127.0.0.1:8000]
    max_concurrency: 0
    queue: {max_depth: 10, max_wait: 5}
  classify:
    model: gemma-3-27b-it
    replicas: [ftp://nowhere]
    max_concurrency: 4
classes:
  - {name: prefill_heavy, when: {input_tokens: {gte: 1024}}}
  - {name: decode_heavy, when: {}}
routes:
  - {match: {model: gemma-3, class: prefil_heavy}, pool: generate-12b}
  - {match: {model: gemma-3}, pool: generate-27b}
plugins:
  picker: {type: most-random}
"""


def check(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check", *flags, str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_check_names_line_and_field_of_every_schema_error(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(BROKEN)
    result = check(path)
    assert result.returncode == 1
    errors = result.stderr.splitlines()
    assert f"{path}:9: pools.generate-12b.max_concurrency: must be >= 1" in errors
    assert (
        f"{path}:10: pools.generate-12b.queue.max_wait: unknown field; did you mean `max_wait_s`?"
        in errors
    )
    assert (
        f"{path}:13: pools.classify.replicas: 'ftp://nowhere' must be an http:// or https:// URL"
        in errors
    )


def test_a_misspelt_field_is_named_with_the_one_it_resembles(tmp_path) -> None:
    """At any depth (a pool's section, a class's condition, a route's match, `server`), from the
    model the file is in there (a pool named `retry` is a pool, not PoolSpec's `retry`); a field
    like no other is only unknown."""
    path = tmp_path / "x.yaml"
    path.write_text(
        "models:\n"
        "  tiny: {tokenizer: estimate, max_model_len: 8192}\n"
        "pools:\n"
        "  retry: {model: tiny, replicas: ['http://127.0.0.1:1'], max_concurency: 8,\n"
        "         helth: {interval_s: 1}}\n"
        "server: {tokenizer_thread: 2, frobnicate: 1}\n"
        "classes: [{name: any, when: {input_token: {gte: 5}}}]\n"
        "routes: [{match: {modle: tiny}, pool: retry}]\n"
    )
    result = check(path)
    assert result.returncode == 1
    errors = result.stderr.splitlines()
    for line, where, meant in (
        (4, "pools.retry.max_concurency", "max_concurrency"),
        (5, "pools.retry.helth", "health"),
        (6, "server.tokenizer_thread", "tokenizer_threads"),
        (7, "classes.0.when.input_token", "input_tokens"),
        (8, "routes.0.match.modle", "model"),
    ):
        assert f"{path}:{line}: {where}: unknown field; did you mean `{meant}`?" in errors
    assert f"{path}:6: server.frobnicate: unknown field" in errors


def test_check_reports_cross_references_and_plugins(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(
        BROKEN.replace("max_concurrency: 0", "max_concurrency: 1")
        .replace(", max_wait: 5", "")
        .replace("ftp://nowhere", "http://127.0.0.1:1")
    )
    result = check(path)
    assert result.returncode == 1
    errors = result.stderr.splitlines()
    assert f"{path}:12: pools.classify.model: model 'gemma-3-27b-it' is not under models" in errors
    assert f"{path}:19: routes.0.match.class: unknown class 'prefil_heavy'" in errors
    assert f"{path}:20: routes.1.pool: unknown pool 'generate-27b'" in errors
    assert any(
        e.startswith(
            f"{path}:22: plugins.picker: unknown picker type 'most-random'; known: least-inflight, round-robin"
        )
        for e in errors
    )


def test_check_reports_field_errors_and_cross_references_in_one_pass(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(BROKEN)
    errors = check(path).stderr.splitlines()
    assert f"{path}:9: pools.generate-12b.max_concurrency: must be >= 1" in errors
    # pools.classify's replicas are wrong, but its model parsed: the reference is checked too.
    assert f"{path}:12: pools.classify.model: model 'gemma-3-27b-it' is not under models" in errors
    assert f"{path}:19: routes.0.match.class: unknown class 'prefil_heavy'" in errors
    assert f"{path}:20: routes.1.pool: unknown pool 'generate-27b'" in errors
    assert any(e.startswith(f"{path}:22: plugins.picker: unknown picker type") for e in errors)
    # generate-12b is broken, not missing: the route to it is no problem of its own.
    assert not any("unknown pool 'generate-12b'" in e for e in errors)
    assert len(errors) == 7, errors


def test_a_broken_field_is_reported_once(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(BROKEN.replace("pool: generate-27b", "pool: [generate-12b]"))
    errors = check(path).stderr.splitlines()
    assert [e for e in errors if "routes.1.pool" in e] == [
        f"{path}:20: routes.1.pool: Input should be a valid string"
    ]


def test_yaml_syntax_error_has_a_line(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("models:\n  a: [unclosed\n")
    result = check(path)
    assert result.returncode == 1 and result.stderr.startswith(f"{path}:")
    assert f'in "{path}", line 2, column 6' in result.stderr
    assert "<unicode string>" not in result.stderr


def test_nesting_past_the_limit_is_refused_at_its_line(tmp_path) -> None:
    """Deeper than any policy needs, and deep enough to exhaust the YAML composer's recursion."""
    path = tmp_path / "x.yaml"
    path.write_text("models:\n  a:\n    " + "[" * 1000 + "]" * 1000 + "\n")
    result = check(path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"{path}:3: (yaml): nested more than 32 levels deep")


def test_anchors_and_aliases_read_as_yaml_reads_them(tmp_path) -> None:
    """A value used twice, as `yaml.safe_dump` writes it (an anchor and an alias) and as people
    share defaults: a policy is plain YAML."""
    demo = yaml.safe_load((Path(__file__).parents[2] / "policies" / "demo.yaml").read_text())
    shared = next(iter(demo["pools"].values()))["replicas"]
    for pool in demo["pools"].values():
        pool["replicas"] = shared
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(demo))
    assert "&id001" in path.read_text()
    result = check(path, "--skip-tokenizers")  # demo.yaml's tokenizer is built by `make demo`
    assert result.returncode == 0, result.stderr


def test_aliases_nested_past_the_limit_are_refused(tmp_path) -> None:
    """Each alias is shallow in the file; expanded, eleven levels of three make 33."""
    lines = ["l0: &l0 [[[x]]]"] + [f"l{n}: &l{n} [[[*l{n - 1}]]]" for n in range(1, 11)]
    path = tmp_path / "x.yaml"
    path.write_text("\n".join(lines) + "\n")
    result = check(path)
    assert result.returncode == 1
    assert "nested more than 32 levels deep once its aliases are expanded" in result.stderr


def test_an_alias_inside_its_own_anchor_is_refused_at_its_line(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("models: {}\nloop: &loop [1, *loop]\n")
    result = check(path)
    assert result.stderr.startswith(f"{path}:2: (yaml): alias *loop is inside its own anchor")


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path) -> None:
    """PyYAML keeps the last of two equal keys without a word; a policy refuses it."""
    path = tmp_path / "x.yaml"
    path.write_text(
        "models: {m: {tokenizer: estimate}}\npools:\n  p:\n    model: m\n"
        "    max_concurrency: 4\n    replicas: [http://127.0.0.1:1]\n    max_concurrency: 8\n"
    )
    result = check(path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"{path}:7: (yaml): key 'max_concurrency' first given")
    assert f'in "{path}", line 5, column 5' in result.stderr


def test_merge_keys_may_be_overridden(tmp_path) -> None:
    """`<<: *base` then a key of the base's is ordinary YAML: the explicit key wins."""
    demo = (Path(__file__).parents[2] / "policies" / "minimal.yaml").read_text()
    path = tmp_path / "x.yaml"
    path.write_text(
        demo.replace("  classify:\n", "  classify: &base\n", 1).replace(
            "  generate:\n", "  generate:\n    <<: *base\n", 1
        )
    )
    assert "<<: *base" in path.read_text()
    result = check(path)
    assert result.returncode == 0, result.stderr


def test_alias_over_different_tokenizers_is_refused(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(
        "models:\n  a: {tokenizer: /t/a, max_model_len: 10}\n  b: {tokenizer: /t/b, max_model_len: 10}\n"
        "pools:\n  pa: {model: a, replicas: ['http://127.0.0.1:1'], max_concurrency: 1}\n"
        "  pb: {model: b, replicas: ['http://127.0.0.1:2'], max_concurrency: 1}\n"
        "classes: [{name: c}]\n"
        "routes:\n  - {match: {model: x}, pool: pa}\n  - {match: {model: x}, pool: pb}\n"
    )
    with pytest.raises(PolicyError, match=r"x.yaml:10: routes.1.pool: model 'x' already routes"):
        load_policy(path, load_tokenizers=False)


def test_missing_tokenizer_directory_fails_serve_time_load(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(
        "models:\n  a: {tokenizer: /nonexistent/tok, max_model_len: 10}\n"
        "pools:\n  pa: {model: a, replicas: ['http://127.0.0.1:1'], max_concurrency: 1}\n"
        "classes: [{name: c}]\nroutes: [{pool: pa}]\n"
    )
    with pytest.raises(
        PolicyError, match=r"x.yaml:2: models.a.tokenizer: tokenizer directory '/nonexistent/tok'"
    ):
        load_policy(path)


@pytest.mark.parametrize("policy", sorted((ROOT / "policies").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_policies_pass_check(policy) -> None:
    result = check(policy, "--skip-tokenizers")  # their directories are a fleet's, or built
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_schema_json_is_up_to_date() -> None:
    shipped = json.loads((ROOT / "policies" / "schema.json").read_text())
    assert shipped == json_schema(), "run `make schema`"


def test_lower_tiers_must_shed_first(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(
        "models:\n  a: {tokenizer: estimate, max_model_len: 10}\n"
        "pools:\n  pa:\n    model: a\n    replicas: ['http://127.0.0.1:1']\n    max_concurrency: 1\n"
        "    shed: {sheddable: 2.0, standard: 1.0}\n"
        "classes: [{name: c}]\nroutes: [{pool: pa}]\n"
    )
    with pytest.raises(PolicyError, match=r"x.yaml:8: pools.pa.shed: a lower tier must shed"):
        load_policy(path)


def test_an_infinite_latency_seed_is_refused(tmp_path) -> None:
    """A sweep that failed may write an infinite coefficient (NaN fails `ge=0` already): taken,
    every prediction of the pool is infinite, or NaN where its feature is 0 (no headroom to
    rank by, a NaN at the top of a replica's heap of whole answers that never settles)."""
    path = tmp_path / "x.yaml"
    path.write_text(
        "models:\n  a: {tokenizer: estimate, max_model_len: 10}\n"
        "pools:\n  pa:\n    model: a\n    replicas: ['http://127.0.0.1:1']\n    max_concurrency: 1\n"
        "    slo: {model: {ttft_per_1k_prefill_ms: .inf}}\n"
        "classes: [{name: c}]\nroutes: [{pool: pa}]\n"
    )
    with pytest.raises(PolicyError, match=r"x.yaml:8: pools.pa.slo.model.ttft_per_1k_prefill_ms"):
        load_policy(path)


def test_an_unknown_counting_backend_is_refused_at_load(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(
        "models:\n  a: {tokenizer: estimate, max_model_len: 10, tokenizer_backend: rust}\n"
        "pools:\n  pa: {model: a, replicas: ['http://127.0.0.1:1'], max_concurrency: 1}\n"
        "classes: [{name: c}]\nroutes: [{pool: pa}]\n"
    )
    with pytest.raises(PolicyError, match=r"x.yaml:2: models.a.tokenizer_backend: "):
        load_policy(path)


def test_a_replica_url_with_credentials_is_refused_without_echoing_them(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(BROKEN.replace("ftp://nowhere", "http://user:s3cret@10.0.0.1:8000"))
    result = check(path)
    assert result.returncode == 1
    assert (
        f"{path}:13: pools.classify.replicas: a replica URL carries no credentials: give the key"
        " in `api_key_env`" in result.stderr.splitlines()
    )
    assert "s3cret" not in result.stderr + result.stdout


def test_a_replica_url_without_a_host_is_refused_at_load(tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(BROKEN.replace("ftp://nowhere", "http://:8000"))
    result = check(path)
    assert (
        f"{path}:13: pools.classify.replicas: 'http://:8000' names no host"
        in result.stderr.splitlines()
    )
