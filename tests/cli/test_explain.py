"""`llm-gateway explain` with headers, a tenant key and a tokenizer that is not on this machine:
real policy files, the real tiny tokenizer, the CLI as a user runs it."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main as gateway
from tests.conftest import basic_policy, write_policy

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-explain-test-0123456789"


def explain(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = gateway(["explain", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def chat(tmp_path: Path, model: str = "tiny", **extra: Any) -> str:
    path = tmp_path / "request.json"
    body = {"model": model, "messages": [{"role": "user", "content": "Label this review."}]}
    path.write_text(json.dumps({**body, **extra}))
    return str(path)


def test_a_header_rule_is_explained(capsys, tmp_path, tokenizer_dir) -> None:
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])
    policy["pools"]["search"] = {**policy["pools"]["main"], "replicas": ["http://127.0.0.1:2"]}
    policy["routes"].insert(0, {"match": {"header": {"x-team": "search*"}}, "pool": "search"})
    path = str(write_policy(tmp_path, policy))
    request = chat(tmp_path)
    code, out, _ = explain(
        capsys, "--json", "--policy", path, "-H", "X-Team: search-ranking", request
    )
    decision = json.loads(out)
    assert code == 0
    assert (decision["route"], decision["pool"]) == ("routes[0]", "search")
    assert decision["route_match"] == 'header {"x-team":"search*"}'
    code, out, _ = explain(capsys, "--json", "--policy", path, "-H", "x-team: ads", request)
    assert (json.loads(out)["route"], json.loads(out)["pool"]) == ("routes[1]", "main")


def test_a_malformed_header_is_refused_by_the_parser(capsys, tmp_path, tokenizer_dir) -> None:
    path = str(write_policy(tmp_path, basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])))
    with pytest.raises(SystemExit) as exc:
        explain(capsys, "--policy", path, "-H", "no colon here", chat(tmp_path))
    assert exc.value.code == 2
    assert "is not `Name: value`" in capsys.readouterr().err


def tenant_policy(tmp_path: Path, tokenizer_dir: Path) -> str:
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])
    policy["tenants"] = {
        "search-team": {
            "keys": [f"sha256:{hashlib.sha256(SECRET.encode()).hexdigest()}"],
            "tier": "standard",
            "tpm": 90000,
            "rpm": 60,
            "pools": {"main": {"tpm": 5000}},
        }
    }
    return str(write_policy(tmp_path, policy))


def test_the_tenant_and_its_quota_are_explained_never_the_key(
    capsys, tmp_path, tokenizer_dir
) -> None:
    path = tenant_policy(tmp_path, tokenizer_dir)
    request = chat(tmp_path, max_tokens=20)
    key = tmp_path / "key"
    key.write_text(f"{SECRET}\n")
    code, out, err = explain(
        capsys, "--json", "--policy", path, "--api-key-file", str(key), request
    )
    decision = json.loads(out)
    assert code == 0
    assert (decision["tenant"], decision["tier"], decision["priority"]) == (
        "search-team",
        "standard",
        "standard",
    )
    reserved = decision["reserved_tokens"]
    assert decision["quota"] == [
        f"tokens {reserved} of 90000/min",
        "requests 1 of 60/min",
        f"tokens {reserved} of 5000/min on pool main",
    ]
    code, human, err2 = explain(
        capsys, "--policy", path, "--api-key-file", str(key), "-H", "x-priority: sheddable", request
    )
    assert code == 0
    assert "tenant                  search-team" in human
    assert "priority                sheddable" in human  # lowered by the header, as served
    for shown in (out, err, human, err2):
        assert SECRET not in shown


def test_the_key_may_come_as_a_header_and_a_wrong_one_is_refused(
    capsys, tmp_path, tokenizer_dir
) -> None:
    path = tenant_policy(tmp_path, tokenizer_dir)
    request = chat(tmp_path)
    bearer = f"Authorization: Bearer {SECRET}"
    code, out, _ = explain(capsys, "--json", "--policy", path, "-H", bearer, request)
    assert (code, json.loads(out)["tenant"]) == (0, "search-team")
    wrong = tmp_path / "wrong-key"
    wrong.write_text("sk-wrong-key")
    code, out, err = explain(capsys, "--policy", path, "--api-key-file", str(wrong), request)
    assert (code, out) == (2, "")
    assert err == "refused: 401 invalid_api_key: Incorrect API key provided.\n"
    code, out, _ = explain(capsys, "--json", "--policy", path, request)
    assert code == 0  # where a request would go is worth seeing without its key
    decision = json.loads(out)
    assert decision["tenant"] is None
    assert decision["quota"] == "no key given: the gateway answers 401"


def test_the_key_comes_from_standard_input_never_from_the_command_line(
    capsys, monkeypatch, tmp_path, tokenizer_dir
) -> None:
    path = tenant_policy(tmp_path, tokenizer_dir)
    request = chat(tmp_path)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(f"{SECRET}\n".encode())))
    code, out, err = explain(capsys, "--json", "--policy", path, "--api-key-file", "-", request)
    assert (code, json.loads(out)["tenant"]) == (0, "search-team")
    assert SECRET not in out + err
    # Standard input cannot hold both; an empty key file is said, not sent as no key.
    code, out, err = explain(capsys, "--policy", path, "--api-key-file", "-", "-")
    assert (code, out) == (1, "")
    assert "standard input holds the request" in err
    (tmp_path / "empty").write_text("\n")
    code, _, err = explain(
        capsys, "--policy", path, "--api-key-file", str(tmp_path / "empty"), request
    )
    assert code == 1 and "no key in it" in err
    with pytest.raises(SystemExit):  # the old argv flag is gone, not silently ignored
        explain(capsys, "--policy", path, "--api-key", SECRET, request)


def estimate_twin(tmp_path: Path, tokenizer: str) -> str:
    """The same one-model policy, its tokenizer `tokenizer`, in a directory of its own."""
    directory = tmp_path / tokenizer.replace("/", "_")
    directory.mkdir()
    return str(write_policy(directory, basic_policy(tokenizer, ["http://127.0.0.1:1"])))


def test_a_missing_tokenizer_falls_back_to_the_estimate(capsys, tmp_path) -> None:
    absent = tmp_path / "no-such-tokenizer"
    path = estimate_twin(tmp_path, str(absent))
    request = chat(tmp_path, max_tokens=16)
    argv = ("--policy", path, "--tokenizer-fallback", "estimate", request)
    code, out, _ = explain(capsys, "--json", *argv)
    decision = json.loads(out)
    assert code == 0
    _, expected, _ = explain(
        capsys, "--json", "--policy", estimate_twin(tmp_path, "estimate"), request
    )
    assert decision["input_tokens"] == json.loads(expected)["input_tokens"]
    assert (decision["tokenizer"], decision["tokenizer_missing"]) == (str(absent), True)
    code, human, _ = explain(capsys, *argv)
    assert code == 0
    assert (
        f"input_tokens            {decision['input_tokens']} (estimated: tokenizer {absent} not found)"
        in human
    )


def test_the_fallback_serves_a_pool_scoring_by_precise_prefix(capsys, tmp_path) -> None:
    """That scorer refuses a model counted by estimate; explain picks no replica anyway."""
    absent = tmp_path / "no-such-tokenizer"
    pick = {"scorers": {"precise_prefix": 1, "queue": 1}}
    policy = basic_policy(str(absent), ["http://127.0.0.1:1"], pick=pick)
    path = str(write_policy(tmp_path, policy))
    code, out, err = explain(
        capsys, "--json", "--policy", path, "--tokenizer-fallback", "estimate", chat(tmp_path)
    )
    assert (code, err) == (0, "")
    assert json.loads(out)["pool"] == "main"


def test_a_missing_tokenizer_without_the_fallback_says_which_and_what_to_do(
    capsys, tmp_path
) -> None:
    absent = tmp_path / "no-such-tokenizer"
    code, out, err = explain(
        capsys, "--policy", estimate_twin(tmp_path, str(absent)), chat(tmp_path)
    )
    assert (code, out) == (1, "")
    assert f"tokenizer directory '{absent}' does not exist" in err
    assert "--tokenizer-fallback estimate" in err


def test_a_present_tokenizer_is_used_even_with_the_fallback(
    capsys, tmp_path, tokenizer_dir
) -> None:
    path = str(write_policy(tmp_path, basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])))
    request = chat(tmp_path)
    _, exact, _ = explain(capsys, "--json", "--policy", path, request)
    _, fallback, _ = explain(
        capsys, "--json", "--policy", path, "--tokenizer-fallback", "estimate", request
    )
    assert json.loads(exact) == json.loads(fallback)
    assert json.loads(exact)["tokenizer_missing"] is False


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        ("classify.json", ("prefill_heavy", "classify-27b", "sheddable")),
        ("generate.json", ("decode_heavy", "generate-12b", "sheddable")),
    ],
)
def test_the_documented_example_runs_on_the_shipped_policy(capsys, sample, expected) -> None:
    code, out, _ = explain(
        capsys,
        "--json",
        "--policy",
        str(ROOT / "policies/gemma3-tpu-v6e.yaml"),
        "--tokenizer-fallback",
        "estimate",
        "-H",
        "x-priority: sheddable",
        str(ROOT / "policies/requests" / sample),
    )
    decision = json.loads(out)
    assert code == 0
    assert (decision["class"], decision["pool"], decision["priority"]) == expected


def shipped(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """explain on the shipped fleet, which spills alias classification from 27B to 12B."""
    return explain(
        capsys, "--policy", str(ROOT / "policies/gemma3-tpu-v6e.yaml"),
        "--tokenizer-fallback", "estimate", *argv, str(ROOT / "policies/requests/classify.json"),
    )  # fmt: skip


def test_the_fallback_chain_is_shown_and_taken_only_at_the_load_that_takes_it(capsys) -> None:
    _, out, _ = shipped(capsys, "--json")
    idle = json.loads(out)
    assert (idle["pool"], idle["spilled_from"]) == ("classify-27b", None)
    assert idle["fallback"] == [
        "generate-12b (when classify-27b saturation >= 1; while under 0.8;"
        " tiers critical+standard): passed over: classify-27b is not full"
    ]
    _, out, _ = shipped(
        capsys, "--json", "--saturation", "classify-27b=1.2", "--saturation", "generate-12b=0.5"
    )
    full = json.loads(out)
    assert (full["pool"], full["spilled_from"], full["rewritten_model"]) == (
        "generate-12b", "classify-27b", "gemma-3-12b-it",
    )  # fmt: skip
    assert full["fallback"][0].endswith(": TAKES IT")
    _, out, _ = shipped(
        capsys, "--saturation", "classify-27b=1.2", "--saturation", "generate-12b=0.8"
    )
    assert "passed over: generate-12b is full too (saturation 0.8 >= 0.8)" in out
    _, out, _ = shipped(capsys, "--saturation", "classify-27b=2", "-H", "x-priority: sheddable")
    assert "passed over: not for tier sheddable" in out and "classify-27b" in out


def test_an_assumed_load_names_a_pool_of_the_policy(capsys) -> None:
    code, _, err = shipped(capsys, "--saturation", "classify-99b=1")
    assert code == 1 and "no pool classify-99b" in err
    with pytest.raises(SystemExit):
        shipped(capsys, "--predicted-wait", "classify-27b=soon")


def test_explain_counts_with_vllms_library_and_check_says_which_serve_uses(
    capsys, tmp_path, tokenizer_dir
) -> None:
    """Issue 36 item 7: `explain` counts one request, so it builds no fastokens (most of a start's
    time, with its self-check): the tokenizers library, vLLM's own, counts the same. Which library
    `serve` counts with, `check --load-tokenizers` says, as it builds them."""
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])
    counts = set()
    for backend in ("auto", "fastokens", "tokenizers"):
        policy["models"]["tiny"]["tokenizer_backend"] = backend
        path = str(write_policy(tmp_path, policy))
        code, out, _ = explain(capsys, "--json", "--policy", path, chat(tmp_path))
        decision = json.loads(out)
        assert (code, decision["counting_backend"]) == (0, "tokenizers")
        counts.add(decision["input_tokens"])
        code = gateway(["check", "--load-tokenizers", path])
        out = capsys.readouterr().out
        served = "tokenizers" if backend == "tokenizers" else "fastokens"
        assert code == 0 and out.endswith(f"counted by: tiny {served}\n"), out
    assert len(counts) == 1


def test_a_body_from_standard_input_without_messages_is_explained_as_chat(
    capsys, monkeypatch, tmp_path, tokenizer_dir
) -> None:
    """No `prompt` means a chat body, as the server's chat endpoint would answer it."""
    path = str(write_policy(tmp_path, basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'{"model": "tiny"}')))
    code, _, err = explain(capsys, "--policy", path, "-")
    assert code == 2
    assert "refused: 400 invalid_request: 'messages' must be a non-empty array" in err


def test_a_messages_request_is_explained_by_the_chat_it_converts_to(
    capsys, tmp_path, tokenizer_dir
) -> None:
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])
    policy["pools"]["agents"] = {**policy["pools"]["main"], "replicas": ["http://127.0.0.1:2"]}
    policy["routes"].insert(0, {"match": {"endpoint": "messages"}, "pool": "agents"})
    path = str(write_policy(tmp_path, policy))
    request = tmp_path / "messages.json"
    body = {"model": "tiny", "max_tokens": 20, "system": "Be brief.",
            "messages": [{"role": "user", "content": "Label this review."}]}  # fmt: skip
    request.write_text(json.dumps(body))
    code, out, _ = explain(
        capsys, "--json", "--policy", path, "--endpoint", "messages", "-H", "x-api-key: k",
        str(request),
    )  # fmt: skip
    decision = json.loads(out)
    assert code == 0 and decision["endpoint"] == "messages" and decision["pool"] == "agents"
    chat = {"model": "tiny", "max_tokens": 20, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Label this review."},
    ]}  # fmt: skip
    request.write_text(json.dumps(chat))
    _, out, _ = explain(capsys, "--json", "--policy", path, str(request))
    assert json.loads(out)["input_tokens"] == decision["input_tokens"]


def test_an_upload_is_explained_through_its_endpoints_own_decoder(
    capsys, tmp_path, tokenizer_dir
) -> None:
    """A multipart body is read as the server reads it (the endpoint's `decode`), given its
    `Content-Type` as curl gives it; without it, the endpoint's media type lacks the boundary."""
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:1"])
    policy["pools"]["speech"] = {**policy["pools"]["main"], "replicas": ["http://127.0.0.1:2"]}
    policy["routes"].insert(0, {"match": {"endpoint": "translations"}, "pool": "speech"})
    path = str(write_policy(tmp_path, policy))
    boundary = "x0x0"
    fields = {"model": "tiny-alias", "prompt": "Names: Ada Lovelace."}
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    )
    upload = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
    body += f"{upload}\r\nRIFF....\r\n--{boundary}--\r\n".encode()
    request = tmp_path / "upload.bin"
    request.write_bytes(body)
    header = f"Content-Type: multipart/form-data; boundary={boundary}"
    code, out, err = explain(
        capsys, "--json", "--policy", path, "--endpoint", "translations", "-H", header,
        str(request),
    )  # fmt: skip
    assert code == 0, err
    decision = json.loads(out)
    assert (decision["endpoint"], decision["pool"]) == ("translations", "speech")
    assert decision["rewritten_model"] == "tiny" and decision["input_tokens"] > 0
    code, _, err = explain(capsys, "--policy", path, "--endpoint", "translations", str(request))
    assert code == 2 and "400 invalid_multipart" in err and "no valid boundary" in err


def test_each_replicas_predicted_latency_is_explained_against_the_objective(
    capsys, tmp_path, tokenizer_dir
) -> None:
    busy, idle = "http://127.0.0.1:1", "http://127.0.0.1:2"
    policy = basic_policy(
        tokenizer_dir,
        [busy, idle],
        slo={"objectives": {"standard": {"ttft_ms": 400, "tpot_ms": 50}}},
    )
    path = str(write_policy(tmp_path, policy))
    load = f"{busy}=running:40,prefill:8000"
    code, out, _ = explain(
        capsys, "--json", "--policy", path, "-H", "x-priority: standard",
        "--replica-load", load, chat(tmp_path),
    )  # fmt: skip
    decision = json.loads(out)
    assert code == 0 and decision["objective"] == "TTFT 400 ms, TPOT 50 ms"
    on_busy, on_idle = decision["predicted"]
    assert on_busy.startswith(busy) and on_busy.endswith("misses)")
    assert on_idle.startswith(idle) and on_idle.endswith("meets)")
    # A header's objective is the request's; a pool without `slo` predicts nothing.
    code, out, _ = explain(
        capsys, "--policy", path, "-H", "x-priority: standard", "-H", "x-slo-ttft-ms: 900",
        chat(tmp_path),
    )  # fmt: skip
    assert "TTFT 900 ms, TPOT 50 ms" in out
    plain = str(write_policy(tmp_path, basic_policy(tokenizer_dir, [busy])))
    code, out, _ = explain(capsys, "--json", "--policy", plain, chat(tmp_path))
    assert (json.loads(out)["objective"], json.loads(out)["predicted"]) == (None, None)
    with pytest.raises(SystemExit):
        explain(capsys, "--policy", path, "--replica-load", "nonsense", chat(tmp_path))
    assert "URL=running:N" in capsys.readouterr().err
